#!/usr/bin/env bash
# Checks libmoe_ep.so's ELF contract (issue 16 item 1): SONAME
# libmoe_ep.so.MAJOR, RUNPATH/RPATH $ORIGIN, and only moe_ep_* symbols
# exported (nm -D --defined-only). Usage: check_library.sh LIB MAJOR
set -euo pipefail
lib=${1:?usage: check_library.sh LIB MAJOR}
major=${2:?usage: check_library.sh LIB MAJOR}
status=0
soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
if [ "$soname" != "libmoe_ep.so.$major" ]; then
  echo "FAIL SONAME: expected libmoe_ep.so.$major, got '${soname}'"; status=1
fi
rpath=$(readelf -d "$lib" | sed -n 's/.*(\(RUNPATH\|RPATH\)).*\[\(.*\)\]/\2/p')
if [ "$rpath" != '$ORIGIN' ]; then
  echo "FAIL RUNPATH: expected \$ORIGIN, got '${rpath}'"; status=1
fi
symbols=$(nm -D --defined-only "$lib" | awk '{print $NF}')
count=$(printf '%s\n' "$symbols" | grep -c . || true)
others=$(printf '%s\n' "$symbols" | grep -v '^moe_ep_' || true)
if [ -n "$others" ]; then
  echo "FAIL exported symbols other than moe_ep_*:"; printf '%s\n' "$others" | head -20; status=1
fi
for want in moe_ep_version moe_ep_worker_start moe_ep_dispatch moe_ep_combine moe_ep_forward \
            moe_ep_worker_wait_ready_for_steps moe_ep_dispatch_only \
            moe_ep_sync_token_counts_async moe_ep_check_step moe_ep_graph_token moe_ep_check_graph \
            moe_ep_worker_main; do
  printf '%s\n' "$symbols" | grep -qx "$want" || { echo "FAIL $want is not exported"; status=1; }
done
[ $status -eq 0 ] && echo "PASS $lib: SONAME $soname, RUNPATH $rpath, $count symbols, all moe_ep_*"
exit $status
