#!/usr/bin/env bash
# The lead's GPU call of session 7 (bench/results/run18/README.md): every GPU
# test of the merged tree (the NCCL shrink cases among them), the server's
# Gpu* cases (GpuRankMask), the one-sided service tests (rank masks, rejoin
# and the coordinator's mask and re-add, 4 worker processes on one GPU) and
# the embedded C API. Usage on the GPU machine, after
# `source <bundle>/env.sh`:
#   BIN=<bundle>/bin bench/results/run18/gpu-run.sh OUT_DIR
set -u
out=${1:?OUT_DIR}
bin=${BIN:?BIN=<bundle>/bin}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
timeout 240 "$bin/moe_ep_gpu_tests" > "$out/gpu_tests.log" 2>&1
echo "exit $?" >> "$out/gpu_tests.log"
timeout 120 "$bin/moe_ep_server_tests" --gtest_filter='Gpu*' > "$out/server_gpu_tests.log" 2>&1
echo "exit $?" >> "$out/server_gpu_tests.log"
MOE_EP_WORKER_BINARY="$bin/moe-ep-worker" timeout 200 "$bin/moe_ep_integration_tests" \
  --gtest_filter='*GpuOneSided*' > "$out/integration_gpu_tests.log" 2>&1
echo "exit $?" >> "$out/integration_gpu_tests.log"
timeout 60 "$bin/moe_ep_gpu_embedded" "$bin/moe-ep" > "$out/gpu_embedded.log" 2>&1
echo "exit $?" >> "$out/gpu_embedded.log"
