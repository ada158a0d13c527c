#!/bin/bash
here=$(cd "$(dirname "$0")" && pwd)
source $here/env.sh
export NCCL_NVLS_ENABLE=0
B=$here/bin
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 $B/moe_ep_gpu_tests_B --gtest_filter='*Mxfp4*:DeviceExpertSet*' > $OUT/tests_B.txt 2>&1; echo tests_B rc $?
grep -E '^\[  (PASSED|FAILED) |FAILED|largest|^\[ RUN' $OUT/tests_B.txt | grep -v RUN | head -20
b() { echo "== $1"; shift; timeout 90 "$@"; echo "rc $?"; }
b base $B/moe_ep_mxfp4_bench_base --tokens 1 128 4096 --bound-tbps 3.35 --prefetch 3
b A $B/moe_ep_mxfp4_bench_A --tokens 1 128 4096 --bound-tbps 3.35 --prefetch 4 --ring-x 1
b B $B/moe_ep_mxfp4_bench_B --tokens 1 128 4096 --bound-tbps 3.35 --prefetch 3 4 6 --ring-x 2 1
b base $B/moe_ep_mxfp4_bench_base --tokens 1 128 4096 --bound-tbps 3.35 --prefetch 3
b A $B/moe_ep_mxfp4_bench_A --tokens 1 128 4096 --bound-tbps 3.35 --prefetch 4 --ring-x 1
b B $B/moe_ep_mxfp4_bench_B --tokens 1 128 4096 --bound-tbps 3.35 --prefetch 6 --ring-x 2
timeout 100 ncu --clock-control none -k regex:Mxfp4Grouped --launch-count 2 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
  --section MemoryWorkloadAnalysis --section LaunchStats --section SourceCounters \
  --metrics smsp__inst_executed.sum,smsp__inst_executed_pipe_alu.sum \
  --export $OUT/B $B/moe_ep_mxfp4_bench_B --tokens 128 --iters 1 --warmup 0 --prefetch 6 > $OUT/ncu_B.txt 2>&1; echo ncu rc $?
ncu --import $OUT/B.ncu-rep --page source --print-source sass --csv > $OUT/ncu_B_source.csv 2>&1; xz -9 $OUT/ncu_B_source.csv
ncu --import $OUT/B.ncu-rep --print-summary none > $OUT/ncu_B_details.txt 2>&1; rm -f $OUT/B.ncu-rep
grep -E 'Mxfp4GroupedKernel|Duration|Registers Per|Achieved Active Warps|Issue Slots Busy|DRAM Throughput|inst_executed|Dynamic Shared' $OUT/ncu_B_details.txt
