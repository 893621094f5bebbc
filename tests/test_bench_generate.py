"""bench/generate.py on the CPU: the parsing of fairseq-generate's output (its summary line and
H-/T- lines), the command lines of both sides, the rows (speedup, identical share, dtype notes,
the decoding targets), the start-up checks, and one tiny real run of the whole pipeline (corpus,
ls_ training, conversion, fairseq-generate on both sides) whose fp32 hypotheses must be identical.
"""
from types import SimpleNamespace

import pytest

import generate  # bench/ (pytest.ini's pythonpath)
import quality
from benchlib import env, results

# fairseq-generate's output, as fairseq 0.12 prints it (stdout: S-/T-/H-/D-/P- lines; stderr: the
# log, in fairseq's own format or, when a plugin configured logging first, Python's default)
OUTPUT = """\
S-1\ta teni <unk> zizolefe .
T-1\teine breinerau <<unk>> eröau .
H-1\t-0.6126945972442627\teine breinerau eröau .
D-1\t-0.6126945972442627\teine breinerau eröau .
P-1\t-0.9647 -0.4561 -0.6754 -0.7938 -0.7854
S-0\tthis tufe mofa .
T-0\tdieses ochieichqu .
H-0\t-0.535185813903809\tdieses ochieichqu kein .
D-0\t-0.535185813903809\tdieses ochieichqu kein .
P-0\t-0.0663 -0.4165 -0.4892 -0.6129 -0.6700
"""
LOG_FAIRSEQ = ("2026-11-26 17:54:57 | INFO | fairseq_cli.generate | NOTE: hypothesis and token "
               "scores are output in base 2\n2026-11-26 17:54:57 | INFO | fairseq_cli.generate | "
               "Translated 3,003 sentences (95,451 tokens) in 21.3s (141.21 sentences/s, "
               "4483.21 tokens/s)\n")
LOG_PLAIN = ("INFO:fairseq_cli.generate:Translated 48 sentences (9,648 tokens) in 1.4s "
             "(35.40 sentences/s, 7115.81 tokens/s)\n")


def test_summary_line():
    assert generate.parse_summary(LOG_FAIRSEQ) == dict(
        sentences=3003, tokens=95451, seconds=21.3, sent_s=141.21, tok_s=4483.21)
    assert generate.parse_summary(OUTPUT + LOG_PLAIN) == dict(
        sentences=48, tokens=9648, seconds=1.4, sent_s=35.40, tok_s=7115.81)
    assert generate.parse_summary(OUTPUT) is None  # a run that died before its summary


def test_hypothesis_and_reference_lines():
    hyps, refs = quality.parse_generate(OUTPUT + LOG_PLAIN)
    assert hyps == {1: "eine breinerau eröau .", 0: "dieses ochieichqu kein ."}
    assert refs == {1: "eine breinerau <<unk>> eröau .", 0: "dieses ochieichqu ."}
    probe = "BENCH_MODEL_DTYPE float16\nBENCH_PEAK_BYTES 1610612736\n"
    assert generate.parse_probe(OUTPUT + probe) == dict(model_dtype="float16", peak_gb=1.5)
    assert generate.parse_probe(OUTPUT) == dict(model_dtype=None, peak_gb=None)


def _flag(cmd, name):
    assert cmd.count(name) == 1, (name, cmd)
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize("dtype,flags", [("fp32", []), ("fp16", ["--fp16"]),
                                         ("bf16", ["--bf16"])])
def test_generate_command_lines(dtype, flags):
    fs = generate.generate_args("bin", "fs.pt", "fairseq", "test", 5, 128, dtype, "cuda")
    ls = generate.generate_args("bin", "ls.pt", "ls", "test", 5, 128, dtype, "cuda",
                                ["--ls-something"])
    assert "--user-dir" not in fs and _flag(ls, "--user-dir") == generate.USER_DIR
    assert ls[-1] == "--ls-something"
    for cmd, ckpt in ((fs, "fs.pt"), (ls, "ls.pt")):
        assert cmd[0] == "bin" and _flag(cmd, "--path") == ckpt
        assert _flag(cmd, "--beam") == "5" and _flag(cmd, "--batch-size") == "128"
        assert _flag(cmd, "--gen-subset") == "test" and _flag(cmd, "--seed") == "1"
        # fairseq's own length limit, explicitly
        assert _flag(cmd, "--max-len-a") == "0" and _flag(cmd, "--max-len-b") == "200"
        assert _flag(cmd, "--required-batch-size-multiple") == "1"
        assert [f for f in cmd if f in ("--fp16", "--bf16")] == flags and "--cpu" not in cmd
    # everything but the checkpoint and --user-dir is the same on both sides
    assert fs[:2] + fs[3:] == ls[:2] + ls[3:ls.index("--user-dir")]
    cpu = generate.generate_args("bin", "fs.pt", "fairseq", "latency", 1, 1, "fp32", "cpu")
    assert "--cpu" in cpu and _flag(cpu, "--batch-size") == "1" and _flag(cpu, "--beam") == "1"


