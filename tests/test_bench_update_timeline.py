"""bench/benchlib/update_timeline.py's split of each update after its backward, on synthetic GPU timelines
(µs) whose every figure is known by construction, written as profile_summary.write_timeline
writes them."""
import gzip
import json

import pytest

from benchlib import update_timeline  # bench/ (pytest.ini's pythonpath)

MAIN, SIDE, NCCL_STREAM = 7, 31, 23


def _update(t0, idle_after_optimizer, wait, first=False):
    """One update from t0 on the main stream: HtoD, forward+backward kernels to t0 + 20000, a
    pause of ``wait`` (the all-reduce tail on the side streams), clip kernels for 300 µs, the
    optimizer for 2000 µs; the next update starts ``idle_after_optimizer`` later."""
    rows = [[t0, 0.0, MAIN, 0, f"bench_update_{0 if first else int(t0)}"],
            [t0, 4.0, MAIN, 64, "Memcpy HtoD "],
            [t0 + 10.0, 9990.0, MAIN, 0, "nvjet_sm90_hsh_gemm"],   # forward
            [t0 + 10000.0, 10000.0, MAIN, 0, "lsf::ln_bwd_rows_kernel"],  # backward
            # the side streams: pushes during the backward, the last bucket's tail after it
            [t0 + 15000.0, 500.0, SIDE, 1 << 20, "Memcpy PtoP "],
            [t0 + 20000.0, wait - 200.0, NCCL_STREAM, 0, "ncclDevKernel_AllReduce_Sum_f32"],
            [t0 + 20000.0 + wait - 200.0, 200.0, SIDE, 1 << 20, "Memcpy PtoP "]]
    t = t0 + 20000.0 + wait
    rows += [[t, 100.0, MAIN, 0, "at::native::reduce_kernel"],
             [t, 300.0, MAIN, 0, "clip-grads"],                    # an annotation, not a kernel
             [t + 100.0, 200.0, MAIN, 0, "at::native::vectorized_elementwise_kernel"],
             [t + 300.0, 2000.0, MAIN, 0, "ls_fairseq_adam::multi_tensor_adam_kernel"]]
    return rows, t + 2300.0 + idle_after_optimizer


def _timeline(tmp_path, name, waits, idles):
    rows, t = [], 0.0
    for k, (wait, idle) in enumerate(zip(waits, idles)):
        more, t = _update(t, idle, wait, first=k == 0)
        rows += more
    # the next update's mark, its batch copy and its first kernel 50 µs later
    rows += [[t, 0.0, MAIN, 0, "bench_update_99"], [t, 4.0, MAIN, 64, "Memcpy HtoD "],
             [t + 50.0, 100.0, MAIN, 0, "nvjet_sm90_hsh_gemm"]]
    for k, r in enumerate(rows):
        if r[4].startswith("bench_update_"):
            r[4] = f"bench_update_{k}"  # unique names, in time order
    path = tmp_path / name
    with gzip.open(path, "wt") as f:
        json.dump({"columns": ["start_us", "dur_us", "stream", "bytes", "name"],
                   "rows": sorted(rows)}, f)
    return str(path)


def test_each_update_splits_at_its_known_points(tmp_path):
    path = _timeline(tmp_path, "profile_ls_pytorch_ddp_4gpu_1.json.timeline.json.gz",
                     waits=[1500.0, 800.0], idles=[3000.0, 0.0])
    first, second = update_timeline.updates(update_timeline.load(path))
    assert first == pytest.approx({
        "update": 0, "period_ms": 26.8, "backward_end_ms": 20.0, "wait_after_backward_ms": 1.5,
        "clip_and_norm_ms": 0.3, "optimizer_ms": 2.0,
        # 3000 µs before the next update's HtoD, then 10 µs to its first kernel, minus the 4 µs
        # copy
        "boundary_idle_ms": 3.006, "side_copies_ms": 0.7, "side_nccl_ms": 1.3})
    assert second["wait_after_backward_ms"] == pytest.approx(0.8)
    assert second["boundary_idle_ms"] == pytest.approx(0.046)  # the last mark's 50 µs, less 4
    assert second["period_ms"] == pytest.approx(20.0 + 0.8 + 2.3 + 0.0)


def test_summary_groups_ranks_by_variant_and_takes_medians(tmp_path):
    paths = [_timeline(tmp_path, f"profile_ls_pytorch_ddp_4gpu_{r}.json.timeline.json.gz",
                       waits=[1000.0 + 100 * r, 1000.0], idles=[0.0, 0.0]) for r in range(3)]
    summary = update_timeline.summarize(paths)
    assert set(summary["variants"]) == {"ls_pytorch_ddp, 4 GPUs"}
    both = summary["variants"]["ls_pytorch_ddp, 4 GPUs"]
    assert both["updates"] == 6
    # waits 1.0, 1.1, 1.2 and three of 1.0: median 1.0
    assert both["median"]["wait_after_backward_ms"] == pytest.approx(1.0)
    assert summary["files"][paths[2].split("/")[-1]]["rank"] == 2
    text = update_timeline.markdown(summary)
    assert "| ls_pytorch_ddp, 4 GPUs | 6 |" in text
    assert "| ls_pytorch_ddp, 4 GPUs, rank 2 | 2 |" in text


def test_updates_without_an_optimizer_kernel_are_left_out(tmp_path):
    path = _timeline(tmp_path, "t.timeline.json.gz", waits=[1000.0], idles=[0.0])
    assert update_timeline.updates(update_timeline.load(path), optimizer_kernel="sgd") == []
    assert len(update_timeline.updates(update_timeline.load(path))) == 1


def test_bad_optimizer_regex_is_refused(tmp_path, capsys):
    path = _timeline(tmp_path, "t.timeline.json.gz", waits=[1000.0], idles=[0.0])
    with pytest.raises(SystemExit):
        update_timeline.main([path, "--optimizer-kernel", "("])
    assert "--optimizer-kernel: not a regex" in capsys.readouterr().err
