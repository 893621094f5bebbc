"""bench/host_slack.py's host-side logic (no GPU): the per-update summary of its timing records,
and its probe inside a real (tiny, CPU) fairseq-train: one record per update, the added sleep
inside each timed step, the data loader and log reads timed."""
import os
import sys

import pytest

import e2e  # bench/ (pytest.ini's pythonpath)
import host_slack


def _records(n, period, step, data, log, start=100.0):
    # (start, end, data wait, log reads) of each update; the waits happen before the update
    return [(start + i * period, start + i * period + step, data, log) for i in range(n)]


def test_summary_splits_the_period_of_the_second_half():
    first = _records(20, 0.050, 0.045, 0.0, 0.0)  # slower first half: left out
    second = _records(21, 0.025, 0.019, 0.001, 0.002, start=200.0)
    s = host_slack.summarize(first + second)
    assert s["updates"] == 20  # records 20..40 (the second list), each timed to the next
    assert s["period"] == pytest.approx(25.0)
    assert s["train_step"] == pytest.approx(19.0)
    assert s["data_wait"] == pytest.approx(1.0)
    assert s["log_reads"] == pytest.approx(2.0)
    assert s["other"] == pytest.approx(3.0)


def test_summary_needs_enough_updates():
    assert host_slack.summarize(_records(20, 0.025, 0.02, 0.0, 0.0)) is None
    assert host_slack.summarize(_records(22, 0.025, 0.02, 0.0, 0.0)) is not None


def test_markdown_marks_runs_without_records():
    s = host_slack.summarize(_records(40, 0.025, 0.02, 0.0, 0.0))
    table = host_slack.markdown([(0.0, s, 262000.0), (4.0, None, None)]).splitlines()
    assert table[2] == "| 0 | 19 | 25.00 | 20.00 | 0.00 | 0.00 | 5.00 | 262,000 |"
    assert table[3] == "| 4 | – | – | – | – | – | – | – |"


def test_probe_times_every_update_of_a_real_fairseq_train(tmp_path):
    e2e.make_corpus(str(tmp_path), 120, 300)
    data = e2e.preprocess(str(tmp_path), 1)
    cmd = [sys.executable, "-c", host_slack.PROBE + e2e.WRAPPER, data, "--arch",
           "transformer_iwslt_de_en", "--encoder-layers", "1", "--decoder-layers", "1",
           "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
           "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
           "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
           "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "300", "--max-epoch", "2",
           "--cpu", "--no-save", "--disable-validation", "--log-format", "json",
           "--log-interval", "2", "--num-workers", "0",
           "--criterion", "label_smoothed_cross_entropy"]
    env = dict(os.environ, HOST_SLACK_SLEEP_MS="5")
    proc = e2e.subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    records = host_slack.parse_records(log)
    inner, epochs, _, _ = e2e.parse_log(log)
    assert len(records) == int(epochs[2]["num_updates"])  # one per update
    assert all(end - start >= 0.005 for start, end, _, _ in records)  # the sleep is timed
    assert [r[0] for r in records] == sorted(r[0] for r in records)
    assert sum(r[2] for r in records) > 0  # the data loader's waits are timed
    assert sum(r[3] for r in records) > 0  # and the log reads (every --log-interval updates)


def test_records_are_read_per_rank():
    """Each rank prints its records at exit; on one GPU the only rank is 0."""
    log = ("noise\nHOST_SLACK_RECORDS rank=1 [(1.0, 2.0, 0.0, 0.0)]\n"
           "HOST_SLACK_RECORDS rank=0 [(3.0, 4.0, 0.5, 0.0)]\nmore noise\n")
    assert host_slack.parse_all_records(log) == {0: [(3.0, 4.0, 0.5, 0.0)],
                                                 1: [(1.0, 2.0, 0.0, 0.0)]}
    assert host_slack.parse_records(log) == [(3.0, 4.0, 0.5, 0.0)]
    assert host_slack.parse_records("no records") == []


def test_markdown_takes_a_label_per_rank():
    s = host_slack.summarize(_records(40, 0.025, 0.02, 0.0, 0.0))
    assert host_slack.markdown([("2 (rank 3)", s, None)]).splitlines()[2].startswith(
        "| 2 (rank 3) | 19 |")


def test_every_rank_runs_the_probe_through_the_sitecustomize():
    """bench/multi_gpu.py's sitecustomize (on every rank's PYTHONPATH) installs the probe when
    HOST_SLACK_SLEEP_MS is set, and only then."""
    import multi_gpu

    code = "from fairseq import trainer; print(trainer.Trainer.train_step.__name__)"
    for sleep, expected in (("0", "_probed_train_step"), (None, "train_step")):
        env = dict(os.environ, BENCH_HERE=os.path.dirname(e2e.__file__),
                   PYTHONPATH=multi_gpu._sitecustomize_dir())
        env.pop("HOST_SLACK_SLEEP_MS", None)
        if sleep is not None:
            env["HOST_SLACK_SLEEP_MS"] = sleep
        proc = e2e.subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split()[-1] == expected