def test_train_command_is_the_plain_ls_command():
    a = SimpleNamespace(lr=7e-4, warmup_updates=500, train_max_tokens=8192, train_updates=1500,
                        device="cuda")
    big = generate.train_cmd(a, "bin", "big", "save")
    assert _flag(big, "--arch") == "ls_transformer_wmt_en_de_big_t2t"
    assert _flag(big, "--criterion") == "ls_label_smoothed_cross_entropy"
    assert _flag(big, "--optimizer") == "ls_adam" and _flag(big, "--user-dir") == generate.USER_DIR
    assert "--fp16" in big and "--share-all-embeddings" in big and "--cpu" not in big
    assert _flag(big, "--max-update") == "1500" and _flag(big, "--max-tokens") == "8192"
    assert not [f for f in big if f.startswith("--ls-")]  # ls_'s defaults, as users get them
    base = generate.train_cmd(a, "bin", "base", "save")
    assert _flag(base, "--arch") == "ls_transformer" and "--encoder-layers" not in base
    tiny = generate.train_cmd(SimpleNamespace(**dict(vars(a), device="cpu")), "bin", "tiny", "save")
    assert "--cpu" in tiny and "--fp16" not in tiny and _flag(tiny, "--encoder-embed-dim") == "32"


def _side(sent_s, dtype="float16", batch=128, bleu=50.0):
    return dict(sent_s=sent_s, tok_s=30 * sent_s, model_dtype=dtype, bleu=bleu,
                length_ratio=1.0, **({"ms_per_sentence": 1000 / sent_s} if batch == 1 else {}))


def test_row_speedup_identical_and_notes():
    config = dict(size="big", dtype="fp16", beam=5, batch=128)
    hyps = dict(fairseq={0: "a b", 1: "c d", 2: "e", 3: "f"},
                ls={0: "a b", 1: "c d", 2: "e x", 3: "f"})
    row = generate.make_row(config, dict(fairseq=_side(100.0), ls=_side(350.0)), hyps, {})
    assert row["speedup"] == pytest.approx(3.5) and row["identical"] == pytest.approx(0.75)
    assert row["fairseq_sent_s"] == 100.0 and row["ls_tok_s"] == 30 * 350.0
    assert row["notes"] == []
    # a sentence one side lacks counts as different
    assert generate.identical_fraction({0: "a", 1: "b"}, {0: "a"}) == pytest.approx(0.5)
    # a side that decoded in another dtype than asked says so
    odd = generate.make_row(dict(config, dtype="bf16"), dict(
        fairseq=dict(error=generate.FAIRSEQ_NO_BF16), ls=_side(90.0, "float32")),
        dict(ls=hyps["ls"]), {})
    assert odd["speedup"] is None and odd["identical"] is None
    assert odd["notes"] == ["ls_ decoded in float32", "fairseq: " + generate.FAIRSEQ_NO_BF16]
    failed = generate.make_row(config, dict(fairseq=_side(100.0), ls=dict(error="exit 1")),
                               dict(fairseq=hyps["fairseq"]), {})
    assert failed["speedup"] is None and failed["notes"] == ["ls_: exit 1"]
    table = generate.markdown([row, odd, failed])
    assert "| big | fp16 | 5 | 128 | 100.0 | 350.0 | 3.50x |" in table and "75.0%" in table
    assert "not supported by fairseq 0.12" in table


def test_side_figures_take_the_median():
    runs = [dict(sent_s=s, tok_s=10 * s, sentences=4, tokens=40, model_dtype="float32",
                 peak_gb=None, seconds=1.0, wall_s=2.0) for s in (10.0, 30.0, 20.0)]
    hyps = {0: "a b c d", 1: "e f g h"}
    f = generate.side_figures(runs, hyps, hyps, batch=1)
    assert f["sent_s"] == 20.0 and f["tok_s"] == 200.0 and f["ms_per_sentence"] == 50.0
    assert f["bleu"] == pytest.approx(100.0) and f["length_ratio"] == 1.0 and len(f["runs"]) == 3
    assert "ms_per_sentence" not in generate.side_figures(runs, hyps, hyps, batch=128)
    assert generate.side_figures(runs[:1] + [dict(error="boom")], hyps, hyps, 1) == dict(
        error="boom")


