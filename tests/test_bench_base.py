"""bench/benchlib (the benchmarks' common base) on the CPU, and the fixtures the bench tests share.

* the results schema: the validator rejects each kind of bad header, the writer fills and checks
  the header and writes atomically, every file in docs/results validates, and the generated
  docs (docs/results/README.md, docs/PERFORMANCE.md's tables) equal what the generator writes
  from the files now;
* the log reader: fairseq's json and simple formats through ``ls_fairseq.cli.compare``'s
  parser (fairseq's own log lines, spawned workers' default-format lines), the probes' lines;
* every script's ``--help``: without a GPU, and without importing torch or fairseq;
* the shared fixtures: ``tiny_corpus`` (one small learnable corpus, binarised once per test run)
  and ``probed_run`` (one real CPU fairseq-train on it with every training probe on, read by
  tests/test_bench_e2e.py and tests/test_bench_multi_gpu.py).
"""
import functools
import glob
import json
import os
import subprocess
import sys

import pytest

import results as results_script  # bench/results.py (pytest.ini's pythonpath)
from benchlib import env, logs, results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "bench", "*.py")))


# --------------------------------------------------------------------------------------------
# shared fixtures: one tiny corpus and one probed fairseq-train per test run
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _tiny_corpus(root):
    """The learnable corpus's small vocabulary: 300 training sentences (~12 tokens: 8 batches of
    300 tokens an epoch), 24 valid, 16 test; binarised into ``root/bin`` (test included)."""
    from benchlib import corpora
    from ls_fairseq.testing import learnable_corpus

    learnable_corpus.write_corpus(root, train=300, valid=24, test=16, vocabulary="small")
    corpora.preprocess(root, 1)
    return root


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """Text ``{train,valid,test}.{en,de}`` and ``bin/`` of one small learnable corpus (shared by
    every bench test that trains: build it once)."""
    return _tiny_corpus(str(tmp_path_factory.getbasetemp() / "bench_tiny_corpus"))


def tiny_cpu_train_args(data, epochs):
    """fairseq-train's arguments (after the program) for a one-layer model on the CPU, logging
    every 2 updates as JSON: the real log format, in seconds."""
    return [data, "--arch", "transformer_iwslt_de_en", "--encoder-layers", "1", "--decoder-layers",
            "1", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
            "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
            "--encoder-attention-heads", "2", "--decoder-attention-heads", "2", "--optimizer",
            "adam", "--lr", "1e-3", "--max-tokens", "300", "--max-epoch", str(epochs), "--cpu",
            "--no-save", "--disable-validation", "--log-format", "json", "--log-interval", "2",
            "--num-workers", "0", "--criterion", "label_smoothed_cross_entropy"]


@functools.lru_cache(maxsize=None)
def _probed_run(corpus):
    probes = env.train_env(BENCH_MEMORY="1", BENCH_STAMPS="1", BENCH_CUDNN_SDPA="0")
    proc = subprocess.run(env.fairseq_cmd("train") + tiny_cpu_train_args(
        os.path.join(corpus, "bin"), epochs=3), capture_output=True, text=True, env=probes,
        timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def probed_run(tiny_corpus):
    """The log of one real (tiny, CPU) fairseq-train of 3 epochs with the training probes on,
    started as the benchmarks start it (``env.train_env``: the sitecustomize in every process)."""
    rc, log = _probed_run(tiny_corpus)
    assert rc == 0, log[-3000:]
    return log


# --------------------------------------------------------------------------------------------
# the results schema
# --------------------------------------------------------------------------------------------

def _valid():
    return dict(schema=results.SCHEMA, script="bench/e2e.py", what="a test",
                device="NVIDIA H100 80GB HBM3", commit="abc1234", torch="2.11.0+cu130",
                command="python bench/e2e.py", date="2026-11-26", rows=[{"variant": "ls"}])


@pytest.mark.parametrize("change,message", [
    (dict(schema="other/1"), "schema"),
    (dict(device=""), "device"),
    (dict(commit=None), "commit"),
    (dict(torch=2.11), "torch"),
    (dict(command=["a", "b"]), "command"),
    (dict(date="26.11.2026"), "date"),
    (dict(script="e2e.py"), "script"),
    (dict(script="tools/check.sh"), "script"),  # only bench/ and scripts/ hold the makers
    (dict(what="  "), "what"),
    (dict(rows=[]), "rows"),
    (dict(rows={"a": 1}), "rows"),
    (dict(rows=[{"a": 1}, 3]), "rows"),
    (dict(header_source="git"), "header_source"),
])
def test_the_validator_names_each_bad_header_field(change, message):
    assert results.problems(_valid()) == []
    found = results.problems(dict(_valid(), **change))
    assert len(found) == 1 and found[0].startswith(message), found
    with pytest.raises(ValueError, match=message):
        results.check(dict(_valid(), **change), "x.json")
    missing = _valid()
    del missing[message if message in missing else "device"]
    assert results.problems(missing)


def test_unknown_date_and_extra_keys_are_allowed():
    assert results.problems(dict(_valid(), script="scripts/check_prebuilt_wheel.sh")) == []
    assert results.problems(dict(_valid(), date="unknown", summary={"x": 1},
                                 header_source={"torch": "the same call's other file"})) == []
    assert results.problems([1, 2]) == ["not a JSON object but list"]


def test_the_writer_fills_the_header_and_checks_before_writing(tmp_path, monkeypatch):
    monkeypatch.setenv("LS_BENCH_COMMIT", "feed123")
    monkeypatch.setattr(env, "gpu_names", lambda: ["GPU A", "GPU A"])
    head = results.header("bench/quality.py", "what it is", "python bench/quality.py --x")
    assert head["commit"] == "feed123" and head["device"] == "GPU A, GPU A"
    assert head["torch"] == env.torch_version() != "unknown"
    path = tmp_path / "sub" / "r.json"
    written = results.write(str(path), head, [{"bleu": 1.0}], summary={"n": 1})
    assert json.loads(path.read_text()) == written == results.load(str(path))
    assert written["rows"] == [{"bleu": 1.0}] and written["summary"] == {"n": 1}
    with pytest.raises(ValueError, match="rows"):
        results.write(str(path), head, [])
    assert json.loads(path.read_text()) == written  # a refused write leaves the file as it was
    assert os.listdir(tmp_path / "sub") == ["r.json"]


def test_every_file_in_docs_results_follows_the_schema():
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "results", "*.json")))
    assert files
    bad = {os.path.basename(p): results.problems(json.load(open(p))) for p in files}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_results_index_and_the_performance_tables_are_generated_from_the_files():
    """docs/results/README.md and every table of docs/PERFORMANCE.md are what
    ``python bench/results.py index|tables --write`` writes from docs/results now: a table cannot
    drift from its data."""
    from benchlib import tables

    with open(os.path.join(ROOT, "docs", "results", "README.md")) as f:
        assert f.read() == tables.index_markdown(os.path.join(ROOT, "docs", "results"))
    with open(os.path.join(ROOT, "docs", "PERFORMANCE.md")) as f:
        doc = f.read()
    assert tables.render(doc, os.path.join(ROOT, "docs", "results")) == doc
    assert tables.table_names(doc) == sorted(tables.TABLES)  # each table placed once


