"""A module shaped like DeepEP's `deep_ep.Buffer`, over the embedded moe-ep worker.

An engine that speaks DeepEP changes an import (issue 30 item 2; DESIGN §14):

    from moe_ep_client.deep_ep import Buffer          # instead of: from deep_ep import Buffer
    buffer = Buffer(group, hidden=7168, num_experts=256, num_topk=8,
                    num_max_tokens_per_rank=128)       # group: a torch.distributed ProcessGroup
    # normal mode
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = \\
        buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_per_expert, handle, event = \\
        buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                        num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
                        num_tokens_per_expert=num_tokens_per_expert)
    combined_x, combined_weights, event = buffer.combine(expert_out, handle, topk_weights=...)
    # low-latency mode
    recv, recv_count, handle, event, hook = buffer.low_latency_dispatch(
        x, topk_idx, num_max_dispatch_tokens_per_rank=128, num_experts=256, use_fp8=False)
    y, event, hook = buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

Semantics are DeepEP's documented ones (deep_ep/buffer.py docstrings):
  - topk_idx int64 [T, K], -1 = no expert; ids outside [-1, num_experts) are
    the caller's routing bug: the worker raises EngineError INVALID_ARGUMENT
    naming the row and the id on that rank (ABORTED on its peers), nothing
    moves on any rank.
  - normal dispatch: recv_x [num_recv, H] (source rank 0's tokens first, each
    source's in its token order), recv_topk_idx int64 [num_recv, K] as local
    expert indices (-1 where the expert is not on this rank),
    recv_topk_weights float32 (0 where recv_topk_idx is -1),
    num_recv_tokens_per_expert_list aligned up to expert_alignment; a handle
    that caches the layout (dispatch(x, handle=handle) sends the same
    routing again, without top-k); combine(x, handle) sums each token's rows
    from every rank it was sent to (no weights), in fp32 with one bf16
    rounding, and with topk_weights also their sum.
  - low-latency dispatch: rows packed per local expert,
    [num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, H],
    per-expert counts (int32), the handle's src_info [L, maxT * E] int32
    (each row's token index on its source rank) and layout_range [L, E]
    int64 ((begin << 32) | count of each source's rows); use_fp8 returns
    (e4m3 codes, float32 scales [L, maxT * E, H / 128]) quantized per token
    per 128 channels (amax / 448; round_scale: a power of two).
    low_latency_combine(x, topk_idx, topk_weights, handle) returns
    sum_k w_k * x[row of (token, k)] per token: every expert output row goes
    back to its source unweighted and the source sums in fp32 with its own
    weights, then rounds to bf16 once.

How it maps onto the C API (server/moe_ep.h): every exchange is one step
(moe_ep_sync_token_counts, moe_ep_commit_geometry, moe_ep_dispatch_only)
on the CPU (Gloo) plane, and a combine is an exchange back to the sources,
so any number of dispatches may be in flight before their combines (two
micro-batches, cached layouts). The workspace is sized for the way back:
capacity = num_ranks * num_max_tokens_per_rank * num_topk rows per rank.

Bootstrap, with no outside former (the gRPC control plane stays reachable at
buffer.worker.address for an orchestrator's GetStatus, metrics, health):
  - Buffer(group, ...): a torch.distributed ProcessGroup; the ranks' worker
    addresses are all-gathered over it;
  - Buffer(None, ..., rank=r, world_size=n, addresses=[...]): every rank's
    worker listen address known up front (rank r listens on addresses[r]).
Rank 0 then forms, configures and allocates the group (moe_ep_client.Group,
gRPC), and every rank waits for readiness (Worker.wait_ready, experts="own").

Events and hooks: the CPU plane moves data synchronously, except with
async_finish or return_recv_hook in low-latency mode, where the exchange runs
on the buffer's one worker thread (in call order, so every rank's calls stay
in the same order) and the returned arrays are complete once
event.current_stream_wait() or hook() returns. previous_event is waited for
first. Config, num_sms and allocate_on_comm_stream are accepted for
compatibility and have no effect.

Bad input: dispatch, combine and their low-latency forms check their
arguments before any exchange (TypeError / ValueError naming the argument);
a rank whose checks fail still enters the exchange's first round, refusing
it (engine.Worker.refuse), so its peers' calls raise EngineError ABORTED
naming that rank at once, nothing moves on any rank, and the next call of
every rank pairs as before.

Tensors: NumPy arrays (bf16 as uint16 bit patterns, engine.float32_to_bf16)
or CPU torch tensors (outputs are then torch tensors too). Not thread-safe:
one engine thread per Buffer. Every rank makes the same calls in the same
order (DeepEP's rule too); ranks in different collective calls (one in
dispatch, another in combine) get EngineError ABORTED naming both calls,
with nothing moved (each exchange's epoch carries its call).
"""

import concurrent.futures
import functools
import os
import re
import socket
import time
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

from .engine import EngineError, Worker, bf16_to_float32, float32_to_bf16

__all__ = ["Buffer", "Config", "EventOverlap", "DispatchHandle", "LowLatencyHandle",
           "fp8_e4m3_quantize", "fp8_e4m3_dequantize", "refused_on_error"]

_INT32_MIN = -(2 ** 31)

