#!/usr/bin/env bash
# The GPU call of bench/results/fp8-planes/README.md (issue 35 item 3, issue
# 34 items 1 and 3): fp8 block-scaled experts on the GPU planes (the device
# expert set's bits, RunFp8, the NCCL plane's Forward against the quantized
# reference), the GPU tests of the service after the group-session and
# expert-registry refactors, the one-sided worker processes, and the
# DeepSeek-V3 main job on one GPU with the checkpoint's fp8 experts.
#   bash bench/results/fp8-planes/gpu-run.sh BUNDLE "$OUT"
set -o pipefail
bundle=$1
out=$2
source "$bundle/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$bundle/data"
bin=$bundle/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
timeout 100 "$bin/moe_ep_gpu_tests" \
  --gtest_filter='DeviceExpertSet*:ExpertComputeFp8*:ExpertCompute.*:GpuEpDispatcher*' \
  > "$out/gpu_tests.log" 2>&1
echo "exit $?" >> "$out/gpu_tests.log"
timeout 80 "$bin/moe_ep_server_tests" --gtest_filter='Gpu*:OneSidedRouteMap*:CheckGpu*' \
  > "$out/server_gpu_tests.log" 2>&1
echo "exit $?" >> "$out/server_gpu_tests.log"
MOE_EP_WORKER_BINARY="$bin/moe-ep-worker" timeout 110 "$bin/moe_ep_integration_tests" \
  --gtest_filter='*GpuOneSided*' > "$out/integration_gpu_tests.log" 2>&1
echo "exit $?" >> "$out/integration_gpu_tests.log"
# DeepSeek-V3's fp8 experts (its quantization_config) on the NCCL plane, one
# GPU, every step checked against the CPU reference of the same experts.
timeout 110 "$bin/moe-ep" run --model "$MOE_EP_DATA_DIR/models/DeepSeek-V3.json" \
  --backend nccl --experts checkpoint --layers 1 --steps 2 --tokens 64 \
  > "$out/run-fp8.log" 2>&1
echo "exit $?" >> "$out/run-fp8.log"
tail -n 3 "$out"/*.log
