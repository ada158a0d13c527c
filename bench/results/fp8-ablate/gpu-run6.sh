#!/usr/bin/env bash
# Stop 54's first call (an H200 when one comes): shared-memory stream rates
# (bench/smem_stream_bench.cu; issues 32, 35), the NCCL teardown review mends
# (issue 30), the engine calls at 2 ranks as processes and the graph sections
# beside the bare one-sided kernels (issue 30 item 3; also timed inside one
# graph), two producer threads in the fp8 GEMM (abl10.patch), then the fp8 and bf16
# expert steps beside their torch anchors (moe-ep, anchor, moe-ep again).
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 560 bash bench/results/fp8-ablate/gpu-run6.sh g /tmp/r; tar -C /tmp/r -czf "$OUT/r.tgz" .
set -u
g=$1
out=$2
mkdir -p "$out"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
lib=$PWD/$g/lib
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
timeout 40 "$bin/moe_ep_smem_stream_bench" --reps 20 > "$out/stream.csv" 2> "$out/stream.log"
mark stream $?
timeout 40 "$bin/moe_ep_gpu_tests" \
  --gtest_filter='NcclGraphRefs.*:NcclCollective.*:MaskedStreamCollective*:GpuEpDispatcher.Ep1*' \
  > "$out/gpu_nccl.log" 2>&1
mark gpu_nccl $?
host() {  # name, plane, ranks, extra
  # shellcheck disable=SC2086
  MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 90 python3 bench/engine_call_host.py \
    --moe-ep "$bin/moe-ep" --out "$out/host_$1" --plane "$2" --ranks "$3" --calls 1000 $4 \
    > "$out/host_$1.log" 2>&1
  mark "host_$1" $?
}
host onesided2 one-sided 2 "--side-stream"
host nccl1 nccl 1 "--graph-replays 1000"
for b in 16 64; do
  timeout 40 "$bin/moe_ep_onesided_bench" --tokens 128 --sm-budget $b --path sm --skip-nccl \
    > "$out/onesided_sm$b.csv" 2> "$out/onesided_sm$b.log"
  mark "onesided_bench_sm$b" $?
  host "graph1_sm$b" one-sided 1 "--side-stream --graph-replays 1000 --onesided-sm-budget $b"
done
# Issue 35: two producer threads (abl10.patch: thread 0 the A boxes, thread 32
# the B boxes) beside the committed kernel, one process order.
fb() {  # name, binary, shape args
  # shellcheck disable=SC2086
  timeout 60 "$2" --paths fp8 --fp8-tile-compare --warmup 10 --iters 100 $3 \
    > "$out/abl_$1.csv" 2> "$out/abl_$1.log"
  mark "abl_$1" $?
}
for shape in "t4096:--tokens 4096" "e16:--experts 16 --topk 1 --tokens 32768"; do
  s=${shape%%:*}; a=${shape#*:}
  fb "base_$s" "$bin/moe_ep_expert_bench" "$a"
  fb "abl10_$s" "$bin/moe_ep_expert_bench_abl10" "$a"
  fb "base_again_$s" "$bin/moe_ep_expert_bench" "$a"
done
# Issue 35 on an H200: fp8 at 1 / 128 / 4096 tokens beside torch._scaled_grouped_mm.
fa=(--paths fp8 --tokens 1 128 4096 --warmup 20 --iters 300 --bound-tbps 4.8)
timeout 90 "$bin/moe_ep_expert_bench" "${fa[@]}" > "$out/fp8_1.csv" 2> "$out/fp8_1.log"
mark fp8_1 $?
PYTHONUNBUFFERED=1 timeout 90 python3 "$g/anchors/expert_fp8_torch.py" 1 128 4096 > "$out/fp8_torch.jsonl" 2> "$out/fp8_torch.log"
mark fp8_torch $?
timeout 90 "$bin/moe_ep_expert_bench" "${fa[@]}" > "$out/fp8_2.csv" 2> "$out/fp8_2.log"
mark fp8_2 $?
# Issue 32 on an H200: the bf16 Hopper step beside torch.
ba=(--paths hopper --tokens 1 128 4096 --warmup 10 --iters 300)
timeout 60 "$bin/moe_ep_expert_bench" "${ba[@]}" > "$out/bf16_1.csv" 2> "$out/bf16_1.log"
mark bf16_1 $?
PYTHONUNBUFFERED=1 timeout 90 python3 "$g/anchors/expert_gemm_torch.py" 1 128 4096 > "$out/bf16_torch.jsonl" 2> "$out/bf16_torch.log"
mark bf16_torch $?
timeout 60 "$bin/moe_ep_expert_bench" "${ba[@]}" > "$out/bf16_2.csv" 2> "$out/bf16_2.log"
mark bf16_2 $?
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw --format=csv >> "$out/gpu.txt" 2>&1
{
  grep -h -E "^\[  (PASSED|FAILED)" "$out"/gpu_nccl.log
  grep -h "warning" "$out/host_nccl1.log" | tail -2
  for f in "$out"/host_*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('onesided_sm_budget'), d.get('p50_us_slower_rank'), d.get('python_over_c_us'))" "$f"; done 2>&1
  echo "abl csv: name step gu dn err gu128 gu256 dn128 dn256 gu128c2 dn128c2 gu256c2 dn256c2"
  for f in "$out"/abl_*.csv; do echo "$(basename "$f") $(tail -1 "$f" | cut -d, -f7,8,9,21,23-30)"; done
  tail -n +1 "$out"/onesided_sm*.csv "$out"/fp8_*.csv "$out"/fp8_torch.jsonl "$out"/bf16_*.csv "$out"/bf16_torch.jsonl
} > "$out/summary.txt"
cat "$out/rc.txt" "$out/summary.txt" "$out/stream.csv"
