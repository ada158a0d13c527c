#!/usr/bin/env bash
# Sets up whatever is missing on a Debian 12 machine, skipping what is there:
# the Debian packages (scripts/install-deps.sh), the npm packages of the
# deploy validator (scripts/install-deploy-tools.sh; not with --no-deploy-tools)
# and the build (as scripts/build.sh: into ./build, or $BUILD_DIR; configured
# once, then an incremental build, which is quick when nothing changed).
#
# Usage: scripts/setup.sh [--no-deploy-tools] [--target T]... [CMAKE_ARGS...]
#   --target T   build only these targets (default: everything)
#   CMAKE_ARGS   passed to the first configure, e.g. -DMOE_EP_WITH_CUDA=OFF
# Used by scripts/main-job.sh and scripts/check.sh (the README's two commands).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy_tools=1
targets=()
cmake_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-deploy-tools) deploy_tools=0; shift ;;
    --target) targets+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) cmake_args+=("$1"); shift ;;
  esac
done
scripts/install-deps.sh
if [ "$deploy_tools" = 1 ]; then scripts/install-deploy-tools.sh; fi
BUILD_DIR=${BUILD_DIR:-build}
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ] || [ ${#cmake_args[@]} -gt 0 ]; then
  # A new build directory: Ninja where installed (scripts/install-deps.sh),
  # which keeps both cores busy across target boundaries. An existing one
  # keeps the generator it was configured with.
  generator=()
  if [ ! -f "$BUILD_DIR/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then
    generator=(-G Ninja)
  fi
  cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" \
    "${cmake_args[@]}"
fi
target_args=()
for t in "${targets[@]}"; do target_args+=(--target "$t"); done
cmake --build "$BUILD_DIR" -j"${JOBS:-2}" "${target_args[@]}"
