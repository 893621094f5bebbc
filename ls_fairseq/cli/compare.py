"""ls-fairseq-compare: compare fairseq training runs (speed, memory, loss, BLEU) from their logs.

    ls-fairseq-compare RUN_A RUN_B [RUN_C ...] [--labels a,b,c] [--out-dir DIR] [--json FILE]

Each RUN is a run directory (the ``--save-dir`` of the recipes: ``train.log`` plus ``eval/``) or a
log file. What is read:

* training logs written by ``fairseq-train`` in the ``simple`` or ``json`` log format (``tqdm``
  logs only carry the per-epoch lines), either captured from stderr (lines prefixed with
  ``date | INFO | logger |``) or written by ``--log-file`` (bare messages, and fairseq 0.12 repeats
  every progress line once per epoch there: duplicates are dropped);
* several training sessions appended to one log (a run interrupted and restarted from
  ``checkpoint_last.pt``): the updates that were redone after the restart replace the lost ones;
* evaluation outputs in the run directory: ``sacrebleu.json`` (``sacrebleu -f json``),
  ``compound_split_bleu.txt`` (``fairseq-score`` output) and ``generate-*.txt``
  (``fairseq-generate`` output with its ``BLEU4 =`` line).

It prints a markdown table (one column per run, ratios against the first run) and the list of
what it could not find, and writes PNG plots: loss vs updates, loss vs wall-clock, wps over time.
Throughput is given twice: fairseq's own interval wps, and the same intervals timed by the log
timestamps, the one to compare for ``--ls-deferred-overflow-check`` runs (whose interval wps
leaves out the wait for the GPU work queued at each log, and so reads high).
The loss-curve rows say whether a run's training loss follows the first run's: the mean and
standard deviation of the differences of their interval losses logged at the same updates, and
each run's largest loss spike over its neighbouring intervals (``--curve-from`` skips the
warm-up). Intervals with a non-finite gnorm hold an update that overflowed in fp16, which fairseq
itself never logs (only ``--ls-deferred-overflow-check`` runs log them): they are left out and
counted.
"""
import argparse
import glob
import json
import logging
import math
import os
import re
import statistics
import sys
from collections import OrderedDict

# --------------------------------------------------------------------------------------------
# log parsing
# --------------------------------------------------------------------------------------------

_PREFIX_RE = re.compile(
    r"^(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) \| (?P<level>[A-Z]+) \| (?P<logger>[^|]+?) \| (?P<msg>.*)$"
)
_SIMPLE_INNER_RE = re.compile(r"^epoch (?P<epoch>\d+):\s+(?P<i>\d+) / (?P<n>\d+) (?P<stats>.*)$")
_SIMPLE_EPOCH_RE = re.compile(r"^epoch (?P<epoch>\d+) \| (?P<rest>.*)$")
_VALID_ON_RE = re.compile(r"^(?P<subset>.+?) on '(?P<name>[^']+)' subset$")
_LOADED_RE = re.compile(r"Loaded checkpoint (?P<path>\S+) \(epoch (?P<epoch>\d+) @ (?P<upd>\d+) updates\)")
_TOTAL_MEM_RE = re.compile(r"total memory = (?P<gb>[\d.]+) GB ; name = (?P<name>.*?)\s*$")
_ARCH_RE = re.compile(r"""(?:'arch': '|\barch=')(?P<arch>[^']+)'""")
_DONE_RE = re.compile(r"^done training in (?P<sec>[\d.]+) seconds")
_GEN_BLEU_RE = re.compile(r"Generate \S+ with beam=\d+: BLEU4 = (?P<bleu>[\d.]+)")
_BLEU4_RE = re.compile(r"BLEU4? = (?P<bleu>[\d.]+)")


def _num(value):
    """fairseq formats stats with '{:g}' / '{:.3f}' (json: as strings); anything else -> None."""
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _parse_pairs(text, item_sep, kv_sep):
    out = OrderedDict()
    for item in text.split(item_sep):
        item = item.strip()
        if not item or kv_sep not in item:
            continue
        key, value = item.split(kv_sep, 1)
        out[key.strip()] = value.strip()
    return out


def _split_json_prefix(stats):
    """End-of-epoch json lines prefix every key with the tag ('train_loss', 'valid_loss',
    'train_train_wall'); return (tag, stats without the prefix)."""
    prefixes = [k[: -len("_loss")] for k in stats if k.endswith("_loss") and k != "nll_loss"]
    if not prefixes:
        return None, stats
    tag = min(prefixes, key=len)
    plen = len(tag) + 1
    return tag, OrderedDict((k[plen:] if k.startswith(tag + "_") else k, v) for k, v in stats.items())


class Session:
    """One fairseq-train process inside a log file."""

    def __init__(self, index, start_ts):
        self.index = index
        self.start_ts = start_ts
        self.last_ts = start_ts
        self.resumed_from = None  # num_updates of the checkpoint it restarted from (if logged)
        self.done = False
        self.error = None
        self.stop_reason = None
        self.n_records = 0


