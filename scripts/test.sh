#!/usr/bin/env bash
# The project's test command: C++ tests (GoogleTest via ctest), then the Python tests (pytest).
# Extra arguments go to pytest (e.g. -m cuda on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cmake
ctest --test-dir build/cmake --output-on-failure
set +e
$PY -m pytest tests/python "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "pytest collected no tests: treating as failure" >&2
  exit 1
fi
exit $rc
