"""bench/e2e.py's host-side logic (no GPU): the loss-curve table (``fidelity_markdown``: each run
against the first baseline of its --max-tokens, with ``ls-fairseq-compare``'s statistics, whose
definitions tests/test_compare.py checks on closed-form curves; here, that e2e applies them per
batch size and to the right reference, also after a JSON round trip, whose keys are strings), what
counts as a run that does not fit, the steady-state intervals timed by the probes' stamps, a run's
row from the log of a real (tiny, CPU) fairseq-train with the probes on (the shared
``probed_run``), the largest-batch bisection and the results file."""
import json
import os

import pytest

import e2e  # bench/ (pytest.ini's pythonpath)
from benchlib import corpora, env, logs, results
from test_bench_base import probed_run, tiny_corpus  # noqa: F401  (shared fixtures)


def _row(variant, max_tokens, curve, overflows=0, skipped=()):
    return {"variant": variant, "max_tokens": max_tokens, "fp16_overflows": overflows,
            "loss_by_update": curve, "skipped_update_intervals": list(skipped)}


def test_fidelity_table_against_each_batch_sizes_baseline():
    # eighths: exact in binary, so a straight line has jumps of exactly 0 (the first interval
    # with 5 neighbours on each side, update 350, is then the largest)
    line = {u: (10000 - u) / 8 for u in range(10, 1010, 10)}
    spiked = {u: v + 0.125 + (1.0 if u == 500 else 0.0) for u, v in line.items()}
    shifted = {u: v - 0.25 for u, v in line.items()}
    rows = [_row("baseline_nocudnn", 8192, line, 4), _row("ls_deferred", 8192, spiked, 5),
            _row("ls_deferred", 16384, line), _row("baseline_nocudnn", 16384, shifted),
            _row("ls", 8192, line) | {"error": "OOM"}]
    rows = json.loads(json.dumps(rows))  # as read back from --json
    table = e2e.fidelity_markdown(rows).splitlines()
    assert table[0] == "Loss curves, intervals from update 300 on (as `ls-fairseq-compare`):"
    body = [r for r in table if r.startswith("| 8192") or r.startswith("| 16384")]
    assert body == [
        "| 8192 | baseline_nocudnn | – | – | – | +0.000 (350) | 4 | 0 |",
        # 0.125 seventy times, 1.125 once: mean 0.125 + 1/71, s.d. sqrt(1/71)
        "| 8192 | ls_deferred | 71 | +0.1391 | 0.1187 | +1.000 (500) | 5 | 0 |",
        # the 16384 baseline is logged second: the ls_ run still compares against it
        "| 16384 | ls_deferred | 71 | +0.2500 | 0.0000 | +0.000 (350) | 0 | 0 |",
        "| 16384 | baseline_nocudnn | – | – | – | +0.000 (350) | 0 | 0 |",
    ]


def test_fidelity_table_leaves_out_intervals_with_a_skipped_update():
    # the spike's interval logged a non-finite gnorm (an overflowing update, logged only with
    # --ls-deferred-overflow-check), and so did one before update 300: the spike is left out,
    # 70 intervals of +0.125 remain, and one interval from update 300 on is counted as left out.
    # The largest jump is now the gap's: at 490 the neighbours' median is the line at 495 (its
    # 5th and 6th neighbours are 480 and 510), 5/8 below it
    line = {u: (10000 - u) / 8 for u in range(10, 1010, 10)}
    spiked = {u: v + 0.125 + (1.0 if u == 500 else 0.0) for u, v in line.items()}
    rows = json.loads(json.dumps([_row("baseline_nocudnn", 8192, line),
                                  _row("ls_deferred", 8192, spiked, 2, skipped=(200, 500))]))
    body = [r for r in e2e.fidelity_markdown(rows).splitlines() if r.startswith("| 8192")]
    assert body[1] == "| 8192 | ls_deferred | 70 | +0.1250 | 0.0000 | +0.625 (490) | 2 | 1 |"


