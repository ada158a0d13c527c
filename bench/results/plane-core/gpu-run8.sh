#!/usr/bin/env bash
# Issue 34 item 2 / item 4 on a GPU after the engine cells joined the
# capability matrix (CapabilityMatrixEngine: tests/embedded/engine_embedded.cc
# as gloo 4, nccl 1 and one-sided 4 processes): the whole matrix and the
# one-sided integration tests, the C API program on every plane it can run
# here, the Python engine on torch, the DeepSeek-V3 fp8 main job; then the
# fp8 one-expert bench the fixed seed makes runnable (issue 35).
# Results: $2/*.log, $2/rc.txt, $2/summary.txt.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && bash bench/results/plane-core/gpu-run8.sh g "$OUT/r"
set -u
g=$1
out=$2
mkdir -p "$out"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
lib=$PWD/$g/lib
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt" 2>&1
# The matrix's engine cells run the bundle's C API program and CLI.
export MOE_EP_ENGINE_EMBEDDED="$PWD/$bin/moe_ep_engine_embedded" MOE_EP_CLI="$PWD/$bin/moe-ep"
timeout 240 "$bin/moe_ep_integration_tests" --gtest_filter='*GpuOneSided*:*CapabilityMatrix*' > "$out/integration_gpu.log" 2>&1
mark integration_gpu $?
for args in "nccl 1" "one-sided 1" "one-sided 2" "one-sided 4" "gloo 4"; do
  # shellcheck disable=SC2086
  timeout 90 "$bin/moe_ep_engine_embedded" "$bin/moe-ep" $args > "$out/engine_${args// /_}.log" 2>&1
  mark "engine[$args]" $?
done
(cd python/tests && MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" MOE_EP_CLI="$OLDPWD/$bin/moe-ep" \
  PYTHONPATH="$OLDPWD/python" PYTHONDONTWRITEBYTECODE=1 timeout 100 python3 -m unittest -v test_engine_gpu) \
  > "$out/python_engine_gpu.log" 2>&1
mark python_engine_gpu $?
timeout 100 "$bin/moe-ep" run --model "$MOE_EP_DATA_DIR/models/DeepSeek-V3.json" --backend nccl --workers 1 \
  --worker-binary "$MOE_EP_WORKER_BINARY" --experts checkpoint --layers 1 --steps 2 --tokens 64 > "$out/main_deepseek_v3_fp8.log" 2>&1
mark main_deepseek_v3_fp8 $?
timeout 60 "$bin/moe_ep_expert_bench" --paths fp8 --experts 1 --topk 1 --tokens 32768 \
  --warmup 5 --iters 50 --bound-tbps 3.35 > "$out/bench_experts1.csv" 2> "$out/bench_experts1.log"
mark bench_experts1 $?
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|^(OK|FAILED)|PASS: |FAIL|SKIP" "$out"/*.log | sort | uniq -c > "$out/summary.txt"
cat "$out/rc.txt" "$out/summary.txt" "$out/bench_experts1.csv"
