#!/usr/bin/env bash
# The GPU call of issue 17 item 5 (bench/results/masks-onesided/README.md):
# the one-sided service tests, the rank-mask ones included (4 worker
# processes on one GPU, CUDA IPC windows). Usage on the GPU machine, after
# `source <bundle>/env.sh`:
#   BIN=<bundle>/bin bench/results/masks-onesided/gpu-run.sh OUT_DIR
set -u
out=${1:?OUT_DIR}
bin=${BIN:?BIN=<bundle>/bin}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
MOE_EP_WORKER_BINARY="$bin/moe-ep-worker" timeout ${TIMEOUT:-300} "$bin/moe_ep_integration_tests" \
  --gtest_filter="${FILTER:-GpuOneSided*}" > "$out/integration_gpu_tests.log" 2>&1
echo "exit $?" >> "$out/integration_gpu_tests.log"
