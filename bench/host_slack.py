#!/usr/bin/env python3
"""Is the steady-state update waiting for the host or for the GPU? (H100 figures in
docs/PERFORMANCE.md.)

Runs real fairseq-train (``bench/e2e.py``'s corpus, command and wrapper) and times, without a
profiler, every update of the run's second half (its last epoch, at the default two) on the host
clock:

* period: from one ``Trainer.train_step`` call to the next (the update's wall time);
* train_step: inside ``Trainer.train_step`` (with no host synchronisation in the update, this is
  the host's own work plus whatever it waits for inside: a read of a value the GPU has not
  produced yet, a full launch queue);
* data wait: in fairseq's ``BufferedIterator.__next__`` (the data loader not keeping up);
* log reads: in fairseq's ``safe_round`` (its log-interval reads of CUDA meters, each waiting for
  all the GPU work queued);
* other: the rest of the training loop.

Each ``--sleep-ms`` value adds that much host time to every update (a ``time.sleep`` after
``train_step``). If the period does not grow, the host had at least that much slack per update:
the update is GPU-bound, and shortening the host's work would not speed it up.

    python bench/host_slack.py --max-tokens 8192 --sleep-ms 0 4
    python bench/host_slack.py --gpus 4 --variant ls --sentences 200000 --sleep-ms 0 2

On several GPUs (``--gpus``) the probe runs in every rank and each rank's row is printed.
"""
import argparse
import ast
import os
import re
import subprocess
import sys

import e2e  # noqa: E402
import multi_gpu  # noqa: E402

# Prepended to e2e.WRAPPER (which then runs fairseq-train in the same interpreter).
PROBE = r"""
import os, time, atexit
from fairseq import trainer as _trainer
from fairseq.data import iterators as _iterators
from fairseq.logging import meters as _meters
_sleep = float(os.environ["HOST_SLACK_SLEEP_MS"]) / 1e3
_records, _waits = [], {"data": 0.0, "log": 0.0}
def _timed(fn, bucket):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _waits[bucket] += time.perf_counter() - t
    return wrapper
_iterators.BufferedIterator.__next__ = _timed(_iterators.BufferedIterator.__next__, "data")
_meters.safe_round = _timed(_meters.safe_round, "log")
_train_step = _trainer.Trainer.train_step
_rank = []
def _probed_train_step(self, *a, **k):
    if not _rank:
        import torch.distributed as _dist
        _rank.append(_dist.get_rank() if _dist.is_available() and _dist.is_initialized() else 0)
    start = time.perf_counter()
    out = _train_step(self, *a, **k)
    if _sleep:
        time.sleep(_sleep)
    _records.append((start, time.perf_counter(), _waits["data"], _waits["log"]))
    _waits["data"] = _waits["log"] = 0.0
    return out
_trainer.Trainer.train_step = _probed_train_step
atexit.register(lambda: _rank and print(f"HOST_SLACK_RECORDS rank={_rank[0]}", repr(_records),
                                        flush=True))
"""


def summarize(records, skip_fraction=0.5):
    """Mean ms per update of (period, train_step, data wait, log reads, other) over the updates
    after the first ``skip_fraction`` of ``records`` ((start, end, data wait, log reads) per
    ``train_step``, host seconds; the waits are those between the previous update and this one),
    leaving out the last update (no next start to time its period to). None if fewer than 10."""
    r = records[int(len(records) * skip_fraction):]
    if len(r) < 11:
        return None
    n = len(r) - 1
    period = sum(r[i + 1][0] - r[i][0] for i in range(n)) / n
    step = sum(r[i][1] - r[i][0] for i in range(n)) / n
    data = sum(r[i + 1][2] for i in range(n)) / n
    log = sum(r[i + 1][3] for i in range(n)) / n
    return {"updates": n, "period": 1e3 * period, "train_step": 1e3 * step,
            "data_wait": 1e3 * data, "log_reads": 1e3 * log,
            "other": 1e3 * (period - step - data - log)}


RECORDS = re.compile(r"^HOST_SLACK_RECORDS rank=(\d+) (.*)$", re.M)


def parse_all_records(text):
    """Each rank's records (the last printed per rank), by rank."""
    return {int(rank): ast.literal_eval(records) for rank, records in RECORDS.findall(text)}


def parse_records(text):
    """The lowest rank's records (the only rank on one GPU); [] if none."""
    found = parse_all_records(text)
    return found[min(found)] if found else []


