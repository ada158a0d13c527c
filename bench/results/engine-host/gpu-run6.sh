#!/usr/bin/env bash
# The engine calls' host time on torch's default stream (the one-sided
# plane forks onto its own stream and joins back) against an engine's own
# stream (--side-stream: the calls enqueue on it directly), alternated in
# one call, 2 ranks as processes; then the stream-order tests and the
# embedded C API with two processes. Results in $OUT/r.tar.gz.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && bash bench/results/engine-host/gpu-run6.sh g "$OUT"
set -u
g=$1
out=$2
r=$out/r
mkdir -p "$r/host" "$r/verify"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
lib=$PWD/$g/lib
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" | tee -a "$out/rc.txt"; }
timeout 40 "$bin/moe_ep_gpu_tests" --gtest_filter='EngineStreamOrder*:*RefusedStep*' > "$r/verify/gpu.log" 2>&1
mark gpu_tests $?
for round in 1 2; do
  for mode in default side; do
    extra=()
    [ "$mode" = side ] && extra=(--side-stream)
    MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 40 python3 bench/engine_call_host.py \
      --moe-ep "$bin/moe-ep" --out "$r/host/$mode$round" --plane one-sided --ranks 2 --calls 1000 \
      "${extra[@]}" > "$r/host/$mode$round.log" 2>&1
    mark "host_$mode$round" $?
  done
done
timeout 40 "$bin/moe_ep_gpu_embedded" "$bin/moe-ep" one-sided 2 > "$r/verify/embedded2.log" 2>&1
mark embedded_one-sided_2 $?
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|PASS: |FAIL" "$r"/verify/*.log | sort | uniq -c > "$out/summary.txt"
for f in "$r"/host/*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print([{k: v['p50'] for k, v in x.items() if k.startswith(('c_', 'py_d', 'py_c', 'py_i'))} for x in d['per_rank']], d['python_over_c_us'])" "$f"; done >> "$out/summary.txt" 2>&1
cat "$out/summary.txt"
tar -C "$out" -czf "$out/r.tar.gz" r && rm -rf "$r"