def test_a_run_with_batches_skipped_for_memory_does_not_count():
    # fairseq-train's own words when it skips a batch (trainer.train_step, one GPU): exit code 0
    oom_log = ("2026-11-25 | WARNING | fairseq.trainer | OOM: Ran out of memory with exception: "
               "CUDA out of memory.\n2026-11-25 | WARNING | fairseq.trainer | attempting to "
               "recover from OOM in forward/backward pass\n") * 3
    assert e2e.run_failure(0, oom_log) == "OOM (3 batches skipped)"
    assert e2e.run_failure(1, "RuntimeError: CUDA out of memory. Tried to allocate") == "OOM"
    assert e2e.run_failure(1, "x" * 2000 + "Traceback") == ("x" * 2000 + "Traceback")[-1500:]
    assert e2e.run_failure(0, "| train | {\"loss\": \"10.4\"}") is None


def test_steady_intervals_are_timed_from_stamp_to_stamp():
    """Two epochs of three logged intervals; fairseq's own interval figures (wps) leave out a
    wait at each log, the stamps (one per interval, at its end) do not: the steady figure is the
    epoch's tokens after its first interval over the time between their stamps."""
    inner = []
    for k, (epoch, updates, wpb, wps) in enumerate([
            (1, 10, 100.0, 1000.0), (1, 20, 100.0, 1000.0), (1, 25, 120.0, 1000.0),
            (2, 35, 100.0, 900.0), (2, 45, 100.0, 2000.0), (2, 50, 80.0, 2000.0)]):
        inner.append({"epoch": float(epoch), "num_updates": float(updates), "wpb": wpb,
                      "wps": wps})
    ends = [1.0, 2.0, 2.5, 9.0, 10.25, 11.0]
    # epoch 2 without its first interval: 10 updates x 100 + 5 x 80 tokens in 1.25 + 0.75 s
    assert e2e.interval_wps(inner, 2, ends) == (1000 + 400) / 2.0
    # epoch 1: 10 x 100 + 5 x 120 tokens in 1.0 + 0.5 s
    assert e2e.interval_wps(inner, 1, ends) == (1000 + 600) / 1.5
    # no stamps, or not one per interval: fairseq's figures, time-weighted
    fairseq_2 = (100 + 80) / (100 / 2000 + 80 / 2000)
    assert e2e.interval_wps(inner, 2) == fairseq_2
    assert e2e.interval_wps(inner, 2, ends[:-1]) == fairseq_2


def test_the_probes_stamp_every_logged_interval_of_a_real_fairseq_train(probed_run):
    """The stamps come from patching fairseq's ``metrics.reset_meters`` as it is imported (the
    probes' sitecustomize): a real fairseq-train must print exactly one per logged interval, or
    the steady figure silently falls back to fairseq's own interval meters."""
    run = logs.parse(probed_run)
    ends = logs.interval_ends(probed_run)
    assert sorted(run.epochs) == [1, 2, 3] and len(run.inner) >= 6
    assert len(ends) == len(run.inner) and ends == sorted(ends)
    assert e2e.interval_wps(run.inner, 3, ends) > 0


def test_a_runs_row_from_its_log(probed_run):
    """row_of_log on the real log: fairseq's epoch figures, the timed steady intervals, the loss
    curve; no memory figures on the CPU (fairseq never resets a CUDA peak counter there)."""
    row = e2e.row_of_log(probed_run, "baseline_nocudnn", 300, 800.0)
    run = logs.parse(probed_run)
    assert row["wps_by_epoch"] == [run.epochs[e]["wps"] for e in (1, 2, 3)]
    assert row["wps_unseen"] == run.epochs[1]["wps"] and row["wps_steady"] == run.epochs[3]["wps"]
    assert row["updates_through_epoch"] == [int(run.epochs[e]["num_updates"]) for e in (1, 2, 3)]
    assert row["intervals_timed"] and row["wps_steady_intervals"] > 0
    assert list(row["loss_by_update"].items()) == [(u, loss) for u, loss in logs.losses(run)]
    assert row["loss_first"] > row["loss_last"]
    assert row["peak_gb"] is row["reserved_gb"] is row["device_gb"] is None
    assert row["fp16_overflows"] == 0 and row["skipped_update_intervals"] == []


