#!/usr/bin/env bash
# The test command (README): CPU tests everywhere; GPU tests too where CUDA is present.
#   bash scripts/run_tests.sh            # all tests
#   bash scripts/run_tests.sh -m gpu     # only the GPU tests (on a CUDA machine)
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m pytest tests -q -p no:cacheprovider "$@"
