#!/usr/bin/env bash
# The habits CI enforces (issue 10 item 7), run by scripts/check.sh before the
# tests:
#   1. clang-format: every tracked C++/CUDA source (.cc .h .cu .cuh) must be
#      formatted as .clang-format says; the first unformatted file fails.
#   2. clang-tidy (14, the checks in .clang-tidy): every tracked .cc, and
#      every tracked .h that no .cc or .cu includes (the others are checked
#      through their includer by HeaderFilterRegex), with the build's
#      compile_commands.json. Findings are listed; they fail the run when
#      MOE_EP_TIDY_STRICT=1 (the default; 0 lists them without failing).
#   3. clang-tidy on CUDA (issue 34 item 3): when the build compiles CUDA,
#      every tracked .cu, with clang-tidy-19 and the same .clang-tidy (19
#      knows more checks under its globs than 14; the few it found are fixed).
#      clang-tidy 14 cannot parse CUDA 13's headers (it knows no sm_90a, its
#      CUDA wrapper needs the texture templates CUDA 12 removed, and CCCL 3's
#      headers do not parse in it); 19 can, with two small generated headers
#      (scripts/tidy_cache.py, CUDA_SHIM).
#      Each .cu's nvcc command is read as clang's (tidy_cache.py
#      cuda_command): the host pass, which parses every kernel body too.
#      scripts/install-deps.sh installs clang-tidy-19 where nvcc exists.
#
# The clang-tidy cache (issue 34 item 5): .ci/tidy-clean.txt lists, one per
# line and sorted, the content keys of files that were tidied clean. A file's
# key (scripts/tidy_cache.py) hashes the file, every project header it
# includes transitively (the compiler's own -MM list, generated *.pb.h
# included), its compile command (source and build paths made relative),
# .clang-tidy, the clang-tidy version and the flags below (for a .cu, its
# clang command, the CUDA release and the generated headers too). A file
# whose key is in the cache is skipped; every other file is tidied, so a file
# is never skipped when any of its inputs changed. Only --update-tidy-cache
# writes the cache: it tidies the files not in it and rewrites it with the
# keys of every file now clean (the skipped ones and the newly clean ones;
# stale keys go).
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
# .cu files: tidied only when the build compiles CUDA (nvcc commands in
# compile_commands.json); their own clang-tidy and clang (tidy_cache.py).
cu_tidy_bin=clang-tidy-19
cu_clang=clang++-19
cu=()
if grep -q '"file": ".*\.cu"' "$BUILD_DIR/compile_commands.json"; then
  if ! command -v "$cu_tidy_bin" >/dev/null || ! command -v "$cu_clang" >/dev/null; then
    echo "lint: the build compiles CUDA: .cu files need $cu_tidy_bin (scripts/install-deps.sh)" >&2
    exit 1
  fi
  mapfile -t cu < <(git ls-files '*.cu')
else
  echo "lint: no CUDA in $BUILD_DIR: .cu files are not tidied"
fi
# Each run also gets --extra-arg=-Wno-error (not part of the key): the
# build's -Werror (MOE_EP_WERROR) would turn clang's own warnings into
# errors; the cache keys drop -Werror from the commands to match.
start=$(date +%s)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# clang-tidy reads the build's commands with unity batches expanded, so each
# batched source is tidied with its own command (scripts/tidy_cache.py).
# The .cu files get their own database ($work/cudb: clang commands) and the
# generated headers ($work/cuda-shim: tidy_cache.py CUDA_SHIM).
cuda_args=(--cuda-clang "$cu_clang" --cuda-shim "$work/cuda-shim")
scripts/tidy_cache.py compdb --build-dir "$BUILD_DIR" --out "$work/db" \
  --cuda-out "$work/cudb" "${cuda_args[@]}"
scripts/tidy_cache.py keys --build-dir "$BUILD_DIR" --jobs "$jobs" --tidy "$tidy_bin" \
  --tidy-args "${tidy_args[*]}" "${tidy[@]}" >"$work/keys"
if [ "${#cu[@]}" -gt 0 ]; then
  scripts/tidy_cache.py keys --build-dir "$BUILD_DIR" --jobs "$jobs" --tidy "$cu_tidy_bin" \
    --tidy-args "${tidy_args[*]}" "${cuda_args[@]}" "${cu[@]}" >>"$work/keys"
fi
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
total=$((${#tidy[@]} + ${#cu[@]}))
cu_todo=$(grep -c '\.cu$' "$work/todo" || true)
echo "lint: clang-tidy on ${#todo[@]} of $total files, $jobs at a time" \
  "($((total - ${#todo[@]})) unchanged since tidied clean: $cache; keys $(($(date +%s) - start)) s)"
if [ "${#cu[@]}" -gt 0 ]; then
  echo "lint: of them $cu_todo of ${#cu[@]} .cu files, with $cu_tidy_bin (CUDA, host pass)"
fi
# One file per clang-tidy process; -quiet keeps the output to findings. Each
# file's output goes to its own log; a file tidied clean is listed in "clean".
mkdir "$work/logs"
touch "$work/clean" "$work/failed"
status=0
if [ "${#todo[@]}" -gt 0 ]; then
  printf '%s\n' "${todo[@]}" | xargs -P "$jobs" -I{} sh -c '
    file=$1 work=$2 tidy=$3 build=$4 cu_tidy=$5 cu_build=$6
    shift 6
    case "$file" in *.cu) tidy=$cu_tidy build=$cu_build ;; esac
    log="$work/logs/$(printf %s "$file" | tr / _).log"
    if "$tidy" -p "$build" "$@" --extra-arg=-Wno-error "$file" >"$log" 2>&1; then
      printf "%s\n" "$file" >>"$work/clean"
    else
      printf "%s\n" "$log" >>"$work/failed"
      exit 1
    fi' _ {} "$work" "$tidy_bin" "$work/db" "$cu_tidy_bin" "$work/cudb" "${tidy_args[@]}" ||
    status=$?
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
