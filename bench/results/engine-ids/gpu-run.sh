#!/usr/bin/env bash
# The GPU call of bench/results/engine-ids/README.md (issue 30 item 1):
# expert ids out of range checked on the device by both GPU planes' route
# kernels (kernels/expert_id_error.h), through the C API at EP 1 on both
# planes and at 2 ranks as two processes sharing the GPU; the kernel tests
# of the route, pack and one-sided dispatcher; the one-sided worker
# processes' integration tests (no regression from the id normalisation).
#   bash bench/results/engine-ids/gpu-run.sh BUNDLE "$OUT"
set -o pipefail
bundle=$1
out=$2
mkdir -p "$out"
source "$bundle/env.sh"
export NCCL_NVLS_ENABLE=0
bin=$bundle/bin
export PATH="$bin:$PATH"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
for args in "nccl 1" "one-sided 1" "one-sided 2"; do
  set -- $args
  log="$out/gpu_embedded_$1_$2.log"
  timeout 90 "$bin/moe_ep_gpu_embedded" "$bin/moe-ep" "$1" "$2" > "$log" 2>&1
  echo "exit $?" >> "$log"
done
timeout 150 "$bin/moe_ep_gpu_tests" \
  --gtest_filter='LaunchRoute*:ExpertIdError*:KernelLaunchers*:LaunchPackDispatch*:OneSided*:GpuEpDispatcher*' \
  > "$out/gpu_tests.log" 2>&1
echo "exit $?" >> "$out/gpu_tests.log"
MOE_EP_WORKER_BINARY="$bin/moe-ep-worker" timeout 200 \
  "$bin/moe_ep_integration_tests" --gtest_filter='GpuOneSided*' > "$out/integration.log" 2>&1
echo "exit $?" >> "$out/integration.log"
tail -n 3 "$out"/*.log