def test_targets():
    rows = [generate.make_row(dict(size="big", dtype="fp16", beam=5, batch=b),
                              dict(fairseq=_side(100.0, batch=b), ls=_side(s, batch=b, bleu=50.05)),
                              dict(fairseq={0: "a"}, ls={0: "a"}), {})
            for b, s in ((128, 310.0), (1, 150.0))]
    rows.append(generate.make_row(dict(size="base", dtype="fp32", beam=1, batch=128),
                                  dict(fairseq=_side(1.0, "float32"), ls=_side(2.0, "float32")),
                                  dict(fairseq={0: "a", 1: "b"}, ls={0: "a", 1: "c"}), {}))
    found = dict(generate.targets(rows))
    met = {text.split(":")[0]: ok for text, ok in found.items()}
    assert [ok for text, ok in found.items() if "sentences/s" in text] == [True, False]
    assert met["big fp16 beam 5 batch 128"] is True  # fp16: 100% identical, Δ BLEU 0.05
    assert met["base fp32 beam 1 batch 128"] is False  # 50% identical
    text = generate.targets_markdown(rows)
    assert "3.10x fairseq's sentences/s (target ≥ 3x): met" in text
    assert "1.50x fairseq's sentences/s (target ≥ 2x): **not met**" in text


SENTENCES = {0: "a b c d e f", 1: "g h i j k l"}


def test_both_sides_alternate_and_bf16_skips_fairseq(monkeypatch, tmp_path):
    """run_config with fairseq-generate faked: batch 1 decodes the latency split, the sides take
    turns over --repeats, the fairseq side of bf16 is not run where fairseq cannot decode bf16."""
    calls = []

    def fake(args, log_path, device):
        side = "ls" if "--user-dir" in args else "fairseq"
        calls.append((side, args))
        dtype = "bfloat16" if "--bf16" in args and side == "ls" else "float16"
        return (dict(sent_s=10.0 if side == "fairseq" else 25.0, tok_s=100.0, sentences=2,
                     tokens=8, seconds=1.0, wall_s=3.0, model_dtype=dtype, peak_gb=1.0),
                SENTENCES, SENTENCES)

    monkeypatch.setattr(generate, "run_generate", fake)
    a = SimpleNamespace(repeats=3, fairseq_bf16=False, device="cuda", ls_args="--x 1",
                        workdir=str(tmp_path), floor_batch=0)
    ckpts = dict(fairseq="fs.pt", ls="ls.pt")
    refs = dict(latency=SENTENCES, test={})
    row = generate.run_config(a, dict(size="big", dtype="fp16", beam=5, batch=1), ckpts, "bin",
                              refs)
    assert [s for s, _ in calls] == ["fairseq", "ls", "ls", "fairseq", "fairseq", "ls"]
    assert all(_flag(args, "--gen-subset") == "latency" for _, args in calls)
    assert all(args[-2:] == ["--x", "1"] for s, args in calls if s == "ls")
    assert row["speedup"] == pytest.approx(2.5) and row["identical"] == 1.0
    assert row["ls_bleu"] == pytest.approx(100.0) and row["fairseq_ms_per_sentence"] == 100.0
    assert row["subset"] == "latency" and len(row["ls_runs"]) == 3
    assert row["commands"]["fairseq"].startswith("fairseq-generate bin --path fs.pt ")
    assert "--user-dir" in row["commands"]["ls"] and "--user-dir" not in \
        row["commands"]["fairseq"]

    calls.clear()
    a.repeats = 1
    row = generate.run_config(a, dict(size="big", dtype="bf16", beam=5, batch=128), ckpts, "bin",
                              refs)
    assert [s for s, _ in calls] == ["ls"] and _flag(calls[0][1], "--gen-subset") == "test"
    assert row["fairseq_error"] == generate.FAIRSEQ_NO_BF16 and row["speedup"] is None
    assert row["ls_bleu"] == pytest.approx(100.0)  # the T- lines where no raw text is given
    assert row["notes"] == ["fairseq: " + generate.FAIRSEQ_NO_BF16]


