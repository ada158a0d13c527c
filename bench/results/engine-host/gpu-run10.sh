#!/usr/bin/env bash
# Issue 30 item 1 and 3 at stop 50, one call: gpu-run9.sh (the fused unpack
# of the one-sided engine dispatch: correctness at 1, 2, 4 ranks fused and
# not, then host time fused vs not), and the nccl plane's refused combine
# (GpuEpDispatcher::RefuseCombine: a step header among the combine's NCCL
# transfers, read by the combine reduction): the reduction's header check,
# the dispatcher's refusal at one rank, the engine program's step 4c at
# nccl 1 (the refusing rank alone), and the tests stop 49 left unrun; then
# the Python layer's tensor checks piece by piece (bench/python_checks_bench.py).
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && bash bench/results/engine-host/gpu-run10.sh g "$OUT/r"
set -u
g=$1
out=$2
mkdir -p "$out"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
SECONDS=0
timeout 120 "$bin/moe_ep_gpu_tests" \
  --gtest_filter='LaunchCombineReduce.*:LaunchWriteStepHeader.*:LaunchCheckStepHeaders.*:GpuEpDispatcher.*Refuse*:GpuEpDispatcher.Ep1*:GpuEpDispatcher.Graph*' \
  > "$out/gpu_refusal.log" 2>&1
echo "gpu_refusal rc $? at ${SECONDS}s" >> "$out/rc.txt"
timeout 90 "$bin/moe_ep_engine_embedded" "$bin/moe-ep" nccl 1 > "$out/engine_nccl_1.log" 2>&1
echo "engine[nccl 1] rc $? at ${SECONDS}s" >> "$out/rc.txt"
bash bench/results/engine-host/gpu-run9.sh "$g" "$out"
# The nccl plane's calls (1 rank: NCCL takes one rank a device), its combine
# now carrying the step header: beside call 2's figures.
MOE_EP_LIBRARY="$PWD/$g/lib/libmoe_ep.so.0" timeout 60 python3 bench/engine_call_host.py \
  --moe-ep "$bin/moe-ep" --out "$out/host/nccl1" --plane nccl --ranks 1 --calls 1000 --graph-replays 0 \
  --side-stream > "$out/host/nccl1.log" 2>&1
echo "host_nccl1 rc $? at ${SECONDS}s" >> "$out/rc.txt"
timeout 60 python3 bench/python_checks_bench.py --out "$out/python_checks.json" > "$out/python_checks.log" 2>&1
echo "python_checks rc $? at ${SECONDS}s" >> "$out/rc.txt"
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|PASS: |FAIL" "$out/gpu_refusal.log" "$out/engine_nccl_1.log" >> "$out/summary.txt"
tail -5 "$out/summary.txt"
