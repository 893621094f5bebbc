"""bench/multi_gpu.py's host-side logic (no GPU): throughput by wall clock over whole epochs from
fairseq's end-of-epoch lines and the probes' epoch-end stamps (also in the shared real CPU
fairseq-train, ``probed_run``), each rank's memory line (the memory probe run with a fake CUDA),
and the scaling rows, ratios, table and --json results file that main() assembles."""
import json
import os
import subprocess
import sys

import pytest

import multi_gpu  # bench/ (pytest.ini's pythonpath)
from benchlib import env, results
from test_bench_base import probed_run, tiny_corpus  # noqa: F401  (shared fixtures)

# The end of a 2-GPU run's log as fairseq-train prints it (--log-format json, log interval 10):
# the spawned workers log in logging's default format, rank 0 only; the sitecustomize's lines
# come from both ranks (rank 1's clock differs), with NCCL noise between them. Long lines are
# continued with a backslash (no newline in the string).
TWO_GPU_LOG = """\
INFO:fairseq_cli.train:Start iterating over samples
INFO:train_inner:{"epoch": 1, "update": 0.962, "loss": "11.873", "nll_loss": "11.801", \
"ppl": "3568.4", "wps": "301212", "ups": "7.58", "wpb": "39741.3", "bsz": "1266.2", \
"num_updates": "230", "lr": "4.03e-05", "gnorm": "2.913", "loss_scale": "16", "train_wall": "1", \
"gb_free": "61.4", "wall": "40"}
INFO:fairseq_cli.train:end of epoch 1 (average epoch stats below)
INFO:train:{"epoch": 1, "train_loss": "12.94", "train_nll_loss": "12.87", "train_ppl": "7489.6", \
"train_wps": "236212", "train_ups": "5.94", "train_wpb": "39752.6", "train_bsz": "1268.4", \
"train_num_updates": "236", "train_lr": "4.13e-05", "train_gnorm": "3.114", \
"train_loss_scale": "16", "train_train_wall": "31", "train_gb_free": "61.2", "train_wall": "41"}
BENCH_EPOCH_END rank=0 1000.25
BENCH_EPOCH_END rank=1 1000.31
host:123:456 [1] NCCL INFO comm 0x55d1 rank 1 nranks 2 - BENCH_EPOCH_END rank=0 1.0
INFO:fairseq.trainer:begin training epoch 2
INFO:train_inner:{"epoch": 2, "update": 1.975, "loss": "10.412", "nll_loss": "10.233", \
"ppl": "1203.5", "wps": "437150", "ups": "11", "wpb": "39741.9", "bsz": "1266.8", \
"num_updates": "470", "lr": "8.23e-05", "gnorm": "1.612", "loss_scale": "16", "train_wall": "1", \
"gb_free": "61.3", "wall": "62"}
INFO:fairseq_cli.train:end of epoch 2 (average epoch stats below)
INFO:train:{"epoch": 2, "train_loss": "10.77", "train_nll_loss": "10.61", "train_ppl": "1562.8", \
"train_wps": "421870", "train_ups": "10.61", "train_wpb": "39750.1", "train_bsz": "1268.4", \
"train_num_updates": "472", "train_lr": "8.27e-05", "train_gnorm": "1.733", \
"train_loss_scale": "16", "train_train_wall": "21", "train_gb_free": "61.2", "train_wall": "63"}
BENCH_EPOCH_END rank=1 1022.61
BENCH_EPOCH_END rank=0 1022.5
INFO:fairseq.trainer:begin training epoch 3
INFO:train_inner:{"epoch": 3, "update": 2.992, "loss": "9.334", "nll_loss": "9.101", \
"ppl": "549.2", "wps": "441002", "ups": "11.1", "wpb": "39748.2", "bsz": "1267.9", \
"num_updates": "700", "lr": "0.000122", "gnorm": "1.201", "loss_scale": "16", "train_wall": "1", \
"gb_free": "61.2", "wall": "84"}
INFO:fairseq_cli.train:end of epoch 3 (average epoch stats below)
INFO:train:{"epoch": 3, "train_loss": "9.52", "train_nll_loss": "9.30", "train_ppl": "630.1", \
"train_wps": "435911", "train_ups": "10.97", "train_wpb": "39749.8", "train_bsz": "1268.4", \
"train_num_updates": "708", "train_lr": "0.000124", "train_gnorm": "1.254", \
"train_loss_scale": "16", "train_train_wall": "21", "train_gb_free": "61.2", "train_wall": "85"}
BENCH_EPOCH_END rank=0 1044.0
BENCH_EPOCH_END rank=1 1044.12
INFO:fairseq_cli.train:done training in 84.1 seconds
BENCH_MEMORY rank=1 total=85899345920 reserved_max=21474836480 used_max=23622320128
BENCH_MEMORY rank=0 total=85899345920 reserved_max=22548578304 used_max=24696061952
"""
# its figures: (num_updates, wpb, wall field) per epoch line, rank 0's stamps
EPOCHS = [(236, 39752.6, 41), (472, 39750.1, 63), (708, 39749.8, 85)]
STAMPS = [1000.25, 1022.5, 1044.0]


