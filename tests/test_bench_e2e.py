"""bench/e2e.py's host-side logic (no GPU): the loss-curve table (``fidelity_markdown``: each run
against the first baseline of its --max-tokens, with ``ls-fairseq-compare``'s statistics, whose
definitions tests/test_compare.py checks on closed-form curves; here, that e2e applies them per
batch size and to the right reference, also after a JSON round trip, whose keys are strings), what
counts as a run that does not fit, the GEMM probe's parsing, the steady-state intervals timed by
the wrapper's stamps (also in a tiny real fairseq-train on CPU), and the largest-batch bisection."""
import json
import sys

import pytest

import e2e  # bench/ (pytest.ini's pythonpath)


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


def test_gemm_rate_is_read_from_the_probe_and_missing_without_it(monkeypatch):
    """The GEMM probe runs in a subprocess (no CUDA context in the benchmark's own process); its
    figure is parsed from its output, and a probe that printed none (no GPU) gives None."""
    class Done:
        def __init__(self, stdout):
            self.stdout = stdout

    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        return Done(outputs.pop(0))

    outputs = ["warming up\nBENCH_GEMM_TFLOPS 712.25\n", "Traceback: no CUDA\n"]
    monkeypatch.setattr(e2e.subprocess, "run", fake_run)
    assert e2e.gemm_tflops() == 712.25
    assert e2e.gemm_tflops() is None
    assert all(cmd[1] == "-c" and "BENCH_GEMM_TFLOPS" in cmd[2] for cmd in seen)


def test_steady_intervals_are_timed_from_stamp_to_stamp():
    """Two epochs of three logged intervals; fairseq's own interval figures (wps) leave out a
    wait at each log, the stamps (one per interval, at its end) do not: the steady figure is the
    epoch's tokens after its first interval over the time between their stamps."""
    inner = []
    for k, (epoch, updates, wpb, wps) in enumerate([
            (1, 10, 100.0, 1000.0), (1, 20, 100.0, 1000.0), (1, 25, 120.0, 1000.0),
            (2, 35, 100.0, 900.0), (2, 45, 100.0, 2000.0), (2, 50, 80.0, 2000.0)]):
        inner.append({"epoch": str(epoch), "num_updates": str(updates), "wpb": str(wpb),
                      "wps": str(wps)})
    ends = [1.0, 2.0, 2.5, 9.0, 10.25, 11.0]
    # epoch 2 without its first interval: 10 updates x 100 + 5 x 80 tokens in 1.25 + 0.75 s
    assert e2e.interval_wps(inner, 2, ends) == (1000 + 400) / 2.0
    # epoch 1: 10 x 100 + 5 x 120 tokens in 1.0 + 0.5 s
    assert e2e.interval_wps(inner, 1, ends) == (1000 + 600) / 1.5
    # no stamps, or not one per interval: fairseq's figures, time-weighted
    fairseq_2 = (100 + 80) / (100 / 2000 + 80 / 2000)
    assert e2e.interval_wps(inner, 2) == fairseq_2
    assert e2e.interval_wps(inner, 2, ends[:-1]) == fairseq_2


def test_interval_stamps_are_read_in_order_from_the_log():
    log = ("BENCH_TOTAL_BYTES 1\n2026 | INFO | train_inner | {\"epoch\": 1}\n"
           "BENCH_INTERVAL_END 12.5\nnoise BENCH_INTERVAL_END 99\nBENCH_INTERVAL_END 1.25e+03\n")
    assert e2e.interval_ends(log) == [12.5, 1250.0]


