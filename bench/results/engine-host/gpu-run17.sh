#!/usr/bin/env bash
# Stop 56, second call: call 15's (gpu-run16.sh) direct-unpack gtests
# failed on two test faults now mended: the reference's 0 * x was -0 for a
# token sent nowhere, and the R 4096 case stalled on the lazy load of the
# unpack kernel (now preloaded by the dispatcher's Create). Runs
# gpu-run15.sh (the gtests at EP 1 and 2, the threads tests, the C API
# program at one-sided 1, 2 on/off and 4) and the copy-engine gtests.
# gpu-run15.sh's own timeouts sum to 490 s; its wrapper leaves them room.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 590 bash bench/results/engine-host/gpu-run17.sh g /tmp/r/e
set -u
g=$1
out=$2
here=$(dirname "$0")
timeout 495 bash "$here/gpu-run15.sh" "$g" "$out"
(source "$g/env.sh"; export NCCL_NVLS_ENABLE=0
 timeout 85 "$g/bin/moe_ep_gpu_tests" --gtest_filter='OneSidedThreadsCe.*:OneSidedCe.*' \
   > "$out/gtest_ce.log" 2>&1; echo "gtest_ce rc $?" >> "$out/rc.txt")
grep -h -E "^\[  (PASSED|FAILED)" "$out/gtest_ce.log"
