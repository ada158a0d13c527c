"""The engine's first steps racing the orchestrator's set-up (issue 30 item 1).

The case of the issue: two engine processes, each embedding a worker, step
right after Worker.wait_ready() while `moe-ep up --load-experts` (or the
LoadExperts RPCs of a Group client, rank by rank) is still loading. At
04f07a8 that aborted (an uncaught gloo::EnforceNotMet), stalled past the
group timeout, or exchanged mixed batches. Now the wait returns only once
every rank is formed, configured, allocated and (experts="worker") holds
every sparse layer, and every data call opens with a round that pairs the
ranks' calls, so in every run:
  - no rank process dies (a signal such as SIGABRT fails the run);
  - no call takes longer than its timeout (CALL_TIMEOUT_S, plus a margin);
  - no mixed batches: every received row is bit-equal to the row its source
    rank sent in the same step, combines are exact and forward is
    deterministic.
Runs cycle through three set-ups: `up --load-experts swiglu` with
experts="worker" (forward too), the same with experts="own" (dispatch and
combine only: steps run while the loads do), and a Group client that forms,
configures, allocates and then loads each layer rank by rank with pauses.

MOE_EP_RACE_RUNS runs (default 100), MOE_EP_RACE_PARALLEL of them at a
time (default 2). Run by ctest (tests/embedded.cmake:
embedded_python_engine_race) with MOE_EP_LIBRARY, MOE_EP_CLI and PYTHONPATH.
"""

import concurrent.futures
import json
import os
import subprocess
import sys
import time
import unittest

import numpy as np

LIBRARY = os.environ.get("MOE_EP_LIBRARY")
CLI = os.environ.get("MOE_EP_CLI")
RUNS = int(os.environ.get("MOE_EP_RACE_RUNS", "100"))
PARALLEL = max(1, int(os.environ.get("MOE_EP_RACE_PARALLEL", "2")))
RANKS = 2
HIDDEN = 256
NUM_EXPERTS = 8
TOP_K = 2
LAYERS = 3
CAPACITY = 32
INTERMEDIATE = 1024
STEPS = 4
CALL_TIMEOUT_S = 20.0
MODES = ("up-worker", "up-own", "group-worker")


def step_inputs(rank: int, step: int):
    from moe_ep_client.engine import float32_to_bf16

    rng = np.random.default_rng(7919 * step + rank)
    t = 1 + (3 * rank + 5 * step) % 11
    x = float32_to_bf16(rng.standard_normal((t, HIDDEN)).astype(np.float32))
    ids = np.stack([rng.choice(NUM_EXPERTS, TOP_K, replace=False) for _ in range(t)]).astype(
        np.int32)
    w = rng.random((t, TOP_K)).astype(np.float32)
    return x, ids, w


