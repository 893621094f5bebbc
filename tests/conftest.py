"""Every test: the ``gpu`` marker (declared with ``slow`` in pytest.ini) skips a test where no
CUDA device is visible. The GPU tests' shared setup is tests/gpu/conftest.py."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on a GPU machine: scripts/run_tests.sh -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