# The Buffer call an exchange serves, in the low 3 bits of the epoch it
# commits: ranks in different Buffer calls (which all make the same C calls)
# then commit different epochs, and the dispatch's opening round refuses the
# step on every rank before anything moves ("geometry mismatch"), instead of
# pairing a dispatch's rows with a combine's.
_CALL_KINDS = {1: "dispatch", 2: "combine", 3: "low_latency_dispatch", 4: "low_latency_combine"}
_KIND_OF = {name: kind for kind, name in _CALL_KINDS.items()}
_EPOCH_MISMATCH = re.compile(r"geometry mismatch: rank (\d+) has \(epoch (\d+),")


def refused_on_error(method: Callable[..., Any]) -> Callable[..., Any]:
    """For a collective call of a Buffer, or of an adapter over one (an
    object whose `buffer` is a Buffer: python/moe_ep_client/vllm_seam.py,
    sglang_seam.py): when the call raises before it queued any exchange on
    the buffer, this rank refuses the exchange its peers are in
    (Buffer.refuse), so they raise EngineError ABORTED naming it instead of
    pairing with this rank's next call; then the error is raised."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        buf = self if isinstance(self, Buffer) else self.buffer
        queued = buf._runs
        try:
            return method(self, *args, **kwargs)
        except Exception:
            if buf._runs == queued:
                buf.refuse()
            raise

    return wrapper


def _np() -> Any:
    import numpy

    return numpy


# ------------------------------------------------------------------ tensors


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _array(name: str, x: Any, kind: str) -> Any:
    """`x` as a C-contiguous NumPy array: kind "bf16" (uint16 bits), "int64",
    "float32" or "bool". CPU torch tensors are viewed, not copied."""
    np = _np()
    if _is_torch(x):
        import torch

        if x.is_cuda:
            raise ValueError(f"{name}: a CUDA tensor; this module runs on the CPU (gloo) plane")
        x = x.contiguous()
        if kind == "bf16":
            if x.dtype != torch.bfloat16:
                raise TypeError(f"{name}: expected torch.bfloat16, got {x.dtype}")
            return x.view(torch.int16).numpy().view(np.uint16)
        return np.ascontiguousarray(x.numpy())
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a NumPy array or a torch tensor, got {type(x).__name__}")
    want = {"bf16": np.uint16, "int64": None, "float32": np.float32, "bool": np.bool_}[kind]
    if kind == "int64":
        if x.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected an integer array (int64), got {x.dtype}")
        return np.ascontiguousarray(x)
    if x.dtype != want:
        what = "uint16 (bf16 bit patterns)" if kind == "bf16" else np.dtype(want).name
        raise TypeError(f"{name}: expected dtype {what}, got {x.dtype}")
    return np.ascontiguousarray(x)


def _like(torch_out: bool, arr: Any, kind: str = "") -> Any:
    """A result: NumPy as is, or a torch tensor when the inputs were torch."""
    if not torch_out or arr is None:
        return arr
    import torch

    np = _np()
    if kind == "bf16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    if kind == "fp8":
        return torch.from_numpy(arr).view(torch.float8_e4m3fn)
    return torch.from_numpy(arr)


def _shape(name: str, arr: Any, shape: Sequence[Optional[int]]) -> None:
    if arr.ndim != len(shape) or any(w is not None and g != w for g, w in zip(arr.shape, shape)):
        want = ", ".join("*" if w is None else str(w) for w in shape)
        raise ValueError(f"{name}: expected shape [{want}], got {list(arr.shape)}")


_E4M3: Any = None  # (values of codes 0..126 ascending, as float64)


def _e4m3_values() -> Any:
    global _E4M3
    if _E4M3 is None:
        np = _np()
        codes = np.arange(127)
        exp = codes >> 3
        mant = codes & 7
        _E4M3 = np.where(exp == 0, mant / 8.0 * 2.0 ** -6, (1 + mant / 8.0) * 2.0 ** (exp - 7.0))
    return _E4M3


def fp8_e4m3_quantize(x: Any, round_scale: bool = False) -> Tuple[Any, Any]:
    """Per token, per 128 channels: float32 x [..., H] (H a multiple of 128) ->
    (e4m3fn codes uint8 [..., H], float32 scales [..., H / 128]) with
    scale = amax / 448 (amax at least 1e-4; round_scale: the next power of
    two) and code = round-to-nearest-even(x / scale), so x ~ code * scale.
    Example: a block of 448.0 and -1.0 -> scale 1.0, codes 0x7E and 0xB8."""
    np = _np()
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % 128:
        raise ValueError(f"x: the last dimension must be a multiple of 128, got {x.shape[-1]}")
    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // 128, 128))
    amax = np.maximum(np.abs(blocks).max(axis=-1), 1e-4)
    scale = amax / np.float32(448.0)
    if round_scale:
        scale = np.exp2(np.ceil(np.log2(scale)))
    scale = scale.astype(np.float32)
    v = np.clip(blocks / scale[..., None], -448.0, 448.0).astype(np.float64)
    table = _e4m3_values()
    mag = np.abs(v)
    hi = np.clip(np.searchsorted(table, mag), 1, len(table) - 1)
    lo = hi - 1
    d_lo = mag - table[lo]
    d_hi = table[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    code = np.where(mag <= table[0], 0, code).astype(np.uint8)
    code |= np.where(np.signbit(v) & (code != 0), np.uint8(0x80), np.uint8(0))
    return code.reshape(x.shape), scale


def fp8_e4m3_dequantize(codes: Any, scales: Any) -> Any:
    """(uint8 e4m3fn codes [..., H], float32 scales [..., H / 128]) -> float32 [..., H]."""
    np = _np()
    codes = np.asarray(codes, dtype=np.uint8)
    mag = _e4m3_values()[np.minimum(codes & 0x7F, 126)].astype(np.float32)
    v = np.where(codes & 0x80, -mag, mag)
    blocks = v.reshape(v.shape[:-1] + (v.shape[-1] // 128, 128))
    return (blocks * np.asarray(scales, dtype=np.float32)[..., None]).reshape(v.shape)


def _round_bf16(values: Any) -> Any:
    return float32_to_bf16(values)


# ------------------------------------------------------------ events, config


class Config:
    """DeepEP's performance config (num_sms, chunk sizes ...): kept, not used."""

    def __init__(self, *args: Any) -> None:
        self.args = args


