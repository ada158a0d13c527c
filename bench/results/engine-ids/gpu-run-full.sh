#!/usr/bin/env bash
# Call 3 of bench/results/engine-ids/README.md: the whole GPU kernel suite,
# the server's Gpu* cases and every one-sided worker-process integration case
# (masks included) on the tree of calls 1-2, for regressions from the device
# id check and the test inputs that now carry only the configured invalid id.
#   bash bench/results/engine-ids/gpu-run-full.sh BUNDLE "$OUT"
set -o pipefail
bundle=$1
out=$2
mkdir -p "$out"
source "$bundle/env.sh"
export NCCL_NVLS_ENABLE=0
bin=$bundle/bin
timeout 300 "$bin/moe_ep_gpu_tests" > "$out/gpu_tests_all.log" 2>&1
echo "exit $?" >> "$out/gpu_tests_all.log"
timeout 120 "$bin/moe_ep_server_tests" --gtest_filter='Gpu*' > "$out/server_gpu.log" 2>&1
echo "exit $?" >> "$out/server_gpu.log"
MOE_EP_WORKER_BINARY="$bin/moe-ep-worker" timeout 150 "$bin/moe_ep_integration_tests" \
  --gtest_filter='GpuOneSided*:Victims/GpuOneSidedMasks*' > "$out/integration_all.log" 2>&1
echo "exit $?" >> "$out/integration_all.log"
for f in "$out"/*.log; do echo "== $f"; grep -E "^\[  (PASSED|FAILED|SKIPPED) \]" "$f" | sort | uniq -c | head; tail -n 1 "$f"; done
