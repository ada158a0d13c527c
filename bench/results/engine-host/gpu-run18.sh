#!/usr/bin/env bash
# Stop 57, first call (issue 30 item 3): the receive buffers (the peers
# store their rows in place: OsDispatchParams::peer_direct). The
# receive-buffers gtests first, then 2 ranks as processes under MPS: the
# engine's graph phases into the receive buffers against its own buffers
# and the bare kernels, side by side in the same call; then stop 56's
# unrun commits (gpu-run15.sh: the direct-unpack gtests, the C API program
# at one-sided 1/2/4, now with its receive-buffers step; the copy-engine
# gtests), in what time is left.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 570 bash bench/results/engine-host/gpu-run18.sh g /tmp/r/e
set -u
g=$1
out=$2
# Absolute, and not `here`: env.sh sets a variable of that name.
run_dir=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out/verify"
(source "$g/env.sh"; export NCCL_NVLS_ENABLE=0
 timeout 90 "$g/bin/moe_ep_gpu_tests" --gtest_filter='OneSidedReceiveBuffers.*' \
   > "$out/verify/gtest_receive.log" 2>&1; echo "gtest_receive rc $?" >> "$out/verify/rc.txt")
mkdir -p "$out/timed"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
lib=$PWD/$g/lib
o=$out/timed
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$o/rc.txt"; }
host() {  # name, extra
  # shellcheck disable=SC2086
  MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 40 python3 bench/engine_call_host.py \
    --moe-ep "$bin/moe-ep" --out "$o/host_$1" --plane one-sided --ranks 2 --calls 1000 $2 \
    > "$o/host_$1.log" 2>&1
  mark "host_$1" $?
}
# 2 ranks as processes sharing the GPU under MPS (call 15's setting: a user
# daemon with private pipe and log folders, quit however the script ends;
# no setting of the card changes).
mps=$(mktemp -d)
mkdir -p "$mps/pipe" "$mps/log"
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
if command -v nvidia-cuda-mps-control > /dev/null && nvidia-cuda-mps-control -d; then
  trap 'echo quit | timeout 20 nvidia-cuda-mps-control' EXIT
  mark mps_started 0
  sleep 1
  for b in 16 64; do
    timeout 30 "$bin/moe_ep_onesided_bench" --tokens 128 --sm-budget $b --path sm --skip-nccl \
      > "$o/mps_onesided_sm$b.csv" 2> "$o/mps_onesided_sm$b.log"
    mark "mps_onesided_bench_sm$b" $?
    a="--side-stream --graph-replays 1000 --onesided-sm-budget $b"
    host "mps2_sm${b}_receive" "$a --receive-buffers"
    host "mps2_sm${b}_own" "$a"
    host "mps2_sm${b}_receive_again" "$a --receive-buffers"
  done
  echo quit | timeout 20 nvidia-cuda-mps-control
  mark mps_quit $?
  trap - EXIT
  cp -r "$mps/log" "$o/mps_log"
else
  mark mps_started 1
fi
{
  for f in "$o"/host_*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('onesided_sm_budget'), d.get('receive_buffers'), d.get('p50_us_slower_rank'), d.get('p50_us_later_rank'), d.get('python_over_c_us'))" "$f"; done 2>&1
  tail -n +1 "$o"/mps_onesided_sm*.csv
} > "$o/summary.txt"
cat "$out/verify/rc.txt" "$o/rc.txt" "$o/summary.txt"
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
timeout 200 bash "$run_dir/gpu-run15.sh" "$g" "$out/verify"
timeout 60 "$g/bin/moe_ep_gpu_tests" --gtest_filter='OneSidedThreadsCe.*:OneSidedCe.*' \
  > "$out/verify/gtest_ce.log" 2>&1
echo "gtest_ce rc $?" >> "$out/verify/rc.txt"
grep -h -E "^\[  (PASSED|FAILED)" "$out"/verify/gtest_*.log
