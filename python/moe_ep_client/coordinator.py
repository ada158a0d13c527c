"""Client of a running `moe-ep coordinator` (moe_ep.v1.Coordinator), for Python
orchestrators (DESIGN §16; issue 31 item 1):

    from moe_ep_client import Coordinator
    with Coordinator("127.0.0.1:50070") as c:
        c.apply({"targets": ["10.0.0.1:50051", "10.0.0.2:50051"], "backend": "gloo"})
        view = c.wait_ready(timeout_s=120)          # GetGroup until phase READY
        print(view.phase, view.generation, [r.state for r in view.ranks])
        c.drain()                                   # every rank leaves; the lease is given back

The same calls as `moe-ep coordinator status|apply|drain`. States and phases
are the enum names without their prefix ("READY", "WAITING", "MASKED");
proto/moe_ep/v1/coordinator.proto says what each means. Failures raise
CoordinatorError with the gRPC code (UNAVAILABLE: no coordinator there;
INVALID_ARGUMENT: Apply refused the state, naming the field; UNIMPLEMENTED:
the address serves no coordinator, e.g. a worker).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, List, Mapping, Union

import grpc
from google.protobuf import json_format

from moe_ep.v1 import coordinator_pb2, coordinator_pb2_grpc, worker_pb2
from moe_ep_client.client import Security

DEFAULT_TARGET = "127.0.0.1:50070"  # the coordinator's default --listen


def _short(name: str, prefix: str) -> str:
    return name[len(prefix):] if name.startswith(prefix) else name


class CoordinatorError(Exception):
    """A Coordinator call failed: `op`, the gRPC `code` and the server's `details`."""

    def __init__(self, op: str, target: str, code: grpc.StatusCode, details: str):
        self.op = op
        self.target = target
        self.code = code
        self.details = details
        hint = ""
        if code == grpc.StatusCode.UNIMPLEMENTED:
            hint = f" ({target} serves no moe_ep.v1.Coordinator: a worker? use Group.status())"
        super().__init__(f"Coordinator.{op} on {target}: {code.name}: {details}{hint}")


@dataclasses.dataclass(frozen=True)
class RankView:
    """One rank as the coordinator sees it (coordinator.proto RankView)."""

    rank: int
    target: str
    state: str  # READY, FORMING, WAITING, UNREACHABLE, UNRESPONSIVE, IDLE, BROKEN, MASKED
    worker_state: str  # STARTED, JOINED, CONFIGURED, ALLOCATED (its last GetStatus)
    worker_generation: int
    last_error: str  # why it is not READY ("" when READY)
    since_unix_s: float  # when it entered `state` (Unix time, seconds)


@dataclasses.dataclass(frozen=True)
class GroupEvent:
    time_unix_s: float  # Unix time, seconds
    generation: int
    kind: str  # "formed", "rank_lost", "group_broken", "masked", "drained", ...
    rank: int  # -1 when not about one rank
    message: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class GroupView:
    """GetGroup: the group as the coordinator sees it (every time in seconds, as the
    rest of moe_ep_client)."""

    phase: str  # READY, FORMING, WAITING, BACKING_OFF, MASKED, DRAINED, UNSPECIFIED
    generation: int
    desired_version: int
    ranks: List[RankView]
    history: List[GroupEvent]  # newest last
    formations: int
    failed_attempts: int
    last_error: str
    masked_ranks: List[int]
    mask_round: int
    lost_experts: List[int]
    readds: int
    last_form_seconds: float
    last_load_seconds: float
    last_recovery_seconds: float
    desired: Mapping[str, Any]  # the desired state in force (proto field names)

    @property
    def ready(self) -> bool:
        return self.phase == "READY"

    @staticmethod
    def from_proto(g: coordinator_pb2.GetGroupResponse) -> "GroupView":
        ranks = [
            RankView(
                rank=r.rank,
                target=r.target,
                state=_short(coordinator_pb2.RankState.Name(r.state), "RANK_STATE_"),
                worker_state=_short(worker_pb2.WorkerState.Name(r.worker_state), "WORKER_STATE_"),
                worker_generation=r.worker_generation,
                last_error=r.last_error,
                since_unix_s=r.since_unix_ms / 1000.0,
            )
            for r in g.ranks
        ]
        history = [
            GroupEvent(e.time_unix_ms / 1000.0, e.generation, e.kind, e.rank, e.message, e.seconds)
            for e in g.history
        ]
        return GroupView(
            phase=_short(coordinator_pb2.GroupPhase.Name(g.phase), "GROUP_PHASE_"),
            generation=g.generation,
            desired_version=g.desired_version,
            ranks=ranks,
            history=history,
            formations=g.formations,
            failed_attempts=g.failed_attempts,
            last_error=g.last_error,
            masked_ranks=list(g.masked_ranks),
            mask_round=g.mask_round,
            lost_experts=list(g.lost_experts),
            readds=g.readds,
            last_form_seconds=g.last_form_seconds,
            last_load_seconds=g.last_load_seconds,
            last_recovery_seconds=g.last_recovery_seconds,
            desired=json_format.MessageToDict(g.desired, preserving_proto_field_name=True),
        )


