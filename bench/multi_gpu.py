#!/usr/bin/env python3
"""Multi-GPU checks through fairseq's own distributed engine (one process per GPU, NCCL).

1. Correctness: the ls_ model (the README's command, variant ``ls``) under --correctness-backend
   (fairseq's default, pytorch_ddp) on N GPUs with --update-freq 1 and on 1 GPU with
   --update-freq N see the same batches per update (fairseq shards the batch list round-robin),
   so with dropout 0 and an initial loss scale at which neither run overflows (--init-scale)
   their per-update losses agree within fp16 noise; --updates (200) updates, both curves, their
   loss scales and the largest gap. The JSON is written after every run.
2. The N-GPU run's checkpoint resumes on 1 GPU.
3. fairseq's other DDP backends (--other-backends: of pytorch_ddp, legacy_ddp, no_c10d) train
   the ls_ model on N GPUs.
4. Scaling by wall clock over whole epochs: each (--max-tokens per GPU, variant, ddp-backend) on
   1 and N GPUs runs --scaling-epochs whole epochs; its throughput is the target tokens of the
   epochs (fairseq's end-of-epoch wpb x updates, summed over the GPUs) over the wall-clock time
   between their ends: epoch 1 (warm-up, CUDA-graph captures) on its own, epochs 2..last as
   "steady". Also per configuration: updates per epoch (a warning under 200), fairseq's own
   interval wps, and each rank's peak reserved and used device memory; the ratios N GPUs / 1 GPU
   and ls_ / best baseline at the same GPU count. Default variants: the fairseq baseline with and
   without cuDNN attention and ls_, all under pytorch_ddp.

    # 1-3 (correctness, resume, backends), on a 2-GPU machine
    python bench/multi_gpu.py --gpus 2 --skip-scaling --json $OUT/multi_gpu_correctness.json \
        --markdown $OUT/multi_gpu_correctness.md
    # 4 (scaling): 200k pairs give >= 200 updates per epoch on 2 GPUs at 16384 tokens per GPU
    python bench/multi_gpu.py --gpus 2 --skip-correctness --sentences 200000 \
        --max-tokens 8192 16384 --json $OUT/multi_gpu_scaling.json --markdown $OUT/multi_gpu.md

--json holds every figure as data (benchlib/results.py's schema: device, date, commit from
LS_BENCH_COMMIT or git, the command line), one row per step: ``step`` "correctness" (the curves,
gaps, resume and backends), "graphs_check", "profiles", and one "scaling" row per configuration.
The probes (benchlib/probes: the memory sampler and the epoch-end stamps) run in every rank.
Keeps NVLink multicast off (NCCL_NVLS_ENABLE=0) as the device machines require.
"""
import argparse
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys

import e2e
from benchlib import corpora, env, logs, results, update_timeline
from benchlib.env import gpu_names

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


LOG_DIR = os.environ.get("OUT", "/tmp")
#: fewer updates per epoch, and the epoch boundary's cost weighs too much in the steady figure
MIN_UPDATES_PER_EPOCH = 200


def losses(log):
    return logs.losses(logs.parse(log))


def loss_scales(log):
    """(update, fp16 loss scale) of each logged interval: where two runs' scales differ, they
    skipped a different number of overflowing updates and stopped seeing the same batches."""
    return logs.loss_scales(logs.parse(log))


def largest_gap(a, b):
    """(largest |loss a - loss b|, its update) over the updates both curves logged; (nan, None)
    where they share none."""
    other = dict(b)
    gaps = [(abs(loss - other[u]), u) for u, loss in a if u in other]
    return max(gaps) if gaps else (float("nan"), None)


def max_gap(a, b):
    return largest_gap(a, b)[0]


def _finite(x):
    """x, or None for nan (the JSON file stays standard JSON)."""
    return None if x is None or math.isnan(x) else x


def corpus(sentences, workers, workdir=None):
    """The binarised synthetic corpus of ``sentences`` pairs (made once per machine)."""
    if workdir is None:
        workdir = "/tmp/ls_bench_e2e" + ("" if sentences == 40000 else f"_{sentences}")
    if not os.path.exists(os.path.join(workdir, "train.en")):
        corpora.write_learnable_wmt(workdir, sentences)
    return corpora.preprocess(workdir, workers)


#: fairseq's DDP backends that train the ls_ model (correctness, step 3)
DDP_BACKENDS = ("pytorch_ddp", "legacy_ddp", "no_c10d")

KEEP = re.compile(r"^BENCH_|end of epoch|Stopping training|Loaded checkpoint|"
                  r"copy-engine-all-reduce|sharded-optimizer-step|re-capturing|"
                  r"(train_inner|train)(?: \| |:)\{")


