"""moe_ep_client.deep_ep (issue 30 item 2): DeepEP's checks on the CPU plane
with NumPy, 1, 2 and 4 rank processes, each embedding a worker; rank 0's
Buffer forms the group itself (explicit addresses: no outside former).

Per rank and step, against references computed here from every rank's
seeded inputs (each rank can draw any rank's): the layout (tokens per rank,
per expert, is_token_in_rank), normal dispatch (received rows bit-equal to
their sources, in source then token order; local topk ids; masked weights;
per-expert counts), a cached dispatch, normal combine (the sum over the
ranks a token went to, one rounding; the weights' sum), low-latency dispatch
(rows packed per local expert, counts, src_info = the source token index,
layout ranges), low-latency combine = sum_k w_k * expert_k(x) within one bf16
rounding (and out=), the fp8 option (scales = amax / 448 per 128 channels,
codes within half an e4m3 step), two low-latency micro-batches in flight
(async_finish, return_recv_hook), and an expert id out of range failing on
its rank (INVALID_ARGUMENT naming the row) and ABORTED on the others with
the next step exact.

Run by ctest (tests/embedded.cmake: embedded_python_deep_ep) with
MOE_EP_LIBRARY and PYTHONPATH (the build's stubs) set; skips without them.
"""

import json
import os
import socket
import subprocess
import sys
import time
import unittest

import numpy as np

LIBRARY = os.environ.get("MOE_EP_LIBRARY")
HIDDEN = 256  # a multiple of 128 (fp8 scales)
NUM_EXPERTS = 8
TOP_K = 3
MAX_TOKENS = 12


def inputs(rank: int, world: int, step: int):
    """Rank `rank`'s tokens of `step`: (x bf16 bits [T, H], topk_idx int64
    [T, K] with some -1, topk_weights float32 [T, K]). The last rank of a
    4-rank group has no tokens at step 0."""
    from moe_ep_client.engine import float32_to_bf16

    rng = np.random.default_rng(1000 * step + rank)
    t = 0 if (world == 4 and rank == world - 1 and step == 0) else 3 + (5 * rank + 2 * step) % 9
    x = float32_to_bf16(rng.standard_normal((t, HIDDEN)).astype(np.float32))
    idx = np.stack([rng.choice(NUM_EXPERTS, TOP_K, replace=False) for _ in range(t)]).astype(
        np.int64) if t else np.zeros((0, TOP_K), np.int64)
    if t:
        idx[rng.random((t, TOP_K)) < 0.15] = -1
    w = rng.random((t, TOP_K)).astype(np.float32)
    return x, idx, w


def placement(world: int):
    base, rem = divmod(NUM_EXPERTS, world)
    sizes = [base + (1 if r < rem else 0) for r in range(world)]
    first = [sum(sizes[:r]) for r in range(world)]
    owner = np.repeat(np.arange(world), sizes)
    return first, sizes, owner


