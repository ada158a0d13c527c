"""Python control-plane client of moe-ep workers, for orchestrators.

A small typed wrapper over the generated gRPC stubs of proto/moe_ep/v1
(`pip install --no-build-isolation ./python` generates and installs them;
or python/generate_stubs.sh OUT with OUT on PYTHONPATH):

    from moe_ep_client import Group, Security
    group = Group(["10.0.0.1:50051", "10.0.0.2:50051"], security=Security(...))
    group.form()                                  # Join, rank i = targets[i]
    group.configure(hidden_size=..., ...)         # ConfigureLayers
    group.allocate(hidden_size=..., ...)          # AllocateWorkspace
    agreed = group.agree_geometry(epoch=1, local_tokens=[5, 3])
    for s in group.status(): print(s.rank, s.state, s.runtime_max_tokens_per_rank)
    group.load_experts(layer=0, kind="identity")  # LoadExperts
    out = group.forward(layer=0, epoch=1, hidden_size=..., top_k=...,
                        inputs=[ForwardInput(hidden, ids, weights), ...])  # Forward
    group.benchmark(tokens_per_rank=128, hidden_size=..., top_k=..., num_experts=...)

Every collective call is sent to all ranks in parallel under one deadline;
failures raise GroupError listing each failing rank, its target and gRPC code.
"""

from typing import Any

# The control-plane names import gRPC and the generated stubs on first use
# (PEP 562), so that `moe_ep_client.engine` (ctypes only) also loads where
# gRPC is not installed, e.g. an engine's GPU image.
__all__ = [
    "AllocatedWorkspace",
    "BenchmarkResult",
    "Coordinator",
    "CoordinatorError",
    "ForwardInput",
    "ForwardResult",
    "GeometryAgreement",
    "Group",
    "GroupError",
    "LoadedExperts",
    "RankFailure",
    "Security",
    "WorkerStatus",
]


def __getattr__(name: str) -> Any:
    if name in ("Coordinator", "CoordinatorError"):  # moe_ep.v1.Coordinator (issue 31)
        from moe_ep_client import coordinator

        return getattr(coordinator, name)
    if name in __all__:
        from moe_ep_client import client

        return getattr(client, name)
    raise AttributeError(f"module 'moe_ep_client' has no attribute {name!r}")
