"""ls-fairseq-compare on fairseq training logs.

Two kinds of input:

* tests/data/logs/: samples written through fairseq 0.12's own logging code with made-up numbers
  (see make_samples.py there), so every metric has an exact expected value: simple and json
  formats, --log-file output (duplicated lines, no timestamps), an interrupted run, a run that
  crashed and was restarted from a checkpoint, plus eval outputs for the BLEU columns; and
  real_cpu/, logs of real fairseq-train runs kept as they came out;
* logs made here by running fairseq-train on a tiny corpus (CPU): simple + --log-file of the same
  run, and a json run interrupted and resumed from an older checkpoint.
"""
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys

import pytest

from ls_fairseq.cli import compare
from ls_fairseq.cli.compare import column as col

LOGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "logs")
# the samples' generator (a script in LOGS), loaded from its file
_spec = importlib.util.spec_from_file_location("make_samples",
                                               os.path.join(LOGS, "make_samples.py"))
samples = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(samples)

TOTAL_GB = samples.TOTAL_GB


def sample(*parts):
    return os.path.join(LOGS, *parts)


def expected_epoch_loss(epoch):
    """The end-of-epoch train loss of the samples: the mean of the epoch's interval losses."""
    ups = range((epoch - 1) * samples.EPOCH_UPDATES + samples.INTERVAL, epoch * samples.EPOCH_UPDATES + 1,
                samples.INTERVAL)
    vals = [samples.loss_at(u, 10.0) for u in ups]
    return round(sum(vals) / len(vals), 3)


# the samples alternate wpb between 26260 and 25740 from one logged interval to the next
WPB_HI, WPB_LO = 26260.0, 25740.0


# --------------------------------------------------------------------------------------------
# hand-specified samples: exact values
# --------------------------------------------------------------------------------------------

def test_simple_format_sample_metrics():
    run = compare.load_run(sample("baseline_simple"), "base")
    m = run.metrics
    assert run.missing == []
    assert m["updates"] == 1200 and m["epochs"] == 3
    # 12 intervals alternating wpb lo/hi; the first of each epoch (1, 5, 9: lo) is left out,
    # among them the warm-up one (ups 2)
    assert m["ups_interval"] == pytest.approx(4.0)
    assert m["wps_interval"] == pytest.approx((6 * 4.0 * WPB_HI + 3 * 4.0 * WPB_LO) / 9, abs=0.1)
    # the samples' end-of-epoch wps/ups are the means of the epoch's 4 intervals (lo, hi, lo, hi);
    # epoch 1's first interval runs at the warm-up ups
    spec = samples.SPEC["baseline"]
    assert m["epochs_complete"] == 3 and m["steady_epochs"] == "2–3" and m["last_complete_epoch"] == 3
    assert m["ups_epoch1"] == pytest.approx((spec["warm_ups"] + 3 * spec["ups"]) / 4)
    assert m["wps_epoch1"] == pytest.approx((spec["warm_ups"] * WPB_LO + spec["ups"] * (WPB_HI + WPB_LO + WPB_HI)) / 4)
    assert m["ups_steady"] == m["ups_last"] == pytest.approx(spec["ups"])
    assert m["wps_steady"] == m["wps_last"] == pytest.approx(spec["ups"] * (WPB_HI + WPB_LO) / 2)
    # epoch = 100 s of updates + 20 s validation + 10 s checkpoint, from fairseq's wall field;
    # epoch 1: 10 s start-up + 50 s warm-up interval + 3 * 25 s + 20 s + 10 s
    assert m["epoch_wall_s"] == pytest.approx(130.0) and m["epoch_wall_source"] == "wall field"
    assert m["epoch1_wall_s"] == pytest.approx(10 + 50 + 75 + 30)
    assert m["epoch_train_wall_s"] == pytest.approx(100.0)  # steady: epochs 2, 3 (epoch 1: 125, warm-up)
    # peak = total memory (CUDA banner) - lowest gb_free (79.109 - 43.6)
    assert m["peak_mem_gb"] == pytest.approx(TOTAL_GB - 43.6)
    assert m["train_loss"] == pytest.approx(expected_epoch_loss(3))
    assert m["valid_loss"] == pytest.approx(round(samples.loss_at(1200, 10.0) - 0.1, 3))
    assert m["valid_nll_loss"] == pytest.approx(round(samples.loss_at(1200, 10.0) - 0.5, 3), abs=1e-3)
    assert (m["bleu_sacrebleu"], m["bleu_compound_split"], m["bleu_generate"]) == (26.9, 27.61, 27.45)
    assert run.log.arch == "transformer_wmt_en_de_big_t2t"
    assert run.log.gpu_name == "NVIDIA H100 80GB HBM3" and run.log.world_size == 1
    assert len(run.inner) == 12 and len(run.valid) == 3 and len(run.epochs) == 3
    assert [r["epoch"] for r in run.epoch_rows] == [1, 2, 3] and all(r["complete"] for r in run.epoch_rows)