class ParsedLog:
    def __init__(self, path):
        self.path = path
        self.records = []  # dicts: kind (inner|epoch|valid), session, ts, stats..., line
        self.sessions = []
        self.has_timestamps = False
        self.gpu_total_gb = None
        self.gpu_name = None
        self.world_size = None
        self.arch = None
        self.log_format = None
        self.duplicates_dropped = 0
        self.epoch_sizes = {}  # epoch -> updates per epoch seen in "i / n" of inner lines


def _ts_seconds(ts):
    import datetime

    return datetime.datetime.strptime(ts, "%Y-%m-%d %H:%M:%S").timestamp()


def parse_log(path):
    """Read one fairseq-train log (any mix of sessions) into a ParsedLog."""
    log = ParsedLog(path)
    session = None
    seen = set()
    formats = set()

    def new_session(ts):
        nonlocal session, seen
        if session is not None and session.n_records == 0 and session.resumed_from is None:
            session.start_ts = ts  # only preamble so far (import warnings...): same process
            return
        session = Session(len(log.sessions), ts)
        log.sessions.append(session)
        seen = set()

    with open(path, encoding="utf-8", errors="replace") as f:
        for raw in f:
            line = raw.rstrip("\n")
            m = _PREFIX_RE.match(line)
            ts = None
            logger = None
            if m:
                ts = _ts_seconds(m.group("ts"))
                logger = m.group("logger").strip()
                msg = m.group("msg")
                log.has_timestamps = True
            else:
                msg = line
            stripped = msg.strip()

            # ---- session boundaries and run metadata --------------------------------------
            is_cfg = stripped.startswith("{'_name':") or stripped.startswith("Namespace(")
            if is_cfg:
                new_session(ts)
                am = _ARCH_RE.search(stripped)
                if am:
                    log.arch = am.group("arch")
                continue
            if session is None and not (m or _SIMPLE_INNER_RE.match(stripped) or _SIMPLE_EPOCH_RE.match(stripped)
                                        or stripped.startswith("{")):
                continue  # output before the first fairseq line (warnings from imports...)
            if session is None:
                new_session(ts)  # a log that starts mid-way (truncated / rotated)
            if ts is not None:
                if session.start_ts is None:
                    session.start_ts = ts
                session.last_ts = ts
            lm = _LOADED_RE.search(stripped)
            if lm:
                session.resumed_from = int(lm.group("upd"))
                continue
            if stripped.startswith("No existing checkpoint found"):
                session.resumed_from = 0
                continue
            mm = _TOTAL_MEM_RE.search(stripped)
            if mm:
                gb = float(mm.group("gb"))
                log.gpu_total_gb = gb if log.gpu_total_gb is None else min(log.gpu_total_gb, gb)
                log.gpu_name = mm.group("name")
                continue
            wm = re.match(r"training on (\d+) devices", stripped)
            if wm:
                log.world_size = int(wm.group(1))
                continue
            if _DONE_RE.match(stripped):
                session.done = True
                continue
            if stripped.startswith("Stopping training due to"):
                session.stop_reason = stripped
                continue
            if stripped.startswith("Traceback (most recent call last)"):
                session.error = session.error or "Traceback"
                continue
            if re.match(r"^[\w.]*(Error|Exception|KeyboardInterrupt)(: |$)", stripped):
                if session.error in (None, "Traceback"):
                    session.error = stripped  # the exception line that ends a traceback
                continue

            # ---- progress records ---------------------------------------------------------
            rec = None
            if stripped.startswith("{") and stripped.endswith("}"):
                try:
                    data = json.loads(stripped, object_pairs_hook=OrderedDict)
                except ValueError:
                    data = None
                if isinstance(data, dict) and "epoch" in data:
                    formats.add("json")
                    if "loss" in data or logger == "train_inner":
                        rec = {"kind": "inner", **{k: _num(v) for k, v in data.items()}}
                    else:
                        tag, stats = _split_json_prefix(data)
                        if tag is None:
                            continue
                        kind = "epoch" if tag == "train" else "valid"
                        rec = {"kind": kind, **{k: _num(v) for k, v in stats.items()}}
                        if kind == "valid":
                            rec["subset"] = tag
            else:
                im = _SIMPLE_INNER_RE.match(stripped)
                if im:
                    formats.add("simple")
                    stats = _parse_pairs(im.group("stats"), ",", "=")
                    rec = {"kind": "inner", "epoch": float(im.group("epoch"))}
                    rec.update({k: _num(v) for k, v in stats.items()})
                    log.epoch_sizes[int(im.group("epoch"))] = int(im.group("n"))
                else:
                    em = _SIMPLE_EPOCH_RE.match(stripped)
                    if em:
                        formats.add("simple")
                        parts = em.group("rest").split(" | ")
                        vm = _VALID_ON_RE.match(parts[0].strip())
                        if vm:
                            rec = {"kind": "valid", "subset": vm.group("name")}
                            parts = parts[1:]
                        else:
                            rec = {"kind": "epoch"}
                        rec["epoch"] = float(em.group("epoch"))
                        rec.update({k: _num(v) for k, v in _parse_pairs(" | ".join(parts), " | ", " ").items()})
            if rec is None or rec.get("num_updates") is None:
                continue
            key = (rec["kind"], stripped)
            if key in seen:  # --log-file in fairseq 0.12 writes each line once per epoch so far
                log.duplicates_dropped += 1
                continue
            seen.add(key)
            rec["session"] = session.index
            session.n_records += 1
            rec["ts"] = ts
            log.records.append(rec)
    log.log_format = "+".join(sorted(formats)) if formats else None
    return log