def _tokens(epochs):
    """Each epoch's target tokens: wpb x the updates since the previous epoch's end."""
    before = [0] + [u for u, _, _ in epochs]
    return [wpb * (u - b) for (u, wpb, _), b in zip(epochs, before)]


def test_epoch_throughput_is_tokens_over_the_wall_clock_between_epoch_ends():
    tokens = _tokens(EPOCHS)
    got = multi_gpu.epoch_wps(TWO_GPU_LOG)
    assert got["updates_by_epoch"] == [236, 236, 236] and got["updates_per_epoch"] == 236
    assert got["tokens_by_epoch"] == pytest.approx(tokens)
    assert got["epochs_steady"] == [2, 3] and got["epochs_complete"] == 3
    # epoch 1 from the trainer's start (fairseq's wall field), then rank 0's stamps
    assert got["wall_source"] == "epoch-end stamps"
    assert got["wall_by_epoch_s"] == pytest.approx(
        [EPOCHS[0][2], STAMPS[1] - STAMPS[0], STAMPS[2] - STAMPS[1]])
    assert got["wps_epoch1_wall"] == pytest.approx(tokens[0] / EPOCHS[0][2])
    assert got["wps_steady_wall"] == pytest.approx((tokens[1] + tokens[2]) /
                                                   (STAMPS[2] - STAMPS[0]))
    assert got["wps_by_epoch_fairseq"] == [236212.0, 421870.0, 435911.0]


def test_stamps_that_share_a_line_are_read():
    """Two ranks' stamps on one line (an earlier sitecustomize wrote each newline apart from its
    text) still time the epochs; a stamp inside another program's line does not."""
    merged = TWO_GPU_LOG.replace("BENCH_EPOCH_END rank=0 1022.5\n", "").replace(
        "BENCH_EPOCH_END rank=1 1022.61\n", "BENCH_EPOCH_END rank=1 1022.61BENCH_EPOCH_END "
        "rank=0 1022.5\n")
    assert merged != TWO_GPU_LOG
    assert multi_gpu.epoch_ends(merged) == STAMPS
    got = multi_gpu.epoch_wps(merged)
    assert got["wall_source"] == "epoch-end stamps"
    assert got["wall_by_epoch_s"][1:] == pytest.approx([STAMPS[1] - STAMPS[0],
                                                        STAMPS[2] - STAMPS[1]])


def test_without_a_stamp_per_epoch_the_wall_fields_time_the_epochs():
    tokens = _tokens(EPOCHS)
    walls = [w for _, _, w in EPOCHS]
    for log in (
            "\n".join(l for l in TWO_GPU_LOG.splitlines() if "BENCH_EPOCH_END" not in l),
            # rank 0's last stamp lost (a killed run's output): the stamps do not pair up
            TWO_GPU_LOG.replace("BENCH_EPOCH_END rank=0 1044.0\n", "")):
        got = multi_gpu.epoch_wps(log)
        assert got["wall_source"] == "fairseq wall field"
        assert got["wall_by_epoch_s"] == pytest.approx([walls[0], walls[1] - walls[0],
                                                        walls[2] - walls[1]])
        assert got["wps_steady_wall"] == pytest.approx((tokens[1] + tokens[2]) /
                                                       (walls[2] - walls[0]))


