"""The GPU tests' shared setup (every file in tests/gpu/).

* Every test collected here carries the ``gpu`` marker, so tests/conftest.py skips it where no CUDA
  device is visible, also in a file that forgets its ``pytestmark = pytest.mark.gpu`` (the files
  keep theirs: ``-m gpu`` and a file run alone read it).
* Fixtures:

  - ``extension``: the loaded CUDA extension (``ls_fairseq.ops._extension``), once per session.
    Skips without a CUDA device; fails (not skips) when the extension does not build, because on
    a GPU machine that is a bug. A kernel test module asks for its ops in its own fixture::

        @pytest.fixture(scope="module", autouse=True)
        def _kernels(extension):
            assert extension.has_op("layer_norm_fwd")

  - ``kernels_required``: ``LS_FAIRSEQ_KERNELS=require`` for one test (an ls_ model or criterion
    that falls back to PyTorch ops fails instead). Add ``pytestmark = pytest.mark.usefixtures(
    "kernels_required")`` or an autouse fixture that requests it.
  - ``dictionary``: a 203-symbol fairseq dictionary (the model and CUDA graphs tests' vocabulary).

A module's own fixture of the same name takes precedence over these.

Importable helpers: tests/ and bench/ are on sys.path (pytest.ini's ``pythonpath``), and so is this
folder (pytest's default import mode), so ``from fairseq_helpers import ...``,
``from test_end_to_end import ...`` and ``from kernel_oracle import ...`` work here; the helpers
themselves live in ``ls_fairseq.testing``.
"""
import pathlib

import pytest
import torch

HERE = pathlib.Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before tests/conftest.py's hook reads the marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def extension():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from ls_fairseq.ops import _extension

    assert _extension.load(), f"CUDA extension failed to build: {_extension.failure_reason()}"
    return _extension


@pytest.fixture
def kernels_required(monkeypatch):
    monkeypatch.setenv("LS_FAIRSEQ_KERNELS", "require")


@pytest.fixture(scope="module")
def dictionary():
    from ls_fairseq.testing.fairseq_helpers import make_dictionary

    return make_dictionary(203)
