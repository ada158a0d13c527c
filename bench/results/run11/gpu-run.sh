#!/usr/bin/env bash
# Run 11 (issue 14, 4096-token follow-up): one device call on one H200 (kind nvidia-h200).
# usage (on the GPU machine): gpu-run.sh BUNDLE_DIR
#   BUNDLE_DIR: ../shared/tools/gpu-bundle output holding bin/moe_ep_gpu_tests,
#   bin/moe_ep_expert_bench (this branch), and the same bench linked with other versions of
#   kernels/hopper_grouped_gemm.cu: _run9 (run 9's) and any named in $AB_VARIANTS (the earlier
#   call of run 11 used AB_VARIANTS="run9 384 320x4 new run9 384 320x4 new": _384 = commit
#   49a23e7's 384-row tall tiles with a 3-deep ring, _320x4 = 320-row tiles, 4-deep ring),
#   bin/moe-ep, bin/moe-ep-worker; data/models/*.json, data/prefill_in4096.json; scripts/ with
#   bench/expert_bench.sh and bench/expert_gemm_torch.py. Logs: $OUT/logs, packed in run11.tgz.
set -uo pipefail
b=$(cd "$1" && pwd)
source "$b/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR=$b/data
o=${OUT:-/tmp/out}/logs
mkdir -p "$o"
pack() { tar czf "$o/../run11.tgz" -C "$o" .; }
nvidia-smi -L > "$o/gpu.txt"
nvidia-smi --query-gpu=driver_version,clocks.sm,clocks.mem --format=csv >> "$o/gpu.txt"
cuobjdump --dump-sass "$b/bin/moe_ep_expert_bench" 2>&1 |
  awk '/Function :/{f=$0} /LDL|STL/{if (f ~ /HopperGrouped/) print f " :: " $0}' | sort | uniq -c \
  > "$o/sass_spills.txt"
echo "spill lines in the Hopper kernels' SASS: $(wc -l < "$o/sass_spills.txt")"
timeout 60 "$b/bin/moe_ep_gpu_tests" --gtest_filter='HopperGroupedGemm*' > "$o/hopper_tests.log" 2>&1
rc=$?; tail -2 "$o/hopper_tests.log"; grep -E "FAILED|Failure" "$o/hopper_tests.log" | head
[ $rc -eq 0 ] || { echo "hopper tests rc $rc: stop"; pack; exit 1; }
timeout 150 "$b/bin/moe_ep_gpu_tests" > "$o/gpu_tests_1gpu.log" 2>&1; echo "all gpu tests rc $?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$o/gpu_tests_1gpu.log" | head -8
echo "A/B at 4096 tokens (hopper path, p50 of 20 graph replays, us)"
for v in ${AB_VARIANTS:-run9 new run9 new}; do
  bin=$b/bin/moe_ep_expert_bench; [ $v != new ] && bin=$b/bin/moe_ep_expert_bench_$v
  timeout 60 "$bin" --tokens 4096 --paths hopper --iters 20 > "$o/ab_$v.csv" 2>&1
  echo "$v $(tail -1 "$o/ab_$v.csv" | cut -d, -f8)" | tee -a "$o/ab.txt"
done
echo "full bench"
timeout 200 "$b/scripts/expert_bench.sh" "$b/bin/moe_ep_expert_bench" "$o" --iters 30 > "$o/bench.txt" 2>&1
cat "$o/bench.txt"
for t in 128 4096; do
  timeout 60 ncu --clock-control none -k regex:HopperGrouped -c 2 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section LaunchStats \
    "$b/bin/moe_ep_expert_bench" --tokens $t --paths hopper --iters 1 --warmup 0 > "$o/ncu_$t.txt" 2>&1
  grep -E "HopperGrouped|Duration|DRAM Through|L2 Hit|Compute \(SM\)|Memory Through" "$o/ncu_$t.txt"
done
pack
echo "main job"
timeout 260 "$b/bin/moe-ep" run --model "$b/data/models/DeepSeek-V3.json" --experts swiglu \
  --backend nccl --workers 1 --worker-binary "$b/bin/moe-ep-worker" \
  --routing "load:$b/data/prefill_in4096.json" --tokens 4096 --even-tokens --layers 3 --steps 1 \
  > "$o/main_job_deepseek_v3_1gpu.txt" 2>&1
echo "main job rc $?" >> "$o/main_job_deepseek_v3_1gpu.txt"
cat "$o/main_job_deepseek_v3_1gpu.txt"
pack