def train(data, variant, max_tokens, gpus, update_freq, updates, save_dir, extra=(),
          backend="pytorch_ddp", env_extra=None, epochs=100):
    cmd = e2e.train_cmd(data, variant, max_tokens, epochs, 1, list(extra))
    cmd.remove("--no-save")  # train_cmd's own; a caller that wants no checkpoints passes it
    cmd += ["--distributed-world-size", str(gpus), "--update-freq", str(update_freq),
            "--save-dir", save_dir, "--no-epoch-checkpoints", "--ddp-backend", backend]
    if updates:
        cmd += ["--max-update", str(updates)]
    run_env = e2e.train_env(variant, **(env_extra or {}))
    run_env["CUDA_VISIBLE_DEVICES"] = ",".join(env.visible_gpus(gpus))
    # streamed into $OUT while it runs, so a run that the call's time cuts still shows how far
    # it got; the next run overwrites them
    streams = [os.path.join(LOG_DIR, f"multi_gpu_current_run.{s}") for s in ("out", "err")]
    with open(streams[0], "w") as out, open(streams[1], "w") as err:
        proc = subprocess.run(cmd, stdout=out, stderr=err, text=True, env=run_env)
    log = ""
    for path in streams:
        with open(path) as f:
            log += f.read()
    with open(os.path.join(save_dir, "train.log"), "w") as f:
        f.write(log)
    # keep every run's stats lines, stamps and the end of its log with the results (the device
    # returns $OUT only): the figures can be recomputed from them if the call is cut short
    with open(os.path.join(LOG_DIR, "multi_gpu_runs.log"), "a") as f:
        f.write(f"\n===== {' '.join(cmd[3:])} gpus={gpus} rc={proc.returncode}\n")
        lines = [l for l in log.splitlines() if "Warning" not in l]
        stats = [l for l in lines[:-40] if KEEP.search(l)]
        f.write("\n".join(stats + lines[-40:])[-200000:])
    if proc.returncode != 0:
        raise RuntimeError(log[-3000:])
    return log


# --------------------------------------------------------------------------------------------
# what a run's log says
# --------------------------------------------------------------------------------------------

def epoch_ends(log):
    """The host clock (s) at each end of epoch of the lowest rank that stamped (rank 0: the rank
    that logs fairseq's stats), in order."""
    return logs.epoch_ends(log)


def rank_memory(log):
    """Each rank's peak reserved and used device memory (bytes), by rank."""
    return [{k: m[k] for k in ("rank", "reserved_max_bytes", "used_max_bytes")}
            for m in logs.memory(log)]


def epoch_wps(log):
    """Throughput by wall clock over whole epochs, from fairseq's end-of-epoch stats lines ("end
    of epoch N (average epoch stats below)", then ``train_*`` stats): an epoch's target tokens
    are its wpb x its updates (on N GPUs fairseq aggregates the stats over the workers, so wpb
    is the sum over the GPUs). Epoch 1 lasts from the trainer's start (fairseq's ``wall`` field:
    whole seconds) to its end; "steady" is epochs 2..last over the time between the ends of
    epoch 1 and of the last, from the sitecustomize's stamps where there is one per epoch line,
    else from the ``wall`` fields. A last epoch cut short by --max-update is left out."""
    from ls_fairseq.cli.compare.metrics import FULL_EPOCH

    epochs = logs.parse(log).epochs
    rows, before = [], 0
    for e in sorted(epochs):
        s = epochs[e]
        updates = int(s["num_updates"]) - before
        before = int(s["num_updates"])
        rows.append({"epoch": e, "updates": updates, "tokens": s["wpb"] * updates,
                     "wall": s["wall"], "wps": s["wps"]})
    ends = epoch_ends(log)
    stamped = len(ends) == len(rows) and len(rows) > 0
    complete = list(rows)
    if ("Stopping training due to" in log and len(rows) > 1
            and rows[-1]["updates"] < FULL_EPOCH * max(r["updates"] for r in rows[:-1])):
        complete.pop()
    walls = [r["wall"] for r in rows]
    clock = ends if stamped else walls
    wall_s = [walls[0]] + [b - a for a, b in zip(clock, clock[1:])] if rows else []
    out = {"epochs_logged": len(rows), "epochs_complete": len(complete),
           "updates_by_epoch": [r["updates"] for r in rows],
           "tokens_by_epoch": [r["tokens"] for r in rows],
           "wall_by_epoch_s": wall_s,
           "wall_source": "epoch-end stamps" if stamped else "fairseq wall field",
           "wps_by_epoch_fairseq": [r["wps"] for r in rows],
           "updates_per_epoch": min((r["updates"] for r in complete), default=None),
           "epochs_steady": [r["epoch"] for r in complete[1:]],
           "wps_epoch1_wall": None, "wps_steady_wall": None,
           "tokens_steady": None, "wall_steady_s": None}
    if complete and complete[0]["epoch"] == 1 and walls[0] > 0:
        out["wps_epoch1_wall"] = rows[0]["tokens"] / walls[0]
    if len(complete) > 1 and complete[0]["epoch"] == 1:
        last = len(complete) - 1
        out["tokens_steady"] = sum(r["tokens"] for r in complete[1:])
        out["wall_steady_s"] = clock[last] - clock[0]
        if out["wall_steady_s"] > 0:
            out["wps_steady_wall"] = out["tokens_steady"] / out["wall_steady_s"]
    return out


