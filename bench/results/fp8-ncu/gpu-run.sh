#!/usr/bin/env bash
# Issue 35 item 4 / issue 32: where the 4096-token expert GEMMs spend their
# time, read from the hardware counters (Nsight Compute, clocks left alone):
# the fp8 gate/up + down kernels (256-row tiles, the step's choice at 4096)
# and the bf16 Hopper kernels at the same shape (DeepSeek-V3 experts, 128
# experts, H 7168, I 2048, top-8), 2 launches each; then the timed step of
# both paths beside the torch fp8 anchor. Writes $OUT/r/ncu_*.txt, bench_*.csv.
#   bash bench/results/fp8-ncu/gpu-run.sh BUNDLE "$OUT"
set -u
g=$1
r=$2/r
mkdir -p "$r"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
  --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats
  --section LaunchStats --section Occupancy)
metrics=sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum,lts__t_sector_hit_rate.pct,lts__t_bytes.sum.per_second,dram__bytes_read.sum.per_second,l1tex__m_xbar2l1tex_read_bytes.sum.per_second,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct
prof() {  # name kernel-regex bench-args...
  local name=$1 kre=$2
  shift 2
  timeout 200 "$ncu" --clock-control none -k "regex:$kre" --launch-skip 2 --launch-count 2 \
    "${sections[@]}" --metrics "$metrics" "$g/bin/moe_ep_expert_bench" --tokens 4096 \
    --warmup 2 --iters 2 "$@" > "$r/ncu_$name.txt" 2>&1
  echo "ncu $name rc $?"
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$r/gpu.txt"
echo "ncu: $ncu"
prof fp8 Fp8GroupedGemm --paths fp8
prof bf16 HopperGroupedGemm --paths hopper
args=(--tokens 1 128 4096 --warmup 10 --iters 300 --bound-tbps 3.35)
timeout 90 "$g/bin/moe_ep_expert_bench" --paths fp8 "${args[@]}" --fp8-tile-compare > "$r/bench_fp8.csv" 2>> "$r/stderr.log"
echo "bench fp8 rc $?"
PYTHONUNBUFFERED=1 timeout 60 python3 "$g/expert_fp8_torch.py" 1 128 4096 > "$r/torch_fp8.jsonl" 2>> "$r/stderr.log"
echo "torch fp8 rc $?"
timeout 90 "$g/bin/moe_ep_expert_bench" --paths hopper "${args[@]}" > "$r/bench_bf16.csv" 2>> "$r/stderr.log"
echo "bench bf16 rc $?"
grep -E "Kernel|gmma|Duration|Throughput|Hit Rate|Registers|Stall|Warp Cycles|Issue|Eligible" "$r"/ncu_*.txt | head -80
