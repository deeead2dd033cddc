#!/usr/bin/env bash
# The GPU tests file by file inside a time budget, for calls shorter than the whole GPU suite.
#   bash benchmarks/cuda_files.sh SECONDS [test file ...]   (default: every file with GPU tests)
# Each file's log goes to $OUT/cuda_<file>.log; one line per file is printed, and the files left for
# lack of time are named last ("not run: ..."), so a later call can pass exactly those.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
budget=${1:?seconds}; shift
files=("$@")
[ ${#files[@]} -eq 0 ] && files=($(grep -l "mark.cuda" tests/python/test_*.py))
t0=$(date +%s); left=()
for f in "${files[@]}"; do
  rem=$(( budget - ($(date +%s) - t0) ))
  if [ $rem -lt 20 ]; then left+=("$f"); continue; fi
  name=$(basename "$f" .py)
  s=$(date +%s)
  timeout $rem python3 -m pytest -q -m cuda "$f" -p no:cacheprovider -rfE > "$OUT/cuda_$name.log" 2>&1
  rc=$?
  printf '%-40s rc=%-3s %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - s ))" "$(tail -n 1 "$OUT/cuda_$name.log" | cut -c1-110)"
  [ $rc -eq 124 ] && left+=("$f(cut)")
done
[ ${#left[@]} -gt 0 ] && echo "not run: ${left[*]}"
exit 0
