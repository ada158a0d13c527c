#!/usr/bin/env bash
# The one-GPU run of issue 15 item 3 (the copy-engine bulk path), from the
# bundle made by
#   ../shared/tools/gpu-bundle gpu-out-ce build/tests/moe_ep_gpu_tests \
#       build/kernels/moe_ep_onesided_bench
# on a GPU machine: `source gpu-out-ce/env.sh && bench/results/onesided-ce/gpu-run.sh OUT`.
# Tests first (every one-sided case on both paths, the NCCL plane's world-1
# cases), then the benchmark: NCCL, one-sided sm and one-sided ce side by
# side in one process (identity experts).
set -u
out=${1:?usage: gpu-run.sh OUT_DIR}
bin=${BIN:-gpu-out-ce/bin}
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
timeout ${TEST_TIMEOUT:-200} "$bin/moe_ep_gpu_tests" --gtest_filter='OneSided*:GpuEpDispatcher.Ep1*' \
  > "$out/gpu_tests.log" 2>&1
echo "moe_ep_gpu_tests rc $?" >> "$out/gpu_tests.log"
timeout ${BENCH_TIMEOUT:-150} "$bin/moe_ep_onesided_bench" --tokens ${TOKENS:-1 128 1024 2048 4096} \
  --sm-budget ${SM_BUDGETS:-64} --path sm ce \
  > "$out/onesided_bench.csv" 2> "$out/onesided_bench.err"
echo "moe_ep_onesided_bench rc $?" >> "$out/onesided_bench.err"
