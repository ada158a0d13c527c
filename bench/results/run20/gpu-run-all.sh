#!/usr/bin/env bash
# Run 20 in one device call, most needed first (the machine came rarely this
# session): this session's GPU tests (Llama-4's e(w x) on the GPU planes,
# fp8 checkpoints streamed to the device), the Llama-4 main job on the NCCL
# plane, then issue 32's floors beside the one-sided phases, then the fp8
# and bf16 expert steps beside their torch anchors, then every GPU test.
#   tar -C gpu-call -xJf gpu-call/b.tar.xz && bash bench/results/run20/gpu-run-all.sh gpu-call "$OUT"
set -u
bundle=$1
out=$2
source "$bundle/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$bundle/data"
bin=$bundle/bin
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
timeout 120 "$bin/moe_ep_gpu_tests" --gtest_filter='DeviceExpertSet*:ExpertCompute*' \
  > "$out/new_gpu_tests.log" 2>&1; mark new_gpu_tests $?
timeout 90 "$bin/moe_ep_server_tests" --gtest_filter='GpuDataPlane*:CheckGpu*' \
  > "$out/new_server_gpu_tests.log" 2>&1; mark new_server_gpu_tests $?
timeout 90 "$bin/moe-ep" run --model "$MOE_EP_DATA_DIR/models/Llama-4-Scout-17B-16E-Instruct.json" \
  --backend nccl --workers 1 --experts swiglu --layers 2 --steps 2 --tokens 64 \
  > "$out/run-llama4.log" 2>&1; mark run-llama4 $?
mkdir -p "$out/floors" "$out/experts"
BIN=$bin FLOOR_TIMEOUT=60 BENCH_TIMEOUT=150 TEST_TIMEOUT=60 \
  bash bench/results/floors/gpu-run.sh "$out/floors"; mark floors 0
e=$out/experts
args=(--tokens 1 128 4096 --warmup 20 --iters 300)
timeout 60 "$bin/moe_ep_expert_bench" --paths fp8 "${args[@]}" > "$e/fp8_1.csv" 2> "$e/stderr.log"
PYTHONUNBUFFERED=1 timeout 90 python3 "$bundle/expert_fp8_torch.py" 1 128 4096 > "$e/torch_fp8.jsonl" 2>> "$e/stderr.log"
timeout 60 "$bin/moe_ep_expert_bench" --paths fp8 "${args[@]}" > "$e/fp8_2.csv" 2>> "$e/stderr.log"
mark fp8 $?
timeout 60 "$bin/moe_ep_expert_bench" --paths hopper "${args[@]}" > "$e/bf16_1.csv" 2>> "$e/stderr.log"
PYTHONUNBUFFERED=1 timeout 90 python3 "$bundle/expert_gemm_torch.py" 1 128 4096 > "$e/torch_bf16.txt" 2>> "$e/stderr.log"
timeout 60 "$bin/moe_ep_expert_bench" --paths hopper "${args[@]}" > "$e/bf16_2.csv" 2>> "$e/stderr.log"
mark bf16 $?
MOE_EP_WORKER_BINARY=$bin/moe-ep-worker timeout 100 "$bin/moe_ep_integration_tests" \
  --gtest_filter='*GpuOneSided*' > "$out/integration_gpu_tests.log" 2>&1; mark integration $?
timeout 150 "$bin/moe_ep_gpu_tests" > "$out/gpu_tests.log" 2>&1; mark gpu_tests $?
cat "$out/rc.txt"
grep -hE "^\[  (PASSED|FAILED) |FAILED  \]|largest|plane:" "$out"/*.log | head -30
tail -n 3 "$out/run-llama4.log"
