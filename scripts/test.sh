#!/usr/bin/env bash
# Runs the whole test suite (unit, integration; GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
# Real model configs and traces live outside the repository (../shared/data).
if [ -z "${MOE_EP_DATA_DIR:-}" ] && [ -d ../shared/data ]; then
  export MOE_EP_DATA_DIR=$(cd ../shared/data && pwd)
fi
# ctest runs two tests at once on the 2-core machine, and a test's workers
# are several processes: OpenBLAS's own thread pool in each of them only
# oversubscribes the cores (the tests' GEMMs are small). One thread: the
# 100-run engine race took 21.8 CPU-s for 12 runs with OpenBLAS's default,
# 14.5 CPU-s with one.
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"${JOBS:-2}" "$@"
