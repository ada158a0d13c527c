#!/usr/bin/env bash
# Stop 52's third device call: issue 30's graph target at equal SM budgets.
# The bare kernels (moe_ep_onesided_bench, 128 tokens) at 16 blocks, the
# workers' default, and at 64; the engine's calls in torch graphs at one
# rank with --onesided-sm-budget 16 and 64 (b900aa7); the dispatcher's
# budget bound (OneSidedThreads.SmBudgetBoundByTheMultiprocessors).
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 200 bash bench/results/floors/gpu-run4.sh g /tmp/r; tar -C /tmp/r -czf "$OUT/r.tgz" .
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
timeout 60 "$bin/moe_ep_gpu_tests" --gtest_filter='OneSidedThreads.SmBudget*:OneSidedThreads.Ep2UnevenTokensFused' \
  > "$out/gpu_budget.log" 2>&1
mark gpu_budget $?
for b in 16 64; do
  timeout 40 "$bin/moe_ep_onesided_bench" --tokens 128 --sm-budget $b --path sm --skip-nccl \
    > "$out/onesided_sm$b.csv" 2> "$out/onesided_sm$b.log"
  mark "onesided_bench_sm$b" $?
  MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 40 python3 bench/engine_call_host.py \
    --moe-ep "$bin/moe-ep" --out "$out/host/graph1_sm$b" --plane one-sided --ranks 1 --side-stream \
    --calls 300 --graph-replays 1000 --onesided-sm-budget $b > "$out/host/graph1_sm$b.log" 2>&1
  mark "host_graph1_sm$b" $?
done
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED" "$out"/*.log | sort | uniq -c > "$out/summary.txt"
for f in "$out"/host/*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['onesided_sm_budget'], d['p50_us_slower_rank'])" "$f"; done >> "$out/summary.txt" 2>&1
tail -n +1 "$out"/onesided_sm*.csv >> "$out/summary.txt"
cat "$out/rc.txt" "$out/summary.txt"
