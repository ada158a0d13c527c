#!/usr/bin/env python3
"""A toy MoE layer in N Python processes, each embedding a moe-ep worker.

    MOE_EP_LIBRARY=BUILD/server/libmoe_ep.so PYTHONPATH=BUILD/python:python \\
        /usr/bin/python3 python/examples/embedded_moe_layer.py --ranks 2 \\
        --moe-ep BUILD/client/moe-ep [--former up|group]

Each rank process starts a worker in process (moe_ep_client.engine.Worker,
gRPC control plane on 127.0.0.1:0) and prints its address; this parent forms
and configures the group remotely (`moe-ep up --targets ...`, or the Python
Group client with --former group). Then every rank runs --steps steps of its
own tokens: Dispatcher.dispatch -> NumPy experts on the received rows ->
Dispatcher.combine, and one Worker.forward with the worker's identity
experts, and compares each output with a dense NumPy reference of its
tokens. Exit status 0 when every rank matches, 1 on a mismatch or failure.
"""

import argparse
import os
import subprocess
import sys
from typing import List, Optional

import numpy as np

HIDDEN = 64
NUM_EXPERTS = 8
TOP_K = 2
CAPACITY = 48


def expert_weights(num_experts: int, hidden: int) -> np.ndarray:
    """Expert e: y = tanh(x @ W[e]) (the same seeded weights on every rank)."""
    rng = np.random.default_rng(1234)
    return (rng.standard_normal((num_experts, hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)


def rank_inputs(rank: int, step: int, tokens: int):
    from moe_ep_client.engine import float32_to_bf16

    rng = np.random.default_rng(1000 * step + rank)
    hidden = float32_to_bf16(rng.standard_normal((tokens, HIDDEN)).astype(np.float32))
    ids = np.array([rng.choice(NUM_EXPERTS, TOP_K, replace=False) for _ in range(tokens)],
                   dtype=np.int32).reshape(tokens, TOP_K)
    weights = rng.random((tokens, TOP_K)).astype(np.float32)
    return hidden, ids, weights


def check(name: str, got_bits: np.ndarray, want: np.ndarray, scale: np.ndarray) -> Optional[str]:
    """bf16 output vs fp32 reference: each partial sum and the result are bf16-rounded,
    so |error| <= 2^-7 * sum_k |w_k e_k(x)| (tests/core/ep_dispatcher_test.cc)."""
    from moe_ep_client.engine import bf16_to_float32

    got = bf16_to_float32(got_bits)
    if got.shape != want.shape:
        return f"{name}: shape {got.shape}, reference {want.shape}"
    bound = 2.0**-7 * scale + 1e-5
    bad = np.abs(got - want) > bound
    if bad.any():
        t, h = np.argwhere(bad)[0]
        return f"{name}: {int(bad.sum())} values differ, first [{t},{h}] got {got[t, h]} want {want[t, h]}"
    return None


def run_rank(rank: int, ranks: int, steps: int) -> int:
    from moe_ep_client.engine import Dispatcher, Worker, bf16_to_float32, float32_to_bf16

    w = expert_weights(NUM_EXPERTS, HIDDEN)
    with Worker(["--listen=127.0.0.1:0", "--backend=gloo", "--log-level=warn"]) as worker:
        print(f"ADDRESS {worker.address}", flush=True)
        # The orchestrator says GO when it is done, so a failed set-up ends
        # the rank at once; the wait alone would also hold until every rank
        # is allocated and has every layer's experts (issue 30).
        if sys.stdin.readline().strip() != "GO":
            print(f"rank {rank}: the orchestrator gave up", flush=True)
            return 1
        worker.wait_ready(timeout_s=10)
        info = worker.info()
        first, count = info.first_expert, info.num_local_experts
        dispatcher = Dispatcher(worker)
        failures: List[str] = []
        for step in range(steps):
            tokens = (5 + 7 * rank + 3 * step) % 11 if (rank + step) % 3 else 0
            hidden, ids, weights = rank_inputs(rank, step, tokens)
            out = dispatcher.dispatch(hidden, ids, weights)
            # This rank's experts on the received rows: per row, the weighted sum
            # over the token's choices that fall on [first, first + count).
            x = bf16_to_float32(out.hidden_states)  # [E, R, H]
            y = np.zeros_like(x)
            expected_counts = np.zeros(count, dtype=np.int64)
            for s in range(info.world_size):
                for j in range(int(out.num_recv_tokens_per_source[s])):
                    for k in range(TOP_K):
                        e = int(out.topk_ids[s, j, k])
                        if first <= e < first + count:
                            expected_counts[e - first] += 1
                            y[s, j] += out.topk_weights[s, j, k] * np.tanh(x[s, j] @ w[e])
            if not np.array_equal(expected_counts, out.num_recv_tokens_per_expert):
                failures.append(f"step {step}: expert counts {out.num_recv_tokens_per_expert}, "
                                f"rows say {expected_counts}")
            combined = dispatcher.combine(float32_to_bf16(y))
            xs = bf16_to_float32(hidden)
            terms = np.stack([weights[:, k:k + 1] * np.tanh(
                np.einsum("th,thg->tg", xs, w[ids[:, k]])) for k in range(TOP_K)]) if tokens else \
                np.zeros((TOP_K, 0, HIDDEN), np.float32)
            ref = terms.sum(axis=0)
            error = check(f"rank {rank} step {step} (T={tokens}) combine", combined, ref,
                          np.abs(terms).sum(axis=0))
            if error:
                failures.append(error)
            # forward: the worker's identity experts, sum_k w_k * x.
            counts, r = worker.sync_token_counts(tokens)
            worker.commit_geometry(10_000 + step, r, tokens)
            forwarded = worker.forward(0, hidden, ids, weights)
            ident = (weights[:, :, None] * xs[:, None, :]) if tokens else np.zeros((0, TOP_K, HIDDEN))
            error = check(f"rank {rank} step {step} forward", forwarded, ident.sum(axis=1),
                          np.abs(ident).sum(axis=1))
            if error:
                failures.append(error)
        for f in failures:
            print(f"MISMATCH {f}", flush=True)
        print(f"rank {rank}: {steps} steps, {'FAIL' if failures else 'ok'}", flush=True)
        return 1 if failures else 0


def form_group(targets: List[str], former: str, moe_ep: str) -> None:
    if former == "up":
        subprocess.run(
            [moe_ep, "up", "--targets", ",".join(targets), "--backend", "gloo",
             "--hidden", str(HIDDEN), "--num-experts", str(NUM_EXPERTS), "--top-k", str(TOP_K),
             "--capacity", str(CAPACITY), "--load-experts", "identity"],
            check=True, stdout=sys.stderr)
        return
    from moe_ep_client import Group

    with Group(targets, backend="gloo") as group:
        group.form()
        group.configure(hidden_size=HIDDEN, num_layers=1, num_experts=NUM_EXPERTS, top_k=TOP_K,
                        attn_dp_size=len(targets))
        group.allocate(hidden_size=HIDDEN, top_k=TOP_K, num_experts=NUM_EXPERTS,
                       capacity_tokens=CAPACITY)
        group.load_experts(layer=0, kind="identity")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--former", choices=["up", "group"], default="up")
    parser.add_argument("--moe-ep", default="moe-ep", help="the moe-ep CLI (for --former up)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a rank process
    args = parser.parse_args(argv)
    if args.rank is not None:
        return run_rank(args.rank, args.ranks, args.steps)

    children = [
        subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r),
                          "--ranks", str(args.ranks), "--steps", str(args.steps)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for r in range(args.ranks)
    ]
    try:
        targets = []
        for r, child in enumerate(children):
            line = child.stdout.readline()
            if not line.startswith("ADDRESS "):
                print(f"rank {r} did not start its worker: {line!r}", file=sys.stderr)
                return 1
            targets.append(line.split()[1])
        print(f"workers: {','.join(targets)}; forming with {args.former}", flush=True)
        form_group(targets, args.former, args.moe_ep)
        for child in children:
            child.stdin.write("GO\n")
            child.stdin.flush()
        status = 0
        for r, child in enumerate(children):
            output, _ = child.communicate(timeout=300)
            sys.stdout.write(output)
            if child.returncode != 0:
                status = 1
        print("embedded MoE layer:", "all ranks match the dense reference" if status == 0
              else "MISMATCH or failure")
        return status
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


if __name__ == "__main__":
    sys.exit(main())
