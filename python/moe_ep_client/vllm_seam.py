"""vLLM's seam: a `FusedMoEPrepareAndFinalize` over moe-ep's DeepEP-shaped Buffer.

vLLM plugs an all-to-all library into its modular fused-MoE kernel as a
prepare/finalize pair (vllm/model_executor/layers/fused_moe/modular_kernel.py;
docs/design/fused_moe_modular_kernel.md). This one uses the batched-experts
activation format, like vLLM's DeepEP low-latency pair (issue 30 item 4;
DESIGN §14):

    from moe_ep_client.deep_ep import Buffer
    from moe_ep_client.vllm_seam import MoeEpPrepareAndFinalize
    pf = MoeEpPrepareAndFinalize(Buffer(group, hidden=H, num_experts=E, num_topk=K,
                                        num_max_tokens_per_rank=M), max_tokens_per_rank=M)
    a, a_scale, meta, _, _ = pf.prepare(a1, topk_weights, topk_ids, E, None, False,
                                        quant_config, False)
    # a: [num_local_experts, num_dispatchers() * M, H]; meta.expert_num_tokens [L]
    fused_out = experts(a, meta)          # same shape as `a`, bf16, unweighted
    pf.finalize(output, fused_out, topk_weights, topk_ids, False, None)  # output [T, H]

prepare: a1 bf16 [T, H] (T <= max_tokens_per_rank), topk_weights float32
[T, K], topk_ids int [T, K] with -1 = no expert, global ids. Returns
(rows [L, num_dispatchers * M, H] bf16 — or e4m3 codes when the quant
config asks for fp8 with 128-blocks, see below —, their float32 scales
[L, num_dispatchers * M, H / 128] or None, ExpertTokensMetadata with
expert_num_tokens [L] int32 (valid rows of each local expert, on the
array's device) and expert_num_tokens_cpu, None, None): rows of a local
expert sit first in its slice, in (source rank, source token, choice) order;
rows past the count are zeros.

finalize: fused_expert_output [L, num_dispatchers * M, H] bf16 (the experts'
unweighted outputs, row for row as prepare gave them), the same topk_weights
and topk_ids -> output [T, H] bf16, written in place: output[t] =
sum_k topk_weights[t, k] * out(row of (t, k)), accumulated in fp32 and rounded
to bf16 once. The weights are applied in the combine (vLLM's
TopKWeightAndReduceDelegate); a weight_and_reduce_impl that would reduce
elsewhere is refused with ValueError.

Quantization (vLLM's FusedMoEQuantConfig; `quant_dtype`, `block_shape`):
fp8 e4m3 with block_shape [128, 128] (DeepSeek's, or the string "fp8_e4m3")
dispatches fp8 codes with per-token, per-128-channel scales (amax / 448),
unless defer_input_quant; any other format dispatches bf16 and leaves the
quantization to the experts, as vLLM's document prescribes for formats a
backend does not carry.

apply_router_weight_on_input (K must be 1): a1 is scaled by its weight
before the dispatch and the combine applies no weight. A top-k narrower
than the buffer's is widened with choices of no expert (-1, weight 0).

expert_map: the buffer places experts contiguously (rank r owns ids
[r * E / n ...), the first E % n ranks one more); a map that disagrees
(its non-negative entries are not exactly this rank's ids, numbered 0..L-1)
is refused with ValueError.

Micro-batches: every prepare is matched by a finalize in the same order
(vLLM's dual-batch overlap calls prepare(0), prepare(1), finalize(0),
finalize(1)); up to two may be in flight. prepare_async / finalize_async
return (hook, receiver) as vLLM's document describes: hook() waits for the
exchange, receiver() gives prepare's tuple (or completes `output`). A
prepare or finalize that raises leaves the prepares in flight as they were,
on every rank alike (a prepare refused anywhere is in flight nowhere; a
refused finalize's prepare stays in flight: finalize it again).

Errors: ValueError / TypeError for arguments (shape, dtype, order), the
Buffer's EngineError for the worker (an id outside [-1, E) is
INVALID_ARGUMENT on its rank, ABORTED on its peers; nothing moves). A rank
whose arguments fail here still meets its peers' exchange, refusing it
(deep_ep.refused_on_error): they raise EngineError ABORTED naming it. Not
thread-safe: one engine thread per rank, every rank making the same calls in
the same order. Works with NumPy arrays (bf16 as uint16 bits) and CPU torch
tensors, without vLLM installed; with vLLM installed the class derives from
its abstract base so FusedMoEModularKernel accepts it.
"""

