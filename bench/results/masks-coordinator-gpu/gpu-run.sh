#!/usr/bin/env bash
# The GPU call of issue 17 (bench/results/masks-coordinator-gpu/README.md):
# the coordinator's GroupKeeper masks and re-adds a GPU group — 4 worker
# processes of backend nccl on one GPU (one-sided CUDA IPC plane), one
# killed with SIGKILL during a step, restarted, re-added — plus the other
# one-sided service tests. Usage on the GPU machine, after
# `source <bundle>/env.sh`:
#   BIN=<bundle>/bin [TESTS=<test binary name>] \
#     bench/results/masks-coordinator-gpu/gpu-run.sh OUT_DIR
set -u
out=${1:?OUT_DIR}
bin=${BIN:?BIN=<bundle>/bin}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
MOE_EP_WORKER_BINARY="$bin/moe-ep-worker" timeout ${TIMEOUT:-200} "$bin/${TESTS:-moe_ep_integration_tests}" \
  --gtest_filter="${FILTER:-*GpuOneSided*}" > "$out/integration_gpu_tests.log" 2>&1
echo "exit $?" >> "$out/integration_gpu_tests.log"
