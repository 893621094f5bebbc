#!/usr/bin/env bash
# quickstart.sh: install what ls-fairseq needs and run the quickstart, in one command.
#
#   bash scripts/quickstart.sh [ls-fairseq-quickstart options]
#
# 1. torch 2.13.0, only if this Python has no torch (an existing torch is kept: the CUDA kernels
#    are built against whatever torch is installed). With an NVIDIA GPU (nvidia-smi lists one):
#    PyPI's build, which brings its CUDA libraries (~3 GB). Without: the CPU build from
#    https://download.pytorch.org/whl/cpu (no CUDA libraries). TORCH_INDEX_URL=<url> picks the
#    index instead (TORCH_INDEX_URL= , empty: PyPI's build on any machine);
# 2. cython + numpy, then fairseq-fixed 0.12.3.1 (built without build isolation, so that its
#    Cython extensions compile against the numpy installed here);
# 3. this package with its comparison extras (pip install ".[compare]", for the plots);
# 4. ls-fairseq-quickstart (the installed package, whatever the current folder): generates a
#    small corpus, trains a fairseq baseline and the ls_ model for a few minutes each (GPU if there
#    is one, else a tiny model on CPU, where the ls_ run is no faster: it says why), decodes,
#    scores with sacreBLEU and prints the comparison table and the plot paths. Its work folder is
#    --workdir, by default ./ls_fairseq_quickstart, or ../ls_fairseq_quickstart beside this
#    checkout when started inside it.
#
# Options after the script name go to ls-fairseq-quickstart (--help lists them), e.g.
#   bash scripts/quickstart.sh --minutes 2 --workdir /tmp/qs
# PYTHON=/path/to/python selects the interpreter (default: python3; use a virtualenv's).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check "$@"; }

echo "== python: $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
TORCH=torch==2.13.0
if "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "== torch $("$PYTHON" -c 'import torch; print(torch.__version__)') already installed: kept"
else
    if [ -n "${TORCH_INDEX_URL+set}" ]; then
        index=$TORCH_INDEX_URL  # the user's choice; empty: PyPI
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        index=""  # a GPU: PyPI's build, with its CUDA libraries
    else
        index=https://download.pytorch.org/whl/cpu
        echo "== no NVIDIA GPU found (nvidia-smi): the CPU build of torch, without CUDA libraries" \
             "(TORCH_INDEX_URL= for PyPI's CUDA build)"
    fi
    echo "== installing $TORCH${index:+ from $index}"
    pip_install "$TORCH" ${index:+--index-url "$index"}
fi
echo "== installing cython, numpy, fairseq-fixed 0.12.3.1"
pip_install cython numpy
pip_install --no-build-isolation fairseq-fixed==0.12.3.1
echo "== installing ls-fairseq from $REPO"
pip_install "$REPO[compare]"

echo "== running ls-fairseq-quickstart $*"
# The installed package must run, not the source tree's: "python -m" would put the current folder
# (often this checkout) first on sys.path, so run it with that entry removed. Without --workdir
# the quickstart works beside the checkout, never inside it.
exec "$PYTHON" -c 'import os, sys
if sys.path and sys.path[0] in ("", os.getcwd()):
    sys.path.pop(0)
from ls_fairseq.cli.quickstart import main
sys.exit(main(sys.argv[1:]))' "$@"
