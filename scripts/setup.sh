#!/usr/bin/env bash
# Installs megatrain and what it needs on a bare Debian machine (or one that already has torch).
# Idempotent: anything already present is left as it is. Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"

need_apt=()
for pkg in g++ cmake ninja-build libgtest-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# torch: keep an installed one (e.g. a CUDA build); otherwise the CPU build 2.13.0.
if ! $PY -c "import torch" >/dev/null 2>&1; then
  $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q setuptools wheel pybind11 ninja pytest
$PY -m pip install -q --no-build-isolation -e ".[test]"
$PY -m megatrain.info
