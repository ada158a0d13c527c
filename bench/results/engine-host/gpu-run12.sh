#!/usr/bin/env bash
# Stop 51's device call: Worker.dispatch(out=) / combine(out=)'s one-pass
# path (the Python layer's host time over the C call, issue 30 item 3: target
# <= 5 us) against the C call, twice; the library's device-ordinal pointer
# check it leans on (DevicePointerCache, the Python GPU tests' host-tensor
# cases); the checks of the step header's device function (dfe250f:
# LaunchCheckStepHeaders.*, LaunchCombineReduce.*, unrun since); the Python
# checks piece by piece; the one-sided combine reading its own rows in place
# (issue 32): the one-sided GPU tests, then moe_ep_onesided_bench at 128 and
# 4096 tokens with the old push (MOE_EP_ONESIDED_PUSH_OWN=1; the default when
# this ran) and with it (=0, the default since). Results land in $2 as each step ends.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && bash bench/results/engine-host/gpu-run12.sh g /tmp/r; tar -C /tmp/r -czf "$OUT/r.tgz" .
set -u
g=$1
out=$2
mkdir -p "$out/host"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
lib=$PWD/$g/lib
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$out/gpu.txt" 2>&1
host() {  # round
  MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 60 python3 bench/engine_call_host.py \
    --moe-ep "$bin/moe-ep" --out "$out/host/r$1" --plane one-sided --ranks 2 --calls 1000 \
    --side-stream > "$out/host/r$1.log" 2>&1
  mark "host_r$1" $?
}
host 1
(cd python/tests && MOE_EP_ONESIDED_PUSH_OWN=0 MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" MOE_EP_CLI="$OLDPWD/$bin/moe-ep" \
  PYTHONPATH="$OLDPWD/python" PYTHONDONTWRITEBYTECODE=1 timeout 100 python3 -m unittest -v test_engine_gpu) \
  > "$out/python_engine_gpu.log" 2>&1
mark python_engine_gpu $?
MOE_EP_ONESIDED_PUSH_OWN=0 timeout 150 "$bin/moe_ep_gpu_tests" \
  --gtest_filter='*OneSided*:EngineStreamOrder*:*Unpack*:*EngineRows*' > "$out/gpu_onesided.log" 2>&1
mark gpu_onesided $?
ob() {  # name, push_own, extra flags
  MOE_EP_ONESIDED_PUSH_OWN=$2 timeout 120 "$bin/moe_ep_onesided_bench" --tokens 128 4096 \
    --sm-budget 64 --path sm $3 > "$out/onesided_$1.csv" 2> "$out/onesided_$1.log"
  mark "onesided_bench_$1" $?
}
ob pushown 1 ""
ob inplace 0 --skip-nccl
timeout 150 "$bin/moe_ep_gpu_tests" \
  --gtest_filter='DevicePointerCache.*:LaunchCombineReduce.*:LaunchWriteStepHeader.*:LaunchCheckStepHeaders.*:GpuEpDispatcher.*Refuse*:GpuEpDispatcher.Ep1*' \
  > "$out/gpu_checks.log" 2>&1
mark gpu_checks $?
timeout 60 python3 bench/python_checks_bench.py --out "$out/python_checks.json" > "$out/python_checks.log" 2>&1
mark python_checks $?
host 2
for pr in "one-sided 2" "nccl 1"; do
  set -- $pr
  timeout 90 "$bin/moe_ep_engine_embedded" "$bin/moe-ep" "$1" "$2" > "$out/engine_$1_$2.log" 2>&1
  mark "engine[$1 $2]" $?
done
timeout 90 "$bin/moe_ep_server_tests" --gtest_filter='Gpu*:CheckGpu*:*OneSided*' > "$out/server_gpu.log" 2>&1
mark server_gpu $?
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|^(OK|FAILED)|PASS: |FAIL" "$out"/*.log | grep -v "^\[20" | sort | uniq -c > "$out/summary.txt"
for f in "$out"/host/*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print([{k: v['p50'] for k, v in x.items() if isinstance(v, dict) and 'p50' in v} for x in d['per_rank']], d['python_over_c_us'])" "$f"; done >> "$out/summary.txt" 2>&1
cat "$out/python_checks.json" "$out"/onesided_*.csv >> "$out/summary.txt" 2>&1
cat "$out/rc.txt" "$out/summary.txt"
