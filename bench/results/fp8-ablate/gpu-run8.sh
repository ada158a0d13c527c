#!/usr/bin/env bash
# Issue 30 item 3 on an H200 (the card the issue names; no call of stops
# 52-54 got one): the engine calls at 2 ranks as processes, the graph
# sections at one rank (inside one graph, as the bare kernels are timed),
# the bare one-sided kernels at budgets 16 and 64, in one call.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 150 bash bench/results/fp8-ablate/gpu-run8.sh g /tmp/r; tar -C /tmp/r -czf "$OUT/r.tgz" .
set -u
g=$1
out=$2
mkdir -p "$out"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
lib=$PWD/$g/lib
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
host() {  # name, plane, ranks, extra
  # shellcheck disable=SC2086
  MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 40 python3 bench/engine_call_host.py \
    --moe-ep "$bin/moe-ep" --out "$out/host_$1" --plane "$2" --ranks "$3" --calls 1000 $4 \
    > "$out/host_$1.log" 2>&1
  mark "host_$1" $?
}
host onesided2 one-sided 2 "--side-stream"
for b in 16 64; do
  timeout 30 "$bin/moe_ep_onesided_bench" --tokens 128 --sm-budget $b --path sm --skip-nccl \
    > "$out/onesided_sm$b.csv" 2> "$out/onesided_sm$b.log"
  mark "onesided_bench_sm$b" $?
  host "graph1_sm$b" one-sided 1 "--side-stream --graph-replays 1000 --onesided-sm-budget $b"
done
{
  for f in "$out"/host_*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('onesided_sm_budget'), d.get('p50_us_slower_rank'), d.get('python_over_c_us'))" "$f"; done 2>&1
  tail -n +1 "$out"/onesided_sm*.csv
} > "$out/summary.txt"
cat "$out/gpu.txt" "$out/rc.txt" "$out/summary.txt"