def run_rank(rank: int, world: int, addresses):
    from moe_ep_client.deep_ep import Buffer, fp8_e4m3_dequantize
    from moe_ep_client.engine import EngineError, bf16_to_float32, float32_to_bf16

    failures = []

    def check(ok, what):
        if not ok:
            failures.append(what)

    first, sizes, owner = placement(world)
    me_first, me_l = first[rank], sizes[rank]
    buf = Buffer(None, hidden=HIDDEN, num_experts=NUM_EXPERTS, num_topk=TOP_K,
                 num_max_tokens_per_rank=MAX_TOKENS, rank=rank, world_size=world,
                 addresses=addresses, timeout_s=60, group_timeout_s=60)
    try:
        check(buf.num_local_experts == me_l, f"num_local_experts {buf.num_local_experts}")
        for step in range(2):
            all_in = [inputs(r, world, step) for r in range(world)]
            x, idx, w = all_in[rank]
            # --- layout -------------------------------------------------
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, NUM_EXPERTS)
            ref_in = np.zeros((len(idx), world), bool)
            for t in range(len(idx)):
                for e in idx[t]:
                    if e >= 0:
                        ref_in[t, owner[e]] = True
            check(np.array_equal(in_rank, ref_in), f"step {step}: is_token_in_rank")
            check(per_rank.tolist() == ref_in.sum(0).tolist(), f"step {step}: num_tokens_per_rank")
            check(per_expert.tolist() == [int((idx == e).sum()) for e in range(NUM_EXPERTS)],
                  f"step {step}: num_tokens_per_expert")
            check(per_rank.dtype == np.int32 and in_rank.dtype == np.bool_, "layout dtypes")
            # --- normal dispatch ----------------------------------------
            recv_x, recv_idx, recv_w, recv_list, handle, event = buf.dispatch(
                x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, expert_alignment=4)
            event.current_stream_wait()
            want_x, want_idx, want_w = [], [], []
            counts = np.zeros(me_l, np.int64)
            for s in range(world):
                xs, ids, ws = all_in[s]
                for t in range(len(ids)):
                    if not any(e >= 0 and owner[e] == rank for e in ids[t]):
                        continue
                    want_x.append(xs[t])
                    loc = np.where((ids[t] >= me_first) & (ids[t] < me_first + me_l),
                                   ids[t] - me_first, -1)
                    want_idx.append(loc)
                    want_w.append(np.where(loc >= 0, ws[t], 0))
                    for e in loc:
                        if e >= 0:
                            counts[e] += 1
            n = len(want_x)
            check(recv_x.shape == (n, HIDDEN), f"step {step}: recv_x shape {recv_x.shape}, want {n}")
            if n and recv_x.shape == (n, HIDDEN):
                check(np.array_equal(recv_x, np.stack(want_x)), f"step {step}: recv_x rows")
                check(np.array_equal(recv_idx, np.stack(want_idx)), f"step {step}: recv_topk_idx")
                check(np.array_equal(recv_w, np.stack(want_w).astype(np.float32)),
                      f"step {step}: recv_topk_weights")
            check(recv_list == [int(-(-c // 4) * 4) for c in counts],
                  f"step {step}: per-expert list {recv_list} vs {counts.tolist()} (aligned 4)")
            check(recv_idx.dtype == np.int64, "recv_topk_idx int64")
            # --- cached dispatch: the same layout, other data -------------
            x2 = float32_to_bf16(bf16_to_float32(x) * 2)
            cached = buf.dispatch(x2, handle=handle)
            check(cached[1] is None and cached[4] is None, "cached dispatch returns no top-k")
            check(np.array_equal(cached[0], float32_to_bf16(bf16_to_float32(recv_x) * 2)),
                  f"step {step}: cached dispatch rows")
            # --- normal combine: sum over destination ranks ---------------
            combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
            dests = ref_in.sum(1).astype(np.float32)
            want = float32_to_bf16(bf16_to_float32(x) * dests[:, None])
            check(np.array_equal(combined, want), f"step {step}: combine = (#ranks) * x")
            check(np.array_equal(combined_w, np.where(idx >= 0, w, 0).astype(np.float32)),
                  f"step {step}: combined topk_weights")
            # --- low-latency dispatch ----------------------------------
            recv, recv_count, ll, _, hook = buf.low_latency_dispatch(
                x, idx, MAX_TOKENS, NUM_EXPERTS, use_fp8=False)
            hook()
            src_info, layout_range = ll.src_info, ll.layout_range
            check(recv.shape == (me_l, MAX_TOKENS * world, HIDDEN), f"ll recv shape {recv.shape}")
            for e in range(me_l):
                g = me_first + e
                rows = [(s, t) for s in range(world) for t in range(len(all_in[s][1]))
                        if (all_in[s][1][t] == g).any()]
                c = int(recv_count[e])
                check(c == len(rows), f"step {step}: expert {g} count {c} vs {len(rows)}")
                if c != len(rows):
                    continue
                for p, (s, t) in enumerate(rows):
                    check(np.array_equal(recv[e, p], all_in[s][0][t]), f"expert {g} row {p}")
                    check(src_info[e, p] == t, f"expert {g} row {p}: src_info {src_info[e, p]}")
                check((recv[e, c:] == 0).all() and (src_info[e, c:] == -1).all(), "ll padding")
                for s in range(world):
                    mine = [p for p, (ss, _) in enumerate(rows) if ss == s]
                    begin, cnt = int(layout_range[e, s]) >> 32, int(layout_range[e, s]) & 0xFFFFFFFF
                    check(cnt == len(mine) and (not mine or begin == mine[0]),
                          f"expert {g} layout_range[{s}] = ({begin}, {cnt})")
            # --- low-latency combine: sum_k w_k * expert_k(x), one rounding
            scale = 1.0 + 0.125 * (me_first + np.arange(me_l, dtype=np.float32))
            y = float32_to_bf16(bf16_to_float32(recv) * scale[:, None, None])
            out = np.empty((len(x), HIDDEN), np.uint16)
            got, _, hook = buf.low_latency_combine(y, idx, w, ll, out=out)
            hook()
            check(got is out, "low_latency_combine(out=) returns out")
            terms = np.zeros((len(x), HIDDEN), np.float64)
            mag = np.zeros((len(x), HIDDEN), np.float64)
            xf = bf16_to_float32(x)
            for t in range(len(x)):
                for k in range(TOP_K):
                    e = idx[t, k]
                    if e < 0:
                        continue
                    yk = bf16_to_float32(float32_to_bf16(xf[t] * np.float32(1.0 + 0.125 * e)))
                    terms[t] += float(w[t, k]) * yk.astype(np.float64)
                    mag[t] += abs(float(w[t, k])) * np.abs(yk)
            err = np.abs(bf16_to_float32(got).astype(np.float64) - terms)
            # One round-to-nearest to bf16 (8 significant bits): |err| <= 2^-8 |v|,
            # plus the fp32 accumulation's few ulps.
            bound = 2.0 ** -8 * np.abs(terms) + 2.0 ** -20 * mag + 1e-30
            if not (err <= bound).all():
                check(False, f"step {step}: ll combine off by {float((err - bound).max())} "
                             f"beyond one bf16 rounding")
            # --- fp8 -------------------------------------------------------
            (codes, scales), c8, _, _, hook = buf.low_latency_dispatch(
                x, idx, MAX_TOKENS, NUM_EXPERTS, use_fp8=True)
            hook()
            check(codes.dtype == np.uint8 and scales.shape == (me_l, MAX_TOKENS * world, HIDDEN // 128),
                  "fp8 shapes")
            rows_f = bf16_to_float32(recv).reshape(me_l, -1, HIDDEN // 128, 128)
            amax = np.maximum(np.abs(rows_f).max(-1), 1e-4)
            check(np.allclose(scales, amax / 448, rtol=1e-6), "fp8 scales = amax / 448")
            deq = fp8_e4m3_dequantize(codes, scales).reshape(rows_f.shape)
            # Half an e4m3 step: at most 16 scale units (the step is 32 in [256, 448]).
            off = np.abs(deq - rows_f) - scales[..., None] * 16
            if not (off <= 1e-6 * np.abs(rows_f) + 1e-12).all():
                check(False, f"fp8 codes off by {off.max()}")
            check(np.array_equal(c8, recv_count), "fp8 counts")
        # --- two low-latency micro-batches in flight ----------------------
        a_in, b_in = inputs(rank, world, 7), inputs(rank, world, 8)
        ra, ca, ha, ea, hook_a = buf.low_latency_dispatch(a_in[0], a_in[1], MAX_TOKENS,
                                                          NUM_EXPERTS, use_fp8=False,
                                                          async_finish=True)
        rb, cb, hb, eb, hook_b = buf.low_latency_dispatch(b_in[0], b_in[1], MAX_TOKENS,
                                                          NUM_EXPERTS, use_fp8=False,
                                                          return_recv_hook=True)
        hook_b()
        ea.current_stream_wait()
        ya, _, _ = buf.low_latency_combine(ra, a_in[1], a_in[2], ha, async_finish=True)
        yb, evb, _ = buf.low_latency_combine(rb, b_in[1], b_in[2], hb)
        evb.current_stream_wait()
        ra2, _, ha2, _, _ = buf.low_latency_dispatch(a_in[0], a_in[1], MAX_TOKENS, NUM_EXPERTS,
                                                     use_fp8=False)
        ya2, _, _ = buf.low_latency_combine(ra2, a_in[1], a_in[2], ha2)
        check(np.array_equal(ra, ra2) and np.array_equal(ya, ya2),
              "two micro-batches in flight give the synchronous results")
        # --- an id out of range on the last rank ---------------------------
        x, idx, w = inputs(rank, world, 3)
        if rank == world - 1 and len(idx):
            idx = idx.copy()
            idx[len(idx) - 1, 1] = NUM_EXPERTS + 5
        try:
            buf.dispatch(x, topk_idx=idx, topk_weights=w)
            check(world == 1 and rank != world - 1, "an out-of-range id was accepted")
        except EngineError as e:
            if rank == world - 1:
                check(e.code == "INVALID_ARGUMENT" and
                      f"topk_ids[row {len(idx) - 1}, choice 1] = {NUM_EXPERTS + 5}" in e.message,
                      f"out-of-range id: {e}")
            else:
                check(e.code == "ABORTED" and f"rank {world - 1} rejected its input" in e.message,
                      f"peer of an out-of-range id: {e}")
        # --- bad input on the last rank: refused in the round ---------------
        # The last rank's own checks fail before any call; it still enters
        # the call's round refusing it, so the peers' calls end at once
        # (well inside the 120 s group timeout) with ABORTED naming it, and
        # nothing moves anywhere: the step after them is exact.
        last = rank == world - 1

        def refused(what: str, call: str, run, error, where: str = "") -> None:
            start = time.monotonic()
            try:
                run()
                check(False, f"{what}: accepted on rank {rank}")
            except EngineError as e:
                check(not last, f"{what}: the failing rank got {e}, not its own check's error")
                check(e.code == "ABORTED" and f"rank {world - 1} refused its {call}" in e.message
                      and e.message.startswith(where), f"{what}: peer of a refused call: {e}")
            except error as e:
                check(last, f"{what}: a peer raised its own check's error: {e}")
            took = time.monotonic() - start
            check(took < 30, f"{what}: rank {rank} waited {took:.1f} s")

        x, idx, w = inputs(rank, world, 5)
        bad_x = x[:, : HIDDEN // 2].copy() if last else x
        refused("Buffer.dispatch, x of half the hidden size", "moe_ep_sync_token_counts",
                lambda: buf.dispatch(bad_x, topk_idx=idx, topk_weights=w), ValueError,
                where="deep_ep.Buffer.dispatch: ")
        # More rows than the buffer holds on one rank: named in the Buffer's terms.
        cap = world * MAX_TOKENS * TOP_K
        many = np.zeros((cap + 1, HIDDEN), np.uint16) if last else x
        many_idx = np.zeros((cap + 1, TOP_K), np.int64) if last else idx
        many_w = np.zeros((cap + 1, TOP_K), np.float32) if last else w
        refused("Buffer.dispatch, more rows than the buffer's capacity",
                "moe_ep_sync_token_counts",
                lambda: buf.dispatch(many, topk_idx=many_idx, topk_weights=many_w), ValueError,
                where="deep_ep.Buffer.dispatch: ")
        # More tokens than the capacity on one rank, through the engine
        # module: every rank fails alike, each told whose count it is.
        try:
            buf.worker.sync_token_counts(cap + 1 if last else len(x))
            check(False, "a count above the capacity was accepted")
        except EngineError as e:
            check(e.code == "RESOURCE_EXHAUSTED" and
                  f"rank {world - 1} has {cap + 1} tokens, the most of the ranks" in e.message,
                  f"capacity exceeded: {e}")
        refused("Worker.sync_token_counts(-1)", "moe_ep_sync_token_counts",
                lambda: buf.worker.sync_token_counts(-1 if last else len(x)), ValueError)
        # The engine module's dispatch: every rank commits a step, the last
        # passes int64 ids (its check: int32).
        _, r5 = buf.worker.sync_token_counts(len(x))
        buf._epoch += 1
        buf.worker.commit_geometry(buf._epoch, r5, len(x))
        ids5 = idx.astype(np.int64) if last else idx.astype(np.int32)
        refused("Worker.dispatch, int64 topk_ids", "moe_ep_dispatch_only",
                lambda: buf.worker.dispatch(x, ids5, w, recv_rows=r5, timeout_s=60,
                                            end_step=True), TypeError)
        # The C call itself with a negative timeout_ms: refused in the round
        # (MOE_EP_INVALID_ARGUMENT here, ABORTED on the peers).
        if last:
            lib = buf.worker._lib
            st = lib.moe_ep_dispatch_only(buf.worker._live(), None, None, None, 0, None, None,
                                          None, 0, None, None, None, -5)
            msg = lib.moe_ep_last_error().decode()
            check(st == 3 and "timeout_ms: expected >= 0 (0 = no limit), got -5" in msg,
                  f"C dispatch with timeout_ms -5: status {st}, {msg}")
        else:
            refused("the C dispatch of a peer with a negative timeout", "moe_ep_dispatch_only",
                    lambda: buf.worker.dispatch(x, idx.astype(np.int32), w, recv_rows=r5,
                                                timeout_s=60, end_step=True), ValueError)
        # A negative timeout: the library would refuse it before the round.
        refused("Worker.dispatch, a negative timeout", "moe_ep_dispatch_only",
                lambda: buf.worker.dispatch(x, idx.astype(np.int32), w, recv_rows=r5,
                                            timeout_s=-1 if last else 60, end_step=True),
                ValueError)
        # An id beyond int32 is named with its value (not the int32 it would wrap to).
        last_t = len(inputs(world - 1, world, 5)[1])  # the same test on every rank
        wide = idx.astype(np.int64).copy()
        if last and len(wide):
            wide[0, 0] = 2 ** 33 + 1
        if last_t:
            refused("Buffer.dispatch, an id beyond int32", "moe_ep_sync_token_counts",
                    lambda: buf.dispatch(x, topk_idx=wide, topk_weights=w), ValueError)
        # The agreed counts against a limit that differs on one rank: that rank
        # raises after the sync and refuses the dispatch; the epochs stay
        # aligned, so the later steps pass (they failed "geometry mismatch").
        counts5 = [len(inputs(s, world, 5)[1]) for s in range(world)]
        if max(counts5) > 1:
            limit = 1 if last else MAX_TOKENS
            refused("low_latency_dispatch over one rank's smaller limit", "moe_ep_dispatch_only",
                    lambda: buf.low_latency_dispatch(x, idx, limit, NUM_EXPERTS, use_fp8=False),
                    ValueError)
        # Receive stats of the wrong length: refused before the exchange.
        bad_stats = np.zeros(me_l + (1 if last else 0), np.int64)
        refused("low_latency_dispatch with stats of the wrong length", "moe_ep_sync_token_counts",
                lambda: buf.low_latency_dispatch(x, idx, MAX_TOKENS, NUM_EXPERTS, use_fp8=False,
                                                 cumulative_local_expert_recv_stats=bad_stats),
                ValueError)
        # A combine whose routing has fewer rows than its dispatch.
        recv5, c5, ll5, _, hook5 = buf.low_latency_dispatch(x, idx, MAX_TOKENS, NUM_EXPERTS,
                                                            use_fp8=False)
        hook5()
        if last_t > 1:
            short = slice(0, len(idx) - 1) if last else slice(0, len(idx))
            refused("low_latency_combine with fewer tokens than its dispatch",
                    "moe_ep_sync_token_counts",
                    lambda: buf.low_latency_combine(recv5, idx[short], w[short], ll5), ValueError)
        y5, _, _ = buf.low_latency_combine(recv5, idx, w, ll5)
        check(y5.shape == (len(x), HIDDEN), "the combine after a refused one")
        # Ranks in different Buffer calls (the last in low_latency_dispatch,
        # the others in dispatch): each exchange's epoch carries its call, so
        # every rank gets ABORTED naming both calls and nothing moves.
        if world > 1:
            try:
                if last:
                    _, _, _, ev, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, NUM_EXPERTS,
                                                              use_fp8=False)
                    ev.current_stream_wait()
                else:
                    buf.dispatch(x, topk_idx=idx, topk_weights=w)
                check(False, f"rank {rank}: different Buffer calls were accepted")
            except EngineError as e:
                mine, other = (("low_latency_dispatch", "dispatch") if last
                               else ("dispatch", "low_latency_dispatch"))
                peer = 0 if last else world - 1
                check(e.code == "ABORTED" and
                      f"rank {peer} is in Buffer.{other}, this rank ({rank}) in Buffer.{mine}"
                      in e.message, f"different calls: {e}")
        x, idx, w = inputs(rank, world, 4)
        rx, _, rw, _, h4, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w)
        back, _, _ = buf.combine(rx, h4)
        dests = buf.get_dispatch_layout(idx, NUM_EXPERTS)[3].sum(1).astype(np.float32)
        check(np.array_equal(back, float32_to_bf16(bf16_to_float32(x) * dests[:, None])),
              "the step after the refused one is exact")
    finally:
        buf.destroy()
    return failures


def free_ports(n: int):
    """n loopback addresses free now, below Linux's ephemeral range (32768+):
    a port picked there and closed again can be taken, before the worker
    binds it, as the source port of any connection on the machine (ctest runs
    other tests beside this one), and a rank that cannot listen leaves its
    peers waiting for readiness."""
    import random

    rng = random.Random()
    found, socks = [], []
    while len(found) < n:
        port = rng.randrange(20000, 32000)
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        socks.append(s)
        found.append(port)
    for s in socks:
        s.close()
    return [f"127.0.0.1:{p}" for p in found]


def run_rank_processes(test: unittest.TestCase, script: str, world: int):
    """Runs `script --rank r --world N --addresses ...` as N processes and
    fails `test` unless every rank exits 0 and prints [] (its failures) last."""
    addresses = free_ports(world)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(script), "--rank", str(r),
                               "--world", str(world), "--addresses", ",".join(addresses)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    finished = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.communicate()
            test.fail(f"rank {r} of {world} did not finish in 240 s")
        finished.append((p.returncode, out, err))
    crashed = [f"rank {r}: exit {code}\n{err[-3000:]}"
               for r, (code, _, err) in enumerate(finished) if code != 0]
    test.assertEqual(crashed, [], f"{world} ranks:\n" + "\n".join(crashed))
    for r, (_, out, _) in enumerate(finished):
        test.assertEqual(json.loads(out.strip().splitlines()[-1]), [], f"rank {r} of {world}")


@unittest.skipUnless(LIBRARY, "MOE_EP_LIBRARY is not set (tests/embedded.cmake sets it)")
class DeepEpBufferTest(unittest.TestCase):
    def run_ranks(self, world: int):
        run_rank_processes(self, __file__, world)

    def test_one_rank(self):
        self.run_ranks(1)

    def test_two_ranks(self):
        self.run_ranks(2)

    def test_four_ranks(self):
        self.run_ranks(4)


if __name__ == "__main__":
    if "--rank" in sys.argv:
        args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
        print(json.dumps(run_rank(int(args["--rank"]), int(args["--world"]),
                                  args["--addresses"].split(","))))
        sys.exit(0)
    unittest.main()