def test_results_script_validates_and_refuses_a_bad_file(tmp_path, capsys):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(_valid()))
    bad.write_text(json.dumps(dict(_valid(), date="yesterday")))
    assert results_script.main(["validate", str(good)]) == 0
    assert results_script.main(["validate", str(good), str(bad)]) == 1
    assert "bad.json: date: 'yesterday'" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# the log reader
# --------------------------------------------------------------------------------------------

JSON_LOG = """\
2026-11-26 10:00:00 | INFO | fairseq_cli.train | {'_name': None, 'common': {}}
2026-11-26 10:00:05 | INFO | train_inner | {"epoch": 1, "update": 0.5, "loss": "9.5", \
"wps": "1000", "wpb": "400", "num_updates": "10", "gnorm": "inf", "loss_scale": "64", \
"gb_free": "70.5"}
2026-11-26 10:00:09 | INFO | train | {"epoch": 1, "train_loss": "9.1", "train_wps": "950", \
"train_wpb": "390", "train_num_updates": "20", "train_wall": "9"}
INFO:train_inner:{"epoch": 2, "update": 1.5, "loss": "8.5", "wps": "1200", "wpb": "400", \
"num_updates": "30", "gb_free": "69.0"}
INFO:train:{"epoch": 2, "train_loss": "8.2", "train_wps": "1150", "train_wpb": "395", \
"train_num_updates": "40", "train_wall": "17"}
BENCH_INTERVAL_END rank=1 5.5
BENCH_INTERVAL_END rank=0 5.0
noise BENCH_INTERVAL_END rank=0 99.0
BENCH_INTERVAL_END rank=0 1.25e+01BENCH_EPOCH_END rank=0 13.0
BENCH_MEMORY rank=1 total=1000 reserved_max=300 used_max=400
BENCH_MEMORY rank=0 total=1000 reserved_max=310 used_max=420
"""

SIMPLE_LOG = """\
2026-11-26 10:00:00 | INFO | train_inner | epoch 004:    100 / 375 loss=2.3, nll_loss=0.2, \
wps=1000, ups=3, wpb=4000, num_updates=1400, gnorm=0.4, loss_scale=16
2026-11-26 10:00:01 | INFO | train | epoch 004 | loss 2.1 | wps 990 | num_updates 1500 | \
loss_scale 8
2026-11-26 10:00:02 | INFO | valid | epoch 004 | valid on 'valid' subset | loss 2.04 | \
nll_loss 0.092 | num_updates 1500
"""


