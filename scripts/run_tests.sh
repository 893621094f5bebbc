#!/usr/bin/env bash
# The test command (README): CPU tests everywhere; GPU tests too where CUDA is present.
#   bash scripts/run_tests.sh            # all tests
#   bash scripts/run_tests.sh -m gpu     # only the GPU tests (on a CUDA machine)
set -euo pipefail
cd "$(dirname "$0")/.."
# the test-only tools (pytest, sacrebleu, ...), if a fresh install lacks them; the torch already
# installed satisfies the package's own requirement, so pip resolves no other torch
python3 -c "import pytest, sacrebleu, pandas" 2>/dev/null \
  || python3 -m pip install -q --no-build-isolation ".[test]"
exec python3 -m pytest tests -q -p no:cacheprovider "$@"
