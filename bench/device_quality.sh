#!/usr/bin/env bash
# The real-text quality gate on the device, in the background across several device calls
# (a whole gate run outlasts one call's 10 minutes; the machine stays up between calls).
#   call 1: source .gpu/setup.sh && bash bench/device_quality.sh start SECONDS "QUALITY ARGS" ["QUALITY ARGS" ...] [-- PYTEST ARGS]
#   call 2+: source .gpu/setup.sh && bash bench/device_quality.sh wait SECONDS
# `start` builds the extension, runs the GPU tests given after `--` (alone), starts one
# bench/quality.py per argument string (side by side, one shared corpus, --json
# /tmp/quality/qN.json), then waits; `wait` waits. Both stop early once every bench has finished, and copy the benches' output
# and tables so far into $OUT. Name the commit in LS_BENCH_COMMIT (the device has no .git).
set -uo pipefail
OUT=${OUT:-out}; Q=/tmp/quality
mkdir -p "$OUT" "$Q"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tex} MAX_JOBS=16
cmd=$1; seconds=$2; shift 2
t0=$(date +%s)

collect() {
  cp "$Q"/q*.log "$OUT"/ 2>/dev/null
  local files; files=$(ls "$Q"/q*.json 2>/dev/null | paste -sd,)
  if [ -n "$files" ]; then
    python3 bench/quality.py --tables-from "$files" > "$OUT/tables.md" 2>/dev/null
    cp "$Q"/q*.json "$OUT"/
  fi
  grep -h "QUALITY_ROW" "$Q"/q*.log 2>/dev/null | wc -l | xargs echo "rows so far:"
}

if [ "$cmd" = start ]; then
  python3 -c "
import time
from ls_fairseq.ops import _extension
t = time.time(); ok = _extension.load()
print('extension', 'OK' if ok else 'FAILED: ' + _extension.failure_reason()[-3000:], f'{time.time()-t:.0f}s')
" 2>&1 | tail -3 | tee "$OUT/build.log"
  # the GPU tests first, alone: beside the benches they met a full GPU
  args=("$@"); tests=()
  for k in "${!args[@]}"; do
    if [ "${args[$k]}" = "--" ]; then tests=("${args[@]:$((k + 1))}"); set -- "${args[@]:0:$k}"; break; fi
  done
  if [ ${#tests[@]} -gt 0 ]; then
    python3 -m pytest "${tests[@]}" -q -p no:cacheprovider -s 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  fi
  i=0
  while [ $# -gt 0 ]; do
    i=$((i + 1))
    setsid nohup python3 bench/quality.py --workdir "$Q/work" --json "$Q/q$i.json" \
      --markdown "$Q/q$i.md" --commit "${LS_BENCH_COMMIT:-unknown}" $1 > "$Q/q$i.log" 2>&1 &
    echo "bench $i: $1"
    shift
    sleep 20  # the first one prepares the corpus; the others wait for it (its lock)
  done
fi
while [ $(( $(date +%s) - t0 )) -lt "$seconds" ]; do
  pgrep -f "bench/quality.py --workdir" > /dev/null || break
  sleep 10
done
collect
pgrep -f "bench/quality.py --workdir" > /dev/null && echo "benches still running" || echo "benches done"
for f in "$Q"/q*.log; do tail -n 3 "$f"; done
echo "call $(( $(date +%s) - t0 ))s"
