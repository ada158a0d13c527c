#!/usr/bin/env bash
# The habits CI enforces (issue 10 item 7), run by scripts/check.sh before the
# tests:
#   1. clang-format: every tracked C++/CUDA source (.cc .h .cu .cuh) must be
#      formatted as .clang-format says; the first unformatted file fails.
#   2. clang-tidy (14, the checks in .clang-tidy): every tracked .cc, and
#      every tracked .h that no .cc includes (the others are checked through
#      their includer by HeaderFilterRegex), with the build's
#      compile_commands.json. clang-tidy cannot parse .cu, so CUDA sources
#      are left out. Findings are listed; they fail the run when
#      MOE_EP_TIDY_STRICT=1 (the default; 0 lists them without failing).
#
# The clang-tidy cache (issue 34 item 5): .ci/tidy-clean.txt lists, one per
# line and sorted, the content keys of files that were tidied clean. A file's
# key (scripts/tidy_cache.py) hashes the file, every project header it
# includes transitively (the compiler's own -MM list, generated *.pb.h
# included), its compile command (source and build paths made relative),
# .clang-tidy, the clang-tidy version and the flags below. A file whose key is
# in the cache is skipped; every other file is tidied, so a file is never
# skipped when any of its inputs changed. Only --update-tidy-cache writes the
# cache: it tidies the files not in it and rewrites it with the keys of every
# file now clean (the skipped ones and the newly clean ones; stale keys go).
# Regenerate it after a change lands, on the complete build, and commit it:
#   scripts/lint.sh --update-tidy-cache && git add .ci/tidy-clean.txt
# (MOE_EP_TIDY_CACHE=0 with it tidies every file first: a rebuild from scratch.)
#
# Usage: scripts/lint.sh [--format-only | --update-tidy-cache]
# Env: BUILD_DIR (default build), LINT_JOBS (clang-tidy processes, default 2),
#      MOE_EP_TIDY_STRICT (0 or 1, default 1), MOE_EP_TIDY_CACHE (1 = skip the
#      files the cache lists, the default; 0 = tidy every file).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
jobs=${LINT_JOBS:-2}
cache=.ci/tidy-clean.txt
update=0
case "${1:-}" in
  "" | --format-only) ;;
  --update-tidy-cache) update=1 ;;
  *)
    echo "usage: scripts/lint.sh [--format-only | --update-tidy-cache]" >&2
    exit 2
    ;;
esac
mapfile -t sources < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
echo "lint: clang-format on ${#sources[@]} files"
clang-format --dry-run -Werror "${sources[@]}"
if [ "${1:-}" = "--format-only" ]; then exit 0; fi
if [ ! -f "$BUILD_DIR/compile_commands.json" ]; then
  echo "lint: $BUILD_DIR/compile_commands.json is missing (configure the build first)" >&2
  exit 1
fi
mapfile -t tidy < <(
  git ls-files '*.cc'
  for h in $(git ls-files '*.h'); do
    git grep -qF "#include \"$h\"" -- '*.cc' '*.cu' || echo "$h"
  done
)
tidy_bin=clang-tidy-14
tidy_args=(-quiet '--warnings-as-errors=*')
# Each run also gets --extra-arg=-Wno-error (not part of the key): the
# build's -Werror (MOE_EP_WERROR) would turn clang's own warnings into
# errors; the cache keys drop -Werror from the commands to match.
start=$(date +%s)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# clang-tidy reads the build's commands with unity batches expanded, so each
# batched source is tidied with its own command (scripts/tidy_cache.py).
scripts/tidy_cache.py compdb --build-dir "$BUILD_DIR" --out "$work/db"
scripts/tidy_cache.py keys --build-dir "$BUILD_DIR" --jobs "$jobs" --tidy "$tidy_bin" \
  --tidy-args "${tidy_args[*]}" "${tidy[@]}" >"$work/keys"
touch "$work/cached"
if [ "${MOE_EP_TIDY_CACHE:-1}" = 1 ] && [ -f "$cache" ]; then cp "$cache" "$work/cached"; fi
# keys: "KEY PATH"; a key of "-" (its inputs could not be listed) never matches.
# pick_keys LIST MATCH WANT PRINT: field PRINT of each line of keys whose field
# MATCH is (WANT=1) or is not (WANT=0) a line of LIST (1 = key, 2 = path).
pick_keys() {
  awk -v list="$1" -v match_field="$2" -v want="$3" -v print_field="$4" '
    BEGIN { while ((getline line < list) > 0) listed[line] = 1 }
    $1 != "-" && (($match_field in listed) == want) { print $print_field }' "$work/keys"
}
pick_keys "$work/cached" 1 0 2 >"$work/todo"
awk '$1 == "-" { print $2 }' "$work/keys" >>"$work/todo"
pick_keys "$work/cached" 1 1 1 >"$work/clean-keys"
mapfile -t todo <"$work/todo"
echo "lint: clang-tidy on ${#todo[@]} of ${#tidy[@]} files, $jobs at a time" \
  "($((${#tidy[@]} - ${#todo[@]})) unchanged since tidied clean: $cache; keys $(($(date +%s) - start)) s)"
# One file per clang-tidy process; -quiet keeps the output to findings. Each
# file's output goes to its own log; a file tidied clean is listed in "clean".
mkdir "$work/logs"
touch "$work/clean" "$work/failed"
status=0
if [ "${#todo[@]}" -gt 0 ]; then
  printf '%s\n' "${todo[@]}" | xargs -P "$jobs" -I{} sh -c '
    file=$1 work=$2 tidy=$3 build=$4
    shift 4
    log="$work/logs/$(printf %s "$file" | tr / _).log"
    if "$tidy" -p "$build" "$@" --extra-arg=-Wno-error "$file" >"$log" 2>&1; then
      printf "%s\n" "$file" >>"$work/clean"
    else
      printf "%s\n" "$log" >>"$work/failed"
      exit 1
    fi' _ {} "$work" "$tidy_bin" "$work/db" "${tidy_args[@]}" || status=$?
fi
if [ "$update" = 1 ]; then
  pick_keys "$work/clean" 2 1 1 >>"$work/clean-keys"
  mkdir -p "$(dirname "$cache")"
  LC_ALL=C sort -u "$work/clean-keys" >"$cache"
  echo "lint: $cache: $(wc -l <"$cache") keys of clean files"
fi
if [ "$status" != 0 ]; then
  mapfile -t failed <"$work/failed"
  cat "${failed[@]}" | grep -E "(warning|error):" | sort -u >&2 || cat "${failed[@]}" >&2
  echo "lint: clang-tidy found problems ($(($(date +%s) - start)) s)" >&2
  if [ "${MOE_EP_TIDY_STRICT:-1}" = 1 ]; then exit 1; fi
  exit 0
fi
echo "lint: clean ($(($(date +%s) - start)) s)"
