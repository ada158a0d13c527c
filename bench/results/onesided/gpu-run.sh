#!/usr/bin/env bash
# The one-GPU run of issue 15 (one-sided data plane), from the bundle made by
#   ../shared/tools/gpu-bundle gpu-out-1s build/tests/moe_ep_gpu_tests \
#       build/kernels/moe_ep_onesided_bench
# on a GPU machine: `source gpu-out-1s/env.sh && bench/results/onesided/gpu-run.sh OUT`.
# Tests first (every one-sided case, the NCCL plane's world-1 cases), then the
# benchmark (one-sided beside NCCL in the same process, identity experts).
set -u
out=${1:?usage: gpu-run.sh OUT_DIR}
bin=${BIN:-gpu-out-1s/bin}
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
timeout ${TEST_TIMEOUT:-300} "$bin/moe_ep_gpu_tests" --gtest_filter='OneSided*:GpuEpDispatcher.Ep1*' \
  > "$out/gpu_tests.log" 2>&1
echo "moe_ep_gpu_tests rc $?" >> "$out/gpu_tests.log"
timeout ${BENCH_TIMEOUT:-240} "$bin/moe_ep_onesided_bench" --tokens 1 128 4096 --sm-budget ${SM_BUDGETS:-16 32} \
  > "$out/onesided_bench.csv" 2> "$out/onesided_bench.err"
echo "moe_ep_onesided_bench rc $?" >> "$out/onesided_bench.err"
