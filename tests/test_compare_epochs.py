"""ls-fairseq-compare's per-epoch rows on constructed logs whose epoch figures are known.

Each log below is written line by line in fairseq 0.12's formats (stdout capture: ``date | INFO |
logger | message``; simple and json progress lines), with chosen end-of-epoch figures; every
expected value is computed here from those choices.
"""
import datetime
import json
import statistics

import pytest

from ls_fairseq.cli import compare

T0 = datetime.datetime(2026, 1, 1, 10, 0, 0)
EPOCH = 100  # updates per epoch in every constructed log


def stamp(t):
    return (T0 + datetime.timedelta(seconds=t)).strftime("%Y-%m-%d %H:%M:%S")


class Log:
    """Writes a fairseq-train log; ``t`` is seconds after 10:00:00 of each line."""

    def __init__(self, fmt="simple"):
        self.fmt = fmt
        self.lines = []

    def add(self, t, logger, msg):
        self.lines.append("{} | INFO | {} | {}".format(stamp(t), logger, msg))

    def start(self, t, resumed=None, epoch=1):
        self.add(t, "fairseq_cli.train", "{{'_name': None, 'common': {{'log_format': '{}'}}, 'model': "
                                         "{{'arch': 'transformer'}}}}".format(self.fmt))
        if resumed is None:
            self.add(t + 1, "fairseq.trainer", "No existing checkpoint found checkpoints/checkpoint_last.pt")
        else:
            self.add(t + 1, "fairseq.trainer", "Loaded checkpoint checkpoints/checkpoint_last.pt (epoch {} @ {} "
                                               "updates)".format(epoch, resumed))

    def inner(self, t, epoch, upd, wps, **extra):
        stats = dict(loss=5.0, wps=wps, ups=round(wps / 1000, 2), wpb=1000, num_updates=upd, **extra)
        if self.fmt == "json":
            self.add(t, "train_inner", json.dumps(dict(epoch=epoch, **{k: str(v) for k, v in stats.items()})))
        else:
            i = upd - (epoch - 1) * EPOCH
            self.add(t, "train_inner", "epoch {:03d}: {:>6} / {} {}".format(
                epoch, i, EPOCH, ", ".join("{}={}".format(k, v) for k, v in stats.items())))

    def epoch(self, t, epoch, upd, wps, ups, wall, train_wall, **extra):
        stats = dict(loss=5.0, wps=wps, ups=ups, **extra)
        stats.update(wpb=1000, num_updates=upd, train_wall=train_wall, wall=wall)
        if self.fmt == "json":
            self.add(t, "train", json.dumps(dict(epoch=epoch, **{"train_" + k: str(v) for k, v in stats.items()})))
        else:
            self.add(t, "train", "epoch {:03d} | {}".format(
                epoch, " | ".join("{} {}".format(k, v) for k, v in stats.items())))

    def write(self, path):
        path.write_text("".join(line + "\n" for line in self.lines))
        return str(path)


def full_run(log, wps, ups, walls, stamps, train_walls, epoch0=1, upd0=0, extra=None):
    """Whole epochs epoch0, epoch0 + 1, ...: two logged intervals each, then the end-of-epoch
    line with the given figures at the given time."""
    for k, (w, u, wall, t, tw) in enumerate(zip(wps, ups, walls, stamps, train_walls)):
        epoch, end = epoch0 + k, upd0 + (k + 1) * EPOCH
        log.inner(t - 20, epoch, end - 50, w * 1.1)
        log.inner(t - 10, epoch, end, w * 1.1)
        log.epoch(t, epoch, end, w, u, wall, tw, **((extra or [{}] * len(wps))[k]))


# run A: five whole epochs; --max-update 500 stops it at the very end of epoch 5, which is then
# still complete. Its timestamps deliberately disagree with the wall field (the tool must use the
# latter where it can).
A = dict(wps=[1000, 3000, 2000, 2500, 2600], ups=[1.0, 3.0, 2.0, 2.5, 2.6], walls=[100, 160, 230, 290, 345],
         stamps=[103, 170, 235, 300, 360], train_walls=[90, 50, 52, 54, 56])
# run B: two whole epochs, then killed in epoch 3 (intervals, no end line, no 'done training')
B = dict(wps=[1500, 2800], ups=[1.5, 2.8], walls=[80, 130], stamps=[82, 132], train_walls=[70, 45])
# run C: one epoch (--max-epoch 1)
C = dict(wps=[1200], ups=[1.2], walls=[90], stamps=[95], train_walls=[80])


