#!/usr/bin/env bash
# Generates the Python gRPC stubs of proto/moe_ep/v1/*.proto into OUT (default
# ./build/python): OUT/moe_ep/v1/{worker,tensor,rendezvous}_pb2.py and
# *_pb2_grpc.py, importable as `moe_ep.v1.worker_pb2` with OUT on PYTHONPATH.
# Uses protoc and grpc_python_plugin (Debian: protobuf-compiler,
# protobuf-compiler-grpc); the generated code needs python3-protobuf and
# python3-grpcio. Generated code is never committed. CMake runs this at build
# time (tests/python.cmake), and so does `pip install ./python` (python/setup.py).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PROTO_DIR="$HERE/../proto"
OUT="${1:-$HERE/../build/python}"
PLUGIN="${GRPC_PYTHON_PLUGIN:-$(command -v grpc_python_plugin || true)}"
command -v protoc >/dev/null || { echo "generate_stubs.sh: protoc not found (Debian: protobuf-compiler)" >&2; exit 1; }
[ -n "$PLUGIN" ] || { echo "generate_stubs.sh: grpc_python_plugin not found (Debian: protobuf-compiler-grpc)" >&2; exit 1; }
mkdir -p "$OUT"
protoc -I "$PROTO_DIR" --python_out="$OUT" --grpc_out="$OUT" \
  --plugin=protoc-gen-grpc="$PLUGIN" "$PROTO_DIR"/moe_ep/v1/*.proto
touch "$OUT/moe_ep/__init__.py" "$OUT/moe_ep/v1/__init__.py"
