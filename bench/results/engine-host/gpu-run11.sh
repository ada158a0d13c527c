#!/usr/bin/env bash
# Stop 50's device call, ordered for a short device budget: what decides
# the most first. 1) the fused unpack of the one-sided engine
# dispatch (MOE_EP_ONESIDED_FUSED_UNPACK=1) exact in the C API program at 2
# ranks, then its host time against the default (2 ranks as processes, 128
# tokens, H 7168, top-8, an engine stream of its own); 2) the nccl refused
# combine (kernel, dispatcher and graph tests; the C API program at nccl 1);
# 3) the rest of the fused unpack's checks (1 and 4 ranks, the one-sided GPU
# tests); 4) the Python checks piece by piece, the nccl plane's host time, a
# second timing round, the server and Python GPU tests. Everything a step
# writes lands in $2 as it ends, so a cut-off call still returns it.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && bash bench/results/engine-host/gpu-run11.sh g "$OUT/r"
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
engine() {  # fused, plane, ranks
  MOE_EP_ONESIDED_FUSED_UNPACK=$1 timeout 90 "$bin/moe_ep_engine_embedded" "$bin/moe-ep" "$2" "$3" \
    > "$out/engine_fused$1_$2_$3.log" 2>&1
  mark "engine[fused $1, $2 $3]" $?
}
host() {  # mode (fused|unfused), round
  local flag=1
  [ "$1" = unfused ] && flag=0
  MOE_EP_ONESIDED_FUSED_UNPACK=$flag MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 60 python3 \
    bench/engine_call_host.py --moe-ep "$bin/moe-ep" --out "$out/host/$1$2" --plane one-sided \
    --ranks 2 --calls 1000 --side-stream > "$out/host/$1$2.log" 2>&1
  mark "host_$1$2" $?
}
engine 1 one-sided 2
host fused 1
host unfused 1
timeout 150 "$bin/moe_ep_gpu_tests" \
  --gtest_filter='LaunchCombineReduce.*:LaunchWriteStepHeader.*:LaunchCheckStepHeaders.*:GpuEpDispatcher.*Refuse*:GpuEpDispatcher.Ep1*:GpuEpDispatcher.Graph*' \
  > "$out/gpu_refusal.log" 2>&1
mark gpu_refusal $?
engine 0 nccl 1
engine 1 one-sided 1
engine 1 one-sided 4
engine 0 one-sided 2
timeout 150 "$bin/moe_ep_gpu_tests" --gtest_filter='*OneSided*:EngineStreamOrder*:*Unpack*:*EngineRows*' \
  > "$out/gpu_onesided.log" 2>&1
mark gpu_onesided $?
timeout 60 python3 bench/python_checks_bench.py --out "$out/python_checks.json" > "$out/python_checks.log" 2>&1
mark python_checks $?
MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 60 python3 bench/engine_call_host.py \
  --moe-ep "$bin/moe-ep" --out "$out/host/nccl1" --plane nccl --ranks 1 --calls 1000 --graph-replays 0 \
  --side-stream > "$out/host/nccl1.log" 2>&1
mark host_nccl1 $?
host fused 2
host unfused 2
timeout 90 "$bin/moe_ep_server_tests" --gtest_filter='Gpu*:CheckGpu*:*OneSided*' > "$out/server_gpu.log" 2>&1
mark server_gpu $?
(cd python/tests && MOE_EP_ONESIDED_FUSED_UNPACK=1 MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" MOE_EP_CLI="$OLDPWD/$bin/moe-ep" \
  PYTHONPATH="$OLDPWD/python" PYTHONDONTWRITEBYTECODE=1 timeout 100 python3 -m unittest -v test_engine_gpu) \
  > "$out/python_engine_gpu.log" 2>&1
mark python_engine_gpu $?
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|^(OK|FAILED)|PASS: |FAIL" "$out"/*.log | grep -v "^\[20" | sort | uniq -c > "$out/summary.txt"
for f in "$out"/host/*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print([{k: v['p50'] for k, v in x.items() if isinstance(v, dict) and 'p50' in v} for x in d['per_rank']], d['python_over_c_us'])" "$f"; done >> "$out/summary.txt" 2>&1
cat "$out/rc.txt" "$out/summary.txt"
