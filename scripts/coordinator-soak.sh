#!/usr/bin/env bash
# Soak of `moe-ep coordinator` (issue 12 item 6), outside CI: N cycles of
# kill -9 of one of W local Gloo workers (rank = cycle % W, so rank 0, which
# hosts the Rendezvous store, comes up every W cycles) and a restart on the
# same address. Each cycle records, from the coordinator's /metrics:
#   detect_s  kill -> the rank shows RANK_STATE_UNREACHABLE
#   reform_s  restarted worker listening -> group READY again in a new generation
#   form_s    the coordinator's own Join + ConfigureLayers + AllocateWorkspace
#   load_s    its LoadExperts of every layer
# checks with `moe-ep status --json` that every worker is ALLOCATED as
# rank i of W, then drives STEPS steps on the coordinator's group with
# `moe-ep run --attach` (the main job's steps and its check of every layer,
# step and rank against the single-process CPU reference; step calls are not
# leased, so this client needs no lease) and records:
#   steps     steps checked (each: every layer on every rank)
#   max_err   the largest |out - ref| of them
#   run_s     the run's wall time
# The first formation's group is checked the same way before cycle 1.
# Stops (exit 1) at the first cycle that does not re-form within TIMEOUT_S,
# whose run fails or disagrees with the reference (a wrong or lost step),
# or whose run does not finish within STEP_TIMEOUT_S (a hung step).
#
# Usage: scripts/coordinator-soak.sh [CYCLES] [BUILD_DIR]
#   env: WORKERS (4), LAYERS (1), EXPERTS (swiglu | identity), TIMEOUT_S (60),
#        STEPS (2), STEP_TIMEOUT_S (120), OUT (bench/results/coordinator/soak.csv),
#        WORKER_BIN (BUILD_DIR/server/moe-ep-worker), PROBE_TIMEOUT_MS (1000: the
#        coordinator's GetStatus deadline; raise it on a machine so loaded that
#        a busy worker misses it and is taken for hung), UNTIL (unix time: start
#        no cycle after it; the summary says how many ran)
# Talks only to 127.0.0.1.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cycles=${1:-20}
build=$(cd "${2:-$root/build}" && pwd)
workers=${WORKERS:-4}
layers=${LAYERS:-1}
experts=${EXPERTS:-swiglu}
timeout_s=${TIMEOUT_S:-60}
steps=${STEPS:-2}
step_timeout_s=${STEP_TIMEOUT_S:-120}
probe_timeout_ms=${PROBE_TIMEOUT_MS:-1000}
out=${OUT:-$root/bench/results/coordinator/soak.csv}
cli=$build/client/moe-ep
worker_bin=${WORKER_BIN:-$build/server/moe-ep-worker}
for b in "$cli" "$worker_bin"; do [ -x "$b" ] || { echo "soak: $b not built" >&2; exit 2; }; done

dir=$(mktemp -d)
pids=()
coord_pid=
cleanup() {
  [ -n "$coord_pid" ] && kill "$coord_pid" 2>/dev/null || true
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }'; }

start_worker() {  # index listen
  "$worker_bin" --listen="$2" --backend=gloo --port-file="$dir/port-$1" \
    >>"$dir/worker-$1.log" 2>&1 &
  pids[$1]=$!
}
wait_file() { for _ in $(seq 1 500); do [ -s "$1" ] && return 0; sleep 0.02; done; return 1; }

targets=""
for i in $(seq 0 $((workers - 1))); do
  rm -f "$dir/port-$i"
  start_worker "$i" 127.0.0.1:0
  wait_file "$dir/port-$i" || { echo "soak: worker $i did not start" >&2; exit 1; }
  targets="${targets:+$targets,}127.0.0.1:$(cat "$dir/port-$i")"
done

"$cli" coordinator --targets "$targets" --layers "$layers" --experts "$experts" \
  --group-timeout-ms 10000 --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
  --backoff-initial-ms 100 --backoff-max-ms 2000 --probe-timeout-ms "$probe_timeout_ms" \
  >"$dir/coordinator.log" 2>&1 &
coord_pid=$!
for _ in $(seq 1 500); do grep -q "metrics on" "$dir/coordinator.log" && break; sleep 0.02; done
metrics_url=$(grep -o 'http://[^ ]*/metrics' "$dir/coordinator.log" | head -1)
[ -n "$metrics_url" ] || { echo "soak: coordinator did not start:" >&2; cat "$dir/coordinator.log" >&2; exit 1; }

