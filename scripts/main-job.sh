#!/usr/bin/env bash
# The README's first command: sets up whatever is missing (Debian packages and
# the two binaries, scripts/setup.sh) and runs the main job,
# `build/client/moe-ep run`, with any arguments given here (see
# `moe-ep run --help`). Exit status: that of `moe-ep run` (0 when every layer
# matches the reference).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --no-deploy-tools --target moe-ep --target moe-ep-worker
exec "${BUILD_DIR:-build}/client/moe-ep" run "$@"
