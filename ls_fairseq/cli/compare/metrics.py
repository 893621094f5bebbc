"""One run (a log and its eval outputs) reduced to the metrics of the table (stdlib only).

Records are the dicts of :mod:`.parse`; a run keeps them as lists: ``run.inner`` (training
intervals), ``run.epochs`` (end-of-epoch ``train`` lines), ``run.valid`` (validation lines of the
first subset), and ``run.epoch_rows``, one dict per end-of-epoch line with fairseq's own figures
for that epoch and whether it is complete (see :func:`epoch_rows`).
"""
import os
import statistics
from collections import OrderedDict

from .parse import add_elapsed, find_bleu, find_log, merge_sessions, parse_log


class Run:
    def __init__(self, path, label):
        self.path = path
        self.label = label
        self.missing = []  # what could not be found
        self.notes = []
        self.metrics = OrderedDict()
        self.absent = {}  # metric key -> why this run has no value for that row (shown in its cell)
        self.qualifiers = {}  # metric key -> what sets this run's value apart (shown beside it)
        self.inner = None  # lists of records (dicts), None without a training log
        self.epochs = None
        self.valid = None
        self.epoch_rows = []
        self.log = None
        self.time_source = None
        self.bleu = {}


def column(records, key):
    """The non-missing values of ``key`` in ``records`` (a list of dicts), in order."""
    return [r[key] for r in records or () if r.get(key) is not None]


def _median(values):
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def _mean(values):
    values = [v for v in values if v is not None]
    return float(statistics.fmean(values)) if values else None


def load_run(path, label):
    run = Run(path, label)
    run_dir = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if not os.path.exists(path):
        run.missing.append("run path {} does not exist".format(path))
        return run
    log_path, looked_for = find_log(path)
    if log_path is None:
        run.missing.append("training log: none found (looked for {})".format(looked_for))
    else:
        log = parse_log(log_path)
        run.log = log
        run.notes.append("log: {} (format: {}{})".format(
            log_path, log.log_format or "unknown", ", timestamps" if log.has_timestamps else ", no timestamps"))
        if log.duplicates_dropped:
            run.notes.append("{} duplicate progress lines dropped (fairseq --log-file repeats them)".format(
                log.duplicates_dropped))
        kept, notes = merge_sessions(log)
        run.notes.extend(notes)
        if not kept:
            run.missing.append(
                "training records: {} has no fairseq progress lines (simple/json log format; "
                "a tqdm log or a crash before the first --log-interval has none)".format(log_path))
        else:
            run.time_source = add_elapsed(log, kept)
            run.inner = [r for r in kept if r["kind"] == "inner"]
            run.epochs = [r for r in kept if r["kind"] == "epoch"]
            valid = [r for r in kept if r["kind"] == "valid"]
            if valid:
                # several validation subsets: report the first one (fairseq's default 'valid')
                first_subset = valid[0].get("subset")
                valid = [r for r in valid if r.get("subset") == first_subset]
            run.valid = valid
        for s in log.sessions:
            last = s is log.sessions[-1]
            if s.done:
                continue
            which = "the last training session" if last else "training session {}".format(s.index + 1)
            if s.error:
                run.notes.append("{} ended with an error: {}".format(which, s.error[:200]))
            elif last:
                run.notes.append("{} has no 'done training' line (interrupted or still running)".format(which))
            else:
                run.notes.append("{} stopped without 'done training' (killed?)".format(which))
        if len(log.sessions) > 1:
            run.notes.append("{} training sessions in the log (restarts)".format(len(log.sessions)))
    run.bleu = find_bleu(run_dir)
    _reduce(run)
    return run


# --------------------------------------------------------------------------------------------
# fairseq's end-of-epoch lines
# --------------------------------------------------------------------------------------------

# stats of the end-of-epoch line reported per epoch; tflops and mfu only ls_ runs log
EPOCH_STATS = ("wps", "ups", "tflops", "mfu", "train_wall")
FULL_EPOCH = 0.95  # a stopped session's last epoch with fewer updates than this x a full one is cut short