def test_a_last_epoch_cut_short_by_max_update_is_not_steady():
    # a 1-GPU run (fairseq-train's own format) that --max-update stopped 50 updates into epoch 3
    lines = []
    for epoch, (updates, wpb, wall), stamp in zip(
            (1, 2, 3), [(190, 7910.4, 30), (380, 7905.2, 51), (430, 7850.0, 57)],
            (500.0, 521.5, 527.5)):
        if epoch == 3:
            lines.append("2026-11-27 10:00:57 | INFO | fairseq_cli.train | Stopping training due "
                         "to num_updates: 430 >= 430")
        lines += [f"2026-11-27 10:00:{wall:02d} | INFO | fairseq_cli.train | end of epoch {epoch} "
                  f"(average epoch stats below)",
                  f"2026-11-27 10:00:{wall:02d} | INFO | train | " + json.dumps(
                      {"epoch": epoch, "train_loss": "9.1", "train_wps": "1", "train_wpb": str(wpb),
                       "train_num_updates": str(updates), "train_wall": str(wall)}),
                  f"BENCH_EPOCH_END rank=0 {stamp}"]
    got = multi_gpu.epoch_wps("\n".join(lines) + "\n")
    assert got["updates_by_epoch"] == [190, 190, 50]
    assert got["epochs_complete"] == 2 and got["epochs_steady"] == [2]
    assert got["updates_per_epoch"] == 190
    assert got["wps_steady_wall"] == pytest.approx(7905.2 * 190 / (521.5 - 500.0))


def test_each_ranks_memory_line_is_read():
    assert multi_gpu.rank_memory(TWO_GPU_LOG) == [
        {"rank": 0, "reserved_max_bytes": 22548578304, "used_max_bytes": 24696061952},
        {"rank": 1, "reserved_max_bytes": 21474836480, "used_max_bytes": 23622320128}]
    assert multi_gpu.rank_memory(
        "noise BENCH_MEMORY rank=0 total=3 reserved_max=1 used_max=2\n") == []


# The memory probe in a process whose CUDA is faked: its n-th peak reset (0-based) sees
# RESERVED[n] reserved and USED[n] used bytes. Spikes at unsampled calls show the sampling.
RESERVED = [1000 + 10 * n + (10**6 if n == 5 else 0) for n in range(25)]
USED = [5000 + (3000 if n == 10 else 7 * n) for n in range(25)]
_FAKE_CUDA = """
import os, sys, torch
state = {"n": -1}
torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
torch.cuda.memory_reserved = lambda *a, **k: RESERVED[state["n"]]
torch.cuda.mem_get_info = lambda *a, **k: (TOTAL - USED[state["n"]], TOTAL)
if os.environ.get("INIT_DIST"):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=os.environ["INIT_DIST"], rank=0, world_size=1)
from benchlib.probes import memory
memory.install()
for n in range(int(os.environ["CALLS"])):
    state["n"] = n
    torch.cuda.reset_peak_memory_stats()
"""


def _run_site(tmp_path, calls, **more):
    script = f"RESERVED = {RESERVED}\nUSED = {USED}\nTOTAL = 10**7\n" + _FAKE_CUDA
    run_env = env.with_path(os.environ, env.BENCH_DIR)  # the child imports benchlib
    run_env.update(CALLS=str(calls), **more)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=run_env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_memory_probe_prints_each_ranks_held_memory_at_exit(tmp_path):
    sampled = range(0, 25, 10)  # every 10th reset, from the first
    out = _run_site(tmp_path, 25, LOCAL_RANK="1")
    assert multi_gpu.rank_memory(out) == [{
        "rank": 1, "reserved_max_bytes": max(RESERVED[n] for n in sampled),
        "used_max_bytes": max(USED[n] for n in sampled)}]
    # an initialised process group names the rank
    init = (tmp_path / "pg").as_uri()
    assert [m["rank"] for m in multi_gpu.rank_memory(
        _run_site(tmp_path, 3, LOCAL_RANK="1", INIT_DIST=init))] == [0]
    # the parent of spawned ranks never trains: no line that could pass for rank 0's
    assert "BENCH_MEMORY" not in _run_site(tmp_path, 0)