def markdown(rows):
    lines = ["| sleep ms | updates | period ms | train_step ms | data wait | log reads | other | "
             "steady wps (intervals) |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for sleep, s, wps in rows:
        label = sleep if isinstance(sleep, str) else f"{sleep:g}"  # str: "4 (rank 1)"
        if s is None:
            lines.append(f"| {label} | – | – | – | – | – | – | – |")
            continue
        lines.append(f"| {label} | {s['updates']} | {s['period']:.2f} | {s['train_step']:.2f} | "
                     f"{s['data_wait']:.2f} | {s['log_reads']:.2f} | {s['other']:.2f} | "
                     f"{e2e.fmt(wps, ',.0f')} |")
    return "\n".join(lines)


def run_one_gpu(args, data, sleep):
    cmd = e2e.train_cmd(data, args.variant, args.max_tokens, args.epochs, 1, args.extra,
                        wrapper=PROBE + e2e.WRAPPER)
    env = dict(e2e.train_env(args.variant), HOST_SLACK_SLEEP_MS=str(sleep))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        print(log[-3000:], file=sys.stderr)
    return log


def run_gpus(args, data, sleep):
    """fairseq's distributed training on ``--gpus`` GPUs (bench/multi_gpu.py's runner): the probe
    runs in every rank (its sitecustomize execs PROBE when HOST_SLACK_SLEEP_MS is set)."""
    save_dir = f"/tmp/host_slack_{args.variant}_{args.gpus}"
    os.makedirs(save_dir, exist_ok=True)
    try:
        return multi_gpu.train(data, args.variant, args.max_tokens, args.gpus, 1, 0, save_dir,
                               ["--no-save"] + list(args.extra), args.ddp_backend,
                               env_extra={"HOST_SLACK_SLEEP_MS": str(sleep)},
                               epochs=args.epochs)
    except RuntimeError as e:
        print(str(e), file=sys.stderr)
        return str(e)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="ls_deferred", choices=sorted(e2e.VARIANTS))
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--sleep-ms", type=float, nargs="+", default=[0.0, 4.0])
    ap.add_argument("--gpus", type=int, default=1,
                    help="fairseq's distributed training on this many GPUs (each rank timed)")
    ap.add_argument("--ddp-backend", default="pytorch_ddp", help="with --gpus > 1")
    ap.add_argument("--workdir", default=None,
                    help="corpus directory (default /tmp/ls_bench_e2e, or ..._<sentences> for "
                         "another --sentences, as bench/multi_gpu.py)")
    ap.add_argument("--sentences", type=int, default=40000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--json", help="write every row (each rank's on several GPUs) here")
    ap.add_argument("extra", nargs="*", help="extra fairseq-train flags (after --)")
    args = ap.parse_args()
    if args.gpus < 1:
        ap.error(f"--gpus {args.gpus}: at least 1")
    if any(s < 0 for s in args.sleep_ms):
        ap.error("--sleep-ms: a time to add is >= 0")
    data = multi_gpu.corpus(args.sentences, args.workers, args.workdir)
    rows, table = [], []
    for sleep in args.sleep_ms:
        log = (run_gpus if args.gpus > 1 else run_one_gpu)(args, data, sleep)
        inner, _, _, _ = e2e.parse_log(log)
        wps = e2e.interval_wps(inner, args.epochs, e2e.interval_ends(log))
        found = parse_all_records(log) or {0: []}
        for rank, records in sorted(found.items()):
            s = summarize(records)
            label = f"{sleep:g}" if args.gpus == 1 else f"{sleep:g} (rank {rank})"
            table.append((label, s, wps))
            rows.append({"sleep_ms": sleep, "rank": rank, "summary": s, "wps_intervals": wps})
            print(f"sleep {label} ms: {s}", flush=True)
    print(f"\n{args.variant}, --max-tokens {args.max_tokens}, {args.gpus} GPU(s), the run's second "
          "half, ms per update (host clock):\n")
    print(markdown(table))
    if args.json:
        import datetime
        import json
        import shlex

        with open(args.json, "w") as f:
            json.dump({"devices": e2e.gpu_names(), "date": str(datetime.date.today()),
                       "commit": e2e.commit(),
                       "command": "python bench/host_slack.py " + shlex.join(sys.argv[1:]),
                       "variant": args.variant, "max_tokens": args.max_tokens,
                       "gpus": args.gpus, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
