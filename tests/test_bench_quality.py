"""bench/quality.py and the learnable corpus (ls_fairseq/testing/learnable_corpus.py) on the CPU:
the corpus (deterministic, ~11k word types a side with Zipf frequencies, target lengths that
differ from the source's, WMT-length lines for bench/e2e.py, the small vocabulary of the
quickstart), the command lines of each variant, the parsing of fairseq's logs, the scores, the
verdict against the baseline (closed-form rows), the --gpus N plumbing (fairseq's distributed
flags, one port per run, CUDA_VISIBLE_DEVICES, the start-up check), the real-text corpus, ls_adam's
step shadow, and one tiny real run of the whole pipeline (fairseq-train, fairseq-generate,
sacreBLEU) with a fairseq and an ls_ variant on the bench tests' shared corpus.
"""
import collections
import json
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import quality  # bench/ (pytest.ini's pythonpath)
from benchlib import corpora, real_corpus, results
from benchlib.probes import adam_shadow
from ls_fairseq.testing import learnable_corpus
from test_bench_base import tiny_corpus  # noqa: F401  (the shared corpus)


def _read(path):
    with open(path) as f:
        return f.read().splitlines()


def test_corpus_is_deterministic_and_seeded(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    learnable_corpus.write_corpus(a, train=300, valid=20, test=20, seed=5)
    learnable_corpus.write_corpus(b, train=300, valid=20, test=20, seed=5)
    learnable_corpus.write_corpus(c, train=300, valid=20, test=20, seed=6)
    for name in ("train.en", "train.de", "test.en", "test.de"):
        assert _read(a / name) == _read(b / name)
    assert _read(a / "train.en") != _read(c / "train.en")
    assert len(_read(a / "train.en")) == len(_read(a / "train.de")) == 300


def test_lexicon_sizes_and_sides_disjoint():
    lex = learnable_corpus.Lexicon()
    src = {w for words in lex.src.values() for w in words}
    tgt = {t for tokens, _ in lex.noun for t in tokens} | set(lex.adj) | set(lex.adv) | \
        {stem for stem, _ in lex.verb} | {p for p, _ in lex.prep}
    assert len(src) >= 10000 and len(tgt) >= 10000
    assert not src & tgt  # nothing can be copied from the source
    # one translation per source word (the transduction is a function of the source)
    assert len(lex.src["noun"]) == len(lex.noun) and len(lex.src["verb"]) == len(lex.verb)


def test_zipf_frequencies_and_length_change():
    gen = learnable_corpus.Generator(learnable_corpus.Lexicon(), np.random.default_rng(0))
    pairs = [gen.sentence() for _ in range(4000)]
    nouns = set(gen.lex.src["noun"])
    counts = collections.Counter(w for s, _ in pairs for w in s.split() if w in nouns)
    freq = [counts[w] for w in gen.lex.src["noun"][:200]]
    # rank 1 vs rank 10 vs rank 100 of a rank^-1 law: about 10x apart each
    assert 5 < freq[0] / max(freq[9], 1) < 20 and 4 < sum(freq[:10]) / max(sum(freq[90:110]), 1)
    ratio = [len(t.split()) / len(s.split()) for s, t in pairs]
    assert sum(r != 1.0 for r in ratio) > 0.5 * len(ratio)
    assert 1.0 < float(np.mean(ratio)) < 1.25


def test_simple_clauses_follow_the_rules():
    """Sentences of the form DET NOUN VERB DET NOUN . translate, by the lexicon alone, to
    DET' NOUN' VERB' DET' NOUN' [PARTICLE] . with each determiner agreeing with its noun's
    gender (compound nouns give two tokens, separable verbs a particle at the end)."""
    lex = learnable_corpus.Lexicon()
    index = {c: {w: i for i, w in enumerate(lex.src[c])} for c in ("noun", "verb")}
    gen = learnable_corpus.Generator(lex, np.random.default_rng(3))
    checked = particles = compounds = 0
    for _ in range(3000):
        s, t = gen.sentence()
        words = s.split()
        if len(words) != 6:
            continue
        d1, n1, v, d2, n2, _ = words
        (t1, g1), (t2, g2) = lex.noun[index["noun"][n1]], lex.noun[index["noun"][n2]]
        stem, particle = lex.verb[index["verb"][v]]
        det = learnable_corpus.DET_TABLE
        want = [det[(d1, g1, 0)]] + t1 + [stem] + [det[(d2, g2, 0)]] + t2 + \
            ([particle] if particle else []) + ["."]
        assert t.split() == want
        checked += 1
        particles += particle is not None
        compounds += len(t1) + len(t2) > 2
    assert checked > 100 and particles > 0 and compounds > 0


def test_wmt_length_lines():
    gen = learnable_corpus.Generator(learnable_corpus.Lexicon(), np.random.default_rng(1))
    for length in (1, 5, 30, 120):
        got = [len(gen.line_of_length(length)[0].split()) for _ in range(40)]
        assert min(got) >= 1
        if length >= 30:
            assert abs(np.mean(got) - length) < 0.2 * length


def test_the_quickstarts_small_vocabulary():
    """synthetic_corpus(n, seed, "small"): the same grammar over ~60 content words a side (a
    tiny model learns it on a CPU), deterministic, as two lists of tokenised lines; the full
    lexicon is untouched by the small one's existence (its draws come first)."""
    en, de = learnable_corpus.synthetic_corpus(300, seed=2, vocabulary="small")
    assert (en, de) == learnable_corpus.synthetic_corpus(300, seed=2, vocabulary="small")
    assert len(en) == len(de) == 300 and all(s.endswith(" .") for s in en + de)
    lex = learnable_corpus.Lexicon(vocabulary="small")
    assert sum(len(v) for k, v in lex.src.items() if k != "prep") == 61
    assert len({w for s in en for w in s.split()}) < 120
    assert learnable_corpus.synthetic_corpus(5)[0] != en[:5]  # the full vocabulary by default
    with pytest.raises(ValueError, match="vocabulary 'tiny'"):
        learnable_corpus.Lexicon(vocabulary="tiny")


def _args(**kw):
    base = dict(lr=7e-4, warmup_updates=500, dropout=0.3, max_tokens=4096, max_update=100,
                model="small", cuda=True, beam=5, lenpen=1.0, gpus=1, ddp_backend=None,
                update_freq=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_variant_command_lines():
    a = _args()
    base = quality.train_cmd(a, "bin", "baseline", 1, "run")
    assert "--user-dir" not in base and "--fp16" in base
    assert base[base.index("--arch") + 1] == "transformer"
    arch = quality.train_cmd(a, "bin", "arch", 1, "run")
    assert arch[arch.index("--arch") + 1] == "ls_transformer"
    assert arch[arch.index("--criterion") + 1] == "label_smoothed_cross_entropy"
    assert "--user-dir" in arch
    for name, flag, value in (("criterion", "--criterion", "ls_label_smoothed_cross_entropy"),
                              ("optimizer", "--optimizer", "ls_adam")):
        cmd = quality.train_cmd(a, "bin", name, 1, "run")
        assert cmd[cmd.index(flag) + 1] == value and cmd[cmd.index("--arch") + 1] == "transformer"
    eager = quality.train_cmd(a, "bin", "ls_eager", 3, "run")
    assert eager[-3:] == ["--ls-no-fused-fp16-copy", "--ls-no-cuda-graphs",
                          "--ls-no-deferred-overflow-check"]
    assert eager[eager.index("--seed") + 1] == "3"
    for name in ("ls_fp8", "ls_fp8_ffn", "ls_fp8_attention"):  # FP8 on the ls command
        cmd = quality.train_cmd(a, "bin", name, 1, "run")
        flags = quality.VARIANTS[name]["flags"]
        assert cmd[-len(flags):] == flags and flags[0] == "--ls-fp8"
        assert cmd[:-len(flags)] == quality.train_cmd(a, "bin", "ls", 1, "run")
    matched = quality.train_cmd(a, "bin", "ls_matched", 1, "run")  # several GPUs
    assert matched == quality.train_cmd(a, "bin", "ls", 1, "run") + [
        "--ls-cost-matching-window", "16"]
    bf16 = quality.train_cmd(a, "bin", "ls_bf16", 3, "run")
    assert "--bf16" in bf16 and "--fp16" not in bf16 and "--user-dir" in bf16
    assert quality.VARIANTS["ls_off"]["env"] == {"LS_FAIRSEQ_KERNELS": "off"}
    cpu = quality.train_cmd(_args(cuda=False), "bin", "baseline", 1, "run")
    assert "--cpu" in cpu and "--fp16" not in cpu
    assert "--user-dir" not in quality.generate_cmd(a, "bin", "baseline", "run")
    assert "--user-dir" in quality.generate_cmd(a, "bin", "optimizer", "run")


# the ls variant's command as quality.py built it before --gpus existed (_args())
ONE_GPU_LS = [
    sys.executable, "-m", "fairseq_cli.train", "bin", "--arch", "ls_transformer",
    "--share-all-embeddings", "--optimizer", "ls_adam", "--adam-betas", "(0.9, 0.98)",
    "--clip-norm", "0.0", "--lr", "0.0007", "--lr-scheduler", "inverse_sqrt", "--warmup-updates",
    "500", "--dropout", "0.3", "--weight-decay", "0.0001", "--criterion",
    "ls_label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "4096",
    "--max-update", "100", "--fp16", "--seed", "1", "--save-dir", "run", "--no-epoch-checkpoints",
    "--no-last-checkpoints", "--save-interval", "100000", "--validate-interval", "100000",
    "--log-format", "simple", "--log-interval", "100", "--no-progress-bar", "--num-workers", "0",
    "--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "256",
    "--decoder-embed-dim", "256", "--encoder-ffn-embed-dim", "1024", "--decoder-ffn-embed-dim",
    "1024", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--user-dir",
    quality.USER_DIR]
DISTRIBUTED = ("--distributed-world-size", "--distributed-init-method", "--distributed-port",
               "--ddp-backend", "--update-freq", "--distributed-no-spawn")


def test_one_gpu_command_is_unchanged(monkeypatch):
    a = _args(gpus=1)
    for port in (None, 29600):  # a port is ignored on one GPU
        cmd = quality.train_cmd(a, "bin", "ls", 1, "run", port)
        assert cmd == ONE_GPU_LS
        assert not set(DISTRIBUTED) & set(cmd)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    train_env, gen_env = quality.run_envs(a, "ls")
    assert "CUDA_VISIBLE_DEVICES" not in train_env and "CUDA_VISIBLE_DEVICES" not in gen_env
    assert gen_env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"
    assert quality.setup_text(_args(max_update=1500)) == \
        "1 GPU per run, 1500 updates of 4096 tokens"


def _flag(cmd, name):
    assert cmd.count(name) == 1, (name, cmd)
    return cmd[cmd.index(name) + 1]


def test_two_gpu_commands(monkeypatch):
    a = _args(gpus=2, max_tokens=2048)
    variants, seeds = list(quality.VARIANTS), [1, 2, 3]
    jobs = quality.job_list(variants, seeds, 29600)
    assert [(v, s) for v, s, _ in jobs] == [(v, s) for s in seeds for v in variants]
    ports = set()
    for variant, seed, port in jobs:
        cmd = quality.train_cmd(a, "bin", variant, seed, f"run_{variant}_{seed}", port)
        assert _flag(cmd, "--distributed-world-size") == "2"
        ports.add(_flag(cmd, "--distributed-init-method"))
        # on one node fairseq ignores --distributed-port (trains on one GPU); no backend flag
        # and no update-freq unless asked
        assert "--distributed-port" not in cmd and "--ddp-backend" not in cmd
        assert "--update-freq" not in cmd
        i = cmd.index("--distributed-world-size")  # otherwise the 1-GPU command
        assert cmd[:i] + cmd[i + 4:] == quality.train_cmd(
            _args(max_tokens=2048), "bin", variant, seed, f"run_{variant}_{seed}")
        gen = quality.generate_cmd(a, "bin", variant, "run")
        assert gen == quality.generate_cmd(_args(), "bin", variant, "run")
        assert not [f for f in gen if f.startswith("--distributed") or f == "--ddp-backend"]
    # every run its own rendezvous, so any --jobs of them can start at once
    assert len(ports) == len(jobs)
    assert ports == {f"tcp://localhost:{29600 + i}" for i in range(len(jobs))}
    eager = quality.train_cmd(a, "bin", "ls_eager", 1, "run", 29600)
    assert eager[-3:] == quality.VARIANTS["ls_eager"]["flags"]

    both = quality.train_cmd(_args(gpus=2, ddp_backend="legacy_ddp", update_freq=2), "bin", "ls",
                             1, "run", 29601)
    assert _flag(both, "--ddp-backend") == "legacy_ddp" and _flag(both, "--update-freq") == "2"
    one = quality.train_cmd(_args(ddp_backend="no_c10d"), "bin", "ls", 1, "run")
    assert _flag(one, "--ddp-backend") == "no_c10d" and "--distributed-world-size" not in one

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    train_env, gen_env = quality.run_envs(a, "ls_off")
    assert train_env["CUDA_VISIBLE_DEVICES"] == "0,1" and gen_env["CUDA_VISIBLE_DEVICES"] == "0"
    assert train_env["LS_FAIRSEQ_KERNELS"] == "off"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 5,6")  # the caller's GPUs are kept
    train_env, gen_env = quality.run_envs(a, "ls")
    assert train_env["CUDA_VISIBLE_DEVICES"] == "4,5" and gen_env["CUDA_VISIBLE_DEVICES"] == "4"

    assert quality.setup_text(_args(gpus=2, max_tokens=2048, max_update=1500)) == (
        "2 GPUs per run (--ddp-backend fairseq default, pytorch_ddp), 1500 updates of 4096 "
        "tokens (2 GPUs × 2048)")
    assert "--ddp-backend legacy_ddp" in quality.setup_text(_args(gpus=2, ddp_backend="legacy_ddp"))


def test_two_gpu_run_records_gpus(monkeypatch, tmp_path):
    """run_one with fairseq's processes faked: the row names the GPUs and the backend, the
    training gets both GPUs and its port, the decoding one GPU."""
    calls = []

    def fake_run(cmd, env, **kw):
        calls.append((cmd, env))
        if "fairseq_cli.train" in cmd:
            open(os.path.join(cmd[cmd.index("--save-dir") + 1], "checkpoint_best.pt"), "w").close()
            return SimpleNamespace(returncode=0)
        return SimpleNamespace(returncode=0, stdout="H-0\t-0.1\tq r s t u\n", stderr="")

    monkeypatch.setattr(quality.subprocess, "run", fake_run)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    a = _args(gpus=2, ddp_backend="legacy_ddp", workdir=str(tmp_path), keep_checkpoints=False)
    row = quality.run_one(a, "bin", "ls", 2, {0: "q r s t u"}, quality.threading.Lock(), 29605)
    assert row["gpus"] == 2 and row["ddp_backend"] == "legacy_ddp" and "error" not in row
    assert row["bleu"] == pytest.approx(100.0)
    (train, train_env), (gen, gen_env) = calls
    assert _flag(train, "--distributed-init-method") == "tcp://localhost:29605"
    assert train_env["CUDA_VISIBLE_DEVICES"] == "0,1" and gen_env["CUDA_VISIBLE_DEVICES"] == "0"
    assert not [f for f in gen if f.startswith("--distributed")]


@pytest.mark.parametrize("cuda,count", [(True, 1), (False, 0)])
def test_too_few_gpus_fail_at_start(monkeypatch, capsys, tmp_path, cuda, count):
    monkeypatch.setattr(quality, "cuda_available", lambda: cuda)
    monkeypatch.setattr(quality, "cuda_device_count", lambda: count)
    with pytest.raises(SystemExit):
        quality.main(["--gpus", "2", "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert f"--gpus 2: only {count} CUDA device(s) visible" in err
    assert not (tmp_path / "w").exists()  # nothing was started


def test_log_parsing():
    t = "2026-11-26 10:00:00 | INFO"  # fairseq's own prefix
    log = (f"{t} | train_inner | epoch 004:    100 / 375 loss=2.3, nll_loss=0.2, ppl=1.2, "
           "wps=1000, ups=3, wpb=4000, bsz=150, num_updates=1400, lr=0.0005, gnorm=0.4\n"
           f"{t} | train | epoch 004 | loss 2.1 | num_updates 1500 | lr 0.0005\n"
           "NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: 32\n"
           f"{t} | valid | epoch 003 | valid on 'valid' subset | loss 2.4 | nll_loss 0.3"
           " | ppl 1.2 | wps 1 | wpb 2 | bsz 3 | num_updates 1125\n"
           f"{t} | valid | epoch 004 | valid on 'valid' subset | loss 2.04 | nll_loss 0.092"
           " | ppl 1.07 | num_updates 1500\n")
    assert quality.parse_train_log(log) == dict(
        valid_loss=2.04, valid_nll=0.092, updates=1500, overflows=1, loss_scale=None,
        train_curve=[[1400, 2.3]], valid_curve=[[1125, 2.4], [1500, 2.04]])
    scaled = log.replace("gnorm=0.4", "gnorm=0.4, loss_scale=16") + 'SHADOW_SUMMARY {"updates": 3}\n'
    parsed = quality.parse_train_log(scaled)
    assert parsed["loss_scale"] == 16.0 and parsed["shadow"] == {"updates": 3}
    gen = "S-1\ta b\nT-1\tx y\nH-1\t-0.5\tx y z\nD-1\t-0.5\tx y z\nH-0\t-0.1\tq\nT-0\tq\n"
    hyps, refs = quality.parse_generate(gen)
    assert hyps == {1: "x y z", 0: "q"} and refs == {1: "x y", 0: "q"}


def test_scores_and_degenerate_hypotheses():
    refs = ["a b c d e f g h", "i j k l m n o p", "q r s"]
    same = quality.score(refs, refs)
    assert same["bleu"] == pytest.approx(100.0) and same["length_ratio"] == 1.0
    assert same["degenerate"] == 0
    hyps = [refs[0] + " a b c a b c",          # a 3-gram repeated back to back: degenerate
            "i j k l m i j k n o p",           # a repeated 3-gram, not back to back: not
            " ".join(["w%d" % i for i in range(100)])]  # 100 tokens: degenerate
    long = quality.score(hyps, refs)
    assert long["length_ratio"] == pytest.approx((14 + 11 + 100) / 19) and long["degenerate"] == 2
    # the loops taken out: the one clean hypothesis (11 words) against its reference (8)
    assert long["clean_length_ratio"] == pytest.approx(11 / 8) and same["clean_length_ratio"] == 1.0
    assert long["bleu"] < 100.0
    assert not quality.degenerate("a b a b c".split())  # a 2-gram loop is below the rule
    assert quality.degenerate("x a b c a b c".split())


def _rows(variant, bleus, ratios, degenerate=None):
    return [dict(variant=variant, seed=i + 1, bleu=b, length_ratio=r, degenerate=d,
                 valid_loss=2.0, updates=100, overflows=0, train_s=1.0)
            for i, (b, r, d) in enumerate(zip(bleus, ratios, degenerate or [10] * len(bleus)))]


def test_verdict_against_the_baseline():
    """Inside every band: pass. Outside a band with three seeds a side, no split of six runs
    is rare enough (the two most extreme of 20 splits: p = 0.1), so the verdict is "within
    noise", not FAIL; fewer seeds than the recipe asks: "too few seeds"."""
    rows = (_rows("baseline", [90.0, 91.0, 92.0], [1.0, 1.0, 1.0])
            + _rows("criterion", [90.6, 91.6, 92.6], [1.0, 1.0, 1.0])     # +0.6 BLEU
            + _rows("optimizer", [90.6, 91.4, 91.0], [1.02, 1.02, 1.02])  # +0.0, +0.02: passes
            + _rows("arch", [91.0, 91.0, 91.0], [1.04, 1.04, 1.04])       # +0.04 length
            + _rows("ls", [91.0, 91.0], [1.0, 1.0])                       # two seeds
            + [dict(variant="ls_off", seed=1, error="fairseq-train exit 1")])
    s = quality.summarize(rows, ["baseline", "criterion", "optimizer", "arch", "ls", "ls_off"],
                          "synthetic")
    assert s["baseline"]["bleu"] == pytest.approx(91.0) and s["baseline"]["bleu_sd"] == \
        pytest.approx(1.0)
    assert s["criterion"]["d_bleu"] == pytest.approx(0.6) and not s["criterion"]["pass"]
    assert s["criterion"]["verdict"] == "within noise" and s["criterion"]["outside"] == ["bleu"]
    assert s["optimizer"]["pass"] and s["optimizer"]["d_length_ratio"] == pytest.approx(0.02)
    assert s["arch"]["verdict"] == "within noise" and s["arch"]["p"]["length"] == \
        pytest.approx(0.1)
    assert s["ls"]["verdict"] == "too few seeds" and not s["ls"]["pass"]
    assert s["ls_off"]["n"] == 0 and s["ls_off"]["failed"] == 1 and "verdict" not in s["ls_off"]
    table = quality.tables(rows, s)
    assert "| criterion | 3 |" in table and "within noise" in table
    assert "fairseq-train exit 1" in table and "**FAIL**" not in table
    assert s["criterion"]["bleu_median"] == pytest.approx(91.6)
    assert "| 91.60 (+0.60) | 0 |" in table


def test_real_text_verdict_bands():
    """The gate's bands (real recipe): BLEU within ±1.0, length ratio within ±0.03, degenerate
    hypotheses at most 20% above the baseline's mean, and five seeds on both sides; outside a
    band with every run beyond every baseline run (p = 1/252 one-sided, 2/252 two-sided): FAIL."""
    five = [1.0] * 5
    rows = (_rows("baseline", [27.0, 27.5, 28.0, 27.0, 28.0], five, [14, 15, 13, 14, 14])
            + _rows("ls", [26.6, 27.0, 27.4, 26.5, 27.0], [1.02] * 5, [16, 17, 16, 17, 16])
            + _rows("optimizer", [27.0] * 5, five, [18] * 5)      # 18 > 1.2 x 14: fails
            + _rows("ls_bf16", [25.0] * 5, five, [14] * 5)        # -2.5 BLEU: fails
            + _rows("crit_opt", [27.5] * 4, five[:4], [14] * 4))  # four seeds
    s = quality.summarize(rows, ["baseline", "ls", "optimizer", "ls_bf16", "crit_opt"], "real")
    assert s["ls"]["pass"] and s["ls"]["d_bleu"] == pytest.approx(-0.6)
    assert s["ls"]["degenerate"] == pytest.approx(16.4)
    assert s["optimizer"]["verdict"] == "FAIL" and s["optimizer"]["outside"] == ["degenerate"]
    assert s["optimizer"]["p"]["degenerate"] == pytest.approx(1 / 252)
    assert s["ls_bf16"]["verdict"] == "FAIL" and s["ls_bf16"]["p"]["bleu"] == \
        pytest.approx(2 / 252)
    assert s["crit_opt"]["verdict"] == "too few seeds" and not s["crit_opt"]["pass"]
    assert quality.degenerate_limit(14.0) == pytest.approx(16.8)
    assert quality.degenerate_limit(0.0) == 1.0
    table = quality.tables(rows, s)
    assert "| ls | 5 | 26.90 ± 0.36 | 1.020 ± 0.000 | 16.4 ± 0.5 |" in table
    assert "| ls_bf16 | 5 |" in table and "**FAIL** | 0.01 / 1.00 / " in table


def test_a_difference_inside_the_spread_is_within_noise():
    """Five seeds a side as spread as real runs (length ratio s.d. ~0.15, BLEU ~2.5): a mean
    0.1 shorter and 2 BLEU higher is outside the bands but not out of the spread; the table
    says what this call could have told apart (2.8 standard errors)."""
    base = _rows("baseline", [23.1, 28.6, 23.2, 24.6, 26.7], [1.28, 1.06, 1.22, 0.87, 1.12])
    ls = _rows("ls", [29.9, 29.5, 27.5, 24.4, 30.1], [1.04, 0.93, 1.08, 0.72, 1.00])
    s = quality.summarize(base + ls, ["baseline", "ls"], "real")["ls"]
    assert s["verdict"] == "within noise" and set(s["outside"]) == {"bleu", "length"}
    assert s["p"]["length"] > quality.ALPHA and s["p"]["bleu"] > quality.ALPHA
    sd_b, sd_l = (quality.mean_sd([r["length_ratio"] for r in rows])[1] for rows in (base, ls))
    assert s["detectable_length"] == pytest.approx(2.8 * ((sd_b ** 2 + sd_l ** 2) / 5) ** 0.5)


def test_permutation_p():
    """Exact over every split when there are few; from a fixed seed's random splits when many
    (then (hits + 1) / (draws + 1), never 0)."""
    assert quality.permutation_p([1, 2, 3], [4, 5, 6]) == pytest.approx(2 / 20)
    assert quality.permutation_p([4, 5, 6], [1, 2, 3], one_sided=True) == pytest.approx(1 / 20)
    assert quality.permutation_p([1, 2, 3], [4, 5, 6], one_sided=True) == 1.0
    assert quality.permutation_p([1, 2], [1, 2]) == 1.0 and quality.permutation_p([], [1]) is None
    many = quality.permutation_p(list(range(15)), [x + 10 for x in range(15)])
    assert many == quality.permutation_p(list(range(15)), [x + 10 for x in range(15)])
    assert 0 < many < 0.01


def test_paired_by_seed():
    """Δ paired by seed: per seed the variant's mean minus the baseline's, averaged over the
    seeds both trained; p from every relabeling within each seed (2^3 with one run a side)."""
    assert quality.paired_p([([2.0], [1.0]), ([3.0], [1.0]), ([4.0], [1.0])]) == \
        (pytest.approx(2.0), pytest.approx(2 / 8))
    assert quality.paired_p([([2.0], [1.0]), ([3.0], [1.0]), ([4.0], [1.0])], one_sided=True)[1] \
        == pytest.approx(1 / 8)
    assert quality.paired_p([]) == (None, None)
    # a seed with two runs of the variant: their mean counts; C(3, 2) relabelings there
    d, p = quality.paired_p([([1.0, 3.0], [1.0]), ([5.0], [4.0])])
    assert d == pytest.approx(1.0) and 0 < p <= 1
    rows = (_rows("baseline", [20.0, 21.0, 22.0], [1.0, 1.1, 1.2])
            + _rows("ls", [21.0, 21.0, 23.0], [0.9, 1.0, 1.1])
            + _rows("ls", [23.0], [1.3]))  # a second run of seed 1
    pairs = quality.by_seed(rows, "ls", "bleu")
    assert pairs == [([21.0, 23.0], [20.0]), ([21.0], [21.0]), ([23.0], [22.0])]
    s = quality.summarize(rows, ["baseline", "ls"], "synthetic")["ls"]
    assert s["paired_seeds"] == 3 and s["paired"]["bleu"][0] == pytest.approx((2 + 0 + 1) / 3)
    assert "| ls | 3 | +1.00 (" in quality.tables(rows, {"baseline": quality.summarize(
        rows, ["baseline", "ls"], "synthetic")["baseline"], "ls": s})


def test_tables_from_several_calls_count_a_repeated_run_once(tmp_path, capsys):
    """fairseq's baseline repeats bitwise on one GPU: a second call's identical baseline rows
    are left out of the pooled table (said in one line); ls_ rows of the same seed that differ
    are two runs."""
    base = _rows("baseline", [25.0, 26.0], [1.1, 1.0])
    first = _rows("ls", [24.0, 27.0], [1.05, 0.95])
    second = _rows("ls", [25.5, 26.5], [1.00, 1.02])
    for name, rows in (("a", base + first), ("b", base + second)):
        (tmp_path / f"{name}.json").write_text(json.dumps(
            dict(rows=rows, summary={"baseline": {}, "ls": {}}, recipe="real")))
    summary = quality.main(["--tables-from", f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}"])
    assert summary["baseline"]["n"] == 2 and summary["ls"]["n"] == 4
    assert "(2 runs left out: exact repeats of a run in another file)" in capsys.readouterr().out


def test_recipes_fill_unset_options():
    real = quality.parse_args([])
    assert (real.recipe, real.model, real.max_update, real.lr, real.dropout) == \
        ("real", "base", 3000, 7e-4, 0.3)
    synthetic = quality.parse_args(["--corpus", "synthetic", "--max-update", "20"])
    assert (synthetic.recipe, synthetic.model, synthetic.max_update, synthetic.lr) == \
        ("synthetic", "small", 20, 1e-3)
    assert quality.parse_args(["--corpus", "/some/dir"]).recipe == "real"


def test_medians_and_low_runs_are_reported_beside_the_verdict():
    """One bad run in six moves the mean past the band; the median and the count of low runs
    say so, and the verdict stays the mean's."""
    rows = (_rows("baseline", [99.0, 99.2, 99.4, 99.1, 99.3, 99.2], [1.0] * 6)
            + _rows("ls", [99.1, 99.3, 99.2, 95.0, 99.2, 99.3], [1.0] * 5 + [1.04]))
    s = quality.summarize(rows, ["baseline", "ls"], "synthetic")
    assert s["ls"]["d_bleu"] == pytest.approx(-0.683, abs=1e-3) and not s["ls"]["pass"]
    assert s["ls"]["verdict"] == "within noise"
    assert s["ls"]["d_bleu_median"] == pytest.approx(0.0) and s["ls"]["low_runs"] == 1
    assert s["baseline"]["low_runs"] == 0 and quality.median([]) is None
    assert "| within noise | " in quality.tables(rows, s)
    assert "| 99.20 (+0.00) | 1 |" in quality.tables(rows, s)


def test_loss_curves_against_the_baseline(tmp_path, capsys):
    """The curve table: per logged update >= 300 held by every run, the variant's seed mean
    minus the baseline's; updates some run lacks and failed runs are left out. Closed-form
    curves: ls sits 0.1 above at 300 and 0.3 above at 400, so mean +0.2, s.d. 0.1414."""
    def run(variant, seed, curve, **extra):
        return dict(variant=variant, seed=seed, bleu=90.0, length_ratio=1.0, degenerate=0,
                    valid_loss=2.0, updates=500, overflows=0, train_s=1.0, train_curve=curve,
                    **extra)

    rows = [run("baseline", 1, [[100, 9.0], [300, 3.0], [400, 2.0], [500, 1.0]]),
            run("baseline", 2, [[100, 8.0], [300, 3.2], [400, 2.2]]),  # no 500: left out
            run("ls", 1, [[100, 7.0], [300, 3.2], [400, 2.4], [500, 1.0]]),
            run("ls", 2, [[300, 3.2], [400, 2.4], [500, 1.5]]),
            dict(variant="ls", seed=3, error="fairseq-train exit 1")]
    gaps = quality.curve_gaps(rows, ["baseline", "ls"])
    assert list(gaps) == ["ls"]
    g = gaps["ls"]
    assert (g["first"], g["last"], g["intervals"], g["runs"]) == (300, 400, 2, 2)
    assert g["mean"] == pytest.approx(0.2) and g["sd"] == pytest.approx(0.1414, abs=1e-4)
    table = quality.tables(rows, quality.summarize(rows, ["baseline", "ls"]))
    assert "| ls | 300–400 | 2 | +0.2000 | 0.1414 |" in table
    # --tables-from prints the same tables from a saved --json file, without training
    saved = tmp_path / "q.json"
    saved.write_text(json.dumps(dict(rows=rows, summary={"baseline": {}, "ls": {}})))
    quality.main(["--tables-from", str(saved)])
    assert capsys.readouterr().out.strip() == table


@pytest.mark.slow
def test_pipeline_end_to_end_on_cpu(tmp_path, tiny_corpus):
    """fairseq-train and -generate for a fairseq and an ls_ variant (tiny model, a few updates:
    the pipeline, not the quality) on a corpus folder (the real recipe's way in: the bench
    tests' shared corpus, binarised already), then the tables and the results file."""
    out = tmp_path / "q.json"
    summary = quality.main(["--corpus", tiny_corpus, "--model", "tiny", "--max-update", "8",
                            "--max-tokens", "512", "--warmup-updates", "4", "--variants",
                            "baseline,ls", "--seeds", "1", "--jobs", "2", "--workdir",
                            str(tmp_path / "w"), "--json", str(out), "--markdown",
                            str(tmp_path / "q.md")])
    data = results.load(str(out))
    assert data["script"] == "bench/quality.py" and data["device"] == "cpu"
    assert [r["variant"] for r in data["rows"]] == ["baseline", "ls"]
    assert data["gpus"] == 1 and data["ddp_backend"] is None and data["recipe"] == "real"
    for r in data["rows"]:
        assert "error" not in r, r
        assert r["gpus"] == 1 and "ddp_backend" not in r
        assert r["updates"] == 8 and r["valid_loss"] > 0 and 0 <= r["bleu"] <= 100
        assert r["sys_len"] > 0 and r["ref_len"] > 0
        assert r["valid_curve"][-1] == [8, r["valid_loss"]] and "overlong_examples" in r
    assert summary["ls"]["n"] == 1 and summary["ls"]["verdict"] == "too few seeds"
    md = (tmp_path / "q.md").read_text()
    assert "| baseline | 1 |" in md and "1 GPU per run, 8 updates of 512 tokens" in md
    # the saved file prints its tables again
    assert quality.main(["--tables-from", str(out)]) == summary


def test_benches_side_by_side_prepare_the_corpus_once(monkeypatch, tmp_path):
    """Two benches sharing --workdir: the second waits for the first's corpus and binarisation
    (before the lock, both ran fairseq-preprocess into one folder and one failed)."""
    import argparse
    import threading
    import time

    events, busy = [], []

    def write_corpus(text_dir, train):
        busy.append(1)
        assert len(busy) == 1, "two preparations at once"
        time.sleep(0.3)
        os.makedirs(text_dir, exist_ok=True)
        open(os.path.join(text_dir, "test.de"), "w").close()
        events.append("corpus")
        busy.pop()

    def preprocess(text_dir, workers, src, tgt, dest):
        if not os.path.exists(dest):
            busy.append(1)
            assert len(busy) == 1, "two binarisations at once"
            time.sleep(0.3)
            os.makedirs(dest)
            events.append("preprocess")
            busy.pop()
        return dest

    monkeypatch.setattr(corpora, "write_learnable_sentences", write_corpus)
    monkeypatch.setattr(corpora, "preprocess", preprocess)
    a = argparse.Namespace(langs="en,de", workdir=str(tmp_path), corpus="synthetic",
                           train_sentences=100)
    results, errors = [], []

    def bench():
        try:
            results.append(quality.prepare_corpus(a))
        except AssertionError as e:
            errors.append(e)

    threads = [threading.Thread(target=bench) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and events == ["corpus", "preprocess"]
    assert results[0] == results[1] == (str(tmp_path / "synthetic_100"),
                                        str(tmp_path / "synthetic_100" / "bin"), "en", "de")
    # a given text folder is binarised under --workdir, never beside the text
    a.corpus = str(tmp_path / "given")
    assert quality.prepare_corpus(a)[1] == str(tmp_path / "given_bin")


def test_overlong_examples_are_the_longest_against_their_references():
    hyps = ["a b", "x y y y y y", "p q r", "m"]
    refs = ["a b", "x y", "p q", "m n"]
    assert quality.overlong_examples(hyps, refs, k=2) == [
        {"hypothesis": "x y y y y y", "reference": "x y", "extra_words": 4},
        {"hypothesis": "p q r", "reference": "p q", "extra_words": 1}]
    assert quality.overlong_examples(["a"], ["a b"]) == []  # none longer: none kept


# ---- the real-text corpus and the optimizer shadow -------------------------------------------

def _write_catalog(path, messages):
    """A compiled gettext catalog (.mo) of {msgid: msgstr}, as msgfmt writes it."""
    import struct

    ids = sorted(messages)
    keys = b"".join(k.encode() + b"\0" for k in ids)
    values = b"".join(messages[k].encode() + b"\0" for k in ids)
    n = len(ids)
    key_start = 7 * 4 + 16 * n
    value_start = key_start + len(keys)
    table, offset = [], 0
    for k in ids:
        table.append((len(k.encode()), key_start + offset))
        offset += len(k.encode()) + 1
    vtable, offset = [], 0
    for k in ids:
        vtable.append((len(messages[k].encode()), value_start + offset))
        offset += len(messages[k].encode()) + 1
    out = struct.pack("Iiiiiii", 0x950412de, 0, n, 7 * 4, 7 * 4 + 8 * n, 0, 0)
    out += b"".join(struct.pack("ii", *e) for e in table + vtable) + keys + values
    path.write_bytes(out)


def test_real_corpus_from_gettext_catalogs(tmp_path, monkeypatch):
    """Pairs from compiled catalogs: tokenised and lower-cased, accelerators dropped,
    multi-line messages split where the line counts agree, over-long and badly matched pairs
    dropped, iso-codes name lists left out, a split by hash (independent of file order), and a
    clear error when a machine has too few pairs."""
    cats = tmp_path / "cats"
    cats.mkdir()
    messages = {f"Cannot open file number {i}": f"Datei Nummer {i} kann nicht geöffnet werden"
                for i in range(60)}
    messages.update({"&Open\nSave _As": "Ö&ffnen\nSpeichern _unter",
                     "word": " ".join(["viele"] * 20),               # 1 vs 20 tokens: dropped
                     " ".join(["long"] * 61): "lang",                # > 60 tokens: dropped
                     "": "Content-Type: text/plain; charset=UTF-8\n"})  # the header entry
    _write_catalog(cats / "app.mo", messages)
    _write_catalog(cats / "iso_3166-2.mo", {"Lower Saxony": "Niedersachsen"})
    pairs = real_corpus.sentence_pairs(sorted(cats.glob("*.mo")))
    assert pairs["cannot open file number 7"] == "datei nummer 7 kann nicht geöffnet werden"
    assert pairs["open"] == "öffnen" and pairs["save as"] == "speichern unter"
    assert "word" not in pairs and "lower saxony" not in pairs and len(pairs) == 62
    monkeypatch.setattr(real_corpus, "TEST", 5)
    monkeypatch.setattr(real_corpus, "VALID", 5)
    train, valid, test = real_corpus.split(pairs)
    assert (len(train), len(valid), len(test)) == (52, 5, 5)
    assert real_corpus.split(dict(reversed(list(pairs.items())))) == (train, valid, test)
    with pytest.raises(RuntimeError, match="62 sentence pairs from 1 catalogs"):
        real_corpus.write_corpus(str(tmp_path / "out"), str(cats / "*.mo"))
    monkeypatch.setattr(real_corpus, "MIN_TRAIN", 10)
    info = real_corpus.write_corpus(str(tmp_path / "out"), str(cats / "*.mo"))
    assert info["pairs"] == {"train": 52, "valid": 5, "test": 5} and info["catalogs"] == 1
    assert len(_read(tmp_path / "out" / "train.en")) == len(_read(tmp_path / "out" / "train.de"))


def _flat_fused_optimizer(monkeypatch):
    """ls_adam's LSFusedFP16Optimizer with fairseq's flat fp32 master, on the CPU."""
    import torch
    from fairseq.optim.fp16_optimizer import FP16Optimizer
    from fairseq_helpers import fp16_optimizer_cfg

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # fairseq keys the flat master
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).half()) for s in [(7,), (33, 5)]]
    opt = FP16Optimizer.build_optimizer(
        fp16_optimizer_cfg("ls_adam", ["--fp16-scale-window", "3"]), params)
    assert torch.is_tensor(opt.master) and opt.defers_host_reads
    return params, opt


@pytest.mark.parametrize("planted", [None, "master", "step"])
def test_adam_shadow_accepts_ls_adam_and_catches_a_wrong_step(monkeypatch, planted):
    """The adam_shadow probe on the CPU (the reference Adam path): ls_adam's steps, overflows
    included, are fairseq's formula to the float32 spacing; a planted wrong master update or a
    wrong step count is caught."""
    import io

    from fairseq_helpers import fp16_trainer_run
    from ls_fairseq.optim.ls_adam import LSFusedFP16Optimizer

    original = LSFusedFP16Optimizer.step

    def step(opt, closure=None, groups=None):
        out = original(opt, closure, groups)
        if planted == "master":
            opt.master.data[3] += 1e-3
        elif planted == "step":
            opt.fp32_optimizer.optimizer.state[opt.master]["step"] += 1
        return out

    params, opt = _flat_fused_optimizer(monkeypatch)
    out = io.StringIO()
    shadow = adam_shadow.Shadow(out)
    monkeypatch.setattr(LSFusedFP16Optimizer, "step", shadow.wrap(step))
    fp16_trainer_run(opt, params, 8, 1, overflow_at=(3,))
    s = shadow.summary()
    assert (s["updates"], s["real_steps"], s["overflows"]) == (8, 7, 1)
    assert len(out.getvalue().splitlines()) == 8
    bad = {k: v for k, v in s["bad_updates"].items() if v}
    if planted is None:
        assert bad == {} and max(s["worst_ulps"].values()) <= adam_shadow.MAX_ULPS
    elif planted == "master":
        assert bad.get("master", 0) >= 6 and bad.get("fp16", 0) >= 6
    else:
        assert bad.get("step", 0) >= 6


def test_adam_shadow_measures_the_master_at_its_operand_scale():
    """A step that nearly cancels a weight leaves a tiny value whose own float32 spacing is far
    below the rounding of ``p - step``: the master is measured at the spacing of the weight
    before the step, so that rounding is not reported as a wrong step, while an error of the
    weight's own size still is."""
    import torch

    p0, ref = torch.tensor([1.0, 0.5]), torch.tensor([3e-8, 0.25])
    rounded = ref + torch.tensor([6e-8, 0.0])  # one spacing of 1.0 (2^-23 ~ 1.2e-7) or less
    assert adam_shadow._ulps(rounded, ref) > 1e5  # at its own spacing: "wrong"
    assert adam_shadow._ulps(rounded, ref, p0) <= 1.0
    assert adam_shadow._ulps(ref + torch.tensor([1e-3, 0.0]), ref, p0) > adam_shadow.MAX_ULPS


def test_decode_runs_again_after_running_out_of_gpu_memory(monkeypatch):
    """The runs of a call share one GPU: a decode that ran out of memory runs again (the trained
    model is kept); any other failure, or the last attempt, is final."""
    import subprocess

    outcomes = []

    def fake_run(cmd, **kw):
        code, err = outcomes.pop(0)
        return subprocess.CompletedProcess(cmd, code, stdout="H-0\t-1\ta b\n", stderr=err)

    monkeypatch.setattr(quality.subprocess, "run", fake_run)
    monkeypatch.setattr(quality.time, "sleep", lambda s: None)
    oom = (1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    outcomes[:] = [oom, oom, (0, "")]
    gen, retries = quality.decode(["fairseq-generate"], {}, retries=3)
    assert gen.returncode == 0 and retries == 2 and not outcomes
    outcomes[:] = [oom, (1, "FileNotFoundError: no checkpoint"), (0, "")]
    gen, retries = quality.decode(["fairseq-generate"], {}, retries=3)
    assert gen.returncode == 1 and retries == 1 and len(outcomes) == 1
    outcomes[:] = [oom, oom]
    gen, retries = quality.decode(["fairseq-generate"], {}, retries=1)
    assert gen.returncode == 1 and "out of memory" in gen.stderr and retries == 1