def test_json_format_sample_metrics():
    run = compare.load_run(sample("ls_json"), "ls")
    m = run.metrics
    assert run.missing == []
    assert run.log.log_format == "json"
    assert run.log.arch == "ls_transformer_wmt_en_de_big_t2t"
    assert m["ups_interval"] == pytest.approx(10.0)
    assert m["ups_steady"] == pytest.approx(10.0)
    assert m["ups_epoch1"] == pytest.approx((samples.SPEC["ls"]["warm_ups"] + 3 * 10.0) / 4, abs=0.01)
    assert m["epoch_wall_s"] == pytest.approx(62.0)  # 40 s updates + 12 s valid + 10 s save
    assert m["epoch_train_wall_s"] == pytest.approx(40.0)
    assert m["peak_mem_gb"] == pytest.approx(TOTAL_GB - 56.4)
    assert m["train_loss"] == pytest.approx(expected_epoch_loss(3))
    # json end-of-epoch lines prefix every key: 'train_wall' is the wall clock there, and
    # 'train_train_wall' the time spent in updates; the tool must not mix them up
    assert col(run.epochs, "train_wall") == [70.0, 40.0, 40.0]
    # wall at the end of epoch 1: 10 s start-up + 40 s warm-up interval + 3 * 10 s + 12 s + 10 s
    assert col(run.epochs, "wall")[0] == pytest.approx(102.0)
    assert m["epoch1_wall_s"] == pytest.approx(102.0)
    assert m["bleu_sacrebleu"] == 26.8