def steady_wps(log):
    """Tokens/s over the logged intervals in the second half of a run (logs.time_weighted_wps),
    leaving out each interval that spans an epoch boundary: that interval carries the
    end-of-epoch work (iterator and data-loader restart, ~3 s) and falls at a different place in
    the 1- and N-GPU runs (N GPUs finish an epoch in 1/N of the updates), so keeping it would
    bias the ratio. fairseq's interval meters: kept beside the wall-clock figures."""
    rows, after_epoch = [], False
    for record in logs.parse(log).records:
        if record["kind"] == "epoch":
            after_epoch = True
            continue
        if record["kind"] != "inner":
            continue
        if not after_epoch:
            rows.append(record)
        after_epoch = False
    steady = rows[len(rows) // 2:]
    return logs.time_weighted_wps(steady) if steady else float("nan")


def scaling_row(log, max_tokens, variant, backend, gpus, epochs, error=None):
    """One scaling configuration as data (the JSON row; add_ratios fills in the ratios)."""
    row = {"max_tokens": max_tokens, "variant": variant, "ddp_backend": backend, "gpus": gpus,
           "update_freq": 1, "epochs_run": epochs}
    if error:
        row["error"] = error
        return row
    row.update(epoch_wps(log))
    interval = steady_wps(log)
    row["wps_interval_fairseq"] = _finite(interval)
    row["memory_by_rank"] = rank_memory(log)
    return row


def _ratio(a, b):
    return a / b if a and b else None


def add_ratios(rows):
    """scaling_*: an N-GPU row over the 1-GPU row of its max-tokens, variant and backend;
    ls_over_best_baseline_*: an ls_ row over the fastest baseline row (any variant and backend)
    of its max-tokens and GPU count; for epoch 1 and steady. tokens_per_epoch_vs_1gpu: the N-GPU
    run's target tokens per epoch over the 1-GPU run's (the same corpus: 1 where the N-GPU wpb
    is the sum over the GPUs)."""
    ok = [r for r in rows if not r.get("error")]
    for r in ok:
        one = next((o for o in ok if o["gpus"] == 1 and r["gpus"] > 1 and (
            o["max_tokens"], o["variant"], o["ddp_backend"]) == (
            r["max_tokens"], r["variant"], r["ddp_backend"])), None)
        for key in ("epoch1", "steady"):
            wps = f"wps_{key}_wall"
            r[f"scaling_{key}"] = _ratio(r[wps], one[wps]) if one else None
            bases = [o for o in ok if o["variant"].startswith("baseline") and o[wps]
                     and (o["max_tokens"], o["gpus"]) == (r["max_tokens"], r["gpus"])]
            best = max(bases, key=lambda o: o[wps], default=None)
            is_ls = r["variant"].startswith("ls") and best is not None
            r[f"best_baseline_{key}"] = best["variant"] if is_ls else None
            r[f"ls_over_best_baseline_{key}"] = _ratio(r[wps], best[wps]) if is_ls else None
        r["tokens_per_epoch_vs_1gpu"] = None
        if one and r["epochs_complete"] and one["epochs_complete"]:
            mean = [sum(x["tokens_by_epoch"][:x["epochs_complete"]]) / x["epochs_complete"]
                    for x in (r, one)]
            r["tokens_per_epoch_vs_1gpu"] = _ratio(*mean)
    return rows


def row_warnings(row):
    name = (f"{row['variant']} ({row['ddp_backend']}), {row['gpus']} GPU(s), max-tokens "
            f"{row['max_tokens']}")
    if row.get("error"):
        return [f"WARNING: {name}: FAILED"]
    out = []
    n = row.get("updates_per_epoch")
    if n is None or n < MIN_UPDATES_PER_EPOCH:
        out.append(f"WARNING: {name}: {e2e.fmt(n, 'd')} updates per epoch, under the "
                   f"{MIN_UPDATES_PER_EPOCH} a steady figure needs (a larger --sentences)")
    if not row.get("epochs_steady"):
        out.append(f"WARNING: {name}: no complete epoch after the first (no steady figure)")
    ratio = row.get("tokens_per_epoch_vs_1gpu")
    if ratio is not None and abs(ratio - 1) > 0.05:
        out.append(f"WARNING: {name}: {ratio:.3f}x the 1-GPU run's target tokens per epoch (not "
                   f"the sum over the GPUs?)")
    return out


def _held_gb(row):
    return "; ".join(f"r{m['rank']} {m['reserved_max_bytes'] / 2**30:.1f} / "
                     f"{m['used_max_bytes'] / 2**30:.1f}" for m in row.get("memory_by_rank", []))


def _ratios(row, key):
    steady, first = row.get(f"{key}_steady"), row.get(f"{key}_epoch1")
    if steady is None and first is None:
        return ""
    return f"{e2e.fmt(steady, '.2f')}× ({e2e.fmt(first, '.2f')}×)"


def scaling_markdown(rows):
    lines = ["Scaling by wall clock over whole epochs: target tokens (fairseq's wpb x updates, "
             "summed over the GPUs) / seconds between epoch ends; epoch 1 from the trainer's "
             "start, steady = epochs 2..last. Ratios: steady (epoch 1). Held memory: each rank's "
             "peak torch.cuda.memory_reserved() / device memory used (total - free), GB.", "",
             "| max-tokens per GPU | variant | ddp-backend | GPUs | updates/epoch | "
             "steady epochs | wps epoch 1 | wps steady | scaling vs 1 GPU | ls_/best baseline | "
             "fairseq interval wps | held GB per rank: reserved / used |",
             "|---:|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        head = f"| {r['max_tokens']} | {r['variant']} | {r['ddp_backend']} | {r['gpus']} |"
        if r.get("error"):
            lines.append(f"{head} FAILED: {r['error'][-60:]!r} | | | | | | | |")
            continue
        steady = r["epochs_steady"]
        epochs = "–" if not steady else (
            str(steady[0]) if len(steady) == 1 else f"{steady[0]}–{steady[-1]}")
        lines.append(
            f"{head} {e2e.fmt(r['updates_per_epoch'], 'd')} | {epochs} | "
            f"{e2e.fmt(r['wps_epoch1_wall'], ',.0f')} | {e2e.fmt(r['wps_steady_wall'], ',.0f')} | "
            f"{_ratios(r, 'scaling')} | {_ratios(r, 'ls_over_best_baseline')} | "
            f"{e2e.fmt(r['wps_interval_fairseq'], ',.0f')} | {_held_gb(r)} |")
    warnings = [w for r in rows for w in row_warnings(r)]
    return "\n".join(lines + ([""] + warnings if warnings else []))


# --------------------------------------------------------------------------------------------
# the call: device, commit, command; the results file
# --------------------------------------------------------------------------------------------

def result_rows(results_so_far):
    """The results file's rows: one per step that ran (``step``: correctness, graphs_check,
    profiles), then one per scaling configuration."""
    rows = [dict(step=step, **results_so_far[step])
            for step in ("correctness", "graphs_check", "profiles") if results_so_far.get(step)]
    scaling = results_so_far.get("scaling") or {}
    return rows + [dict(step="scaling", scaling_epochs=scaling["epochs"], **r)
                   for r in scaling.get("rows", [])]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--workdir", default=None,
                    help="corpus directory (default /tmp/ls_bench_e2e, or ..._<sentences> for "
                         "another --sentences)")
    ap.add_argument("--sentences", type=int, default=40000,
                    help="training pairs of the synthetic corpus: more pairs, longer epochs (the "
                         "scaling step wants >= 200 updates per epoch on N GPUs: 200000 at 16384 "
                         "tokens per GPU on 2 GPUs)")
    ap.add_argument("--workers", type=int, default=8, help="fairseq-preprocess workers")
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[8192],
                    help="per GPU; the correctness step uses the first")
    ap.add_argument("--updates", type=int, default=200,
                    help="updates of the correctness runs (>= 200: past the early fp16 overflows)")
    ap.add_argument("--correctness-backend", default="pytorch_ddp",
                    help="--ddp-backend of the correctness and resume runs (fairseq's default)")
    ap.add_argument("--other-backends", default=",".join(DDP_BACKENDS),
                    help="step 3: the DDP backends, besides --correctness-backend, that train 30 "
                         "updates each (about 45 s each on 4 GPUs); '' for none")
    ap.add_argument("--init-scale", type=float, default=4.0,
                    help="--fp16-init-scale of the correctness runs: fairseq's 128 overflows "
                         "a different number of times on 1 GPU x update-freq N (fp16 sums of N "
                         "gradients) than on N GPUs, and each skipped update shifts the batches "
                         "of the rest of the run; at 4 neither run overflows (transformer big). "
                         "0: fairseq's default")
    ap.add_argument("--scaling-epochs", type=int, default=2,
                    help="whole epochs per scaling run: epoch 1, then the steady epochs 2..last")
    ap.add_argument("--scaling-variants",
                    default="baseline:pytorch_ddp,baseline_nocudnn:pytorch_ddp,ls:pytorch_ddp",
                    help="variant:ddp-backend[:epochs] (bench/e2e.py's variants; epochs overrides "
                         "--scaling-epochs for that variant)")
    ap.add_argument("--scaling-skip-one-gpu", action="store_true",
                    help="the scaling runs on N GPUs only (their 1-GPU rows came from an earlier "
                         "call: no scaling column, but ls_ over fairseq on N GPUs, same call)")
    ap.add_argument("--graphs-check", action="store_true",
                    help="a graphed variant (--graphs-check-variant) under legacy_ddp: N GPUs x "
                         "update-freq 1 vs 1 GPU x update-freq N, dropout 0, on a 4k-pair corpus "
                         "(batches recur, so graphs replay)")
    ap.add_argument("--graphs-check-variant", default="ls_graphs",
                    help="the graphed variant --graphs-check runs (e.g. ls_async)")
    ap.add_argument("--skip-scaling", action="store_true")
    ap.add_argument("--skip-correctness", action="store_true",
                    help="only the scaling runs (steps 1-3 were shown in an earlier call)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile --profile-steps updates from --profile-at (GPU, every "
                         "rank) and 20 more (host) of --profile-variants on 1 and N GPUs at the "
                         "first --max-tokens")
    ap.add_argument("--profile-variants", default="baseline_nocudnn:pytorch_ddp,ls:pytorch_ddp",
                    help="variant:ddp-backend pairs to profile")
    ap.add_argument("--profile-at", type=int, default=40,
                    help="first profiled update; with ls_graphs, late enough that the batches "
                         "replay, and inside an epoch (an epoch boundary adds ~3 s)")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--profile-skip-one-gpu", action="store_true",
                    help="profile on N GPUs only (the 1-GPU profile was taken in an earlier call)")
    ap.add_argument("--profile-timelines", action="store_true",
                    help="each profiled rank also writes its GPU timeline (BENCH_PROFILE_TIMELINE) "
                         "and benchlib/update_timeline.py splits every update after its backward: "
                         "all-reduce wait, clip, optimizer, idle until the next update")
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--json", default=None,
                    help="every figure as data: device, date, commit, command, the correctness "
                         "curves and gaps, each scaling row (written again after each run)")
    args = ap.parse_args(argv)
    unknown = [b for b in args.other_backends.split(",") if b and b not in DDP_BACKENDS]
    if unknown:
        ap.error(f"--other-backends {args.other_backends}: {', '.join(unknown)} is not one of "
                 f"{', '.join(DDP_BACKENDS)}")
    if args.init_scale < 0:
        ap.error(f"--init-scale {args.init_scale:g}: a loss scale is positive (0: fairseq's)")
    names = gpu_names()
    command = "python bench/multi_gpu.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    info = results.header("bench/multi_gpu.py", f"several GPUs through fairseq's distributed "
                          f"engine on {args.gpus} GPUs: "
                          + ", ".join(step for step, skip in (
                              ("correctness, resume and DDP backends", args.skip_correctness),
                              ("scaling", args.skip_scaling), ("profiles", not args.profile),
                              ("graphs check", not args.graphs_check)) if not skip),
                          command, device=names[0])
    info["devices"] = names
    print(f"Device: {', '.join(names)}; commit: {info['commit']}", flush=True)
    data = corpus(args.sentences, args.workers, args.workdir)
    out, results_so_far = [], {}

    def save():
        rows = result_rows(results_so_far)
        if args.json and rows:
            results.write(args.json, info, rows, gpus=args.gpus, sentences=args.sentences)

    if not args.skip_correctness:
        def step(figures):  # after each run: a call cut short keeps the runs that finished
            results_so_far["correctness"] = figures
            save()

        text, results_so_far["correctness"] = correctness(data, args, step)
        out.append(text)
        save()
        print(text, flush=True)
    if args.graphs_check:
        text, results_so_far["graphs_check"] = graphs_check(args)
        out.append(text)
        save()
        print(text, flush=True)
    if args.profile:
        text, results_so_far["profiles"] = profiles(data, args)
        out.append(text)
        save()
        print(text, flush=True)
    if not args.skip_scaling:
        def partial(rows):
            results_so_far["scaling"] = {"epochs": args.scaling_epochs, "rows": add_ratios(rows)}
            save()

        rows = scaling(data, args, partial)
        partial(rows)
        out.append(scaling_markdown(rows))
    header = (f"Device: {args.gpus}x {info['device']} ({', '.join(info['devices'])}); date: "
              f"{info['date']}; commit: {info['commit']}; torch {info['torch']}\n\n"
              f"Command: `{info['command']}`")
    text = "\n\n".join([header] + out)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


