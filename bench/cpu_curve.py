#!/usr/bin/env python3
"""Training curves of several data-parallel workers on the CPU: which batch order trains as
fairseq's does.

Each variant of ``bench/quality.py`` (its corpus and recipe: by default the synthetic one, the
learnable corpus) trains as N gloo
workers of one fairseq-train run (``--ddp-backend legacy_ddp``: fairseq hands torch DDP a GPU
id even on the CPU), for ``--max-update`` updates, no validation, no decoding. The table gives
the training loss at each logged update beside the first variant's. What it is for: the early
curve of an order of the epoch's batches (fairseq's, ``--grouped-shuffling``, ls_'s batches
fixed to GPUs) without GPU time; about 0.2 updates a second for 2 workers on 2 cores.

    python bench/cpu_curve.py --variants baseline,baseline_grouped,ls --max-update 200

``--json`` writes benchlib/results.py's schema, a row per run with its curve.
"""
import argparse
import concurrent.futures
import os
import platform
import socket
import subprocess
import sys
import time

import quality
from benchlib import results


def worker_cmds(cmd, workers):
    """``cmd`` as ``workers`` gloo workers of one run (fairseq's engine, no spawn)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shared = ["--distributed-backend", "gloo", "--distributed-world-size", str(workers),
              "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-no-spawn",
              "--ddp-backend", "legacy_ddp", "--disable-validation", "--no-save"]
    return [cmd + shared + ["--distributed-rank", str(r)] for r in range(workers)]


def run(a, data, variant, seed):
    run_dir = os.path.join(a.workdir, "cpu_curves", f"{variant}_s{seed}")
    os.makedirs(run_dir, exist_ok=True)
    cmd = quality.train_cmd(a, data, variant, seed, run_dir)
    cmd[cmd.index("--log-interval") + 1] = str(a.log_interval)
    env, _ = quality.run_envs(a, variant)
    t0 = time.time()
    logs = [open(os.path.join(run_dir, f"rank{r}.log"), "w") for r in range(a.workers)]
    procs = [subprocess.Popen(c, stdout=log, stderr=subprocess.STDOUT, env=env)
             for c, log in zip(worker_cmds(cmd, a.workers), logs)]
    codes = [p.wait() for p in procs]
    for log in logs:
        log.close()
    with open(os.path.join(run_dir, "rank0.log")) as f:
        curve = quality.parse_train_log(f.read())["train_curve"]
    row = dict(variant=variant, seed=seed, workers=a.workers, train_s=round(time.time() - t0, 1),
               train_curve=curve)
    if any(codes):
        row["error"] = f"exit codes {codes} (see {run_dir})"
    return row


def table(rows):
    """Markdown: loss per logged update, each variant's difference from the first variant's."""
    updates = sorted({u for r in rows for u, _ in r["train_curve"]})
    ref = dict(rows[0]["train_curve"])
    head = "| variant | seed | " + " | ".join(str(u) for u in updates) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(updates)]
    for r in rows:
        curve = dict(r["train_curve"])
        cells = []
        for u in updates:
            if u not in curve:
                cells.append("")
            elif r is rows[0] or u not in ref:
                cells.append(f"{curve[u]:.3f}")
            else:
                cells.append(f"{curve[u]:.3f} ({curve[u] - ref[u]:+.3f})")
        lines.append(f"| {r['variant']} | {r['seed']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="baseline,baseline_grouped,ls",
                   help="bench/quality.py's variants; the first is the reference")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-update", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=2048,
                   help="per worker (2 workers x 2048: quality.py's 4096 tokens per update)")
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--jobs", type=int, default=1, help="runs at a time")
    p.add_argument("--corpus", default="synthetic",
                   help="bench/quality.py's --corpus, whose recipe the runs train: synthetic "
                        "(the learnable corpus), real, or a folder of tokenised text")
    p.add_argument("--model", choices=sorted(quality.MODELS),
                   help="quality.py's model size (default: the --corpus recipe's)")
    p.add_argument("--train-sentences", type=int,
                   default=quality.arg_parser().get_default("train_sentences"),
                   help="the synthetic corpus's training pairs (quality.py's default)")
    p.add_argument("--workdir", default="/tmp/ls_quality")
    p.add_argument("--json")
    a = p.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in variants if v not in quality.VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {sorted(quality.VARIANTS)}")
    if a.workers < 2:
        p.error(f"--workers {a.workers}: at least 2 (one worker has no batch order to compare)")
    # quality.py's recipe of --corpus, on the CPU, one process per worker
    recipe = quality.parse_args(["--corpus", a.corpus] + (["--model", a.model] if a.model else []))
    for key in ("langs", "model", "lr", "warmup_updates", "dropout", "ddp_backend",
                "update_freq"):
        setattr(a, key, getattr(recipe, key))
    a.gpus, a.cuda = 1, False
    _, data, _, _ = quality.prepare_corpus(a)
    with concurrent.futures.ThreadPoolExecutor(max_workers=a.jobs) as pool:
        rows = list(pool.map(lambda v: run(a, data, v, a.seed), variants))
    print(table(rows))
    if a.json:
        head = results.header(
            "bench/cpu_curve.py", f"training loss curves of {a.variants} as {a.workers} CPU "
            f"workers, {a.max_update} updates", "python bench/cpu_curve.py " + " ".join(
                argv if argv is not None else sys.argv[1:]),
            device=f"{os.cpu_count()}-core CPU ({platform.machine()})")
        results.write(a.json, head, rows, workers=a.workers, max_tokens=a.max_tokens,
                      max_update=a.max_update, seed=a.seed)
    return rows


if __name__ == "__main__":
    main()