def epoch_rows(epochs, sessions, has_timestamps):
    """One dict per end-of-epoch ``train`` line, in update order: ``epoch``, ``session``,
    ``num_updates``, ``updates`` (since the previous epoch's end), fairseq's figures
    (:data:`EPOCH_STATS`, None where not logged), and:

    * ``complete``: the epoch's end line was logged and the epoch was not cut short; fairseq also
      logs the line when ``--max-update``/``--stop-time-hours`` stops training mid-epoch, so the
      last epoch of a session that logged "Stopping training due to ..." is cut short when it has
      fewer than 0.95 x the updates of the others (fp16 overflows skip a few updates, so the
      counts vary a little). An interrupted run's partial epoch has no end line, hence no row.
    * ``cold``: the run's first epoch or the first epoch a restarted session finished (start-up,
      CUDA warm-up, kernel build; a session resumed mid-epoch restores fairseq's epoch meters
      from the checkpoint, so that epoch's figures mix both sessions: ``split``): left out of
      "steady"; a split epoch is not the "last complete epoch" either.
    * ``wall_s``: the epoch's wall-clock, ``wall_source`` saying from what: the difference of the
      ``wall`` fields of consecutive end lines of one session (fairseq's clock since the trainer
      started, whole seconds), else of their log timestamps (a session resumed mid-epoch logs
      ``wall`` 0 throughout: fairseq resets that meter without restarting it); for an epoch that a
      session ran from its start, its ``wall`` (or the time since the session's first log line).
      None for an epoch split by a restart.
    """
    rows = []
    ordered = sorted(epochs, key=lambda r: r["num_updates"])
    walls = {}
    for e in ordered:
        walls.setdefault(e["session"], []).append(e.get("wall"))
    # a session's wall field is a clock if it is logged, moves, and never goes back
    wall_ok = {s: None not in w and max(w) > 0 and w == sorted(w) for s, w in walls.items()}
    for i, e in enumerate(ordered):
        prev = ordered[i - 1] if i else None
        session = sessions[int(e["session"])]
        row = OrderedDict([("epoch", int(e["epoch"])) if e.get("epoch") is not None else ("epoch", None),
                           ("session", int(e["session"])), ("num_updates", e["num_updates"])])
        # updates since the end of the previous epoch (not since a cut-short line of this epoch
        # that the session before a restart logged)
        before = [r for r in ordered[:i] if r.get("epoch") is not None and r["epoch"] < e["epoch"]]
        start_upd = before[-1]["num_updates"] if before else (session.resumed_from or 0)
        row["updates"] = e["num_updates"] - start_upd
        for key in EPOCH_STATS:
            row[key] = e.get(key)
        first_of_session = prev is None or prev["session"] != e["session"]
        # did this session run the whole epoch (from scratch, or resumed where the previous epoch
        # ended)? A restart from a checkpoint of this same epoch (say --max-update stopped it
        # mid-epoch) splits the epoch between two sessions.
        whole = first_of_session and (
            (prev is None and row["epoch"] == 1 and not session.resumed_from)
            or (prev is not None and session.resumed_from == prev["num_updates"]
                and prev.get("epoch") == e["epoch"] - 1))
        row["cold"] = first_of_session
        row["split"] = first_of_session and not whole and prev is not None
        row["wall_s"], row["wall_source"] = None, None
        if not first_of_session:
            if wall_ok[e["session"]]:
                row["wall_s"], row["wall_source"] = e["wall"] - prev["wall"], "wall field"
            elif has_timestamps and e.get("ts") is not None and prev.get("ts") is not None:
                row["wall_s"], row["wall_source"] = e["ts"] - prev["ts"], "log timestamps"
        elif whole:
            if wall_ok[e["session"]]:
                row["wall_s"], row["wall_source"] = e["wall"], "wall field"
            elif has_timestamps and e.get("ts") is not None and session.start_ts is not None:
                row["wall_s"], row["wall_source"] = e["ts"] - session.start_ts, "log timestamps"
        rows.append(row)
    for i, row in enumerate(rows):
        last_of_session = i + 1 == len(rows) or rows[i + 1]["session"] != row["session"]
        row["stopped"] = last_of_session and sessions[row["session"]].stop_reason is not None
    others = [r["updates"] for r in rows if not r["stopped"]]
    typical = max(others) if others else None
    for row in rows:
        row["complete"] = True
        row["why_incomplete"] = None
        row["full_updates"] = typical
        if row["stopped"] and (typical is None or row["updates"] < FULL_EPOCH * typical):
            row["complete"] = False
            row["why_incomplete"] = "cut short by '{}' after {:.0f} updates{}".format(
                sessions[row["session"]].stop_reason, row["updates"],
                "" if typical is None else " ({:.0f} in a full epoch)".format(typical))
    return rows


