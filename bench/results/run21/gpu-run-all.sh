#!/usr/bin/env bash
# Run 21 in one device call: gpt-oss's mxfp4 experts on the GPU first (issue
# 35 items 3 and 4: the kernel, loader and step tests, the step against its
# weight-streaming bound at gpt-oss-120b's shape, the gpt-oss main job on
# the NCCL plane and on 2 one-sided worker processes sharing the GPU), then
# run 20's call (never made: stop 38's GPU tests, Llama-4, issue 32's
# floors, the fp8 and bf16 expert steps beside their torch anchors).
#   tar -C gpu-call -xJf gpu-call/b.tar.xz && bash bench/results/run21/gpu-run-all.sh gpu-call "$OUT"
set -u
bundle=$1
out=$2
source "$bundle/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$bundle/data"
bin=$bundle/bin
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
# The weight bound at the card's own memory rate (H200 4.8 TB/s, H100 3.35).
tbps=4.8; grep -q H100 "$out/gpu.txt" && tbps=3.35
timeout 120 "$bin/moe_ep_gpu_tests" --gtest_filter='*Mxfp4*' > "$out/mxfp4_tests.log" 2>&1
mark mxfp4_tests $?
timeout 120 "$bin/moe_ep_mxfp4_bench" --tokens 1 128 4096 --bound-tbps $tbps > "$out/mxfp4_bench_1.csv" 2> "$out/mxfp4_bench.err"
mark mxfp4_bench $?
timeout 90 "$bin/moe-ep" run --model "$MOE_EP_DATA_DIR/models/gpt-oss-120b.json" --backend nccl \
  --workers 1 --experts checkpoint --layers 2 --steps 2 --tokens 64 > "$out/run-gpt-oss-nccl.log" 2>&1
mark run-gpt-oss-nccl $?
MOE_EP_WORKER_BINARY=$bin/moe-ep-worker timeout 120 "$bin/moe-ep" run \
  --model "$MOE_EP_DATA_DIR/models/gpt-oss-20b.json" --backend nccl --gpu-data-plane one-sided \
  --workers 2 --experts checkpoint --layers 2 --steps 2 --tokens 64 > "$out/run-gpt-oss-onesided.log" 2>&1
mark run-gpt-oss-onesided $?
timeout 120 "$bin/moe_ep_mxfp4_bench" --tokens 1 128 4096 --bound-tbps $tbps > "$out/mxfp4_bench_2.csv" 2>> "$out/mxfp4_bench.err"
mark mxfp4_bench_again $?
cat "$out/rc.txt"
grep -hE "^\[  (PASSED|FAILED) |FAILED  \]|largest" "$out/mxfp4_tests.log" | head -20
cat "$out/mxfp4_bench_1.csv" "$out/mxfp4_bench_2.csv"
tail -n 4 "$out/run-gpt-oss-nccl.log" "$out/run-gpt-oss-onesided.log"
mkdir -p "$out/run20"
bash bench/results/run20/gpu-run-all.sh "$bundle" "$out/run20"