def write_a(tmp_path):
    log = Log()
    log.start(0)
    full_run(log, **A)
    log.add(A["stamps"][-1] - 5, "fairseq_cli.train", "Stopping training due to num_updates: 500 >= max_update: 500")
    log.add(A["stamps"][-1] + 1, "fairseq_cli.train", "done training in 360.0 seconds")
    return log.write(tmp_path / "a.log")


def write_b(tmp_path):
    log = Log()
    log.start(0)
    full_run(log, **B)
    log.inner(150, 3, 250, 2900)
    return log.write(tmp_path / "b.log")


def write_c(tmp_path):
    log = Log()
    log.start(0)
    full_run(log, **C)
    log.add(96, "fairseq_cli.train", "done training in 95.0 seconds")
    return log.write(tmp_path / "c.log")


def test_epoch_figures_of_whole_runs(tmp_path):
    a = compare.load_run(write_a(tmp_path), "a").metrics
    steady = slice(1, None)  # every complete epoch after the first
    assert a["epochs_complete"] == 5 and a["last_complete_epoch"] == 5 and a["steady_epochs"] == "2–5"
    assert a["wps_epoch1"] == A["wps"][0] and a["ups_epoch1"] == A["ups"][0]
    assert a["wps_steady"] == statistics.median(A["wps"][steady])  # even count: mean of the middle two
    assert a["ups_steady"] == pytest.approx(statistics.median(A["ups"][steady]))
    assert a["wps_last"] == A["wps"][-1] and a["ups_last"] == A["ups"][-1]
    # wall-clock from the wall field: epoch 1 from the trainer's start, the others as differences
    durations = [b - a for a, b in zip([0] + A["walls"], A["walls"])]
    assert a["epoch1_wall_s"] == durations[0]
    assert a["epoch_wall_s"] == statistics.median(durations[steady])
    assert a["epoch_wall_source"] == "wall field"
    assert a["epoch_train_wall_s"] == statistics.median(A["train_walls"][steady])

    b = compare.load_run(write_b(tmp_path), "b")
    m = b.metrics
    # the interrupted epoch 3 has no end line: not an epoch of the table
    assert [r["epoch"] for r in b.epoch_rows] == [1, 2] and m["epochs"] == 3
    assert m["epochs_complete"] == 2 and m["steady_epochs"] == "2"
    assert (m["wps_epoch1"], m["wps_steady"], m["wps_last"]) == (B["wps"][0], B["wps"][1], B["wps"][1])
    assert m["epoch_wall_s"] == B["walls"][1] - B["walls"][0]

    c = compare.load_run(write_c(tmp_path), "c")
    assert c.metrics["wps_epoch1"] == c.metrics["wps_last"] == C["wps"][0]
    assert c.metrics["wps_steady"] is None and c.metrics["epoch_wall_s"] is None
    assert c.absent["wps_steady"] == c.absent["epoch_wall_s"] == "run has 1 complete epoch"


def test_table_compares_epoch_with_epoch(tmp_path):
    """Runs of 5, 2 and 1 complete epochs: epoch 1 with epoch 1, steady with steady; the run with
    one epoch says so in its steady cells, and its ratio is '—'."""
    runs, report, _ = compare.compare([write_a(tmp_path), write_b(tmp_path), write_c(tmp_path)], plots=False)
    lines = report.splitlines()
    assert "| metric | a | b | c | b / a | c / a |" in lines
    wa, wb, wc = A["wps"], B["wps"], C["wps"]
    sa = statistics.median(wa[1:])
    assert "| wps, epoch 1 (cold) | {:,.0f} | {:,.0f} | {:,.0f} | {:.3f}x | {:.3f}x |".format(
        wa[0], wb[0], wc[0], wb[0] / wa[0], wc[0] / wa[0]) in lines
    assert "| wps, steady (median over the steady epochs) | {:,.0f} | {:,.0f} | —, run has 1 complete epoch | " \
           "{:.3f}x | — |".format(sa, wb[1], wb[1] / sa) in lines
    assert "| wps, last complete epoch | {:,.0f} | {:,.0f} | {:,.0f} | {:.3f}x | {:.3f}x |".format(
        wa[-1], wb[-1], wc[-1], wb[-1] / wa[-1], wc[-1] / wa[-1]) in lines
    assert "| last complete epoch | 5 | 2 | 1 |  |  |" in lines
    assert "| steady epochs (complete, after the first) | 2–5 | 2 | — |  |  |" in lines
    assert "| … wall-clock per epoch taken from | wall field | wall field | wall field |  |  |" in lines
    # the interval figures stay, as extra rows under their own heading, after the epoch rows
    head = lines.index("| **throughput per logged interval (`train_inner` lines; not fairseq's epoch figures)** "
                       "| | | | | |")
    assert lines[head + 1].startswith("| wps (interval mean, all epochs) |")
    assert head > [i for i, l in enumerate(lines) if l.startswith("| wps, last complete epoch |")][0]
    # no run logs tflops/mfu: no such rows
    assert "tflops" not in report and "MFU" not in report