def correctness(data, args, on_step=None):
    """Steps 1-3: (the text, the figures as data); ``on_step(figures so far)`` after each run."""
    out = []
    on_step = on_step or (lambda figures: None)
    backend = args.correctness_backend
    # 1 + 2: correctness and resume, dropout off so the two runs are comparable update by update;
    # fairseq's order on N GPUs (no length grouping), the batches of 1 GPU x update-freq N
    nodrop = ["--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0",
              "--ls-no-fix-batches-to-gpus"]
    if args.init_scale:
        nodrop += ["--fp16-init-scale", f"{args.init_scale:g}"]
    multi_dir, single_dir = "/tmp/mg_multi", "/tmp/mg_single"
    for d in (multi_dir, single_dir):
        # an earlier call's checkpoint_last.pt would be resumed instead of training from scratch
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    mt = args.max_tokens[0]
    data_out = {"variant": "ls", "ddp_backend": backend, "gpus": args.gpus, "max_tokens": mt,
                "updates": args.updates, "dropout": 0, "fp16_init_scale": args.init_scale or None,
                "other_backends": []}
    log = train(data, "ls", mt, args.gpus, 1, args.updates, multi_dir, nodrop, backend)
    multi, multi_scales = losses(log), loss_scales(log)
    data_out.update(loss_n_gpus=multi, loss_scale_n_gpus=multi_scales)
    on_step(data_out)
    log = train(data, "ls", mt, 1, args.gpus, args.updates, single_dir, nodrop, backend)
    single, single_scales = losses(log), loss_scales(log)
    gap, at = largest_gap(multi, single)
    data_out.update(loss_1_gpu_update_freq_n=single, loss_scale_1_gpu_update_freq_n=single_scales,
                    largest_gap=_finite(gap), largest_gap_update=at)
    on_step(data_out)
    scale = "fairseq's" if not args.init_scale else f"{args.init_scale:g}"
    out.append(f"Correctness ({args.gpus} GPUs x update-freq 1 vs 1 GPU x update-freq "
               f"{args.gpus}, ls_, --ddp-backend {backend}, max-tokens {mt}, dropout 0, "
               f"initial loss scale {scale}, {args.updates} updates): largest loss gap "
               f"{gap:.4f} (update {at})")
    out.append("updates: " + " ".join(str(u) for u, _ in multi))
    out.append(f"loss {args.gpus} GPUs: " + " ".join(f"{l:.3f}" for _, l in multi))
    out.append("loss 1 GPU:   " + " ".join(f"{l:.3f}" for _, l in single))
    if multi_scales != single_scales:
        out.append(f"loss scales differ ({args.gpus} GPUs: "
                   f"{' '.join(f'{x:g}' for _, x in multi_scales)}; 1 GPU: "
                   f"{' '.join(f'{x:g}' for _, x in single_scales)}): the runs skipped a "
                   f"different number of overflowing updates, so their batches differ after it")
    resumed = train(data, "ls", mt, 1, args.gpus, args.updates + 10, multi_dir, nodrop, backend)
    ok = re.search(r"Loaded checkpoint .*@ %d updates" % args.updates, resumed) is not None
    out.append(f"{args.gpus}-GPU checkpoint resumed on 1 GPU: {'yes' if ok else 'NO'}")
    data_out["resumed_on_1_gpu"] = ok
    on_step(data_out)

    # 3: the other DDP backends
    for other in [b for b in args.other_backends.split(",") if b and b != backend]:
        d = f"/tmp/mg_{other}"
        os.makedirs(d, exist_ok=True)
        try:
            curve = losses(train(data, "ls", mt, args.gpus, 1, 30, d, nodrop + ["--no-save"],
                                 other))
            gap = max_gap(curve, multi)
            last = (f"loss at {curve[-1][0]} updates {curve[-1][1]:.3f}" if curve
                    else "no loss logged")
            out.append(f"--ddp-backend {other}, {args.gpus} GPUs, 30 updates: trains; {last} "
                       f"(largest gap to {backend} {gap:.4f})")
            data_out["other_backends"].append({"ddp_backend": other, "trains": True,
                                               "loss": curve, "largest_gap": _finite(gap)})
        except (RuntimeError, IndexError) as e:
            out.append(f"--ddp-backend {other}: FAILED: {str(e)[-300:]!r}")
            data_out["other_backends"].append({"ddp_backend": other, "trains": False,
                                               "error": str(e)[-300:]})
        on_step(data_out)
    return "\n".join(out), data_out


