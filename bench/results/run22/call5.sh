#!/bin/bash
# Call 5: one binary (moe_ep_mxfp4_bench_v, tests _v) of the variant knobs
# before the 16-row passes (defaults as 5421a7c; variants depth:min_ctas).
here=$(cd "$(dirname "$0")" && pwd)
source $here/env.sh
export NCCL_NVLS_ENABLE=0
B=$here/bin
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
V="0:0 3:0 4:0 5:0 6:0 3:4 4:4 5:4 6:4 3:5 4:5"
P="0:0/0:0 4:0/3:0 4:0/4:4 4:0/5:4 5:0/4:4 5:0/3:0 3:5/4:4 4:4/4:4 5:4/4:4 4:0/6:4"
for r in 1 2; do
  echo "== run $r"
  timeout 100 $B/moe_ep_mxfp4_bench_v --tokens 1 128 --bound-tbps 3.35 --prefetch 4 --variants $V --pairs $P; echo "rc $?"
done
timeout 150 $B/moe_ep_gpu_tests_v --gtest_filter='*Mxfp4*:DeviceExpertSet*' > $OUT/tests_v.txt 2>&1; echo tests rc $?
grep -E '^\[  (PASSED|FAILED) |FAILED|^\[       OK' $OUT/tests_v.txt | head -30
