#!/usr/bin/env bash
# One device call for issue 14's comparison: moe-ep (hopper, wmma, cuBLAS), then torch._grouped_mm,
# then moe-ep again (interleaved, so drift between the two sides shows). Writes CSVs into OUT_DIR.
# usage: bench/expert_bench.sh BENCH_BINARY OUT_DIR [expert_bench args...]
set -euo pipefail
bin=$1; out=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
"$bin" "$@" > "$out/moe_ep_1.csv" 2> "$out/moe_ep_1.err"
PYTHONUNBUFFERED=1 python3 "$here/expert_gemm_torch.py" > "$out/torch.csv" 2> "$out/torch.err"
"$bin" "$@" > "$out/moe_ep_2.csv" 2> "$out/moe_ep_2.err"
cat "$out/moe_ep_1.csv" "$out/torch.csv" "$out/moe_ep_2.csv"
