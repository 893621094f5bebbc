"""Reading fairseq-train logs and run directories (stdlib only).

:func:`parse_log` turns one log (any mix of sessions, simple or json format, stdout capture or
``--log-file``) into a :class:`ParsedLog` of records: dicts with ``kind`` (``inner`` for
``train_inner`` intervals, ``epoch`` for the end-of-epoch ``train`` line, ``valid``), the
stats as floats, ``session`` and ``ts`` (log timestamp in seconds, or None).
:func:`merge_sessions` drops what a restarted session redid; :func:`add_elapsed` puts a
wall-clock on every record; :func:`find_log` and :func:`find_bleu` locate the files of a run.
"""
import datetime
import glob
import json
import os
import re
from collections import OrderedDict

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
# the files of a run, and the sessions of a log
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


def add_elapsed(log, kept):
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
