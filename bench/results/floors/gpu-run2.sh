#!/usr/bin/env bash
# Stop 52's device call: the one-sided identity weight looked up one lane per
# choice (c6cd8cc, issue 32), the reduction loading two ranks' rows at once
# (3cf9794) and the push's 8 vectors a lane (5b6028f)
# against the floors and the NCCL anchor of the
# same call (floors, phases, floors again, as gpu-run.sh), the one-sided GPU
# tests that cover it and 598f77f, then the engine's Python-over-C host time
# after 3c4ce72 (issue 30), twice, its calls replayed in graphs at one
# rank against the bare kernels' EP 1 phases, and the GPU tests of the engine paths.
# From a bundle of the binaries below plus libmoe_ep.so.0 and the model configs:
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 420 bash bench/results/floors/gpu-run2.sh g /tmp/r; tar -C /tmp/r -czf "$OUT/r.tgz" .
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
timeout 60 "$bin/moe_ep_floor_bench" --replays 1000 > "$out/floor_bench.csv" 2> "$out/floor_bench.log"
mark floor_bench $?
# The kernels before (cfe3ec9), with the weight one lane per choice
# (c6cd8cc), with the paired reduction (3cf9794), each its own static bench
# binary, and with the push's 8 vectors a lane (5b6028f, this bundle's),
# then the first again: moe-ep, anchor, moe-ep again.
ob() {  # name, binary, extra flags
  timeout 120 "$2" --tokens 128 4096 --sm-budget 64 --path sm $3 \
    > "$out/onesided_$1.csv" 2> "$out/onesided_$1.log"
  mark "onesided_bench_$1" $?
}
ob cfe3ec9 "$bin/moe_ep_onesided_bench_cfe3ec9" ""
ob c6cd8cc "$bin/moe_ep_onesided_bench_c6cd8cc" --skip-nccl
ob paired "$bin/moe_ep_onesided_bench_3cf9794" --skip-nccl
ob push8 "$bin/moe_ep_onesided_bench" ""
ob cfe3ec9_again "$bin/moe_ep_onesided_bench_cfe3ec9" --skip-nccl
cp "$out/onesided_push8.csv" "$out/onesided_bench.csv"  # floor_table.py's input
timeout 60 "$bin/moe_ep_floor_bench" --replays 1000 > "$out/floor_bench_again.csv" 2> "$out/floor_bench_again.log"
mark floor_bench_again $?
timeout 150 "$bin/moe_ep_gpu_tests" \
  --gtest_filter='*OneSided*:EngineStreamOrder*:*Unpack*:*EngineRows*:DevicePointerCache.*' \
  > "$out/gpu_onesided.log" 2>&1
mark gpu_onesided $?
host() {  # round
  MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 60 python3 bench/engine_call_host.py \
    --moe-ep "$bin/moe-ep" --out "$out/host/r$1" --plane one-sided --ranks 2 --calls 1000 \
    --side-stream > "$out/host/r$1.log" 2>&1
  mark "host_r$1" $?
}
host 1
(cd python/tests && MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" MOE_EP_CLI="$OLDPWD/$bin/moe-ep" \
  PYTHONPATH="$OLDPWD/python" PYTHONDONTWRITEBYTECODE=1 timeout 100 python3 -m unittest -v test_engine_gpu) \
  > "$out/python_engine_gpu.log" 2>&1
mark python_engine_gpu $?
host 2
# Issue 30's graph target: the engine's calls captured in torch graphs at one
# rank, against the bare kernels' EP 1 phases of onesided_bench.csv above.
MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 60 python3 bench/engine_call_host.py \
  --moe-ep "$bin/moe-ep" --out "$out/host/graph1" --plane one-sided --ranks 1 --calls 300 \
  --graph-replays 1000 --side-stream > "$out/host/graph1.log" 2>&1
mark host_graph1 $?
timeout 90 "$bin/moe_ep_server_tests" --gtest_filter='Gpu*:CheckGpu*:*OneSided*:DeviceTokensSent.*' \
  > "$out/server_gpu.log" 2>&1
mark server_gpu $?
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|^(OK|FAILED)" "$out"/*.log | sort | uniq -c > "$out/summary.txt"
for f in "$out"/host/*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['p50_us_slower_rank'], d['python_over_c_us'])" "$f"; done >> "$out/summary.txt" 2>&1
tail -n +1 "$out"/onesided_*.csv >> "$out/summary.txt"
cat "$out/rc.txt" "$out/summary.txt"
