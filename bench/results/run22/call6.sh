#!/bin/bash
here=$(cd "$(dirname "$0")" && pwd)
source $here/env.sh
export NCCL_NVLS_ENABLE=0
B=$here/bin
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for v in B A; do
  timeout 150 $B/tests_$v --gtest_filter='*Mxfp4*:DeviceExpertSet*' > $OUT/tests_$v.txt 2>&1; echo "tests_$v rc $?"
  grep -E '^\[  (PASSED|FAILED) |FAILED' $OUT/tests_$v.txt | head -10
done
T="--tokens 1 128 4096 --bound-tbps 3.35"
for r in 1 2; do
  for v in base A B; do
    echo "== $v run $r"
    if [ $v = base ]; then timeout 60 $B/bench_base $T --prefetch 4; else timeout 60 $B/bench_$v $T --prefetch 0; fi
    echo "rc $?"
  done
done
echo "== B variants"
timeout 120 $B/bench_B $T --prefetch 0 --variants 0:0 4:0:-1 4:0 3:0:-1 3:0 3:4 4:4 --pairs 4:0:-1/4:0:-1 4:0:-1/3:0:-1 4:0/3:0 4:0/3:4 4:0:-1/3:0
echo "rc $?"