class EventOverlap:
    """DeepEP's event: current_stream_wait() returns once the call's results
    are complete (at once for a call that ran synchronously); `with event:`
    waits at the end of the block."""

    def __init__(self, future: Optional[concurrent.futures.Future] = None) -> None:
        self._future = future

    def current_stream_wait(self) -> None:
        if self._future is not None:
            self._future.result()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: object) -> None:
        self.current_stream_wait()


class DispatchHandle:
    """The layout of a normal-mode dispatch (opaque to engines, as DeepEP's).

    topk_ids [T, K] int32: the routing sent (the caller's ids, or one expert
    of each destination rank for a dispatch without top-k); is_token_in_rank
    [T, E] bool; num_recv_tokens_per_rank [E] int64: rows received from each
    source; rank_prefix [E]: their running sum (source s's rows of recv_x are
    rank_prefix[s - 1] .. rank_prefix[s])."""

    def __init__(self, topk_ids: Any, is_token_in_rank: Any, num_recv: Any, has_topk: bool):
        np = _np()
        self.topk_ids = topk_ids
        self.is_token_in_rank = is_token_in_rank
        self.num_recv_tokens_per_rank = num_recv
        self.rank_prefix = np.cumsum(num_recv)
        self.num_tokens = topk_ids.shape[0]
        self.has_topk = has_topk


class LowLatencyHandle(NamedTuple):
    """DeepEP's low-latency handle: (src_info [L, maxT * E] int32,
    layout_range [L, E] int64, num_max_dispatch_tokens_per_rank, hidden,
    num_experts), plus `rows`: where each received (token, choice) row sits
    and came from, filled by the dispatch's exchange (opaque; the combine
    returns rows by it)."""

    src_info: Any
    layout_range: Any
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    rows: dict  # "rows": [P, 5] int64: local expert, slot, source rank, source token, choice
    num_tokens: int = 0  # T of the dispatch (low_latency_combine's topk_idx rows)


# -------------------------------------------------------------------- buffer