def test_memory_figures_come_from_the_sampler_and_fairseqs_gb_free():
    log = ('2026-11-26 10:00:00 | INFO | train_inner | {"epoch": 1, "loss": "9.0", "wps": "10", '
           '"wpb": "5", "num_updates": "10", "gb_free": "70.5"}\n'
           '2026-11-26 10:00:01 | INFO | train | {"epoch": 1, "train_loss": "9.0", '
           '"train_wps": "10", "train_ups": "2", "train_wpb": "5", "train_num_updates": "10"}\n'
           f"BENCH_MEMORY rank=0 total={80 * 2**30} reserved_max={12 * 2**30} "
           f"used_max={13 * 2**30}\n")
    row = e2e.row_of_log(log, "ls", 8192, 800.0)
    assert row["peak_gb"] == pytest.approx(9.5)  # total - min(gb_free): peak allocated
    assert row["reserved_gb"] == 12.0 and row["device_gb"] == 13.0


def test_largest_that_fits_bisects_over_full_runs():
    """Against a hidden limit: the bisection returns the largest multiple of the step that fits
    and the smallest that does not, probing each size at most once and only O(log) of them."""
    for limit in (32768, 40960, 57344, 65536, 163840, 10, 10**9):
        probed = []

        def fits(n):
            assert n not in probed
            probed.append(n)
            return n <= limit

        good, bad = e2e.largest_that_fits(fits, 32768, 163840, 8192)
        if limit < 32768:
            assert (good, bad) == (None, 32768)
        elif limit >= 163840:
            assert (good, bad) == (163840, None)
        else:
            assert good == limit // 8192 * 8192 and bad == good + 8192
        assert len(probed) <= 2 + 4  # 16 steps between LOW and HIGH: 4 halvings
    with pytest.raises(ValueError):
        e2e.largest_that_fits(lambda n: True, 32768, 163840, 10000)


def test_largest_table():
    text = e2e.largest_markdown({"baseline_nocudnn": (57344, 65536), "ls_deferred": (131072, None)})
    assert "| baseline_nocudnn | 57344 | 65536 |" in text
    assert "| ls_deferred | 131072 | – |" in text


def test_largest_mode_runs_the_bisection_per_variant_and_stops_on_other_failures(
        tmp_path, monkeypatch):
    """main() with --largest: each variant bisected on its own limit, every probe a row of the
    tables, the summary table and JSON name the sizes; a failure that is not memory stops it."""
    limits = {"baseline_nocudnn": 57344, "ls_deferred": 131072}
    monkeypatch.setattr(corpora, "write_learnable_wmt", lambda *a, **k: 28.0)
    monkeypatch.setattr(corpora, "preprocess", lambda *a, **k: str(tmp_path))
    monkeypatch.setattr(env, "gemm_tflops", lambda: None)
    monkeypatch.setattr(env, "gpu_names", lambda: ["NVIDIA H100 80GB HBM3"])
    monkeypatch.setenv("LS_BENCH_COMMIT", "abc1234")

    def fake_run(data, variant, max_tokens, args, log_dir, profile_at=None, extra=()):
        if max_tokens > limits[variant]:
            return {"variant": variant, "max_tokens": max_tokens, "error": "OOM (3 batches skipped)"}
        return {"variant": variant, "max_tokens": max_tokens, "wps_unseen": 1.0}

    monkeypatch.setattr(e2e, "run_variant", fake_run)
    out_md, out_json = tmp_path / "e2e.md", tmp_path / "e2e.json"
    argv = ["--workdir", str(tmp_path), "--log-dir", str(tmp_path / "logs"), "--largest", "32768",
            "163840", "8192", "--variants", "baseline_nocudnn,ls_deferred",
            "--markdown", str(out_md), "--json", str(out_json)]
    e2e.main(argv)
    text = out_md.read_text()
    assert "| baseline_nocudnn | 57344 | 65536 |" in text
    assert "| ls_deferred | 131072 | 139264 |" in text
    saved = results.load(str(out_json))
    assert saved["script"] == "bench/e2e.py" and saved["commit"] == "abc1234"
    assert saved["command"] == "python bench/e2e.py " + " ".join(argv)
    assert saved["device"] == "NVIDIA H100 80GB HBM3" and saved["torch"] == env.torch_version()
    assert saved["largest"] == {"baseline_nocudnn": [57344, 65536], "ls_deferred": [131072, 139264]}
    tried = [(r["variant"], r["max_tokens"]) for r in saved["rows"]]
    assert ("ls_deferred", 163840) in tried and ("baseline_nocudnn", 65536) in tried

    limits["ls_deferred"] = None  # any size: a crash, not memory
    monkeypatch.setattr(e2e, "run_variant", lambda data, variant, mt, *a, **k: (
        {"variant": variant, "max_tokens": mt, "error": "Traceback: KeyError"}
        if variant == "ls_deferred" else {"variant": variant, "max_tokens": mt}))
    with pytest.raises(SystemExit, match="another reason than memory"):
        e2e.main(argv)


