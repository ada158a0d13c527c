#!/usr/bin/env bash
# Installs the Debian 12 packages moe-ep builds and tests with. One list, used by
# scripts/setup.sh (so scripts/main-job.sh and scripts/check.sh), .ci/run and
# deploy/Dockerfile. CUDA is optional and not installed here. Idempotent: when
# every package is already installed it says so and touches nothing (no
# apt-get, no sudo), so it is fast to call again.
set -euo pipefail
PACKAGES=(
  build-essential cmake pkg-config git ca-certificates
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libgtest-dev libgmock-dev libbenchmark-dev
  libgloo-dev nlohmann-json3-dev prometheus-cpp-dev libopenblas-dev libcli11-dev
  clang-format
  # The linker (CMakeLists.txt MOE_EP_USE_LLD): ~4x faster links than ld.bfd.
  lld
  # The build tool scripts/setup.sh configures with: it starts a target's
  # objects while its dependencies still link (make waits per target).
  ninja-build
  openssl python3-grpcio python3-protobuf python3-matplotlib
  # python/ installs into a venv offline: python3 -m venv (ensurepip's wheels)
  # and pip install --no-build-isolation (setuptools + wheel from the system).
  python3-venv python3-setuptools python3-wheel
  # The embedded worker's Python tests (tests/embedded.cmake): NumPy experts.
  python3-numpy
)
# scripts/validate-deploy.sh (ctest -L deploy) also needs node + npm (its npm
# packages: scripts/install-deploy-tools.sh) and kubectl with kustomize v4 or
# later. The machine image brings both (NodeSource node 20, kubectl 1.32 with
# kustomize v5). Debian's nodejs + npm are added only where node is missing:
# Debian's npm conflicts with a NodeSource nodejs. Debian 12's kubectl
# (kubernetes-client 1.20) embeds kustomize v2, too old for deploy/k8s.
if ! command -v npm >/dev/null 2>&1; then PACKAGES+=(nodejs npm); fi
# scripts/lint.sh tidies the .cu files with clang-tidy 19 (14 cannot parse
# CUDA 13's headers) where the build compiles CUDA, i.e. where nvcc exists.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  PACKAGES+=(clang-tidy-19)
fi
missing=()
for p in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [ "$status" = installed ] || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} Debian packages are installed"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
