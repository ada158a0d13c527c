#!/usr/bin/env bash
# Issue 34 item 4 after the Benchmark loop and engine checks moved to the core and the .cu
# tidy edits (rms_norm, nccl_peer_window): the whole GPU kernel test binary, the GPU tests of
# both GPU planes (Benchmark on nccl, one-sided over NCCL windows and one-sided IPC), the capability matrix, the embedded C API and Python engine on the
# GPU, the merged mxfp4 kernels' tests, and the main jobs (DeepSeek-V3 fp8 and gpt-oss-120b mxfp4 on NCCL),
# in one device call.
#   mkdir -p g && tar -C g -xJf gpu-call3/b.tar.xz && bash bench/results/plane-core/gpu-run3.sh g "$OUT"
set -u
g=$1
out=$2
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
timeout 240 "$bin/moe_ep_gpu_tests" > "$out/gpu_kernels.log" 2>&1
mark gpu_kernel_tests $?
timeout 240 "$bin/moe_ep_server_tests" --gtest_filter='Gpu*:CheckGpu*:DeviceTokensSent.*:StepCountStats.*:*OneSided*' > "$out/server_gpu.log" 2>&1
mark server_gpu_tests $?
timeout 300 "$bin/moe_ep_integration_tests" --gtest_filter='*GpuOneSided*:*CapabilityMatrix*' > "$out/integration_gpu.log" 2>&1
mark integration_gpu_tests $?
for args in "" "one-sided" "one-sided 2"; do
  # shellcheck disable=SC2086
  timeout 200 "$bin/moe_ep_gpu_embedded" "$bin/moe-ep" $args > "$out/embedded_${args// /_}.log" 2>&1
  mark "embedded[$args]" $?
done
(cd python/tests && MOE_EP_LIBRARY="$OLDPWD/$g/lib/libmoe_ep.so.0" MOE_EP_CLI="$OLDPWD/$bin/moe-ep" \
  PYTHONPATH="$OLDPWD/python" PYTHONDONTWRITEBYTECODE=1 timeout 200 python3 -m unittest -v test_engine_gpu) \
  > "$out/python_engine_gpu.log" 2>&1
mark python_engine_gpu $?
timeout 150 "$bin/moe-ep" run --model "$MOE_EP_DATA_DIR/models/DeepSeek-V3.json" --backend nccl --workers 1 \
  --worker-binary "$MOE_EP_WORKER_BINARY" --experts checkpoint --layers 1 --steps 2 --tokens 64 > "$out/main_deepseek_v3_fp8.log" 2>&1
mark main_deepseek_v3_fp8 $?
timeout 150 "$bin/moe-ep" run --model "$MOE_EP_DATA_DIR/models/gpt-oss-120b.json" --backend nccl --workers 1 \
  --worker-binary "$MOE_EP_WORKER_BINARY" --experts checkpoint --layers 2 --steps 2 --tokens 64 > "$out/main_gpt_oss_120b.log" 2>&1
mark main_gpt_oss_120b $?
cat "$out/rc.txt"
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|tests ran|^(OK|FAILED)|PASS|FAIL" "$out"/*.log | sort | uniq -c | head -40