def _epoch_range(epochs):
    """[2, 3, 4, 6] -> '2–4, 6'."""
    parts, start = [], None
    for i, e in enumerate(epochs):
        if start is None:
            start = e
        if i + 1 == len(epochs) or epochs[i + 1] != e + 1:
            parts.append(str(start) if start == e else "{}–{}".format(start, e))
            start = None
    return ", ".join(parts)


def _epoch_metrics(run):
    """The per-epoch rows of the table: fairseq's figures of epoch 1, of the last complete epoch
    and their median over the steady epochs (complete, not cold); run.absent says why a row has
    no value for this run."""
    m, absent = run.metrics, run.absent
    rows = run.epoch_rows
    complete = [r for r in rows if r["complete"]]
    steady = [r for r in complete if not r["cold"]]
    # the last complete epoch that one session ran (a split epoch's figures mix two sessions)
    unsplit = [r for r in complete if not r["split"]]
    last = unsplit[-1] if unsplit else None
    m["epochs_complete"] = float(len(complete)) if rows else None
    m["steady_epochs"] = _epoch_range([r["epoch"] for r in steady]) if steady else None
    m["last_complete_epoch"] = float(last["epoch"]) if last else None

    first = rows[0] if rows else None
    first_label = None
    if first is None:
        why_first = "no end-of-epoch line"
    elif first["epoch"] != 1:
        why_first, first = "log starts at epoch {}".format(first["epoch"]), None
    else:
        why_first = None
        if not first["complete"]:  # fairseq's figures all the same: shown, and labelled
            first_label = "cut short: {:.0f}{} updates".format(
                first["updates"], " of {:.0f}".format(first["full_updates"]) if first["full_updates"] else "")
    if not rows:
        why_steady = why_last = "no end-of-epoch line"
    else:
        why_last = None if last else (
            "its complete epochs are split by restarts" if complete else "no complete epoch")
        if steady:
            why_steady = None
        elif len(complete) <= 1:
            why_steady = "run has {} complete epoch{}".format(len(complete), "" if len(complete) == 1 else "s")
        else:
            why_steady = "no complete epoch after the first outside a restart's first epoch"

    for key in ("wps", "ups", "tflops", "mfu"):
        logged = any(r[key] is not None for r in rows)
        m[key + "_epoch1"] = first[key] if first else None
        m[key + "_steady"] = _median(r[key] for r in steady)
        m[key + "_last"] = last[key] if last else None
        if not logged:
            continue  # not in this log at all (tflops/mfu of a fairseq run): a plain '—'
        for suffix, why in (("_epoch1", why_first), ("_steady", why_steady), ("_last", why_last)):
            if m[key + suffix] is None and why:
                absent[key + suffix] = why
        if first_label and m[key + "_epoch1"] is not None:
            run.qualifiers[key + "_epoch1"] = first_label
    m["epoch1_wall_s"] = first["wall_s"] if first else None
    if first_label and m["epoch1_wall_s"] is not None:
        run.qualifiers["epoch1_wall_s"] = first_label
    m["epoch_wall_s"] = _median(r["wall_s"] for r in steady)
    m["epoch_train_wall_s"] = _median(r["train_wall"] for r in steady)
    sources = sorted({r["wall_source"] for r in ([first] if first else []) + steady if r["wall_s"] is not None})
    m["epoch_wall_source"] = " + ".join(sources) if sources else None
    for key, why in (("epoch1_wall_s", why_first), ("epoch_wall_s", why_steady), ("epoch_train_wall_s", why_steady)):
        if m[key] is None and why:
            absent[key] = why

    if not rows:
        run.missing.append("per-epoch figures: no end-of-epoch training line (no epoch finished?)")
    else:
        if m["epoch1_wall_s"] is None and m["epoch_wall_s"] is None and complete:
            run.missing.append("wall-clock per epoch: neither fairseq's wall field nor log timestamps time a "
                               "complete epoch")
        for r in rows:
            if not r["complete"]:
                run.notes.append("epoch {}: {}: not a complete epoch".format(r["epoch"], r["why_incomplete"]))
            if r["split"]:
                run.notes.append("epoch {} spans the restart of session {} (resumed at update {}): fairseq's "
                                 "figures for it mix both sessions; not counted as steady".format(
                                     r["epoch"], r["session"] + 1, run.log.sessions[r["session"]].resumed_from))
            elif r["cold"] and r["session"] > 0:
                run.notes.append("epoch {}: first epoch of restarted session {}: cold, not counted as "
                                 "steady".format(r["epoch"], r["session"] + 1))


