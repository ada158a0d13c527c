"""Typed wrapper over the moe_ep.v1.Worker stubs (see __init__.py).

Control plane (form, configure, allocate, agree_geometry, status) and data
plane (load_experts, forward, benchmark).

Semantics follow proto/moe_ep/v1/worker.proto (the contract) and DESIGN §6/§8:
the group is formed with rank i = targets[i] and the rendezvous at targets[0];
a new group always uses a generation above every generation any worker has
seen (rendezvous keys are write-once); geometry is agreed by SyncTokenCounts on
every rank followed by CommitGeometry(epoch, R) on every rank.

Ownership (DESIGN §16; LeaseClaim in worker.proto): like `moe-ep --targets`,
a Group claims the workers' lease in every state-changing call (Join, Leave,
ConfigureLayers, AllocateWorkspace, LoadExperts) with its owner id and TTL,
so a successful call acquires or renews the lease; another owner's live lease
makes such a call fail (GroupError, FAILED_PRECONDITION naming the owner)
unless the Group was made with take_over=True. The step calls (forward,
agree_geometry, benchmark) are not leased.

Units (issue 31 item 4): every time in this API is in seconds, a float
(timeout_s, group_timeout_s, lease_ttl_s, WorkerStatus.lease_remaining_s,
ForwardResult.dispatch_s, BenchmarkResult.dispatch_p50_s, ...); sizes are
bytes or elements as their names say.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
from concurrent import futures
from typing import Any, Callable, List, Mapping, Optional, Sequence, TypeVar, Union

import grpc

from moe_ep.v1 import worker_pb2, worker_pb2_grpc
from moe_ep_client import tensors
from moe_ep_client.model_config import ModelConfig

T = TypeVar("T")

_STATE_NAMES = {
    worker_pb2.WORKER_STATE_STARTED: "STARTED",
    worker_pb2.WORKER_STATE_JOINED: "JOINED",
    worker_pb2.WORKER_STATE_CONFIGURED: "CONFIGURED",
    worker_pb2.WORKER_STATE_ALLOCATED: "ALLOCATED",
}

# DispatchDType values the proto declares but no data plane moves
# (worker.proto: "nvfp4 and mxfp8 are sized (DESIGN §5) but refused by every
# data plane"; the planes' BackendLimits::dispatch_dtypes).
_REFUSED_DTYPES = frozenset({"nvfp4", "mxfp8"})


def _dispatch_dtypes() -> "dict[str, int]":
    """name -> DispatchDType of every value of the proto enum that the worker
    moves: DISPATCH_DTYPE_FP8_E4M3 -> "fp8_e4m3" (the names of `moe-ep
    workspace --dtype` and core::DispatchDTypeName)."""
    out = {}
    for value in worker_pb2.DispatchDType.DESCRIPTOR.values:
        if value.number == worker_pb2.DISPATCH_DTYPE_UNSPECIFIED:
            continue
        name = value.name[len("DISPATCH_DTYPE_") :].lower()
        if name not in _REFUSED_DTYPES:
            out[name] = value.number
    return out


_DTYPES = _dispatch_dtypes()
# The dtype names Group.allocate accepts, from the proto: ("bf16", "fp8_e4m3").
DISPATCH_DTYPES = tuple(_DTYPES)

_EXPERT_KINDS = {
    "swiglu": worker_pb2.EXPERT_KIND_SWIGLU,
    "identity": worker_pb2.EXPERT_KIND_IDENTITY,
}

_MAX_MESSAGE_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class Security:
    """Channel security, matching the worker's --tls_* / --auth-token-file.

    All None: plaintext. tls_ca: PEM file of the CA that signed the workers'
    certificates (None with TLS on: the system roots). tls_cert/tls_key: client
    certificate for mutual TLS. token: the bearer token (sent as
    "authorization: Bearer <token>"; needs TLS).
    """

    tls_ca: Optional[str] = None
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    token: Optional[str] = None

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None or self.tls_cert is not None

    def channel_credentials(self) -> Optional[grpc.ChannelCredentials]:
        """None for plaintext; raises ValueError for inconsistent options."""
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if not self.tls:
            if self.token is not None:
                raise ValueError("a bearer token needs TLS (tls_ca): it would be sent in clear")
            return None

        def read(path: Optional[str]) -> Optional[bytes]:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        credentials = grpc.ssl_channel_credentials(
            root_certificates=read(self.tls_ca),
            private_key=read(self.tls_key),
            certificate_chain=read(self.tls_cert),
        )
        if self.token is not None:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.access_token_call_credentials(self.token)
            )
        return credentials


@dataclasses.dataclass(frozen=True)
class WorkerStatus:
    """GetStatus of one worker (sizes in bytes, token counts per rank)."""

    target: str
    state: str  # STARTED, JOINED, CONFIGURED, ALLOCATED
    rank: int
    world_size: int
    generation: int
    backend: str
    device_name: str
    device_memory_bytes: int
    workspace_bytes: int
    expert_bytes: int
    memory_cap_bytes: int
    geometry_epoch: int
    runtime_max_tokens_per_rank: int
    capacity_tokens: int
    forwards: int
    errors: int
    # Highest generation any Join asked this worker to form (formed or not).
    max_generation_seen: int = 0
    # The lease (issue 12): its owner ("" = none) and time left, seconds.
    lease_owner: str = ""
    lease_remaining_s: float = 0.0

    @staticmethod
    def from_proto(target: str, s: worker_pb2.GetStatusResponse) -> "WorkerStatus":
        return WorkerStatus(
            target=target,
            state=_STATE_NAMES.get(s.state, "UNSPECIFIED"),
            rank=s.rank,
            world_size=s.world_size,
            generation=s.generation,
            backend=s.backend,
            device_name=s.device_name,
            device_memory_bytes=s.device_memory_bytes,
            workspace_bytes=s.workspace_bytes,
            expert_bytes=s.expert_bytes,
            memory_cap_bytes=s.memory_cap_bytes,
            geometry_epoch=s.geometry_epoch,
            runtime_max_tokens_per_rank=s.runtime_max_tokens_per_rank,
            capacity_tokens=s.capacity_tokens,
            forwards=s.counters.forwards,
            errors=s.counters.errors,
            max_generation_seen=s.max_generation_seen,
            lease_owner=s.lease_owner,
            lease_remaining_s=s.lease_remaining_ms / 1000.0,
        )


@dataclasses.dataclass(frozen=True)
class AllocatedWorkspace:
    """AllocateWorkspace's answer (identical on every rank; rank 0's)."""

    dispatch_bytes_per_token: int
    combine_bytes_per_token: int
    flashinfer_workspace_bytes: int
    allocated_bytes: int
    capacity_tokens: int


@dataclasses.dataclass(frozen=True)
class GeometryAgreement:
    """The committed geometry of one step (DESIGN §6)."""

    epoch: int
    token_counts: List[int]  # one per rank
    max_tokens: int
    runtime_max_tokens_per_rank: int  # R


@dataclasses.dataclass(frozen=True)
class LoadedExperts:
    """LoadExperts' answer of one rank: its experts [first, first + count)."""

    first_expert: int
    num_local_experts: int
    expert_bytes: int


