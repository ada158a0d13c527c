"""Build step of moe-ep-client (pyproject.toml holds the metadata).

Generates the gRPC stubs of proto/moe_ep/v1 into the build tree with
python/generate_stubs.sh (protoc + grpc_python_plugin), so that the wheel
carries moe_ep.v1.*_pb2 and *_pb2_grpc beside moe_ep_client; nothing is
written into the source tree but setuptools' own build/ and *.egg-info. The
version is CMakeLists.txt's project(VERSION), the one `moe-ep --version` prints.
The source tree is this file's parent (or MOE_EP_SOURCE_DIR).
"""

import os
import re
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("MOE_EP_SOURCE_DIR", os.path.dirname(HERE))


def project_version() -> str:
    path = os.path.join(ROOT, "CMakeLists.txt")
    with open(path) as f:
        match = re.search(r"project\(\s*moe_ep\s+VERSION\s+([0-9][0-9.]*)", f.read())
    if match is None:
        raise RuntimeError(f"{path}: no project(moe_ep VERSION x.y.z)")
    return match.group(1)


class BuildWithStubs(build_py):
    """build_py, then the stubs of proto/moe_ep/v1 into the build tree."""

    def run(self) -> None:
        super().run()
        if not os.path.isdir(os.path.join(ROOT, "proto", "moe_ep", "v1")):
            raise RuntimeError(
                f"{ROOT}/proto/moe_ep/v1 not found: build from the moe-ep source tree "
                "(pip install ./python) or set MOE_EP_SOURCE_DIR"
            )
        subprocess.run(
            ["bash", os.path.join(ROOT, "python", "generate_stubs.sh"), self.build_lib],
            check=True,
        )


setup(version=project_version(), cmdclass={"build_py": BuildWithStubs})