def test_attention_ab_variants_set_the_backend(monkeypatch, tmp_path):
    """ls_deferred_short / ls_deferred_efficient run ls_deferred's flags with one attention
    backend forced through the environment of the fairseq-train they start."""
    seen = {}

    class Done:
        returncode, stdout, stderr = 1, "", "stopped by the test"

    def fake_subprocess_run(cmd, env, **kwargs):
        seen[env.get("LS_FAIRSEQ_ATTENTION")] = cmd
        return Done()

    monkeypatch.setattr(e2e.subprocess, "run", fake_subprocess_run)
    monkeypatch.delenv("LS_FAIRSEQ_ATTENTION", raising=False)
    args = type("Args", (), {"epochs": 1, "seed": 1, "extra": [], "peak_tflops": 800.0})()
    for variant in ("ls_deferred", "ls_deferred_short", "ls_deferred_efficient"):
        row = e2e.run_variant(str(tmp_path), variant, 4096, args, str(tmp_path))
        assert "stopped by the test" in row["error"]
    assert set(seen) == {None, "short", "efficient"}
    assert seen["short"] == seen["efficient"] == seen[None]  # the same fairseq-train command
    assert seen[None][:3] == env.fairseq_cmd("train")


def test_variants_the_probes_and_unknown_names(monkeypatch):
    """Every run carries the memory sampler and the stamps (the sitecustomize on its path);
    cuDNN attention is off for baseline_nocudnn only; an unknown variant is a one-line error."""
    monkeypatch.delenv("LS_FAIRSEQ_KERNELS", raising=False)
    base, nocudnn, ls = (e2e.train_env(v) for v in ("baseline", "baseline_nocudnn", "ls"))
    for e in (base, nocudnn, ls):
        assert e["BENCH_MEMORY"] == e["BENCH_STAMPS"] == "1"
        assert e["PYTHONPATH"].split(os.pathsep)[0] == env.SITE_DIR
    assert (base["BENCH_CUDNN_SDPA"], nocudnn["BENCH_CUDNN_SDPA"]) == ("1", "0")
    assert ls["LS_FAIRSEQ_KERNELS"] == "require" and "LS_FAIRSEQ_KERNELS" not in base
    assert "--user-dir" in e2e.train_cmd("d", "ls", 8192, 2, 1, [])
    assert "--user-dir" not in e2e.train_cmd("d", "baseline", 8192, 2, 1, [])
    with pytest.raises(SystemExit):
        e2e.main(["--variants", "baseline,ls_nope"])
