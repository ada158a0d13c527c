#!/usr/bin/env python3
"""The Python layer's overhead over libmoe_ep.so's C API (issue 16 item 5).

    MOE_EP_LIBRARY=BUILD/server/libmoe_ep.so PYTHONPATH=BUILD/python:python \\
        /usr/bin/python3 bench/embedded_overhead.py --moe-ep BUILD/client/moe-ep \\
        --out bench/results/embedded

One embedded worker (EP 1, CPU/Gloo, H 128, K 2, 8 experts) formed by
`moe-ep up --targets`. Each figure times --calls single calls with
perf_counter_ns and takes the p50:
  noop:      Worker.noop() (the wrapper's path: handle check, call, status check)
             - the C no-op entry point moe_ep_noop called through bare ctypes;
  dispatch:  Worker.dispatch (argument checks, call) into reused outputs
             (out=), and allocating its outputs, each
             - moe_ep_dispatch through bare ctypes on preallocated buffers whose
             addresses are taken once
             (T = 4 tokens; each then combines through bare ctypes, untimed).
Writes overhead.json and overhead.md to --out.
"""

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

from moe_ep_client.engine import Worker, float32_to_bf16, load_library


def p50(samples):
    return float(np.percentile(np.asarray(samples, dtype=np.float64), 50))


def timed(fn, calls):
    out = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1000.0)
    return out


def plot(result, path):
    """Bars of the p50s: each Python method beside its C entry point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    q = result["p50_us"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = list(q)
    ax.barh(names, [q[n] for n in names],
            color=["#888" if n.startswith("c_") else "#3a7" for n in names])
    for i, n in enumerate(names):
        ax.text(q[n], i, f" {q[n]:.2f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("p50 per call (µs)")
    o = result["overhead_us"]
    ax.set_title(f"Python layer overhead: noop {o['noop']:.2f} µs, dispatch (out=) "
                 f"{o['dispatch_out']:.2f} µs (target 5)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moe-ep", required=True)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    lib = load_library()
    hidden, top_k, experts, tokens = 128, 2, 8, 4
    with Worker(["--listen=127.0.0.1:0", "--backend=gloo", "--log-level=warn"]) as worker:
        subprocess.run([args.moe_ep, "up", "--targets", worker.address, "--backend", "gloo",
                        "--hidden", str(hidden), "--num-experts", str(experts), "--top-k", str(top_k),
                        "--capacity", "16"], check=True, stdout=subprocess.DEVNULL)
        worker.wait_ready(timeout_s=30, experts="own")  # no experts loaded: dispatch/combine only
        info = worker.info()
        worker.commit_geometry(1, tokens, tokens)
        rng = np.random.default_rng(1)
        x = float32_to_bf16(rng.standard_normal((tokens, hidden)).astype(np.float32))
        ids = np.array([[t % experts, (t + 3) % experts] for t in range(tokens)], np.int32)
        w = rng.random((tokens, top_k)).astype(np.float32)
        rows = tokens
        recv_h = np.empty((1, rows, hidden), np.uint16)
        recv_i = np.empty((1, rows, top_k), np.int32)
        recv_w = np.empty((1, rows, top_k), np.float32)
        per_source = np.empty(1, np.int64)
        per_expert = np.empty(info.num_local_experts, np.int64)
        y = np.empty((tokens, hidden), np.uint16)
        handle = worker._handle
        combine_in = np.zeros((1, rows, hidden), np.uint16)

        # The C baseline: addresses taken once, outside the timed calls.
        combine_args = (handle, combine_in.ctypes.data, rows, y.ctypes.data, None, 0)
        dispatch_args = (handle, x.ctypes.data, ids.ctypes.data, w.ctypes.data, tokens,
                         recv_h.ctypes.data, recv_i.ctypes.data, recv_w.ctypes.data, rows,
                         per_source.ctypes.data, per_expert.ctypes.data, None, 0)
        c_combine, c_dispatch = lib.moe_ep_combine, lib.moe_ep_dispatch

        def raw_combine():
            assert c_combine(*combine_args) == 0

        def raw_dispatch():
            assert c_dispatch(*dispatch_args) == 0

        reused = worker.dispatch(x, ids, w, recv_rows=rows)  # the outputs py_dispatch writes
        raw_combine()

        def py_dispatch():
            worker.dispatch(x, ids, w, recv_rows=rows, out=reused)

        def py_dispatch_alloc():
            worker.dispatch(x, ids, w, recv_rows=rows)

        noop_c = timed(lib.moe_ep_noop, args.calls)
        noop_py = timed(worker.noop, args.calls)
        dispatch_c, dispatch_py, dispatch_alloc = [], [], []
        clock = time.perf_counter_ns
        for _ in range(args.calls):
            for fn, samples in ((raw_dispatch, dispatch_c), (py_dispatch, dispatch_py),
                                (py_dispatch_alloc, dispatch_alloc)):
                t0 = clock()
                fn()
                samples.append((clock() - t0) / 1000.0)
                raw_combine()
    result = {
        "calls": args.calls,
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores".strip(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "shape": {"T": tokens, "H": hidden, "K": top_k, "E": 1, "experts": experts},
        "p50_us": {
            "c_noop_via_ctypes": p50(noop_c),
            "python_worker_noop": p50(noop_py),
            "c_dispatch_via_ctypes": p50(dispatch_c),
            "python_worker_dispatch_out": p50(dispatch_py),
            "python_worker_dispatch_alloc": p50(dispatch_alloc),
        },
    }
    q = result["p50_us"]
    result["overhead_us"] = {
        "noop": q["python_worker_noop"] - q["c_noop_via_ctypes"],
        "dispatch_out": q["python_worker_dispatch_out"] - q["c_dispatch_via_ctypes"],
        "dispatch_alloc": q["python_worker_dispatch_alloc"] - q["c_dispatch_via_ctypes"],
    }
    result["target_us"] = 5.0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "overhead.json"), "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    o = result["overhead_us"]
    lines = [
        "# Python layer overhead over libmoe_ep.so (issue 16 item 5)",
        "",
        f"`bench/embedded_overhead.py`, {args.calls} calls each, p50 in µs; {result['machine']}, "
        f"Python {result['python']}, NumPy {result['numpy']}; EP 1 on the CPU (Gloo) backend, "
        f"T {tokens}, H {hidden}, K {top_k}.",
        "",
        "| call | p50 (µs) |",
        "|---|---|",
    ] + [f"| {k} | {v:.2f} |" for k, v in q.items()] + [
        "",
        f"Overhead of the Python layer (p50 Python method - p50 C entry point): noop "
        f"{o['noop']:.2f} µs, dispatch into reused outputs (`out=`) {o['dispatch_out']:.2f} µs, "
        f"dispatch allocating its outputs {o['dispatch_alloc']:.2f} µs; target <= 5 µs: noop "
        f"{'met' if o['noop'] <= 5 else 'NOT met'}, dispatch (out=) "
        f"{'met' if o['dispatch_out'] <= 5 else 'NOT met'}.",
        "",
        f"Load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
        "(other builds ran on the machine; p50 absorbs most of it).",
        "",
    ]
    with open(os.path.join(args.out, "overhead.md"), "w") as f:
        f.write("\n".join(lines))
    plot(result, os.path.join(args.out, "overhead.png"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
