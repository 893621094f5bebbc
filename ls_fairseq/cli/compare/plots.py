"""PNG plots of the compared runs. matplotlib is optional (``pip install "ls-fairseq[compare]"``):
it is imported only when plots are drawn, so the table needs nothing beyond the standard library."""
import logging
import os

INSTALL_HINT = 'pip install "ls-fairseq[compare]" or pip install matplotlib'


def _pyplot():
    """matplotlib.pyplot with the Agg backend, or None when matplotlib is not installed."""
    # fairseq leaves the root logger at DEBUG: keep matplotlib's font-search chatter quiet
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def available():
    return _pyplot() is not None


def _segments(records):
    """The records of each training session in update order: one line per session, so that a
    restart shows as a gap, not a jump."""
    by_session = {}
    for r in records:
        by_session.setdefault(r["session"], []).append(r)
    for k, s in enumerate(sorted(by_session)):
        yield k, sorted(by_session[s], key=lambda r: r["num_updates"])


def _xy(records, xkey, ykey, xscale=1.0):
    pts = [(r[xkey] / xscale, r[ykey]) for r in records if r.get(xkey) is not None and r.get(ykey) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def write_plots(runs, out_dir):
    """-> list of written PNG paths (empty if matplotlib is missing)."""
    plt = _pyplot()
    if plt is None:
        return []
    paths = []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    plotted = [r for r in runs if r.inner]
    if not plotted:
        return paths
    os.makedirs(out_dir, exist_ok=True)

    def save(fig, fname):
        p = os.path.join(out_dir, fname)
        fig.tight_layout()
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)

    def loss_plot(xkey, xlabel, fname, xscale=1.0):
        fig, ax = plt.subplots(figsize=(8, 5))
        for i, r in enumerate(plotted):
            c = colors[i % len(colors)]
            lw = max(1.0, 3.0 - i)  # later runs drawn thinner, so identical curves stay visible
            for k, d in _segments(r.inner):
                x, y = _xy(d, xkey, "loss", xscale)
                if x:
                    ax.plot(x, y, color=c, lw=lw, alpha=0.9, label="{} train".format(r.label) if k == 0 else None)
            x, y = _xy(sorted(r.valid or [], key=lambda v: v["num_updates"]), xkey, "loss", xscale)
            if x:
                ax.plot(x, y, "o--", color=c, lw=lw, ms=3 + lw, alpha=0.9, label="{} valid".format(r.label))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (label-smoothed, base 2)")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, fname)

    loss_plot("num_updates", "updates", "loss_vs_updates.png")
    span = max([r["elapsed"] for run in plotted for r in run.inner if r.get("elapsed") is not None] or [0.0])
    scale, unit = (3600.0, "h") if span > 3 * 3600 else ((60.0, "min") if span > 180 else (1.0, "s"))
    sources = sorted({r.time_source for r in plotted if r.time_source})
    loss_plot("elapsed", "wall-clock ({}) [{}]".format(unit, "; ".join(sources)), "loss_vs_wallclock.png", scale)

    # wps: fairseq's interval figure over time (left) beside its end-of-epoch figure per epoch (right)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    for i, r in enumerate(plotted):
        for k, d in _segments(r.inner):
            x, y = _xy(d, "elapsed", "wps", scale)
            if x:
                ax.plot(x, y, "-", marker=".", color=colors[i % len(colors)], label=r.label if k == 0 else None)
    ax.set_xlabel("wall-clock ({})".format(unit))
    ax.set_ylabel("wps (target tokens / s)")
    ax.set_title("per logged interval (train_inner)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    with_epochs = [(i, r) for i, r in enumerate(runs) if any(e["wps"] is not None for e in r.epoch_rows)]
    width = 0.8 / max(1, len(with_epochs))
    for j, (i, r) in enumerate(with_epochs):
        rows = [e for e in r.epoch_rows if e["wps"] is not None and e["epoch"] is not None]
        xs = [e["epoch"] - 0.4 + width * (j + 0.5) for e in rows]
        bars = bx.bar(xs, [e["wps"] for e in rows], width=width, color=colors[i % len(colors)], label=r.label)
        for bar, e in zip(bars, rows):
            if not e["complete"]:
                bar.set_hatch("//")  # cut short: not comparable
                bar.set_alpha(0.4)
    if with_epochs:
        epochs = sorted({e["epoch"] for _, r in with_epochs for e in r.epoch_rows if e["epoch"] is not None})
        bx.set_xticks(epochs)
        bx.legend()
    bx.set_xlabel("epoch (hatched: cut short, not complete)")
    bx.set_ylabel("wps (target tokens / s)")
    bx.set_title("per epoch (fairseq's end-of-epoch line)")
    bx.set_ylim(bottom=0)
    bx.grid(alpha=0.3, axis="y")
    save(fig, "wps_over_time.png")
    return paths
