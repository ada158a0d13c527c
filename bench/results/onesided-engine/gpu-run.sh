#!/usr/bin/env bash
# The GPU call of bench/results/onesided-engine/README.md (issue 34 item 2,
# issue 30): the engine's in-process calls on the one-sided plane (the C
# API's GPU test at EP 1 on both planes and at 2 ranks as two processes
# sharing the GPU) and the Python layer's host time of a dispatch on both
# planes side by side, in one call.
#   bash bench/results/onesided-engine/gpu-run.sh BUNDLE "$OUT"
set -o pipefail
bundle=$1
out=$2
mkdir -p "$out"
source "$bundle/env.sh"
export NCCL_NVLS_ENABLE=0
bin=$bundle/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
for args in "nccl 1" "one-sided 1" "one-sided 2"; do
  set -- $args
  log="$out/gpu_embedded_$1_$2.log"
  timeout 60 "$bin/moe_ep_gpu_embedded" "$bin/moe-ep" "$1" "$2" > "$log" 2>&1
  echo "exit $?" >> "$log"
done
for plane in nccl one-sided; do
  MOE_EP_LIBRARY="$bin/libmoe_ep.so" PYTHONPATH=python timeout 40 python3 \
    bench/embedded_overhead_gpu.py --moe-ep "$bin/moe-ep" --out "$out" \
    --gpu-data-plane "$plane" --calls 3000 > "$out/overhead_$plane.log" 2>&1
  echo "exit $?" >> "$out/overhead_$plane.log"
done
tail -n 3 "$out"/*.log