def test_a_real_fairseq_train_stamps_every_epoch_end(probed_run):
    """The stamps come from patching fairseq.logging.metrics as it is imported: a real (tiny,
    CPU) fairseq-train must print exactly one per end-of-epoch line, or the steady figure
    silently falls back to the whole-second wall fields; the time between two stamps is the
    time fairseq's own epoch wps meter ran (within the logging of one line)."""
    got = multi_gpu.epoch_wps(probed_run)
    assert got["epochs_logged"] == 3 and len(multi_gpu.epoch_ends(probed_run)) == 3
    assert got["wall_source"] == "epoch-end stamps"
    for tokens, seconds, wps in list(zip(got["tokens_by_epoch"], got["wall_by_epoch_s"],
                                         got["wps_by_epoch_fairseq"]))[1:]:
        assert tokens / seconds == pytest.approx(wps, rel=0.1)
    assert multi_gpu.rank_memory(probed_run) == []  # CPU: fairseq never resets a CUDA peak counter


# --------------------------------------------------------------------------------------------
# main(): the rows, ratios, table and JSON
# --------------------------------------------------------------------------------------------

def fake_log(gpus, updates, wpb, seconds, reserved=0, losses=()):
    """A fairseq-train log of len(seconds) epochs of ``updates`` updates and ``wpb`` target tokens
    per update (all GPUs), epoch e lasting seconds[e] (stamped by every rank, the wall field in
    whole seconds), then each rank's memory line; ``losses``: (update, loss) interval lines."""
    worker = gpus > 1
    tag = (lambda name: f"INFO:{name}:") if worker else (
        lambda name: f"2026-11-27 10:00:00 | INFO | {name} | ")
    lines, clock = [], 100.0
    for u, loss in losses:
        lines.append(tag("train_inner") + json.dumps(
            {"epoch": 1, "loss": str(loss), "wps": "1000", "wpb": str(wpb),
             "num_updates": str(u), "loss_scale": "4"}))
    for e, s in enumerate(seconds, 1):
        clock += s
        lines += [tag("fairseq_cli.train") + f"end of epoch {e} (average epoch stats below)",
                  tag("train") + json.dumps(
                      {"epoch": e, "train_loss": "9.1", "train_wps": str(round(updates * wpb / s)),
                       "train_wpb": str(wpb), "train_num_updates": str(e * updates),
                       "train_wall": str(round(clock - 100.0))})]
        lines += [f"BENCH_EPOCH_END rank={r} {clock!r}" for r in range(gpus)]
    lines += [f"BENCH_MEMORY rank={r} total={80 * 2**30} reserved_max={reserved + r} "
              f"used_max={reserved + 2**30}" for r in range(gpus)]
    return "\n".join(lines) + "\n"


# (variant, gpus) -> (updates per epoch, wpb, seconds of epochs 1 and 2)
RUNS = {("baseline", 1): (400, 8000.0, [70.0, 40.0]), ("baseline", 2): (200, 16000.0, [50.0, 22.0]),
        ("baseline_nocudnn", 1): (400, 8000.0, [45.0, 42.0]),
        ("baseline_nocudnn", 2): (200, 16000.0, [30.0, 23.0]),
        ("ls", 1): (400, 8000.0, [30.0, 16.0]), ("ls", 2): (200, 16000.0, [20.0, 8.5]),
        ("ls_graphs", 1): (400, 8000.0, [30.0, 16.0]), ("ls_graphs", 2): (150, 16000.0, [1, 1]),
        ("ls_nccl_all_reduce", 2): (200, 16000.0, [21.0, 9.0])}


def _steady(variant, gpus):
    updates, wpb, seconds = RUNS[(variant, gpus)]
    return updates * wpb / seconds[1], updates * wpb / seconds[0]