def graphs_check(args, sentences=4000, updates=100):
    """The CUDA-graphed step under legacy_ddp: the N-GPU run (flat all-reduce of the replayed
    gradients, ls_adam) and the 1-GPU run with update-freq N see the same batches per update;
    with dropout 0 their losses agree within fp16 noise. fairseq's trainer also checks every
    update that the ranks' grad norms agree (it stops the run if not). (the text, the data)"""
    data = corpus(sentences, args.workers)
    nodrop = ["--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0",
              "--no-save", "--ls-no-fix-batches-to-gpus"]
    mt = args.max_tokens[0]
    logs = {}
    for gpus, freq in ((args.gpus, 1), (1, args.gpus)):
        d = f"/tmp/mg_graphs_{gpus}"
        os.makedirs(d, exist_ok=True)
        logs[gpus] = train(data, args.graphs_check_variant, mt, gpus, freq, updates, d, nodrop,
                           "legacy_ddp")
    multi, single = losses(logs[args.gpus]), losses(logs[1])
    flat = "all-reducing them in place" in logs[args.gpus]
    overlapped = "as the backward completes them" in logs[args.gpus]
    captured = re.findall(r"captured (\d+) batch shape", logs[args.gpus])
    # fp16 overflows (skipped updates) of each run: with --ls-deferred-overflow-check the trainer
    # counts and logs them, so runs that skip different updates differ until they are trained
    overflows = {g: log.count("gradient overflow detected") for g, log in logs.items()}
    gap = max_gap(multi, single)
    out = [f"{args.graphs_check_variant}, --ddp-backend legacy_ddp ({args.gpus} GPUs x update-freq "
           f"1 vs 1 GPU x update-freq {args.gpus}, max-tokens {mt}, dropout 0, {updates} updates, "
           f"{sentences}-pair corpus): largest loss gap {gap:.4f}; flat "
           f"all-reduce used: {'yes' if flat else 'NO'}, during the backward: "
           f"{'yes' if overlapped else 'no'}; shapes captured (rank log, last power of 2): "
           f"{captured[-1] if captured else 'none'}; fp16 overflows: {overflows[args.gpus]} "
           f"({args.gpus} GPUs), {overflows[1]} (1 GPU)",
           "updates: " + " ".join(str(u) for u, _ in multi),
           f"loss {args.gpus} GPUs: " + " ".join(f"{l:.3f}" for _, l in multi),
           "loss 1 GPU:   " + " ".join(f"{l:.3f}" for _, l in single)]
    data_out = {"variant": args.graphs_check_variant, "ddp_backend": "legacy_ddp",
                "gpus": args.gpus, "max_tokens": mt, "updates": updates, "sentences": sentences,
                "loss_n_gpus": multi, "loss_1_gpu_update_freq_n": single,
                "largest_gap": _finite(gap),
                "flat_all_reduce": flat, "all_reduce_during_backward": overlapped,
                "fp16_overflows": {str(g): n for g, n in overflows.items()}}
    return "\n".join(out), data_out


