#!/usr/bin/env bash
# Issue 30 item 3, second call: the engine calls' host time after the send
# kernel zeroes the engine's counts (no cudaMemsetAsync in the unpack), the
# combine kernel reads the engine's expert outputs in place, and the Python
# layer's lock / tensor-check / combine(out=) changes; "new" (this tree)
# beside "old" (BUNDLE/old: the library and Python package of 64751e3),
# alternated in one call; a gperftools CPU profile of the new one-sided C
# calls; then the GPU tests these changes touch: the one-sided and engine
# kernel tests, both GPU planes' server tests, the one-sided integration and
# capability matrix, the embedded C API (NCCL 1, one-sided 1 and 2
# processes) and the Python engine on torch. FULL=1 adds a second new run,
# the old 1-rank run, NCCL, the CPU profile and the integration tests. Results are packed in one
# tarball ($OUT/r.tar.gz) with rc.txt and summary.txt beside it.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && bash bench/results/engine-host/gpu-run2.sh g "$OUT"
set -u
g=$1
out=$2
r=$out/r
mkdir -p "$r/host" "$r/prof" "$r/verify"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
lib=$PWD/$g/lib
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" | tee -a "$out/rc.txt"; }
host() {  # host new|old NAME SUBDIR ARGS...
  local which=$1 name=$2 sub=$3
  shift 3
  if [ "$which" = new ]; then
    MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 60 python3 bench/engine_call_host.py \
      --moe-ep "$bin/moe-ep" --out "$r/host/$which$sub" "$@" > "$r/host/${which}_$name.log" 2>&1
  else
    MOE_EP_LIBRARY="$PWD/$g/old/libmoe_ep.so.0" timeout 60 python3 "$g/old/tree/bench/engine_call_host.py" \
      --moe-ep "$bin/moe-ep" --out "$r/host/$which$sub" "$@" > "$r/host/${which}_$name.log" 2>&1
  fi
  mark "host_${which}_$name" $?
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$r/gpu.txt" 2>&1
host new one-sided_2 a --plane one-sided --ranks 2 --calls 1000
host old one-sided_2 a --plane one-sided --ranks 2 --calls 1000
host new one-sided_1 a --plane one-sided --ranks 1 --calls 1000
if [ "${FULL:-0}" = 1 ]; then
  host new one-sided_2b b --plane one-sided --ranks 2 --calls 1000
  host old one-sided_1 a --plane one-sided --ranks 1 --calls 1000
  host new nccl_1 a --plane nccl --ranks 1 --calls 300 --graph-replays 0
  MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 60 python3 bench/engine_call_host.py --moe-ep "$bin/moe-ep" \
    --plane one-sided --ranks 2 --calls 100 --profile --profile-calls 8000 \
    --profiler-lib "$lib/libprofiler.so.0" --out "$r/prof" > "$r/prof/profile.log" 2>&1
  mark profile $?
  for f in "$r"/prof/cpu.*.prof; do
    [ -f "$f" ] || continue
    for call in moe_ep_dispatch moe_ep_combine; do
      timeout 30 "$bin/google-pprof" --text --focus=$call "$(command -v python3)" "$f" > "$f.$call.txt" 2>&1
    done
  done
fi
v=$r/verify
timeout 120 "$bin/moe_ep_gpu_tests" --gtest_filter='OneSided*:DeviceCalls.*:DevicePointerCache.*' > "$v/gpu_kernels.log" 2>&1
mark gpu_kernel_tests $?
timeout 120 "$bin/moe_ep_server_tests" --gtest_filter='*OneSided*' > "$v/server_gpu.log" 2>&1
mark server_gpu_tests $?
if [ "${FULL:-0}" = 1 ]; then
  timeout 120 "$bin/moe_ep_integration_tests" --gtest_filter='*GpuOneSided*:*CapabilityMatrix*' > "$v/integration_gpu.log" 2>&1
  mark integration_gpu_tests $?
fi
for args in "" "one-sided" "one-sided 2"; do
  # shellcheck disable=SC2086
  timeout 60 "$bin/moe_ep_gpu_embedded" "$bin/moe-ep" $args > "$v/embedded_${args// /_}.log" 2>&1
  mark "embedded[$args]" $?
done
(cd python/tests && MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" MOE_EP_CLI="$OLDPWD/$bin/moe-ep" \
  PYTHONPATH="$OLDPWD/python" PYTHONDONTWRITEBYTECODE=1 timeout 100 python3 -m unittest -v test_engine_gpu) \
  > "$v/python_engine_gpu.log" 2>&1
mark python_engine_gpu $?
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|^(OK|FAILED)|PASS: |FAIL" "$v"/*.log | sort | uniq -c > "$out/summary.txt"
for f in "$r"/host/*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['p50_us_slower_rank'], d['python_over_c_us'])" "$f"; done >> "$out/summary.txt" 2>&1
cat "$out/summary.txt"
tar -C "$out" -czf "$out/r.tar.gz" r && rm -rf "$r"
