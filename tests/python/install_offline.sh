#!/usr/bin/env bash
# Installs python/ as a user would, offline, into a fresh venv, then runs
# python/tests with that venv's interpreter against real workers (issue 9
# item 9):
#   /usr/bin/python3 -m venv --system-site-packages V
#   V/bin/pip install --no-build-isolation ./python      (no index: offline)
# The build runs from a copy of python/, proto/ and CMakeLists.txt, so the
# source tree gets no build/ or *.egg-info; it generates the stubs itself.
# Usage: tests/python/install_offline.sh MOE_EP_WORKER [MOE_EP_CLI]
# (MOE_EP_CLI, the moe-ep binary: the model-config test compares with its reader.)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
worker=$(realpath "${1:?usage: install_offline.sh MOE_EP_WORKER [MOE_EP_CLI]}")
[ -x "$worker" ] || { echo "FAIL $worker is not an executable moe-ep-worker"; exit 1; }
cli=${2:+$(realpath "$2")}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/src"
cp -r "$root/python" "$root/proto" "$root/CMakeLists.txt" "$tmp/src/"
rm -rf "$tmp/src/python/build" "$tmp/src/python/"*.egg-info
/usr/bin/python3 -m venv --system-site-packages "$tmp/v"
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
"$tmp/v/bin/pip" install --no-build-isolation --quiet "$tmp/src/python"
rm -rf "$tmp/src"  # what follows must come from the venv alone
"$tmp/v/bin/pip" show moe-ep-client | grep -E '^(Name|Version):'
cd "$tmp"
"$tmp/v/bin/python" - "$tmp/v" <<'PY'
import sys
import moe_ep_client, moe_ep.v1.worker_pb2, moe_ep.v1.worker_pb2_grpc
for m in (moe_ep_client, moe_ep.v1.worker_pb2):
    if not m.__file__.startswith(sys.argv[1]):
        sys.exit(f"FAIL {m.__name__} comes from {m.__file__}, not the venv {sys.argv[1]}")
print("imported from the venv:", moe_ep_client.__file__, moe_ep.v1.worker_pb2.__file__)
PY
cd "$root/python/tests"
MOE_EP_WORKER=$worker MOE_EP_CLI=$cli "$tmp/v/bin/python" -m unittest discover -s . -v
