"""SGLang's seam: a token dispatcher emitting the DeepEP low-latency format.

SGLang plugs an all-to-all into its MoE layers as a token dispatcher
(python/sglang/srt/layers/moe/token_dispatcher/base.py: `dispatch(
hidden_states, topk_output)` -> a DispatchOutput with a `format`,
`combine(combine_input)` -> [T, H]); the cheapest drop-in emits
DispatchOutputFormat.DEEPEP_LL, which SGLang's DeepGEMM masked grouped GEMM
already consumes (issue 30 item 4; DESIGN §14):

    from moe_ep_client.deep_ep import Buffer
    from moe_ep_client.sglang_seam import MoeEpLowLatencyDispatcher, DeepEPLLCombineInput
    d = MoeEpLowLatencyDispatcher(Buffer(group, hidden=H, num_experts=E, num_topk=K,
                                         num_max_tokens_per_rank=M),
                                  num_max_dispatch_tokens_per_rank=M)
    out = d.dispatch(hidden_states, topk_output)     # topk_output.topk_ids / .topk_weights
    y = experts(out.hidden_states, out.masked_m, out.expected_m)
    combined = d.combine(DeepEPLLCombineInput(y, out.topk_ids, out.topk_weights))

dispatch: hidden_states bf16 [T, H] (T <= num_max_dispatch_tokens_per_rank),
topk_output with `topk_ids` int [T, K] (global ids, -1 = none) and
`topk_weights` float32 [T, K] (SGLang's StandardTopKOutput) -> a
DeepEPLLDispatchOutput: hidden_states [L, E_ranks * M, H] bf16 (or e4m3
codes with use_fp8), hidden_states_scale float32 [L, E_ranks * M, H / 128]
or None, topk_ids and topk_weights as given (the combine needs them, as in
SGLang's DeepEP dispatcher), masked_m [L] int32 (valid rows of each local
expert; rows past it are zeros) and expected_m, a hint for the grouped GEMM:
the rows an expert would get with this rank's T on every rank and uniform
routing, ceil(T * ranks * K / E), at least 1 and at most E_ranks * M.

combine: a combine input with hidden_states (the experts' outputs,
[L, E_ranks * M, H] bf16, row for row as dispatched), topk_ids, topk_weights
-> [T, H] bf16, sum_k w_k * out(row of (t, k)) in fp32 with one rounding.

dispatch_a / dispatch_b and combine_a / combine_b split each call around the
exchange for SGLang's two-batch overlap: _a starts it, _b waits and returns;
each _a is matched by its _b in order, and at most two dispatches are in
flight before their combines. Errors: ValueError / TypeError for arguments
and call order (a rank whose _a call fails them still meets its peers'
exchange, refusing it: they raise EngineError ABORTED naming it), the
Buffer's EngineError from the worker. Not thread-safe;
every rank makes the same calls in the same order. NumPy arrays or CPU torch
tensors; SGLang's own output classes are used when SGLang is installed.
"""

import collections
import enum
from typing import Any, Deque, NamedTuple, Optional, Tuple

from .deep_ep import Buffer, refused_on_error

try:  # SGLang's own types where SGLang is installed (an engine's process)
    from sglang.srt.layers.moe.token_dispatcher import base as _base
    from sglang.srt.layers.moe.token_dispatcher import deepep as _deepep

    DispatchOutputFormat: Any = _base.DispatchOutputFormat
    CombineInputFormat: Any = _base.CombineInputFormat
    DeepEPLLDispatchOutput: Any = _deepep.DeepEPLLDispatchOutput
    DeepEPLLCombineInput: Any = _deepep.DeepEPLLCombineInput
    _Base: Any = _base.BaseDispatcher
except ImportError:  # stand-ins with SGLang's names, fields and values
    class DispatchOutputFormat(enum.Enum):  # type: ignore[no-redef]
        STANDARD = "standard"
        DEEPEP_NORMAL = "deepep_normal"
        DEEPEP_LL = "deepep_ll"

    class CombineInputFormat(enum.Enum):  # type: ignore[no-redef]
        STANDARD = "standard"
        DEEPEP_NORMAL = "deepep_normal"
        DEEPEP_LL = "deepep_ll"

    class DeepEPLLDispatchOutput(NamedTuple):  # type: ignore[no-redef]
        hidden_states: Any
        hidden_states_scale: Optional[Any]
        topk_ids: Any
        topk_weights: Any
        masked_m: Any
        expected_m: int

        @property
        def format(self) -> Any:
            return DispatchOutputFormat.DEEPEP_LL

    class DeepEPLLCombineInput(NamedTuple):  # type: ignore[no-redef]
        hidden_states: Any
        topk_ids: Any
        topk_weights: Any

        @property
        def format(self) -> Any:
            return CombineInputFormat.DEEPEP_LL

    _Base = object

