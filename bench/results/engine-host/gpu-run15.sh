#!/usr/bin/env bash
# Stop 55, third call (issue 30 item 3, review mends): the direct unpack's
# error paths (a failed flag round pads the own slab and zeroes its
# counts), the gtests at EP 1 and EP 2 (two steps, stale window rows,
# UnpacksDirectly checked), the one-sided threads tests, and the C API
# program at one-sided 1, 2 (on and off) and 4.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 200 bash bench/results/engine-host/gpu-run15.sh g /tmp/r/e
set -u
g=$1
out=$2
mkdir -p "$out"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
timeout 150 "$bin/moe_ep_gpu_tests" --gtest_filter='OneSidedDirectUnpack.*' > "$out/gtest_direct.log" 2>&1
mark gtest_direct $?
engine() {  # name, direct flag, ranks
  MOE_EP_ONESIDED_DIRECT_UNPACK=$2 timeout 60 "$bin/moe_ep_engine_embedded" "$bin/moe-ep" one-sided "$3" \
    > "$out/engine_$1.log" 2>&1
  mark "engine_$1" $?
}
engine direct_os1 1 1
engine direct_os2 1 2
engine window_os2 0 2
engine direct_os4 1 4
timeout 100 "$bin/moe_ep_gpu_tests" --gtest_filter='OneSidedThreads.*:OneSidedWorld1.*' \
  > "$out/gtest_onesided.log" 2>&1
mark gtest_onesided $?
grep -h -E "^\[  (PASSED|FAILED|SKIPPED)|PASS|FAIL" "$out"/*.log | sort | uniq -c > "$out/summary.txt"
cat "$out/gpu.txt" "$out/rc.txt" "$out/summary.txt"