@dataclasses.dataclass(frozen=True)
class ForwardInput:
    """One rank's tokens for Forward: hidden [T, H], topk_ids / topk_weights [T, K].

    Arrays (the fast path: raw bytes, no per-element Python): hidden a torch
    bfloat16 tensor or a NumPy uint16 array of bf16 bit patterns (sent as
    they are), or a float NumPy array / torch tensor (rounded to bf16);
    topk_ids any integer array, topk_weights any float array. Nested lists
    still work (slow: about 0.4 s of Python per [256, 2048]). T may be 0 (a
    rank with no tokens still takes part in the collective).
    """

    hidden: Any
    topk_ids: Any
    topk_weights: Any


@dataclasses.dataclass(frozen=True)
class ForwardResult:
    """Forward's answer of one rank: output [T, H] and the step's times (seconds).

    output follows the kind of the rank's hidden input: bf16 in, bf16 out
    (a torch bfloat16 tensor on the input's device, or NumPy uint16 bits);
    float in, float32 out (NumPy or torch); nested lists in, lists of floats
    out.
    """

    output: Any
    dispatch_s: float
    expert_s: float
    combine_s: float
    total_s: float
    runtime_max_tokens_per_rank: int  # R
    tokens_sent: int  # token copies sent, one per distinct destination rank
    bytes_sent: int  # dispatch + combine bytes to other ranks
    tokens_received: int


