"""``ls-fairseq-compare``: load the runs, print the report, write the plots."""
import argparse
import json
import logging
import os

from . import plots
from .curve import CURVE_FROM, curve_metrics
from .metrics import load_run
from .parse import LOG_CANDIDATES
from .report import epoch_table, explanation, markdown_table, summary_dict


def default_labels(paths):
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
    return labels


def compare(paths, labels=None, out_dir="compare_out", plots=True, curve_from=CURVE_FROM,
            omit=(), speed_note=None):
    """Load the runs; -> (runs, markdown report, plot paths: empty without matplotlib).

    ``omit``: prefixes of row keys left out of the table (the quickstart on the CPU leaves out
    ``tflops``/``mfu``, which measure a GPU). ``speed_note``: shown instead of the ratios of the
    throughput and wall-clock rows (the quickstart on the CPU: not a speed test, and why)."""
    runs = [load_run(p, lab) for p, lab in zip(paths, labels or default_labels(paths))]
    curve_metrics(runs, curve_from)
    report = ["## Runs", ""]
    for r in runs:
        arch = r.log.arch if r.log and r.log.arch else "?"
        dev = ""
        if r.log and r.log.gpu_name:
            dev = ", {} x {}".format(r.log.world_size or 1, r.log.gpu_name)
        report.append("- **{}**: {} (arch {}{})".format(r.label, r.path, arch, dev))
    report += ["", markdown_table(runs, omit=omit, speed_note=speed_note), ""]
    epochs = epoch_table(runs, speed_note=speed_note)
    if epochs:
        report += ["## Every epoch: fairseq's end-of-epoch `train` lines", "", epochs, ""]
    for paragraph in explanation(runs, curve_from):
        report += [paragraph, ""]
    sources = {r.time_source for r in runs if r.time_source}
    if len(sources) > 1:
        report.append("Wall-clock is not measured the same way for all runs ({}): the total wall-clock row and "
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
    plot_paths = _plots.write_plots(runs, out_dir) if plots else []
    return runs, "\n".join(report), plot_paths


_plots = plots  # compare()'s argument 'plots' shadows the module inside it


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
    for path in args.runs:  # a wrong path: the error alone, before anything is read or written
        if not os.path.exists(path):
            parser.exit(2, "{}: error: run {} does not exist\n".format(parser.prog, path))
    if args.curve_from < 0:
        parser.error("--curve-from must be >= 0, got {}".format(args.curve_from))
    labels = args.labels.split(",") if args.labels else None
    if labels is not None and len(labels) != len(args.runs):
        parser.error("--labels has {} names for {} runs".format(len(labels), len(args.runs)))
    # importing the ls_fairseq package imports fairseq (when installed), which leaves the root
    # logger at DEBUG: keep matplotlib's font-search chatter out of the report
    logging.getLogger().setLevel(logging.WARNING)
    draw = not args.no_plots and plots.available()
    runs, report, plot_paths = compare(args.runs, labels, args.out_dir, plots=draw, curve_from=args.curve_from)
    print(report)
    if not args.no_plots:
        print("")
        if not draw:
            # the table is the core of the tool and needs only the standard library
            print("plots skipped: matplotlib is not installed ({})".format(plots.INSTALL_HINT))
        elif plot_paths:
            print("## Plots")
            print("")
            for p in plot_paths:
                print("- " + p)
        else:
            print("no plots written: no run has per-interval training records")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary_dict(runs), f, indent=2)
    # a run without any training record is most likely a wrong path: say so through the exit code
    return 1 if any(not r.inner and not r.epochs for r in runs) else 0
