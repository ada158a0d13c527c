#!/usr/bin/env bash
# Issue 34 item 4 / issue 35 item 4 after the fp8-speed merge (gather once per row,
# ping-pong 128-row tiles, cluster and prefetch options off by default) and the
# expert-scratch intermediate moved into the plane core: the whole GPU kernel test
# binary (fp8 at the committed defaults), both GPU planes' server tests, the one-sided
# integration and capability matrix, and the DeepSeek-V3 fp8 main job, in one call.
#   mkdir -p g && tar -C g -xJf gpu-call4/b.tar.xz && bash bench/results/plane-core/gpu-run4.sh g "$OUT"
set -u
g=$1
out=$2
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" | tee -a "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
timeout 300 "$bin/moe_ep_gpu_tests" > "$out/gpu_kernels.log" 2>&1
mark gpu_kernel_tests $?
timeout 120 "$bin/moe_ep_server_tests" --gtest_filter='Gpu*:CheckGpu*:DeviceTokensSent.*:StepCountStats.*:*OneSided*' > "$out/server_gpu.log" 2>&1
mark server_gpu_tests $?
timeout 120 "$bin/moe_ep_integration_tests" --gtest_filter='*GpuOneSided*:*CapabilityMatrix*' > "$out/integration_gpu.log" 2>&1
mark integration_gpu_tests $?
timeout 100 "$bin/moe-ep" run --model "$MOE_EP_DATA_DIR/models/DeepSeek-V3.json" --backend nccl --workers 1 \
  --worker-binary "$MOE_EP_WORKER_BINARY" --experts checkpoint --layers 1 --steps 2 --tokens 64 > "$out/main_deepseek_v3_fp8.log" 2>&1
mark main_deepseek_v3_fp8 $?
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|PASS|FAIL" "$out"/*.log | grep -v warning | sort | uniq -c | head -30
