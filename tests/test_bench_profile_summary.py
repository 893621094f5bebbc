"""The profiler probe's (bench/benchlib/probes/profile_summary.py) split of an update's GPU period, and bench/multi_gpu.py's per-rank
table built on it: synthetic kernel spans (µs) with known unions."""
import pytest

import multi_gpu  # bench/ (pytest.ini's pythonpath)
from benchlib import update_timeline
from benchlib.probes import profile_summary


def test_an_update_splits_into_compute_nccl_copies_and_idle():
    kernels = [
        (0.0, 400.0, "sm90_xmma_gemm_f16f16"),             # compute
        (300.0, 500.0, "Memcpy PtoP (Device -> Device)"),  # a push, beside compute
        (500.0, 600.0, "ncclDevKernel_AllReduce_Sum_f32"),  # the barrier (waiting included)
        (700.0, 800.0, "ls_shard_reduce_kernel"),           # compute
        # update 2 starts at 1000
        (1000.0, 1500.0, "sm90_xmma_gemm_f16f16"),
    ]
    out = profile_summary.per_update(kernels, {0: 0.0, 1: 1000.0}, wall_us=1600.0)
    first, second = out["per_update"]
    # compute: [0, 400) and [700, 800); copies [300, 500); NCCL [500, 600); idle [600, 700) and
    # [800, 1000)
    assert first == pytest.approx({"ms": 1.0, "compute_ms": 0.5, "nccl_ms": 0.1,
                                   "copy_ms": 0.2, "idle_ms": 0.3})
    # the window closes at first kernel + wall: [1000, 1600), 500 µs of it busy
    assert second == pytest.approx({"ms": 0.6, "compute_ms": 0.5, "nccl_ms": 0.0,
                                    "copy_ms": 0.0, "idle_ms": 0.1})
    assert set(out["median_ms_per_update"]) == {"ms", "compute_ms", "nccl_ms", "copy_ms",
                                                "idle_ms"}


def test_ranks_table_prints_copies_and_the_cost_of_unequal_batches():
    def rank(compute):
        return {"per_update": [{"ms": 10.0, "compute_ms": c, "nccl_ms": 1.0, "copy_ms": 0.5,
                                "idle_ms": 0.2} for c in compute]}
    text = multi_gpu.ranks_table("ls, 2 GPUs", [rank([8.0, 9.0]), rank([9.0, 7.0])])
    assert "| 0 | 8.0 / 1.0 / 0.5 / 0.2 | 9.0 / 1.0 / 0.5 / 0.2 | 10.0 |" in text
    # max - mean: 0.5 and 1.0
    assert "max - mean compute per update 0.75 ms on average over 2 updates" in text


def test_timeline_file_is_what_update_timeline_reads(tmp_path):
    """write_timeline's columns are update_timeline.load's (a CPU profile has no GPU rows)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(3).add_(1)
    path = str(tmp_path / "p.json.timeline.json.gz")
    profile_summary.write_timeline(prof, path)
    assert update_timeline.load(path) == []
    assert update_timeline.updates([]) == []