@pytest.fixture
def fake_runs(monkeypatch, tmp_path):
    calls = []

    def fake_train(data, variant, max_tokens, gpus, update_freq, updates, save_dir, extra=(),
                   backend="pytorch_ddp", env_extra=None, epochs=100):
        calls.append((variant, max_tokens, gpus, update_freq, updates, backend, epochs))
        if variant == "ls_graphs" and gpus == 2:
            raise RuntimeError("Traceback: NCCL error")
        if update_freq == 1 and updates is None:  # a scaling run
            u, wpb, s = RUNS[(variant, gpus)]
            return fake_log(gpus, u, wpb, s[:epochs], reserved=(gpus * 10 + 1) * 2**30)
        # a correctness run: the N-GPU and 1-GPU curves differ by 0.01 at update 20
        shift = 0.01 if gpus == 1 and updates == 200 else 0.0
        log = fake_log(gpus, 100, 9000.0, [10.0, 10.0],
                       losses=[(10, 12.5), (20, 11.25 + shift), (30, 10.0)])
        if updates == 210:
            log += ("2026-11-27 10:00:00 | INFO | fairseq.trainer | Loaded checkpoint "
                    "/tmp/mg_multi/checkpoint_last.pt (epoch 3 @ 200 updates)\n")
        return log

    monkeypatch.setattr(multi_gpu, "train", fake_train)
    monkeypatch.setattr(multi_gpu, "corpus", lambda *a, **k: str(tmp_path))
    monkeypatch.setattr(multi_gpu, "gpu_names", lambda: ["NVIDIA H100 80GB HBM3"] * 2)
    monkeypatch.setenv("LS_BENCH_COMMIT", "abc1234")
    return calls


def _saved(path):
    """The results file main() wrote (schema-checked), its rows by step."""
    saved = results.load(str(path))
    steps = {}
    for r in saved["rows"]:
        steps.setdefault(r["step"], []).append(r)
    return saved, steps


def _correctness(path):
    (row,) = _saved(path)[1]["correctness"]
    return row


def _scaling(path):
    return _saved(path)[1]["scaling"]


def test_scaling_rows_ratios_table_and_json(fake_runs, monkeypatch, tmp_path, capsys):
    out_json, out_md = tmp_path / "mg.json", tmp_path / "mg.md"
    argv = ["--gpus", "2", "--skip-correctness", "--max-tokens", "8192", "--json", str(out_json),
            "--markdown", str(out_md),
            "--scaling-variants", "baseline:pytorch_ddp,baseline_nocudnn:pytorch_ddp,"
                                  "ls:pytorch_ddp,ls_graphs:legacy_ddp:2"]
    monkeypatch.setattr(sys, "argv", ["multi_gpu.py"] + argv)
    multi_gpu.main()
    saved, steps = _saved(out_json)
    assert saved["device"] == "NVIDIA H100 80GB HBM3" and saved["commit"] == "abc1234"
    assert saved["command"] == "python bench/multi_gpu.py " + " ".join(argv)
    assert saved["script"] == "bench/multi_gpu.py" and saved["gpus"] == 2
    assert list(steps) == ["scaling"] and {r["scaling_epochs"] for r in steps["scaling"]} == {2}
    rows = {(r["variant"], r["gpus"]): r for r in steps["scaling"]}
    assert list(rows)[:6] == [(v, g) for v in ("baseline", "baseline_nocudnn", "ls")
                              for g in (1, 2)]
    # the default 2 epochs of each run, no --max-update, update-freq 1
    assert {c[4] for c in fake_runs} == {None} and {c[6] for c in fake_runs} == {2}
    for (variant, gpus), r in rows.items():
        if "error" in r:
            continue
        steady, first = _steady(variant, gpus)
        assert (r["max_tokens"], r["ddp_backend"]) == (8192, "legacy_ddp" if variant == "ls_graphs"
                                                       else "pytorch_ddp")
        assert r["wps_steady_wall"] == pytest.approx(steady)
        assert r["wps_epoch1_wall"] == pytest.approx(first)
        assert r["updates_per_epoch"] == RUNS[(variant, gpus)][0] and r["epochs_steady"] == [2]
        assert [m["rank"] for m in r["memory_by_rank"]] == list(range(gpus))
        assert r["memory_by_rank"][0]["reserved_max_bytes"] == (gpus * 10 + 1) * 2**30
        if gpus == 2:
            assert r["scaling_steady"] == pytest.approx(steady / _steady(variant, 1)[0])
            assert r["scaling_epoch1"] == pytest.approx(first / _steady(variant, 1)[1])
            assert r["tokens_per_epoch_vs_1gpu"] == pytest.approx(1.0)
        else:
            assert r["scaling_steady"] is None
    for gpus in (1, 2):
        best = max(("baseline", "baseline_nocudnn"), key=lambda v: _steady(v, gpus)[0])
        ls = rows[("ls", gpus)]
        assert ls["best_baseline_steady"] == best
        assert ls["ls_over_best_baseline_steady"] == pytest.approx(
            _steady("ls", gpus)[0] / _steady(best, gpus)[0])
        assert rows[("baseline", gpus)]["ls_over_best_baseline_steady"] is None
    assert "NCCL error" in rows[("ls_graphs", 2)]["error"]
    text = out_md.read_text()
    assert "| 8192 | ls | pytorch_ddp | 2 | 200 | 2 |" in text
    assert "| 8192 | ls_graphs | legacy_ddp | 2 | FAILED:" in text
    printed = capsys.readouterr().out
    # every 2-GPU run has 200 updates per epoch: no warning; 1-GPU runs 400
    assert "WARNING: ls_graphs (legacy_ddp), 2 GPU(s), max-tokens 8192: FAILED" in printed
    assert "updates per epoch, under the 200" not in printed