def test_noise_floor_decodes_fairseq_again_at_the_floor_batch(monkeypatch, tmp_path):
    """--floor-batch: one more fairseq run at that batch; the row says how many of fairseq's
    hypotheses equal its own there (and ls_'s equal fairseq's there), the table and the target
    line say the floor; rows of batch 1 have none."""
    calls = []

    def fake(args, log_path, device):
        side = "ls" if "--user-dir" in args else "fairseq"
        batch = int(_flag(args, "--batch-size"))
        calls.append((side, batch))
        hyps = dict(SENTENCES)
        if side == "fairseq" and batch == 96:  # a near-tie flips at the other batch
            hyps[1] = "g h i j k"
        return (dict(sent_s=10.0, tok_s=100.0, sentences=2, tokens=8, seconds=1.0, wall_s=3.0,
                     model_dtype="float16", peak_gb=1.0), hyps, SENTENCES)

    monkeypatch.setattr(generate, "run_generate", fake)
    a = SimpleNamespace(repeats=1, fairseq_bf16=False, device="cuda", ls_args="",
                        workdir=str(tmp_path), floor_batch=96)
    ckpts = dict(fairseq="fs.pt", ls="ls.pt")
    refs = dict(latency=SENTENCES, test=SENTENCES)
    row = generate.run_config(a, dict(size="big", dtype="fp16", beam=5, batch=128), ckpts, "bin",
                              refs)
    assert calls == [("fairseq", 128), ("ls", 128), ("fairseq", 96)]
    assert row["floor_batch"] == 96 and row["identical"] == 1.0
    assert row["fairseq_floor_identical"] == pytest.approx(0.5)
    assert row["ls_floor_identical"] == pytest.approx(0.5)
    assert "fairseq at batch 96: 50.0% identical to itself" in generate.markdown([row])
    assert "fairseq against itself at batch 96: 50.0%" in generate.targets_markdown([row])
    calls.clear()
    row = generate.run_config(a, dict(size="big", dtype="fp16", beam=5, batch=1), ckpts, "bin",
                              refs)
    assert calls == [("fairseq", 1), ("ls", 1)] and "floor_batch" not in row


def test_fairseq_012_generate_has_no_bf16():
    assert not generate.fairseq_generate_casts_bf16()


def test_start_up_checks(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(generate, "cuda_available", lambda: False)
    with pytest.raises(SystemExit):
        generate.main(["--workdir", str(tmp_path / "w")])
    assert "no CUDA device visible" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate.main(["--device", "cpu", "--size", "tiny", "--workdir", str(tmp_path / "w")])
    assert "--device cpu decodes in fp32 only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate.main(["--device", "cpu", "--dtypes", "fp32", "--sizes", "huge"])
    assert "unknown size/dtype ['huge']" in capsys.readouterr().err
    for floor in ("128", "-1"):
        with pytest.raises(SystemExit):
            generate.main(["--device", "cpu", "--dtypes", "fp32", "--batches", "1,128",
                           "--floor-batch", floor])
        assert f"--floor-batch {floor}: a batch size" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # nothing was started
    a = generate.parse_args(["--device", "cpu", "--size", "tiny", "--dtypes", "fp32",
                             "--batches", "1,16"])
    assert a.sizes == ["tiny"] and a.batches == [1, 16] and a.train_max_tokens == 1024


@pytest.mark.slow
def test_pipeline_end_to_end_on_cpu(tmp_path):
    """Corpus, ls_ training (a few updates), conversion, fairseq-generate on both sides at batch
    1 and 16: fp32 on the same weights gives the same hypotheses (what the converter and the
    plugin guarantee); the table, the JSON and the per-run logs."""
    out = tmp_path / "g.json"
    rows = generate.main(["--device", "cpu", "--size", "tiny", "--dtypes", "fp32", "--beams", "1",
                          "--batches", "1,16", "--lines", "sentence", "--train-sentences", "600",
                          "--test-sentences", "48", "--latency-sentences", "8",
                          "--train-updates", "10", "--workdir", str(tmp_path / "w"),
                          "--json", str(out), "--markdown", str(tmp_path / "g.md")])
    assert [(r["batch"], r["subset"]) for r in rows] == [(1, "latency"), (16, "test")]
    for r in rows:
        assert r["identical"] == 1.0, r
        assert r["fairseq_sent_s"] > 0 and r["ls_sent_s"] > 0 and r["speedup"] > 0
        assert r["fairseq_sentences"] == r["ls_sentences"] == (8 if r["batch"] == 1 else 48)
        assert r["fairseq_model_dtype"] == r["ls_model_dtype"] == "float32"
        assert r["fairseq_bleu"] == r["ls_bleu"] and r["notes"] == []
    assert rows[0]["ls_ms_per_sentence"] == pytest.approx(1000 / rows[0]["ls_sent_s"])
    data = results.load(str(out))
    assert data["device"] == "cpu" and data["models"]["tiny"]["updates"] == 10
    assert data["script"] == "bench/generate.py" and data["torch"] == env.torch_version()
    assert data["models"]["tiny"]["fairseq_arch"] == "transformer"
    assert len(data["rows"]) == 2 and all(ok for _, ok in data["targets"])
    md = (tmp_path / "g.md").read_text()
    assert "| tiny | fp32 | 1 | 16 |" in md and "Targets:" in md
    assert len(list((tmp_path / "w" / "runs").iterdir())) == 4
