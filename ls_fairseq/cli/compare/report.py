"""The comparison table (markdown), the text around it and the JSON summary (stdlib only)."""
import math
from collections import OrderedDict

from .curve import NEIGHBOURS


class Section:
    """A heading row of the table, shown when one of the rows under it is."""

    def __init__(self, title):
        self.title = title


# (key, label, format, compare): compare = "ratio" for speed/time/memory, "delta" adds B-A
ROWS = [
    ("updates", "updates", "{:.0f}", None),
    ("epochs", "epochs (last one logged)", "{:.0f}", None),
    ("epochs_complete", "complete epochs (end-of-epoch line logged, not cut short)", "{:.0f}", None),
    ("last_complete_epoch", "last complete epoch", "{:.0f}", None),
    ("steady_epochs", "steady epochs (complete, after the first)", "{}", None),
    Section("throughput per epoch: fairseq's end-of-epoch `train` lines"),
    ("wps_epoch1", "wps, epoch 1 (cold)", "{:,.0f}", "ratio"),
    ("wps_steady", "wps, steady (median over the steady epochs)", "{:,.0f}", "ratio"),
    ("wps_last", "wps, last complete epoch", "{:,.0f}", "ratio"),
    ("ups_epoch1", "ups, epoch 1 (cold)", "{:.2f}", "ratio"),
    ("ups_steady", "ups, steady (median)", "{:.2f}", "ratio"),
    ("ups_last", "ups, last complete epoch", "{:.2f}", "ratio"),
    ("tflops_epoch1", "model TFLOP/s (tflops), epoch 1 (cold)", "{:.1f}", "ratio"),
    ("tflops_steady", "model TFLOP/s (tflops), steady (median)", "{:.1f}", "ratio"),
    ("mfu_epoch1", "MFU % (mfu), epoch 1 (cold)", "{:.1f}", "ratio"),
    ("mfu_steady", "MFU % (mfu), steady (median)", "{:.1f}", "ratio"),
    ("epoch1_wall_s", "wall-clock, epoch 1 (s)", "{:,.1f}", "ratio"),
    ("epoch_wall_s", "wall-clock per epoch, steady (median, s)", "{:,.1f}", "ratio"),
    ("epoch_wall_source", "… wall-clock per epoch taken from", "{}", None),
    ("epoch_train_wall_s", "train_wall per epoch, steady (median, s)", "{:,.1f}", "ratio"),
    ("wall_clock_s", "total training wall-clock (s)", "{:,.0f}", "ratio"),
    Section("throughput per logged interval (`train_inner` lines; not fairseq's epoch figures)"),
    ("wps_interval", "wps (interval mean, all epochs)", "{:,.0f}", "ratio"),
    ("wps_wall", "wps (interval tokens / log-timestamp time, all epochs)", "{:,.0f}", "ratio"),
    ("ups_interval", "ups (interval mean, all epochs)", "{:.2f}", "ratio"),
    Section("memory"),
    ("peak_mem_gb", "peak GPU memory (GB)", "{:.1f}", "ratio"),
    ("min_gb_free", "min gb_free (GB)", "{:.1f}", "ratio"),
    Section("loss"),
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
    Section("BLEU"),
    ("bleu_sacrebleu", "BLEU sacreBLEU (detok)", "{:.2f}", "delta"),
    ("bleu_compound_split", "BLEU tok + compound split", "{:.2f}", "delta"),
    ("bleu_generate", "BLEU fairseq-generate (tok)", "{:.2f}", "delta"),
]

ABSENT = "—"


def _missing(v):
    return v is None or (isinstance(v, float) and math.isnan(v))


def _fmt(fmt, v):
    return ABSENT if _missing(v) else fmt.format(v)


def _cell(run, key, fmt):
    v = run.metrics.get(key)
    if _missing(v) and key in run.absent:
        return "{}, {}".format(ABSENT, run.absent[key])  # says why this row has no counterpart
    if not _missing(v) and key in run.qualifiers:
        return "{} ({})".format(_fmt(fmt, v), run.qualifiers[key])  # e.g. an epoch cut short
    return _fmt(fmt, v)


#: the rows whose ratios compare speed (throughput, time): what a CPU quickstart does not measure
SPEED_KEYS = ("wps_", "ups_", "tflops_", "mfu_", "epoch1_wall_s", "epoch_wall_s", "epoch_train_wall_s",
              "wall_clock_s")


