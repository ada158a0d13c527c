#!/usr/bin/env bash
# fp8 speed (issue 35 item 4): the fp8 tests of the new build, then the step at
# 1 / 128 / 4096 tokens with both tile heights' GEMMs alone: the base build,
# the torch anchor, the new build, the base again (same process order each call).
#   VARIANTS='name:--opt=v,--opt2=w ...' bash bench/results/fp8-speed/gpu-run.sh BUNDLE "$OUT" [extra bench args]
# (each variant: the new build again with those options, appended to variants.csv)
set -o pipefail
b=$1
out=$2
shift 2
source "$b/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$b/data"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$out/gpu.txt"
timeout 100 "$b/bin/moe_ep_gpu_tests" --gtest_filter='*Fp8*:GatherQuantize*:WeightedExpertSum*' > "$out/tests.log" 2>&1
echo "tests rc $?" >> "$out/tests.log"
grep -E "^\[  (PASSED|FAILED) |rc |FAILED|largest" "$out/tests.log" | head -30
args=(--paths fp8 --tokens 1 128 4096 --warmup 10 --iters 100 --bound-tbps 3.35 --fp8-tile-compare "$@")
run() {  # name binary
  timeout 60 "$2" "${args[@]}" > "$out/$1.csv" 2>> "$out/stderr.log"
  echo "$1 rc $?"; cut -d, -f1,7,8,9,12,14,18,23- "$out/$1.csv"
}
[ -x "$b/bin/moe_ep_expert_bench_base" ] && run base "$b/bin/moe_ep_expert_bench_base"
PYTHONUNBUFFERED=1 timeout 60 python3 "$b/expert_fp8_torch.py" 1 128 4096 > "$out/torch.jsonl" \
  2>> "$out/stderr.log"
cat "$out/torch.jsonl"
run new "$b/bin/moe_ep_expert_bench"
for v in $VARIANTS; do  # e.g. VARIANTS="pf0:--fp8-prefetch=0 pf24:--fp8-prefetch=24"
  IFS=, read -ra more <<< "${v#*:}"
  echo "variant ${v%%:*}: ${more[*]}" | tee -a "$out/variants.csv"
  timeout 60 "$b/bin/moe_ep_expert_bench" "${args[@]}" "${more[@]}" > "$out/v.csv" \
    2>> "$out/stderr.log"
  echo "rc $?"; cat "$out/v.csv" >> "$out/variants.csv"; cut -d, -f1,7,8,9,12,14,18,23- "$out/v.csv"
done
rm -f "$out/v.csv"
tail -3 "$out/stderr.log"