def profiles(data, args):
    """Where an update's time goes on 1 and N GPUs (the profiler probe in every worker), and
    where the host waits for the GPU. On N GPUs each update is split per rank into NCCL kernels
    (transfer, plus waiting for the slower rank), other kernels and idle GPU time: a rank's
    compute next to the other's shows how unequal the ranks' batches are. With
    ``--profile-timelines``, benchlib/update_timeline.py's split of each update after its backward.
    Returns (the text, the figures as data)."""
    mt, found, lines, timelines = args.max_tokens[0], [], [], []
    at, steps = args.profile_at, args.profile_steps
    for spec in args.profile_variants.split(","):
        variant, backend = spec.split(":")
        for gpus in (1, args.gpus)[1 if args.profile_skip_one_gpu else 0:]:
            d = f"/tmp/mg_profile_{variant}_{backend}_{gpus}"
            os.makedirs(d, exist_ok=True)
            # beside the results ($OUT): the JSON has the per-update rows and host profile
            out = os.path.join(LOG_DIR, f"profile_{variant}_{backend}_{gpus}gpu_{{rank}}.json")
            probes = {"BENCH_PROFILE_AT": str(at), "BENCH_PROFILE_STEPS": str(steps),
                   "BENCH_PROFILE_OUT": out,
                   "BENCH_PROFILE_TIMELINE": "1" if args.profile_timelines else ""}
            name = f"{variant} ({backend}), {gpus} GPU{'s' if gpus > 1 else ''}"
            try:
                train(data, variant, mt, gpus, 1, at + steps + 2 + e2e.PROFILE_PY_STEPS + 1, d,
                      ["--no-save"], backend, env_extra=probes)
                ranks = []
                for r in range(gpus):
                    with open(out.format(rank=r)) as f:
                        ranks.append(json.load(f))
                for r, prof in enumerate(ranks):
                    found.append({"variant": name + (f", rank {r}" if gpus > 1 else ""),
                                  "profile": prof})
                if gpus > 1:
                    lines.append(ranks_table(name, ranks))
                if args.profile_timelines:
                    timelines += [out.format(rank=r) + ".timeline.json.gz" for r in range(gpus)]
            except (RuntimeError, OSError) as e:
                found.append({"variant": name, "error": str(e)[-300:]})
    head = [f"Profiles at max-tokens {mt} (per GPU), updates {at}-{at + steps - 1}:",
            e2e.profile_markdown(found)]
    for p in found:
        s = p.get("profile") or {}
        if s.get("median_ms_per_update"):
            m = s["median_ms_per_update"]
            head.append(f"\nMedian per update, {p['variant']}: period {m['ms']:.1f} ms = "
                        f"compute {m['compute_ms']:.1f} + NCCL {m['nccl_ms']:.1f} + idle "
                        f"{m['idle_ms']:.1f} (copies {m.get('copy_ms', 0.0):.1f}, beside "
                        f"compute)")
        if s.get("host_syncs_per_step_by_site"):
            head.append(f"\nHost syncs per update, {p['variant']}: " + "; ".join(
                f"{site} {n:.1f}" for site, n in s["host_syncs_per_step_by_site"][:8]))
    split = update_timeline.summarize(timelines) if timelines else None
    if split:
        lines.append("\nAfter the backward (benchlib/update_timeline.py): " + update_timeline.markdown(
            split))
    return "\n".join(head + lines), {"max_tokens": mt, "at": at, "steps": steps,
                                    "profiles": found, "update_timeline": split}