def test_table_ratios_against_first_run(capsys):
    rc = compare.main([sample("baseline_simple"), sample("ls_json"), "--labels", "base,ls", "--no-plots"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "| metric | base | ls | ls / base |" in text
    assert "| ups, steady (median) | 4.00 | 10.00 | 2.500x |" in text
    assert "| ups, epoch 1 (cold) | 3.50 | 8.12 | {:.3f}x |".format(8.12 / 3.5) in text
    assert "| ups (interval mean, all epochs) | 4.00 | 10.00 | 2.500x |" in text
    assert "| wall-clock per epoch, steady (median, s) | 130.0 | 62.0 | 0.477x |" in text
    assert "| peak GPU memory (GB) | 35.5 | 22.7 | 0.640x |" in text
    assert "| BLEU sacreBLEU (detok) | 26.90 | 26.80 | 0.996x (-0.100) |" in text
    assert "| BLEU tok + compound split | 27.61 | 27.53 | 0.997x (-0.080) |" in text
    assert "nothing: every metric was found for every run" in text


def test_log_file_format_duplicates_and_no_timestamps():
    """fairseq 0.12's --log-file: no timestamps, and epoch k repeats each progress line k times."""
    lf = compare.load_run(sample("logfile_simple"), "logfile")
    ref = compare.load_run(sample("baseline_simple"), "base")
    assert not lf.log.has_timestamps
    assert lf.log.duplicates_dropped == 6 * 1 + 6 * 2  # epoch 2 once, epoch 3 twice (4 inner+valid+train)
    for name in ("inner", "valid", "epochs"):
        a, b = getattr(lf, name), getattr(ref, name)
        assert col(a, "num_updates") == col(b, "num_updates")
        assert col(a, "loss") == col(b, "loss")
    for key in ("wps_interval", "wps_epoch1", "wps_steady", "ups_steady"):
        assert lf.metrics[key] == pytest.approx(ref.metrics[key])
    # without timestamps the clock is rebuilt from the intervals' ups: 100/2 + 11 * 100/4
    assert lf.time_source == "summed from ups"
    assert lf.metrics["wall_clock_s"] == pytest.approx(50 + 11 * 25)
    # no timestamps, but the end-of-epoch lines' wall field times the epochs all the same
    assert lf.metrics["epoch_wall_s"] == pytest.approx(130.0) and lf.metrics["epoch_wall_source"] == "wall field"
    assert lf.metrics["epoch_train_wall_s"] == pytest.approx(100.0)
    assert lf.metrics["peak_mem_gb"] is None and lf.metrics["min_gb_free"] == pytest.approx(43.6)
    assert any("GPU total memory" in m for m in lf.missing)


def test_interrupted_run():
    run = compare.load_run(sample("interrupted_simple.log"), "int")
    m = run.metrics
    assert m["updates"] == 700 and m["epochs"] == 2
    # no end-of-epoch line for epoch 2: the final train loss is the last logged interval's
    assert m["train_loss"] == pytest.approx(samples.loss_at(700, 10.0))
    assert m["valid_loss"] == pytest.approx(round(samples.loss_at(400, 10.0) - 0.1, 3))
    # epoch 2 has no end line: one complete epoch, the cold one, and no steady figure
    assert m["epochs_complete"] == 1 and m["wps_epoch1"] == m["wps_last"] is not None
    assert m["wps_steady"] is None and m["epoch_wall_s"] is None
    assert run.absent["wps_steady"] == "run has 1 complete epoch"
    assert any("no 'done training' line" in n for n in run.notes)
    assert sum("not found" in x for x in run.missing) == 3  # the three BLEU sources


def test_restart_after_crash_replaces_lost_updates():
    run = compare.load_run(sample("restart_json.log"), "restart")
    inner = run.inner
    assert [s.resumed_from for s in run.log.sessions] == [0, 500]
    assert col(inner, "num_updates") == list(range(100, 1201, 100))
    # 600 and 700 were logged by both sessions: the restarted session's records are kept
    redone = [r for r in inner if r["num_updates"] in (600, 700)]
    assert [r["session"] for r in redone] == [1, 1]
    assert redone[0]["wps"] == pytest.approx(2.5 * WPB_LO)  # warm-up interval of session 2
    assert col(run.valid, "num_updates") == [400, 500, 800, 1200]
    # the warm-up interval of each session is left out of wps/ups (and the first of each epoch)
    assert run.metrics["ups_interval"] == pytest.approx(10.0)
    steady = [r["wps"] for r in inner if r["num_updates"] not in (100, 500, 600, 900)]
    assert run.metrics["wps_interval"] == pytest.approx(sum(steady) / len(steady))
    # per epoch: epoch 2 was split by the restart at update 500 (its figures mix both sessions),
    # so the only steady epoch is 3, timed by the wall field of session 2 (158 - 96 s)
    assert [(r["epoch"], r["session"], r["cold"], r["split"]) for r in run.epoch_rows] == [
        (1, 0, True, False), (2, 1, True, True), (3, 1, False, False)]
    assert run.metrics["steady_epochs"] == "3"
    assert run.metrics["wps_steady"] == pytest.approx(260000) and run.metrics["epoch_wall_s"] == pytest.approx(62)
    assert run.epoch_rows[1]["wall_s"] is None
    assert any("epoch 2 spans the restart of session 2 (resumed at update 500)" in n for n in run.notes)
    assert any("resumed at update 500: 2 records" in n for n in run.notes)
    assert any("session 1 ended with an error: RuntimeError: CUDA error" in n for n in run.notes)
    # wall-clock: session 1 (start to crash) + session 2; the 10 minutes down in between do not count
    s1, s2 = run.log.sessions
    assert run.metrics["wall_clock_s"] == pytest.approx((s1.last_ts - s1.start_ts) + (s2.last_ts - s2.start_ts),
                                                        abs=1.0)
    assert col(inner, "elapsed") == sorted(col(inner, "elapsed"))


def test_says_what_it_could_not_find(tmp_path, capsys):
    empty = tmp_path / "no_log"
    (empty / "eval").mkdir(parents=True)
    (empty / "eval" / "sacrebleu.json").write_text("{not json")
    tqdm_like = tmp_path / "tqdm.log"
    # a tqdm-format run: only the end-of-epoch lines reach the log
    tqdm_like.write_text(
        "2026-01-01 10:00:00 | INFO | fairseq_cli.train | {'_name': None, 'common': {'log_format': 'tqdm'}}\n"
        "2026-01-01 10:05:00 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 5.1 | nll_loss 4.7 | "
        "ppl 26 | wps 400000 | wpb 3000 | bsz 98 | num_updates 400\n"
        "2026-01-01 10:05:10 | INFO | train | epoch 001 | loss 6 | nll_loss 5.6 | ppl 48.5 | wps 100000 | "
        "ups 3.9 | wpb 25000 | bsz 900 | num_updates 400 | lr 5e-05 | gnorm 1.2 | train_wall 100 | wall 310\n")
    rc = compare.main([sample("baseline_simple"), str(empty), str(tqdm_like), "--no-plots",
                       "--labels", "a,b,c"])
    text = capsys.readouterr().out
    assert rc == 1  # a run without any training record: most likely a wrong path
    assert "- b: training log: none found (looked for train.log" in text
    assert "- b: detokenised sacreBLEU (eval/sacrebleu.json): " in text and "unreadable" in text
    # through the API, a missing path is one more thing not found
    missing = compare.load_run(str(tmp_path / "nope"), "d")
    assert missing.missing == ["run path {} does not exist".format(tmp_path / "nope")]
    # the tqdm log still gives the epoch-level numbers
    tq = compare.load_run(str(tqdm_like), "c")
    assert tq.metrics["wps_epoch1"] == pytest.approx(100000) and tq.metrics["ups_epoch1"] == pytest.approx(3.9)
    assert tq.metrics["epoch1_wall_s"] == pytest.approx(310)  # its wall field
    assert tq.metrics["wps_interval"] is None
    assert tq.metrics["valid_loss"] == pytest.approx(5.1) and tq.metrics["train_loss"] == pytest.approx(6.0)
    assert "- c: peak memory: no gb_free in the training log" in text


def test_a_run_path_that_does_not_exist_is_the_error_alone(tmp_path, capsys):
    """The command: the error first and alone on stderr, exit status 2, no table, no plots, no
    JSON."""
    out, js = tmp_path / "plots", tmp_path / "m.json"
    with pytest.raises(SystemExit) as info:
        compare.main([sample("baseline_simple"), str(tmp_path / "nope"), "--out-dir", str(out),
                      "--json", str(js)])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "ls-fairseq-compare: error: run {} does not exist\n".format(tmp_path / "nope")
    assert not out.exists() and not js.exists()


def test_plots_and_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots"
    js = tmp_path / "m.json"
    rc = compare.main([sample("baseline_simple"), sample("ls_json"), sample("restart_json.log"),
                       "--out-dir", str(out), "--json", str(js)])
    text = capsys.readouterr().out
    assert rc == 0
    import matplotlib.image as mpimg
    import numpy as np

    for name in ("loss_vs_updates.png", "loss_vs_wallclock.png", "wps_over_time.png"):
        path = out / name
        assert str(path) in text
        img = mpimg.imread(str(path))
        assert img.shape[0] >= 400 and img.shape[1] >= 600
        # something was drawn: the three runs' colours are there, not just axes on white
        colours = {tuple(np.round(px[:3], 1)) for px in img.reshape(-1, img.shape[-1])[::7]}
        assert len(colours) > 10
    data = json.loads(js.read_text())
    assert list(data) == ["baseline_simple", "ls_json", "restart_json"]
    assert data["ls_json"]["metrics"]["ups_steady"] == pytest.approx(10.0)
    assert [e["wps"] for e in data["baseline_simple"]["epochs"]] == col(
        compare.load_run(sample("baseline_simple"), "b").epochs, "wps")
    assert data["baseline_simple"]["missing"] == []


# --------------------------------------------------------------------------------------------
# real logs kept in tests/data/logs/real_cpu
# --------------------------------------------------------------------------------------------

def test_real_cpu_logs():
    simple = compare.load_run(sample("real_cpu", "simple_train.log"), "simple")
    logfile = compare.load_run(sample("real_cpu", "logfile_train.fairseq.log"), "logfile")
    restart = compare.load_run(sample("real_cpu", "json_restart_train.log"), "restart")
    # the same run read from stdout and from --log-file
    for name in ("inner", "valid", "epochs"):
        assert col(getattr(simple, name), "num_updates") == col(getattr(logfile, name), "num_updates")
        assert col(getattr(simple, name), "loss") == col(getattr(logfile, name), "loss")
    assert simple.metrics["updates"] == 60 and simple.metrics["epochs"] == 3
    for key in ("wps_epoch1", "wps_steady", "epoch_wall_s", "epoch1_wall_s"):
        assert simple.metrics[key] == logfile.metrics[key] is not None
    assert [s.resumed_from for s in restart.log.sessions] == [0, 40]
    ups = col(restart.inner, "num_updates")
    assert ups == sorted(set(ups))
    assert restart.metrics["updates"] == 80
    # the restart resumed mid-epoch 2 (update 40); fairseq then logs wall 0 on every line, so the
    # epochs of session 2 are timed by the log timestamps; epoch 3 was cut short by --max-update
    e = restart.epoch_rows
    assert [(r["epoch"], r["session"], r["split"], r["complete"]) for r in e] == [
        (1, 0, False, True), (2, 1, True, True), (3, 1, False, False)]
    assert restart.metrics["wps_epoch1"] == col(restart.epochs, "wps")[0]
    assert restart.metrics["wps_steady"] is None  # 1: cold, 2: split, 3: cut short
    assert restart.absent["wps_steady"] == "no complete epoch after the first outside a restart's first epoch"
    assert e[2]["wall_source"] == "log timestamps" and e[2]["wall_s"] == e[2]["wall_s"] > 0
    for run in (simple, logfile, restart):
        assert any("no gb_free" in m for m in run.missing)  # CPU runs


def test_real_gpu_logs():
    """ls-fairseq-quickstart on an H100 (fp16, big t2t model, 400 updates): baseline and ls_."""
    base = compare.load_run(sample("real_gpu", "baseline_train.log"), "baseline")
    ls = compare.load_run(sample("real_gpu", "ls_train.log"), "ls")
    for run, arch in ((base, "transformer_wmt_en_de_big_t2t"), (ls, "ls_transformer_wmt_en_de_big_t2t")):
        m = run.metrics
        assert run.log.arch == arch and run.log.gpu_name == "NVIDIA H100 80GB HBM3"
        assert run.log.gpu_total_gb == pytest.approx(79.179)
        assert m["updates"] == 400 and m["epochs"] == 5
        assert m["peak_mem_gb"] == pytest.approx(79.179 - min(col(run.inner, "gb_free")))
        assert 1 < m["peak_mem_gb"] < 20
        # epoch 5 was cut short by --max-update: not a complete epoch; the steady epochs are 2-4
        assert [r["complete"] for r in run.epoch_rows] == [True] * 4 + [False]
        assert m["epochs_complete"] == 4 and m["last_complete_epoch"] == 4 and m["steady_epochs"] == "2–4"
        wps, ups, walls = col(run.epochs, "wps"), col(run.epochs, "ups"), col(run.epochs, "wall")
        assert (m["wps_epoch1"], m["ups_epoch1"]) == (wps[0], ups[0])
        assert (m["wps_last"], m["ups_last"]) == (wps[3], ups[3])
        assert m["wps_steady"] == sorted(wps[1:4])[1] and m["ups_steady"] == sorted(ups[1:4])[1]
        assert m["epoch1_wall_s"] == walls[0] and m["epoch_wall_source"] == "wall field"
        assert m["epoch_wall_s"] == sorted(b - a for a, b in zip(walls[:3], walls[1:4]))[1]
        assert m["epoch_train_wall_s"] == sorted(col(run.epochs, "train_wall")[1:4])[1]
        assert m["valid_loss"] < 2.0 and m["train_loss"] < 2.0  # the synthetic task is learnt
        # fp16 overflows at the start skip updates: 'i / n' counts batches, num_updates lags
        assert run.inner[0]["num_updates"] == 20
        assert not any("peak memory" in x or "per-epoch" in x or "wall-clock per epoch" in x for x in run.missing)
        assert "tflops_epoch1" not in run.absent  # not logged at all: a plain '—', no reason


# --------------------------------------------------------------------------------------------
# logs made now by fairseq-train
# --------------------------------------------------------------------------------------------

TINY = ["--arch", "transformer_wmt_en_de_big_t2t", "--share-all-embeddings", "--encoder-layers", "1",
        "--decoder-layers", "1", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
        "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2", "--optimizer", "adam", "--lr", "1e-3", "--lr-scheduler",
        "inverse_sqrt", "--warmup-updates", "10", "--criterion", "label_smoothed_cross_entropy",
        "--label-smoothing", "0.1", "--max-tokens", "400", "--cpu", "--seed", "1", "--log-interval", "4",
        "--num-workers", "0"]


def fairseq(tool):
    return [sys.executable, "-c", "import sys; from fairseq_cli.{} import cli_main; sys.argv[0] = 'x'; "
            "cli_main()".format(tool)]


def _env():
    env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", PYTHONWARNINGS="ignore")
    return env


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmpdata")
    rng = random.Random(0)
    words = ["w{}".format(i) for i in range(40)]
    for split, n in (("train", 240), ("valid", 24)):
        src = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(n)]
        (root / "{}.en".format(split)).write_text("".join(s + "\n" for s in src))
        (root / "{}.de".format(split)).write_text("".join(" ".join(reversed(s.split())) + "\n" for s in src))
    subprocess.run(fairseq("preprocess") + ["--source-lang", "en", "--target-lang", "de", "--trainpref",
                                            str(root / "train"), "--validpref", str(root / "valid"), "--destdir",
                                            str(root / "bin"), "--joined-dictionary", "--workers", "1"],
                   check=True, capture_output=True, env=_env())
    return str(root / "bin")


def train(data, save_dir, *extra, log_path):
    with open(log_path, "a") as f:
        proc = subprocess.run(fairseq("train") + [data, "--save-dir", save_dir] + TINY + list(extra),
                              stdout=f, stderr=subprocess.STDOUT, env=_env())
    if proc.returncode != 0 and not _aborted_after_training(proc.returncode, log_path):
        raise subprocess.CalledProcessError(proc.returncode, proc.args)


def _aborted_after_training(returncode, log_path):
    """Rarely (once in CI) plain fairseq-train on the CPU finishes ("done training",
    last checkpoint saved) and then aborts while the interpreter shuts down ("terminate called
    without an active exception": a C++ thread still alive at exit). The run itself is complete,
    and what these tests check is its log; any other failure still fails the test."""
    tail = open(log_path).read().splitlines()[-3:]
    return returncode == -signal.SIGABRT and any("done training" in l for l in tail) and \
        any("terminate called without an active exception" in l for l in tail)


@pytest.mark.slow
def test_fairseq_train_simple_and_log_file_agree(data_bin, tmp_path):
    run = tmp_path / "simple"
    run.mkdir()
    train(data_bin, str(run), "--max-update", "40", "--log-format", "simple", "--log-file",
          str(run / "train.fairseq.log"), log_path=run / "train.log")
    a = compare.load_run(str(run / "train.log"), "stdout")
    b = compare.load_run(str(run / "train.fairseq.log"), "logfile")
    assert a.log.has_timestamps and not b.log.has_timestamps
    assert b.log.duplicates_dropped > 0  # more than one epoch: fairseq repeated lines
    for name in ("inner", "valid", "epochs"):
        da, db = getattr(a, name), getattr(b, name)
        assert len(da) > 0
        for key in ("num_updates", "loss", "nll_loss"):
            assert col(da, key) == col(db, key)
    assert col(a.inner, "num_updates") == list(range(4, 41, 4))
    assert a.metrics["updates"] == 40
    assert a.metrics["epochs"] == len(a.valid)  # one validation per epoch
    assert a.metrics["train_loss"] < a.inner[0]["loss"]  # it learnt something
    assert a.log.sessions[-1].done


@pytest.mark.slow
def test_fairseq_train_json_interrupted_and_resumed(data_bin, tmp_path, capsys):
    run = tmp_path / "json"
    run.mkdir()
    common = ["--log-format", "json", "--save-interval-updates", "12", "--keep-interval-updates", "-1"]
    train(data_bin, str(run), "--max-update", "36", *common, log_path=run / "train.log")
    # pretend it died after update 36 and the newest checkpoint that survived is the one at 24
    ckpts = sorted(p for p in os.listdir(run) if p.startswith("checkpoint_") and p.endswith("_24.pt"))
    assert ckpts, os.listdir(run)
    shutil.copy(run / ckpts[0], run / "checkpoint_last.pt")
    train(data_bin, str(run), "--max-update", "48", *common, log_path=run / "train.log")
    r = compare.load_run(str(run), "json")
    assert r.log.log_format == "json"
    assert [s.resumed_from for s in r.log.sessions] == [0, 24]
    assert col(r.inner, "num_updates") == list(range(4, 49, 4))
    assert all(x["session"] == 1 for x in r.inner if x["num_updates"] > 24)
    assert any("resumed at update 24" in n for n in r.notes)
    assert r.metrics["updates"] == 48
    rc = compare.main([str(run), sample("baseline_simple"), "--no-plots"])
    assert rc == 0
    assert "| updates | 48 | 1200 |" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# the loss curve against the first run
# --------------------------------------------------------------------------------------------

def _write_inner_log(path, losses, gnorms=None, stats_at=None, seconds=None):
    """A json-format fairseq-train log of training intervals only: {num_updates: loss} (and
    {num_updates: gnorm as fairseq writes it} where given; {num_updates: {stat: value}} for more
    stats or others, e.g. epoch, wps, wpb; {num_updates: seconds after 10:00:00} for the
    timestamps, else one second per line)."""
    import datetime

    t0 = datetime.datetime(2026, 11, 25, 10, 0, 0)
    with open(path, "w") as f:
        for i, (u, loss) in enumerate(sorted(losses.items())):
            stats = {"epoch": 1, "update": round(u / 1000, 3), "loss": "{:.3f}".format(loss),
                     "num_updates": str(u), "wps": "1000", "ups": "1.0"}
            if gnorms is not None:
                stats["gnorm"] = gnorms.get(u, "0.8")
            stats.update((stats_at or {}).get(u, {}))
            ts = t0 + datetime.timedelta(seconds=(seconds or {}).get(u, i))
            f.write("{} | INFO | train_inner | {}\n".format(ts.strftime("%Y-%m-%d %H:%M:%S"),
                                                            json.dumps(stats)))


def test_loss_curve_rows(tmp_path, capsys):
    """A falling linear curve against the same curve 0.01 higher with one spike of +1 at update
    500: over the 71 intervals from update 300 on the differences are 0.01 seventy times and
    1.01 once, so mean 0.01 + 1/71 and s.d. sqrt(1/71); the spike is the second run's largest
    jump (1.0, its neighbours' median is the line), and the line has none (0)."""
    base = {u: 10 - 0.001 * u for u in range(10, 1010, 10)}
    other = {u: v + 0.01 + (1.0 if u == 500 else 0.0) for u, v in base.items()}
    _write_inner_log(tmp_path / "a.log", base)
    _write_inner_log(tmp_path / "b.log", other)
    runs, report, _ = compare.compare([str(tmp_path / "a.log"), str(tmp_path / "b.log")],
                                      plots=False)
    a, b = runs[0].metrics, runs[1].metrics
    assert a["loss_diff_mean"] is None and a["loss_jump"] == pytest.approx(0, abs=1e-9)
    assert b["loss_diff_intervals"] == 71
    assert b["loss_diff_mean"] == pytest.approx(0.01 + 1 / 71, abs=1e-9)
    assert b["loss_diff_sd"] == pytest.approx((1 / 71) ** 0.5, abs=1e-9)
    assert (b["loss_jump"], b["loss_jump_update"]) == (pytest.approx(1.0, abs=1e-9), 500)
    assert "| interval loss − first run's, mean | — | +0.0241 |" in report
    assert "| … at update |" in report and "| 500 |" in report

    # --curve-from past the spike: only the offset is left
    runs, _, _ = compare.compare([str(tmp_path / "a.log"), str(tmp_path / "b.log")],
                                 plots=False, curve_from=600)
    b = runs[1].metrics
    assert b["loss_diff_intervals"] == 41
    assert b["loss_diff_mean"] == pytest.approx(0.01, abs=1e-9)
    assert b["loss_diff_sd"] == pytest.approx(0, abs=1e-9)


def test_loss_curve_rows_leave_out_intervals_with_an_overflowing_update(tmp_path, capsys):
    """The same spike in an interval whose gnorm is "inf" (fairseq-train writes it so when
    --ls-deferred-overflow-check logs an update that overflowed; "nan" likewise): left out, so
    the remaining differences are all 0.01 and the largest jump is the gaps' (at 490 the median
    of its neighbours is the line at 495, 0.005 below); a finite gnorm, however large, keeps its
    interval."""
    base = {u: 10 - 0.001 * u for u in range(10, 1010, 10)}
    other = {u: v + 0.01 + (1.0 if u in (500, 700) else 0.0) for u, v in base.items()}
    _write_inner_log(tmp_path / "a.log", base, {})
    _write_inner_log(tmp_path / "b.log", other, {500: "inf", 700: "nan", 200: "inf"})
    _write_inner_log(tmp_path / "c.log", other, {500: "inf", 700: "31.565"})
    runs, report, _ = compare.compare([str(tmp_path / n) for n in ("a.log", "b.log", "c.log")],
                                      plots=False)
    a, b, c = (r.metrics for r in runs)
    assert a["loss_skipped_intervals"] == 0 and b["loss_skipped_intervals"] == 2  # 200 < 300
    assert b["loss_diff_intervals"] == 69
    assert b["loss_diff_mean"] == pytest.approx(0.01, abs=1e-9)
    assert b["loss_diff_sd"] == pytest.approx(0, abs=1e-9)
    assert (b["loss_jump"], b["loss_jump_update"]) == (pytest.approx(0.005, abs=1e-9), 490)
    assert c["loss_skipped_intervals"] == 1 and c["loss_diff_intervals"] == 70
    assert (c["loss_jump"], c["loss_jump_update"]) == (pytest.approx(1.0, abs=1e-9), 700)
    assert "| intervals left out (an overflowing update logged) | 0 | 2 | 1 |" in report


def test_loss_curve_needs_common_updates(tmp_path):
    _write_inner_log(tmp_path / "a.log", {u: 5.0 for u in range(10, 400, 20)})
    _write_inner_log(tmp_path / "b.log", {u: 5.0 for u in range(20, 400, 20)})  # other updates
    runs, _, _ = compare.compare([str(tmp_path / "a.log"), str(tmp_path / "b.log")], plots=False)
    assert runs[1].metrics["loss_diff_mean"] is None
    assert any("fewer than 2 intervals logged at the same update" in m for m in runs[1].missing)
    assert runs[0].metrics["loss_jump"] is None  # 5 intervals from update 300 on: none has 5 + 5


def test_curve_from_must_not_be_negative(capsys):
    with pytest.raises(SystemExit):
        compare.main([sample("baseline_simple"), "--curve-from", "-1"])
    assert "--curve-from must be >= 0" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# throughput from the log timestamps
# --------------------------------------------------------------------------------------------

# Two epochs of intervals logged every 10 updates: (num_updates, epoch, wpb, seconds of its log
# line). Each epoch's first interval (warm-up, or validation before it) has an absurd wpb and a
# long time: it must only be the starting point. An fp16 overflow in epoch 1 leaves 8 updates in
# its last interval (fairseq does not count a skipped update). Tokens: epoch 1
# 10 * (3000 + 5000 + 3000) + 8 * 5000 = 150000 in 70 - 30 = 40 s; epoch 2
# 10 * (3 * 4000 + 6000) = 180000 in 140 - 100 = 40 s: 330000 / 80 s = 4125 tokens/s exactly.
TIMED = [(10, 1, 99999, 30), (20, 1, 3000, 40), (30, 1, 5000, 50), (40, 1, 3000, 60), (48, 1, 5000, 70),
         (58, 2, 99999, 100), (68, 2, 4000, 110), (78, 2, 4000, 120), (88, 2, 4000, 130), (98, 2, 6000, 140)]


def _write_timed_log(path, intervals, wps, time_scale=1):
    """``intervals`` as in TIMED, the stamps' seconds times ``time_scale``; every interval logs
    ``wps`` as its own figure."""
    _write_inner_log(path, {u: 5.0 for u, _, _, _ in intervals},
                     stats_at={u: {"epoch": ep, "wpb": str(wpb), "wps": str(wps)} for u, ep, wpb, _ in intervals},
                     seconds={u: t * time_scale for u, _, _, t in intervals})


def test_wall_clock_wps_from_timestamps(tmp_path):
    """fairseq's interval wps reads high (here 5000) in a run without a per-update host sync; the
    wall-clock figure is the intervals' tokens over the time between their log lines."""
    _write_timed_log(tmp_path / "a.log", TIMED, wps=5000)
    run = compare.load_run(str(tmp_path / "a.log"), "a")
    assert run.metrics["wps_interval"] == pytest.approx(5000)  # fairseq's interval figure, unchanged
    assert run.metrics["wps_wall"] == 4125.0
    assert not any(m.startswith("wps_wall") for m in run.missing)
    # the first interval of each epoch is only the starting point: its tokens change nothing (nor
    # does its time, from 10:00:00 or across the gap after epoch 1: 4125 holds neither)
    other = [(u, ep, 1 if wpb == 99999 else wpb, t) for u, ep, wpb, t in TIMED]
    _write_timed_log(tmp_path / "b.log", other, wps=5000)
    assert compare.load_run(str(tmp_path / "b.log"), "b").metrics["wps_wall"] == 4125.0


def test_wall_clock_wps_needs_a_minute_of_timestamps(tmp_path):
    """1-s timestamps: under 60 s of timed intervals there is no figure, and missing says why."""
    # epoch 1 spans 30 -> 60 s and epoch 2 100 -> 125 s: 55 s in all
    short = [(10, 1, 3000, 30), (20, 1, 3000, 40), (30, 1, 3000, 60),
             (40, 2, 3000, 100), (50, 2, 3000, 110), (60, 2, 3000, 125)]
    _write_timed_log(tmp_path / "short.log", short, wps=5000)
    run = compare.load_run(str(tmp_path / "short.log"), "short")
    assert run.metrics["wps_wall"] is None and run.metrics["wps_interval"] == pytest.approx(5000)
    assert "wps_wall: the 4 timed training intervals span 55 s of log timestamps, under the 60 s that " \
           "their 1-s resolution needs" in run.missing
    # 5 s more, 60 s in all: enough; 4 * 10 * 3000 tokens
    _write_timed_log(tmp_path / "minute.log", short[:-1] + [(60, 2, 3000, 130)], wps=5000)
    assert compare.load_run(str(tmp_path / "minute.log"), "minute").metrics["wps_wall"] == 2000.0
    # --log-file logs have no timestamps
    lf = compare.load_run(sample("logfile_simple"), "logfile")
    assert lf.metrics["wps_wall"] is None
    assert "wps_wall: no log timestamps (a --log-file log has none)" in lf.missing


def test_wall_clock_wps_row(tmp_path):
    """The baseline syncs every update (its wps is right: 1375, TIMED stretched 3 times); the ls_
    run's interval wps reads 5000 where the stamps give 4125: the wall-clock row, right after the
    wps row, says 3x, not the 3.6x of the wps row."""
    _write_timed_log(tmp_path / "base.log", TIMED, wps=1375, time_scale=3)
    _write_timed_log(tmp_path / "ls.log", TIMED, wps=5000)
    runs, report, _ = compare.compare([str(tmp_path / "base.log"), str(tmp_path / "ls.log")], plots=False)
    lines = report.splitlines()
    wps = lines.index("| wps (interval mean, all epochs) | 1,375 | 5,000 | 3.636x |")
    assert lines[wps + 1] == "| wps (interval tokens / log-timestamp time, all epochs) | 1,375 | 4,125 | 3.000x |"
    assert "compare the log-timestamp row when a run uses --ls-deferred-overflow-check" in report
    # the samples: steady intervals of 100 updates at wpb 26260, 25740, 26260 per epoch, 25 s
    # (baseline) and 10 s (ls_) apart
    _, report, _ = compare.compare([sample("baseline_simple"), sample("ls_json")], ["base", "ls"], plots=False)
    assert "| wps (interval tokens / log-timestamp time, all epochs) | {:,.0f} | {:,.0f} | 2.500x |".format(
        100 * (2 * WPB_HI + WPB_LO) / 75, 100 * (2 * WPB_HI + WPB_LO) / 30) in report


# --------------------------------------------------------------------------------------------
# the base install: no pandas, no matplotlib, and the tool without torch or fairseq
# --------------------------------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL_GPU = [sample("real_gpu", "baseline_train.log"), sample("real_gpu", "ls_train.log")]


def _entry_point():
    """The module:function of the ls-fairseq-compare console script in setup.py."""
    import re

    with open(os.path.join(ROOT, "setup.py")) as f:
        return re.search(r'"ls-fairseq-compare=([\w.]+):(\w+)"', f.read()).groups()


def _run_blocked(tmp_path, blocked, *args, watch=("torch", "fairseq", "fairseq_cli", "pandas", "matplotlib")):
    """Run ls-fairseq-compare's entry point in a fresh interpreter where the ``blocked`` modules
    cannot be imported (``sys.modules[name] = None`` makes ``import name`` raise ImportError, as
    when it is not installed); the child prints, after the report, which modules of the
    ``watch`` packages got loaded."""
    module, func = _entry_point()
    code = (
        "import importlib, sys\n"
        "for name in {blocked!r}: sys.modules[name] = None\n"
        "main = getattr(importlib.import_module({module!r}), {func!r})\n"
        "rc = main(sys.argv[1:])\n"
        "loaded = sorted(m for m, v in sys.modules.items() if v is not None and m.split('.')[0] in {watch!r})\n"
        "print('LOADED:', loaded)\n"
        "import ls_fairseq; print('REGISTERED:', ls_fairseq.REGISTERED)\n"
        "sys.exit(rc)\n").format(blocked=list(blocked), watch=list(watch), module=module, func=func)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code] + list(args), cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)


