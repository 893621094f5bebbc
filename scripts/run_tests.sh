#!/usr/bin/env bash
# The test command (README): CPU tests everywhere; GPU tests too where CUDA is present.
#   bash scripts/run_tests.sh                          # the default selection (below)
#   bash scripts/run_tests.sh -m gpu                   # only the GPU tests, smoke grids (CUDA machine)
#   bash scripts/run_tests.sh -m "gpu or exhaustive"   # only the GPU tests, full grids
#   bash scripts/run_tests.sh -m csrc                  # only the nvcc compile check of csrc/
# Default selection (tests/conftest.py): without CUDA the GPU tests are deselected; with it they run
# on their smoke grids; the csrc compile check runs when csrc/ changed against the main branch.
# A line at the end says what was left out and how to run it; the 15 slowest tests are listed.
# Arguments go to pytest (e.g. -x, -k NAME, a file).
set -euo pipefail
cd "$(dirname "$0")/.."
# the test-only tools (pytest, sacrebleu, ...), if a fresh install lacks them; the torch already
# installed satisfies the package's own requirement, so pip resolves no other torch
python3 -c "import pytest, xdist, sacrebleu, pandas" 2>/dev/null \
  || python3 -m pip install -q --no-build-isolation ".[test]"
# Without CUDA, two pytest workers (pytest-xdist; a test file stays on one worker): most tests
# wait on one core for subprocesses or Python, so two workers halve the time on two cores. With
# CUDA one worker: the GPU tests share the one device. LS_TEST_WORKERS sets the count (1: none).
workers=${LS_TEST_WORKERS:-$(python3 -c "import torch; print(1 if torch.cuda.is_available() else 2)")}
parallel=()
if [ "$workers" -gt 1 ]; then parallel=(-n "$workers" --dist loadfile); fi
where=(tests)  # the whole suite, unless an argument names a test file or folder
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then where=(); break; fi
done
exec python3 -m pytest "${where[@]}" -q -p no:cacheprovider --durations=15 "${parallel[@]}" "$@"
