"""recipes/wmt14_en_de and ls-fairseq-quickstart, end to end on CPU with tiny data.

prepare.sh runs on a raw directory in the layout of the WMT14 archives (generated here, never
downloaded); train.sh (baseline and ls) gets a tiny model through its pass-through fairseq
arguments;
evaluate.sh averages real checkpoints and scores with sacreBLEU and fairseq-score; the comparison
tool reads what they wrote.
"""
import json
import os
import shlex
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from ls_fairseq.cli import quickstart

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(REPO, "recipes", "wmt14_en_de")

# a tiny model through the scripts' pass-through arguments (wins over the recipe's defaults)
TINY = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2", "--warmup-updates", "10", "--lr", "0.002", "--dropout", "0.1",
        "--log-interval", "4", "--num-workers", "0"]


def env():
    e = dict(os.environ, PYTHONWARNINGS="ignore")
    e["PYTHONPATH"] = REPO + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    # the console scripts of this interpreter first (fairseq-train, sacremoses, subword-nmt...)
    e["PATH"] = os.path.dirname(sys.executable) + os.pathsep + e.get("PATH", "")
    return e


def modules_only_env():
    """No console scripts on PATH (as after pip install --target / --user): the recipes must fall
    back to `python -m fairseq_cli.train`, `python -m sacremoses`..."""
    return dict(env(), PATH="/usr/bin:/bin", PYTHON=sys.executable)


def sh(script, *args, check=True, environ=None):
    proc = subprocess.run(["bash", os.path.join(RECIPES, script)] + [str(a) for a in args],
                          capture_output=True, text=True, env=environ or env())
    if check and proc.returncode != 0:
        raise AssertionError("{} {} failed ({}):\n{}\n{}".format(script, " ".join(map(str, args)), proc.returncode,
                                                                 proc.stdout[-4000:], proc.stderr[-4000:]))
    return proc


def need_tools():
    for mod in ("sacremoses", "subword_nmt", "sacrebleu", "pandas"):
        pytest.importorskip(mod)


# --------------------------------------------------------------------------------------------
# train.sh baseline|ls: same recipe, only the names differ
# --------------------------------------------------------------------------------------------

def test_train_script_takes_the_variant_first():
    for args in ([], ["--data", "DATA", "--save-dir", "SAVE", "--dry-run"], ["ls_adam", "--dry-run"]):
        proc = sh("train.sh", *args, check=False)
        assert proc.returncode == 2 and "the first argument is the variant, baseline or ls" in proc.stderr
    for args in (["--help"], ["ls", "--help"]):
        proc = sh("train.sh", *args)
        assert "train.sh baseline|ls --data DATA_BIN --save-dir DIR" in proc.stdout


def dry_run(variant, *args):
    out = sh("train.sh", variant, "--data", "DATA", "--save-dir", "SAVE", "--dry-run", *args).stdout.strip()
    return shlex.split(out)