def test_table_without_pandas_matplotlib_torch_fairseq(tmp_path):
    """As after `pip install --no-deps .` with nothing else: the table is printed, one line says
    the plots were skipped and how to get them, exit status 0, and nothing blocked was loaded."""
    out = tmp_path / "plots"
    proc = _run_blocked(tmp_path, ["pandas", "matplotlib", "torch", "fairseq", "fairseq_cli", "numpy"],
                        *REAL_GPU, "--labels", "base,ls", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert "| metric | base | ls | ls / base |" in text
    base, ls = (compare.load_run(p, n).metrics for p, n in zip(REAL_GPU, ("base", "ls")))
    assert "| wps, epoch 1 (cold) | {:,.0f} | {:,.0f} | {:.3f}x |".format(
        base["wps_epoch1"], ls["wps_epoch1"], ls["wps_epoch1"] / base["wps_epoch1"]) in text
    skipped = [line for line in (text + proc.stderr).splitlines() if "plots" in line.lower()]
    assert skipped == ['plots skipped: matplotlib is not installed (pip install "ls-fairseq[compare]" or '
                       'pip install matplotlib)']
    assert not out.exists()
    assert "LOADED: []" in text and "REGISTERED: False" in text


def test_compare_modules_import_neither_torch_nor_fairseq(tmp_path):
    """With fairseq installed but torch blocked, ls_fairseq registers nothing, so whatever fairseq
    module gets loaded was imported by the compare tool itself: none may be."""
    pytest.importorskip("fairseq")
    proc = _run_blocked(tmp_path, ["torch"], *REAL_GPU, "--no-plots", watch=("torch", "fairseq", "fairseq_cli"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| wps, steady (median over the steady epochs) |" in proc.stdout
    assert "LOADED: []" in proc.stdout and "REGISTERED: False" in proc.stdout
    # and the modules one by one
    code = ("import sys; sys.modules['torch'] = None\n"
            "import ls_fairseq.cli.compare, ls_fairseq.cli.compare.parse, ls_fairseq.cli.compare.metrics, "
            "ls_fairseq.cli.compare.curve, ls_fairseq.cli.compare.report, ls_fairseq.cli.compare.plots, "
            "ls_fairseq.cli.compare.command\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fairseq', 'fairseq_cli', 'torch', "
            "'pandas') and sys.modules[m] is not None))")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_compare_sources_import_no_heavy_module():
    """The compare package's modules import only the standard library and each other; matplotlib
    only inside plots.py's functions (so that importing it costs nothing)."""
    import ast

    pkg = os.path.dirname(compare.__file__)
    stdlib = set(sys.stdlib_module_names)
    for name in sorted(os.listdir(pkg)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(pkg, name)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                tops = [] if node.level else [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top == "matplotlib":
                    assert name == "plots.py" and node.col_offset > 0, (name, node.lineno)
                else:
                    assert top in stdlib, (name, node.lineno, top)


def test_python_dash_m(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "ls_fairseq.cli.compare", *REAL_GPU, "--no-plots"],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| last complete epoch | 4 | 4 |  |" in proc.stdout  # epoch 5 of both was cut short