def tiny_cpu_train_args(data, epochs):
    """fairseq-train's arguments (after the program) for a one-layer model on the CPU, logging
    every 2 updates as JSON: the real log format, in seconds (also tests/test_bench_multi_gpu.py)."""
    return [data, "--arch", "transformer_iwslt_de_en", "--encoder-layers", "1", "--decoder-layers",
            "1", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
            "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
            "--encoder-attention-heads", "2", "--decoder-attention-heads", "2", "--optimizer",
            "adam", "--lr", "1e-3", "--max-tokens", "300", "--max-epoch", str(epochs), "--cpu",
            "--no-save", "--disable-validation", "--log-format", "json", "--log-interval", "2",
            "--num-workers", "0", "--criterion", "label_smoothed_cross_entropy"]


def test_the_wrapper_stamps_every_logged_interval_of_a_real_fairseq_train(tmp_path):
    """The stamps come from patching fairseq's ``metrics.reset_meters`` in e2e's wrapper: a real
    (tiny, CPU) fairseq-train must print exactly one per logged interval, or the steady figure
    silently falls back to fairseq's own interval meters."""
    e2e.make_corpus(str(tmp_path), 120, 300)
    data = e2e.preprocess(str(tmp_path), 1)
    cmd = [sys.executable, "-c", e2e.WRAPPER] + tiny_cpu_train_args(data, epochs=2)
    proc = e2e.subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    inner, epochs, _, _ = e2e.parse_log(log)
    ends = e2e.interval_ends(log)
    assert sorted(epochs) == [1, 2] and len(inner) >= 4
    assert len(ends) == len(inner)
    assert ends == sorted(ends)
    assert e2e.interval_wps(inner, 2, ends) > 0


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
    monkeypatch.setattr(e2e, "make_corpus", lambda *a, **k: 28.0)
    monkeypatch.setattr(e2e, "preprocess", lambda *a, **k: str(tmp_path))
    monkeypatch.setattr(e2e, "gemm_tflops", lambda: None)

    def fake_run(data, variant, max_tokens, args, log_dir, profile_at=None, extra=()):
        if max_tokens > limits[variant]:
            return {"variant": variant, "max_tokens": max_tokens, "error": "OOM (3 batches skipped)"}
        return {"variant": variant, "max_tokens": max_tokens, "wps_unseen": 1.0}

    monkeypatch.setattr(e2e, "run_variant", fake_run)
    out_md, out_json = tmp_path / "e2e.md", tmp_path / "e2e.json"
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--workdir", str(tmp_path), "--log-dir",
                                      str(tmp_path / "logs"), "--largest", "32768", "163840",
                                      "8192", "--variants", "baseline_nocudnn,ls_deferred",
                                      "--markdown", str(out_md), "--json", str(out_json)])
    e2e.main()
    text = out_md.read_text()
    assert "| baseline_nocudnn | 57344 | 65536 |" in text
    assert "| ls_deferred | 131072 | 139264 |" in text
    saved = json.loads(out_json.read_text())
    assert saved["largest"] == {"baseline_nocudnn": [57344, 65536], "ls_deferred": [131072, 139264]}
    tried = [(r["variant"], r["max_tokens"]) for r in saved["rows"]]
    assert ("ls_deferred", 163840) in tried and ("baseline_nocudnn", 65536) in tried

    limits["ls_deferred"] = None  # any size: a crash, not memory
    monkeypatch.setattr(e2e, "run_variant", lambda data, variant, mt, *a, **k: (
        {"variant": variant, "max_tokens": mt, "error": "Traceback: KeyError"}
        if variant == "ls_deferred" else {"variant": variant, "max_tokens": mt}))
    with pytest.raises(SystemExit, match="another reason than memory"):
        e2e.main()


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
    args = type("Args", (), {"epochs": 1, "seed": 1, "extra": []})()
    for variant in ("ls_deferred", "ls_deferred_short", "ls_deferred_efficient"):
        row = e2e.run_variant(str(tmp_path), variant, 4096, args, str(tmp_path))
        assert "stopped by the test" in row["error"]
    assert set(seen) == {None, "short", "efficient"}
    assert seen["short"] == seen["efficient"] == seen[None]  # the same fairseq-train command
