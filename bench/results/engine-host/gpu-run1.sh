#!/usr/bin/env bash
# Issue 30 item 3 and issue 34's owed GPU run, in one device call: the engine
# calls' host time (bench/engine_call_host.py: 128 tokens, H 7168, top-8, 256
# experts; one-sided at 2 and 1 ranks as processes sharing the GPU, NCCL at 1
# rank), this tree ("new") beside the library and Python package of the
# commit before the host-path changes ("old", BUNDLE/old), alternated in the
# same call; a gperftools CPU profile of the new one-sided C calls at 2
# ranks; then bench/results/plane-core/gpu-run3.sh (whole GPU test binary,
# both planes' server tests, capability matrix, embedded C API, Python engine
# on torch, the DeepSeek-V3 fp8 and gpt-oss-120b main jobs).
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && bash bench/results/engine-host/gpu-run1.sh g "$OUT"
set -u
g=$1
out=$2
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0
bin=$g/bin
lib=$PWD/$g/lib
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" | tee -a "$out/rc.txt"; }
host() {  # host new|old NAME ARGS...
  local which=$1 name=$2
  shift 2
  if [ "$which" = new ]; then
    MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 100 python3 bench/engine_call_host.py \
      --moe-ep "$bin/moe-ep" --out "$out/host/new" "$@" > "$out/host/new_$name.log" 2>&1
  else
    MOE_EP_LIBRARY="$PWD/$g/old/libmoe_ep.so.0" timeout 100 python3 "$g/old/tree/bench/engine_call_host.py" \
      --moe-ep "$bin/moe-ep" --out "$out/host/old" "$@" > "$out/host/old_$name.log" 2>&1
  fi
  mark "host_${which}_$name" $?
}
mkdir -p "$out/host"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/host/gpu.txt" 2>&1
for which in new old new; do
  host $which one-sided_2 --plane one-sided --ranks 2 --calls 1000
done
for which in new old; do
  host $which one-sided_1 --plane one-sided --ranks 1 --calls 1000
  host $which nccl_1 --plane nccl --ranks 1 --calls 1000
done
MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 100 python3 bench/engine_call_host.py --moe-ep "$bin/moe-ep" \
  --plane one-sided --ranks 2 --calls 100 --profile --profile-calls 10000 \
  --profiler-lib "$lib/libprofiler.so.0" --out "$out/prof" > "$out/host/profile.log" 2>&1
mark profile $?
for f in "$out"/prof/cpu.*.prof; do
  [ -f "$f" ] || continue
  "$bin/google-pprof" --text --focus=moe_ep_dispatch "$(command -v python3)" "$f" > "$f.dispatch.txt" 2>&1 || true
  "$bin/google-pprof" --text --focus=moe_ep_combine "$(command -v python3)" "$f" > "$f.combine.txt" 2>&1 || true
done
tail -qn 1 "$out"/host/*.log
mkdir -p "$out/verify"
bash bench/results/plane-core/gpu-run3.sh "$g" "$out/verify" > "$out/verify/summary.txt" 2>&1
cat "$out/verify/summary.txt"
