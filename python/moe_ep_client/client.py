"""Typed wrapper over the moe_ep.v1.Worker stubs (see __init__.py).

Semantics follow proto/moe_ep/v1/worker.proto (the contract) and DESIGN §6/§8:
the group is formed with rank i = targets[i] and the rendezvous at targets[0];
a new group always uses a generation above every generation any worker has
seen (rendezvous keys are write-once); geometry is agreed by SyncTokenCounts on
every rank followed by CommitGeometry(epoch, R) on every rank.
"""

from __future__ import annotations

import dataclasses
from concurrent import futures
from typing import Callable, List, Optional, Sequence, TypeVar

import grpc

from moe_ep.v1 import worker_pb2, worker_pb2_grpc

T = TypeVar("T")

_STATE_NAMES = {
    worker_pb2.WORKER_STATE_STARTED: "STARTED",
    worker_pb2.WORKER_STATE_JOINED: "JOINED",
    worker_pb2.WORKER_STATE_CONFIGURED: "CONFIGURED",
    worker_pb2.WORKER_STATE_ALLOCATED: "ALLOCATED",
}

_DTYPES = {
    "bf16": worker_pb2.DISPATCH_DTYPE_BF16,
    "nvfp4": worker_pb2.DISPATCH_DTYPE_NVFP4,
    "mxfp8": worker_pb2.DISPATCH_DTYPE_MXFP8,
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
    """One channel per worker; rank i is targets[i]. Not thread-safe."""

    def __init__(
        self,
        targets: Sequence[str],
        security: Security = Security(),
        timeout_s: float = 60.0,
        group_timeout_ms: int = 30000,
        backend: str = "gloo",
    ):
        if not targets:
            raise ValueError("targets: expected at least 1 worker")
        if len(set(targets)) != len(targets):
            raise ValueError(f"targets: an address appears twice: {list(targets)}")
        self.targets = list(targets)
        self.timeout_s = timeout_s
        self.group_timeout_ms = group_timeout_ms
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

    @property
    def world_size(self) -> int:
        return len(self.targets)

    def close(self) -> None:
        for c in self._channels:
            c.close()

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- fan-out -----------------------------------------------------------

    def _fan_out(
        self,
        op: str,
        call: Callable[[int, worker_pb2_grpc.WorkerStub, float], "grpc.Future"],
        timeout_s: Optional[float] = None,
        ranks: Optional[Sequence[int]] = None,
    ) -> List:
        """Starts call(rank, stub, timeout) on every rank at once, then waits."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        pending = {r: call(r, self._stubs[r], timeout) for r in ranks}
        results: List = [None] * self.world_size
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

    def status_each(self) -> List[object]:
        """WorkerStatus per rank, or the RankFailure of a worker that did not answer."""
        pending = [
            s.GetStatus.future(worker_pb2.GetStatusRequest(), timeout=self.timeout_s)
            for s in self._stubs
        ]
        out: List[object] = []
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
        1 + the largest generation this client or any worker has used.
        """
        statuses = self.status()
        joined = [r for r, s in enumerate(statuses) if s.state != "STARTED"]
        if joined:
            self._fan_out(
                "Leave",
                lambda r, s, t: s.Leave.future(
                    worker_pb2.LeaveRequest(generation=statuses[r].generation), timeout=t
                ),
                ranks=joined,
            )
        generation = 1 + max([self.generation] + [s.generation for s in statuses])
        rendezvous = self.targets[0]

        def join(r, stub, timeout):
            request = worker_pb2.JoinRequest(
                world_size=self.world_size,
                rank=r,
                backend=self.backend,
                rendezvous_address=rendezvous if self.world_size > 1 else "",
                generation=generation,
                timeout_ms=self.group_timeout_ms,
            )
            return stub.Join.future(request, timeout=timeout)

        self._fan_out("Join", join, timeout_s=self.group_timeout_ms / 1000.0 + 10.0)
        self.generation = generation
        return generation

    def leave(self) -> None:
        self._fan_out(
            "Leave",
            lambda r, s, t: s.Leave.future(
                worker_pb2.LeaveRequest(generation=self.generation), timeout=t
            ),
        )

    def configure(
        self,
        hidden_size: int,
        num_layers: int,
        num_experts: int,
        top_k: int,
        sparse_layers: Optional[Sequence[bool]] = None,
        attn_dp_size: int = 1,
        moe_intermediate_size: int = 0,
        a2a_enabled: bool = True,
        name: str = "",
    ) -> str:
        """ConfigureLayers with tp = world; returns the plan fingerprint (same on all ranks)."""
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
        )
        responses = self._fan_out(
            "ConfigureLayers", lambda r, s, t: s.ConfigureLayers.future(request, timeout=t)
        )
        return responses[0].fingerprint

    def allocate(
        self,
        hidden_size: int,
        top_k: int,
        num_experts: int,
        capacity_tokens: int,
        dtype: str = "bf16",
        cuda_graph_buckets: Sequence[int] = (),
    ) -> AllocatedWorkspace:
        """AllocateWorkspace on every rank (N = capacity_tokens, per rank)."""
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
        request = worker_pb2.AllocateWorkspaceRequest(
            hidden_size=hidden_size,
            top_k=top_k,
            num_experts=num_experts,
            capacity_tokens=capacity_tokens,
            dispatch_dtype=_DTYPES[dtype],
            cuda_graph_buckets=list(cuda_graph_buckets),
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
