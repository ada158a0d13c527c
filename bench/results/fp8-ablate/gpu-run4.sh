#!/usr/bin/env bash
# Issues 32, 35: bulk copies into shared memory alone (bench/smem_stream_bench.cu):
# per-SM rate against CTAs per SM, producers, bytes in flight, L2 or DRAM
# source, half the SMs.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 120 bash bench/results/fp8-ablate/gpu-run4.sh g /tmp/r; tar -C /tmp/r -czf "$OUT/r.tgz" .
set -u
g=$1
out=$2
mkdir -p "$out"
source "$g/env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
timeout 60 "$g/bin/moe_ep_smem_stream_bench" --reps 20 > "$out/stream.csv" 2> "$out/stream.log"
echo "stream rc $?" > "$out/rc.txt"
timeout 60 "$g/bin/moe_ep_smem_stream_bench" --reps 20 > "$out/stream_again.csv" 2>> "$out/stream.log"
echo "stream_again rc $?" >> "$out/rc.txt"
nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv >> "$out/gpu.txt" 2>&1
cat "$out/rc.txt" "$out/stream.csv" "$out/stream_again.csv" "$out/stream.log"
