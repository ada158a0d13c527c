#!/usr/bin/env bash
# Issue 35: the fp8 GEMMs' TMA stream with no consumer at all (abl8,
# abl8.patch: the producer reuses a stage once its own load has landed; the
# consumer warpgroups never touch the ring), abl9 (abl9.patch: as abl8 with
# every box a 1-D bulk copy of 8 KB contiguous bytes: tiles laid out in
# memory as shared memory holds them), against the loads with the
# consumers' handshake (abl2) and the committed kernel (base), in one process
# order: base, abl2, abl8, abl2, base; 4096 tokens over 128 experts and
# 32,768 rows over 16 experts, --fp8-tile-compare.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 560 bash bench/results/fp8-ablate/gpu-run3.sh g /tmp/r; tar -C /tmp/r -czf "$OUT/r.tgz" .
set -u
g=$1
out=$2
mkdir -p "$out"
source "$g/env.sh"
bin=$g/bin
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
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
  fb "abl8_$s" "$bin/moe_ep_expert_bench_abl8" "$a"
  fb "abl9_$s" "$bin/moe_ep_expert_bench_abl9" "$a"
  fb "abl2_again_$s" "$bin/moe_ep_expert_bench_abl2" "$a"
  fb "base_again_$s" "$bin/moe_ep_expert_bench" "$a"
done
# Issue 32: the bf16 Hopper step with its consumers' products removed
# (babl2.patch: every consumer warpgroup only waits for each stage and frees
# it), beside the committed one.
for v in base babl2 base_again; do
  b="$bin/moe_ep_expert_bench"; [ "$v" = babl2 ] && b="$bin/moe_ep_expert_bench_babl2"
  timeout 60 "$b" --paths hopper --tokens 128 4096 --warmup 5 --iters 50 > "$out/bf16_$v.csv" 2> "$out/bf16_$v.log"
  mark "bf16_$v" $?
done
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw --format=csv >> "$out/gpu.txt" 2>&1
echo "csv: name gu_step dn_step gu128 gu256 dn128 dn256 gu128c2 dn128c2 gu256c2 dn256c2" > "$out/summary.txt"
for f in "$out"/fp8_*.csv; do echo "$(basename "$f") $(tail -1 "$f" | cut -d, -f8,9,23-30)"; done >> "$out/summary.txt"
tail -n +1 "$out"/bf16_*.csv >> "$out/summary.txt"
cat "$out/rc.txt" "$out/summary.txt"
# Issue 30 on the same machine (an H200 when one comes): the engine calls at
# 2 ranks as processes on the one-sided plane and 1 rank on NCCL (graph
# sections at one rank, budgets 16 and 64), beside the bare kernels.
if [ -x "$g/bin/moe-ep" ]; then
  export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
  lib=$PWD/$g/lib
  host() {  # name, plane, ranks, extra
    # shellcheck disable=SC2086
    MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 90 python3 bench/engine_call_host.py \
      --moe-ep "$bin/moe-ep" --out "$out/host_$1" --plane "$2" --ranks "$3" --calls 1000 $4 \
      > "$out/host_$1.log" 2>&1
    mark "host_$1" $?
  }
  host onesided2 one-sided 2 "--side-stream"
  host nccl1 nccl 1 "--graph-replays 1000"
  for b in 16 64; do
    timeout 40 "$bin/moe_ep_onesided_bench" --tokens 128 --sm-budget $b --path sm --skip-nccl \
      > "$out/onesided_sm$b.csv" 2> "$out/onesided_sm$b.log"
    mark "onesided_bench_sm$b" $?
    host "graph1_sm$b" one-sided 1 "--side-stream --graph-replays 1000 --onesided-sm-budget $b"
  done
  for f in "$out"/host_*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('onesided_sm_budget'), d.get('p50_us_slower_rank'), d.get('python_over_c_us'))" "$f"; done >> "$out/summary.txt" 2>&1
  tail -n +1 "$out"/onesided_sm*.csv >> "$out/summary.txt"
  cat "$out/rc.txt" "$out/summary.txt"
fi