# --------------------------------------------------------------------------------------------
# the logged intervals
# --------------------------------------------------------------------------------------------

def timed_tokens(groups):
    """(tokens, seconds) of logged training intervals timed by the time each one's log ended:
    ``groups`` (one per epoch of a session) of (num_updates, wpb, end time) in update order. An
    interval holds wpb x the updates since the previous one and lasts from that one's end to its
    own, so a group's first interval is only the starting point (it spans the epoch boundary or
    the warm-up). Shared by this tool (log timestamps) and bench/e2e.py (its wrapper's stamps)."""
    tokens = seconds = 0.0
    for g in groups:
        for (u0, _, t0), (u1, wpb, t1) in zip(g, g[1:]):
            tokens += float(wpb) * (float(u1) - float(u0))
            seconds += float(t1) - float(t0)
    return tokens, seconds


WALL_MIN_S = 60.0  # log timestamps have a 1-s resolution: at 60 s, one second is under 2%


def _groups(inner):
    """The intervals by (session, epoch), each in update order, groups in order of first appearance."""
    groups = OrderedDict()
    for r in inner:
        groups.setdefault((r["session"], r.get("epoch")), []).append(r)
    return [sorted(g, key=lambda r: r["num_updates"]) for g in groups.values()]


def wall_clock_wps(inner):
    """(target tokens/s, None) of the training intervals timed by their log timestamps, or
    (None, why there is none).

    In each (session, epoch), the intervals sorted by num_updates, r0..rn: the tokens of r1..rn
    (wpb x updates of each) over ts(rn) - ts(r0). r0 is only the starting point, as the first
    interval is left out of wps (validation, checkpointing, warm-up). fairseq's own interval wps
    reads the interval's time before the gnorm, whose read waits for the GPU work still queued;
    that wait lies in no interval's time. Without a per-update host sync
    (``--ls-deferred-overflow-check``) it is about 0.7 of an update per log, so the interval wps
    reads high by ~0.7 / --log-interval; the timestamps include the wait."""
    if not inner:
        return None, "no per-interval training records"
    for key, what, absent in (("ts", "log timestamp", "no log timestamps (a --log-file log has none)"),
                              ("wpb", "wpb", "no wpb on the training intervals")):
        lacking = sum(r.get(key) is None for r in inner)
        if lacking == len(inner):
            return None, absent
        if lacking:
            return None, "{} of {} training intervals have no {}".format(lacking, len(inner), what)
    groups = [[(r["num_updates"], r["wpb"], r["ts"]) for r in g] for g in _groups(inner)]
    tokens, seconds = timed_tokens(groups)
    timed = sum(max(len(g) - 1, 0) for g in groups)
    if not timed:
        return None, "no epoch has two logged training intervals in one session"
    if seconds < WALL_MIN_S:
        return None, "the {} timed training intervals span {:.0f} s of log timestamps, under the {:.0f} s " \
                     "that their 1-s resolution needs".format(timed, seconds, WALL_MIN_S)
    return tokens / seconds, None


def steady_intervals(inner):
    """The intervals without the first of each epoch and session: fairseq's interval meters run
    on through validation and checkpointing at the epoch boundary, and a session's first interval
    carries CUDA warm-up and the kernel JIT build. With one interval per epoch, only each
    session's first is left out; with one in all, it is kept."""
    steady = [r for g in _groups(inner) for r in g[1:]]
    if not steady:
        firsts = {}
        for r in sorted(inner, key=lambda r: r["num_updates"]):
            firsts.setdefault(r["session"], id(r))
        steady = [r for r in inner if id(r) != firsts[r["session"]]]
    return steady or list(inner)


