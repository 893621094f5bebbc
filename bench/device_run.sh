#!/usr/bin/env bash
# One device call: build the extension, run GPU tests, run the end-to-end benchmark.
#   device: source .gpu/setup.sh && LS_BENCH_COMMIT=<commit> bash bench/device_run.sh "<pytest args or 'none'>" <e2e args...>
# (the device has no .git: name the commit being measured in LS_BENCH_COMMIT)
# Logs land in $OUT (the device tool's result folder) or ./out.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export LS_FAIRSEQ_KERNELS=require TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tex} MAX_JOBS=16
TESTS=$1; shift
t0=$(date +%s)
python3 - <<'PY' 2>&1 | tail -5 | tee "$OUT/build.log"
import time, torch
from ls_fairseq.ops import _extension
t = time.time(); ok = _extension.load()
print("extension", "OK" if ok else "FAILED: " + _extension.failure_reason()[-3000:], f"{time.time()-t:.0f}s")
PY
if [ "$TESTS" != "none" ]; then
  python3 -m pytest $TESTS -q -p no:cacheprovider -x 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
fi
echo "build+tests $(( $(date +%s) - t0 ))s"
if [ $# -gt 0 ]; then
  # the whole output in $OUT as it comes (each finished run prints its JSON row): a call cut
  # off by its time limit still returns the runs it finished
  python3 bench/e2e.py --markdown "$OUT/e2e.md" --json "$OUT/e2e.json" --log-dir /tmp/e2e_logs "$@" 2>&1 \
    | tee "$OUT/e2e_stdout.log" | tail -30
  tar czf "$OUT/e2e_logs.tgz" -C /tmp e2e_logs 2>/dev/null
fi
echo "total $(( $(date +%s) - t0 ))s"
