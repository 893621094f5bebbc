import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device and the ls_fairseq CUDA extension (skipped otherwise)"
    )
    config.addinivalue_line("markers", "slow: end-to-end runs of fairseq-train/generate")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on a GPU machine: scripts/run_tests.sh -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
