#!/usr/bin/env bash
# Runs the whole test suite (unit, integration; GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
# Real model configs and traces live outside the repository (../shared/data).
if [ -z "${MOE_EP_DATA_DIR:-}" ] && [ -d ../shared/data ]; then
  export MOE_EP_DATA_DIR=$(cd ../shared/data && pwd)
fi
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"${JOBS:-2}" "$@"
