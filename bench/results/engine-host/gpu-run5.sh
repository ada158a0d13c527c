#!/usr/bin/env bash
# The short form of gpu-run4.sh, for a call with little device time left:
# the one-sided engine calls' host time at 2 and 1 ranks, then the GPU
# tests of the engine-stream order and the refused dispatch, the embedded
# C API x3 and the Python engine on torch. Results in $OUT/r.tar.gz.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && bash bench/results/engine-host/gpu-run5.sh g "$OUT"
set -u
g=$1
out=$2
r=$out/r
mkdir -p "$r/host" "$r/verify"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
lib=$PWD/$g/lib
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" | tee -a "$out/rc.txt"; }
v=$r/verify
timeout 90 "$bin/moe_ep_gpu_tests" \
  --gtest_filter='EngineStreamOrder*:*RefusedStep*:OneSidedThreads.Ep2*:OneSidedWorld1.*' \
  > "$v/gpu_kernels.log" 2>&1
mark gpu_kernel_tests $?
for args in "" "one-sided" "one-sided 2"; do
  # shellcheck disable=SC2086
  timeout 40 "$bin/moe_ep_gpu_embedded" "$bin/moe-ep" $args > "$v/embedded_${args// /_}.log" 2>&1
  mark "embedded[$args]" $?
done
for ranks in 2 1; do
  MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 45 python3 bench/engine_call_host.py \
    --moe-ep "$bin/moe-ep" --out "$r/host/a" --plane one-sided --ranks $ranks --calls 1000 \
    > "$r/host/one-sided_$ranks.log" 2>&1
  mark "host_one-sided_$ranks" $?
done
(cd python/tests && MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" MOE_EP_CLI="$OLDPWD/$bin/moe-ep" \
  PYTHONPATH="$OLDPWD/python" PYTHONDONTWRITEBYTECODE=1 timeout 60 python3 -m unittest -v test_engine_gpu) \
  > "$v/python_gpu.log" 2>&1
mark python_gpu $?
timeout 60 "$bin/moe_ep_server_tests" --gtest_filter='*OneSided*' > "$v/server_gpu.log" 2>&1
mark server_gpu_tests $?
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|^(OK|FAILED)|PASS: |FAIL" "$v"/*.log | sort | uniq -c > "$out/summary.txt"
for f in "$r"/host/*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['p50_us_slower_rank'], d['python_over_c_us'])" "$f"; done >> "$out/summary.txt" 2>&1
cat "$out/summary.txt"
tar -C "$out" -czf "$out/r.tar.gz" r && rm -rf "$r"
