#!/usr/bin/env bash
# Issue 30 item 1 on the NCCL plane (ea83556..baa5451): the refusal's
# one-GPU tests (step header, RefuseStep at EP 1), the NCCL dispatcher's and
# both GPU planes' tests around it (the step header record grew), the
# capability matrix (new RefusedDispatchFreesThePeers cell), the embedded C
# API x3; then the fp8 consumer stall profile (fp8-ncu/gpu-run2.sh).
# Results: $2/v/*.log, $2/rc.txt, $2/summary.txt, $2/ncu/.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && bash bench/results/engine-host/gpu-run7.sh g "$OUT"
set -u
g=$1
out=$2
v=$out/v
mkdir -p "$v"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$out/rc.txt"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
timeout 60 "$bin/moe_ep_gpu_tests" --gtest_filter='LaunchWriteStepHeader.*:LaunchCheckStepHeaders.*:GpuEpDispatcher.*:*RefusedStep*:EngineStreamOrder*' > "$v/gpu_refusal.log" 2>&1
mark gpu_refusal $?
[ "${REST:-1}" = 1 ] && timeout 150 "$bin/moe_ep_gpu_tests" --gtest_filter='-LaunchWriteStepHeader.*:LaunchCheckStepHeaders.*:GpuEpDispatcher.*:*RefusedStep*:EngineStreamOrder*:Fp8GroupedGemm.*:ExpertComputeFp8.*:*Mxfp4*' > "$v/gpu_rest.log" 2>&1
mark gpu_rest $?
timeout 60 "$bin/moe_ep_server_tests" --gtest_filter='Gpu*:CheckGpu*:DeviceTokensSent.*:StepCountStats.*:*OneSided*' > "$v/server_gpu.log" 2>&1
mark server_gpu $?
timeout 90 "$bin/moe_ep_integration_tests" --gtest_filter='*CapabilityMatrix*' > "$v/matrix.log" 2>&1
mark matrix $?
for args in "" "one-sided" "one-sided 2" "nccl 2"; do
  # shellcheck disable=SC2086
  timeout 40 "$bin/moe_ep_gpu_embedded" "$bin/moe-ep" $args > "$v/embedded_${args// /_}.log" 2>&1
  mark "embedded[$args]" $?
done
grep -h -E "^\[  (PASSED|FAILED)|^\[  FAILED|PASS: |FAIL|SKIP" "$v"/*.log | sort | uniq -c > "$out/summary.txt"
cat "$out/rc.txt" "$out/summary.txt"
if [ "${NCU:-1}" = 1 ]; then
  bash bench/results/fp8-ncu/gpu-run2.sh "$g" "$out/ncu" > "$out/ncu.log" 2>&1
  mark ncu $?
  head -c 3000 "$out/ncu/ncu_source.txt"
fi
