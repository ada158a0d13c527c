"""Python control-plane client of moe-ep workers, for orchestrators.

A small typed wrapper over the generated gRPC stubs of proto/moe_ep/v1
(`pip install --no-build-isolation ./python` generates and installs them;
or python/generate_stubs.sh OUT with OUT on PYTHONPATH):

    from moe_ep_client import Group, Security
    group = Group.from_model("DeepSeek-V3.json",  # or Group(targets) and sizes per call
                             ["10.0.0.1:50051", "10.0.0.2:50051"], security=Security(...))
    group.form()                                  # Join, rank i = targets[i]
    group.configure()                             # ConfigureLayers (the model's sizes)
    group.allocate(capacity_tokens=256)           # AllocateWorkspace ("bf16"/"fp8_e4m3")
    agreed = group.agree_geometry(epoch=1, local_tokens=[5, 3])
    for s in group.status(): print(s.rank, s.state, s.runtime_max_tokens_per_rank)
    group.load_experts(layer=3, kind="identity")  # LoadExperts
    out = group.forward(layer=3, epoch=1,         # Forward; arrays go as raw bytes
                        inputs=[ForwardInput(hidden, ids, weights), ...])
    group.benchmark(tokens_per_rank=128)

Every collective call is sent to all ranks in parallel under one deadline;
failures raise GroupError listing each failing rank, its target and gRPC code.
Times are seconds (floats) throughout. __version__ is the package's (the
CMake project version, as `moe-ep --version` prints it).
"""

import os
import re
from typing import Any


def _version() -> str:
    """The source tree's CMake project version when this package lies in one
    (python/ on PYTHONPATH), else the installed distribution's."""
    cmake = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "CMakeLists.txt")
    try:
        with open(cmake, encoding="utf-8") as f:
            match = re.search(r"project\(\s*moe_ep\s+VERSION\s+([0-9][0-9.]*)", f.read())
        if match:
            return match.group(1)
    except OSError:
        pass
    from importlib import metadata

    try:
        return metadata.version("moe-ep-client")
    except metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _version()

# The control-plane names import gRPC and the generated stubs on first use
# (PEP 562), so that `moe_ep_client.engine` (ctypes only) also loads where
# gRPC is not installed, e.g. an engine's GPU image.
__all__ = [
    "DISPATCH_DTYPES",
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
    "ModelConfig",
    "RankFailure",
    "Security",
    "WorkerStatus",
]


def __getattr__(name: str) -> Any:
    if name == "ModelConfig":  # standard library only, like engine
        from moe_ep_client import model_config

        return model_config.ModelConfig
    if name in ("Coordinator", "CoordinatorError"):  # moe_ep.v1.Coordinator (issue 31)
        from moe_ep_client import coordinator

        return getattr(coordinator, name)
    if name in __all__:
        from moe_ep_client import client

        return getattr(client, name)
    raise AttributeError(f"module 'moe_ep_client' has no attribute {name!r}")