def test_epoch_cut_short_by_max_update_is_not_complete(tmp_path):
    """--max-update in the middle of epoch 2: fairseq still logs an end line for it, with 50 of
    the 100 updates; the epoch is not complete, so the run has one complete epoch."""
    log = Log()
    log.start(0)
    full_run(log, wps=[1000], ups=[1.0], walls=[100], stamps=[101], train_walls=[90])
    log.inner(130, 2, 150, 4000)
    log.add(131, "fairseq_cli.train", "Stopping training due to num_updates: 150 >= max_update: 150")
    log.epoch(140, 2, 150, 3000, 3.0, 139, 30)
    run = compare.load_run(log.write(tmp_path / "short.log"), "short")
    assert [(r["epoch"], r["updates"], r["complete"]) for r in run.epoch_rows] == [(1, 100, True), (2, 50, False)]
    m = run.metrics
    assert m["epochs"] == 2 and m["epochs_complete"] == 1 and m["last_complete_epoch"] == 1
    assert m["wps_last"] == 1000 and m["wps_steady"] is None  # epoch 2's 3000 is not used
    assert run.absent["wps_steady"] == "run has 1 complete epoch"
    assert any(n.startswith("epoch 2: cut short by 'Stopping training due to num_updates: 150 >= max_update: "
                            "150' after 50 updates (100 in a full epoch)") for n in run.notes)


def test_restart_mid_epoch_json(tmp_path):
    """json log: epochs 1, 2, a crash in epoch 3 after the checkpoint at update 250, a restart from
    it 10 minutes later. fairseq logs wall 0 throughout a session resumed mid-epoch, so session 2's
    epochs are timed by the log timestamps; epoch 3's figures mix both sessions (fairseq restores
    its epoch meters from the checkpoint): neither cold epoch 1 nor epoch 3 is steady."""
    wps = {1: 1000, 2: 3000, 3: 1800, 4: 3200, 5: 3100}
    log = Log("json")
    log.start(0)
    full_run(log, wps=[wps[1], wps[2]], ups=[1.0, 3.0], walls=[100, 160], stamps=[102, 163], train_walls=[90, 50])
    log.inner(190, 3, 250, 3300)
    log.inner(200, 3, 260, 3300)  # lost in the crash: redone by session 2
    log.lines.append("Traceback (most recent call last):")
    log.lines.append("RuntimeError: CUDA error: an illegal memory access was encountered")
    log.start(800, resumed=250, epoch=3)
    log.inner(830, 3, 260, 3100)
    log.inner(840, 3, 300, 3100)
    ts3, ts4, ts5 = 845, 905, 968
    log.epoch(ts3, 3, 300, wps[3], 1.8, 0, 40)
    full_run(log, wps=[wps[4], wps[5]], ups=[3.2, 3.1], walls=[0, 0], stamps=[ts4, ts5], train_walls=[50, 51],
             epoch0=4, upd0=300)
    log.add(ts5 + 1, "fairseq_cli.train", "done training in 170.0 seconds")
    run = compare.load_run(log.write(tmp_path / "restart.log"), "restart")
    rows = run.epoch_rows
    assert [(r["epoch"], r["session"], r["cold"], r["split"], r["complete"]) for r in rows] == [
        (1, 0, True, False, True), (2, 0, False, False, True), (3, 1, True, True, True),
        (4, 1, False, False, True), (5, 1, False, False, True)]
    assert [r["wall_source"] for r in rows] == ["wall field", "wall field", None, "log timestamps", "log timestamps"]
    m = run.metrics
    assert m["steady_epochs"] == "2, 4–5"
    assert m["wps_epoch1"] == wps[1] and m["wps_last"] == wps[5]
    assert m["wps_steady"] == statistics.median([wps[2], wps[4], wps[5]])
    assert m["epoch_wall_s"] == statistics.median([160 - 100, ts4 - ts3, ts5 - ts4])
    assert m["epoch_wall_source"] == "log timestamps + wall field"
    assert [r["num_updates"] for r in run.inner if r["num_updates"] == 260] == [260]  # the redone one only
    assert any("epoch 3 spans the restart of session 2 (resumed at update 250)" in n for n in run.notes)