def ranks_table(name, ranks):
    """Update by update, each rank's compute / NCCL / copies / idle ms, and what unequal batches
    cost: the mean over updates of max(compute) - mean(compute) (the faster ranks wait about that
    long)."""
    rows = [f"\nPer update, {name} (ms; compute / NCCL / copies / idle per rank):",
            "| update | " + " | ".join(f"rank {r}" for r in range(len(ranks))) + " | period |",
            "|---|" + "---|" * (len(ranks) + 1)]
    per = [r.get("per_update") or [] for r in ranks]
    n = min(len(p) for p in per)
    waits = []
    for i in range(n):
        cells = [f"{p[i]['compute_ms']:.1f} / {p[i]['nccl_ms']:.1f} / "
                 f"{p[i].get('copy_ms', 0.0):.1f} / {p[i]['idle_ms']:.1f}" for p in per]
        compute = [p[i]["compute_ms"] for p in per]
        waits.append(max(compute) - sum(compute) / len(compute))
        rows.append(f"| {i} | " + " | ".join(cells) + f" | {per[0][i]['ms']:.1f} |")
    if waits:
        rows.append(f"\nUnequal batches, {name}: max - mean compute per update "
                    f"{sum(waits) / n:.2f} ms on average over {n} updates")
    return "\n".join(rows)


