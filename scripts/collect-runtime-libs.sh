#!/usr/bin/env bash
# Copies the shared libraries that the given binaries need (as ldd resolves
# them, minus the C/C++ runtime) into OUT_DIR, for a slim runtime image.
# Usage: scripts/collect-runtime-libs.sh OUT_DIR BINARY...
set -euo pipefail
out=$1; shift
mkdir -p "$out"
out_real=$(cd "$out" && pwd -P)
ldd "$@" | awk '/=> \//{print $3}' | sort -u | while read -r lib; do
  # Already there (libmoe_ep.so.0, which moe-ep-worker links, is copied first).
  [ "$(cd "$(dirname "$lib")" && pwd -P)" = "$out_real" ] && continue
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
    *) cp -L "$lib" "$out/" ;;
  esac
done
