#!/usr/bin/env bash
# The one GPU call of this run (bench/results/service-onesided/README.md):
# every GPU test of the tree, the one-sided service tests, and moe_ep_bench
# on both planes. Usage on the GPU machine, after `source <bundle>/env.sh`:
#   BIN=<bundle>/bin bench/results/service-onesided/gpu-run.sh OUT_DIR
set -u
out=${1:?OUT_DIR}
bin=${BIN:?BIN=<bundle>/bin}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
timeout 240 "$bin/moe_ep_gpu_tests" > "$out/gpu_tests.log" 2>&1
echo "exit $?" >> "$out/gpu_tests.log"
timeout 120 "$bin/moe_ep_server_tests" --gtest_filter='Gpu*' > "$out/server_gpu_tests.log" 2>&1
echo "exit $?" >> "$out/server_gpu_tests.log"
MOE_EP_WORKER_BINARY="$bin/moe-ep-worker" timeout 120 "$bin/moe_ep_integration_tests" \
  --gtest_filter='GpuOneSided*' > "$out/integration_gpu_tests.log" 2>&1
echo "exit $?" >> "$out/integration_gpu_tests.log"
# H 7168, top-8, 256 experts, identity experts, uniform routing, EP 1; the
# one-sided rows run over an NCCL symmetric window of the same communicator.
timeout 120 "$bin/moe_ep_bench" --ep 1 --tokens 1 128 4096 --hidden 7168 --topk 8 \
  --experts 256 --routing uniform --check device --data-plane nccl one-sided \
  --warmup 50 --iters 1000 > "$out/ep_bench.csv" 2> "$out/ep_bench.err"
echo "exit $?" >> "$out/ep_bench.err"
