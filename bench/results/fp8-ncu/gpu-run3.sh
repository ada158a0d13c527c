#!/usr/bin/env bash
# Issue 35: the 256-row fp8 tiles in A-sharing 2-CTA clusters (cluster 2,
# either height now): their tests (exact against the CPU reference, bit for
# bit against one CTA a tile), then every tile variant timed alone on the
# same rows (--fp8-tile-compare) at 4096 tokens (128 experts, top-8), 128
# tokens, and 32,768 rows over 16 experts.
# Results: $2/tests.log, $2/bench_*.csv, $2/rc.txt.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && bash bench/results/fp8-ncu/gpu-run3.sh g "$OUT/r"
set -u
g=$1
out=$2
mkdir -p "$out"
source "$g/env.sh"
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
timeout 150 "$g/bin/moe_ep_gpu_tests" --gtest_filter='Fp8GroupedGemm.*:ExpertComputeFp8.*' > "$out/tests.log" 2>&1
mark tests $?
b="$g/bin/moe_ep_expert_bench --paths fp8 --fp8-tile-compare --warmup 5 --iters 30 --bound-tbps 3.35"
# shellcheck disable=SC2086
timeout 90 $b --tokens 4096 > "$out/bench_4096.csv" 2> "$out/bench_4096.log"; mark bench_4096 $?
# shellcheck disable=SC2086
timeout 60 $b --tokens 128 > "$out/bench_128.csv" 2> "$out/bench_128.log"; mark bench_128 $?
# shellcheck disable=SC2086
timeout 90 $b --experts 16 --topk 1 --tokens 32768 > "$out/bench_e16.csv" 2> "$out/bench_e16.log"; mark bench_e16 $?
grep -E "^\[  (PASSED|FAILED)|^\[  FAILED" "$out/tests.log"
cat "$out/rc.txt"
for f in "$out"/bench_*.csv; do echo "== $f"; python3 - "$f" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
for r in rows:
    print({k: r[k] for k in ("tokens", "experts_hit", "fp8_gate_up_gemm_p50_us", "fp8_down_gemm_p50_us",
                             "gemms_pct_fp8_peak", "gate_up_256_rows_us", "down_256_rows_us",
                             "gate_up_256_cluster2_us", "down_256_cluster2_us", "gate_up_128_rows_us",
                             "down_128_rows_us")})
PY
done
