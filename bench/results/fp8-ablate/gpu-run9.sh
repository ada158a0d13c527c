#!/usr/bin/env bash
# The next measurement (issues 35, 32; README "What next"): does the fp8
# GEMMs' load stream slow with fewer ring stages in flight? Variants from
# prod.patch through variant.sh (flags: producers, loads only, big A, and
# MOE_EP_FP8_TALL_STAGES, the 256-row tiles' stages for both GEMMs; the
# fused GEMM holds at most 3 beside its 64 KB of parked values):
#   p1       1 0 0        main's kernel, the control (fused 3, down 4 stages)
#   lo       1 1 0        loads only, main's stages
#   lo_s3    1 1 0, 3     loads only, 3 stages for both
#   lo_s2    1 1 0, 2     loads only, 2 stages
#   full_s3  1 0 0, 3     products, 3 stages for both
#   full_s2  1 0 0, 2     products, 2 stages
# Bundle: build/kernels/moe_ep_expert_bench and each variant's binary
# (bin/moe_ep_expert_bench_NAME).
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 300 bash bench/results/fp8-ablate/gpu-run9.sh g /tmp/r; tar -C /tmp/r -czf "$OUT/r.tgz" .
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
  timeout 40 "$2" --paths fp8 --warmup 10 --iters 100 $3 > "$out/fp8_$1.csv" 2> "$out/fp8_$1.log"
  mark "fp8_$1" $?
}
for shape in "t4096:--tokens 4096" "e16:--experts 16 --topk 1 --tokens 32768"; do
  s=${shape%%:*}; a=${shape#*:}
  for v in p1 lo lo_s3 lo_s2 full_s3 full_s2 p1_again; do
    fb "${v}_$s" "$bin/moe_ep_expert_bench_${v%_again}" "$a"
  done
done
{
  echo "fp8: name step_us gate_up_us down_us fp8_vs_bf16_max_rel"
  for f in "$out"/fp8_*.csv; do echo "$(basename "$f" .csv) $(tail -1 "$f" | cut -d, -f7,8,9,21)"; done
} > "$out/summary.txt"
cat "$out/rc.txt" "$out/summary.txt"
