#!/usr/bin/env python3
"""Host time of the engine's dispatch and combine calls (issue 30 item 3).

    MOE_EP_LIBRARY=.../libmoe_ep.so PYTHONPATH=python python3 \\
        bench/engine_call_host.py --moe-ep .../moe-ep --plane one-sided --ranks 2 --out DIR

--ranks embedded GPU workers, one process each, all on cuda:0 (the one-sided
plane's processes share the GPU through CUDA IPC windows; the NCCL plane
runs one rank per GPU, so --ranks 1 there), formed by `moe-ep up --targets`
with --load-experts identity. Issue 30's shape by default: 128 tokens per
rank, H 7168, top-8, 256 experts. Every rank times --calls steps; in each,
with perf_counter_ns around the call alone (the GPU calls only enqueue):
  c_dispatch / c_combine        moe_ep_dispatch / moe_ep_combine through bare
                                ctypes, arguments and stream taken once;
  py_dispatch / py_combine      Worker.dispatch(out=) / Worker.combine(out=);
at --ranks 1 (one-sided: at any --ranks, every rank replaying its own
graphs, whose kernels pair up through the plane's flags; processes sharing
one GPU without MPS run in the driver's time slices, so the earlier rank's
phases hold the slice, milliseconds, and p50_us_later_rank, the smaller
p50 over the ranks, is the figure closest to the kernels': call14 in
bench/results/engine-host), each call captured alone in a torch CUDA graph
and replayed
--graph-replays times from an idle stream (graph_dispatch / graph_combine,
CUDA events around each replay: the phases' device time), then both in one
graph (graph_step); then both in one graph with external event record
nodes between them, as onesided_bench times the bare kernels
(graph_dispatch_inside / graph_combine_inside / graph_phases_inside:
device time alone, no graph launch); and, outside the
steps, the Python pieces of Worker.dispatch one by one
(py_inputs: the three tensor checks; py_stream: the current stream;
py_info: Worker.info()). Steps alternate C and Python; the stream is drained
every --drain steps (the launch queue must not fill: that would time the
GPU). p10 / p50 / p90 per rank; the figure is the slower rank's p50.
--profile: each rank's process runs under gperftools' CPU profiler
(LD_PRELOAD=--profiler-lib, CPUPROFILE=DIR/cpu.rankN.prof) for a second
loop of C calls only. --receive-buffers: the workers hold receive buffers in
their windows (--onesided-receive-buffers) and the C dispatch (and its graphs)
fills those (moe_ep_receive_buffers: the peers store their rows in place).
Writes DIR/host_<plane>_<ranks>.json and prints it.
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def pct(samples, q):
    s = sorted(samples)
    return round(s[min(len(s) - 1, int(len(s) * q))], 2)


def summary(samples):
    return {"p10": pct(samples, 0.1), "p50": pct(samples, 0.5), "p90": pct(samples, 0.9)}


def rank_main(args):
    import torch

    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    from moe_ep_client.engine import Worker, _stream  # noqa: E402

    rank, world = args.rank, args.ranks
    t, h, k, e = args.tokens, args.hidden, args.top_k, args.experts
    flags = ["--listen=127.0.0.1:0", "--backend=nccl", "--device=0", "--log-level=warn",
             f"--gpu-data-plane={args.plane}"]
    if args.onesided_sm_budget > 0:
        flags.append(f"--onesided-sm-budget={args.onesided_sm_budget}")
    if args.receive_buffers:
        flags.append("--onesided-receive-buffers")
    with Worker(flags) as worker:
        with open(os.path.join(args.rendezvous, f"addr.{rank}.tmp"), "w") as f:
            f.write(worker.address)
        os.rename(os.path.join(args.rendezvous, f"addr.{rank}.tmp"),
                  os.path.join(args.rendezvous, f"addr.{rank}"))
        worker.wait_ready(timeout_s=120, experts="own")
        if args.side_stream:
            # The engine's own stream rather than torch's default (the legacy
            # stream): the one-sided calls then enqueue on it directly.
            torch.cuda.set_stream(torch.cuda.Stream())
        rows = t
        worker.commit_geometry(1, rows, t)
        dev = "cuda:0"
        gen = torch.Generator(device=dev).manual_seed(100 + rank)
        x = torch.randn(t, h, device=dev, generator=gen).to(torch.bfloat16)
        # Distinct experts per token, uniform over all experts.
        ids = torch.argsort(torch.rand(t, e, device=dev, generator=gen), dim=1)[:, :k]
        ids = ids.to(torch.int32).contiguous()
        w = torch.rand(t, k, device=dev, generator=gen)
        expert_out = torch.zeros(world, rows, h, dtype=torch.bfloat16, device=dev)
        y = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
        lib, handle = worker._lib, worker._handle
        stream = torch.cuda.current_stream().cuda_stream or None
        reused = worker.dispatch(x, ids, w, recv_rows=rows)
        worker.combine(expert_out)
        p = reused._pointers
        recv = (p[2], p[3], p[4], rows)
        if args.receive_buffers:
            # The window's receive buffers: the peers store their rows in
            # place (no copy after the flag round).
            rb_rows, rb_hidden, rb_ids, rb_weights = worker.receive_buffers()
            recv = (rb_hidden, rb_ids, rb_weights, rb_rows)
        d_args = (handle, x.data_ptr(), ids.data_ptr(), w.data_ptr(), t) + recv + (
            p[6], p[5], stream, 0)
        c_args = (handle, expert_out.data_ptr(), rows, y.data_ptr(), stream, 0)
        c_dispatch, c_combine = lib.moe_ep_dispatch, lib.moe_ep_combine
        clock = time.perf_counter_ns
        names = ("c_dispatch", "c_combine", "py_dispatch", "py_combine")
        samples = {n: [] for n in names}
        torch.cuda.synchronize()
        for i in range(args.calls):
            t0 = clock()
            rc = c_dispatch(*d_args)
            t1 = clock()
            assert rc == 0, lib.moe_ep_last_error()
            t2 = clock()
            rc = c_combine(*c_args)
            t3 = clock()
            assert rc == 0, lib.moe_ep_last_error()
            samples["c_dispatch"].append((t1 - t0) / 1e3)
            samples["c_combine"].append((t3 - t2) / 1e3)
            t0 = clock()
            worker.dispatch(x, ids, w, recv_rows=rows, out=reused)
            t1 = clock()
            worker.combine(expert_out, out=y)
            t2 = clock()
            samples["py_dispatch"].append((t1 - t0) / 1e3)
            samples["py_combine"].append((t2 - t1) / 1e3)
            if i % args.drain == args.drain - 1:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        worker.check_step()
        # The Python pieces alone (no library call).
        pieces = {"py_inputs": lambda: worker._inputs(x, ids, w),
                  "py_info": worker.info,
                  "py_stream": lambda: _stream(worker._inputs(x, ids, w)[0])}
        piece_samples = {}
        for name, fn in pieces.items():
            s = []
            for _ in range(2000):
                t0 = clock()
                fn()
                s.append((clock() - t0) / 1e3)
            piece_samples[name] = summary(s)
        piece_samples["py_stream"]["p50"] = round(
            piece_samples["py_stream"]["p50"] - piece_samples["py_inputs"]["p50"], 2)
        if args.profile_calls > 0:
            # C calls only, under the profiler the parent preloaded.
            for i in range(args.profile_calls):
                assert c_dispatch(*d_args) == 0
                assert c_combine(*c_args) == 0
                if i % args.drain == args.drain - 1:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
        result = {n: summary(v) for n, v in samples.items()}
        result.update(piece_samples)
        with open(os.path.join(args.rendezvous, f"result.{rank}.json"), "w") as f:
            json.dump(result, f)
        if args.graph_replays > 0 and (world == 1 or args.plane == "one-sided"):
            # The C dispatch and combine each captured in a torch CUDA graph,
            # replayed from an idle stream: CUDA events around each replay.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            sid = side.cuda_stream
            gd_args = d_args[:11] + (sid, 0)
            gc_args = c_args[:4] + (sid, 0)
            with torch.cuda.stream(side):
                assert c_dispatch(*gd_args) == 0 and c_combine(*gc_args) == 0
            side.synchronize()
            g_dispatch, g_combine = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(g_dispatch, stream=side):
                assert c_dispatch(*gd_args) == 0, lib.moe_ep_last_error()
            with torch.cuda.graph(g_combine, stream=side):
                assert c_combine(*gc_args) == 0, lib.moe_ep_last_error()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            gd, gc = [], []
            for _ in range(args.graph_replays):
                ev[0].record()
                g_dispatch.replay()
                ev[1].record()
                g_combine.replay()
                ev[2].record()
                ev[2].synchronize()
                gd.append(ev[0].elapsed_time(ev[1]) * 1e3)
                gc.append(ev[1].elapsed_time(ev[2]) * 1e3)
            # Both calls in one graph: the engine's whole step (no experts),
            # comparable with onesided_bench's "graph step" (ReplayForward).
            g_step = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g_step, stream=side):
                assert c_dispatch(*gd_args) == 0 and c_combine(*gc_args) == 0
            gs = []
            for _ in range(args.graph_replays):
                ev[0].record()
                g_step.replay()
                ev[1].record()
                ev[1].synchronize()
                gs.append(ev[0].elapsed_time(ev[1]) * 1e3)
            # As onesided_bench times the bare kernels' phases: both calls in
            # one graph with external event record nodes between them, so a
            # phase's figure is device time alone (no graph launch, no idle
            # stream before it).
            ext = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            for e in ext:
                e.record(side)  # creates the CUDA event behind it
            side.synchronize()
            cuda = ctypes.CDLL("libcuda.so.1")
            cuda.cuEventRecordWithFlags.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                                    ctypes.c_uint]
            external = 1  # CU_EVENT_RECORD_EXTERNAL

            def mark(e):
                rc = cuda.cuEventRecordWithFlags(e.cuda_event, sid, external)
                assert rc == 0, f"cuEventRecordWithFlags: CUresult {rc}"

            g_inside = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g_inside, stream=side):
                mark(ext[0])
                assert c_dispatch(*gd_args) == 0, lib.moe_ep_last_error()
                mark(ext[1])
                assert c_combine(*gc_args) == 0, lib.moe_ep_last_error()
                mark(ext[2])
            gdi, gci, gpi = [], [], []
            for _ in range(args.graph_replays):
                g_inside.replay()
                ext[2].synchronize()
                gdi.append(ext[0].elapsed_time(ext[1]) * 1e3)
                gci.append(ext[1].elapsed_time(ext[2]) * 1e3)
                gpi.append(ext[0].elapsed_time(ext[2]) * 1e3)
            worker.check_step()
            result["graph_dispatch_inside"] = summary(gdi)
            result["graph_combine_inside"] = summary(gci)
            result["graph_phases_inside"] = summary(gpi)
            result["graph_dispatch"] = summary(gd)
            result["graph_combine"] = summary(gc)
            result["graph_step"] = summary(gs)
            with open(os.path.join(args.rendezvous, f"result.{rank}.json"), "w") as f:
                json.dump(result, f)
        # Stay until every rank is done: a rank that stops early breaks
        # the others' last steps.
        open(os.path.join(args.rendezvous, f"done.{rank}"), "w").close()
        deadline = time.time() + 120
        while time.time() < deadline and not all(
                os.path.exists(os.path.join(args.rendezvous, f"done.{r}")) for r in range(world)):
            time.sleep(0.05)


def parent_main(args):
    os.makedirs(args.out, exist_ok=True)
    rendezvous = tempfile.mkdtemp(prefix="engine_call_host.")
    procs = []
    for r in range(args.ranks):
        env = dict(os.environ)
        if args.profile:
            env["LD_PRELOAD"] = args.profiler_lib
            env["CPUPROFILE"] = os.path.join(os.path.abspath(args.out),
                                             f"cpu.{args.plane}.{args.ranks}.rank{r}.prof")
            env["CPUPROFILE_FREQUENCY"] = "4000"
        cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(r), "--rendezvous",
               rendezvous] + sys.argv[1:]
        procs.append(subprocess.Popen(cmd, env=env))
    addrs = []
    deadline = time.time() + 120
    for r in range(args.ranks):
        path = os.path.join(rendezvous, f"addr.{r}")
        while not os.path.exists(path):
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(f"rank {r} did not start")
            time.sleep(0.05)
        with open(path) as f:
            addrs.append(f.read().strip())
    subprocess.run([args.moe_ep, "up", "--targets", ",".join(addrs), "--backend", "nccl",
                    "--hidden", str(args.hidden), "--num-experts", str(args.experts), "--top-k",
                    str(args.top_k), "--capacity", str(args.tokens), "--load-experts",
                    "identity"], check=True, stdout=subprocess.DEVNULL)
    codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        raise SystemExit(f"rank exit codes {codes}")
    per_rank = []
    for r in range(args.ranks):
        with open(os.path.join(rendezvous, f"result.{r}.json")) as f:
            per_rank.append(json.load(f))
    import torch

    result = {
        "plane": args.plane, "ranks": args.ranks, "tokens": args.tokens, "hidden": args.hidden,
        "top_k": args.top_k, "experts": args.experts, "calls": args.calls,
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "onesided_sm_budget": args.onesided_sm_budget or 16,
        "receive_buffers": args.receive_buffers,
        "p50_us_slower_rank": {n: max(pr[n]["p50"] for pr in per_rank) for n in per_rank[0]},
        # A phase's own figure; a sum of phases (graph_phases_inside,
        # graph_step) pairs each phase's later rank differently: none here.
        "p50_us_later_rank": {n: min(pr[n]["p50"] for pr in per_rank) for n in per_rank[0]
                              if n.startswith(("graph_dispatch", "graph_combine"))},
        "per_rank": per_rank,
    }
    s = result["p50_us_slower_rank"]
    result["python_over_c_us"] = {"dispatch": round(s["py_dispatch"] - s["c_dispatch"], 2),
                                  "combine": round(s["py_combine"] - s["c_combine"], 2)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"host_{args.plane}_{args.ranks}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "per_rank"}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moe-ep", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plane", choices=["nccl", "one-sided"], default="one-sided")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--drain", type=int, default=32)
    parser.add_argument("--graph-replays", type=int, default=500)
    parser.add_argument("--onesided-sm-budget", type=int, default=0,
                        help="the workers' --onesided-sm-budget (0: their default, 16)")
    parser.add_argument("--receive-buffers", action="store_true",
                        help="one-sided: the C calls dispatch into the window's receive buffers "
                             "(workers with --onesided-receive-buffers)")
    parser.add_argument("--side-stream", action="store_true",
                        help="run the calls on a torch.cuda.Stream, not the default stream")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-calls", type=int, default=0)
    parser.add_argument("--profiler-lib", default="libprofiler.so.0")
    parser.add_argument("--rank", type=int, default=-1)
    parser.add_argument("--rendezvous", default="")
    args = parser.parse_args()
    if args.rank >= 0:
        rank_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
