#!/usr/bin/env python3
"""The Python layer's overhead over libmoe_ep.so on the GPU backend (issue 16 item 5).

    MOE_EP_LIBRARY=.../libmoe_ep.so PYTHONPATH=python python3 \\
        bench/embedded_overhead_gpu.py --moe-ep .../moe-ep --out DIR

One embedded GPU worker (EP 1 on cuda:0, H 128, K 2, 8 experts; its data plane
--gpu-data-plane nccl or one-sided, the file names carry it) formed by
`moe-ep up --targets`; torch CUDA tensors, T = 4. Times --calls single
calls with perf_counter_ns (host time of the call: the GPU calls only
enqueue) and takes the p50: Worker.dispatch (argument checks, current
stream, call) into reused outputs (out=) against moe_ep_dispatch through
bare ctypes with the same device addresses and stream taken once. Each
dispatch is followed by an untimed combine through bare ctypes; the stream
is drained every 256 calls. Writes overhead_gpu.json and overhead_gpu.md.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from moe_ep_client.engine import Worker  # noqa: E402


def p50(samples):
    s = sorted(samples)
    return s[len(s) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moe-ep", required=True)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpu-data-plane", choices=["nccl", "one-sided"], default="nccl")
    args = parser.parse_args()
    hidden, top_k, experts, tokens, rows = 128, 2, 8, 4, 4
    plane = args.gpu_data_plane
    with Worker(["--listen=127.0.0.1:0", "--backend=nccl", "--device=0",
                 "--log-level=warn", f"--gpu-data-plane={plane}"]) as worker:
        subprocess.run([args.moe_ep, "up", "--targets", worker.address, "--backend", "nccl",
                        "--hidden", str(hidden), "--num-experts", str(experts), "--top-k",
                        str(top_k), "--capacity", "16", "--load-experts", "identity"],
                       check=True, stdout=subprocess.DEVNULL)
        worker.wait_ready(timeout_s=60)
        info = worker.info(refresh=True)
        worker.commit_geometry(1, rows, tokens)
        dev = "cuda:0"
        x = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)
        ids = torch.tensor([[t % experts, (t + 3) % experts] for t in range(tokens)],
                           dtype=torch.int32, device=dev)
        w = torch.rand(tokens, top_k, device=dev)
        combine_in = torch.zeros(1, rows, hidden, dtype=torch.bfloat16, device=dev)
        y = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=dev)
        lib, handle = worker._lib, worker._handle
        stream = torch.cuda.current_stream().cuda_stream or None
        reused = worker.dispatch(x, ids, w, recv_rows=rows)
        combine_args = (handle, combine_in.data_ptr(), rows, y.data_ptr(), stream, 0)
        lib.moe_ep_combine(*combine_args)
        p = reused._pointers
        dispatch_args = (handle, x.data_ptr(), ids.data_ptr(), w.data_ptr(), tokens, p[2], p[3],
                         p[4], rows, p[6], p[5], stream, 0)
        c_dispatch, c_combine = lib.moe_ep_dispatch, lib.moe_ep_combine

        def raw_dispatch():
            assert c_dispatch(*dispatch_args) == 0

        def py_dispatch():
            worker.dispatch(x, ids, w, recv_rows=rows, out=reused)

        samples = {"c_dispatch_via_ctypes": [], "python_worker_dispatch_out": []}
        clock = time.perf_counter_ns
        for i in range(args.calls):
            for name, fn in (("c_dispatch_via_ctypes", raw_dispatch),
                             ("python_worker_dispatch_out", py_dispatch)):
                t0 = clock()
                fn()
                samples[name].append((clock() - t0) / 1000.0)
                assert c_combine(*combine_args) == 0
            if i % 256 == 255:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        worker.check_step()
    result = {
        "calls": args.calls,
        "p50_us": {k: round(p50(v), 2) for k, v in samples.items()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "backend": info.backend,
        "gpu_data_plane": plane,
    }
    result["overhead_dispatch_out_us"] = round(
        result["p50_us"]["python_worker_dispatch_out"] - result["p50_us"]["c_dispatch_via_ctypes"], 2)
    os.makedirs(args.out, exist_ok=True)
    stem = "overhead_gpu" if plane == "nccl" else "overhead_gpu_onesided"
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write("# Python layer overhead on the GPU backend (issue 16 item 5)\n\n")
        f.write(f"`bench/embedded_overhead_gpu.py`, {args.calls} calls each, p50 of the host time "
                f"of the call (it only enqueues); {result['gpu']}, Python {result['python']}, "
                f"torch {result['torch']}; EP 1, {plane} data plane, T 4, H 128, K 2.\n\n")
        f.write("| call | p50 (µs) |\n|---|---|\n")
        for k, v in result["p50_us"].items():
            f.write(f"| {k} | {v} |\n")
        f.write(f"\nOverhead of `Worker.dispatch(out=)` with torch CUDA tensors: "
                f"{result['overhead_dispatch_out_us']} µs (target <= 5 µs).\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