def test_restart_at_an_epoch_boundary(tmp_path):
    """Killed in epoch 3, restarted from the checkpoint at the end of epoch 2 (update 200): session
    2 runs epoch 3 whole, from its start-up (cold, timed from its trainer's start by its own wall
    field), then epoch 4 (steady)."""
    log = Log()
    log.start(0)
    full_run(log, wps=[1000, 3000], ups=[1.0, 3.0], walls=[100, 160], stamps=[101, 161], train_walls=[90, 50])
    log.inner(190, 3, 250, 3300)
    log.start(700, resumed=200, epoch=3)
    full_run(log, wps=[1500, 2900], ups=[1.5, 2.9], walls=[95, 150], stamps=[797, 852], train_walls=[80, 52],
             epoch0=3, upd0=200)
    run = compare.load_run(log.write(tmp_path / "boundary.log"), "boundary")
    rows = run.epoch_rows
    assert [(r["epoch"], r["cold"], r["split"], r["wall_s"]) for r in rows] == [
        (1, True, False, 100), (2, False, False, 60), (3, True, False, 95), (4, False, False, 55)]
    m = run.metrics
    assert m["steady_epochs"] == "2, 4" and m["wps_steady"] == statistics.median([3000, 2900])
    assert m["epoch_wall_s"] == statistics.median([60, 55])
    assert any("epoch 3: first epoch of restarted session 2: cold" in n for n in run.notes)


def test_tflops_and_mfu_rows(tmp_path):
    """ls_ runs log tflops and mfu (in train_inner and end-of-epoch lines, as any fairseq stat);
    fairseq's baseline does not: its cells are '—', with no reason and no ratio."""
    tflops, mfu = [300.0, 380.0, 390.0], [30.3, 38.4, 39.4]
    base = Log()
    base.start(0)
    full_run(base, wps=[1000, 2000, 2100], ups=[1.0, 2.0, 2.1], walls=[100, 150, 200], stamps=[100, 150, 200],
             train_walls=[90, 45, 45])
    ls = Log("json")
    ls.start(0)
    full_run(ls, wps=[1500, 3000, 3100], ups=[1.5, 3.0, 3.1], walls=[80, 115, 150], stamps=[80, 115, 150],
             train_walls=[70, 30, 30], extra=[dict(tflops=t, mfu=u) for t, u in zip(tflops, mfu)])
    # the simple format too: the same figures in an ls_ run logged as simple
    ls_simple = Log()
    ls_simple.start(0)
    full_run(ls_simple, wps=[1500, 3000, 3100], ups=[1.5, 3.0, 3.1], walls=[80, 115, 150], stamps=[80, 115, 150],
             train_walls=[70, 30, 30], extra=[dict(tflops=t, mfu=u) for t, u in zip(tflops, mfu)])
    paths = [base.write(tmp_path / "base.log"), ls.write(tmp_path / "ls.log"),
             ls_simple.write(tmp_path / "ls_simple.log")]
    runs, report, _ = compare.compare(paths, plots=False)
    for run in runs[1:]:
        assert run.metrics["tflops_epoch1"] == tflops[0] and run.metrics["mfu_epoch1"] == mfu[0]
        assert run.metrics["tflops_steady"] == statistics.median(tflops[1:])
        assert run.metrics["mfu_steady"] == pytest.approx(statistics.median(mfu[1:]))
    assert runs[0].metrics["tflops_epoch1"] is None and "tflops_epoch1" not in runs[0].absent
    lines = report.splitlines()
    assert "| model TFLOP/s (tflops), epoch 1 (cold) | — | {0:.1f} | {0:.1f} | — | — |".format(tflops[0]) in lines
    assert "| model TFLOP/s (tflops), steady (median) | — | {0:.1f} | {0:.1f} | — | — |".format(
        statistics.median(tflops[1:])) in lines
    assert "| MFU % (mfu), epoch 1 (cold) | — | {0:.1f} | {0:.1f} | — | — |".format(mfu[0]) in lines
    assert "| MFU % (mfu), steady (median) | — | {0:.1f} | {0:.1f} | — | — |".format(
        statistics.median(mfu[1:])) in lines
    # ratios between two ls_ runs
    _, report, _ = compare.compare(paths[1:], plots=False)
    assert "| model TFLOP/s (tflops), epoch 1 (cold) | {0:.1f} | {0:.1f} | 1.000x |".format(tflops[0]) \
        in report.splitlines()


