"""The vLLM and SGLang seams (issue 30 item 4) with their documented call
sequences, on the CPU plane with NumPy, in 2 and 4 rank processes (the last
of 4 has no tokens at step 0), each embedding a worker.

vLLM (moe_ep_client.vllm_seam): FusedMoEModularKernel's sequence —
prepare -> batched experts -> finalize(output) — checked against references
computed here from every rank's seeded inputs: the batched rows (bit-equal
to their sources, per local expert in source-then-token order, zeros past
the count), expert_num_tokens, output = sum_k w_k * expert_k(x) within one
bf16 rounding; two micro-batches through prepare_async / finalize_async
bit-equal to the synchronous calls; fp8 with 128-blocks (codes and scales =
amax / 448) and defer_input_quant; apply_router_weight_on_input; the
refusals (expert_map, weight_and_reduce_impl, order, top-k) leaving the next
step exact.

SGLang (moe_ep_client.sglang_seam): dispatch(hidden_states, topk_output) ->
DEEPEP_LL output (rows, masked_m, expected_m, the ids and weights carried),
combine(DeepEPLLCombineInput) within one bf16 rounding; the two-batch
overlap split (dispatch_a, dispatch_a, dispatch_b, dispatch_b, combine_a,
combine_b, ...) bit-equal to the plain calls; order refusals.

Run by ctest (tests/embedded.cmake: embedded_python_seams) with
MOE_EP_LIBRARY and PYTHONPATH set; skips without them.
"""

import json
import os
import sys
import unittest
from typing import Any, NamedTuple

import numpy as np

from test_deep_ep import (HIDDEN, MAX_TOKENS, NUM_EXPERTS, TOP_K, inputs, placement,
                          run_rank_processes)

LIBRARY = os.environ.get("MOE_EP_LIBRARY")


class TopKOutput(NamedTuple):
    """SGLang's StandardTopKOutput fields."""

    topk_weights: Any
    topk_ids: Any
    router_logits: Any


def scale_of(g):
    return np.float32(1.0 + 0.125 * g)


