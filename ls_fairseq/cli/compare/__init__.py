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
what it could not find, and writes PNG plots (with matplotlib: loss vs updates, loss vs
wall-clock, wps per interval over time beside wps per epoch). The table needs only the standard
library, and nothing here imports torch or fairseq.
Throughput is given as fairseq prints it, per epoch from its end-of-epoch lines: epoch 1 (cold),
the median over the later complete epochs ("steady"), the last complete epoch, and wall-clock per
epoch (also model TFLOP/s and MFU when the log has ``tflops``/``mfu``). Extra rows, labelled as
such, give the mean over the logged intervals and the same intervals timed by the log timestamps,
the one to compare for ``--ls-deferred-overflow-check`` runs (whose interval wps leaves out the
wait for the GPU work queued at each log, and so reads high).
The loss-curve rows say whether a run's training loss follows the first run's: the mean and
standard deviation of the differences of their interval losses logged at the same updates, and
each run's largest loss spike over its neighbouring intervals (``--curve-from`` skips the
warm-up). Intervals with a non-finite gnorm hold an update that overflowed in fp16, which fairseq
itself never logs (only ``--ls-deferred-overflow-check`` runs log them): they are left out and
counted.
"""
# modules: parse (log files -> records), metrics (records -> per-epoch / interval / memory / loss
# figures), curve (loss curve against the first run), report (table, JSON), plots (matplotlib,
# imported only when drawing), command (compare(), main()).
from .command import compare, default_labels, main  # noqa: E402,F401
from .curve import (  # noqa: E402,F401
    CURVE_FROM, NEIGHBOURS, curve_metrics, holds_skipped_update, largest_jump, loss_curve, loss_difference)
from .metrics import (  # noqa: E402,F401
    Run, column, epoch_rows, load_run, steady_intervals, timed_tokens, wall_clock_wps, WALL_MIN_S)
from .parse import (  # noqa: E402,F401
    LOG_CANDIDATES, ParsedLog, Session, add_elapsed, find_bleu, find_log, merge_sessions, parse_log)
from .plots import write_plots  # noqa: E402,F401
from .report import ROWS, markdown_table, summary_dict  # noqa: E402,F401