def test_one_gpu_run_shared_by_a_variant_and_its_single_gpu_as(fake_runs, monkeypatch, tmp_path):
    """ls_nccl_all_reduce is ls on one GPU: listed first, it runs one GPU as ls, and ls reuses
    that run (one 1-GPU run per call, whichever comes first)."""
    monkeypatch.setattr(sys, "argv", ["multi_gpu.py", "--gpus", "2", "--skip-correctness",
                                      "--json", str(tmp_path / "mg.json"), "--scaling-variants",
                                      "ls_nccl_all_reduce:pytorch_ddp,ls:pytorch_ddp"])
    multi_gpu.main()
    assert [(c[0], c[2]) for c in fake_runs] == [("ls", 1), ("ls_nccl_all_reduce", 2), ("ls", 2)]
    rows = _scaling(tmp_path / "mg.json")
    assert [(r["variant"], r["gpus"], r.get("same_run_as")) for r in rows] == [
        ("ls_nccl_all_reduce", 1, "ls"), ("ls_nccl_all_reduce", 2, None), ("ls", 1, None),
        ("ls", 2, None)]
    assert rows[1]["scaling_steady"] == pytest.approx(_steady("ls_nccl_all_reduce", 2)[0]
                                                      / _steady("ls", 1)[0])


def test_fewer_than_200_updates_per_epoch_is_warned():
    row = multi_gpu.scaling_row(fake_log(2, 150, 16000.0, [5.0, 4.0]), 16384, "ls",
                                "pytorch_ddp", 2, 2)
    assert row["updates_per_epoch"] == 150
    assert any("150 updates per epoch, under the 200" in w for w in multi_gpu.row_warnings(row))
    one = multi_gpu.scaling_row(fake_log(1, 300, 8000.0 * 1.2, [5.0, 4.0]), 16384, "ls",
                                "pytorch_ddp", 1, 2)
    multi_gpu.add_ratios([one, row])
    # 150 x 16000 tokens per epoch against 300 x 9600 on one GPU: the N-GPU wpb is not a sum
    assert row["tokens_per_epoch_vs_1gpu"] == pytest.approx(150 * 16000.0 / (300 * 9600.0))
    assert any("target tokens per epoch" in w for w in multi_gpu.row_warnings(row))


