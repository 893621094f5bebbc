"""fairseq-train logs, read as ``ls-fairseq-compare`` reads them, and the probes' lines.

``parse`` hands a log's text to ``ls_fairseq.cli.compare``'s parser (``parse_log``: simple or
json format, fairseq's timestamped lines or a bare capture) and returns its records by kind:
``inner`` (the ``train_inner`` intervals), ``epochs`` (the end-of-epoch ``train`` lines, by
epoch, their ``train_`` prefix dropped) and ``valid``, every stat a float. Lines that processes
spawned by fairseq print in Python's default logging format (``INFO:train_inner:{...}``) are
read as their message.

The probes' lines (benchlib/probes): ``memory`` (``BENCH_MEMORY``), ``interval_ends`` and
``epoch_ends`` (``BENCH_INTERVAL_END`` / ``BENCH_EPOCH_END``). Stdlib only; the compare parser
is imported when a log is parsed.
"""
import os
import re
import tempfile

GIB = 2 ** 30
_DEFAULT_FORMAT = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):[\w.]+:", re.M)


class Run:
    """The records of one fairseq-train log (see the module docstring)."""

    def __init__(self, parsed):
        self.parsed = parsed  # ls_fairseq.cli.compare.parse.ParsedLog
        self.records = parsed.records
        self.inner = [r for r in self.records if r["kind"] == "inner"]
        self.epochs = {int(r["epoch"]): r for r in self.records if r["kind"] == "epoch"}
        self.valid = [r for r in self.records if r["kind"] == "valid"]


def parse(text):
    """A :class:`Run` of the log ``text``."""
    from ls_fairseq.cli.compare.parse import parse_log

    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False, encoding="utf-8") as f:
        f.write(_DEFAULT_FORMAT.sub("", text))
    try:
        return Run(parse_log(f.name))
    finally:
        os.unlink(f.name)


def losses(run):
    """(update, loss) of each logged interval."""
    return [(int(r["num_updates"]), r["loss"]) for r in run.inner if r.get("loss") is not None]


def loss_scales(run):
    """(update, fp16 loss scale) of each logged interval that has one."""
    return [(int(r["num_updates"]), r["loss_scale"]) for r in run.inner
            if r.get("loss_scale") is not None]


def time_weighted_wps(records):
    """Tokens/s over logged intervals, each weighted by its time: sum(tokens) / sum(tokens /
    wps)."""
    return sum(r["wpb"] for r in records) / sum(r["wpb"] / r["wps"] for r in records)


# ---- the probes' lines ------------------------------------------------------------------------

MEMORY = re.compile(r"^BENCH_MEMORY rank=(\d+) total=(\d+) reserved_max=(\d+) used_max=(\d+)\s*$",
                    re.M)
# a stamp starts a line, or follows another stamp on it (two ranks' output may share a line)
_STAMP = r"(?:^|(?<=\d))BENCH_{kind}_END rank=(\d+) ([0-9.e+-]+)(?=BENCH_|\s|$)"
INTERVAL_END = re.compile(_STAMP.format(kind="INTERVAL"), re.M)
EPOCH_END = re.compile(_STAMP.format(kind="EPOCH"), re.M)


def memory(text):
    """Each rank's memory line (the last one per rank): total, peak reserved and peak device
    memory used, bytes, in rank order."""
    found = {int(r): (int(t), int(res), int(used)) for r, t, res, used in MEMORY.findall(text)}
    return [{"rank": r, "total_bytes": t, "reserved_max_bytes": res, "used_max_bytes": used}
            for r, (t, res, used) in sorted(found.items())]


def _lowest_rank(stamps):
    stamps = [(int(r), float(t)) for r, t in stamps]
    first = min((r for r, _ in stamps), default=None)
    return [t for r, t in stamps if r == first]


def interval_ends(text):
    """The host clock (s) at the end of each logged interval of the lowest rank that stamped
    (rank 0 logs fairseq's stats), in order."""
    return _lowest_rank(INTERVAL_END.findall(text))


def epoch_ends(text):
    """The host clock (s) at each end of epoch of the lowest rank that stamped, in order."""
    return _lowest_rank(EPOCH_END.findall(text))


def peak_allocated_gb(run, total_bytes):
    """fairseq's peak allocated memory over the run, GiB: it logs ``gb_free`` = total - the peak
    since its last reset of the counter, so the run's peak is total - min(gb_free). None without
    the total or a gb_free."""
    free = [r["gb_free"] for r in run.inner if r.get("gb_free") is not None]
    return (total_bytes - min(free) * GIB) / GIB if total_bytes and free else None
