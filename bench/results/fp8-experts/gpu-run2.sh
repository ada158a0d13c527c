#!/usr/bin/env bash
# Issue 35, call 2: the many-tiles cases one process each (a stuck ring wait
# now traps after 4 s with its CTA, role, stage and tile), the fp8 config
# shapes at real size, then the 4096-token step with 128-row tiles beside the
# torch anchor (moe-ep, anchor, moe-ep again), then 256-row tiles.
#   bash bench/results/fp8-experts/gpu-run2.sh gpu-fp8 "$OUT"
set -o pipefail
bundle=$1
out=$2
source "$bundle/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$bundle/data"
bin=$bundle/bin
for t in ManyTilesFused ManyTilesPlain ManyTallTilesFused ManyTallTilesPlain; do
  timeout 30 "$bin/moe_ep_gpu_tests" --gtest_filter="Fp8GroupedGemm.${t}RepeatBitForBit" \
    >> "$out/tests.log" 2>&1
  echo "$t rc $?" >> "$out/tests.log"
done
timeout 60 "$bin/moe_ep_gpu_tests" --gtest_filter='Fp8GroupedGemm.EveryFp8ModelConfigShape' \
  >> "$out/tests.log" 2>&1
echo "shapes rc $?" >> "$out/tests.log"
args=(--paths fp8 --tokens 4096 --warmup 20 --iters 300)
timeout 60 "$bin/moe_ep_expert_bench" "${args[@]}" --fp8-tile-rows 128 > "$out/moe_ep_1.csv" \
  2> "$out/stderr.log"
PYTHONUNBUFFERED=1 timeout 60 python3 "$bundle/expert_fp8_torch.py" 4096 > "$out/torch.jsonl" \
  2>> "$out/stderr.log"
timeout 60 "$bin/moe_ep_expert_bench" "${args[@]}" --fp8-tile-rows 128 > "$out/moe_ep_2.csv" \
  2>> "$out/stderr.log"
if grep -q "ManyTallTilesPlain rc 0" "$out/tests.log"; then
  timeout 60 "$bin/moe_ep_expert_bench" "${args[@]}" --fp8-tile-rows 256 > "$out/moe_ep_3.csv" \
    2>> "$out/stderr.log"
fi
grep -E "^\[  (PASSED|FAILED) |rc |Fp8GroupedGemmKernel:|largest" "$out/tests.log"
cat "$out/moe_ep_1.csv" "$out/torch.jsonl" "$out/moe_ep_2.csv" "$out/moe_ep_3.csv" 2> /dev/null
tail -4 "$out/stderr.log"
