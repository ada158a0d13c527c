#!/usr/bin/env bash
# Stop 52's second device call: the one-sided fused unpack in (slot, chunk)
# items (issue 30's graph target: the engine's dispatch graph against the
# bare kernels' EP 1 dispatch of the same call) and the revert of the push's
# 8 vectors a lane (22db405): the one-sided GPU tests, the Python GPU tests,
# moe_ep_onesided_bench beside NCCL, the engine's calls in torch graphs at one
# rank, its host time at two ranks, the server's GPU tests and the C API
# program.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 300 bash bench/results/floors/gpu-run3.sh g /tmp/r; tar -C /tmp/r -czf "$OUT/r.tgz" .
set -u
g=$1
out=$2
mkdir -p "$out/host"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
lib=$PWD/$g/lib
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
timeout 100 "$bin/moe_ep_gpu_tests" \
  --gtest_filter='*OneSided*:EngineStreamOrder*:*Unpack*:*EngineRows*:DevicePointerCache.*' \
  > "$out/gpu_onesided.log" 2>&1
mark gpu_onesided $?
(cd python/tests && MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" MOE_EP_CLI="$OLDPWD/$bin/moe-ep" \
  PYTHONPATH="$OLDPWD/python" PYTHONDONTWRITEBYTECODE=1 timeout 100 python3 -m unittest -v test_engine_gpu) \
  > "$out/python_engine_gpu.log" 2>&1
mark python_engine_gpu $?
timeout 60 "$bin/moe_ep_onesided_bench" --tokens 128 4096 --sm-budget 64 --path sm \
  > "$out/onesided_bench.csv" 2> "$out/onesided_bench.log"
mark onesided_bench $?
host() {  # name, ranks, extra flags
  MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 60 python3 bench/engine_call_host.py \
    --moe-ep "$bin/moe-ep" --out "$out/host/$1" --plane one-sided --ranks "$2" --side-stream $3 \
    > "$out/host/$1.log" 2>&1
  mark "host_$1" $?
}
host graph1 1 "--calls 300 --graph-replays 1000"
host r1 2 "--calls 1000"
timeout 90 "$bin/moe_ep_server_tests" --gtest_filter='Gpu*:CheckGpu*:*OneSided*:DeviceTokensSent.*' \
  > "$out/server_gpu.log" 2>&1
mark server_gpu $?
for pr in "one-sided 2" "nccl 1"; do
  set -- $pr
  timeout 60 "$bin/moe_ep_engine_embedded" "$bin/moe-ep" "$1" "$2" > "$out/engine_$1_$2.log" 2>&1
  mark "engine[$1 $2]" $?
done
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|^(OK|FAILED)|PASS: |FAIL" "$out"/*.log | grep -v "^\[20" | sort | uniq -c > "$out/summary.txt"
for f in "$out"/host/*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['p50_us_slower_rank'], d['python_over_c_us'])" "$f"; done >> "$out/summary.txt" 2>&1
cat "$out/onesided_bench.csv" >> "$out/summary.txt"
cat "$out/rc.txt" "$out/summary.txt"
