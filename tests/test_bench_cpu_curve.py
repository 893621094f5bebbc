"""bench/cpu_curve.py: the gloo workers' command lines, the table against the first variant, and
one tiny real run of fairseq's baseline and ls_ as two CPU workers each (both orders of the
epoch's batches on the bench tests' shared corpus), with its results file."""
import cpu_curve  # bench/ (pytest.ini's pythonpath)
from benchlib import results
from test_bench_base import tiny_corpus  # noqa: F401  (the shared corpus)


def test_worker_commands():
    cmds = cpu_curve.worker_cmds(["train", "data"], 3)
    assert len(cmds) == 3
    for rank, cmd in enumerate(cmds):
        assert cmd[:2] == ["train", "data"]
        assert cmd[cmd.index("--distributed-rank") + 1] == str(rank)
        assert cmd[cmd.index("--distributed-backend") + 1] == "gloo"
        assert cmd[cmd.index("--ddp-backend") + 1] == "legacy_ddp"
        assert cmd[cmd.index("--distributed-world-size") + 1] == "3"
    inits = {c[c.index("--distributed-init-method") + 1] for c in cmds}
    assert len(inits) == 1 and inits.pop().startswith("tcp://127.0.0.1:")


def test_table_against_the_first_variant():
    rows = [dict(variant="baseline", seed=1, train_curve=[[50, 13.0], [100, 10.0]]),
            dict(variant="baseline_grouped", seed=1, train_curve=[[50, 13.25], [100, 10.5]]),
            dict(variant="ls", seed=1, train_curve=[[50, 12.9]])]
    text = cpu_curve.table(rows).splitlines()
    assert text[0] == "| variant | seed | 50 | 100 |"
    assert text[2] == "| baseline | 1 | 13.000 | 10.000 |"
    assert text[3] == "| baseline_grouped | 1 | 13.250 (+0.250) | 10.500 (+0.500) |"
    assert text[4] == "| ls | 1 | 12.900 (-0.100) |  |"


def test_two_workers_train_on_the_cpu(tmp_path, tiny_corpus):
    rows = cpu_curve.main(["--variants", "baseline,ls", "--max-update", "2", "--log-interval",
                           "1", "--corpus", tiny_corpus, "--model", "tiny", "--max-tokens", "300",
                           "--jobs", "2",
                           "--workdir", str(tmp_path), "--json", str(tmp_path / "c.json")])
    assert [r["variant"] for r in rows] == ["baseline", "ls"]
    for row in rows:
        assert "error" not in row, row
        assert [u for u, _ in row["train_curve"]] == [1, 2]
    ls_log = (tmp_path / "cpu_curves" / "ls_s1" / "rank0.log").read_text()
    assert "batches fixed to GPUs: each of the 2 GPUs" in ls_log
    base_log = (tmp_path / "cpu_curves" / "baseline_s1" / "rank0.log").read_text()
    assert "batches fixed to GPUs" not in base_log
    saved = results.load(str(tmp_path / "c.json"))
    assert saved["script"] == "bench/cpu_curve.py" and saved["rows"] == rows
    assert "CPU" in saved["device"] and saved["workers"] == 2


def test_the_synthetic_recipe_by_default(monkeypatch, tmp_path):
    """Without --corpus the runs train quality.py's synthetic recipe (the learnable corpus, the
    small model), not the real-text gate's."""
    seen = {}
    monkeypatch.setattr(cpu_curve.quality, "prepare_corpus",
                        lambda a: seen.setdefault("a", a) and (None, "bin", "en", "de"))
    monkeypatch.setattr(cpu_curve, "run", lambda a, data, v, seed: dict(
        variant=v, seed=seed, workers=a.workers, train_curve=[[1, 9.0]]))
    cpu_curve.main(["--variants", "baseline", "--workdir", str(tmp_path)])
    a = seen["a"]
    assert (a.corpus, a.model, a.lr, a.dropout) == ("synthetic", "small", 1e-3, 0.1)
