"""The test run's selection and its shared fixtures (markers: pytest.ini).

Selection, after collection (tests/gpu/conftest.py marks its tests ``gpu`` and its grids'
cases beyond the smoke grid ``exhaustive`` first):

* ``gpu``: on a machine without CUDA the GPU tests are deselected, and one line at the end says
  how many and how to run them; named in ``-m`` (``-m gpu``) they are collected and skipped with
  the reason instead, so asking for them on the wrong machine does not pass silently.
* ``exhaustive``: the GPU grids' cases beyond the smoke grid; deselected unless ``-m`` names the
  marker (``-m "gpu or exhaustive"``: every GPU case).
* ``csrc``: the nvcc compile check of csrc/; runs when ``-m`` names the marker or csrc/ changed
  (the rule and why: tests/test_csrc_compiles.py), announced before it starts.

A case named by its full node id (``tests/x.py::test[id]``) is never deselected here.

Shared fixtures (session scope: built once per test run, whatever file asks first):

* ``data_bin``: the tiny reversal corpus of the end-to-end tests, binarised
  (``test_end_to_end.make_tiny_data``).
* ``trained``: one ls_ model trained on it with fairseq-train (``test_end_to_end.TRAINED``): its
  checkpoint and the run's log, for the tests that decode, convert or compare it. A test that
  writes next to the checkpoint copies it first.
"""
import os
import re

import pytest
import torch

# The processes the tests start (fairseq-train/generate on tiny models, ...) run on one thread
# unless told otherwise: a model of width 32 gains nothing from a second one, and a 2-core machine
# that also runs other work loses a lot to OpenMP threads spinning against each other (60 updates
# of the shared trained model: 26 s on one thread, 194 s on two, at a load of 7). Set after torch
# is imported, so this process keeps its own thread count.
os.environ.setdefault("OMP_NUM_THREADS", "1")

if not torch.cuda.is_available():  # tests/fork_cli.py: commands and gloo workers start preloaded
    import fork_cli

    fork_cli.configure()

GPU_HINT = 'bash scripts/run_tests.sh -m gpu (smoke grids) or -m "gpu or exhaustive" (full grids)'


def _named(config, marker):
    return re.search(rf"\b{marker}\b", config.option.markexpr or "") is not None


def _named_by_id(config, item):
    """Whether a command-line argument names this very case (path::test[id])."""
    return any("::" in str(arg) and item.nodeid.endswith(str(arg).split("::", 1)[1])
               and "[" in str(arg) for arg in config.args)


def pytest_collection_modifyitems(config, items):
    no_cuda = not torch.cuda.is_available()
    gone = {"gpu": [], "exhaustive": [], "csrc": []}
    csrc_decision = None
    kept = []
    for item in items:
        by_id = _named_by_id(config, item)
        if "gpu" in item.keywords and no_cuda:
            if not (by_id or _named(config, "gpu") or _named(config, "exhaustive")):
                gone["gpu"].append(item)
                continue
            item.add_marker(pytest.mark.skip(reason="needs CUDA (run on a GPU machine: "
                                             "bash scripts/run_tests.sh -m gpu)"))
        if by_id:
            kept.append(item)
            continue
        if "exhaustive" in item.keywords and not _named(config, "exhaustive"):
            gone["exhaustive"].append(item)
            continue
        if "csrc" in item.keywords:
            if csrc_decision is None:  # the module's own rule (its docstring says why)
                csrc_decision = item.module.csrc_check_decision(asked=_named(config, "csrc"))
            if not csrc_decision[0]:
                gone["csrc"].append(item)
                continue
        kept.append(item)
    deselected = [item for group in gone.values() for item in group]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
    config.stash[_SUMMARY] = _summary(gone, csrc_decision)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if csrc_decision is not None and csrc_decision[0] and reporter is not None:
        # before minutes of nvcc: say what runs and why
        reporter.write_line(f"csrc compile check selected: {csrc_decision[1]}")


_SUMMARY = pytest.StashKey[list]()


def _summary(gone, csrc_decision):
    lines = []
    if gone["gpu"]:
        lines.append(f"{len(gone['gpu'])} GPU tests deselected (no CUDA device here); on a GPU "
                     f"machine: {GPU_HINT}")
    if gone["exhaustive"]:
        lines.append(f"{len(gone['exhaustive'])} GPU grid cases beyond the smoke grids "
                     f"deselected; all of them: bash scripts/run_tests.sh -m \"gpu or exhaustive\"")
    if gone["csrc"]:
        lines.append(f"csrc compile check ({len(gone['csrc'])} tests) deselected: "
                     f"{csrc_decision[1]}; bash scripts/run_tests.sh -m csrc runs it")
    elif csrc_decision is not None and csrc_decision[0]:
        lines.append(f"csrc compile check selected: {csrc_decision[1]}")
    return lines


def pytest_terminal_summary(terminalreporter, config):
    for line in config.stash.get(_SUMMARY, []):
        terminalreporter.write_line(line)


def pytest_sessionfinish(session):
    # under pytest-xdist (scripts/run_tests.sh) the workers collect and select; each hands its
    # summary lines to the controller, which prints them once
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["ls_summary"] = session.config.stash.get(_SUMMARY, [])


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's controller
def pytest_testnodedown(node, error):
    lines = getattr(node, "workeroutput", {}).get("ls_summary")
    if lines:
        node.config.stash[_SUMMARY] = lines


@pytest.fixture(scope="session")
def data_bin(tmp_path_factory):
    from test_end_to_end import make_tiny_data

    return make_tiny_data(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def trained(data_bin, tmp_path_factory):
    from test_end_to_end import train_trained

    return train_trained(data_bin, tmp_path_factory.mktemp("trained"))
