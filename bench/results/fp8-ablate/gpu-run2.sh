#!/usr/bin/env bash
# Issue 30: the NCCL communicator's teardown while the engine's captured
# graphs live (kernels/nccl_graph_refs.h): its GPU tests, then
# engine_call_host --plane nccl --ranks 1 with its graph section (hung in
# moe_ep_worker_stop in call 1), beside the one-sided plane at 1 and 2 ranks.
# Issue 35: the fp8 load pipeline alone (abl2), with 128-row TMA boxes
# (abl4), and with every box read from an L2-resident 11 MB (abl6), beside
# the committed kernel (base), at 4096 tokens (128 experts, top-8) and 32,768
# rows over 16 experts; --fp8-tile-compare (128- and 256-row tiles).
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 560 bash bench/results/fp8-ablate/gpu-run2.sh g /tmp/r; tar -C /tmp/r -czf "$OUT/r.tgz" .
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
timeout 120 "$bin/moe_ep_gpu_tests" --gtest_filter='NcclGraphRefs.*:NcclCollective.*' \
  > "$out/gpu_nccl_refs.log" 2>&1
mark gpu_nccl_refs $?
host() {  # name, plane, ranks
  PYTHONFAULTHANDLER=1 MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 90 python3 bench/engine_call_host.py \
    --moe-ep "$bin/moe-ep" --out "$out/host_$1" --plane "$2" --ranks "$3" --calls 1000 \
    --graph-replays 300 > "$out/host_$1.log" 2>&1
  mark "host_$1" $?
}
host nccl1 nccl 1
host onesided1 one-sided 1
host onesided2 one-sided 2
fb() {  # name, binary, shape args
  # shellcheck disable=SC2086
  timeout 60 "$2" --paths fp8 --fp8-tile-compare --warmup 10 --iters 100 --bound-tbps 3.35 $3 \
    > "$out/fp8_$1.csv" 2> "$out/fp8_$1.log"
  mark "fp8_$1" $?
}
for shape in "t4096:--tokens 4096" "e16:--experts 16 --topk 1 --tokens 32768"; do
  s=${shape%%:*}; a=${shape#*:}
  fb "base_$s" "$bin/moe_ep_expert_bench" "$a"
  fb "abl2_$s" "$bin/moe_ep_expert_bench_abl2" "$a"
  fb "abl4_$s" "$bin/moe_ep_expert_bench_abl4" "$a"
  fb "abl6_$s" "$bin/moe_ep_expert_bench_abl6" "$a"
  fb "base_again_$s" "$bin/moe_ep_expert_bench" "$a"
done
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|^(OK|FAILED)" "$out"/*.log | sort | uniq -c > "$out/summary.txt"
for f in "$out"/host_*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print([{k: v['p50'] for k, v in x.items() if isinstance(v, dict) and 'p50' in v} for x in d['per_rank']], d.get('python_over_c_us'))" "$f"; done >> "$out/summary.txt" 2>&1
echo "csv: name gu_step dn_step gu128 gu256 dn128 dn256 gu128c2 dn128c2 gu256c2 dn256c2" >> "$out/summary.txt"
for f in "$out"/fp8_*.csv; do echo "$(basename "$f") $(tail -1 "$f" | cut -d, -f8,9,23-30)"; done >> "$out/summary.txt"
cat "$out/rc.txt" "$out/summary.txt"