def test_dry_run_commands_are_the_recipe():
    base = dry_run("baseline", "--gpus", "2", "--max-tokens", "8192", "--update-freq", "3",
                   "--encoder-layers", "2")
    ls = dry_run("ls", "--gpus", "2", "--max-tokens", "8192", "--update-freq", "3", "--encoder-layers", "2")
    i = ls.index("--user-dir")
    user_dir = ls[i + 1]
    assert os.path.isfile(os.path.join(user_dir, "__init__.py")) and os.path.basename(user_dir) == "ls_fairseq"
    ls_without = ls[:i] + ls[i + 2:]
    renamed = [{"transformer_wmt_en_de_big_t2t": "ls_transformer_wmt_en_de_big_t2t",
                "label_smoothed_cross_entropy": "ls_label_smoothed_cross_entropy", "adam": "ls_adam"}.get(a, a)
               for a in base]
    assert renamed == ls_without

    def opt(cmd, name):
        return cmd[cmd.index(name) + 1]

    assert base[:2] == ["fairseq-train", "DATA"]
    proc = sh("train.sh", "baseline", "--data", "DATA", "--save-dir", "SAVE", "--dry-run",
              environ=modules_only_env())
    assert shlex.split(proc.stdout)[:4] == [sys.executable, "-m", "fairseq_cli.train", "DATA"]
    expected = {"--arch": "transformer_wmt_en_de_big_t2t", "--optimizer": "adam", "--adam-betas": "(0.9, 0.98)",
                "--lr": "0.0005", "--lr-scheduler": "inverse_sqrt", "--warmup-updates": "4000",
                "--warmup-init-lr": "1e-07", "--dropout": "0.3", "--weight-decay": "0.0", "--clip-norm": "0.0",
                "--criterion": "label_smoothed_cross_entropy", "--label-smoothing": "0.1",
                "--max-tokens": "8192", "--update-freq": "3", "--distributed-world-size": "2",
                "--save-dir": "SAVE", "--log-file": "SAVE/train.fairseq.log", "--log-format": "simple"}
    for k, v in expected.items():
        assert opt(base, k) == v, k
    assert "--fp16" in base and "--share-all-embeddings" in base and "--cpu" not in base
    assert base[-2:] == ["--encoder-layers", "2"]  # pass-through arguments come last and win

    cpu = dry_run("baseline", "--gpus", "0")
    assert "--cpu" in cpu and "--fp16" not in cpu and opt(cpu, "--update-freq") == "1"
    one = dry_run("baseline", "--gpus", "1")
    assert opt(one, "--update-freq") == "8"  # the batch of the 8-GPU recipe
    four = dry_run("ls", "--gpus", "4")
    assert opt(four, "--update-freq") == "2" and opt(four, "--distributed-world-size") == "4"


def test_train_script_needs_data_and_save_dir():
    proc = sh("train.sh", "baseline", "--save-dir", "x", "--dry-run", check=False)
    assert proc.returncode == 2 and "--data DATA_BIN is required" in proc.stderr


# --------------------------------------------------------------------------------------------
# prepare.sh
# --------------------------------------------------------------------------------------------

def test_prepare_reports_missing_raw_files(tmp_path):
    need_tools()
    raw = tmp_path / "raw"
    (raw / "training").mkdir(parents=True)
    (raw / "training" / "europarl-v7.de-en.en").write_text("Hello .\n")
    proc = sh("prepare.sh", "--raw-dir", raw, "--out-dir", tmp_path / "out", check=False)
    assert proc.returncode != 0
    assert "missing" in proc.stderr
    assert "commoncrawl.de-en.en" in proc.stderr and "newstest2014-deen-ref.de.sgm" in proc.stderr
    proc = sh("prepare.sh", "--no-download", "--out-dir", tmp_path / "out2", check=False)
    assert proc.returncode != 0 and "--no-download" in proc.stderr


def _moses(lines, lang, normalize):
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    norm = MosesPunctNormalizer(lang=lang, post_remove_control_chars=True)
    tok = MosesTokenizer(lang=lang)
    out = []
    for s in lines:
        if normalize:
            s = norm.normalize(s)
        out.append(tok.tokenize(s, return_str=True, aggressive_dash_splits=True, escape=True))
    return out


