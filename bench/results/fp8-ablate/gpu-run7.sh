#!/usr/bin/env bash
# Stop 54's second call: the ablations again, built so that the variant is
# really in the binary (stop 53's were not: ninja rebuilt the object from the
# repository's source, so every "variant" ran the committed kernel; see the
# README). prod.patch builds each from kernels/fp8_grouped_gemm.cu:
#   p1   MOE_EP_FP8_PRODUCERS=1: main's kernel before this call (one producer)
#   new  the bundle's own build: 4 producer threads in every form (this
#        stop's change to kernels/fp8_grouped_gemm.cu), after its GPU tests
#   p2   2 producer threads (warps 0, 1), box j by producer j % 2
#   p4   4 producer threads
#   lo   MOE_EP_FP8_LOADS_ONLY=1: no products, no promotion (1 producer)
#   lo4  loads only, 4 producers
#   bb1  MOE_EP_FP8_BIG_A=1: A as one TMA box of the whole tile (32 KB at
#        256 rows), 1 producer
#   bb2  big A box from producer 0, B from producer 1
# and the bf16 Hopper step (issue 32) with its products removed (babl2.patch,
# hb), and with 4 producer threads in its tall kernel (bf16-prod.patch: hp4;
# hp1 the same source at 1, main's kernel: the control).
# One process order per shape.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 360 bash bench/results/fp8-ablate/gpu-run7.sh g /tmp/r; tar -C /tmp/r -czf "$OUT/r.tgz" .
set -u
g=$1
out=$2
mkdir -p "$out"
source "$g/env.sh"
bin=$g/bin
export MOE_EP_DATA_DIR="$PWD/$g/data"
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
fb() {  # name, binary, shape args
  # shellcheck disable=SC2086
  timeout 40 "$2" --paths fp8 --warmup 10 --iters 100 $3 > "$out/fp8_$1.csv" 2> "$out/fp8_$1.log"
  mark "fp8_$1" $?
}
# The kernel as built here (main's working tree: 4 producer threads in
# every form, clusters included) on the GPU tests of the fp8 GEMMs first.
timeout 120 "$bin/moe_ep_gpu_tests" --gtest_filter='Fp8GroupedGemm.*:ExpertComputeFp8.*' \
  > "$out/fp8_tests.log" 2>&1
mark fp8_tests $?
a="--tokens 4096"
for v in p1 new p2 p4 lo lo4 bb1 bb2 p1_again new_again; do
  b="$bin/moe_ep_expert_bench_${v%_again}"; [ "${v%_again}" = new ] && b="$bin/moe_ep_expert_bench"
  fb "${v}_t4096" "$b" "$a"
done
a="--experts 16 --topk 1 --tokens 32768"
for v in p1 new p4 lo4 p1_again; do
  b="$bin/moe_ep_expert_bench_${v%_again}"; [ "${v%_again}" = new ] && b="$bin/moe_ep_expert_bench"
  fb "${v}_e16" "$b" "$a"
done
# The new kernel at 128 / 4096 tokens with its tile comparison (clusters).
timeout 40 "$bin/moe_ep_expert_bench" --paths fp8 --fp8-tile-compare --tokens 128 4096 \
  --warmup 10 --iters 100 --bound-tbps 3.35 > "$out/fp8_new_tiles.csv" 2> "$out/fp8_new_tiles.log"
mark fp8_new_tiles $?
for v in hp1 hp4 hb hp1_again; do
  b="$bin/moe_ep_expert_bench_${v%_again}"
  timeout 40 "$b" --paths hopper cublas --tokens 128 4096 --warmup 5 --iters 50 \
    > "$out/bf16_$v.csv" 2> "$out/bf16_$v.log"
  mark "bf16_$v" $?
done
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw --format=csv >> "$out/gpu.txt" 2>&1
{
  echo "fp8: name step_us gate_up_us down_us fp8_vs_bf16_max_rel"
  for f in "$out"/fp8_*.csv; do echo "$(basename "$f" .csv) $(tail -1 "$f" | cut -d, -f7,8,9,21)"; done
  grep -h -E "^\[  (PASSED|FAILED)" "$out/fp8_tests.log"
  tail -3 "$out/fp8_new_tiles.csv" | cut -d, -f1,7,8,9,12,18,21,23-30
  for f in "$out"/bf16_*.csv; do echo "$(basename "$f" .csv)"; tail -2 "$f" | cut -d, -f1,8,10,15; done
} > "$out/summary.txt"
cat "$out/rc.txt" "$out/summary.txt"