def run_rank(rank: int) -> int:
    from moe_ep_client.engine import Dispatcher, Worker, bf16_to_float32, float32_to_bf16

    failures = []
    slowest = 0.0

    def timed(fn, *args, **kwargs):
        nonlocal slowest
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            slowest = max(slowest, time.monotonic() - start)

    with Worker(["--listen=127.0.0.1:0", "--backend=gloo", "--log-level=error"]) as worker:
        print(f"ADDRESS {worker.address}", flush=True)
        mode = sys.stdin.readline().split()[1]
        experts = "own" if mode == "up-own" else "worker"
        start = time.monotonic()
        worker.wait_ready(timeout_s=60, experts=experts)
        waited = time.monotonic() - start
        base, rem = divmod(NUM_EXPERTS, RANKS)
        first = rank * base + min(rank, rem)
        local = base + (1 if rank < rem else 0)
        owner = [e // base for e in range(NUM_EXPERTS)]
        dispatcher = Dispatcher(worker)
        first_step = time.time()
        for step in range(STEPS):
            x, ids, w = step_inputs(rank, step)
            out = timed(dispatcher.dispatch, x, ids, w)
            # No mixed batches: source s's rows here are its step-`step` rows
            # that chose an expert of this rank, in its token order.
            for s in range(RANKS):
                xs, ids_s, _ = step_inputs(s, step)
                mine = [t for t in range(len(ids_s)) if any(owner[e] == rank for e in ids_s[t])]
                c = int(out.num_recv_tokens_per_source[s])
                if c != len(mine) or not np.array_equal(out.hidden_states[s, :c], xs[mine]) or \
                        not np.array_equal(out.topk_ids[s, :c], ids_s[mine]):
                    failures.append(f"step {step}: rows from rank {s} are not its step's rows")
            # Experts: e scales by (1 + e / 8) on its rank's choices.
            xf = bf16_to_float32(out.hidden_states)
            own = (out.topk_ids >= first) & (out.topk_ids < first + local)
            scale = (out.topk_weights * (1 + out.topk_ids / 8.0) * own).sum(axis=2)
            y = timed(worker.combine, float32_to_bf16(xf * scale[:, :, None]),
                      timeout_s=CALL_TIMEOUT_S)
            ref = bf16_to_float32(x) * (w * (1 + ids / 8.0)).sum(axis=1)[:, None]
            got = bf16_to_float32(y)
            if not np.all(np.abs(got - ref) <= 2.0 ** -7 * np.abs(ref) + 1e-6):
                failures.append(f"step {step}: combine differs from the reference")
            if experts == "worker":
                for layer in range(LAYERS):
                    _, r = timed(worker.sync_token_counts, len(x))
                    worker.commit_geometry(1000 + 10 * step + layer, r, len(x))
                    a = timed(worker.forward, layer, x, ids, w, timeout_s=CALL_TIMEOUT_S)
                    _, r = timed(worker.sync_token_counts, len(x))
                    worker.commit_geometry(5000 + 10 * step + layer, r, len(x))
                    b = timed(worker.forward, layer, x, ids, w, timeout_s=CALL_TIMEOUT_S)
                    if not np.array_equal(a, b) or not np.isfinite(bf16_to_float32(a)).all():
                        failures.append(f"step {step} layer {layer}: forward not deterministic")
        print(json.dumps({"failures": failures, "waited_s": waited, "slowest_call_s": slowest,
                          "first_step": first_step}), flush=True)
        # The worker serves until the orchestrator is done (with experts="own"
        # the steps may end while it still loads).
        sys.stdin.readline()
    return 0


def form(mode: str, targets):
    """Starts the orchestrator of `mode`; returns a callable that waits for it."""
    if mode.startswith("up"):
        proc = subprocess.Popen(
            [CLI, "up", "--targets", ",".join(targets), "--backend", "gloo", "--hidden",
             str(HIDDEN), "--num-experts", str(NUM_EXPERTS), "--top-k", str(TOP_K), "--capacity",
             str(CAPACITY), "--layers", str(LAYERS), "--load-experts", "swiglu",
             "--intermediate", str(INTERMEDIATE), "--seed", "3"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def done():
            out, _ = proc.communicate(timeout=120)
            return proc.returncode, out, time.time()

        return done
    from moe_ep_client import Group

    group = Group(targets, backend="gloo", group_timeout_s=60)
    group.form()
    group.configure(hidden_size=HIDDEN, num_layers=LAYERS, num_experts=NUM_EXPERTS, top_k=TOP_K,
                    attn_dp_size=len(targets), moe_intermediate_size=INTERMEDIATE)
    group.allocate(hidden_size=HIDDEN, top_k=TOP_K, num_experts=NUM_EXPERTS,
                   capacity_tokens=CAPACITY)

    def done():
        # Rank by rank, layer by layer, with pauses: the engines are waiting.
        for layer in range(LAYERS):
            for t in targets:
                with Group([t], backend="gloo") as one:
                    one.load_experts(layer=layer, kind="swiglu",
                                     intermediate_size=INTERMEDIATE, seed=3)
                time.sleep(0.02)
        group.close()
        return 0, "", time.time()

    return done


@unittest.skipUnless(LIBRARY and CLI, "MOE_EP_LIBRARY / MOE_EP_CLI are not set")
class StepsRacingTheSetUpTest(unittest.TestCase):
    def one_run(self, run: int):
        """One run: two engine processes and an orchestrator. Returns (the
        slowest data call in s, 1 when an up-own run stepped before `up`
        had exited else 0); a failed check raises."""
        mode = MODES[run % len(MODES)]
        slowest = 0.0
        overlapped = 0
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(RANKS)]
        try:
            targets = []
            for r, p in enumerate(procs):
                line = p.stdout.readline()
                self.assertTrue(line.startswith("ADDRESS "), f"run {run} rank {r}: {line!r}")
                targets.append(line.split()[1])
            # The engines start waiting before the orchestrator has done anything.
            for p in procs:
                p.stdin.write(f"GO {mode}\n")
                p.stdin.flush()
            done = form(mode, targets)
            code, text, set_up_done = done()
            self.assertEqual(code, 0, f"run {run} ({mode}): the orchestrator failed:\n{text}")
            for p in procs:
                p.stdin.write("BYE\n")
                p.stdin.flush()
            for r, p in enumerate(procs):
                out, err = p.communicate(timeout=120)
                self.assertEqual(p.returncode, 0,
                                 f"run {run} ({mode}) rank {r}: exit {p.returncode} "
                                 f"(negative: a signal)\n{err[-3000:]}")
                result = json.loads(out.strip().splitlines()[-1])
                self.assertEqual(result["failures"], [], f"run {run} ({mode}) rank {r}")
                self.assertLess(result["slowest_call_s"], CALL_TIMEOUT_S + 5,
                                f"run {run} ({mode}) rank {r}: a call stalled")
                slowest = max(slowest, result["slowest_call_s"])
                if mode == "up-own" and r == 0 and result["first_step"] < set_up_done:
                    overlapped = 1
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return slowest, overlapped

    def test_runs(self):
        # PARALLEL runs at a time: each run is its own group on its own
        # loopback ports, and most of a run is waiting (process start-up,
        # the orchestrator's calls), so overlapping runs shortens the test
        # and adds contention the race should survive anyway.
        with concurrent.futures.ThreadPoolExecutor(max_workers=PARALLEL) as pool:
            results = list(pool.map(self.one_run, range(RUNS)))
        slowest = max((r[0] for r in results), default=0.0)
        overlapped = sum(r[1] for r in results)
        print(f"{RUNS} runs ({PARALLEL} at a time): no abort, no mixed batch, slowest data call "
              f"{slowest:.3f} s; {overlapped} of the up-own runs stepped before `up` had exited",
              file=sys.stderr)


if __name__ == "__main__":
    if "--rank" in sys.argv:
        sys.exit(run_rank(int(sys.argv[sys.argv.index("--rank") + 1])))
    unittest.main()
