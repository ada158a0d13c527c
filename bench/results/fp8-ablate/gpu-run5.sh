#!/usr/bin/env bash
# Stop 53's last call: the review mends of the NCCL teardown (the abort waits
# on its own count of captures, 200 ms grace for releases in flight, the
# all-to-all capture NCCL really holds), the collectives that call it, the
# engine's NCCL graph section; then bench/smem_stream_bench.cu (issues 32, 35).
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 110 bash bench/results/fp8-ablate/gpu-run5.sh g /tmp/r; tar -C /tmp/r -czf "$OUT/r.tgz" .
set -u
g=$1
out=$2
mkdir -p "$out"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
timeout 25 "$bin/moe_ep_smem_stream_bench" --reps 20 > "$out/stream.csv" 2> "$out/stream.log"
mark stream $?
timeout 40 "$bin/moe_ep_gpu_tests" \
  --gtest_filter='NcclGraphRefs.*:NcclCollective.*:MaskedStreamCollective*:GpuEpDispatcher.Ep1*' \
  > "$out/gpu_nccl.log" 2>&1
mark gpu_nccl $?
MOE_EP_LIBRARY="$PWD/$g/lib/libmoe_ep.so.0" timeout 30 python3 bench/engine_call_host.py \
  --moe-ep "$bin/moe-ep" --out "$out/host_nccl1" --plane nccl --ranks 1 --calls 200 \
  --graph-replays 100 > "$out/host_nccl1.log" 2>&1
mark host_nccl1 $?
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED" "$out"/*.log | sort | uniq -c > "$out/summary.txt"
grep -h "warning" "$out/host_nccl1.log" | tail -2 >> "$out/summary.txt"
cat "$out/rc.txt" "$out/summary.txt" "$out/stream.csv"