def test_json_logs_of_the_trainer_and_of_spawned_workers():
    run = logs.parse(JSON_LOG)
    assert [(int(r["num_updates"]), r["loss"]) for r in run.inner] == [(10, 9.5), (30, 8.5)]
    assert sorted(run.epochs) == [1, 2] and run.epochs[2]["wps"] == 1150.0
    assert run.epochs[1]["wall"] == 9.0 and run.inner[0]["gnorm"] == float("inf")
    assert logs.losses(run) == [(10, 9.5), (30, 8.5)] and logs.loss_scales(run) == [(10, 64.0)]
    assert logs.time_weighted_wps(run.inner) == 800 / (400 / 1000 + 400 / 1200)
    # fairseq's peak allocated: total - the smallest gb_free
    assert logs.peak_allocated_gb(run, 100 * logs.GIB) == pytest.approx(31.0)
    assert logs.peak_allocated_gb(run, None) is None


def test_simple_logs_and_validation_lines():
    run = logs.parse(SIMPLE_LOG)
    assert [r["loss"] for r in run.inner] == [2.3] and run.inner[0]["loss_scale"] == 16.0
    assert run.epochs[4]["loss_scale"] == 8.0 and run.epochs[4]["num_updates"] == 1500
    assert [(r["subset"], r["loss"], r["nll_loss"]) for r in run.valid] == [("valid", 2.04, 0.092)]


def test_the_probes_lines():
    # the lowest rank's stamps, in order; a stamp glued to the next one is still read
    assert logs.interval_ends(JSON_LOG) == [5.0, 12.5]
    assert logs.epoch_ends(JSON_LOG) == [13.0]
    assert logs.memory(JSON_LOG) == [
        {"rank": 0, "total_bytes": 1000, "reserved_max_bytes": 310, "used_max_bytes": 420},
        {"rank": 1, "total_bytes": 1000, "reserved_max_bytes": 300, "used_max_bytes": 400}]
    assert logs.memory("noise BENCH_MEMORY rank=0 total=1 reserved_max=1 used_max=2\n") == []


# --------------------------------------------------------------------------------------------
# the environment
# --------------------------------------------------------------------------------------------

def test_commit_devices_and_the_probes_path(monkeypatch):
    monkeypatch.setenv("LS_BENCH_COMMIT", "0d45ba2")
    assert env.commit() == "0d45ba2"
    monkeypatch.delenv("LS_BENCH_COMMIT")
    assert "not LS_BENCH_COMMIT" in env.commit()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5,7")
    assert env.visible_gpus(2) == ["3", "5"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert env.visible_gpus(3) == ["0", "1", "2"]
    probes = env.train_env({"PYTHONPATH": "/x"}, BENCH_MEMORY=1)
    assert probes["PYTHONPATH"] == env.SITE_DIR + os.pathsep + "/x"
    assert probes["BENCH_MEMORY"] == "1"
    # the folder on the child's path holds the sitecustomize only: nothing else to shadow
    assert sorted(f for f in os.listdir(env.SITE_DIR) if f.endswith(".py")) == \
        ["sitecustomize.py"]


def test_the_gemm_rate_is_read_from_its_probe(monkeypatch):
    """The probe runs in a subprocess (no CUDA context in the benchmark's process); a probe
    that printed no figure (no GPU) gives None."""
    outputs, seen = ["warming up\nBENCH_GEMM_TFLOPS 712.25\n", "Traceback: no CUDA\n"], []

    class Done:
        def __init__(self, stdout):
            self.stdout = stdout

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        return Done(outputs.pop(0))

    monkeypatch.setattr(env.subprocess, "run", fake_run)
    assert env.gemm_tflops() == 712.25 and env.gemm_tflops() is None
    assert all(cmd[1].endswith(os.path.join("probes", "gemm_rate.py")) for cmd in seen)


# --------------------------------------------------------------------------------------------
# the scripts
# --------------------------------------------------------------------------------------------

def test_bench_holds_at_most_ten_scripts():
    """Every file directly in bench/ but its README counts (Python scripts and the shell
    helpers); the base package bench/benchlib/ does not."""
    top = sorted(f for f in os.listdir(os.path.join(ROOT, "bench"))
                 if os.path.isfile(os.path.join(ROOT, "bench", f)) and f != "README.md")
    assert len(top) <= 10, top


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_without_a_gpu_imports_neither_torch_nor_fairseq(script):
    """``--help`` of every script: exit 0, a usage line, and (``python -X importtime``) no
    import of torch or fairseq, which take seconds; the scripts import them when they run."""
    proc = subprocess.run([sys.executable, "-X", "importtime", os.path.join("bench", script),
                           "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    assert not imported & {"torch", "fairseq", "ls_fairseq", "numpy"}, script


def test_shard_balance_names_match_its_model():
    """bench/shard_balance.py lists the model's orders without importing it (``--help``)."""
    import shard_balance
    from benchlib import shard_model

    assert shard_balance.ORDERS == shard_model.ORDERS
    assert shard_balance.POLICIES == tuple(shard_model.POLICIES)
    assert shard_balance.MATCH_WINDOW == shard_model.MATCH_WINDOW
    assert shard_balance.simulate is shard_model.simulate  # the model's names, through the script