def markdown_table(runs, omit=(), speed_note=None):
    """The comparison table. ``omit``: prefixes of row keys to leave out; ``speed_note``: shown in
    the ratio cells of the speed rows instead of the ratios."""
    base = runs[0]
    header = ["metric"] + [r.label for r in runs] + ["{} / {}".format(r.label, base.label) for r in runs[1:]]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    section = None
    for row in ROWS:
        if isinstance(row, Section):
            section = row
            continue
        key, label, fmt, how = row
        vals = [r.metrics.get(key) for r in runs]
        if all(_missing(v) for v in vals) or key.startswith(tuple(omit)):
            continue
        if speed_note is not None and how == "ratio" and key.startswith(SPEED_KEYS):
            how = speed_note
        if section is not None:
            lines.append("| **{}** |".format(section.title) + " |" * (len(header) - 1))
            section = None
        cells = [label] + [_cell(r, key, fmt) for r in runs]
        for r in runs[1:]:
            a, b = base.metrics.get(key), r.metrics.get(key)
            if how is None:
                cells.append("")
            elif how not in ("ratio", "delta"):  # a note instead of the ratio
                cells.append(how)
            elif _missing(a) or _missing(b):
                cells.append(ABSENT)  # no counterpart: the run's own cell says why
            elif a == 0 or b == 0:
                cells.append("")
            else:
                cell = "{:.3f}x".format(b / a)
                if how == "delta":
                    cell += " ({:+.3f})".format(b - a)
                cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _epoch_label(row):
    """What sets an epoch's figures apart: cold, cut short, split by a restart."""
    labels = []
    if not row["complete"]:
        labels.append("cut short: {:.0f} of {:.0f} updates".format(row["updates"], row["full_updates"])
                      if row.get("full_updates") else "cut short: {:.0f} updates".format(row["updates"]))
    if row["split"]:
        labels.append("split by a restart")
    elif row["cold"]:
        labels.append("cold")
    return ", ".join(labels)


def _epoch_cell(row):
    figures = "{} ({})".format(_fmt("{:,.0f}", row["wps"]), _fmt("{:.2f}", row["ups"]))
    label = _epoch_label(row)
    return figures + (", " + label if label else "")


def _epoch_wps(run, epoch):
    """The wps of ``epoch`` for the ratio column: its complete line if there is one, else its last."""
    rows = [r for r in run.epoch_rows if r["epoch"] == epoch and r["wps"] is not None]
    complete = [r for r in rows if r["complete"]]
    return (complete or rows)[-1]["wps"] if rows else None


def epoch_table(runs, speed_note=None):
    """Every end-of-epoch ``train`` line fairseq printed, one row per epoch: each run's wps
    (ups), labelled where the epoch is cold, cut short (--max-update, --stop-time-hours) or split
    by a restart; the ratio of its wps to the first run's for the same epoch. Empty when no run
    has such a line."""
    epochs = sorted({r["epoch"] for run in runs for r in run.epoch_rows if r["epoch"] is not None})
    if not epochs:
        return ""
    base = runs[0]
    header = ["epoch"] + ["{}: wps (ups)".format(r.label) for r in runs] + [
        "{} / {} (wps)".format(r.label, base.label) for r in runs[1:]]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---:"] * len(header)) + "|"]
    for epoch in epochs:
        cells = [str(epoch)]
        for run in runs:
            rows = [r for r in run.epoch_rows if r["epoch"] == epoch]
            cells.append("; ".join(_epoch_cell(r) for r in rows) if rows else ABSENT)
        for run in runs[1:]:
            a, b = _epoch_wps(base, epoch), _epoch_wps(run, epoch)
            if speed_note is not None:
                cells.append(speed_note)
            else:
                cells.append("{:.3f}x".format(b / a) if a and b else ABSENT)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def explanation(runs, curve_from):
    """The paragraphs under the table: what the rows measure."""
    return [
        "Per-epoch rows: fairseq's own figures from its end-of-epoch `train` lines (the `wps`, `ups` it "
        "prints for the whole epoch, validation and checkpointing at its end included). An epoch is complete "
        "when its end line was logged and it was not cut short by --max-update/--stop-time; epoch 1 is cold "
        "(start-up, warm-up), as is the first epoch of a restarted session; steady = the median over the other "
        "complete epochs; runs are compared epoch 1 with epoch 1, steady with steady (an epoch 1 cut short is "
        "shown, labelled so). The table of every epoch gives each end-of-epoch line fairseq printed, cut-short "
        "and cold epochs included and labelled; a cut-short epoch is left out of steady only. Wall-clock per epoch: the "
        "difference of consecutive end lines' `wall` field (fairseq's clock), or of their log timestamps where "
        "that field does not move; epoch 1 counts from the trainer's start.",
        "Interval rows: mean over the logged `train_inner` intervals of all epochs, without the first interval of "
        "each epoch and session (it includes validation, checkpointing or warm-up). The log-timestamp row: the "
        "same intervals' target tokens over the time between their log lines, which, unlike fairseq's interval "
        "wps, includes the wait at each log for the GPU work still queued (~0.7 of an update per log without a "
        "per-update host sync): compare the log-timestamp row when a run uses --ls-deferred-overflow-check. "
        "Ratios: each run divided by {}; (+x): difference; {}: the run has no such figure.".format(
            runs[0].label, ABSENT),
        "Loss-curve rows: the training intervals from update {} on; the differences are taken "
        "at the updates both runs logged, the jump is an interval's loss minus the median of "
        "the {} intervals around it; intervals with a non-finite gnorm (an update whose fp16 gradients "
        "overflowed, which fairseq skips and does not log; --ls-deferred-overflow-check logs it) "
        "are left out.".format(curve_from, 2 * NEIGHBOURS),
    ]


def summary_dict(runs):
    return OrderedDict(
        (r.label, OrderedDict([("path", r.path), ("metrics", r.metrics), ("epochs", r.epoch_rows),
                               ("absent", r.absent), ("qualifiers", r.qualifiers), ("missing", r.missing),
                               ("notes", r.notes)]))
        for r in runs
    )