def _interval_metrics(run):
    m = run.metrics
    inner = run.inner
    if inner:
        steady = steady_intervals(inner)
        for key in ("wps", "ups"):
            m[key + "_interval"] = _mean(column(steady, key))
            if m[key + "_interval"] is None:
                run.missing.append("{} per interval: not in the training log".format(key))
        m["wps_wall"], why = wall_clock_wps(inner)
        if why:
            run.missing.append("wps_wall: " + why)
    else:
        m["wps_interval"] = m["ups_interval"] = m["wps_wall"] = None
        if run.epochs:  # a tqdm log: only the end-of-epoch lines
            run.notes.append("no per-interval training records (a tqdm log?): only fairseq's per-epoch figures")


# --------------------------------------------------------------------------------------------
# everything else
# --------------------------------------------------------------------------------------------

def _last_of(records, key):
    d = sorted((r for r in records or () if r.get(key) is not None), key=lambda r: r["num_updates"])
    return float(d[-1][key]) if d else None


def _reduce(run):
    m = run.metrics
    inner, epochs, valid = run.inner, run.epochs, run.valid
    log = run.log
    everything = (inner or []) + (epochs or []) + (valid or [])

    # ---- progress
    ups = column(everything, "num_updates")
    last_upd = float(max(ups)) if ups else None
    m["updates"] = last_upd
    eps = column(everything, "epoch")
    m["epochs"] = float(max(eps)) if eps else None

    # ---- throughput and time
    run.epoch_rows = epoch_rows(epochs, log.sessions, log.has_timestamps) if epochs else []
    _epoch_metrics(run)
    _interval_metrics(run)
    elapsed = column(everything, "elapsed")
    m["wall_clock_s"] = float(max(elapsed)) if inner and elapsed else None

    # ---- memory: fairseq logs gb_free = total - torch.cuda.max_memory_allocated() per interval
    m["peak_mem_gb"] = None
    m["min_gb_free"] = None
    free = column(inner, "gb_free") or column(epochs, "gb_free")
    if free:
        m["min_gb_free"] = float(min(free))
        if log.gpu_total_gb is not None:
            m["peak_mem_gb"] = log.gpu_total_gb - m["min_gb_free"]
        else:
            run.missing.append(
                "GPU total memory: no 'total memory = ... GB' line (a --log-file log does not have it); "
                "reporting min gb_free only")
    else:
        run.missing.append("peak memory: no gb_free in the training log (CPU run, or not a CUDA run)")

    # ---- losses
    # the final train loss: the epoch average if the last epoch line is at the very end, else the
    # last logged interval (an interrupted run has no final epoch line)
    for key in ("loss", "nll_loss"):
        val = None
        if epochs and last_upd is not None and max(column(epochs, "num_updates")) >= last_upd:
            val = _last_of(epochs, key)
        if val is None:
            val = _last_of(inner, key)
        m["train_" + key] = val
    if m["train_loss"] is None:
        run.missing.append("train loss: no training records")
    m["valid_loss"] = _last_of(valid, "loss")
    m["valid_nll_loss"] = _last_of(valid, "nll_loss")
    vl = column(valid, "loss")
    m["best_valid_loss"] = float(min(vl)) if vl else None
    if m["valid_loss"] is None:
        run.missing.append("valid loss: no validation line in the log")

    # ---- BLEU
    b = run.bleu
    m["bleu_sacrebleu"] = b.get("sacrebleu")
    m["bleu_compound_split"] = b.get("compound_split")
    m["bleu_generate"] = b.get("generate")
    for key, what in (("sacrebleu", "detokenised sacreBLEU (eval/sacrebleu.json)"),
                      ("compound_split", "compound-split tokenised BLEU (eval/compound_split_bleu.txt)"),
                      ("generate", "fairseq-generate BLEU (eval/generate-*.txt)")):
        if key + "_error" in b:
            run.missing.append("{}: {}".format(what, b[key + "_error"]))
        elif key not in b:
            run.missing.append("{}: not found".format(what))
        else:
            run.notes.append("{}: {}".format(what.split(" (")[0], b[key + "_file"]))
