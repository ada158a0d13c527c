#!/usr/bin/env bash
# The README's second command, and what .ci/run runs: sets up whatever is
# missing (Debian packages, the deploy validator's npm packages, the whole
# build: scripts/setup.sh), checks formatting and clang-tidy (scripts/lint.sh)
# and runs every test (scripts/test.sh, i.e. ctest; arguments go to ctest,
# e.g. -R python). Exit status: the first failing step's.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/lint.sh
exec scripts/test.sh "$@"
