#!/usr/bin/env bash
# The one-GPU call of issue 32 items 1 and 2, from the bundle of
# moe_ep_floor_bench, moe_ep_onesided_bench and moe_ep_server_tests that
# bench/results/floors/README.md makes; on a GPU machine, once unpacked:
# `source gpu-floors/env.sh && bench/results/floors/gpu-run.sh OUT`.
# Floors, then the phases (one-sided beside the NCCL anchor, one process),
# then the floors again (moe-ep, anchor, moe-ep again in one call: drift
# between the two floor runs bounds how far the ratios can be trusted);
# last the GPU server tests that cover Benchmark's device counts.
set -u
out=${1:?usage: gpu-run.sh OUT_DIR}
bin=${BIN:-gpu-floors/bin}
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
log="$out/stderr.log"
timeout ${FLOOR_TIMEOUT:-120} "$bin/moe_ep_floor_bench" --replays 1000 > "$out/floor_bench.csv" 2>> "$log"
echo "moe_ep_floor_bench rc $?" >> "$log"
timeout ${BENCH_TIMEOUT:-300} "$bin/moe_ep_onesided_bench" --tokens 128 4096 --sm-budget 64 --path sm \
  > "$out/onesided_bench.csv" 2>> "$log"
echo "moe_ep_onesided_bench rc $?" >> "$log"
timeout ${FLOOR_TIMEOUT:-120} "$bin/moe_ep_floor_bench" --replays 1000 > "$out/floor_bench_again.csv" 2>> "$log"
echo "moe_ep_floor_bench (again) rc $?" >> "$log"
timeout ${TEST_TIMEOUT:-240} "$bin/moe_ep_server_tests" --gtest_filter='Gpu*:DeviceTokensSent.*:StepCountStats.*' \
  > "$out/server_tests.log" 2>&1
echo "moe_ep_server_tests rc $?" >> "$out/server_tests.log"
