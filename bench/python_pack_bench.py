#!/usr/bin/env python3
"""Times how long the Python client takes to pack one rank's Forward request.

Issue 31 item 4's goal: a DeepSeek-V3-sized rank (4096 tokens x hidden 7168,
bf16 hidden states, top-8 int64 ids and float64 weights, as an engine holds
them) packs into ForwardRequest bytes in <= 50 ms. The time is a benchmark
figure, not a test assertion (machines differ); python/tests/test_tensors.py
checks the bytes themselves.

Usage (from the repository root, after the build generated the stubs):
  PYTHONPATH=build/python:python python3 bench/python_pack_bench.py [--runs 20]
Prints one JSON object: tokens, hidden, top_k, bytes, and min / p50 / max
milliseconds over the runs (the first run, which pays page faults on fresh
buffers, is reported apart as first_ms).
"""

import argparse
import json
import statistics
import time

import numpy as np

from moe_ep_client import tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args()
    rng = np.random.default_rng(7)
    hidden = rng.integers(0, 1 << 16, size=(args.tokens, args.hidden), dtype=np.uint16)
    ids = rng.integers(0, 256, size=(args.tokens, args.top_k)).astype(np.int64)
    weights = rng.random((args.tokens, args.top_k))
    times = []
    size = 0
    for _ in range(args.runs + 1):
        start = time.perf_counter()
        raw, _ = tensors.forward_request_bytes(
            0, 1, hidden, ids, weights, args.hidden, args.top_k
        )
        times.append((time.perf_counter() - start) * 1e3)
        size = len(raw)
    steady = times[1:]
    print(
        json.dumps(
            {
                "tokens": args.tokens,
                "hidden": args.hidden,
                "top_k": args.top_k,
                "bytes": size,
                "first_ms": round(times[0], 2),
                "min_ms": round(min(steady), 2),
                "p50_ms": round(statistics.median(steady), 2),
                "max_ms": round(max(steady), 2),
                "runs": args.runs,
            }
        )
    )


if __name__ == "__main__":
    main()
