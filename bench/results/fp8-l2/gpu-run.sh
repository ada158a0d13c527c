#!/usr/bin/env bash
# Issue 35 item 4: the fp8 GEMMs' L2 policies (--fp8-l2-hint 1..3) and the
# 2-CTA clusters sharing B over m-tile pairs (--fp8-cluster 3) against the
# default, at DeepSeek-V3's expert shape (128 experts, H 7168, I 2048,
# top-8), 128 and 4096 tokens, beside the torch anchor, in one call: the
# new modes' tests first (their own process: a trapped kernel would poison
# the rest), the default's tests, then default / anchor / variants / default
# again, then DRAM bytes per GEMM at 4096 under ncu for default, hint 2 and
# cluster 3. Writes $2/*.csv, *.log, ncu_*.txt.
#   bash bench/results/fp8-l2/gpu-run.sh BUNDLE OUT
set -u
g=$1
out=$2
mkdir -p "$out"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data"
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" | tee -a "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$out/gpu.txt"
timeout 150 "$g/bin/moe_ep_gpu_tests" --gtest_filter='*L2Hints*:*BSharing*' > "$out/tests_new_modes.log" 2>&1
mark tests_new_modes $?
timeout 150 "$g/bin/moe_ep_gpu_tests" \
  --gtest_filter='Fp8GroupedGemm.*:ExpertComputeFp8.*:GatherQuantize*:WeightedExpertSum*:-*L2Hints*:*BSharing*' \
  > "$out/tests_default.log" 2>&1
mark tests_default $?
args=(--paths fp8 --tokens 128 4096 --warmup 10 --iters 100 --bound-tbps 3.35)
bench() {  # name extra-args...
  local name=$1
  shift
  timeout 60 "$g/bin/moe_ep_expert_bench" "${args[@]}" "$@" > "$out/bench_$name.csv" 2>> "$out/stderr.log"
  mark "bench_$name" $?
}
bench default
PYTHONUNBUFFERED=1 timeout 60 python3 "$g/expert_fp8_torch.py" 128 4096 > "$out/torch.jsonl" 2>> "$out/stderr.log"
mark torch $?
bench h1 --fp8-l2-hint=1
bench h2 --fp8-l2-hint=2
bench h3 --fp8-l2-hint=3
bench cl3 --fp8-cluster=3
bench cl3h1 --fp8-cluster=3 --fp8-l2-hint=1
bench cl3t128 --fp8-cluster=3 --fp8-tile-rows=128
bench default_again
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
for v in "default:" "h2:--fp8-l2-hint=2" "cl3:--fp8-cluster=3"; do
  name=${v%%:*}
  # shellcheck disable=SC2086
  timeout 90 "$ncu" --clock-control none -k regex:Fp8GroupedGemm --launch-skip 2 --launch-count 2 \
    --metrics dram__bytes_read.sum,gpu__time_duration.sum,lts__t_sector_hit_rate.pct,lts__t_bytes.sum \
    "$g/bin/moe_ep_expert_bench" --paths fp8 --tokens 4096 --warmup 2 --iters 2 ${v#*:} \
    > "$out/ncu_$name.txt" 2>&1
  mark "ncu_$name" $?
done
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED" "$out"/tests_*.log
for f in "$out"/bench_*.csv; do echo "$(basename "$f")"; cut -d, -f1,7,8,9,12,18 "$f"; done
cat "$out/torch.jsonl"
grep -h -E "Fp8GroupedGemmKernel|dram__bytes|gpu__time|hit_rate" "$out"/ncu_*.txt | sed 's/(CUtensorMap.*//' 