MAX_IN_FLIGHT = 2  # dispatches between a dispatch and its combine


class MoeEpLowLatencyDispatcher(_Base):  # type: ignore[misc,valid-type]
    """SGLang token dispatcher in the DEEPEP_LL format (see the module doc).

    buffer: a moe_ep_client.deep_ep.Buffer; num_max_dispatch_tokens_per_rank
    (M): the slots per source rank (<= the buffer's num_max_tokens_per_rank);
    use_fp8: dispatch e4m3 codes with per-128 scales (round_scale: powers of
    two, as DeepGEMM's UE8M0 path wants). Raises ValueError for M outside it.
    """

    def __init__(self, buffer: Buffer, num_max_dispatch_tokens_per_rank: int,
                 use_fp8: bool = False, round_scale: bool = False) -> None:
        m = num_max_dispatch_tokens_per_rank
        if not isinstance(m, int) or not 1 <= m <= buffer.num_max_tokens_per_rank:
            raise ValueError(f"num_max_dispatch_tokens_per_rank: expected in [1, "
                             f"{buffer.num_max_tokens_per_rank}] (the buffer's), got {m!r}")
        self.buffer = buffer
        self.num_max_dispatch_tokens_per_rank = m
        self.use_fp8 = use_fp8
        self.round_scale = round_scale
        self._dispatches: Deque[Tuple[Any, ...]] = collections.deque()  # started, not returned
        self._handles: Deque[Any] = collections.deque()  # returned, not combined
        self._combine: Optional[Tuple[Any, Any]] = None

    def expected_m(self, num_tokens: int) -> int:
        b = self.buffer
        rows = -(-num_tokens * b.group_size * b.num_topk // b.num_experts)
        return max(1, min(rows, b.group_size * self.num_max_dispatch_tokens_per_rank))

    # ------------------------------------------------------------- dispatch

    @refused_on_error
    def dispatch_a(self, hidden_states: Any, topk_output: Any) -> None:
        """Starts the dispatch of hidden_states routed by topk_output."""
        if len(self._dispatches) + len(self._handles) >= MAX_IN_FLIGHT:
            raise ValueError(f"dispatch: {MAX_IN_FLIGHT} dispatches are already in flight; "
                             f"combine the oldest first")
        if not (hasattr(topk_output, "topk_ids") and hasattr(topk_output, "topk_weights")):
            raise TypeError(f"topk_output: expected SGLang's TopKOutput (topk_weights, topk_ids), "
                            f"got {type(topk_output).__name__}")
        ids, weights = topk_output.topk_ids, topk_output.topk_weights
        recv, count, handle, _, hook = self.buffer.low_latency_dispatch(
            hidden_states, ids, self.num_max_dispatch_tokens_per_rank, self.buffer.num_experts,
            use_fp8=self.use_fp8, round_scale=self.round_scale, return_recv_hook=True)
        self._dispatches.append((recv, count, handle, hook, ids, weights,
                                 int(hidden_states.shape[0])))

    def dispatch_b(self) -> Any:
        """Waits for the oldest dispatch_a; returns its DeepEPLLDispatchOutput."""
        if not self._dispatches:
            raise ValueError("dispatch_b: no dispatch_a is in flight (call dispatch_a first)")
        recv, count, handle, hook, ids, weights, tokens = self._dispatches.popleft()
        hook()
        self._handles.append(handle)
        rows, scales = recv if self.use_fp8 else (recv, None)
        return DeepEPLLDispatchOutput(rows, scales, ids, weights, count, self.expected_m(tokens))

    def dispatch(self, hidden_states: Any, topk_output: Any, **kwargs: Any) -> Any:
        self.dispatch_a(hidden_states, topk_output)
        return self.dispatch_b()

    # -------------------------------------------------------------- combine

    @refused_on_error
    def combine_a(self, combine_input: Any) -> None:
        """Starts the combine of the oldest returned dispatch."""
        if not self._handles:
            raise ValueError("combine: no dispatch is waiting for its combine (dispatch first; "
                             "each dispatch is combined once, in order)")
        if self._combine is not None:
            raise ValueError("combine_a: the previous combine_a has no combine_b yet")
        handle = self._handles.popleft()
        out, _, hook = self.buffer.low_latency_combine(
            combine_input.hidden_states, combine_input.topk_ids, combine_input.topk_weights,
            handle, return_recv_hook=True)
        self._combine = (out, hook)

    def combine_b(self) -> Any:
        """Waits for combine_a; returns the combined [T, H] bf16."""
        if self._combine is None:
            raise ValueError("combine_b: no combine_a is in flight (call combine_a first)")
        out, hook = self._combine
        self._combine = None
        hook()
        return out

    def combine(self, combine_input: Any, **kwargs: Any) -> Any:
        self.combine_a(combine_input)
        return self.combine_b()
