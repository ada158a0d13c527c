#!/usr/bin/env bash
# bundle10.sh N: builds gpu-run10.sh's variants and packs the call's bundle
# into gpu-callN/b.tar.xz (an excluded folder; carry ["gpu-callN"]). Run
# here, from the repository root, after `cmake --build build -j2`.
#   fp8 (prod3.patch on kernels/fp8_grouped_gemm.cu; every macro given):
#     p3 control, lo loads only, mo products only, or turns, mor turns +
#     products only
#   bf16 (bf16-math.patch on kernels/hopper_grouped_gemm.cu):
#     hp control, hb loads only, hm products only
# Each through variant.sh (no ninja: it would rebuild the object from the
# repository's source), which prints whether the device code differs.
set -euo pipefail
n=$1
repo=$(pwd)
src=$(mktemp -d)
cp kernels/fp8_grouped_gemm.cu kernels/hopper_grouped_gemm.cu "$src/"
patch -s "$src/fp8_grouped_gemm.cu" < bench/results/fp8-ablate/prod3.patch
patch -s "$src/hopper_grouped_gemm.cu" < bench/results/fp8-ablate/bf16-math.patch
v=bench/results/fp8-ablate/variant.sh
f="-DMOE_EP_FP8_PRODUCERS=1 -DMOE_EP_FP8_BIG_A=0"
# name: loads-only math-only order
for spec in "p3 0 0 0" "lo 1 0 0" "mo 0 1 0" "or 0 0 1" "mor 0 1 1"; do
  set -- $spec
  # shellcheck disable=SC2086
  bash $v "$1" "$src/fp8_grouped_gemm.cu" $f -DMOE_EP_FP8_LOADS_ONLY=$2 \
    -DMOE_EP_FP8_MATH_ONLY=$3 -DMOE_EP_FP8_ORDER=$4
done
for spec in "hp 0 0" "hb 1 0" "hm 0 1"; do
  set -- $spec
  UNIT=hopper_grouped_gemm bash $v "$1" "$src/hopper_grouped_gemm.cu" \
    -DMOE_EP_BF16_LOADS_ONLY=$2 -DMOE_EP_BF16_MATH_ONLY=$3
done
b=$(mktemp -d)
../shared/tools/gpu-bundle "$b" build/tests/moe_ep_gpu_tests build/client/moe-ep \
  build/server/moe-ep-worker build/kernels/moe_ep_expert_bench > /dev/null
cp -L build/server/libmoe_ep.so.0 "$b/lib/"
for x in p3 lo mo or mor hp hb hm; do cp "${VARIANT_DIR:-/tmp/abl}/$x/moe_ep_expert_bench_$x" "$b/bin/"; done
strip --strip-debug "$b"/bin/moe* "$b/lib/libmoe_ep.so.0"
mkdir -p "$b/data" && cp -r ../shared/data/models "$b/data/" && cp -r ../shared/tools/anchors "$b/"
grep -q "^/gpu-call$n/" .git/info/exclude || echo "/gpu-call$n/" >> .git/info/exclude
mkdir -p "gpu-call$n" && tar -C "$b" -cJf "gpu-call$n/b.tar.xz" .
rm -rf "$src" "$b"
ls -la "$repo/gpu-call$n"
