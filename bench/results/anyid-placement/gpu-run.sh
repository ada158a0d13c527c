#!/usr/bin/env bash
# The GPU call of bench/results/anyid-placement/README.md (issue 34 item 2):
# every GPU kernel test of the tree, the service's GPU tests, the one-sided
# service tests (EPLB's DeepSeek-V3 tables on 4 worker processes among them)
# and `moe-ep run --targets` over 4 one-sided worker processes sharing the
# GPU with EPLB rebalancing (the run issue 34 measured failing). Usage on the
# GPU machine, from the repository root, after `source <bundle>/env.sh`:
#   BIN=<bundle>/bin bench/results/anyid-placement/gpu-run.sh OUT_DIR
set -u
out=${1:?OUT_DIR}
bin=${BIN:?BIN=<bundle>/bin}
data=${MOE_EP_DATA_DIR:?MOE_EP_DATA_DIR=<the shared data>}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
timeout 200 "$bin/moe_ep_gpu_tests" > "$out/gpu_tests.log" 2>&1
echo "exit $?" >> "$out/gpu_tests.log"
timeout 90 "$bin/moe_ep_server_tests" --gtest_filter='Gpu*:OneSidedRouteMap*' \
  > "$out/server_gpu_tests.log" 2>&1
echo "exit $?" >> "$out/server_gpu_tests.log"
MOE_EP_WORKER_BINARY="$bin/moe-ep-worker" timeout 150 "$bin/moe_ep_integration_tests" \
  --gtest_filter='*GpuOneSided*' > "$out/integration_gpu_tests.log" 2>&1
echo "exit $?" >> "$out/integration_gpu_tests.log"
# 4 worker processes on device 0 (auto picks the one-sided plane), DeepSeek-V3's
# shape with identity experts, its real prefill load, 8 redundant slots a rank,
# EPLB after step 1, every step checked against the dense reference.
pids=()
targets=""
for i in 0 1 2 3; do
  port=$((47310 + i))
  "$bin/moe-ep-worker" --listen=127.0.0.1:$port --device=0 > "$out/worker-$i.log" 2>&1 &
  pids+=($!)
  targets="$targets${targets:+,}127.0.0.1:$port"
done
sleep 3
timeout 120 "$bin/moe-ep" run --targets "$targets" --backend nccl \
  --model "$data/models/DeepSeek-V3.json" --experts identity \
  --routing "load:$data/traces/sglang_ep_statistics_deepseek/prefill_in4096.json" \
  --layers 2 --steps 3 --tokens 256 --even-tokens --redundant-slots 8 --rebalance-after 1 \
  > "$out/run-rebalance.log" 2>&1
echo "exit $?" >> "$out/run-rebalance.log"
for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
sleep 3
for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
tail -n 3 "$out"/*.log
