#!/usr/bin/env bash
# Stop 52's fourth device call: a rank alone skipping the dispatch's grid
# count and flag (issue 32, the EP 1 step). The one-sided GPU tests and the
# server's (Forward at EP 1 runs that path), then the bench of 58ac830 (its
# own static binary), this bundle's with the NCCL anchor, 58ac830's again.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 200 bash bench/results/floors/gpu-run5.sh g /tmp/r; tar -C /tmp/r -czf "$OUT/r.tgz" .
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
timeout 60 "$bin/moe_ep_gpu_tests" --gtest_filter='*OneSided*:*Unpack*:*EngineRows*' \
  > "$out/gpu_onesided.log" 2>&1
mark gpu_onesided $?
ob() {  # name, binary, extra flags
  timeout 40 "$2" --tokens 128 4096 --sm-budget 64 --path sm $3 \
    > "$out/onesided_$1.csv" 2> "$out/onesided_$1.log"
  mark "onesided_bench_$1" $?
}
ob 58ac830 "$bin/moe_ep_onesided_bench_58ac830" --skip-nccl
ob alone "$bin/moe_ep_onesided_bench" ""
ob 58ac830_again "$bin/moe_ep_onesided_bench_58ac830" --skip-nccl
timeout 60 "$bin/moe_ep_server_tests" --gtest_filter='*OneSided*' > "$out/server_onesided.log" 2>&1
mark server_onesided $?
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED" "$out"/*.log | sort | uniq -c > "$out/summary.txt"
tail -n +1 "$out"/onesided_*.csv >> "$out/summary.txt"
cat "$out/rc.txt" "$out/summary.txt"
