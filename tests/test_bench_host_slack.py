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