def test_correctness_results_are_data(fake_runs, monkeypatch, tmp_path):
    out_json = tmp_path / "mg.json"
    monkeypatch.setattr(sys, "argv", ["multi_gpu.py", "--gpus", "2", "--skip-scaling",
                                      "--json", str(out_json)])
    multi_gpu.main()
    c = _correctness(out_json)
    assert (c["variant"], c["ddp_backend"], c["updates"]) == ("ls", "pytorch_ddp", 200)
    # the N-GPU run (update-freq 1) against 1 GPU (update-freq 2), both under pytorch_ddp
    assert ("ls", 8192, 2, 1, 200, "pytorch_ddp", 100) in fake_runs
    assert ("ls", 8192, 1, 2, 200, "pytorch_ddp", 100) in fake_runs
    assert c["loss_n_gpus"] == [[10, 12.5], [20, 11.25], [30, 10.0]]
    assert c["largest_gap"] == pytest.approx(0.01) and c["largest_gap_update"] == 20
    assert c["resumed_on_1_gpu"] is True
    assert c["fp16_init_scale"] == 4.0 and c["loss_scale_n_gpus"] == [[10, 4.0], [20, 4.0],
                                                                      [30, 4.0]]
    assert [b["ddp_backend"] for b in c["other_backends"]] == ["legacy_ddp", "no_c10d"]
    assert all(b["trains"] for b in c["other_backends"])

    monkeypatch.setattr(sys, "argv", ["multi_gpu.py", "--skip-scaling", "--json", str(out_json),
                                      "--correctness-backend", "legacy_ddp"])
    multi_gpu.main()
    c = _correctness(out_json)
    assert c["ddp_backend"] == "legacy_ddp"
    assert [b["ddp_backend"] for b in c["other_backends"]] == ["pytorch_ddp", "no_c10d"]


def test_correctness_runs_start_at_the_initial_loss_scale_and_save_after_each_run(
        fake_runs, monkeypatch, tmp_path):
    """--init-scale reaches every correctness run (0: fairseq's own); the JSON holds the runs that
    finished when a later one fails (a device call cut short keeps them)."""
    out_json = tmp_path / "mg.json"
    seen = []
    fake = multi_gpu.train

    def train(*a, **k):
        extra = list(a[7] if len(a) > 7 else k.get("extra", ()))
        seen.append(extra)
        if a[3] == 1 and a[5] == 210:  # the resume run: the call is cut short here
            raise KeyboardInterrupt
        return fake(*a, **k)

    monkeypatch.setattr(multi_gpu, "train", train)
    monkeypatch.setattr(sys, "argv", ["multi_gpu.py", "--gpus", "2", "--skip-scaling",
                                      "--json", str(out_json), "--init-scale", "8"])
    with pytest.raises(KeyboardInterrupt):
        multi_gpu.main()
    assert all(e[e.index("--fp16-init-scale") + 1] == "8" for e in seen)
    c = _correctness(out_json)
    assert c["fp16_init_scale"] == 8.0 and c["largest_gap"] == pytest.approx(0.01)
    assert "resumed_on_1_gpu" not in c

    seen.clear()
    monkeypatch.setattr(multi_gpu, "train", lambda *a, **k: (seen.append(list(a[7])),
                                                             fake(*a, **k))[1])
    monkeypatch.setattr(sys, "argv", ["multi_gpu.py", "--gpus", "2", "--skip-scaling",
                                      "--init-scale", "0"])
    multi_gpu.main()
    assert seen and not any("--fp16-init-scale" in e for e in seen)


def test_differing_loss_scales_are_named(fake_runs, monkeypatch, tmp_path, capsys):
    fake = multi_gpu.train

    def train(*a, **k):  # the 1-GPU run skipped one more overflowing update
        log = fake(*a, **k)
        return log.replace('"loss_scale": "4"', '"loss_scale": "2"') if a[3] == 1 else log

    monkeypatch.setattr(multi_gpu, "train", train)
    monkeypatch.setattr(sys, "argv", ["multi_gpu.py", "--gpus", "2", "--skip-scaling",
                                      "--json", str(tmp_path / "mg.json")])
    multi_gpu.main()
    assert "loss scales differ (2 GPUs: 4 4 4; 1 GPU: 2 2 2)" in capsys.readouterr().out
    c = _correctness(tmp_path / "mg.json")
    assert c["loss_scale_1_gpu_update_freq_n"] == [[10, 2.0], [20, 2.0], [30, 2.0]]


