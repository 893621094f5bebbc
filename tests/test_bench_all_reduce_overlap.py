"""bench/all_reduce_overlap.py on a machine without the GPUs it asks for: one clear line, before
any process starts (its measurement itself needs 2 GPUs; figures in docs/PERFORMANCE.md)."""
import sys

import pytest
import torch

import all_reduce_overlap


def test_too_few_gpus_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(sys, "argv", ["all_reduce_overlap.py", "--gpus", "2"])
    with pytest.raises(SystemExit) as info:
        all_reduce_overlap.main()
    assert str(info.value) == "all_reduce_overlap: needs 2 GPUs, torch sees 1"
