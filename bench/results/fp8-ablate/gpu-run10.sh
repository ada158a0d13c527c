#!/usr/bin/env bash
# Stop 58's first call (issues 35 and 32, asked for on an H200, the card
# both issues name). In one process order:
#  1. stop 57's unrun Python test (Worker.receive_output, issue 30);
#  2. the fp8 step at 1 / 128 / 4096 tokens beside torch._scaled_grouped_mm,
#     and the bf16 step beside torch._grouped_mm (moe-ep, anchor, moe-ep);
#  3. the split of each GEMM's time that call 5 left half done: loads only
#     (`lo`: no products) against products only (`mo`: no loads, the stage
#     marked full at once), beside the control built the same way (`p1`).
#     If full ~ loads + products, the two do not overlap; if full ~ max of
#     them, the longer is the bound. fp8 from prod3.patch, bf16 from
#     bf16-math.patch (hp control, hb loads only, hm products only).
#  4. `or`: the consumer warpgroups take turns issuing their sub-tile
#     products (prod3.patch, MOE_EP_FP8_ORDER: named barriers), so that one's
#     wait and promotion overlap the other's products, which today start and
#     end together; `mor` the same with no loads. p3: the control from
#     prod3.patch (ORDER 0), built like the variants.
# Bundle: bench/results/fp8-ablate/bundle10.sh N (builds the variants). Then:
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 560 bash bench/results/fp8-ablate/gpu-run10.sh g /tmp/r; tar -C /tmp/r -czf "$OUT/r.tgz" .
set -u
g=$1
out=$2
mkdir -p "$out"
source "$g/env.sh"
bin=$g/bin
export MOE_EP_DATA_DIR="$PWD/$g/data"
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
# The step-path kernel preload (kernels/kernel_preload.h) in a fresh process
# first, then the suites that create the dispatchers and ExpertCompute with it.
timeout 60 "$bin/moe_ep_gpu_tests" --gtest_filter='KernelPreload.*' > "$out/gtest_preload.log" 2>&1
mark gtest_preload $?
timeout 150 "$bin/moe_ep_gpu_tests" --gtest_filter='OneSided*:ExpertCompute*:GpuEpDispatcher.Ep1*:Fp8GroupedGemm.*' \
  > "$out/gtest_step.log" 2>&1
mark gtest_step $?
(cd python/tests && MOE_EP_LIBRARY=$PWD/../../$g/lib/libmoe_ep.so.0 MOE_EP_CLI=$PWD/../../$g/bin/moe-ep \
   timeout 90 python3 -m unittest -v test_engine_gpu.OneSidedOneGpuTest) > "$out/py_onesided.log" 2>&1
mark py_onesided $?
fa=(--paths fp8 --tokens 1 128 4096 --warmup 20 --iters 300 --bound-tbps 4.8)
timeout 90 "$bin/moe_ep_expert_bench" "${fa[@]}" > "$out/fp8_1.csv" 2> "$out/fp8_1.log"
mark fp8_1 $?
PYTHONUNBUFFERED=1 timeout 90 python3 "$g/anchors/expert_fp8_torch.py" 1 128 4096 > "$out/fp8_torch.jsonl" 2> "$out/fp8_torch.log"
mark fp8_torch $?
timeout 90 "$bin/moe_ep_expert_bench" "${fa[@]}" > "$out/fp8_2.csv" 2> "$out/fp8_2.log"
mark fp8_2 $?
ba=(--paths hopper --tokens 1 128 4096 --warmup 10 --iters 300)
timeout 60 "$bin/moe_ep_expert_bench" "${ba[@]}" > "$out/bf16_1.csv" 2> "$out/bf16_1.log"
mark bf16_1 $?
PYTHONUNBUFFERED=1 timeout 90 python3 "$g/anchors/expert_gemm_torch.py" 1 128 4096 > "$out/bf16_torch.jsonl" 2> "$out/bf16_torch.log"
mark bf16_torch $?
timeout 60 "$bin/moe_ep_expert_bench" "${ba[@]}" > "$out/bf16_2.csv" 2> "$out/bf16_2.log"
mark bf16_2 $?
fb() {  # name, binary, shape args
  # shellcheck disable=SC2086
  timeout 40 "$2" --paths fp8 --warmup 10 --iters 100 $3 > "$out/abl_$1.csv" 2> "$out/abl_$1.log"
  mark "abl_$1" $?
}
for shape in "t4096:--tokens 4096" "e16:--experts 16 --topk 1 --tokens 32768"; do
  s=${shape%%:*}; a=${shape#*:}
  for v in p3 lo mo or mor p3_again; do fb "${v}_$s" "$bin/moe_ep_expert_bench_${v%_again}" "$a"; done
done
for v in hp hb hm hp_again; do
  timeout 40 "$bin/moe_ep_expert_bench_${v%_again}" --paths hopper --tokens 128 4096 --warmup 5 \
    --iters 50 > "$out/babl_$v.csv" 2> "$out/babl_$v.log"
  mark "babl_$v" $?
done
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw --format=csv >> "$out/gpu.txt" 2>&1
{
  grep -h -E "^(OK|FAILED|Ran )" "$out/py_onesided.log"
  grep -h -E "^\[  (PASSED|FAILED)|not loaded before" "$out"/gtest_*.log
  echo "abl: name step_us gate_up_us down_us fp8_vs_bf16_max_rel"
  for f in "$out"/abl_*.csv; do echo "$(basename "$f" .csv) $(tail -1 "$f" | cut -d, -f7,8,9,21)"; done
  for f in "$out"/babl_*.csv; do echo "$(basename "$f" .csv)"; tail -2 "$f" | cut -d, -f1,8,10,15; done
  tail -n +1 "$out"/fp8_*.csv "$out"/fp8_torch.jsonl "$out"/bf16_*.csv "$out"/bf16_torch.jsonl
} > "$out/summary.txt"
cat "$out/rc.txt" "$out/summary.txt"
