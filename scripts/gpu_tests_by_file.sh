#!/usr/bin/env bash
# The GPU tests one file per pytest process, under a deadline (a device call's time limit):
#   source .gpu/setup.sh && bash scripts/gpu_tests_by_file.sh [SECONDS] [FILE ...]
# Why not one pytest: a CUDA error or an abort poisons the whole process, and a failure's report
# is lost with it; here a file that crashes or hangs costs only itself, and every file's log
# comes back. SECONDS: the whole run's budget (default 540); each file gets what is left, at most
# LS_TEST_FILE_LIMIT (default 300). FILES: default every tests/gpu/test_*_cuda.py. pytest's
# selection: LS_PYTEST_ARGS (default "-m gpu", the smoke grids).
# Writes $OUT/gpu_tests/summary.txt (one line per file: seconds and pytest's last line, TIMEOUT,
# CRASHED or "not run: deadline") and $OUT/gpu_tests.tgz (every file's log); exits 1 unless every
# file passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
logs="$OUT/gpu_tests"
mkdir -p "$logs"
budget=${1:-540}
[ $# -gt 0 ] && shift
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/gpu/test_*_cuda.py)
limit=${LS_TEST_FILE_LIMIT:-300}
t0=$(date +%s)
status=0
summary="$logs/summary.txt"
: > "$summary"
for f in "${files[@]}"; do
  name=$(basename "$f" .py)
  left=$(( budget - ($(date +%s) - t0) ))
  if [ "$left" -lt 20 ]; then
    echo "$name: not run: deadline" | tee -a "$summary"; status=1; continue
  fi
  start=$(date +%s)
  # shellcheck disable=SC2086  # LS_PYTEST_ARGS is a list of arguments
  timeout "$(( left < limit ? left : limit ))" python3 -m pytest "$f" ${LS_PYTEST_ARGS:--m gpu} \
    -q -p no:cacheprovider -rfE --durations=5 > "$logs/$name.log" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  case $rc in
    0|5) result=$(grep -E "[0-9]+ (passed|skipped|deselected)|no tests ran" "$logs/$name.log" | tail -1) ;;
    124) result="TIMEOUT ($(grep -o '[.sFE]' "$logs/$name.log" | tr -d '\n' | head -c 80) so far)"; status=1 ;;
    1) result=$(grep -E "[0-9]+ (failed|passed|error)" "$logs/$name.log" | tail -1); status=1 ;;
    *) result="CRASHED rc $rc: $(grep -m1 -E "what\(\)|Fatal Python error|Error" "$logs/$name.log")"; status=1 ;;
  esac
  echo "$name: ${took}s: $result" | tee -a "$summary"
done
tar czf "$OUT/gpu_tests.tgz" -C "$OUT" gpu_tests
echo "every file's log: $OUT/gpu_tests.tgz; $(( $(date +%s) - t0 ))s in all"
exit $status
