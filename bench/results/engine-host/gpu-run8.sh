#!/usr/bin/env bash
# Issue 30 item 1 on the GPU planes, after forward refusals (both planes)
# and the one-sided plane's refused combine (OsCombineParams::refused): the
# whole GPU kernel test binary (the one-sided combine kernel changed), both
# GPU planes' server tests, the C API program on every plane (step 4b's
# forward refusals, step 4c's refused combine), the capability matrix with
# its engine cells, the Python engine on torch.
# Results: $2/*.log, $2/rc.txt, $2/summary.txt.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && bash bench/results/engine-host/gpu-run8.sh g "$OUT/r"
set -u
g=$1
out=$2
mkdir -p "$out"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
export MOE_EP_ENGINE_EMBEDDED="$PWD/$g/bin/moe_ep_engine_embedded" MOE_EP_CLI="$PWD/$g/bin/moe-ep"
bin=$g/bin
lib=$PWD/$g/lib
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt" 2>&1
for args in "one-sided 4" "one-sided 2" "nccl 1" "one-sided 1" "gloo 4"; do
  # shellcheck disable=SC2086
  timeout 90 "$bin/moe_ep_engine_embedded" "$bin/moe-ep" $args > "$out/engine_${args// /_}.log" 2>&1
  mark "engine[$args]" $?
done
timeout 240 "$bin/moe_ep_gpu_tests" > "$out/gpu_kernels.log" 2>&1
mark gpu_kernel_tests $?
timeout 90 "$bin/moe_ep_server_tests" --gtest_filter='Gpu*:CheckGpu*:DeviceTokensSent.*:StepCountStats.*:*OneSided*' > "$out/server_gpu.log" 2>&1
mark server_gpu $?
timeout 200 "$bin/moe_ep_integration_tests" --gtest_filter='*CapabilityMatrix*' > "$out/matrix.log" 2>&1
mark matrix $?
(cd python/tests && MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" MOE_EP_CLI="$OLDPWD/$bin/moe-ep" \
  PYTHONPATH="$OLDPWD/python" PYTHONDONTWRITEBYTECODE=1 timeout 100 python3 -m unittest -v test_engine_gpu) \
  > "$out/python_engine_gpu.log" 2>&1
mark python_engine_gpu $?
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|^(OK|FAILED)|PASS: |FAIL" "$out"/*.log | grep -v "^\[20" | sort | uniq -c > "$out/summary.txt"
cat "$out/rc.txt" "$out/summary.txt"
