#!/usr/bin/env bash
# variant.sh NAME SRC [NVCC FLAGS...]: the expert bench linked with SRC in
# place of kernels/$unit.cu (no ninja: it would rebuild the object
# from the repository's source), at $VARIANT_DIR/NAME/moe_ep_expert_bench_NAME
# (VARIANT_DIR defaults to /tmp/abl; UNIT=hopper_grouped_gemm for the bf16
# kernel). Prints whether the device code differs from the build's own: "SAME"
# means ninja's trap again; "differs" holds for the same source built from
# another path too, so a control built this way (p1) is timed beside them.
set -e
name=$1; src=$2; shift 2; unit=${UNIT:-fp8_grouped_gemm}
d=${VARIANT_DIR:-/tmp/abl}/$name; rm -rf "$d"; mkdir -p "$d"
cd /work/main/build
obj=kernels/CMakeFiles/moe_ep_kernels.dir/$unit.cu.o
cmd=$(ninja -t commands kernels/moe_ep_expert_bench | grep "$unit.cu" | head -1)
v=$(echo "$cmd" | sed "s|/work/main/kernels/$unit.cu|$src|; s| -c | $* -I/work/main/kernels -c |; s|-o $obj|-o $d/$unit.cu.o|; s|-MF [^ ]*||; s|-MD||")
eval "$v"
cp kernels/libmoe_ep_kernels.a "$d/k.a"
(cd "$d" && ar r k.a "$unit.cu.o")
link=$(ninja -t commands kernels/moe_ep_expert_bench | tail -1 | sed "s|^: && ||; s| kernels/libmoe_ep_kernels.a | $d/k.a |; s|-o kernels/moe_ep_expert_bench|-o $d/moe_ep_expert_bench_$name|; s| && :\$||")
eval "$link"
objcopy --dump-section .nv_fatbin="$d/fatbin" "$d/moe_ep_expert_bench_$name" /dev/null
objcopy --dump-section .nv_fatbin="$d/base.fatbin" kernels/moe_ep_expert_bench /dev/null
if cmp -s "$d/fatbin" "$d/base.fatbin"; then echo "$name: SAME device code as the base build"; else echo "$name: device code differs from base"; fi