def test_other_backends_are_chosen(fake_runs, monkeypatch, tmp_path):
    out_json = tmp_path / "mg.json"
    for flag, expected in (("legacy_ddp", ["legacy_ddp"]), ("", [])):
        monkeypatch.setattr(sys, "argv", ["multi_gpu.py", "--gpus", "2", "--skip-scaling",
                                          "--json", str(out_json), "--other-backends", flag])
        multi_gpu.main()
        c = _correctness(out_json)
        assert [b["ddp_backend"] for b in c["other_backends"]] == expected


@pytest.mark.parametrize("flags, message", [
    (["--other-backends", "legacy_ddp,c10d"], "--other-backends legacy_ddp,c10d: c10d is not one"),
    (["--init-scale", "-1"], "--init-scale -1: a loss scale is positive"),
])
def test_bad_correctness_flags_are_refused(monkeypatch, capsys, flags, message):
    monkeypatch.setattr(sys, "argv", ["multi_gpu.py", "--skip-scaling"] + flags)
    with pytest.raises(SystemExit):
        multi_gpu.main()
    assert message in capsys.readouterr().err


def test_scaling_on_n_gpus_only(fake_runs, monkeypatch, tmp_path):
    """--scaling-skip-one-gpu: no 1-GPU run, no scaling column, but ls_ over the best baseline
    on N GPUs (the 1-GPU rows came from an earlier call)."""
    monkeypatch.setattr(sys, "argv", ["multi_gpu.py", "--gpus", "2", "--skip-correctness",
                                      "--scaling-skip-one-gpu", "--json", str(tmp_path / "mg.json"),
                                      "--markdown", str(tmp_path / "mg.md"), "--scaling-variants",
                                      "baseline:pytorch_ddp,baseline_nocudnn:pytorch_ddp,"
                                      "ls:pytorch_ddp"])
    multi_gpu.main()
    assert [(c[0], c[2]) for c in fake_runs] == [("baseline", 2), ("baseline_nocudnn", 2),
                                                 ("ls", 2)]
    rows = _scaling(tmp_path / "mg.json")
    assert [r["gpus"] for r in rows] == [2, 2, 2]
    assert all(r["scaling_steady"] is None for r in rows)
    best = max(("baseline", "baseline_nocudnn"), key=lambda v: _steady(v, 2)[0])
    assert rows[2]["best_baseline_steady"] == best
    assert rows[2]["ls_over_best_baseline_steady"] == pytest.approx(
        _steady("ls", 2)[0] / _steady(best, 2)[0])
    assert "| 8192 | ls | pytorch_ddp | 2 | 200 | 2 |" in (tmp_path / "mg.md").read_text()


def test_train_streams_its_log_into_out(monkeypatch, tmp_path):
    """A run's stdout and stderr go to $OUT while it runs (a run the call's time cuts still
    shows how far it got); train returns stdout then stderr, and a failed run raises with its
    log."""
    script = ("import sys; print('stats line', flush=True); "
              "print('to stderr', file=sys.stderr); sys.exit(int(sys.argv[1]))")
    rc = {"value": "0"}
    monkeypatch.setattr(multi_gpu.e2e, "train_cmd", lambda *a, **k: [
        sys.executable, "-c", script, rc["value"], "--no-save"])
    monkeypatch.setattr(multi_gpu, "LOG_DIR", str(tmp_path))
    save = tmp_path / "run"
    save.mkdir()
    log = multi_gpu.train("data", "ls", 8192, 1, 1, None, str(save), ["--no-save"])
    assert log == "stats line\nto stderr\n"
    assert (tmp_path / "multi_gpu_current_run.out").read_text() == "stats line\n"
    assert (tmp_path / "multi_gpu_current_run.err").read_text() == "to stderr\n"
    assert (save / "train.log").read_text() == log
    assert "stats line" in (tmp_path / "multi_gpu_runs.log").read_text()
    rc["value"] = "3"
    with pytest.raises(RuntimeError, match="to stderr"):
        multi_gpu.train("data", "ls", 8192, 1, 1, None, str(save), ["--no-save"])