@dataclasses.dataclass(frozen=True)
class ApplyResult:
    desired_version: int
    changed: bool  # False: the state in force was applied again (nothing re-formed)


DesiredStateLike = Union[coordinator_pb2.DesiredState, Mapping[str, Any]]


def desired_state(desired: DesiredStateLike) -> coordinator_pb2.DesiredState:
    """A DesiredState from itself or from a dict in its JSON form (field names as
    in the .proto or lowerCamelCase; enums by name, e.g. "EXPERT_KIND_IDENTITY").
    ValueError naming the field for an unknown field or a wrong type."""
    if isinstance(desired, coordinator_pb2.DesiredState):
        return desired
    try:
        return json_format.ParseDict(dict(desired), coordinator_pb2.DesiredState())
    except json_format.ParseError as e:
        raise ValueError(f"desired state: {e}") from e


class Coordinator:
    """One channel to a coordinator. Thread-safe (gRPC channels are)."""

    def __init__(
        self, target: str = DEFAULT_TARGET, security: Security = Security(), timeout_s: float = 10.0
    ) -> None:
        if not target:
            raise ValueError("target: expected the coordinator's host:port")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")
        self.target = target
        self.timeout_s = timeout_s
        options = [("grpc.enable_http_proxy", 0)]
        credentials = security.channel_credentials()
        self._channel = (
            grpc.secure_channel(target, credentials, options=options)
            if credentials is not None
            else grpc.insecure_channel(target, options=options)
        )
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, op: str, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise CoordinatorError(op, self.target, e.code(), e.details() or "") from e

    def group_proto(self) -> coordinator_pb2.GetGroupResponse:
        """GetGroup as the raw message."""
        return self._call("GetGroup", self._stub.GetGroup, coordinator_pb2.GetGroupRequest())

    def group(self) -> GroupView:
        """GetGroup: phase, generation, ranks, history (never blocks on workers)."""
        return GroupView.from_proto(self.group_proto())

    def apply(self, desired: DesiredStateLike) -> ApplyResult:
        """Apply a desired state; the group is formed in the background when it
        changed (wait_ready waits for it)."""
        request = coordinator_pb2.ApplyRequest(desired=desired_state(desired))
        response = self._call("Apply", self._stub.Apply, request)
        return ApplyResult(response.desired_version, response.changed)

    def apply_file(self, path: str) -> ApplyResult:
        """Apply the desired state JSON file at `path` (as `moe-ep coordinator --state`)."""
        with open(path) as f:
            return self.apply(json.load(f))

    def drain(self) -> List[str]:
        """Drain: every reachable rank leaves, the lease is given back and nothing
        is formed until the next apply. Returns the ranks that could not be
        reached ("rank R (TARGET): error"; empty when every rank left)."""
        response = self._call("Drain", self._stub.Drain, coordinator_pb2.DrainRequest())
        return list(response.unreachable)

    def wait_ready(self, timeout_s: float = 120.0, poll_s: float = 0.1) -> GroupView:
        """GetGroup every poll_s until the phase is READY; TimeoutError (with the
        last phase and each rank's state) after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            view = self.group()
            if view.ready:
                return view
            if time.monotonic() >= deadline:
                states = ", ".join(
                    f"rank {r.rank} {r.state}" + (f" ({r.last_error})" if r.last_error else "")
                    for r in view.ranks
                )
                raise TimeoutError(
                    f"coordinator {self.target}: phase {view.phase} after {timeout_s} s "
                    f"(generation {view.generation}; {states or 'no ranks'})"
                )
            time.sleep(poll_s)
