#!/usr/bin/env bash
# Issue 30 item 3, third call: the engine calls' host time once they
# enqueue on the engine's stream (kernels/engine_stream_order.h: one event
# record a call instead of two records and two waits) and the Python layer
# checks torch arguments in one pass; one-sided 2 ranks twice, 1 rank with
# the graph rows, NCCL 1 rank; then the GPU tests these changes touch
# (EngineStreamOrder, the one-sided kernels and dispatcher, both GPU planes'
# server tests, the one-sided integration and capability matrix, the
# embedded C API x3, the Python engine and deep_ep module on torch); then
# issue 32's floors beside the one-sided phases (bench/results/floors).
# Results in $OUT/r.tar.gz, rc.txt and summary.txt beside it.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && bash bench/results/engine-host/gpu-run4.sh g "$OUT"
set -u
g=$1
out=$2
r=$out/r
mkdir -p "$r/host" "$r/verify" "$r/floors"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
lib=$PWD/$g/lib
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" | tee -a "$out/rc.txt"; }
host() {  # NAME SUBDIR ARGS...
  local name=$1 sub=$2
  shift 2
  MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 60 python3 bench/engine_call_host.py \
    --moe-ep "$bin/moe-ep" --out "$r/host/$sub" "$@" > "$r/host/$name.log" 2>&1
  mark "host_$name" $?
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$r/gpu.txt" 2>&1
host one-sided_2 a --plane one-sided --ranks 2 --calls 1000
host one-sided_1 a --plane one-sided --ranks 1 --calls 1000
host one-sided_2b b --plane one-sided --ranks 2 --calls 1000
host nccl_1 a --plane nccl --ranks 1 --calls 300 --graph-replays 0
v=$r/verify
timeout 200 "$bin/moe_ep_gpu_tests" --gtest_filter='EngineStreamOrder*:OneSided*:DeviceCalls.*:DevicePointerCache.*' > "$v/gpu_kernels.log" 2>&1
mark gpu_kernel_tests $?
timeout 120 "$bin/moe_ep_server_tests" --gtest_filter='*OneSided*:Gpu*' > "$v/server_gpu.log" 2>&1
mark server_gpu_tests $?
timeout 120 "$bin/moe_ep_integration_tests" --gtest_filter='*GpuOneSided*:*CapabilityMatrix*' > "$v/integration_gpu.log" 2>&1
mark integration_gpu_tests $?
for args in "" "one-sided" "one-sided 2"; do
  # shellcheck disable=SC2086
  timeout 60 "$bin/moe_ep_gpu_embedded" "$bin/moe-ep" $args > "$v/embedded_${args// /_}.log" 2>&1
  mark "embedded[$args]" $?
done
(cd python/tests && MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" MOE_EP_CLI="$OLDPWD/$bin/moe-ep" \
  PYTHONPATH="$OLDPWD/python" PYTHONDONTWRITEBYTECODE=1 timeout 150 python3 -m unittest -v test_engine_gpu test_deep_ep test_engine) \
  > "$v/python_gpu.log" 2>&1
mark python_gpu $?
if [ "${FLOORS:-1}" = 1 ]; then
  BIN=$bin FLOOR_TIMEOUT=60 BENCH_TIMEOUT=120 TEST_TIMEOUT=60 bash bench/results/floors/gpu-run.sh "$r/floors"
  mark floors $?
fi
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|^(OK|FAILED)|PASS: |FAIL" "$v"/*.log | sort | uniq -c > "$out/summary.txt"
for f in "$r"/host/*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['p50_us_slower_rank'], d['python_over_c_us'])" "$f"; done >> "$out/summary.txt" 2>&1
cat "$out/summary.txt"; cat "$r/floors/stderr.log" 2>/dev/null | tail -5
tar -C "$out" -czf "$out/r.tar.gz" r && rm -rf "$r"
