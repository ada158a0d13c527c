#!/usr/bin/env bash
# Issue 30 item 3: the one-sided engine dispatch unpacks inside its send
# kernel (OsDispatchParams::fuse_unpack, one launch instead of two). First
# correctness (the C API program's exact checks of received rows, padding
# and counts at 1, 2 and 4 ranks; the one-sided kernel, server and Python
# GPU tests), then the calls' host time, 2 ranks as processes, 128 tokens,
# H 7168, top-8, an engine stream of its own (--side-stream), fused
# (MOE_EP_ONESIDED_FUSED_UNPACK=1) against the default (the unpack a kernel
# of its own), alternated twice in this one call. Written at stop 49, not
# run (no device time was left): the fused path is off by default until it
# passes here.
# Results: $2/*.log, $2/host/*, $2/rc.txt, $2/summary.txt.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && bash bench/results/engine-host/gpu-run9.sh g "$OUT/r"
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
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
for fused in 1 0; do
  for args in "one-sided 1" "one-sided 2" "one-sided 4"; do
    # shellcheck disable=SC2086
    MOE_EP_ONESIDED_FUSED_UNPACK=$fused timeout 90 "$bin/moe_ep_engine_embedded" "$bin/moe-ep" \
      $args > "$out/engine_fused${fused}_${args// /_}.log" 2>&1
    mark "engine[fused $fused, $args]" $?
  done
done
timeout 120 "$bin/moe_ep_gpu_tests" --gtest_filter='*OneSided*:EngineStreamOrder*:*Unpack*:*EngineRows*' > "$out/gpu_onesided.log" 2>&1
mark gpu_onesided $?
timeout 90 "$bin/moe_ep_server_tests" --gtest_filter='Gpu*:CheckGpu*:*OneSided*' > "$out/server_gpu.log" 2>&1
mark server_gpu $?
(cd python/tests && MOE_EP_ONESIDED_FUSED_UNPACK=1 MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" MOE_EP_CLI="$OLDPWD/$bin/moe-ep" \
  PYTHONPATH="$OLDPWD/python" PYTHONDONTWRITEBYTECODE=1 timeout 100 python3 -m unittest -v test_engine_gpu) \
  > "$out/python_engine_gpu.log" 2>&1
mark python_engine_gpu $?
for round in 1 2; do
  for mode in fused unfused; do
    flag=1
    [ "$mode" = unfused ] && flag=0
    MOE_EP_ONESIDED_FUSED_UNPACK=$flag MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 60 python3 \
      bench/engine_call_host.py --moe-ep "$bin/moe-ep" --out "$out/host/$mode$round" --plane one-sided \
      --ranks 2 --calls 1000 --side-stream > "$out/host/$mode$round.log" 2>&1
    mark "host_$mode$round" $?
  done
done
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|^(OK|FAILED)|PASS: |FAIL" "$out"/*.log | grep -v "^\[20" | sort | uniq -c > "$out/summary.txt"
for f in "$out"/host/*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print([{k: v['p50'] for k, v in x.items() if k.startswith(('c_', 'py_d', 'py_c'))} for x in d['per_rank']], d['python_over_c_us'])" "$f"; done >> "$out/summary.txt" 2>&1
cat "$out/rc.txt" "$out/summary.txt"