def _unbpe(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n").replace("@@ ", "") for line in f]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """prepare.sh on the .tgz files as downloaded from statmt.org, given with --raw-dir (no
    network); shared by the checks below and the end-to-end run."""
    need_tools()
    tmp = tmp_path_factory.mktemp("wmt")
    extracted = tmp / "extracted"
    corpus = quickstart.write_wmt_raw_dir(str(extracted), 400, 30, seed=3)
    raw = tmp / "downloads"
    raw.mkdir()
    archives = {
        "training-parallel-europarl-v7.tgz": ["training/europarl-v7.de-en.en", "training/europarl-v7.de-en.de"],
        "training-parallel-commoncrawl.tgz": ["commoncrawl.de-en.en", "commoncrawl.de-en.de"],
        "training-parallel-nc-v9.tgz": ["training/news-commentary-v9.de-en.en", "training/news-commentary-v9.de-en.de"],
        "test-full.tgz": ["test-full/newstest2014-deen-src.en.sgm", "test-full/newstest2014-deen-ref.de.sgm"],
    }
    for name, members in archives.items():
        with tarfile.open(raw / name, "w:gz") as tar:
            for m in members:
                tar.add(extracted / m, arcname=m)
    out = tmp / "wmt14"
    # CHUNK_MIN_LINES: exercise the parallel (chunked) tokenisation; no console scripts on PATH:
    # exercise the fallback to the modules (sacremoses, subword_nmt, fairseq_cli.preprocess)
    e = dict(modules_only_env(), CHUNK_MIN_LINES="50")
    # --valid-every 20: 20 valid pairs (fairseq needs at least one full batch of 8 to validate)
    proc = subprocess.run(["bash", os.path.join(RECIPES, "prepare.sh"), "--raw-dir", str(raw), "--out-dir", str(out),
                           "--bpe-tokens", "150", "--workers", "2", "--valid-every", "20"],
                          capture_output=True, text=True, env=e)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, corpus


@pytest.mark.slow
def test_prepare_from_downloaded_archives(prepared):
    out, ((train_en, train_de), (test_en, test_de)) = prepared
    # joined dictionary, all splits binarised
    dict_en = (out / "data-bin" / "dict.en.txt").read_text()
    assert dict_en == (out / "data-bin" / "dict.de.txt").read_text() and len(dict_en.splitlines()) > 50
    for split in ("train", "valid", "test"):
        for lang in ("en", "de"):
            assert (out / "data-bin" / "{}.en-de.{}.bin".format(split, lang)).stat().st_size > 0
    merges = (out / "code").read_text().splitlines()
    assert merges[0].startswith("#version") and 50 < len(merges) - 1 <= 150
    # untokenised newstest2014 kept for sacreBLEU, exactly the sgm text
    assert (out / "ref" / "newstest2014.en").read_text().splitlines() == test_en
    assert (out / "ref" / "newstest2014.de").read_text().splitlines() == test_de
    # test: tokenised (no punctuation normalisation, as in fairseq's script), BPE applied, not cleaned
    test_bpe = (out / "test.en").read_text()
    assert "@@ " in test_bpe and "@-@" in test_bpe and "&quot;" in test_bpe
    assert _unbpe(out / "test.en") == _moses(test_en, "en", normalize=False)
    assert _unbpe(out / "test.de") == _moses(test_de, "de", normalize=False)
    # valid = every 20th pair of the concatenated corpora, normalised + tokenised
    assert _unbpe(out / "valid.en") == _moses(train_en[19::20], "en", normalize=True)
    assert _unbpe(out / "valid.de") == _moses(train_de[19::20], "de", normalize=True)
    # train = the rest, minus pairs dropped by the length-ratio cleaning (clean-corpus-n -ratio 1.5)
    rest_en = _moses([s for i, s in enumerate(train_en) if (i + 1) % 20], "en", normalize=True)
    got_en = _unbpe(out / "train.en")
    it = iter(rest_en)
    assert all(any(line == x for x in it) for line in got_en), "train.en is not an ordered subset of the corpus"
    assert len(got_en) >= 0.95 * len(rest_en)
    for s, t in zip((out / "train.en").read_text().splitlines(), (out / "train.de").read_text().splitlines()):
        ns, nt = len(s.split()), len(t.split())
        assert 1 <= ns <= 250 and 1 <= nt <= 250 and ns / nt <= 1.5 and nt / ns <= 1.5


# --------------------------------------------------------------------------------------------
# prepare -> train both -> evaluate -> compare
# --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_recipes_end_to_end(prepared, tmp_path, capsys):
    out, _ = prepared
    data = out / "data-bin"

    runs = {name: tmp_path / "runs" / name for name in ("baseline", "ls")}
    # the ls_ side runs with no console script on PATH: the recipes' fallback to the modules
    environs = {"baseline": env(), "ls": modules_only_env()}

    def train(name):  # the two sides run at the same time (one core each; nothing compares speed)
        save = runs[name]
        sh("train.sh", name, "--data", data, "--save-dir", save, "--gpus", "0", "--max-tokens", "1500",
           "--max-update", "24", *TINY, environ=environs[name])
        assert (save / "train.log").is_file() and (save / "train.fairseq.log").is_file()
        assert len([f for f in os.listdir(save) if f.startswith("checkpoint") and f[10:-3].isdigit()]) >= 2
        if name == "ls":
            assert "--user-dir" in (save / "command.txt").read_text()
            assert "-m fairseq_cli.train" in (save / "command.txt").read_text()
            assert "ls_transformer_wmt_en_de_big_t2t" in (save / "train.log").read_text()
            return
        assert (save / "command.txt").read_text().split("\n")[1].startswith("fairseq-train ")
        # a restart: the same command with a higher --max-update resumes from checkpoint_last.pt
        # and appends to train.log
        sh("train.sh", "baseline", "--data", data, "--save-dir", save, "--gpus", "0", "--max-tokens", "1500",
           "--max-update", "32", *TINY)

    def evaluate(name):
        return sh("evaluate.sh", "--data", data, "--save-dir", runs[name], "--last", "2", "--cpu",
                  "--max-len-b", "8", environ=environs[name])

    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(train, name) for name in runs]:
            done.result()
        evaluated = dict(zip(runs, pool.map(evaluate, runs)))
    for name, save in runs.items():
        proc = evaluated[name]
        assert "sacreBLEU (detok):" in proc.stdout
        ev = save / "eval"
        assert "averaging checkpoint" in proc.stderr
        sacre = json.loads((ev / "sacrebleu.json").read_text())
        assert sacre["name"] == "BLEU" and 0 <= sacre["score"] <= 100 and "tok:13a" in sacre["signature"]
        # every test sentence translated (fairseq drops a partial last batch without
        # --required-batch-size-multiple 1), in order, detokenised
        hyps = (ev / "hyp.detok.de").read_text().splitlines()
        assert len(hyps) == 30 == len((out / "ref" / "newstest2014.de").read_text().splitlines())
        assert not any("@@" in h or "&quot;" in h for h in hyps)
        assert "BLEU4 = " in (ev / "compound_split_bleu.txt").read_text()
        assert (ev / "checkpoint_avg.pt").stat().st_size > 0

    from ls_fairseq.cli import compare

    rc = compare.main([str(runs["baseline"]), str(runs["ls"]), "--out-dir", str(tmp_path / "cmp")])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "| metric | baseline | ls | ls / baseline |" in text
    assert "| updates | 32 | 24 |" in text
    for row in ("| wps, epoch 1 (cold) |", "| wps (interval mean, all epochs) |",
                "| BLEU sacreBLEU (detok) |", "| BLEU tok + compound split |",
                "| final valid loss |"):
        assert row in text
    assert "- baseline: session 2 resumed at update 24" in text  # the restart above
    for png in ("loss_vs_updates.png", "loss_vs_wallclock.png", "wps_over_time.png"):
        assert (tmp_path / "cmp" / png).stat().st_size > 10000


# --------------------------------------------------------------------------------------------
# quickstart
# --------------------------------------------------------------------------------------------

def test_synthetic_tokenisation_is_moses():
    pytest.importorskip("sacremoses")
    en, de = quickstart.synthetic_corpus(400, seed=7)
    assert quickstart.tokenize('"A well-known cat".') == "&quot; A well @-@ known cat &quot; ."
    assert [quickstart.tokenize(s) for s in en] == _moses(en, "en", normalize=False)
    assert [quickstart.tokenize(s) for s in de] == _moses(de, "de", normalize=False)
    assert [quickstart.detokenize(quickstart.tokenize(s)) for s in de] == de
    # the grammar really reorders: verb-final subordinate clauses
    assert any(", weil" in s for s in de)


@pytest.mark.slow
def test_quickstart_short_cpu_run(tmp_path, capsys):
    pytest.importorskip("pandas")
    rc = quickstart.main(["--workdir", str(tmp_path / "qs"), "--device", "cpu", "--train-sentences", "300",
                          "--valid-sentences", "24", "--test-sentences", "24", "--max-update", "12",
                          "--log-interval", "4", "--minutes", "3"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "| metric | baseline | ls | ls / baseline |" in text
    assert "| updates | 12 | 12 |" in text
    assert "| BLEU sacreBLEU (detok) |" in text
    for name in ("baseline", "ls"):
        run = tmp_path / "qs" / "runs" / name
        assert json.loads((run / "eval" / "sacrebleu.json").read_text())["name"] == "BLEU"
        assert len((run / "eval" / "hyp.detok.de").read_text().splitlines()) == 24
    assert "ls_transformer_wmt_en_de_big_t2t" in (tmp_path / "qs" / "runs" / "ls" / "train.log").read_text()
    for png in ("loss_vs_updates.png", "loss_vs_wallclock.png", "wps_over_time.png"):
        assert str(tmp_path / "qs" / "compare" / png) in text
