#!/usr/bin/env bash
# Stop 55 (issue 30 item 3): the direct unpack of a rank alone's engine
# dispatch (OsDispatchParams::direct_unpack). 1) exact: the gtest cases
# against the window path and a host reference, the C API program at 1
# rank with it on and off and at 2 ranks (window path), the Python engine
# tests; 2) timed: the bare one-sided kernels and the engine's graph phases
# at budgets 16 and 64 with MOE_EP_ONESIDED_DIRECT_UNPACK=1 and =0 in one
# call (A, B, A again), then the host time at 2 ranks as processes.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 330 bash bench/results/engine-host/gpu-run13.sh g /tmp/r/e
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
timeout 90 "$bin/moe_ep_gpu_tests" --gtest_filter='OneSidedDirectUnpack.*:OneSidedWorld1.*' \
  > "$out/gtest_direct.log" 2>&1
mark gtest_direct $?
engine() {  # name, direct flag, plane, ranks
  MOE_EP_ONESIDED_DIRECT_UNPACK=$2 timeout 60 "$bin/moe_ep_engine_embedded" "$bin/moe-ep" "$3" "$4" \
    > "$out/engine_$1.log" 2>&1
  mark "engine_$1" $?
}
engine direct_os1 1 one-sided 1
engine window_os1 0 one-sided 1
engine os2 1 one-sided 2
(cd python/tests && MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" MOE_EP_CLI="$OLDPWD/$bin/moe-ep" \
  PYTHONPATH="$OLDPWD/python" PYTHONDONTWRITEBYTECODE=1 timeout 100 python3 -m unittest -v test_engine_gpu) \
  > "$out/python_engine_gpu.log" 2>&1
mark python_engine_gpu $?
host() {  # name, direct flag, plane, ranks, extra
  # shellcheck disable=SC2086
  MOE_EP_ONESIDED_DIRECT_UNPACK=$2 MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 40 python3 \
    bench/engine_call_host.py --moe-ep "$bin/moe-ep" --out "$out/host_$1" --plane "$3" --ranks "$4" \
    --calls 1000 $5 > "$out/host_$1.log" 2>&1
  mark "host_$1" $?
}
for b in 16 64; do
  timeout 30 "$bin/moe_ep_onesided_bench" --tokens 128 --sm-budget $b --path sm --skip-nccl \
    > "$out/onesided_sm$b.csv" 2> "$out/onesided_sm$b.log"
  mark "onesided_bench_sm$b" $?
  for v in direct:1 window:0 direct_again:1; do
    host "graph1_sm${b}_${v%%:*}" "${v#*:}" one-sided 1 \
      "--side-stream --graph-replays 1000 --onesided-sm-budget $b"
  done
done
host onesided2 1 one-sided 2 "--side-stream"
{
  grep -h -E "^\[  (PASSED|FAILED|SKIPPED)|^(OK|FAILED)|PASS|FAIL" "$out"/*.log | sort | uniq -c
  for f in "$out"/host_*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('onesided_sm_budget'), d.get('p50_us_slower_rank'), d.get('python_over_c_us'))" "$f"; done 2>&1
  tail -n +1 "$out"/onesided_sm*.csv
} > "$out/summary.txt"
cat "$out/gpu.txt" "$out/rc.txt" "$out/summary.txt"
