#!/usr/bin/env bash
# Stop 55, second call (issue 30 item 3): the direct unpack now also writes
# a rank's own slab at EP > 1 (the unpack copies the peers' only). The
# direct-unpack gtests again (call 13's second case had a wrong invalid id),
# the C API program at one-sided 2 and 4 with it on and off, then the
# engine's graph phases at 2 ranks as processes sharing the GPU
# (engine_call_host.py now replays graphs at any rank count on the
# one-sided plane), direct on / off / on, beside the bare one-sided kernels
# at EP 2, budgets 16 and 64, in one call.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 280 bash bench/results/engine-host/gpu-run14.sh g /tmp/r/e
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
timeout 60 "$bin/moe_ep_gpu_tests" --gtest_filter='OneSidedDirectUnpack.*' > "$out/gtest_direct.log" 2>&1
mark gtest_direct $?
engine() {  # name, direct flag, ranks
  MOE_EP_ONESIDED_DIRECT_UNPACK=$2 timeout 60 "$bin/moe_ep_engine_embedded" "$bin/moe-ep" one-sided "$3" \
    > "$out/engine_$1.log" 2>&1
  mark "engine_$1" $?
}
engine direct_os2 1 2
engine window_os2 0 2
engine direct_os4 1 4
engine direct_os1 1 1
(cd python/tests && MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" MOE_EP_CLI="$OLDPWD/$bin/moe-ep" \
  PYTHONPATH="$OLDPWD/python" PYTHONDONTWRITEBYTECODE=1 timeout 60 python3 -m unittest -v test_engine_gpu) \
  > "$out/python_engine_gpu.log" 2>&1
mark python_engine_gpu $?
host() {  # name, ranks, extra, direct flag
  # shellcheck disable=SC2086
  MOE_EP_ONESIDED_DIRECT_UNPACK=${4:-1} MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 60 python3 bench/engine_call_host.py \
    --moe-ep "$bin/moe-ep" --out "$out/host_$1" --plane one-sided --ranks "$2" --calls 1000 $3 \
    > "$out/host_$1.log" 2>&1
  mark "host_$1" $?
}
for b in 16 64; do
  timeout 30 "$bin/moe_ep_onesided_bench" --tokens 128 --sm-budget $b --path sm --skip-nccl \
    > "$out/onesided_sm$b.csv" 2> "$out/onesided_sm$b.log"
  mark "onesided_bench_sm$b" $?
  a="--side-stream --graph-replays 1000 --onesided-sm-budget $b"
  host "graph2_sm${b}_direct" 2 "$a" 1
  host "graph2_sm${b}_window" 2 "$a" 0
  host "graph2_sm${b}_direct_again" 2 "$a" 1
done
{
  grep -h -E "^\[  (PASSED|FAILED|SKIPPED)|PASS|FAIL" "$out"/*.log | sort | uniq -c
  for f in "$out"/host_*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('onesided_sm_budget'), d.get('p50_us_slower_rank'), d.get('python_over_c_us'))" "$f"; done 2>&1
  tail -n +1 "$out"/onesided_sm*.csv
} > "$out/summary.txt"
cat "$out/gpu.txt" "$out/rc.txt" "$out/summary.txt"