import collections
import enum
from dataclasses import dataclass
from typing import Any, Callable, Deque, Optional, Tuple

from .deep_ep import Buffer, LowLatencyHandle, refused_on_error
from .engine import _is_torch, bf16_to_float32, float32_to_bf16

try:  # vLLM's own types where vLLM is installed (an engine's process)
    from vllm.model_executor.layers.fused_moe import modular_kernel as _mk

    FusedMoEActivationFormat: Any = _mk.FusedMoEActivationFormat
    ExpertTokensMetadata: Any = _mk.ExpertTokensMetadata
    _Base: Any = getattr(_mk, "FusedMoEPrepareAndFinalizeModular",
                         getattr(_mk, "FusedMoEPrepareAndFinalize", object))
except ImportError:  # a stand-in with the same names and fields
    class FusedMoEActivationFormat(enum.Enum):  # type: ignore[no-redef]
        """vLLM's two activation formats (the values vLLM uses)."""

        Standard = ("standard",)
        BatchedExperts = ("batched_experts",)

    @dataclass
    class ExpertTokensMetadata:  # type: ignore[no-redef]
        """Valid rows per local expert (vLLM's field names)."""

        expert_num_tokens: Any
        expert_num_tokens_cpu: Any
        psum_recv_per_rank: Any = None

    _Base = object

MAX_IN_FLIGHT = 2  # micro-batches between a prepare and its finalize


def _wants_fp8(quant_config: Any) -> bool:
    """True when the config asks for e4m3 activations in 128-channel blocks."""
    if quant_config is None:
        return False
    dtype = quant_config if isinstance(quant_config, str) else getattr(quant_config, "quant_dtype",
                                                                       None)
    if dtype is None or str(dtype) not in ("torch.float8_e4m3fn", "fp8_e4m3"):
        return False
    block = getattr(quant_config, "block_shape", [128, 128])
    return block is not None and list(block) == [128, 128]


def _scaled_by_weight(a1: Any, topk_weights: Any) -> Any:
    """a1 * topk_weights[:, 0] per row, rounded to bf16 (K == 1)."""
    if _is_torch(a1):
        return (a1.float() * topk_weights[:, :1].float()).to(a1.dtype)
    import numpy as np

    return float32_to_bf16(bf16_to_float32(a1) * np.asarray(topk_weights, np.float32)[:, :1])


def _pad_topk(ids: Any, weights: Any, k: int) -> Tuple[Any, Any]:
    """[T, k0 <= k] ids / weights widened to the buffer's top-k with choices
    of no expert (-1, weight 0), so a top-1 call runs on a top-k buffer."""
    k0 = ids.shape[1]
    if k0 == k:
        return ids, weights
    if k0 > k:
        raise ValueError(f"topk_ids: top-k {k0}, more than the buffer's {k}")
    if _is_torch(ids):
        import torch

        pad_ids = torch.full((ids.shape[0], k - k0), -1, dtype=ids.dtype, device=ids.device)
        pad_w = torch.zeros((weights.shape[0], k - k0), dtype=weights.dtype, device=weights.device)
        return torch.cat([ids, pad_ids], 1), torch.cat([weights, pad_w], 1)
    import numpy as np

    ids = np.concatenate([ids, np.full((ids.shape[0], k - k0), -1, ids.dtype)], 1)
    weights = np.concatenate([weights, np.zeros((weights.shape[0], k - k0), weights.dtype)], 1)
    return ids, weights


