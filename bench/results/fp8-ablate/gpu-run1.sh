#!/usr/bin/env bash
# Issue 35: where the fp8 GEMMs' time goes, by ablation, and stop 52's
# unrun kernel mends (68558a8, d701967) on a GPU.
# Three builds of moe_ep_expert_bench in one call: the committed kernel
# (base), abl1 (the products only: every k-block's wgmma accumulate into the
# tile's accumulators with one group in flight, no promotion, no scales),
# abl2 (no products: the consumers wait for each stage and free it: the load
# pipeline alone). Each at 4096 tokens over 128 experts (top-8), 32,768 rows
# over 16 experts and over 1 expert (its weights fit in L2), with
# --fp8-tile-compare (each GEMM alone, 128- and 256-row tiles), base again
# last. Then the one-sided GPU tests, the onesided bench, the Python and
# server GPU tests, and engine_call_host --plane nccl --ranks 1 with its
# graph section (issue 30's hang), its Python stacks dumped at 50 s.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 560 bash bench/results/fp8-ablate/gpu-run1.sh g /tmp/r; tar -C /tmp/r -czf "$OUT/r.tgz" .
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
fb() {  # name, binary, shape args
  # shellcheck disable=SC2086
  timeout 60 "$2" --paths fp8 --fp8-tile-compare --warmup 10 --iters 100 --bound-tbps 3.35 $3 \
    > "$out/fp8_$1.csv" 2> "$out/fp8_$1.log"
  mark "fp8_$1" $?
}
for shape in "t4096:--tokens 4096" "e16:--experts 16 --topk 1 --tokens 32768" "e1:--experts 1 --topk 1 --tokens 32768"; do
  s=${shape%%:*}; a=${shape#*:}
  fb "base_$s" "$bin/moe_ep_expert_bench" "$a"
  fb "abl1_$s" "$bin/moe_ep_expert_bench_abl1" "$a"
  fb "abl2_$s" "$bin/moe_ep_expert_bench_abl2" "$a"
  fb "base_again_$s" "$bin/moe_ep_expert_bench" "$a"
done
timeout 120 "$bin/moe_ep_gpu_tests" --gtest_filter='*OneSided*:*Unpack*:*EngineRows*:DevicePointerCache.*:EngineStreamOrder*' \
  > "$out/gpu_onesided.log" 2>&1
mark gpu_onesided $?
timeout 60 "$bin/moe_ep_onesided_bench" --tokens 128 4096 --sm-budget 64 --path sm \
  > "$out/onesided.csv" 2> "$out/onesided.log"
mark onesided_bench $?
(cd python/tests && MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" MOE_EP_CLI="$OLDPWD/$bin/moe-ep" \
  PYTHONPATH="$OLDPWD/python" PYTHONDONTWRITEBYTECODE=1 timeout 100 python3 -m unittest -v test_engine_gpu) \
  > "$out/python_engine_gpu.log" 2>&1
mark python_engine_gpu $?
timeout 90 "$bin/moe_ep_server_tests" --gtest_filter='Gpu*:CheckGpu*:*OneSided*' > "$out/server_gpu.log" 2>&1
mark server_gpu $?
# Issue 30: the NCCL plane's engine calls captured in CUDA graphs at one rank.
(sleep 50; pkill -ABRT -f engine_call_host.py) &
killer=$!
PYTHONFAULTHANDLER=1 MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 70 python3 bench/engine_call_host.py \
  --moe-ep "$bin/moe-ep" --out "$out/nccl_host" --plane nccl --ranks 1 --calls 200 \
  --graph-replays 50 > "$out/nccl_host.log" 2>&1
mark nccl_host_graph $?
kill "$killer" 2>/dev/null
which gdb > "$out/gdb.txt" 2>&1
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|^(OK|FAILED)" "$out"/*.log | sort | uniq -c > "$out/summary.txt"
for f in "$out"/fp8_*.csv; do echo "== $f"; python3 - "$f" <<'PY'
import csv, sys
for r in csv.DictReader(open(sys.argv[1])):
    print({k: r.get(k) for k in ("tokens", "experts_hit", "fp8_step_graph_p50_us", "fp8_gate_up_gemm_p50_us",
                                 "fp8_down_gemm_p50_us", "gemms_pct_fp8_peak", "gate_up_256_rows_us",
                                 "down_256_rows_us", "gate_up_128_rows_us", "down_128_rows_us")})
PY
done >> "$out/summary.txt" 2>&1
cat "$out/onesided.csv" >> "$out/summary.txt" 2>&1
cat "$out/rc.txt" "$out/summary.txt"
