#!/usr/bin/env bash
# Validates the Kubernetes manifests offline: renders every kustomization under
# deploy/k8s (kubectl kustomize, or kustomize build), then checks each rendered
# document against the Kubernetes API schemas, unknown fields, the
# hand-written LeaderWorkerSet schema, and the flags and environment variables it passes
# to moe-ep-worker / moe-ep against the binaries' help
# (deploy/validate/validate-manifests.mjs says what exactly).
#
# Usage: scripts/validate-deploy.sh [--k8s-dir DIR] [BUILD_DIR]
#   BUILD_DIR  holds server/moe-ep-worker and client/moe-ep (default: build)
#   DIR        the kustomize tree (default: deploy/k8s)
# Needs: node + the npm packages of deploy/validate (scripts/install-deploy-tools.sh),
# kubectl with kustomize v4 or later (or kustomize).
# Exit status: 0 valid, 1 a problem (one FAIL line each), 2 a missing tool.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
k8s_dir=$root/deploy/k8s
build_dir=$root/build
while [ $# -gt 0 ]; do
  case "$1" in
    --k8s-dir) k8s_dir=$(cd "$2" && pwd); shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) build_dir=$(cd "$1" && pwd); shift ;;
  esac
done
worker=$build_dir/server/moe-ep-worker
cli=$build_dir/client/moe-ep
for b in "$worker" "$cli"; do
  [ -x "$b" ] || { echo "validate-deploy: $b not built (cmake --build $build_dir --target moe-ep-worker moe-ep)" >&2; exit 2; }
done
if command -v kustomize >/dev/null; then
  render() { kustomize build "$1"; }
elif command -v kubectl >/dev/null; then
  render() { kubectl kustomize "$1"; }
else
  echo "validate-deploy: neither kustomize nor kubectl found" >&2; exit 2
fi
command -v node >/dev/null || { echo "validate-deploy: node not found (scripts/install-deps.sh)" >&2; exit 2; }
if [ ! -d "$root/deploy/validate/node_modules/kubernetes-models" ]; then
  echo "validate-deploy: npm packages missing: run scripts/install-deploy-tools.sh (scripts/check.sh does)" >&2; exit 2
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
rendered=()
while IFS= read -r k; do
  dir=$(dirname "$k")
  rel=${dir#"$k8s_dir"/}
  [ "$dir" = "$k8s_dir" ] && rel=.
  file=$out/$(echo "$rel" | tr '/' '_').yaml
  if ! render "$dir" > "$file" 2> "$out/render.err"; then
    echo "FAIL $rel: kustomize cannot render it:" && cat "$out/render.err"
    exit 1
  fi
  echo "rendered $rel ($(grep -c '^kind:' "$file") objects)"
  rendered+=("$file")
done < <(find "$k8s_dir" -name kustomization.yaml | sort)
[ ${#rendered[@]} -gt 0 ] || { echo "FAIL no kustomization.yaml under $k8s_dir"; exit 1; }

(cd "$out" && node "$root/deploy/validate/validate-manifests.mjs" \
  --worker "$worker" --cli "$cli" --proto-dir "$root/proto" --schemas "$root/deploy/schemas" \
  "${rendered[@]##*/}")