def test_wps_per_epoch_plot(tmp_path):
    """wps_over_time.png: the per-interval curve, and beside it (the right part of the figure) a
    bar per run and epoch in the run's colour."""
    pytest.importorskip("matplotlib")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    _, _, paths = compare.compare([write_a(tmp_path), write_c(tmp_path)], out_dir=str(tmp_path / "out"))
    png = [p for p in paths if p.endswith("wps_over_time.png")]
    assert png
    img = mpimg.imread(png[0])
    h, w = img.shape[:2]
    assert w >= 1200
    first = [int(255 * float(x)) for x in plt.matplotlib.colors.to_rgb(
        plt.rcParams["axes.prop_cycle"].by_key()["color"][0])]
    right = img[h // 4: 3 * h // 4, int(0.65 * w):, :3].reshape(-1, 3)
    hits = sum(1 for px in right[::3] if all(abs(int(255 * float(c)) - f) <= 2 for c, f in zip(px, first)))
    assert hits > 500  # the first run's bars


def test_max_update_then_extended(tmp_path):
    """The common workflow of stopping with --max-update 250 (mid-epoch 3: fairseq logs an end
    line for the 50 updates of epoch 3 and saves checkpoint_last at 250) and going on with
    --max-update 500 from it: epoch 3 then has two end lines, the first cut short, the second
    split between the sessions (100 updates in all, figures mixing both); the steady epochs are
    2, 4 and 5, and the last complete epoch is 5."""
    wps = {1: 1000, 2: 3000, 3: 2000, 4: 3200, 5: 3100}
    log = Log()
    log.start(0)
    full_run(log, wps=[wps[1], wps[2]], ups=[1.0, 3.0], walls=[100, 160], stamps=[101, 161], train_walls=[90, 50])
    log.inner(190, 3, 250, 3300)
    log.add(191, "fairseq_cli.train", "Stopping training due to num_updates: 250 >= max_update: 250")
    log.epoch(195, 3, 250, 2500, 2.5, 194, 25)
    log.add(196, "fairseq_cli.train", "done training in 196.0 seconds")
    log.start(900, resumed=250, epoch=3)
    log.inner(930, 3, 300, 3100)
    ts3, ts4, ts5 = 935, 995, 1052
    log.epoch(ts3, 3, 300, wps[3], 2.0, 0, 25)
    full_run(log, wps=[wps[4], wps[5]], ups=[3.2, 3.1], walls=[0, 0], stamps=[ts4, ts5], train_walls=[50, 51],
             epoch0=4, upd0=300)
    log.add(ts5 - 2, "fairseq_cli.train", "Stopping training due to num_updates: 500 >= max_update: 500")
    run = compare.load_run(log.write(tmp_path / "extended.log"), "extended")
    assert [(r["epoch"], r["session"], r["updates"], r["complete"], r["split"]) for r in run.epoch_rows] == [
        (1, 0, 100, True, False), (2, 0, 100, True, False), (3, 0, 50, False, False), (3, 1, 100, True, True),
        (4, 1, 100, True, False), (5, 1, 100, True, False)]
    m = run.metrics
    assert m["steady_epochs"] == "2, 4–5" and m["last_complete_epoch"] == 5
    assert m["wps_steady"] == statistics.median([wps[2], wps[4], wps[5]]) and m["wps_last"] == wps[5]
    assert m["epoch_wall_s"] == statistics.median([160 - 100, ts4 - ts3, ts5 - ts4])


def _stopped_in_epoch_2(tmp_path, name, wps2=80362.2):
    """Epoch 1 whole; --max-update stops training 30 updates into epoch 2, and fairseq logs its
    end-of-epoch line for those 30 updates all the same (wps 80362.2, as on the H100 run this
    mirrors)."""
    log = Log()
    log.start(0)
    full_run(log, wps=[40000], ups=[4.0], walls=[100], stamps=[101], train_walls=[90])
    log.inner(110, 2, 130, 81000)
    log.add(111, "fairseq_cli.train", "Stopping training due to num_updates: 130 >= max_update: 130")
    log.epoch(112, 2, 130, wps2, 8.04, 111, 9)
    log.add(113, "fairseq_cli.train", "done training in 112.0 seconds")
    return log.write(tmp_path / name)


def test_every_epoch_line_is_shown_and_a_cut_short_one_is_labelled(tmp_path):
    """fairseq's end-of-epoch line of an epoch cut short by --max-update is in the table of every
    epoch with its wps and ups, labelled; it is left out of "steady" only."""
    runs, report, _ = compare.compare([write_c(tmp_path), _stopped_in_epoch_2(tmp_path, "h.log")],
                                      labels=["c", "h"], plots=False)
    lines = report.splitlines()
    head = lines.index("## Every epoch: fairseq's end-of-epoch `train` lines")
    assert lines[head + 2:head + 6] == [
        "| epoch | c: wps (ups) | h: wps (ups) | h / c (wps) |",
        "|---:|---:|---:|---:|",
        "| 1 | 1,200 (1.20), cold | 40,000 (4.00), cold | {:.3f}x |".format(40000 / C["wps"][0]),
        "| 2 | — | 80,362 (8.04), cut short: 30 of 100 updates | — |"]
    h = runs[1].metrics
    assert h["wps_epoch1"] == 40000 and h["wps_steady"] is None
    assert runs[1].absent["wps_steady"] == "run has 1 complete epoch"


def test_an_epoch_1_cut_short_is_shown_labelled(tmp_path):
    """--max-update inside epoch 1: its figures are fairseq's all the same; the epoch-1 rows
    show them, labelled, instead of a blank."""
    log = Log()
    log.start(0)
    full_run(log, wps=[1000], ups=[1.0], walls=[50], stamps=[51], train_walls=[45])
    # stopped after 50 updates of epoch 1: fairseq logs the epoch's end line for them
    short = Log()
    short.start(0)
    short.inner(30, 1, 50, 1100)
    short.add(31, "fairseq_cli.train", "Stopping training due to num_updates: 50 >= max_update: 50")
    short.epoch(32, 1, 50, 900, 0.9, 31, 28)
    run = compare.load_run(short.write(tmp_path / "short.log"), "short")
    assert run.metrics["wps_epoch1"] == 900 and run.qualifiers["wps_epoch1"] == "cut short: 50 updates"
    assert run.metrics["epoch1_wall_s"] == 31
    _, report, _ = compare.compare([log.write(tmp_path / "whole.log"), str(tmp_path / "short.log")],
                                   labels=["whole", "short"], plots=False)
    assert "| wps, epoch 1 (cold) | 1,000 | 900 (cut short: 50 updates) | 0.900x |" in report.splitlines()


def test_speed_note_and_left_out_rows(tmp_path):
    """The quickstart on the CPU: the speed rows carry its note instead of a ratio, and the
    tflops/mfu rows are left out."""
    ls = Log()
    ls.start(0)
    full_run(ls, wps=[1500, 3000], ups=[1.5, 3.0], walls=[80, 115], stamps=[80, 115], train_walls=[70, 30],
             extra=[dict(tflops=0.0), dict(tflops=0.1)])
    paths = [write_b(tmp_path), ls.write(tmp_path / "ls.log")]
    _, report, _ = compare.compare(paths, labels=["b", "ls"], plots=False, omit=("tflops_", "mfu_"),
                                   speed_note="not a speed test")
    lines = report.splitlines()
    assert "tflops" not in report
    assert "| wps, epoch 1 (cold) | {:,.0f} | 1,500 | not a speed test |".format(B["wps"][0]) in lines
    assert any(line.startswith("| final train loss |") and line.endswith("x (+0.000) |") for line in lines)
    assert "| 2 | {:,.0f} ({:.2f}) | 3,000 (3.00) | not a speed test |".format(B["wps"][1], B["ups"][1]) in lines