def run_rank(rank: int, world: int, addresses):
    from moe_ep_client.deep_ep import Buffer, fp8_e4m3_dequantize
    from moe_ep_client.engine import EngineError, bf16_to_float32, float32_to_bf16
    from moe_ep_client.sglang_seam import (DeepEPLLCombineInput, DispatchOutputFormat,
                                           MoeEpLowLatencyDispatcher)
    from moe_ep_client.vllm_seam import FusedMoEActivationFormat, MoeEpPrepareAndFinalize

    failures = []

    def check(ok, what):
        if not ok:
            failures.append(what)

    def refused(fn, what, needle):
        try:
            fn()
            check(False, f"{what}: accepted")
        except ValueError as e:
            check(needle in str(e), f"{what}: {e}")

    first, sizes, owner = placement(world)
    me_first, me_l = first[rank], sizes[rank]
    slots = MAX_TOKENS * world

    def want_rows(all_in):
        """Per local expert: the (source, token) rows it receives, in order."""
        return [[(s, t) for s in range(world) for t in range(len(all_in[s][1]))
                 if (all_in[s][1][t] == me_first + e).any()] for e in range(me_l)]

    def check_rows(rows, counts, all_in, what):
        want = want_rows(all_in)
        check(rows.shape == (me_l, slots, HIDDEN), f"{what}: rows shape {rows.shape}")
        check(np.asarray(counts).tolist() == [len(w) for w in want],
              f"{what}: counts {np.asarray(counts).tolist()} vs {[len(w) for w in want]}")
        for e, w in enumerate(want):
            got = np.stack([rows[e, p] for p in range(len(w))]) if w else np.zeros((0, HIDDEN))
            ref = np.stack([all_in[s][0][t] for s, t in w]) if w else np.zeros((0, HIDDEN))
            check(np.array_equal(got, ref), f"{what}: expert {me_first + e} rows")
            check((rows[e, len(w):] == 0).all(), f"{what}: expert {me_first + e} padding")

    def experts(rows, counts):
        """Each local expert g scales its valid rows by 1 + g / 8 (bf16 out)."""
        out = np.zeros_like(rows)
        for e in range(me_l):
            c = int(counts[e])
            out[e, :c] = float32_to_bf16(bf16_to_float32(rows[e, :c]) * scale_of(me_first + e))
        return out

    def check_combined(got, x, idx, w, what):
        terms = np.zeros((len(x), HIDDEN), np.float64)
        mag = np.zeros_like(terms)
        xf = bf16_to_float32(x)
        for t in range(len(x)):
            for k in range(idx.shape[1]):
                if idx[t, k] < 0:
                    continue
                yk = bf16_to_float32(float32_to_bf16(xf[t] * scale_of(idx[t, k]))).astype(np.float64)
                terms[t] += float(w[t, k]) * yk
                mag[t] += abs(float(w[t, k])) * np.abs(yk)
        err = np.abs(bf16_to_float32(got).astype(np.float64) - terms)
        # One round-to-nearest to bf16 plus the fp32 accumulation's few ulps.
        bound = 2.0 ** -8 * np.abs(terms) + 2.0 ** -20 * mag + 1e-30
        check(got.shape == (len(x), HIDDEN) and bool((err <= bound).all()),
              f"{what}: combined off by {float((err - bound).max()) if err.size else 0}")

    expert_map = np.full(NUM_EXPERTS, -1, np.int64)
    expert_map[me_first:me_first + me_l] = np.arange(me_l)
    buf = Buffer(None, hidden=HIDDEN, num_experts=NUM_EXPERTS, num_topk=TOP_K,
                 num_max_tokens_per_rank=MAX_TOKENS, rank=rank, world_size=world,
                 addresses=addresses, timeout_s=60, group_timeout_s=60)
    try:
        # ------------------------------------------------------------ vLLM
        pf = MoeEpPrepareAndFinalize(buf, MAX_TOKENS)
        check(pf.activation_format == FusedMoEActivationFormat.BatchedExperts, "format")
        check(pf.num_dispatchers() == world and pf.max_num_tokens_per_rank() == MAX_TOKENS and
              pf.output_is_reduced() and pf.supports_async(), "vLLM properties")
        for step in range(2):
            all_in = [inputs(r, world, step) for r in range(world)]
            x, idx, w = all_in[rank]
            a, a_scale, meta, ids_out, w_out = pf.prepare(x, w, idx, NUM_EXPERTS, expert_map,
                                                          False, None, False)
            check(a_scale is None and ids_out is None and w_out is None, "bf16 prepare extras")
            check_rows(a, meta.expert_num_tokens, all_in, f"vLLM step {step}")
            check(meta.expert_num_tokens.dtype == np.int32, "expert_num_tokens int32")
            out = np.full((len(x), HIDDEN), 0xFFFF, np.uint16)
            check(pf.finalize(out, experts(a, meta.expert_num_tokens), w, idx, False, None) is None,
                  "finalize returns None")
            check_combined(out, x, idx, w, f"vLLM step {step}")
        # Two micro-batches in flight: vLLM's dual-batch-overlap order.
        (xa, ia, wa), (xb, ib, wb) = inputs(rank, world, 5), inputs(rank, world, 6)
        hook_a, recv_a = pf.prepare_async(xa, wa, ia, NUM_EXPERTS, None, False, None)
        hook_b, recv_b = pf.prepare_async(xb, wb, ib, NUM_EXPERTS, None, False, None)
        refused(lambda: pf.prepare(xa, wa, ia, NUM_EXPERTS, None, False, None),
                "a third micro-batch", "already in flight")
        hook_a()
        ra, rb = recv_a(), recv_b()
        out_a = np.zeros((len(xa), HIDDEN), np.uint16)
        out_b = np.zeros((len(xb), HIDDEN), np.uint16)
        fa, ga = pf.finalize_async(out_a, experts(ra[0], ra[2].expert_num_tokens), wa, ia, False)
        fb, gb = pf.finalize_async(out_b, experts(rb[0], rb[2].expert_num_tokens), wb, ib, False)
        fa()
        ga()
        fb()
        gb()
        for (xs, is_, ws), got, res in (((xa, ia, wa), out_a, ra), ((xb, ib, wb), out_b, rb)):
            a, _, meta, _, _ = pf.prepare(xs, ws, is_, NUM_EXPERTS, None, False, None)
            sync = np.zeros_like(got)
            pf.finalize(sync, experts(a, meta.expert_num_tokens), ws, is_, False)
            check(np.array_equal(a, res[0]) and np.array_equal(sync, got),
                  "micro-batches in flight give the synchronous results")
        # fp8 in 128-blocks, and the same config deferred.
        all_in = [inputs(r, world, 2) for r in range(world)]
        x, idx, w = all_in[rank]
        codes, scales, meta, _, _ = pf.prepare(x, w, idx, NUM_EXPERTS, None, False, "fp8_e4m3")
        bf, _, _, _, _ = pf.prepare(x, w, idx, NUM_EXPERTS, None, False, "fp8_e4m3", True)
        check(codes.dtype == np.uint8 and scales.shape == (me_l, slots, HIDDEN // 128),
              "fp8 prepare shapes")
        check_rows(bf, meta.expert_num_tokens, all_in, "deferred fp8 (bf16 rows)")
        rows_f = bf16_to_float32(bf).reshape(me_l, slots, HIDDEN // 128, 128)
        check(np.allclose(scales, np.maximum(np.abs(rows_f).max(-1), 1e-4) / 448, rtol=1e-6),
              "fp8 scales = amax / 448")
        off = np.abs(fp8_e4m3_dequantize(codes, scales).reshape(rows_f.shape) - rows_f)
        # Half an e4m3 step: at most 16 scale units.
        check(bool((off <= scales[..., None] * 16 + 1e-6 * np.abs(rows_f) + 1e-12).all()),
              "fp8 codes within half a step")
        for _ in range(2):  # one finalize per prepare above, in order
            sink = np.zeros((len(x), HIDDEN), np.uint16)
            pf.finalize(sink, experts(bf, meta.expert_num_tokens), w, idx, False)
        check_combined(sink, x, idx, w, "after fp8 prepares")
        # Refusals change nothing: the step after them is exact.
        refused(lambda: pf.prepare(x, w, idx, NUM_EXPERTS, np.roll(expert_map, 1), False, None),
                "a foreign expert_map", "contiguous placement")
        refused(lambda: pf.prepare(x, w, idx, NUM_EXPERTS, None, True, None),
                "apply_router_weight_on_input with top-k 3", "needs top-k 1")
        refused(lambda: pf.finalize(np.zeros((len(x), HIDDEN), np.uint16), a, w, idx, False),
                "finalize before prepare", "no prepare is in flight")
        a, _, meta, _, _ = pf.prepare(x, w, idx, NUM_EXPERTS, None, False, None)

        class TopKWeightAndReduceContiguous:
            pass

        out = np.zeros((len(x), HIDDEN), np.uint16)
        refused(lambda: pf.finalize(out, a, w, idx, False, TopKWeightAndReduceContiguous()),
                "a reduction outside the combine", "TopKWeightAndReduceDelegate")
        pf.finalize(out, experts(a, meta.expert_num_tokens), w, idx, False)
        check_combined(out, x, idx, w, "the step after the refusals")
        # One rank's own check fails (issue 30 item 1): that rank raises, the
        # peers' same call raises EngineError ABORTED naming it at once (it
        # meets their exchange, refusing it), and the next step is exact.
        last = rank == world - 1

        def alone(fn, what, needle):
            try:
                fn()
                check(False, f"{what}: accepted on rank {rank}")
            except EngineError as e:
                check(not last and e.code == "ABORTED" and f"rank {world - 1} refused" in e.message,
                      f"{what}: peer got {e}")
            except (TypeError, ValueError) as e:
                check(last and needle in str(e), f"{what}: rank {rank} raised {e}")

        big = np.zeros((MAX_TOKENS + 1, HIDDEN), np.uint16)
        alone(lambda: pf.prepare(big if last else x, w, idx, NUM_EXPERTS, None, False, None),
              "vLLM prepare with too many tokens on one rank", "more than max_num_tokens_per_rank")
        a, _, meta, _, _ = pf.prepare(x, w, idx, NUM_EXPERTS, None, False, None)
        out = np.zeros((len(x), HIDDEN), np.uint16)
        alone(lambda: pf.finalize(out, experts(a, meta.expert_num_tokens), w,
                                  idx[:-1] if last else idx, False),
              "vLLM finalize with the wrong token count on one rank", "the oldest prepare had")
        # The refused finalize kept its prepare on every rank: finalize it.
        pf.finalize(out, experts(a, meta.expert_num_tokens), w, idx, False)
        check_combined(out, x, idx, w, "the finalize after one rank's refusal")
        # apply_router_weight_on_input: top-1, the weight scales the input.
        x1, i1, w1 = x, idx[:, :1].copy(), w[:, :1].copy()
        a, _, meta, _, _ = pf.prepare(x1, w1, i1, NUM_EXPERTS, None, True, None)
        out = np.zeros((len(x1), HIDDEN), np.uint16)
        pf.finalize(out, experts(a, meta.expert_num_tokens), w1, i1, True)
        xw = float32_to_bf16(bf16_to_float32(x1) * w1)
        check_combined(out, xw, i1, np.ones_like(w1), "apply_router_weight_on_input")
        # ---------------------------------------------------------- SGLang
        d = MoeEpLowLatencyDispatcher(buf, MAX_TOKENS)
        for step in range(2):
            all_in = [inputs(r, world, 10 + step) for r in range(world)]
            x, idx, w = all_in[rank]
            o = d.dispatch(x, TopKOutput(w, idx, None))
            check(o.format == DispatchOutputFormat.DEEPEP_LL, f"SGLang format {o.format}")
            check(o.hidden_states_scale is None and o.topk_ids is idx and o.topk_weights is w,
                  "SGLang output carries the routing")
            check_rows(o.hidden_states, o.masked_m, all_in, f"SGLang step {step}")
            want_m = max(1, min(-(-len(x) * world * TOP_K // NUM_EXPERTS), slots))
            check(o.expected_m == want_m, f"expected_m {o.expected_m} vs {want_m}")
            y = d.combine(DeepEPLLCombineInput(experts(o.hidden_states, o.masked_m), o.topk_ids,
                                               o.topk_weights))
            check_combined(y, x, idx, w, f"SGLang step {step}")
        # One rank's dispatch without a routing: refused there (dispatch_a),
        # ABORTED on the peers (their dispatch_b), the next dispatch exact.
        alone(lambda: d.dispatch(x, None if last else TopKOutput(w, idx, None)),
              "SGLang dispatch without topk_output on one rank", "topk_output")
        o = d.dispatch(x, TopKOutput(w, idx, None))
        y = d.combine(DeepEPLLCombineInput(experts(o.hidden_states, o.masked_m), idx, w))
        check_combined(y, x, idx, w, "SGLang step after one rank's refusal")
        # Two-batch overlap: a, a, b, b, then each combine split.
        (xa, ia, wa), (xb, ib, wb) = inputs(rank, world, 12), inputs(rank, world, 13)
        d.dispatch_a(xa, TopKOutput(wa, ia, None))
        d.dispatch_a(xb, TopKOutput(wb, ib, None))
        refused(lambda: d.dispatch_a(xa, TopKOutput(wa, ia, None)), "a third dispatch",
                "already in flight")
        oa, ob = d.dispatch_b(), d.dispatch_b()
        refused(d.dispatch_b, "dispatch_b without dispatch_a", "no dispatch_a")
        refused(d.combine_b, "combine_b without combine_a", "no combine_a")
        d.combine_a(DeepEPLLCombineInput(experts(oa.hidden_states, oa.masked_m), ia, wa))
        ya = d.combine_b()
        d.combine_a(DeepEPLLCombineInput(experts(ob.hidden_states, ob.masked_m), ib, wb))
        yb = d.combine_b()
        refused(lambda: d.combine(DeepEPLLCombineInput(ya, ia, wa)), "a combine too many",
                "no dispatch is waiting")
        for (xs, is_, ws), o, y in (((xa, ia, wa), oa, ya), ((xb, ib, wb), ob, yb)):
            o2 = d.dispatch(xs, TopKOutput(ws, is_, None))
            y2 = d.combine(DeepEPLLCombineInput(experts(o2.hidden_states, o2.masked_m), is_, ws))
            check(np.array_equal(o.hidden_states, o2.hidden_states) and np.array_equal(y, y2),
                  "two-batch overlap gives the plain calls' results")
    finally:
        buf.destroy()
    return failures


@unittest.skipUnless(LIBRARY, "MOE_EP_LIBRARY is not set (tests/embedded.cmake sets it)")
class SeamsTest(unittest.TestCase):
    def run_ranks(self, world: int):
        run_rank_processes(self, __file__, world)

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