@dataclasses.dataclass(frozen=True)
class BenchmarkResult:
    """Benchmark's answer of one rank: latency percentiles in seconds, logical GB/s."""

    dispatch_p50_s: float
    dispatch_p99_s: float
    combine_p50_s: float
    combine_p99_s: float
    dispatch_logical_gbps: float
    combine_logical_gbps: float
    dispatch_bytes: int
    combine_bytes: int


@dataclasses.dataclass(frozen=True)
class RankFailure:
    rank: int
    target: str
    code: grpc.StatusCode
    message: str


class GroupError(Exception):
    """An operation failed on some ranks; `failures` lists each of them."""

    def __init__(self, op: str, world: int, failures: List[RankFailure]):
        self.op = op
        self.failures = failures
        parts = "; ".join(
            f"rank {f.rank} ({f.target}): {f.code.name}: {f.message}" for f in failures
        )
        super().__init__(f"{op} failed on {len(failures)} of {world} ranks: {parts}")

    @property
    def codes(self) -> List[grpc.StatusCode]:
        return [f.code for f in self.failures]


class Group:
    """One channel per worker; rank i is targets[i]. Not thread-safe.

    backend is what Join asks for: "auto" (the default, as `moe-ep`'s
    --backend: NCCL on workers that see a GPU, else Gloo), "gloo" or "nccl".

    owner_id, lease_ttl_s and take_over are the lease claim of the
    state-changing calls (as `moe-ep --owner/--lease-ttl-ms/--take-over`):
    owner_id None = "python@<hostname>:<pid>", "" = claim nothing (works only
    on workers without a live lease); lease_ttl_s in [0, 3600] seconds (0 =
    the worker's 30 s); take_over replaces another owner's live lease
    (claimed by form() and acquire_lease(); later calls claim plainly).

    timeout_s: the deadline of each fanned-out call; group_timeout_s: how
    long Join waits for the whole group (seconds). model: the ModelConfig
    whose sizes configure / allocate / forward / load_experts / benchmark
    default to (Group.from_model sets it).
    """

    def __init__(
        self,
        targets: Sequence[str],
        security: Security = Security(),
        timeout_s: float = 60.0,
        group_timeout_s: float = 30.0,
        backend: str = "auto",
        owner_id: Optional[str] = None,
        lease_ttl_s: float = 30.0,
        take_over: bool = False,
        model: Optional[ModelConfig] = None,
    ) -> None:
        if not targets:
            raise ValueError("targets: expected at least 1 worker")
        if owner_id is None:
            owner_id = f"python@{socket.gethostname()}:{os.getpid()}"
        if len(owner_id.encode()) > 128:
            raise ValueError(f"owner_id: at most 128 bytes, got {len(owner_id.encode())}")
        if not 0 <= lease_ttl_s <= 3600:
            raise ValueError(f"lease_ttl_s: expected in [0, 3600] seconds, got {lease_ttl_s}")
        if not 0 < group_timeout_s <= 3600:
            raise ValueError(f"group_timeout_s: expected in (0, 3600] seconds, got {group_timeout_s}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected > 0 seconds, got {timeout_s}")
        self.owner_id = owner_id
        self.lease_ttl_s = float(lease_ttl_s)
        self.take_over = take_over
        if len(set(targets)) != len(targets):
            raise ValueError(f"targets: an address appears twice: {list(targets)}")
        self.targets = list(targets)
        self.timeout_s = timeout_s
        self.group_timeout_s = float(group_timeout_s)
        self.model = model
        self.backend = backend
        self.generation = 0
        options = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.enable_http_proxy", 0),
        ]
        credentials = security.channel_credentials()
        self._channels = [
            grpc.secure_channel(t, credentials, options=options)
            if credentials is not None
            else grpc.insecure_channel(t, options=options)
            for t in self.targets
        ]
        self._stubs = [worker_pb2_grpc.WorkerStub(c) for c in self._channels]
        # Forward with the request already serialized (the array path: raw
        # bytes, see tensors.forward_request_bytes).
        forward = worker_pb2.DESCRIPTOR.services_by_name["Worker"].methods_by_name["Forward"]
        self._forward_raw = [
            c.unary_unary(
                f"/{forward.containing_service.full_name}/{forward.name}",
                request_serializer=None,
                response_deserializer=worker_pb2.ForwardResponse.FromString,
            )
            for c in self._channels
        ]

    @classmethod
    def from_model(
        cls,
        config: Union[str, "os.PathLike[str]", Mapping[str, Any], ModelConfig],
        targets: Sequence[str],
        **kwargs: Any,
    ) -> "Group":
        """A Group whose calls default to the sizes of a Hugging Face model.

        config: a config.json path (or its directory), its parsed dict, or a
        ModelConfig (moe_ep_client.model_config reads it as the worker's
        core/model_config.cc does: hidden_size, n_routed_experts /
        num_experts / num_local_experts, num_experts_per_tok,
        moe_intermediate_size, the sparse layers). kwargs: as Group().
        Then configure() configures that model, allocate(capacity_tokens=N)
        sizes its workspace, forward(layer, epoch, inputs) and
        load_experts(layer) need no sizes. ValueError / FileNotFoundError
        from the config.
        """
        model = config if isinstance(config, ModelConfig) else ModelConfig.load(config)
        return cls(targets, model=model, **kwargs)

    def _size(self, name: str, value: Optional[int], model_field: str) -> int:
        """`value`, else the model's `model_field`; ValueError without either."""
        if value is not None:
            return value
        if self.model is None:
            raise ValueError(f"{name}: required (or make the Group with Group.from_model)")
        return int(getattr(self.model, model_field))

    @property
    def world_size(self) -> int:
        return len(self.targets)

    def close(self) -> None:
        """Gives the lease back (issue 31 item 2: not held for its TTL after the
        process is gone), then closes the channels. Idempotent."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if getattr(self, "_claimed", False):
            request = worker_pb2.LeaseRequest(claim=self.claim(), release=True)
            try:  # 5 s at most: a worker that does not answer keeps it until the TTL
                self._fan_out(
                    "Lease (release)",
                    lambda r, s, t: s.Lease.future(request, timeout=t),
                    timeout_s=min(self.timeout_s, 5.0),
                )
            except GroupError:
                pass  # another owner's lease, or a worker gone: nothing of ours to give back
        for c in self._channels:
            c.close()

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def claim(self, take_over: bool = False) -> worker_pb2.LeaseClaim:
        """The LeaseClaim stamped into state-changing calls (empty without an owner)."""
        if not self.owner_id:
            return worker_pb2.LeaseClaim()
        self._claimed = True  # close() gives back what a claimed call may have taken
        return worker_pb2.LeaseClaim(
            owner_id=self.owner_id, ttl_ms=round(self.lease_ttl_s * 1000), take_over=take_over
        )

    def acquire_lease(self) -> List[int]:
        """Lease on every rank: acquires or renews (take_over as the Group says).

        Returns each rank's time left, seconds. GroupError (FAILED_PRECONDITION
        naming the owner) when another owner holds a live lease; ValueError
        without an owner_id.
        """
        if not self.owner_id:
            raise ValueError("acquire_lease: the Group has no owner_id")
        request = worker_pb2.LeaseRequest(claim=self.claim(self.take_over))
        responses = self._fan_out("Lease", lambda r, s, t: s.Lease.future(request, timeout=t))
        return [x.remaining_ms / 1000.0 for x in responses]

    def release_lease(self) -> None:
        """Gives the lease back on every rank (a no-op where this owner holds none)."""
        if not self.owner_id:
            return
        request = worker_pb2.LeaseRequest(claim=self.claim(), release=True)
        self._fan_out("Lease (release)", lambda r, s, t: s.Lease.future(request, timeout=t))

    # -- fan-out -----------------------------------------------------------

    def _fan_out(
        self,
        op: str,
        call: Callable[[int, worker_pb2_grpc.WorkerStub, float], Any],
        timeout_s: Optional[float] = None,
        ranks: Optional[Sequence[int]] = None,
    ) -> List[Any]:
        """Starts call(rank, stub, timeout) on every rank at once, then waits."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        pending = {r: call(r, self._stubs[r], timeout) for r in ranks}
        results: List[Any] = [None] * self.world_size
        failures: List[RankFailure] = []
        for r, future in pending.items():
            try:
                results[r] = future.result()
            except grpc.RpcError as e:  # the future raises its call's error
                failures.append(RankFailure(r, self.targets[r], e.code(), e.details() or ""))
        if failures:
            raise GroupError(op, self.world_size, failures)
        return results

    # -- operations --------------------------------------------------------

    def status_each(self) -> List[Union[WorkerStatus, RankFailure]]:
        """WorkerStatus per rank, or the RankFailure of a worker that did not answer."""
        pending = [
            s.GetStatus.future(worker_pb2.GetStatusRequest(), timeout=self.timeout_s)
            for s in self._stubs
        ]
        out: List[Union[WorkerStatus, RankFailure]] = []
        for r, future in enumerate(pending):
            try:
                out.append(WorkerStatus.from_proto(self.targets[r], future.result()))
            except grpc.RpcError as e:
                out.append(RankFailure(r, self.targets[r], e.code(), e.details() or ""))
        return out

    def status(self) -> List[WorkerStatus]:
        """GetStatus of every rank; GroupError when any does not answer."""
        responses = self._fan_out(
            "GetStatus",
            lambda r, s, t: s.GetStatus.future(worker_pb2.GetStatusRequest(), timeout=t),
        )
        return [WorkerStatus.from_proto(self.targets[r], x) for r, x in enumerate(responses)]

    def form(self) -> int:
        """Forms the group; returns its generation.

        Ranks still joined to an earlier group Leave first; the generation is
        1 + the largest generation this client or any worker has seen (formed
        or not: workers report max_generation_seen).
        """
        statuses = self.status()
        joined = [r for r, s in enumerate(statuses) if s.state != "STARTED"]
        if joined:
            self._fan_out(
                "Leave",
                lambda r, s, t: s.Leave.future(
                    worker_pb2.LeaveRequest(
                        generation=statuses[r].generation, lease=self.claim(self.take_over)
                    ),
                    timeout=t,
                ),
                ranks=joined,
            )
        # Above every generation a worker has seen, formed or not: a failed
        # formation may have written that generation's rendezvous keys.
        generation = 1 + max(
            [self.generation]
            + [s.generation for s in statuses]
            + [s.max_generation_seen for s in statuses]
        )
        secret = secrets.token_hex(16)
        rendezvous = self.targets[0]

        def join(r: int, stub: worker_pb2_grpc.WorkerStub, timeout: float) -> Any:
            request = worker_pb2.JoinRequest(
                world_size=self.world_size,
                rank=r,
                backend=self.backend,
                rendezvous_address=rendezvous if self.world_size > 1 else "",
                generation=generation,
                timeout_ms=round(self.group_timeout_s * 1000),
                rendezvous_secret=secret,
                lease=self.claim(self.take_over),
            )
            return stub.Join.future(request, timeout=timeout)

        self._fan_out("Join", join, timeout_s=self.group_timeout_s + 10.0)
        self.generation = generation
        return generation

    def leave(self) -> None:
        self._fan_out(
            "Leave",
            lambda r, s, t: s.Leave.future(
                worker_pb2.LeaveRequest(generation=self.generation, lease=self.claim()),
                timeout=t,
            ),
        )

    def configure(
        self,
        hidden_size: Optional[int] = None,
        num_layers: Optional[int] = None,
        num_experts: Optional[int] = None,
        top_k: Optional[int] = None,
        sparse_layers: Optional[Sequence[bool]] = None,
        attn_dp_size: int = 1,
        moe_intermediate_size: Optional[int] = None,
        a2a_enabled: bool = True,
        name: Optional[str] = None,
    ) -> str:
        """ConfigureLayers with tp = world; returns the plan fingerprint (same on all ranks).

        A size left None is the Group's model's (Group.from_model); without a
        model, hidden_size, num_layers, num_experts and top_k are required
        (sparse_layers then defaults to every layer, moe_intermediate_size to 0).
        """
        m = self.model
        hidden_size = self._size("hidden_size", hidden_size, "hidden_size")
        num_layers = self._size("num_layers", num_layers, "num_layers")
        num_experts = self._size("num_experts", num_experts, "num_experts")
        top_k = self._size("top_k", top_k, "top_k")
        if moe_intermediate_size is None:
            moe_intermediate_size = m.moe_intermediate_size if m is not None else 0
        if name is None:
            name = m.name if m is not None else ""
        if sparse_layers is None and m is not None and num_layers == m.num_layers:
            sparse_layers = m.sparse_layers
        sparse = list(sparse_layers) if sparse_layers is not None else [True] * num_layers
        request = worker_pb2.ConfigureLayersRequest(
            layout=worker_pb2.ParallelLayout(tp_size=self.world_size, attn_dp_size=attn_dp_size),
            a2a_enabled=a2a_enabled,
            model=worker_pb2.ModelDescription(
                name=name,
                hidden_size=hidden_size,
                num_layers=num_layers,
                num_experts=num_experts,
                top_k=top_k,
                moe_intermediate_size=moe_intermediate_size,
                sparse_layers=sparse,
            ),
            lease=self.claim(),
        )
        responses = self._fan_out(
            "ConfigureLayers", lambda r, s, t: s.ConfigureLayers.future(request, timeout=t)
        )
        return responses[0].fingerprint

    def allocate(
        self,
        hidden_size: Optional[int] = None,
        top_k: Optional[int] = None,
        num_experts: Optional[int] = None,
        capacity_tokens: Optional[int] = None,
        dtype: str = "bf16",
        cuda_graph_buckets: Sequence[int] = (),
    ) -> AllocatedWorkspace:
        """AllocateWorkspace on every rank (N = capacity_tokens, per rank; required).

        dtype: one of DISPATCH_DTYPES, the proto's DispatchDType values the
        worker moves ("bf16", "fp8_e4m3"; fp8_e4m3 needs H a multiple of 128).
        Sizes left None are the model's (Group.from_model).
        """
        hidden_size = self._size("hidden_size", hidden_size, "hidden_size")
        top_k = self._size("top_k", top_k, "top_k")
        num_experts = self._size("num_experts", num_experts, "num_experts")
        if capacity_tokens is None:
            raise ValueError("capacity_tokens: required (N, tokens per rank)")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
        request = worker_pb2.AllocateWorkspaceRequest(
            hidden_size=hidden_size,
            top_k=top_k,
            num_experts=num_experts,
            capacity_tokens=capacity_tokens,
            dispatch_dtype=_DTYPES[dtype],
            cuda_graph_buckets=list(cuda_graph_buckets),
            lease=self.claim(),
        )
        r0 = self._fan_out(
            "AllocateWorkspace", lambda r, s, t: s.AllocateWorkspace.future(request, timeout=t)
        )[0]
        return AllocatedWorkspace(
            dispatch_bytes_per_token=r0.dispatch_bytes_per_token,
            combine_bytes_per_token=r0.combine_bytes_per_token,
            flashinfer_workspace_bytes=r0.flashinfer_workspace_bytes,
            allocated_bytes=r0.allocated_bytes,
            capacity_tokens=r0.capacity_tokens,
        )

    def agree_geometry(self, epoch: int, local_tokens: Sequence[int]) -> GeometryAgreement:
        """SyncTokenCounts then CommitGeometry(epoch, R) on every rank.

        local_tokens[r] is rank r's token count for the step. Raises ValueError
        for a list of the wrong length, GroupError for per-rank failures (e.g.
        RESOURCE_EXHAUSTED when R > N), RuntimeError when ranks disagree.
        """
        if len(local_tokens) != self.world_size:
            raise ValueError(
                f"local_tokens: expected {self.world_size} entries (one per rank), "
                f"got {len(local_tokens)}"
            )
        synced = self._fan_out(
            "SyncTokenCounts",
            lambda r, s, t: s.SyncTokenCounts.future(
                worker_pb2.SyncTokenCountsRequest(epoch=epoch, local_tokens=local_tokens[r]),
                timeout=t,
            ),
        )
        first = synced[0]
        for r, x in enumerate(synced):
            if (list(x.token_counts), x.runtime_max_tokens_per_rank) != (
                list(first.token_counts),
                first.runtime_max_tokens_per_rank,
            ):
                raise RuntimeError(
                    f"SyncTokenCounts: rank {r} answered counts {list(x.token_counts)}, "
                    f"R {x.runtime_max_tokens_per_rank}; rank 0 answered "
                    f"{list(first.token_counts)}, R {first.runtime_max_tokens_per_rank}"
                )
        runtime_max = first.runtime_max_tokens_per_rank
        self._fan_out(
            "CommitGeometry",
            lambda r, s, t: s.CommitGeometry.future(
                worker_pb2.CommitGeometryRequest(
                    epoch=epoch,
                    runtime_max_tokens_per_rank=runtime_max,
                    local_tokens=local_tokens[r],
                ),
                timeout=t,
            ),
        )
        return GeometryAgreement(
            epoch=epoch,
            token_counts=list(first.token_counts),
            max_tokens=first.max_tokens,
            runtime_max_tokens_per_rank=runtime_max,
        )

    # -- data plane --------------------------------------------------------

    def load_experts(
        self,
        layer: int,
        kind: str = "swiglu",
        seed: int = 1,
        intermediate_size: Optional[int] = None,
        safetensors_path: str = "",
        name_pattern: str = "",
    ) -> List[LoadedExperts]:
        """LoadExperts on every rank: its share of `layer`'s experts (DESIGN §7).

        kind "swiglu" (seeded weights, or from safetensors_path with
        name_pattern; intermediate_size I is required: None = the model's
        moe_intermediate_size, else 0) or "identity" (no weights). Returns
        one LoadedExperts per rank.
        """
        if intermediate_size is None:
            intermediate_size = self.model.moe_intermediate_size if self.model is not None else 0
        if kind not in _EXPERT_KINDS:
            raise ValueError(f"kind: expected one of {sorted(_EXPERT_KINDS)}, got {kind!r}")
        request = worker_pb2.LoadExpertsRequest(
            layer=layer,
            kind=_EXPERT_KINDS[kind],
            seed=seed,
            safetensors_path=safetensors_path,
            name_pattern=name_pattern,
            intermediate_size=intermediate_size,
            lease=self.claim(),
        )
        responses = self._fan_out(
            "LoadExperts", lambda r, s, t: s.LoadExperts.future(request, timeout=t)
        )
        return [
            LoadedExperts(x.first_expert, x.num_local_experts, x.expert_bytes) for x in responses
        ]

    def forward(
        self,
        layer: int,
        epoch: int,
        hidden_size: Optional[int] = None,
        top_k: Optional[int] = None,
        inputs: Optional[Sequence[ForwardInput]] = None,
    ) -> List[ForwardResult]:
        """One MoE layer on every rank: dispatch -> experts -> combine (collective).

        inputs[r] is rank r's tokens (hidden sent as bf16; see ForwardInput
        for arrays, which go as raw bytes); the epoch must be the one
        committed by agree_geometry for these token counts. hidden_size and
        top_k: None = the model's (so, with a model: forward(layer, epoch,
        inputs=...)). Raises ValueError for missing inputs, a wrong number of
        them or a wrong shape, TypeError for a wrong dtype (both naming
        inputs[r]), GroupError for per-rank failures.
        """
        hidden_size = self._size("hidden_size", hidden_size, "hidden_size")
        top_k = self._size("top_k", top_k, "top_k")
        if inputs is None:
            raise ValueError("inputs: required (one ForwardInput per rank)")
        if len(inputs) != self.world_size:
            raise ValueError(
                f"inputs: expected {self.world_size} entries (one per rank), got {len(inputs)}"
            )
        requests: List[Any] = []
        kinds: List[tensors.ForwardOutputKind] = []
        for r, x in enumerate(inputs):
            if tensors.is_array(x.hidden):
                try:
                    raw, kind = tensors.forward_request_bytes(
                        layer, epoch, x.hidden, x.topk_ids, x.topk_weights, hidden_size, top_k
                    )
                except (TypeError, ValueError) as e:
                    raise type(e)(f"inputs[{r}].{e}") from e
                requests.append(raw)
                kinds.append(kind)
                continue
            if not (len(x.hidden) == len(x.topk_ids) == len(x.topk_weights)):
                raise ValueError(
                    f"inputs[{r}]: hidden, topk_ids and topk_weights have "
                    f"{len(x.hidden)}, {len(x.topk_ids)} and {len(x.topk_weights)} rows"
                )
            requests.append(
                worker_pb2.ForwardRequest(
                    layer=layer,
                    epoch=epoch,
                    hidden_states=tensors.bf16_tensor(x.hidden, hidden_size),
                    topk_ids=tensors.int32_tensor(x.topk_ids, top_k),
                    topk_weights=tensors.fp32_tensor(x.topk_weights, top_k),
                )
            )
            kinds.append(tensors.ForwardOutputKind("list"))

        def call(r: int, stub: worker_pb2_grpc.WorkerStub, timeout: float) -> Any:
            if isinstance(requests[r], bytes):
                return self._forward_raw[r].future(requests[r], timeout=timeout)
            return stub.Forward.future(requests[r], timeout=timeout)

        responses = self._fan_out("Forward", call)
        return [
            ForwardResult(
                output=tensors.output_from_tensor(x.output, kinds[r]),
                dispatch_s=x.timings.dispatch_us / 1e6,
                expert_s=x.timings.expert_us / 1e6,
                combine_s=x.timings.combine_us / 1e6,
                total_s=x.timings.total_us / 1e6,
                runtime_max_tokens_per_rank=x.runtime_max_tokens_per_rank,
                tokens_sent=x.tokens_sent,
                bytes_sent=x.bytes_sent,
                tokens_received=x.tokens_received,
            )
            for r, x in enumerate(responses)
        ]

    def benchmark(
        self,
        tokens_per_rank: int,
        hidden_size: Optional[int] = None,
        top_k: Optional[int] = None,
        num_experts: Optional[int] = None,
        routing: str = "uniform",
        iterations: int = 20,
        warmup: int = 3,
        seed: int = 1,
    ) -> List[BenchmarkResult]:
        """Times dispatch and combine on inputs the workers generate (collective).

        routing "uniform" or "skewed" (checked by the workers:
        INVALID_ARGUMENT otherwise). Sizes left None are the model's. Returns
        one BenchmarkResult per rank (latencies in seconds).
        """
        hidden_size = self._size("hidden_size", hidden_size, "hidden_size")
        top_k = self._size("top_k", top_k, "top_k")
        num_experts = self._size("num_experts", num_experts, "num_experts")
        request = worker_pb2.BenchmarkRequest(
            tokens_per_rank=tokens_per_rank,
            hidden_size=hidden_size,
            top_k=top_k,
            num_experts=num_experts,
            routing=routing,
            iterations=iterations,
            warmup=warmup,
            seed=seed,
        )
        responses = self._fan_out(
            "Benchmark", lambda r, s, t: s.Benchmark.future(request, timeout=t)
        )
        return [
            BenchmarkResult(
                dispatch_p50_s=x.dispatch_p50_us / 1e6,
                dispatch_p99_s=x.dispatch_p99_us / 1e6,
                combine_p50_s=x.combine_p50_us / 1e6,
                combine_p99_s=x.combine_p99_us / 1e6,
                dispatch_logical_gbps=x.dispatch_logical_gbps,
                combine_logical_gbps=x.combine_logical_gbps,
                dispatch_bytes=x.dispatch_bytes,
                combine_bytes=x.combine_bytes,
            )
            for x in responses
        ]
