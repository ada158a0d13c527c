#!/usr/bin/env bash
# Issue 30 item 3, the short call (the session's last device minutes): the GPU
# tests of the one-sided engine-call changes (one-sided kernels, the
# one-sided server tests, the embedded C API at NCCL 1, one-sided 1 and 2
# processes, the Python engine on torch), then the host time of the engine
# calls at 2 ranks, new beside old (BUNDLE/old = 64751e3). One tarball.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && bash bench/results/engine-host/gpu-run3.sh g "$OUT"
set -u
g=$1
out=$2
r=$out/r
v=$r/verify
mkdir -p "$r/host" "$v"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0
bin=$g/bin
lib=$PWD/$g/lib
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" | tee -a "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$r/gpu.txt" 2>&1
for args in "" "one-sided" "one-sided 2"; do
  # shellcheck disable=SC2086
  timeout 40 "$bin/moe_ep_gpu_embedded" "$bin/moe-ep" $args > "$v/embedded_${args// /_}.log" 2>&1
  mark "embedded[$args]" $?
done
(cd python/tests && MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" MOE_EP_CLI="$OLDPWD/$bin/moe-ep" \
  PYTHONPATH="$OLDPWD/python" PYTHONDONTWRITEBYTECODE=1 timeout 60 python3 -m unittest -v test_engine_gpu) \
  > "$v/python_engine_gpu.log" 2>&1
mark python_engine_gpu $?
MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 40 python3 bench/engine_call_host.py \
  --moe-ep "$bin/moe-ep" --out "$r/host/new" --plane one-sided --ranks 2 --calls 1000 > "$r/host/new_2.log" 2>&1
mark host_new_2 $?
MOE_EP_LIBRARY="$PWD/$g/old/libmoe_ep.so.0" timeout 40 python3 "$g/old/tree/bench/engine_call_host.py" \
  --moe-ep "$bin/moe-ep" --out "$r/host/old" --plane one-sided --ranks 2 --calls 1000 > "$r/host/old_2.log" 2>&1
mark host_old_2 $?
timeout 60 "$bin/moe_ep_gpu_tests" --gtest_filter='OneSided*:DeviceCalls.*:DevicePointerCache.*' > "$v/gpu_kernels.log" 2>&1
mark gpu_kernel_tests $?
timeout 45 "$bin/moe_ep_server_tests" --gtest_filter='*OneSided*' > "$v/server_gpu.log" 2>&1
mark server_gpu_tests $?
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|^(OK|FAILED)|PASS: |FAIL" "$v"/*.log | sort | uniq -c > "$out/summary.txt"
for f in "$r"/host/*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['p50_us_slower_rank'], d['python_over_c_us'])" "$f"; done >> "$out/summary.txt" 2>&1
cat "$out/summary.txt"
tar -C "$out" -czf "$out/r.tar.gz" r && rm -rf "$r"