# The whole page first: a reader that stops early would fail curl (pipefail).
scrape() { curl -sf "$metrics_url" || true; }
metric() { scrape | awk -v m="$1" '$1 == m && !done { print $2; done = 1 }'; }
rank_state() { scrape | sed -n 's/^moe_ep_coordinator_rank_state{rank="'"$1"'",state="\([A-Z_]*\)".*/\1/p'; }
wait_until() {  # seconds command...
  local end=$(( $(date +%s) + $1 )); shift
  while ! "$@"; do [ "$(date +%s)" -lt "$end" ] || return 1; sleep 0.01; done
}
ready_above() { [ "$(metric moe_ep_coordinator_group_ready)" = "1" ] && [ "$(metric moe_ep_coordinator_generation)" -gt "$1" ]; }
unreachable() { [ "$(rank_state "$1")" = RANK_STATE_UNREACHABLE ]; }
check_workers() {  # every worker ALLOCATED, rank i = target i, world W
  "$cli" status --targets "$targets" --json | jq -e --argjson w "$workers" \
    '[.workers | to_entries[] | select(.value.state == "ALLOCATED" and .value.rank == .key
      and .value.world_size == $w)] | length == $w' >/dev/null
}

check_steps() {  # cycle: sets run_line "steps,max_err,run_s", or fails the soak
  local t json
  t=$(now)
  if ! json=$(timeout "$step_timeout_s" "$cli" run --attach --targets "$targets" \
      --layers "$layers" --experts "$experts" --steps "$steps" --rpc-timeout 30 --json \
      2>"$dir/run.log"); then
    echo "soak: cycle $1: steps on the coordinator's group failed or hung (> ${step_timeout_s} s):" >&2
    tail -20 "$dir/run.log" >&2; echo "soak: the coordinator's log:" >&2
    tail -40 "$dir/coordinator.log" >&2; exit 1
  fi
  if ! jq -e '.pass' >/dev/null <<<"$json"; then
    echo "soak: cycle $1: a step disagrees with the reference:" >&2
    jq -c '.layers[] | {layer, max_abs_err, bound, pass}' <<<"$json" >&2; exit 1
  fi
  run_line="$(jq -r '.steps' <<<"$json"),$(jq -r '.total.max_abs_err' <<<"$json"),$(since "$t")"
}

wait_until "$timeout_s" ready_above 0 || { echo "soak: the group never formed" >&2; tail -20 "$dir/coordinator.log" >&2; exit 1; }
gen=$(metric moe_ep_coordinator_generation)
echo "soak: $workers workers, $layers layer(s) of $experts experts, generation $gen; $cycles cycles, $steps checked steps each"
mkdir -p "$(dirname "$out")"
check_steps 0
echo "soak: generation $gen before cycle 1: steps,max_err,run_s $run_line"
echo "cycle,rank,detect_s,reform_s,form_s,load_s,generation,steps,max_err,run_s" >"$out"
for c in $(seq 1 "$cycles"); do
  if [ -n "${UNTIL:-}" ] && [ "$(date +%s)" -ge "$UNTIL" ]; then
    echo "soak: UNTIL reached: stopping after $((c - 1)) of $cycles cycles"; break
  fi
  r=$(( (c - 1) % workers ))
  port=$(cat "$dir/port-$r")
  t0=$(now)
  kill -9 "${pids[$r]}"
  wait "${pids[$r]}" 2>/dev/null || true
  wait_until 10 unreachable "$r" || { echo "soak: cycle $c: rank $r never shown lost" >&2; exit 1; }
  detect=$(since "$t0")
  rm -f "$dir/port-$r"
  start_worker "$r" "127.0.0.1:$port"
  wait_file "$dir/port-$r" || { echo "soak: cycle $c: worker $r did not restart" >&2; exit 1; }
  t1=$(now)
  if ! wait_until "$timeout_s" ready_above "$gen"; then
    echo "soak: cycle $c: no re-form within ${timeout_s} s" >&2; tail -30 "$dir/coordinator.log" >&2; exit 1
  fi
  reform=$(since "$t1")
  gen=$(metric moe_ep_coordinator_generation)
  check_workers || { echo "soak: cycle $c: workers not ALLOCATED as ranks 0..$((workers - 1))" >&2; exit 1; }
  form_s=$(metric moe_ep_coordinator_last_form_seconds)
  load_s=$(metric moe_ep_coordinator_last_load_seconds)
  check_steps "$c"
  [ "$(metric moe_ep_coordinator_generation)" = "$gen" ] ||
    { echo "soak: cycle $c: the group re-formed while its steps ran" >&2
      tail -40 "$dir/coordinator.log" >&2; exit 1; }
  line="$c,$r,$detect,$reform,$form_s,$load_s,$gen,$run_line"
  echo "$line" >>"$out"
  echo "soak: $line"
done
awk -F, 'NR > 1 { n++; d += $3; f += $4; if ($3 > dm) dm = $3; if ($4 > fm) fm = $4; st += $8
    if ($9 > em) em = $9 }
  END { printf "soak: %d cycles, detect mean %.3f s max %.3f s, re-form mean %.3f s max %.3f s; %d steps checked, all passed, max abs err %g\n", n, d / n, dm, f / n, fm, st, em }' "$out"
echo "soak: failed formation attempts: $(metric moe_ep_coordinator_failed_attempts_total)"
