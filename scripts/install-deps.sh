#!/usr/bin/env bash
# Installs the Debian 12 packages moe-ep builds and tests with. One list, used by
# the README, .ci/run and deploy/Dockerfile. CUDA is optional and not installed here.
set -euo pipefail
PACKAGES=(
  build-essential cmake pkg-config git ca-certificates
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libgtest-dev libgmock-dev libbenchmark-dev
  libgloo-dev nlohmann-json3-dev prometheus-cpp-dev libopenblas-dev libcli11-dev
  clang-format
)
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}"