class MoeEpPrepareAndFinalize(_Base):  # type: ignore[misc,valid-type]
    """vLLM prepare/finalize in the batched-experts format (see the module doc).

    buffer: a moe_ep_client.deep_ep.Buffer; max_tokens_per_rank: the most
    tokens a rank passes to one prepare (<= the buffer's
    num_max_tokens_per_rank). Raises ValueError for a max outside it.
    """

    def __init__(self, buffer: Buffer, max_tokens_per_rank: int, moe_config: Any = None,
                 quant_config: Any = None) -> None:
        if not isinstance(max_tokens_per_rank, int) or not (
                1 <= max_tokens_per_rank <= buffer.num_max_tokens_per_rank):
            raise ValueError(f"max_tokens_per_rank: expected in [1, "
                             f"{buffer.num_max_tokens_per_rank}] (the buffer's), got "
                             f"{max_tokens_per_rank!r}")
        # vLLM's base keeps these two; set them without its constructor,
        # whose signature changed across vLLM releases.
        self.moe_config = moe_config
        self.quant_config = quant_config
        self.buffer = buffer
        self.max_tokens = max_tokens_per_rank
        self._handles: Deque[Tuple[LowLatencyHandle, int]] = collections.deque()

    # ----------------------------------------------------------- properties

    @property
    def activation_format(self) -> Any:
        return FusedMoEActivationFormat.BatchedExperts

    def topk_indices_dtype(self) -> Any:
        """int64, DeepEP's (torch.int64 where torch is installed)."""
        try:
            import torch

            return torch.int64
        except ImportError:
            import numpy as np

            return np.int64

    def max_num_tokens_per_rank(self) -> int:
        return self.max_tokens

    def num_dispatchers(self) -> int:
        return self.buffer.group_size

    def output_is_reduced(self) -> bool:
        """True: finalize's output already sums every rank's experts."""
        return True

    def supports_async(self) -> bool:
        return True

    def supports_deferred_moe_finalize(self) -> bool:
        return False

    def post_init_setup(self, fused_experts: Any) -> None:
        """Nothing depends on the experts object."""

    # -------------------------------------------------------------- prepare

    def _drop(self, entry: Any) -> None:
        """Removes `entry` (by identity) from the prepares in flight."""
        for i, e in enumerate(self._handles):
            if e is entry:
                del self._handles[i]
                return

    def _check_expert_map(self, expert_map: Any) -> None:
        if expert_map is None:
            return
        import numpy as np

        m = expert_map.cpu().numpy() if _is_torch(expert_map) else np.asarray(expert_map)
        b = self.buffer
        first = b.first_local_expert
        want = np.full(b.num_experts, -1, dtype=np.int64)
        want[first:first + b.num_local_experts] = np.arange(b.num_local_experts)
        if m.shape != want.shape or not np.array_equal(m.astype(np.int64), want):
            raise ValueError(f"expert_map: rank {b.rank} owns global experts [{first}, "
                             f"{first + b.num_local_experts}) as local 0..{b.num_local_experts - 1}"
                             f" (the buffer's contiguous placement); the map given differs")

    @refused_on_error
    def prepare_async(self, a1: Any, topk_weights: Any, topk_ids: Any, num_experts: int,
                      expert_map: Any, apply_router_weight_on_input: bool, quant_config: Any,
                      defer_input_quant: bool = False
                      ) -> Tuple[Callable[[], None], Callable[[], Tuple]]:
        """Starts the dispatch; returns (hook, receiver) (see the module doc)."""
        if len(self._handles) >= MAX_IN_FLIGHT:
            raise ValueError(f"prepare: {MAX_IN_FLIGHT} micro-batches are already in flight; "
                             f"finalize the oldest first")
        if num_experts != self.buffer.num_experts:
            raise ValueError(f"num_experts: the buffer has {self.buffer.num_experts}, got "
                             f"{num_experts}")
        if a1.shape[0] > self.max_tokens:
            raise ValueError(f"a1: {a1.shape[0]} tokens, more than max_num_tokens_per_rank "
                             f"{self.max_tokens}")
        self._check_expert_map(expert_map)
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError(f"apply_router_weight_on_input: needs top-k 1, got "
                                 f"{topk_ids.shape[1]}")
            a1 = _scaled_by_weight(a1, topk_weights)
        topk_ids, topk_weights = _pad_topk(topk_ids, topk_weights, self.buffer.num_topk)
        use_fp8 = _wants_fp8(quant_config) and not defer_input_quant
        recv, count, handle, _, exchange = self.buffer.low_latency_dispatch(
            a1, topk_ids, self.max_tokens, num_experts, use_fp8=use_fp8, return_recv_hook=True)
        entry = (handle, int(topk_ids.shape[0]))
        self._handles.append(entry)

        def hook() -> None:
            try:
                exchange()
            except Exception:
                # The exchange failed on every rank (a peer refused it:
                # nothing moved), so this prepare is not in flight anywhere.
                self._drop(entry)
                raise

        def receiver() -> Tuple:
            hook()
            rows, scales = recv if use_fp8 else (recv, None)
            counts_cpu = count.cpu() if _is_torch(count) else count
            meta = ExpertTokensMetadata(expert_num_tokens=count,
                                        expert_num_tokens_cpu=counts_cpu)
            return rows, scales, meta, None, None

        return hook, receiver

    def prepare(self, a1: Any, topk_weights: Any, topk_ids: Any, num_experts: int,
                expert_map: Any, apply_router_weight_on_input: bool, quant_config: Any,
                defer_input_quant: bool = False) -> Tuple:
        """Dispatches; returns vLLM's PrepareResultType (see the module doc)."""
        _, receiver = self.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                         apply_router_weight_on_input, quant_config,
                                         defer_input_quant)
        return receiver()

    # ------------------------------------------------------------- finalize

    @refused_on_error
    def finalize_async(self, output: Any, fused_expert_output: Any, topk_weights: Any,
                       topk_ids: Any, apply_router_weight_on_input: bool,
                       weight_and_reduce_impl: Any = None
                       ) -> Tuple[Callable[[], None], Callable[[], None]]:
        """Starts the combine of the oldest prepare; returns (hook, receiver):
        `output` is complete once either returns."""
        if not self._handles:
            raise ValueError("finalize: no prepare is in flight (call prepare first; every "
                             "prepare is matched by one finalize, in order)")
        if weight_and_reduce_impl is not None and \
                type(weight_and_reduce_impl).__name__ != "TopKWeightAndReduceDelegate":
            raise ValueError(f"weight_and_reduce_impl: the combine applies the weights and "
                             f"reduces (TopKWeightAndReduceDelegate); got "
                             f"{type(weight_and_reduce_impl).__name__}")
        entry = self._handles[0]
        handle, tokens = entry
        if topk_ids.shape[0] != tokens:
            raise ValueError(f"topk_ids: the oldest prepare had {tokens} tokens, got "
                             f"{topk_ids.shape[0]}")
        weights = topk_weights
        if apply_router_weight_on_input:
            import numpy as np

            weights = (topk_weights * 0 + 1) if _is_torch(topk_weights) else \
                np.ones(topk_weights.shape, np.float32)
        topk_ids, weights = _pad_topk(topk_ids, weights, self.buffer.num_topk)
        self._handles.popleft()
        try:
            _, _, exchange = self.buffer.low_latency_combine(
                fused_expert_output, topk_ids, weights, handle, return_recv_hook=True, out=output)
        except Exception:
            self._handles.appendleft(entry)  # refused here: the prepare stays in flight
            raise
        failed = []

        def hook() -> None:
            try:
                exchange()
            except Exception:
                # Refused by a peer (nothing moved): the prepare stays in
                # flight, as on the refusing rank; finalize it again.
                if not failed:
                    failed.append(True)
                    self._handles.appendleft(entry)
                raise

        return hook, hook

    def finalize(self, output: Any, fused_expert_output: Any, topk_weights: Any, topk_ids: Any,
                 apply_router_weight_on_input: bool, weight_and_reduce_impl: Any = None) -> None:
        """Combines into `output` [T, H] bf16 in place (see the module doc)."""
        _, receiver = self.finalize_async(output, fused_expert_output, topk_weights, topk_ids,
                                          apply_router_weight_on_input, weight_and_reduce_impl)
        receiver()
