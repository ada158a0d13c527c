#!/usr/bin/env bash
# Issue 35 items 3-4 on one H200, one device call: the fp8 GPU tests, then the
# fp8 expert bench beside the torch._scaled_grouped_mm anchor (moe-ep, anchor,
# moe-ep again). Run from the repository root on the GPU machine with the
# bundle made by bench/results/fp8-experts/README.md's commands:
#   bash bench/results/fp8-experts/gpu-run.sh gpu-fp8 "$OUT"
# Writes into OUT: gpu.txt, tests.log, moe_ep_1.csv, torch.jsonl,
# moe_ep_2.csv, stderr.log (the programs' progress and errors), memcheck.log.
set -o pipefail
bundle=$1
out=$2
source "$bundle/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$bundle/data"
bin=$bundle/bin
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total \
  --format=csv > "$out/gpu.txt" 2>&1
# The fp8 kernels' tensor instructions (QGMMA = fp8 wgmma) in the bench binary.
echo "QGMMA in moe_ep_expert_bench: $(cuobjdump --dump-sass "$bin/moe_ep_expert_bench" 2>&1 |
  grep -c QGMMA)" >> "$out/gpu.txt"
filter='Fp8GroupedGemm.*:GatherQuantizeExpertRows.*:QuantizeFp8BlockMatrices.*'
filter+=':WeightedExpertSumBf16.*:ExpertComputeFp8.*'
# A hang shows here first (then nothing else runs).
timeout 40 "$bin/moe_ep_gpu_tests" --gtest_filter='Fp8GroupedGemm.PlainExact*' > "$out/tests.log" 2>&1
rc=$?
echo "smoke rc $rc" >> "$out/tests.log"
[ $rc -eq 124 ] && { cat "$out/tests.log"; exit 1; }
timeout 200 "$bin/moe_ep_gpu_tests" --gtest_filter="$filter" >> "$out/tests.log" 2>&1
echo "tests rc $?" >> "$out/tests.log"
args=(--paths fp8 --tokens 1 128 4096 --warmup 20 --iters 300 --fp8-tile-compare)
timeout 100 "$bin/moe_ep_expert_bench" "${args[@]}" > "$out/moe_ep_1.csv" 2> "$out/stderr.log"
PYTHONUNBUFFERED=1 timeout 120 python3 "$bundle/expert_fp8_torch.py" > "$out/torch.jsonl" \
  2>> "$out/stderr.log"
timeout 100 "$bin/moe_ep_expert_bench" "${args[@]}" > "$out/moe_ep_2.csv" 2>> "$out/stderr.log"
# Out-of-bounds and race checks of the small cases (memcheck), bounded in time.
small='Fp8GroupedGemm.PlainExact*:Fp8GroupedGemm.TallTilesFusedExact*'
small+=':GatherQuantizeExpertRows.*:ExpertComputeFp8.Small*'
timeout 90 compute-sanitizer --tool memcheck "$bin/moe_ep_gpu_tests" --gtest_filter="$small" \
  > "$out/memcheck.log" 2>&1
echo "memcheck rc $?" >> "$out/memcheck.log"
cat "$out/moe_ep_1.csv" "$out/torch.jsonl" "$out/moe_ep_2.csv"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |rc " "$out/tests.log"
tail -3 "$out/memcheck.log"