def scaling(data, args, on_row=None):
    """4: each --max-tokens (per GPU, update-freq 1) and --scaling-variants entry on 1 and N GPUs
    (N only with --scaling-skip-one-gpu), --scaling-epochs whole epochs each; the rows of
    scaling_row, in order (on_row(rows) after each run). A variant with single_gpu_as (flags that
    matter on several GPUs only) runs one GPU as that variant, once per call: the variant itself,
    listed before or after, reuses the run."""
    rows, single = [], {}  # (variant, backend, max-tokens) -> its 1-GPU row
    for mt in args.max_tokens:
        for spec in args.scaling_variants.split(","):
            variant, backend, *own = spec.split(":")
            epochs = int(own[0]) if own else args.scaling_epochs
            base = e2e.VARIANTS[variant].get("single_gpu_as") or variant
            key = (base, backend, mt)
            for gpus in (args.gpus,) if args.scaling_skip_one_gpu else (1, args.gpus):
                if gpus == 1 and key in single:
                    row = dict(single[key])
                else:
                    run = base if gpus == 1 else variant
                    d = f"/tmp/mg_{run}_{backend}_{mt}_{gpus}"
                    os.makedirs(d, exist_ok=True)
                    log, error = "", None
                    try:
                        log = train(data, run, mt, gpus, 1, None, d, ["--no-save"], backend,
                                    epochs=epochs)
                    except RuntimeError as e:  # keep the rest of the table; the log is in $OUT
                        error = str(e)[-500:]
                        print(f"{run} {mt} tokens {gpus} GPU(s) FAILED: {error}", flush=True)
                    row = scaling_row(log, mt, run, backend, gpus, epochs, error)
                    if gpus == 1:
                        single[key] = row
                if row["variant"] != variant:  # base's 1-GPU run, shared
                    row = dict(row, variant=variant, same_run_as=row["variant"])
                rows.append(row)
                add_ratios(rows)
                print(json.dumps(row), flush=True)
                for warning in row_warnings(row):
                    print(warning, flush=True)
                if on_row:
                    on_row(rows)
    return rows


if __name__ == "__main__":
    sys.exit(main())
