#!/usr/bin/env bash
# The README's second command, and what .ci/run runs: sets up whatever is
# missing (Debian packages, the deploy validator's npm packages, the
# build but the benchmarks: scripts/setup.sh), checks formatting and clang-tidy (scripts/lint.sh)
# and runs every test (scripts/test.sh, i.e. ctest; arguments go to ctest,
# e.g. -R python). Exit status: the first failing step's.
set -euo pipefail
cd "$(dirname "$0")/.."
# A new build directory (CI's clean clone) leaves the benchmarks out of the
# default target: no test runs them, and lint still tidies their sources
# (CMakeLists.txt MOE_EP_BENCHES_IN_ALL). An existing one keeps its setting.
setup_args=()
if [ ! -f "${BUILD_DIR:-build}/CMakeCache.txt" ]; then setup_args=(-DMOE_EP_BENCHES_IN_ALL=OFF); fi
scripts/setup.sh "${setup_args[@]}"
scripts/lint.sh
exec scripts/test.sh "$@"
