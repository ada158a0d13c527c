#!/usr/bin/env bash
# Configures and builds moe-ep into ./build (or $BUILD_DIR). CUDA is picked up
# automatically when nvcc is present; pass -DMOE_EP_WITH_CUDA=OFF to skip it.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-2}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-RelWithDebInfo} "$@"
cmake --build "$BUILD_DIR" -j"$JOBS"
