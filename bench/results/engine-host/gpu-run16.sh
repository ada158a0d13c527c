#!/usr/bin/env bash
# Stop 56, first call (issue 30): verify stop 55's last three commits on a
# GPU (gpu-run15.sh: the direct unpack's error paths, the EP 2 gtest, the
# unpack refactor), then time the engine's graph phases against the bare
# kernels (gpu-run13.sh's timed half) so the card this call lands on gets
# its figures; on an H200 these are issue 30's missing H200 figures.
#   mkdir -p g && tar -C g -xJf gpu-callN/b.tar.xz && timeout 560 bash bench/results/engine-host/gpu-run16.sh g /tmp/r/e
set -u
g=$1
out=$2
here=$(dirname "$0")
timeout 495 bash "$here/gpu-run15.sh" "$g" "$out/verify"
# The engine's dispatch past the copy-engine threshold (stop 56: the SM
# path's packed slots) is in OneSidedDirectUnpack above; the Forward's
# copy-engine path must stay as it was.
(source "$g/env.sh"; export NCCL_NVLS_ENABLE=0
 timeout 120 "$g/bin/moe_ep_gpu_tests" --gtest_filter='OneSidedThreadsCe.*:OneSidedCe.*' \
   > "$out/verify/gtest_ce.log" 2>&1; echo "gtest_ce rc $?" >> "$out/verify/rc.txt")
mkdir -p "$out/timed"
source "$g/env.sh"
export NCCL_NVLS_ENABLE=0 MOE_EP_DATA_DIR="$PWD/$g/data" MOE_EP_WORKER_BINARY="$PWD/$g/bin/moe-ep-worker"
bin=$g/bin
lib=$PWD/$g/lib
o=$out/timed
SECONDS=0
mark() { echo "$1 rc $2 at ${SECONDS}s" >> "$o/rc.txt"; }
host() {  # name, direct flag, plane, ranks, extra
  # shellcheck disable=SC2086
  MOE_EP_ONESIDED_DIRECT_UNPACK=$2 MOE_EP_LIBRARY="$lib/libmoe_ep.so.0" timeout 40 python3 \
    bench/engine_call_host.py --moe-ep "$bin/moe-ep" --out "$o/host_$1" --plane "$3" --ranks "$4" \
    --calls 1000 $5 > "$o/host_$1.log" 2>&1
  mark "host_$1" $?
}
for b in 16 64; do
  timeout 30 "$bin/moe_ep_onesided_bench" --tokens 128 --sm-budget $b --path sm --skip-nccl \
    > "$o/onesided_sm$b.csv" 2> "$o/onesided_sm$b.log"
  mark "onesided_bench_sm$b" $?
  for v in direct:1 window:0 direct_again:1; do
    host "graph1_sm${b}_${v%%:*}" "${v#*:}" one-sided 1 \
      "--side-stream --graph-replays 1000 --onesided-sm-budget $b"
  done
done
host onesided2 1 one-sided 2 "--side-stream"
# Side by side: the NCCL plane (one rank per GPU: 1 rank here; its graph
# section hangs in NCCL's abort at one rank, stop 53).
host nccl1 1 nccl 1 "--side-stream --graph-replays 0"
# 2 ranks as processes sharing the GPU under MPS, so that their kernels run
# side by side rather than time-sliced (call 14's ~4.5 ms phases). The MPS
# control daemon is a user process with private pipe and log folders, quit
# at the end; no setting of the card changes (compute mode stays Default).
# Skipped when the timed half ran long (the call's limit is 600 s).
mps=$(mktemp -d)
mkdir -p "$mps/pipe" "$mps/log"
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
if [ "$SECONDS" -lt 180 ] && command -v nvidia-cuda-mps-control > /dev/null &&
  nvidia-cuda-mps-control -d; then
  # Quit the daemon however the script ends (a warm machine's next call
  # would otherwise find it running).
  trap 'echo quit | timeout 20 nvidia-cuda-mps-control' EXIT
  mark mps_started 0
  sleep 1
  for b in 16 64; do
    timeout 30 "$bin/moe_ep_onesided_bench" --tokens 128 --sm-budget $b --path sm --skip-nccl \
      > "$o/mps_onesided_sm$b.csv" 2> "$o/mps_onesided_sm$b.log"
    mark "mps_onesided_bench_sm$b" $?
    a="--side-stream --graph-replays 1000 --onesided-sm-budget $b"
    host "mps_graph2_sm${b}_direct" 1 one-sided 2 "$a"
    host "mps_graph2_sm${b}_window" 0 one-sided 2 "$a"
    host "mps_graph2_sm${b}_direct_again" 1 one-sided 2 "$a"
  done
  host mps_onesided2 1 one-sided 2 "--side-stream"
  echo quit | timeout 20 nvidia-cuda-mps-control
  mark mps_quit $?
  trap - EXIT
  cp -r "$mps/log" "$o/mps_log"
else
  mark mps_started 1
fi
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
{
  for f in "$o"/host_*/*.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('onesided_sm_budget'), d.get('p50_us_slower_rank'), d.get('p50_us_later_rank'), d.get('python_over_c_us'))" "$f"; done 2>&1
  tail -n +1 "$o"/onesided_sm*.csv "$o"/mps_onesided_sm*.csv
} > "$o/summary.txt"
cat "$o/rc.txt" "$o/summary.txt"
