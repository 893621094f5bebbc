"""The GPU tests' shared setup (every file in tests/gpu/).

* Every test collected here carries the ``gpu`` marker, so tests/conftest.py deselects it where no
  CUDA device is visible, also in a file that forgets its ``pytestmark = pytest.mark.gpu`` (the
  files keep theirs: ``-m gpu`` and a file run alone read it).
* Smoke grid and full grid: of a parametrized test's cases, the smoke grid is a pairwise covering
  of its grid: every pair of values of two parameters that occurs in the full grid occurs in at
  least one smoke case (most kernel bugs hang on one value, e.g. a length past a tile, or on two,
  e.g. that length in bfloat16). The cases are picked greedily in collection order (the case that
  covers the most uncovered pairs first), so the smoke grid is the same on every run and machine;
  it shrinks the 400-750-case grids to about a tenth. Every other case carries the ``exhaustive``
  marker, which tests/conftest.py deselects unless ``-m`` names it:

      bash scripts/run_tests.sh -m gpu                     # GPU tests, smoke grids
      bash scripts/run_tests.sh -m "gpu or exhaustive"     # GPU tests, full grids
      bash scripts/run_tests.sh -m exhaustive              # only the cases beyond the smoke grids

  A case named by its full node id (``file.py::test[id]``) runs whatever its marker.
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
import collections
import itertools
import pathlib

import pytest
import torch

HERE = pathlib.Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before tests/conftest.py's hook reads the markers
def pytest_collection_modifyitems(config, items):
    grids = collections.defaultdict(list)  # one test function's cases
    for item in items:
        if item.path.resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.gpu)
            if getattr(item, "callspec", None) is not None:
                grids[(item.path, item.cls, item.originalname)].append(item)
    for cases in grids.values():
        smoke = set(map(id, smoke_grid(cases)))
        for item in cases:
            if id(item) not in smoke:
                item.add_marker(pytest.mark.exhaustive)


def _value_pairs(item):
    """The (parameter, value) pairs of one case, two by two (one alone for a one-parameter
    grid). Values are told apart by repr (the grids' values: numbers, dtypes, strings, tuples)."""
    values = sorted((name, repr(value)) for name, value in item.callspec.params.items())
    if len(values) == 1:
        return {tuple(values)}
    return set(itertools.combinations(values, 2))


def smoke_grid(cases):
    """The smoke cases of one test function's ``cases`` (see the module doc): greedy pairwise
    covering, ties to the case collected first."""
    pairs = [_value_pairs(item) for item in cases]
    uncovered = set().union(*pairs)
    chosen = []
    while uncovered:
        best = max(range(len(cases)), key=lambda i: len(pairs[i] & uncovered))
        chosen.append(cases[best])
        uncovered -= pairs[best]
    return chosen


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
