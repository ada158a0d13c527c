#!/usr/bin/env bash
# Issue 35 item 4: where the 4096-token fp8 GEMMs' consumer warps wait.
# Nsight Compute's full set (warp-state stall reasons, scheduler issue
# rates, tensor-pipe activity, source counters by SASS line) on the fused
# gate/up and the down kernel of the default step (256-row tiles), clocks
# as they run. Writes $2/ncu_full.txt (details page) and $2/ncu_source.txt
# (the SASS lines with the most stall samples).
#   bash bench/results/fp8-ncu/gpu-run2.sh BUNDLE OUT
set -u
g=$1
out=$2
mkdir -p "$out"
source "$g/env.sh"
# The same 32,768 rows and FLOPs over fewer, larger experts (M per expert
# 256 -> 2,048 -> 32,768): if the kernel nears the fp8 peak with large M,
# the 4096-token step loses to its per-expert tiles (few rows a weight
# tile), else to the consumers' issue structure itself.
for e in 128 16 1; do
  k=$((e < 8 ? 1 : 8)); t=$((e < 8 ? 32768 : 4096)); [ "$e" = 16 ] && k=1 && t=32768
  timeout 60 "$g/bin/moe_ep_expert_bench" --paths fp8 --experts "$e" --topk "$k" --tokens "$t" \
    --warmup 5 --iters 50 --bound-tbps 3.35 > "$out/bench_experts$e.csv" 2>> "$out/bench.log"
  echo "bench experts $e rc $?" >> "$out/rc.txt"
done
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
timeout 150 "$ncu" --clock-control none -k regex:Fp8GroupedGemm --launch-skip 2 --launch-count 2 \
  --set full --import-source no -f -o "$out/fp8_full" \
  "$g/bin/moe_ep_expert_bench" --paths fp8 --tokens 4096 --warmup 2 --iters 2 > "$out/ncu_run.log" 2>&1
echo "ncu rc $?" >> "$out/rc.txt"
"$ncu" -i "$out/fp8_full.ncu-rep" --page details --print-details all > "$out/ncu_full.txt" 2>&1
"$ncu" -i "$out/fp8_full.ncu-rep" --page source --csv --print-source sass > "$out/ncu_source_all.csv" 2>&1
# Keep the 60 SASS lines with the most warp stall samples of each kernel.
python3 - "$out/ncu_source_all.csv" > "$out/ncu_source.txt" 2>&1 <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
hdr = None
blocks, cur = [], []
for r in rows:
    if r and r[0] in ("Address", "# Address") or (r and "Source" in r and "Address" in r[0]):
        if cur: blocks.append((hdr, cur))
        hdr, cur = r, []
    elif hdr and len(r) == len(hdr):
        cur.append(r)
if cur: blocks.append((hdr, cur))
for hdr, body in blocks:
    cols = [i for i, h in enumerate(hdr) if "Warp Stall Sampling (All" in h]
    if not cols: print("columns:", hdr); continue
    c = cols[0]
    def val(r):
        try: return float(r[c].replace(",", ""))
        except ValueError: return 0.0
    total = sum(val(r) for r in body)
    print("== kernel block: %d lines, %.0f samples; header: %s" % (len(body), total, hdr[:6]))
    for r in sorted(body, key=val, reverse=True)[:60]:
        print("%6.2f%%  %s" % (100 * val(r) / max(total, 1), " | ".join(r[:2])))
PY
ls -la "$out"
