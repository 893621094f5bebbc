"""The loss curve of each run against the first run's (stdlib only; bench/e2e.py uses these too)."""
import math
import statistics

CURVE_FROM = 300  # --curve-from: the loss-curve rows skip the warm-up's steep descent
NEIGHBOURS = 5  # a jump is measured against the median of this many intervals on each side


def _interval_losses(run, curve_from):
    """{num_updates: loss} of the logged training intervals from update ``curve_from`` on, and
    how many were left out because they hold a skipped update (:func:`holds_skipped_update`)."""
    d = [r for r in run.inner or () if r.get("num_updates") is not None and r.get("loss") is not None
         and not math.isnan(r["loss"])]
    return loss_curve(((int(r["num_updates"]), float(r["loss"]), holds_skipped_update(r.get("gnorm")))
                       for r in d), curve_from)


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