# --------------------------------------------------------------------------------------------
# one run = one log + eval outputs, reduced to metrics
# --------------------------------------------------------------------------------------------

LOG_CANDIDATES = ("train.log", "train.stderr.log", "train.fairseq.log")


def find_log(run_path):
    """-> (log path or None, what was looked for)."""
    if os.path.isfile(run_path):
        return run_path, run_path
    for name in LOG_CANDIDATES:
        p = os.path.join(run_path, name)
        if os.path.isfile(p):
            return p, None
    logs = sorted(glob.glob(os.path.join(run_path, "*.log")), key=os.path.getsize, reverse=True)
    if logs:
        return logs[0], None
    return None, "{} or *.log in {}".format(", ".join(LOG_CANDIDATES), run_path)


def _find_first(run_dir, patterns):
    for pattern in patterns:
        hits = sorted(glob.glob(os.path.join(run_dir, pattern)), key=os.path.getmtime, reverse=True)
        if hits:
            return hits[0]
    return None


def find_bleu(run_dir):
    """-> dict with 'sacrebleu', 'compound_split', 'generate' scores (+ the files used)."""
    out = {}
    f = _find_first(run_dir, ["eval/sacrebleu.json", "sacrebleu.json", "eval/*sacrebleu*.json", "*sacrebleu*.json"])
    if f:
        try:
            with open(f, encoding="utf-8") as fh:
                data = json.load(fh)
            out["sacrebleu"] = float(data["score"])
            out["sacrebleu_signature"] = data.get("signature")
            out["sacrebleu_file"] = f
        except (ValueError, KeyError, TypeError) as e:
            out["sacrebleu_error"] = "{}: unreadable ({})".format(f, e)
    f = _find_first(run_dir, ["eval/compound_split_bleu.txt", "compound_split_bleu.txt", "eval/*compound*bleu*.txt"])
    if f:
        with open(f, encoding="utf-8", errors="replace") as fh:
            m = None
            for line in fh:
                m = _BLEU4_RE.search(line) or m
        if m:
            out["compound_split"] = float(m.group("bleu"))
            out["compound_split_file"] = f
        else:
            out["compound_split_error"] = "{}: no 'BLEU4 = ' line".format(f)
    f = _find_first(run_dir, ["eval/generate-*.txt", "generate-*.txt", "eval/generate*.out", "generate*.out"])
    if f:
        score = None
        with open(f, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                m = _GEN_BLEU_RE.search(line)
                if m:
                    score = float(m.group("bleu"))
        if score is not None:
            out["generate"] = score
            out["generate_file"] = f
        else:
            out["generate_error"] = "{}: no 'Generate ... BLEU4 =' line (interrupted generation?)".format(f)
    return out


def merge_sessions(log):
    """Drop the records that a later session redid after restarting from a checkpoint.

    Returns (records kept, notes). A session that logged 'Loaded checkpoint ... @ U updates'
    restarted from U: records of earlier sessions past U were lost with the crash. Without that
    line (e.g. --log-file), the first num_updates the new session logs is used instead.
    """
    notes = []
    kept = list(log.records)
    for s in log.sessions[1:]:
        own = [r for r in kept if r["session"] == s.index]
        if s.resumed_from is not None:
            cut, strict = s.resumed_from, True
        elif own:
            cut, strict = min(r["num_updates"] for r in own), False
        else:
            continue
        before = len(kept)
        kept = [
            r
            for r in kept
            if r["session"] >= s.index or (r["num_updates"] <= cut if strict else r["num_updates"] < cut)
        ]
        dropped = before - len(kept)
        if cut == 0:
            notes.append("session {} started from scratch: earlier sessions in this log ignored".format(s.index + 1))
        elif dropped:
            notes.append(
                "session {} resumed at update {}: {} records of the interrupted session replaced".format(
                    s.index + 1, int(cut), dropped
                )
            )
        else:
            notes.append("session {} resumed at update {}".format(s.index + 1, int(cut)))
    return kept, notes


def _elapsed(log, kept):
    """Add 'elapsed' (seconds of wall-clock across sessions) to every kept record.

    With log timestamps: time since the start of the session plus the full length of the earlier
    sessions (time lost to a crash counts; downtime between sessions does not). Without them
    (--log-file): training time summed from the intervals' ups (updates / (updates/s)).
    """
    if log.has_timestamps and all(s.start_ts is not None for s in log.sessions) \
            and all(r["ts"] is not None for r in kept):
        offsets, acc = {}, 0.0
        for s in log.sessions:
            offsets[s.index] = acc
            acc += (s.last_ts or s.start_ts) - s.start_ts
        for r in kept:
            r["elapsed"] = offsets[r["session"]] + (r["ts"] - log.sessions[r["session"]].start_ts)
        return "log timestamps"
    acc, prev = 0.0, 0.0
    last_session = None
    for r in kept:
        if r["kind"] != "inner":
            continue
        if r["session"] != last_session:
            # a restart resumes at the checkpoint's update count (when the log says it), else at
            # the last update kept from before (an upper bound on the time of the first interval)
            resumed = log.sessions[r["session"]].resumed_from
            if resumed is not None:
                prev = resumed
            last_session = r["session"]
        if r.get("ups"):
            acc += max(0.0, r["num_updates"] - prev) / r["ups"]
        prev = r["num_updates"]
        r["elapsed"] = acc
    # epoch/valid records: time of the latest inner record at or before their update
    inner = [r for r in kept if r["kind"] == "inner"]
    for r in kept:
        if r["kind"] == "inner":
            continue
        t = [x["elapsed"] for x in inner if x["num_updates"] <= r["num_updates"]]
        r["elapsed"] = t[-1] if t else 0.0
    return "summed from ups"


class Run:
    def __init__(self, path, label):
        self.path = path
        self.label = label
        self.missing = []  # what could not be found
        self.notes = []
        self.metrics = OrderedDict()
        self.inner = None  # pandas DataFrames
        self.epochs = None
        self.valid = None
        self.log = None
        self.time_source = None


def load_run(path, label):
    import pandas as pd

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
            run.time_source = _elapsed(log, kept)
            df = pd.DataFrame(kept)
            run.inner = df[df.kind == "inner"].dropna(axis=1, how="all").reset_index(drop=True)
            run.epochs = df[df.kind == "epoch"].dropna(axis=1, how="all").reset_index(drop=True)
            valid = df[df.kind == "valid"]
            if "subset" in valid:
                # several validation subsets: report the first one (fairseq's default 'valid')
                first_subset = valid.subset.iloc[0] if len(valid) else None
                valid = valid[valid.subset == first_subset]
            run.valid = valid.dropna(axis=1, how="all").reset_index(drop=True)
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


def _median(series):
    series = series.dropna()
    return float(series.median()) if len(series) else None


def _mean(series):
    series = series.dropna()
    return float(series.mean()) if len(series) else None


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
    if inner is None or not len(inner):
        return None, "no per-interval training records"
    for key, what, absent in (("ts", "log timestamp", "no log timestamps (a --log-file log has none)"),
                              ("wpb", "wpb", "no wpb on the training intervals")):
        if key not in inner:
            return None, absent
        lacking = int(inner[key].isna().sum())
        if lacking:
            return None, "{} of {} training intervals have no {}".format(lacking, len(inner), what)
    groups = [list(zip(g.num_updates, g.wpb, g.ts))
              for _, g in inner.groupby(["session", "epoch"])
              for g in [g.sort_values("num_updates")]]
    tokens, seconds = timed_tokens(groups)
    timed = sum(max(len(g) - 1, 0) for g in groups)
    if not timed:
        return None, "no epoch has two logged training intervals in one session"
    if seconds < WALL_MIN_S:
        return None, "the {} timed training intervals span {:.0f} s of log timestamps, under the {:.0f} s " \
                     "that their 1-s resolution needs".format(timed, seconds, WALL_MIN_S)
    return tokens / seconds, None


def _reduce(run):
    m = run.metrics
    inner, epochs, valid = run.inner, run.epochs, run.valid
    log = run.log

    def col(df, name):
        return df[name] if df is not None and name in df else None

    # ---- progress
    last_upd = None
    for df in (inner, epochs, valid):
        c = col(df, "num_updates")
        if c is not None and len(c.dropna()):
            last_upd = max(last_upd or 0, float(c.max()))
    m["updates"] = last_upd
    ep = None
    for df in (inner, epochs, valid):
        c = col(df, "epoch")
        if c is not None and len(c.dropna()):
            ep = max(ep or 0, float(c.max()))
    m["epochs"] = ep

    # ---- throughput: mean over the logged intervals, skipping the first interval of each epoch
    # and session: fairseq's interval meters run on through validation and checkpointing at the
    # epoch boundary, and a session's first interval carries CUDA warm-up and the kernel JIT build
    if inner is not None and len(inner):
        steady = inner[inner.groupby(["session", "epoch"]).cumcount() > 0]
        if not len(steady):  # one interval per epoch: skip only each session's first
            steady = inner[inner.groupby("session").cumcount() > 0]
        if not len(steady):
            steady = inner
        for key in ("wps", "ups"):
            m[key] = _mean(steady[key]) if key in steady else None
            if m[key] is None:
                run.missing.append("{}: not in the training log".format(key))
        m["wps_wall"], why = wall_clock_wps(inner)
        if why:
            run.missing.append("wps_wall: " + why)
    else:
        # tqdm logs: only the per-epoch lines carry wps/ups
        for key in ("wps", "ups"):
            m[key] = _mean(epochs[key]) if epochs is not None and key in epochs else None
            if m[key] is None:
                run.missing.append("{}: no per-interval or per-epoch training records".format(key))
        m["wps_wall"] = None
        run.missing.append("wps_wall: no per-interval training records")

    # ---- time per epoch
    m["epoch_wall_s"] = None
    m["epoch_train_wall_s"] = None
    if epochs is not None and len(epochs):
        e = epochs.sort_values("num_updates").reset_index(drop=True)
        # an epoch is complete unless it is the last one of a session that fairseq stopped
        # ("Stopping training due to num_updates / stop-time ...") and it is shorter than the
        # others (fp16 overflows skip a few updates, so update counts vary a little)
        n_upd = e.num_updates - e.num_updates.shift(1).fillna(0)
        last_of_session = ~e.session.eq(e.session.shift(-1))
        stopped = e.session.map(lambda i: log.sessions[int(i)].stop_reason is not None)
        others = n_upd[~(last_of_session & stopped)]
        typical = others.max() if len(others) else float("inf")
        full = e[~(last_of_session & stopped & (n_upd < 0.95 * typical))]
        if "train_wall" in full:
            m["epoch_train_wall_s"] = _median(full.train_wall)
        if log is not None and log.has_timestamps and "ts" in e and e.ts.notna().all():
            # consecutive epoch ends within one session: includes validation and checkpointing
            d = e.ts.diff()
            same = e.session.eq(e.session.shift(1))
            durations = d[same & e.index.isin(full.index)]
            m["epoch_wall_s"] = _median(durations) if len(durations) else None
        if m["epoch_wall_s"] is None and m["epoch_train_wall_s"] is None:
            run.missing.append("time per epoch: no complete epoch with timing in the log")
        elif m["epoch_wall_s"] is None:
            run.notes.append("epoch wall-clock needs two consecutive complete epochs in one session with "
                             "log timestamps; only fairseq's train_wall per epoch is reported")
    else:
        run.missing.append("time per epoch: no end-of-epoch training line (no epoch finished?)")
    if inner is not None and len(inner) and "elapsed" in inner:
        m["wall_clock_s"] = float(max(inner.elapsed.max(), (epochs.elapsed.max() if epochs is not None and len(epochs) else 0)))
    else:
        m["wall_clock_s"] = None

    # ---- memory
    m["peak_mem_gb"] = None
    m["min_gb_free"] = None
    if inner is not None and "gb_free" in inner and inner.gb_free.notna().any():
        m["min_gb_free"] = float(inner.gb_free.min())
        if log.gpu_total_gb is not None:
            m["peak_mem_gb"] = log.gpu_total_gb - m["min_gb_free"]
        else:
            run.missing.append(
                "GPU total memory: no 'total memory = ... GB' line (a --log-file log does not have it); "
                "reporting min gb_free only")
    else:
        run.missing.append("peak memory: no gb_free in the training log (CPU run, or not a CUDA run)")

    # ---- losses
    def last_of(df, key):
        if df is None or key not in df or not df[key].notna().any():
            return None
        d = df[df[key].notna()].sort_values("num_updates")
        return float(d[key].iloc[-1])

    # the final train loss: the epoch average if the last epoch line is at the very end, else the
    # last logged interval (an interrupted run has no final epoch line)
    for key in ("loss", "nll_loss"):
        val = None
        if epochs is not None and len(epochs) and key in epochs and last_upd is not None \
                and float(epochs.num_updates.max()) >= last_upd:
            val = last_of(epochs, key)
        if val is None:
            val = last_of(inner, key)
        m["train_" + key] = val
    if m["train_loss"] is None:
        run.missing.append("train loss: no training records")
    m["valid_loss"] = last_of(valid, "loss")
    m["valid_nll_loss"] = last_of(valid, "nll_loss")
    m["best_valid_loss"] = float(valid["loss"].min()) if valid is not None and "loss" in valid and len(valid) else None
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


# --------------------------------------------------------------------------------------------
# the loss curve against the first run
# --------------------------------------------------------------------------------------------

CURVE_FROM = 300  # --curve-from: the loss-curve rows skip the warm-up's steep descent
NEIGHBOURS = 5  # a jump is measured against the median of this many intervals on each side


def _interval_losses(run, curve_from):
    """{num_updates: loss} of the logged training intervals from update ``curve_from`` on, and
    how many were left out because they hold a skipped update (:func:`holds_skipped_update`)."""
    inner = run.inner
    if inner is None or "loss" not in inner or "num_updates" not in inner:
        return {}, 0
    cols = ["num_updates", "loss"] + (["gnorm"] if "gnorm" in inner else [])
    d = inner[cols].dropna(subset=["num_updates", "loss"])
    gnorms = d.gnorm if "gnorm" in d else [None] * len(d)
    return loss_curve(((int(u), float(v), holds_skipped_update(g))
                       for u, v, g in zip(d.num_updates, d.loss, gnorms)), curve_from)


def loss_curve(points, curve_from):
    """({num_updates: loss}, left out) from (num_updates, loss, holds a skipped update) points:
    the points from update ``curve_from`` on, without those holding a skipped update, and how
    many of those were left out."""
    kept, left_out = {}, 0
    for u, loss, skipped in points:
        if u < curve_from:
            continue
        if skipped:
            left_out += 1
        else:
            kept[u] = loss
    return kept, left_out


def holds_skipped_update(gnorm):
    """Whether a logged interval holds an update whose fp16 gradients overflowed.

    fairseq's trainer neither counts nor logs such an update. With ``--ls-deferred-overflow-check``
    the trainer learns of the overflow one update late, so it counts and logs the update, with a
    non-finite gnorm (``inf``/``nan``), which makes its interval's mean gnorm non-finite. Its loss
    is that of a batch whose gradients overflowed, often far above its neighbours' (such batches
    are what overflows), and fairseq's own curve never shows it: the loss-curve rows leave these
    intervals out, so both kinds of run are compared on the updates fairseq would log."""
    return gnorm is not None and not math.isfinite(gnorm)


def largest_jump(losses):
    """(jump, update): the largest excess of an interval's loss over the median of its
    ``NEIGHBOURS`` neighbours on each side (a loss spike stands out; a steady trend gives 0), over
    the intervals that have that many on both sides; (None, None) if none has."""
    ups = sorted(losses)
    best = (None, None)
    for i in range(NEIGHBOURS, len(ups) - NEIGHBOURS):
        u = ups[i]
        around = ups[i - NEIGHBOURS:i] + ups[i + 1:i + 1 + NEIGHBOURS]
        jump = losses[u] - statistics.median(losses[x] for x in around)
        if best[0] is None or jump > best[0]:
            best = (jump, u)
    return best


def loss_difference(base, other):
    """(mean, sample s.d., count) of ``other[u] - base[u]`` over the updates u both have
    ({num_updates: loss} each); (None, None, count) with fewer than 2."""
    common = sorted(set(base) & set(other))
    if len(common) < 2:
        return None, None, len(common)
    diffs = [other[u] - base[u] for u in common]
    return statistics.mean(diffs), statistics.stdev(diffs), len(common)


def curve_metrics(runs, curve_from=CURVE_FROM):
    """Adds to each run's metrics its largest loss jump (and where), and for runs after the first
    the mean and standard deviation of its interval losses minus the first run's, over the
    intervals both logged at the same update (from ``curve_from`` on): the loss curve within
    noise shows as a mean near 0 with a s.d. like that of two seeds of one model."""
    base, _ = _interval_losses(runs[0], curve_from)
    for i, run in enumerate(runs):
        losses, skipped = _interval_losses(run, curve_from)
        run.metrics["loss_skipped_intervals"] = skipped
        run.metrics["loss_jump"], run.metrics["loss_jump_update"] = largest_jump(losses)
        run.metrics["loss_diff_mean"] = run.metrics["loss_diff_sd"] = None
        run.metrics["loss_diff_intervals"] = None
        if i == 0:
            continue
        mean, sd, n = loss_difference(base, losses)
        if mean is None:
            run.missing.append("loss curve against {}: fewer than 2 intervals logged at the same "
                               "update from update {} on".format(runs[0].label, curve_from))
            continue
        run.metrics["loss_diff_mean"], run.metrics["loss_diff_sd"] = mean, sd
        run.metrics["loss_diff_intervals"] = n


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------

# (key, label, format, compare): compare = "ratio" for speed/time/memory, "delta" adds B-A
ROWS = [
    ("updates", "updates", "{:.0f}", None),
    ("epochs", "epochs", "{:.0f}", None),
    ("wps", "wps (target tokens/s)", "{:,.0f}", "ratio"),
    ("wps_wall", "wps, wall clock (target tokens/s)", "{:,.0f}", "ratio"),
    ("ups", "ups (updates/s)", "{:.2f}", "ratio"),
    ("epoch_wall_s", "wall-clock per epoch (s)", "{:,.1f}", "ratio"),
    ("epoch_train_wall_s", "train_wall per epoch (s)", "{:,.1f}", "ratio"),
    ("wall_clock_s", "total training wall-clock (s)", "{:,.0f}", "ratio"),
    ("peak_mem_gb", "peak GPU memory (GB)", "{:.1f}", "ratio"),
    ("min_gb_free", "min gb_free (GB)", "{:.1f}", "ratio"),
    ("train_loss", "final train loss", "{:.3f}", "delta"),
    ("train_nll_loss", "final train nll_loss", "{:.3f}", "delta"),
    ("valid_loss", "final valid loss", "{:.3f}", "delta"),
    ("valid_nll_loss", "final valid nll_loss", "{:.3f}", "delta"),
    ("best_valid_loss", "best valid loss", "{:.3f}", "delta"),
    ("loss_diff_mean", "interval loss − first run's, mean", "{:+.4f}", None),
    ("loss_diff_sd", "interval loss − first run's, s.d.", "{:.4f}", None),
    ("loss_diff_intervals", "intervals compared", "{:.0f}", None),
    ("loss_skipped_intervals", "intervals left out (an overflowing update logged)", "{:.0f}", None),
    ("loss_jump", "largest interval loss jump over its neighbours", "{:+.3f}", None),
    ("loss_jump_update", "… at update", "{:.0f}", None),
    ("bleu_sacrebleu", "BLEU sacreBLEU (detok)", "{:.2f}", "delta"),
    ("bleu_compound_split", "BLEU tok + compound split", "{:.2f}", "delta"),
    ("bleu_generate", "BLEU fairseq-generate (tok)", "{:.2f}", "delta"),
]


def _fmt(fmt, v):
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def markdown_table(runs):
    base = runs[0]
    header = ["metric"] + [r.label for r in runs] + ["{} / {}".format(r.label, base.label) for r in runs[1:]]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for key, label, fmt, how in ROWS:
        vals = [r.metrics.get(key) for r in runs]
        if all(v is None for v in vals):
            continue
        cells = [label] + [_fmt(fmt, v) for v in vals]
        for r in runs[1:]:
            a, b = base.metrics.get(key), r.metrics.get(key)
            if how is None or a is None or b is None or a == 0 or b == 0:
                cells.append("")
                continue
            cell = "{:.3f}x".format(b / a)
            if how == "delta":
                cell += " ({:+.3f})".format(b - a)
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_plots(runs, out_dir):
    """-> list of written PNG paths (empty if matplotlib is missing)."""
    # fairseq leaves the root logger at DEBUG: keep matplotlib's font-search chatter quiet
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    plotted = [r for r in runs if r.inner is not None and len(r.inner)]

    def segments(df):
        # one line per training session, so that a restart shows as a gap, not a jump
        for k, (_, d) in enumerate(df.sort_values("num_updates").groupby("session", sort=True)):
            yield k, d

    def loss_plot(xkey, xlabel, fname, xscale=1.0):
        fig, ax = plt.subplots(figsize=(8, 5))
        for i, r in enumerate(plotted):
            c = colors[i % len(colors)]
            lw = max(1.0, 3.0 - i)  # later runs drawn thinner, so identical curves stay visible
            if "loss" in r.inner and xkey in r.inner:
                for k, d in segments(r.inner):
                    ax.plot(d[xkey] / xscale, d["loss"], color=c, lw=lw, alpha=0.9,
                            label="{} train".format(r.label) if k == 0 else None)
            if r.valid is not None and len(r.valid) and "loss" in r.valid and xkey in r.valid:
                v = r.valid.sort_values("num_updates")
                ax.plot(v[xkey] / xscale, v["loss"], "o--", color=c, lw=lw, ms=3 + lw, alpha=0.9,
                        label="{} valid".format(r.label))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (label-smoothed, base 2)")
        ax.grid(alpha=0.3)
        ax.legend()
        p = os.path.join(out_dir, fname)
        fig.tight_layout()
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)

    if not plotted:
        return paths
    loss_plot("num_updates", "updates", "loss_vs_updates.png")
    span = max(float(r.inner.elapsed.max()) for r in plotted if "elapsed" in r.inner)
    scale, unit = (3600.0, "h") if span > 3 * 3600 else ((60.0, "min") if span > 180 else (1.0, "s"))
    sources = sorted({r.time_source for r in plotted})
    loss_plot("elapsed", "wall-clock ({}) [{}]".format(unit, "; ".join(sources)), "loss_vs_wallclock.png", scale)

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(plotted):
        if "wps" in r.inner:
            for k, d in segments(r.inner):
                ax.plot(d.elapsed / scale, d.wps, "-", marker=".", color=colors[i % len(colors)],
                        label=r.label if k == 0 else None)
    ax.set_xlabel("wall-clock ({})".format(unit))
    ax.set_ylabel("wps (target tokens / s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    p = os.path.join(out_dir, "wps_over_time.png")
    fig.tight_layout()
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    return paths


def compare(paths, labels=None, out_dir="compare_out", plots=True, curve_from=CURVE_FROM):
    """Load the runs; -> (runs, markdown report, plot paths)."""
    if labels is None:
        labels = []
        for p in paths:
            name = os.path.basename(os.path.normpath(p))
            if os.path.isfile(p) and name in LOG_CANDIDATES:  # RUN/train.log: the run's directory
                name = os.path.basename(os.path.dirname(os.path.abspath(p))) or name
            elif os.path.isfile(p) and name.endswith(".log"):
                name = name[: -len(".log")]
            labels.append(name)
        if len(set(labels)) < len(labels):
            labels = ["{}:{}".format(i + 1, n) for i, n in enumerate(labels)]
    runs = [load_run(p, lab) for p, lab in zip(paths, labels)]
    curve_metrics(runs, curve_from)
    report = ["## Runs", ""]
    for r in runs:
        arch = r.log.arch if r.log and r.log.arch else "?"
        dev = ""
        if r.log and r.log.gpu_name:
            dev = ", {} x {}".format(r.log.world_size or 1, r.log.gpu_name)
        report.append("- **{}**: {} (arch {}{})".format(r.label, r.path, arch, dev))
    report += ["", markdown_table(runs), ""]
    report.append("wps/ups: mean over the logged intervals, without the first interval of each epoch and "
                  "session (it includes validation, checkpointing or warm-up). wps, wall clock: the same intervals' "
                  "target tokens over the time between their log timestamps, next to fairseq's own figure because "
                  "that one leaves out the wait at each log for the GPU work still queued (~0.7 of an update per "
                  "log in a run without a per-update host sync): compare the wall-clock row when a run uses "
                  "--ls-deferred-overflow-check. Ratios: each run divided by {}; "
                  "(+x): difference.".format(runs[0].label))
    report.append("Loss-curve rows: the training intervals from update {} on; the differences are taken "
                  "at the updates both runs logged, the jump is an interval's loss minus the median of "
                  "the {} intervals around it; intervals with a non-finite gnorm (an update whose fp16 gradients "
                  "overflowed, which fairseq skips and does not log; --ls-deferred-overflow-check logs it) "
                  "are left out.".format(curve_from, 2 * NEIGHBOURS))
    report.append("")
    sources = {r.time_source for r in runs if r.time_source}
    if len(sources) > 1:
        report.append("Wall-clock is not measured the same way for all runs ({}): the wall-clock rows and "
                      "plot compare different things.".format(
                          "; ".join("{}: {}".format(r.label, r.time_source) for r in runs if r.time_source)))
        report.append("")
    missing = [(r, m) for r in runs for m in r.missing]
    report.append("## Not found")
    report.append("")
    if missing:
        report += ["- {}: {}".format(r.label, m) for r, m in missing]
    else:
        report.append("- nothing: every metric was found for every run")
    notes = [(r, n) for r in runs for n in r.notes]
    if notes:
        report += ["", "## Notes", ""] + ["- {}: {}".format(r.label, n) for r, n in notes]
    plot_paths = write_plots(runs, out_dir) if plots else []
    return runs, "\n".join(report), plot_paths


def summary_dict(runs):
    return OrderedDict(
        (r.label, OrderedDict([("path", r.path), ("metrics", r.metrics), ("missing", r.missing), ("notes", r.notes)]))
        for r in runs
    )


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="ls-fairseq-compare",
        description="Compare fairseq training runs (throughput, memory, loss, BLEU) from their logs.",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="run directory (with train.log and eval/) or a fairseq-train log file; "
                             "the first one is the reference for the ratios")
    parser.add_argument("--labels", help="comma-separated names for the runs (default: directory names)")
    parser.add_argument("--out-dir", default="compare_out", help="where the PNG plots go (default: %(default)s)")
    parser.add_argument("--no-plots", action="store_true", help="only print the table")
    parser.add_argument("--json", metavar="FILE", help="also write the metrics as JSON")
    parser.add_argument("--curve-from", type=int, default=CURVE_FROM, metavar="N",
                        help="the loss-curve rows use the training intervals from update N on "
                             "(default: %(default)s, past the warm-up's steep descent)")
    args = parser.parse_args(argv)
    if args.curve_from < 0:
        parser.error("--curve-from must be >= 0, got {}".format(args.curve_from))
    # importing the ls_fairseq package imports fairseq, which leaves the root logger at DEBUG:
    # keep matplotlib's font-search chatter out of the report
    logging.getLogger().setLevel(logging.WARNING)
    try:
        import pandas  # noqa: F401
    except ImportError:
        print("ls-fairseq-compare needs pandas (and matplotlib for the plots): "
              "pip install 'ls-fairseq[compare]'  (or: pip install pandas matplotlib)", file=sys.stderr)
        return 2
    labels = args.labels.split(",") if args.labels else None
    if labels is not None and len(labels) != len(args.runs):
        parser.error("--labels has {} names for {} runs".format(len(labels), len(args.runs)))
    runs, report, plot_paths = compare(args.runs, labels, args.out_dir, plots=not args.no_plots,
                                       curve_from=args.curve_from)
    print(report)
    if not args.no_plots:
        print("")
        if plot_paths:
            print("## Plots")
            print("")
            for p in plot_paths:
                print("- " + p)
        else:
            print("no plots written: " + ("matplotlib is not installed (pip install matplotlib)"
                                          if _no_matplotlib() else "no run has per-interval training records"))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary_dict(runs), f, indent=2)
    # a run without any training record is most likely a wrong path: say so through the exit code
    return 1 if any(r.inner is None and r.epochs is None for r in runs) else 0


def _no_matplotlib():
    try:
        import matplotlib  # noqa: F401

        return False
    except ImportError:
        return True


if __name__ == "__main__":
    sys.exit(main())
