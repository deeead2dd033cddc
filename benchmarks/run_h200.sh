#!/usr/bin/env bash
# One call on the H200 machine: build, C++ tests (AVX-512 there), GPU tests, then the named
# benchmark stages. Logs go to $OUT (or ./out); a short table is printed last.
#   bash benchmarks/run_h200.sh [stage ...]     stages: build ctest cuda cpu adam memory train bench
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MEGATRAIN_SKIP_HOST_MEMORY_CHECK=${MEGATRAIN_SKIP_HOST_MEMORY_CHECK:-1}
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(build ctest cuda adam memory)
summary=()
run() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-8s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-150)")")
  return $rc
}
for s in "${stages[@]}"; do
  case $s in
    build)
      run build bash -c 'python3 -m pip install -q --no-deps --no-build-isolation -e . && python3 -c "import megatrain, megatrain._C as C; print(C.build_info())"' || break ;;
    ctest)
      run ctest bash -c 'mkdir -p /tmp/gt && for f in .carry/*.deb; do dpkg -x $f /tmp/gt; done;
        cmake -S . -B build/cmake -G Ninja -DGTest_DIR=/tmp/gt/usr/lib/x86_64-linux-gnu/cmake/GTest \
          -DCMAKE_CXX_FLAGS=-I/tmp/gt/usr/include >/dev/null && cmake --build build/cmake >/dev/null &&
        ctest --test-dir build/cmake 2>&1 | tail -n 5' ;;
    cuda)
      run cuda timeout ${CUDA_TIMEOUT:-270} python3 -m pytest -q -x -s -m cuda tests/python -p no:cacheprovider ;;
    cpu)
      run cpu python3 -m pytest -q -x tests/python -p no:cacheprovider ;;
    adam)
      run adam timeout 120 python3 benchmarks/bench_cpu_adam.py --steps 3 --out docs/benchmarks --tag h200 ;;
    memory)
      run memory timeout ${MEM_TIMEOUT:-150} python3 benchmarks/bench_memory.py --out docs/benchmarks/memory_depth.json ;;
    train)
      run train timeout ${TRAIN_TIMEOUT:-400} python3 -m megatrain train --config examples/configs/h200_1b.yaml --out /tmp/run1b --no-progress
      cp /tmp/run1b/summary.json "$OUT/train_summary.json" 2>/dev/null; cp /tmp/run1b/metrics.jsonl "$OUT/train_metrics.jsonl" 2>/dev/null ;;
    bench)
      run bench python3 benchmarks/bench_train.py --out docs/benchmarks/train_3b.json ;;
  esac
done
for f in $(git status --porcelain --untracked-files=all docs/benchmarks | awk '{print $2}'); do cp "$f" "$OUT/" 2>/dev/null; done
echo "==== summary"; printf '%s\n' "${summary[@]}"
