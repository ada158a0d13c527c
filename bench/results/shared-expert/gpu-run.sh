#!/usr/bin/env bash
# Issue 18 on one H200: the GPU tests (shared expert kernels, combine term),
# the GPU worker-service tests, then the main job with shared experts on
# DeepSeek-V3 (SwiGLU, 1 MoE layer, 4096 tokens, 3 steps) and Qwen1.5-MoE,
# whose per-layer JSON carries the CUDA-event overlap of the shared expert
# with the dispatch. Run from the bundle folder's parent: B=bundle dir.
set -uo pipefail
B=${B:-gpu-out-18}
source "$B/env.sh"
O=${OUT:-out}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$O/00_gpu.txt" 2>&1
"$B/bin/moe_ep_gpu_tests" > "$O/01_gpu_tests.txt" 2>&1; echo "gpu tests rc $?" >> "$O/01_gpu_tests.txt"
if [ -x "$B/bin/moe_ep_server_tests" ]; then
  "$B/bin/moe_ep_server_tests" --gtest_filter='*Gpu*' > "$O/02_server_gpu_tests.txt" 2>&1
  echo "server gpu tests rc $?" >> "$O/02_server_gpu_tests.txt"
fi
"$B/bin/moe-ep" run --worker-binary "$B/bin/moe-ep-worker" --backend nccl \
  --model "$B/data/DeepSeek-V3.json" --experts swiglu --layers 1 --tokens 4096 --even-tokens \
  --steps 3 --json > "$O/03_deepseek_v3.json" 2> "$O/03_deepseek_v3.txt"
echo "deepseek rc $?" >> "$O/03_deepseek_v3.txt"
"$B/bin/moe-ep" run --worker-binary "$B/bin/moe-ep-worker" --backend nccl \
  --model "$B/data/Qwen1.5-MoE-A2.7B.partial.json" --experts swiglu --layers 2 --tokens 4096 \
  --even-tokens --steps 3 --json > "$O/04_qwen15.json" 2> "$O/04_qwen15.txt"
echo "qwen rc $?" >> "$O/04_qwen15.txt"