class Buffer:
    """DeepEP's Buffer over an embedded moe-ep worker (see the module doc).

    group: a torch.distributed ProcessGroup, or None with rank, world_size
    and addresses. hidden, num_experts, num_topk, num_max_tokens_per_rank:
    the workspace (the largest T a rank passes; low-latency calls pass
    num_max_dispatch_tokens_per_rank <= it). DeepEP's byte sizes and modes
    are accepted and unused. dispatch_dtype: what the wire moves ("bf16", or
    "fp8_e4m3": quantized per 128 channels by the worker, H a multiple of
    128). timeout_s: how long the set-up and each call's wait for the worker
    may take; group_timeout_s: the group's collective timeout (a peer that
    does not make its call within it breaks the group). worker_args: more
    moe-ep-worker flags. Raises EngineError (the worker), ValueError
    (arguments), RuntimeError (the group could not be formed: rank 0's
    reason; other ranks time out in their wait, naming what they lack).
    """

    num_sms: int = 20

    def __init__(self, group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 12,
                 allow_nvlink_for_low_latency_mode: bool = True, *, hidden: int,
                 num_experts: int, num_topk: int, num_max_tokens_per_rank: int,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 addresses: Optional[Sequence[str]] = None, listen_host: str = "127.0.0.1",
                 dispatch_dtype: str = "bf16", timeout_s: float = 60.0,
                 group_timeout_s: float = 120.0, worker_args: Sequence[str] = (),
                 library: Optional[str] = None) -> None:
        for name, value in (("hidden", hidden), ("num_experts", num_experts),
                            ("num_topk", num_topk),
                            ("num_max_tokens_per_rank", num_max_tokens_per_rank)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if group is not None:
            rank, world_size = int(group.rank()), int(group.size())
        elif rank is None or world_size is None or addresses is None:
            raise ValueError("expected a torch.distributed ProcessGroup, or rank, world_size and "
                             "addresses (every rank's worker listen address)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected in [0, {world_size}), got {rank}")
        if addresses is not None and len(addresses) != world_size:
            raise ValueError(f"addresses: expected {world_size} (one per rank), got {len(addresses)}")
        if num_experts < world_size:
            raise ValueError(f"num_experts: expected >= the {world_size} ranks, got {num_experts}")
        self.group = group
        self.rank = rank
        self.group_size = world_size
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.hidden = hidden
        self.num_experts = num_experts
        self.num_topk = num_topk
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.capacity_tokens = world_size * num_max_tokens_per_rank * num_topk
        self._timeout_s = timeout_s
        listen = addresses[rank] if addresses is not None else f"{listen_host}:0"
        self.worker = Worker([f"--listen={listen}", "--backend=gloo", "--log-level=warn",
                              *worker_args], library=library)
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._runs = 0  # calls queued on the buffer's thread (_run)
        self._epoch = 0
        try:
            if addresses is None:
                import torch.distributed as dist

                gathered: List[Any] = [None] * world_size
                dist.all_gather_object(gathered, self.worker.address, group=group)
                addresses = [str(a) for a in gathered]
            self.addresses = list(addresses)
            if rank == 0:
                self._form(dispatch_dtype, group_timeout_s)
            self.worker.wait_ready(timeout_s=timeout_s, experts="own")
        except BaseException:
            self.worker.stop()
            raise
        info = self.worker.info(refresh=True)
        if (info.world_size, info.hidden, info.top_k, info.num_experts) != (
                world_size, hidden, num_topk, num_experts):
            self.worker.stop()
            raise RuntimeError(
                f"the group formed is (ranks {info.world_size}, H {info.hidden}, K {info.top_k}, "
                f"{info.num_experts} experts), this Buffer asked for ({world_size}, {hidden}, "
                f"{num_topk}, {num_experts})")
        self._info = info
        np = _np()
        base, rem = divmod(num_experts, world_size)
        sizes = np.array([base + (1 if r < rem else 0) for r in range(world_size)])
        self._first_expert = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self._rank_of_expert = np.repeat(np.arange(world_size), sizes)
        self.num_local_experts = int(sizes[rank])
        self.first_local_expert = int(self._first_expert[rank])  # global id of local 0

    # ------------------------------------------------------------ set-up

    def _form(self, dispatch_dtype: str, group_timeout_s: float) -> None:
        """Rank 0: Join, ConfigureLayers, AllocateWorkspace on every rank's worker."""
        from .client import Group

        deadline = time.monotonic() + self._timeout_s
        owner = f"moe-ep deep_ep@{socket.gethostname()}:{os.getpid()}"
        with Group(self.addresses, backend="gloo", group_timeout_s=group_timeout_s,
                   owner_id=owner, timeout_s=self._timeout_s) as g:
            while True:  # every rank's worker must be up first
                try:
                    g.status()
                    break
                except Exception as e:  # noqa: BLE001 (GroupError: a worker not up yet)
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"deep_ep.Buffer: the workers did not all answer within "
                                           f"{self._timeout_s} s: {e}") from e
                    time.sleep(0.05)
            g.form()
            g.configure(hidden_size=self.hidden, num_layers=1, num_experts=self.num_experts,
                        top_k=self.num_topk, attn_dp_size=self.group_size)
            g.allocate(hidden_size=self.hidden, top_k=self.num_topk, num_experts=self.num_experts,
                       capacity_tokens=self.capacity_tokens, dtype=dispatch_dtype)

    def destroy(self) -> None:
        """Stops this rank's worker (every rank calls it at the end)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.worker.stop()

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Kept for DeepEP compatibility; the CPU plane has no SMs to set."""
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event of 'now': complete at once here (the calls it would order
        after ran synchronously or in order on the buffer's thread)."""
        return EventOverlap()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, num_ranks)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes of one rank's receive rows of a low-latency dispatch in bf16
        (a size hint for engines that ask; this module sizes its own)."""
        return num_max_dispatch_tokens_per_rank * num_ranks * hidden * 2

    # ------------------------------------------------------------ plumbing

    def _run(self, fn: Callable[[], Any], background: bool) -> Tuple[Any, EventOverlap]:
        """Runs `fn` on the buffer's thread (every call goes there, so the
        exchanges keep the order they were made in): waits for it unless
        `background`."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="moe-ep-deep-ep")
        self._runs += 1
        future = self._executor.submit(fn)
        if background:
            return None, EventOverlap(future)
        return future.result(), EventOverlap()

    def refuse(self) -> None:
        """Meets the exchange the peers are in, refusing it, for a rank that
        will not make the call they are making (its own checks failed): the
        peers' call raises EngineError ABORTED naming this rank and nothing
        moves (engine.Worker.refuse). Queued on the buffer's thread, after
        this rank's earlier calls. The collective calls here and the seams'
        call it themselves when their checks fail (refused_on_error)."""
        self._run(lambda: self.worker.refuse("moe_ep_sync_token_counts", self._timeout_s),
                  background=False)

    def _exchange(self, call: str, hidden: Any, ids: Any, weights: Any,
                  max_tokens: Optional[int] = None) -> Any:
        """_exchange_step, its worker errors prefixed with the Buffer call
        ("deep_ep.Buffer.combine: rank 1 refused its moe_ep_sync_token_counts
        ..."): the C call a peer names is not one the engine made."""
        try:
            return self._exchange_step(call, hidden, ids, weights, max_tokens)
        except EngineError as e:
            if e.message.startswith("deep_ep.Buffer"):
                raise
            raise EngineError(e.call, e.status, f"deep_ep.Buffer.{call}: {e.message}") from e

    def _exchange_step(self, call: str, hidden: Any, ids: Any, weights: Any,
                       max_tokens: Optional[int]) -> Any:
        """One step that ends with its dispatch (moe_ep_dispatch_only):
        hidden [T, H] uint16, ids [T, K] int32, weights [T, K] float32 ->
        engine.DispatchOutput [E, R, ...], for Buffer call `call` (a key of
        _KIND_OF: tagged into the epoch). max_tokens: every rank raises
        ValueError alike when a rank has more tokens (checked on the agreed
        counts, so no rank is left waiting)."""
        t = int(hidden.shape[0])
        if t > self.capacity_tokens:
            # Before the sync, which would refuse it on every rank in the
            # worker's terms (runtime_max_tokens_per_rank vs capacity_tokens).
            self.worker.refuse("moe_ep_sync_token_counts", self._timeout_s)
            raise ValueError(
                f"num_tokens: {t} rows on rank {self.rank}, more than the buffer's "
                f"{self.capacity_tokens} (num_ranks {self.group_size} x num_max_tokens_per_rank "
                f"{self.num_max_tokens_per_rank} x num_topk {self.num_topk})")
        counts, r = self.worker.sync_token_counts(t)
        # Every rank was in the sync: the epoch moves on every rank alike,
        # whatever follows, so the next exchange commits the same epoch.
        self._epoch += 1
        try:
            if max_tokens is not None and max(counts) > max_tokens:
                worst = max(range(len(counts)), key=lambda i: counts[i])
                raise ValueError(f"num_tokens: rank {worst} has {counts[worst]} tokens, more than "
                                 f"num_max_dispatch_tokens_per_rank = {max_tokens} (this rank's)")
            self.worker.commit_geometry(self._epoch * 8 + _KIND_OF[call], r, t)
        except Exception:
            # A rank that stops here still meets its peers' dispatch, refusing it.
            self.worker.refuse("moe_ep_dispatch_only", self._timeout_s)
            raise
        try:
            return self.worker.dispatch(hidden, ids, weights, recv_rows=r,
                                        timeout_s=self._timeout_s, end_step=True)
        except EngineError as e:
            found = _EPOCH_MISMATCH.search(e.message) if e.code == "ABORTED" else None
            if found is None or int(found.group(2)) % 8 == _KIND_OF[call]:
                raise
            other = _CALL_KINDS.get(int(found.group(2)) % 8, "another call")
            raise EngineError(
                e.call, e.status,
                f"deep_ep.Buffer: rank {found.group(1)} is in Buffer.{other}, this rank "
                f"({self.rank}) in Buffer.{call}: every rank makes the same Buffer calls in the "
                f"same order; nothing moved, the buffer is still usable") from e

    def _ids(self, topk_idx: Any) -> Any:
        """int64 [T, K] -> int32 for the C API. An id beyond int32 is refused
        here with its value (ValueError naming topk_idx); other ids outside
        [-1, num_experts) go to the worker, which refuses the row."""
        np = _np()
        wide = (topk_idx > np.iinfo(np.int32).max) | (topk_idx < _INT32_MIN)
        if wide.any():
            t, k = np.argwhere(wide)[0]
            raise ValueError(f"topk_idx[row {t}, choice {k}] = {topk_idx[t, k]}: outside "
                             f"[0, {self.num_experts}) and not -1")
        return np.ascontiguousarray(topk_idx, dtype=np.int32)

    def _layout(self, ids: Any) -> Any:
        """is_token_in_rank [T, E] bool of valid ids (others select no rank)."""
        np = _np()
        t = ids.shape[0]
        valid = (ids >= 0) & (ids < self.num_experts)
        ranks = self._rank_of_expert[np.where(valid, ids, 0)]
        in_rank = np.zeros((t, self.group_size), dtype=bool)
        rows = np.nonzero(valid)[0]
        in_rank[rows, ranks[valid]] = True
        return in_rank

    def _back_ids(self, dest_ranks: Any) -> Any:
        """Rows going to `dest_ranks` [P]: ids [P, K] = one expert of that rank, -1 else."""
        np = _np()
        ids = np.full((len(dest_ranks), self.num_topk), -1, dtype=np.int32)
        ids[:, 0] = self._first_expert[dest_ranks]
        return ids

    # ------------------------------------------------------- normal mode

    def get_dispatch_layout(self, topk_idx: Any, num_experts: int, previous_event: Any = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple[Any, None, Any, Any, EventOverlap]:
        """topk_idx int64 [T, K] (-1: none) -> (num_tokens_per_rank [E] int32,
        None, num_tokens_per_expert [num_experts] int32, is_token_in_rank
        [T, E] bool, event). Local (no communication). ValueError for an id
        outside [-1, num_experts), naming its row."""
        np = _np()
        if previous_event is not None:
            previous_event.current_stream_wait()
        torch_out = _is_torch(topk_idx)
        idx = _array("topk_idx", topk_idx, "int64")
        _shape("topk_idx", idx, (None, self.num_topk))
        if num_experts != self.num_experts:
            raise ValueError(f"num_experts: the buffer has {self.num_experts}, got {num_experts}")
        bad = (idx < -1) | (idx >= num_experts)
        if bad.any():
            t, k = np.argwhere(bad)[0]
            raise ValueError(f"topk_idx[row {t}, choice {k}] = {idx[t, k]}: outside "
                             f"[0, {num_experts}) and not -1")
        in_rank = self._layout(idx)
        per_rank = in_rank.sum(axis=0).astype(np.int32)
        per_expert = np.bincount(idx[idx >= 0], minlength=num_experts).astype(np.int32)
        return (_like(torch_out, per_rank), None, _like(torch_out, per_expert),
                _like(torch_out, in_rank), EventOverlap())

    @refused_on_error
    def dispatch(self, x: Any, handle: Optional[DispatchHandle] = None,
                 num_tokens_per_rank: Any = None, num_tokens_per_rdma_rank: Any = None,
                 is_token_in_rank: Any = None, num_tokens_per_expert: Any = None,
                 topk_idx: Any = None, topk_weights: Any = None, expert_alignment: int = 1,
                 config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False) -> Tuple:
        """Normal-mode dispatch (see the module doc). x: bf16 [T, H], or a
        tuple (e4m3 codes uint8 [T, H], float32 scales [T, H / 128]), which
        is dequantized to bf16 for the wire and returned re-quantized.
        Routing: topk_idx (with topk_weights) when given, else
        is_token_in_rank (each token to at most K ranks), else handle (the
        cached routing of an earlier dispatch; topk must then be None).
        Returns (recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event); without top-k the
        middle four are None except the handle (None for a cached dispatch,
        as in DeepEP). Synchronous: the event is complete."""
        np = _np()
        if previous_event is not None:
            previous_event.current_stream_wait()
        if not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise ValueError(f"expert_alignment: expected an int >= 1, got {expert_alignment!r}")
        fp8_in = isinstance(x, tuple)
        torch_out = _is_torch(x[0] if fp8_in else x)
        if fp8_in:
            codes = np.ascontiguousarray(_array_u8("x[0]", x[0]))
            scales = _array("x[1]", x[1], "float32")
            _shape("x[0]", codes, (None, self.hidden))
            _shape("x[1]", scales, (codes.shape[0], self.hidden // 128))
            hidden = _round_bf16(fp8_e4m3_dequantize(codes, scales))
        else:
            hidden = _array("x", x, "bf16")
            _shape("x", hidden, (None, self.hidden))
        t = hidden.shape[0]
        has_topk = topk_idx is not None
        if handle is not None:
            if not isinstance(handle, DispatchHandle):
                raise TypeError(f"handle: expected the DispatchHandle of a dispatch, got "
                                f"{type(handle).__name__}")
            if has_topk or topk_weights is not None:
                raise ValueError("topk_idx / topk_weights: a cached dispatch (handle) takes none")
            if handle.num_tokens != t:
                raise ValueError(f"x: the handle's layout has {handle.num_tokens} tokens, got {t}")
            ids = handle.topk_ids
            weights = np.zeros(ids.shape, dtype=np.float32)
        elif has_topk:
            idx = _array("topk_idx", topk_idx, "int64")
            _shape("topk_idx", idx, (t, self.num_topk))
            ids = self._ids(idx)
            if topk_weights is None:
                weights = np.zeros(ids.shape, dtype=np.float32)
            else:
                weights = _array("topk_weights", topk_weights, "float32")
                _shape("topk_weights", weights, (t, self.num_topk))
        else:
            if is_token_in_rank is None:
                raise ValueError("dispatch: needs topk_idx, is_token_in_rank or a handle")
            in_rank = _array("is_token_in_rank", is_token_in_rank, "bool")
            _shape("is_token_in_rank", in_rank, (t, self.group_size))
            ids = np.full((t, self.num_topk), -1, dtype=np.int32)
            for row in range(t):
                ranks = np.nonzero(in_rank[row])[0]
                if len(ranks) > self.num_topk:
                    raise ValueError(f"is_token_in_rank[{row}]: {len(ranks)} ranks, more than "
                                     f"num_topk = {self.num_topk} (the routing has K slots)")
                ids[row, :len(ranks)] = self._first_expert[ranks]
            weights = np.zeros(ids.shape, dtype=np.float32)
        out, _ = self._run(lambda: self._exchange("dispatch", hidden, ids, weights),
                           background=False)
        counts = np.asarray(out.num_recv_tokens_per_source, dtype=np.int64)
        rows = [out.hidden_states[s, :counts[s]] for s in range(self.group_size)]
        recv_hidden = np.concatenate(rows, axis=0) if rows else np.zeros((0, self.hidden), np.uint16)
        if fp8_in:
            q, sc = fp8_e4m3_quantize(bf16_to_float32(recv_hidden))
            recv_x: Any = (_like(torch_out, q, "fp8"), _like(torch_out, sc))
        else:
            recv_x = _like(torch_out, recv_hidden, "bf16")
        if handle is not None:
            return recv_x, None, None, None, None, EventOverlap()
        new_handle = DispatchHandle(ids, self._layout(ids), counts, has_topk)
        if not has_topk:
            return recv_x, None, None, None, new_handle, EventOverlap()
        recv_ids = np.concatenate([out.topk_ids[s, :counts[s]] for s in range(self.group_size)])
        recv_w = np.concatenate([out.topk_weights[s, :counts[s]] for s in range(self.group_size)])
        first = int(self._first_expert[self.rank])
        local = (recv_ids >= first) & (recv_ids < first + self.num_local_experts)
        recv_topk_idx = np.where(local, recv_ids - first, -1).astype(np.int64)
        recv_topk_weights = np.where(local, recv_w, 0.0).astype(np.float32)
        per_expert = np.bincount(recv_topk_idx[local], minlength=self.num_local_experts)
        aligned = [int(-(-c // expert_alignment) * expert_alignment) for c in per_expert]
        return (recv_x, _like(torch_out, recv_topk_idx), _like(torch_out, recv_topk_weights),
                aligned, new_handle, EventOverlap())

    @refused_on_error
    def combine(self, x: Any, handle: DispatchHandle, topk_weights: Any = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False
                ) -> Tuple[Any, Any, EventOverlap]:
        """Normal-mode combine: x bf16 [num_recv, H] (the rows of the
        dispatch's recv_x, in its order) -> (combined_x bf16 [T, H]: each
        token's rows from every rank it went to, summed in fp32 and rounded
        once; combined_topk_weights float32 [T, K]: the sum of the
        topk_weights rows [num_recv, K] given, or None; event)."""
        np = _np()
        if previous_event is not None:
            previous_event.current_stream_wait()
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle: expected the DispatchHandle of a dispatch, got "
                            f"{type(handle).__name__}")
        torch_out = _is_torch(x)
        rows = _array("x", x, "bf16")
        num_recv = int(handle.num_recv_tokens_per_rank.sum())
        _shape("x", rows, (num_recv, self.hidden))
        if topk_weights is not None:
            back_w = _array("topk_weights", topk_weights, "float32")
            _shape("topk_weights", back_w, (num_recv, self.num_topk))
        else:
            back_w = np.zeros((num_recv, self.num_topk), dtype=np.float32)
        sources = np.repeat(np.arange(self.group_size), handle.num_recv_tokens_per_rank)
        ids = self._back_ids(sources)
        out, _ = self._run(lambda: self._exchange("combine", rows, ids, back_w), background=False)
        t = handle.num_tokens
        acc = np.zeros((t, self.hidden), dtype=np.float32)
        acc_w = np.zeros((t, self.num_topk), dtype=np.float32)
        for d in range(self.group_size):
            tokens = np.nonzero(handle.is_token_in_rank[:, d])[0]
            c = int(out.num_recv_tokens_per_source[d])
            if c != len(tokens):
                raise RuntimeError(f"combine: rank {d} returned {c} rows, this rank sent it "
                                   f"{len(tokens)} tokens (a handle of another dispatch?)")
            acc[tokens] += bf16_to_float32(out.hidden_states[d, :c])
            acc_w[tokens] += out.topk_weights[d, :c]
        combined = _like(torch_out, _round_bf16(acc), "bf16")
        weights_out = _like(torch_out, acc_w) if topk_weights is not None else None
        return combined, weights_out, EventOverlap()

    # -------------------------------------------------- low-latency mode

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Kept for DeepEP compatibility: nothing to clean (every call's rows are its own)."""

    @refused_on_error
    def low_latency_dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Any = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> Tuple:
        """Low-latency dispatch (see the module doc): x bf16 [T, H] with
        T <= num_max_dispatch_tokens_per_rank on every rank, topk_idx int64
        [T, K] -> (recv_x [L, maxT * E, H] bf16, or (codes, scales) with
        use_fp8; recv_count [L] int32; handle; event; hook). Rows past an
        expert's count are zeros (src_info -1). With async_finish or
        return_recv_hook the exchange runs on the buffer's thread and the
        arrays are filled once the event or hook is waited for; else hook
        is a no-op. cumulative_local_expert_recv_stats ([L] int, may be
        None) has the counts added. use_ue8m0 (packed exponent scales) is
        not offered: ValueError."""
        np = _np()
        if use_ue8m0:
            raise ValueError("use_ue8m0: packed UE8M0 scales are not offered; use round_scale")
        if num_experts != self.num_experts:
            raise ValueError(f"num_experts: the buffer has {self.num_experts}, got {num_experts}")
        max_t = num_max_dispatch_tokens_per_rank
        if not isinstance(max_t, int) or not 1 <= max_t <= self.num_max_tokens_per_rank:
            raise ValueError(f"num_max_dispatch_tokens_per_rank: expected in [1, "
                             f"{self.num_max_tokens_per_rank}] (the buffer's), got {max_t!r}")
        torch_out = _is_torch(x)
        hidden = _array("x", x, "bf16")
        _shape("x", hidden, (None, self.hidden))
        t = hidden.shape[0]
        idx = _array("topk_idx", topk_idx, "int64")
        _shape("topk_idx", idx, (t, self.num_topk))
        ids = self._ids(idx)
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            kind = str(stats.dtype)
            if tuple(stats.shape) != (self.num_local_experts,) or "int" not in kind:
                raise ValueError(f"cumulative_local_expert_recv_stats: expected an integer array "
                                 f"of shape [{self.num_local_experts}] (this rank's experts), got "
                                 f"{kind} {list(stats.shape)}")
        # Each row carries its token index (the receiver's src_info).
        weights = np.zeros((t, self.num_topk), dtype=np.float32)
        weights[:, 0] = np.arange(t, dtype=np.float32)
        e, l, h = self.group_size, self.num_local_experts, self.hidden
        slots = max_t * e
        packed = np.zeros((l, slots, h), dtype=np.uint16)
        count = np.zeros(l, dtype=np.int32)
        src_info = np.full((l, slots), -1, dtype=np.int32)
        layout_range = np.zeros((l, e), dtype=np.int64)
        result: dict = {}
        first = int(self._first_expert[self.rank])
        codes = np.zeros((l, slots, h), dtype=np.uint8) if use_fp8 else None
        scales = np.zeros((l, slots, h // 128), dtype=np.float32) if use_fp8 else None

        def run() -> None:
            out = self._exchange("low_latency_dispatch", hidden, ids, weights, max_tokens=max_t)
            r = out.topk_ids.shape[1]
            valid = (np.arange(r)[None, :, None] <
                     np.asarray(out.num_recv_tokens_per_source)[:, None, None])
            local = valid & (out.topk_ids >= first) & (out.topk_ids < first + l)
            s, j, k = np.nonzero(local)  # source, slot, choice: ascending
            expert = out.topk_ids[s, j, k] - first
            order = np.argsort(expert, kind="stable")  # by expert, then (source, slot, choice)
            s, j, k, expert = s[order], j[order], k[order], expert[order]
            per_expert = np.bincount(expert, minlength=l)
            starts = np.concatenate([[0], np.cumsum(per_expert)[:-1]]).astype(np.int64)
            pos = np.arange(len(expert)) - starts[expert]
            token = out.topk_weights[s, j, 0].astype(np.int64)
            packed[expert, pos] = out.hidden_states[s, j]
            src_info[expert, pos] = token
            count[:] = per_expert
            for ex in range(l):
                for src in range(e):
                    sel = (expert == ex) & (s == src)
                    n = int(sel.sum())
                    begin = int(pos[sel][0]) if n else 0
                    layout_range[ex, src] = (begin << 32) | n
            result["rows"] = np.stack([expert, pos, s, token, k], axis=1).astype(np.int64)
            if cumulative_local_expert_recv_stats is not None:
                stats = cumulative_local_expert_recv_stats
                if _is_torch(stats):
                    import torch

                    stats += torch.from_numpy(per_expert.astype(np.int64)).to(stats.dtype)
                else:
                    stats += per_expert.astype(stats.dtype)
            if use_fp8:
                q, sc = fp8_e4m3_quantize(bf16_to_float32(packed), round_scale=round_scale)
                codes[...] = q
                scales[...] = sc

        # In the background the arrays below are filled by the buffer's
        # thread; a later call on this buffer runs after it (one thread).
        _, event = self._run(run, background=async_finish or return_recv_hook)
        handle = LowLatencyHandle(_like(torch_out, src_info), _like(torch_out, layout_range), max_t,
                                  h, num_experts, result, t)
        if use_fp8:
            recv: Any = (_like(torch_out, codes, "fp8"), _like(torch_out, scales))
        else:
            recv = _like(torch_out, packed, "bf16")
        hook = event.current_stream_wait
        return recv, _like(torch_out, count), handle, event, hook

    @refused_on_error
    def low_latency_combine(self, x: Any, topk_idx: Any, topk_weights: Any,
                            handle: LowLatencyHandle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Any = None
                            ) -> Tuple[Any, EventOverlap, Callable[[], None]]:
        """Low-latency combine: x bf16 [L, maxT * E, H] (each expert's outputs
        in the dispatch's row order), topk_idx int64 / topk_weights float32
        [T, K] of this rank's dispatched tokens -> (combined bf16 [T, H] =
        sum_k topk_weights[t, k] * x[row of (t, k)], in fp32, rounded once;
        event; hook). out: a bf16 [T, H] array written instead of a new one.
        With async_finish / return_recv_hook the result is complete once the
        event or hook is waited for."""
        np = _np()
        if not isinstance(handle, LowLatencyHandle):
            raise TypeError(f"handle: expected the LowLatencyHandle of a low_latency_dispatch, got "
                            f"{type(handle).__name__}")
        torch_out = _is_torch(x)
        rows_x = _array("x", x, "bf16")
        l, e, h = self.num_local_experts, self.group_size, self.hidden
        max_t = handle.num_max_dispatch_tokens_per_rank
        _shape("x", rows_x, (l, max_t * e, h))
        idx = _array("topk_idx", topk_idx, "int64")
        t = handle.num_tokens
        _shape("topk_idx", idx, (t, self.num_topk))
        w = _array("topk_weights", topk_weights, "float32")
        _shape("topk_weights", w, (t, self.num_topk))
        if out is not None:
            target = _array("out", out, "bf16")
            _shape("out", target, (t, h))
        else:
            target = np.zeros((t, h), dtype=np.uint16)

        def run() -> None:
            if "rows" not in handle.rows:  # every rank alike: the dispatch failed everywhere
                raise ValueError("handle: its low_latency_dispatch did not complete (it raised); "
                                 "dispatch again")
            plan = handle.rows["rows"]  # the dispatch ran before (same thread, in order)
            expert, pos, src, token, choice = (plan[:, i] for i in range(5))
            back = np.ascontiguousarray(rows_x[expert, pos])
            ids = self._back_ids(src)
            meta = np.zeros((len(plan), self.num_topk), dtype=np.float32)
            meta[:, 0] = token
            if self.num_topk > 1:
                meta[:, 1] = choice
            got = self._exchange("low_latency_combine",
                                 back if len(plan) else np.zeros((0, h), np.uint16), ids, meta)
            acc = np.zeros((t, h), dtype=np.float32)
            for d in range(e):
                c = int(got.num_recv_tokens_per_source[d])
                if c == 0:
                    continue
                tok = got.topk_weights[d, :c, 0].astype(np.int64)
                k = got.topk_weights[d, :c, 1].astype(np.int64) if self.num_topk > 1 else \
                    np.zeros(c, dtype=np.int64)
                scale = np.where(idx[tok, k] >= 0, w[tok, k], 0.0).astype(np.float32)
                np.add.at(acc, tok, bf16_to_float32(got.hidden_states[d, :c]) * scale[:, None])
            target[...] = _round_bf16(acc)

        _, event = self._run(run, background=async_finish or return_recv_hook)
        result = out if out is not None else _like(torch_out, target, "bf16")
        return result, event, event.current_stream_wait


def _array_u8(name: str, x: Any) -> Any:
    """fp8 e4m3 codes as uint8 (NumPy uint8, or a torch float8_e4m3fn tensor)."""
    np = _np()
    if _is_torch(x):
        import torch

        return x.contiguous().view(torch.uint8).numpy()
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8:
        raise TypeError(f"{name}: expected uint8 e4m3 codes (or torch.float8_e4m3fn)")
    return x
