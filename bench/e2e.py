#!/usr/bin/env python3
"""End-to-end training throughput: fairseq's transformer vs ls_transformer, real fairseq-train.

On a GPU machine this script
  1. builds a synthetic corpus shaped like WMT14 en-de after joined BPE (lognormal line
     lengths, mean ~29 tokens, tail to 250) that a model can learn: lines of the learnable
     corpus's sentences (``ls_fairseq.testing.learnable_corpus``: a deterministic transduction,
     ~22k joined word types), so every run also shows a falling loss (``--corpus zipf``: random
     Zipf tokens over a ~32k vocabulary, whose loss stops at the unigram entropy: the corpus of
     older figures),
  2. binarises it with fairseq-preprocess,
  3. runs fairseq-train for every variant and --max-tokens, --epochs (2) epochs each: epoch 1
     sees every batch shape for the first time ("unseen shapes"), the last epoch repeats them
     ("steady state"),
  4. prints a markdown table (wps unseen/steady, updates/s, memory, MFU, ls_/baseline ratio)
     and a loss-curve table (each run's interval losses against the first baseline's of its
     --max-tokens, and its largest loss spike: ``ls-fairseq-compare``'s statistics), and writes
     them with device, date, commit and command to --markdown, the rows to --json
     (benchlib/results.py's schema).

Memory, per run (GiB): ``peak_gb`` is the **peak allocated** memory (fairseq's own figure,
``torch.cuda.max_memory_allocated``: total - the smallest ``gb_free`` it logs); ``reserved_gb`` the
**peak reserved** memory (``torch.cuda.memory_reserved``: allocated plus the allocator's cache
and the CUDA graphs' pool); ``device_gb`` the peak device memory used (total - free: also the CUDA
context and the graphs themselves). Reserved and used are sampled every 10th update
(benchlib/probes/memory.py).

Variants: ``baseline`` (transformer_wmt_en_de_big_t2t, label_smoothed_cross_entropy, adam),
``baseline_nocudnn`` (the same with cuDNN SDPA disabled, the best baseline a careful user gets by
a setting: no per-shape plan cost), ``ls`` (the README's command: the ls_ names, with the fused
fp16 copy, CUDA graphs and the deferred overflow check on by default), and A/B variants that
turn one mechanism on or off (``VARIANTS`` below says what each runs). Same data, seed,
hyperparameters (Ott et al. 2018: adam betas (0.9, 0.98), inverse_sqrt, warmup 4000, dropout 0.3,
label smoothing 0.1, shared embeddings), --fp16.

    python bench/e2e.py --max-tokens 8192 --markdown $OUT/e2e.md --json $OUT/e2e.json

The default corpus (40k pairs, 190 batches at 8192 tokens) meets each batch shape once per epoch;
``--sentences 400000 --epochs 1`` gives a first epoch closer to a real corpus's (1,666 batches, whose
shapes and padded shapes repeat within the epoch).

``--largest LOW HIGH STEP`` finds, per variant, the largest --max-tokens (a multiple of STEP in
[LOW, HIGH]) whose run fits: no batch skipped for lack of memory, over the whole --epochs (the
worst batch of an epoch sets the peak, so short runs do not tell). A bisection, each probe a full
run; the rows of every probe land in the tables, and a last table names each variant's largest
size that fits and the smallest that did not.

    python bench/e2e.py --sentences 200000 --epochs 1 --largest 32768 163840 8192 \\
        --variants baseline_nocudnn,ls

MFU counts 1.27 GFLOP per target token (transformer big, forward + backward) against the dense
fp16 matrix rate --peak-tflops (800); each call also measures the GPU's 8192^3 fp16 matmul rate
and prints it in the table's header. ls_ runs also log their own model TFLOP/s and MFU
(``logged_*`` fields).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

from benchlib import corpora, env, logs, results

FLOP_PER_TOKEN = 1.27e9
#: profile_summary's Python-profile window after the profiled updates (its PY_STEPS)
PROFILE_PY_STEPS = 20
#: fairseq-compare's curve start, holds_skipped_update etc. come from ls_fairseq.cli.compare,
#: imported where used (importing ls_fairseq registers the plugin: torch and fairseq)

_LS = dict(arch="ls_transformer_wmt_en_de_big_t2t", criterion="ls_label_smoothed_cross_entropy",
           optimizer="ls_adam", cudnn_sdpa=True)
VARIANTS = {
    "baseline": dict(arch="transformer_wmt_en_de_big_t2t", criterion="label_smoothed_cross_entropy",
                     optimizer="adam", cudnn_sdpa=True),
    "baseline_nocudnn": dict(arch="transformer_wmt_en_de_big_t2t",
                             criterion="label_smoothed_cross_entropy", optimizer="adam",
                             cudnn_sdpa=False),
    # the README's command: the ls_ names and nothing else (fused copy, CUDA graphs and the
    # deferred overflow check are on by default)
    "ls": dict(_LS),
    # the same in bf16 (--bf16: no loss scaling)
    "ls_bf16": dict(_LS, bf16=True),
    "ls_fp8": dict(_LS, flags=["--ls-fp8"]),  # the README's command + FP8 layer matmuls
    # FP8 in one part of each layer only (--ls-fp8-layers)
    "ls_fp8_ffn": dict(_LS, flags=["--ls-fp8", "--ls-fp8-layers", "ffn"]),
    "ls_fp8_attention": dict(_LS, flags=["--ls-fp8", "--ls-fp8-layers", "attention"]),
    # the three mechanisms required by their flags (what "ls" ran before they were defaults)
    "ls_flags": dict(_LS, flags=["--ls-fused-fp16-copy", "--ls-cuda-graphs",
                                 "--ls-deferred-overflow-check"]),
    # eager steps, fused copy only
    "ls_eager": dict(_LS, flags=["--ls-no-cuda-graphs", "--ls-no-deferred-overflow-check"]),
    "ls_graphs": dict(_LS, flags=["--ls-no-deferred-overflow-check"]),
    # the ls_ twins under fairseq's own FP16Optimizer
    "ls_plain_fp16": dict(_LS, flags=["--ls-no-fused-fp16-copy", "--ls-no-cuda-graphs",
                                      "--ls-no-deferred-overflow-check"]),
}

VARIANTS["ls_deferred"] = dict(VARIANTS["ls_flags"])
# the deferred overflow check without CUDA graphs (separates the two in fidelity runs)
VARIANTS["ls_deferred_eager"] = dict(_LS, flags=["--ls-no-cuda-graphs"])
# one graph per batch shape, as before --ls-shape-buckets (on by default with --ls-cuda-graphs)
VARIANTS["ls_deferred_nobuckets"] = dict(VARIANTS["ls_deferred"], flags=VARIANTS["ls_deferred"][
    "flags"] + ["--ls-shape-buckets", "0"])
# a new padded shape's first sighting runs eagerly, its second is captured (the old default)
VARIANTS["ls_deferred_second"] = dict(VARIANTS["ls_deferred"], flags=VARIANTS["ls_deferred"][
    "flags"] + ["--ls-cuda-graphs-capture", "second-sighting"])
# the graphs' memory as PyTorch's allocator manages it by default (the old default): the pool
# grows segment by segment, eager steps and the capture stream's warm-up keep their cache
VARIANTS["ls_deferred_grow"] = dict(VARIANTS["ls_deferred"], flags=VARIANTS["ls_deferred"][
    "flags"] + ["--ls-cuda-graphs-memory", "grow"])
# several GPUs only: the gradient all-reduce after the backward instead of during it (on one
# GPU the same run as ls_graphs, whose 1-GPU figure bench/multi_gpu.py reuses)
VARIANTS["ls_graphs_after"] = dict(VARIANTS["ls_graphs"], single_gpu_as="ls_graphs",
                                   flags=VARIANTS["ls_graphs"]["flags"] + [
                                       "--ls-all-reduce-bucket-mb", "0"])
# several GPUs: fairseq's per-update exchanges between workers off the GPU's critical path
# (ls_fairseq/distributed/async_stats.py); the flag does nothing on one GPU, whose figure is reused
VARIANTS["ls_graphs_async"] = dict(VARIANTS["ls_graphs"], single_gpu_as="ls_graphs",
                                   flags=VARIANTS["ls_graphs"]["flags"] + ["--ls-async-stats"])
VARIANTS["ls_async"] = dict(VARIANTS["ls_deferred"], single_gpu_as="ls_deferred",
                            flags=VARIANTS["ls_deferred"]["flags"] + ["--ls-async-stats"])
# several GPUs: ls_ runs fix batches to GPUs by default (fairseq_patches, patch 7);
# ls_fairseq_order turns that off (fairseq's dealing), and ls_grouped_fairseq passes fairseq's own
# --grouped-shuffling instead (length-grouped updates; it also rebuilds the batches every epoch).
# On one GPU each is the same run as ls (or the baseline), whose figure bench/multi_gpu.py reuses
VARIANTS["ls_fairseq_order"] = dict(_LS, single_gpu_as="ls", flags=["--ls-no-fix-batches-to-gpus"])
VARIANTS["ls_grouped_fairseq"] = dict(_LS, single_gpu_as="ls", flags=["--grouped-shuffling"])
# several GPUs: ls_ all-reduces the gradient buckets by copy engines by default
# (distributed/peer_all_reduce.py); ls_nccl_all_reduce keeps NCCL's all-reduce (same run on one GPU)
VARIANTS["ls_nccl_all_reduce"] = dict(_LS, single_gpu_as="ls",
                                      flags=["--ls-no-copy-engine-all-reduce"])
# several GPUs: the gradient buckets' size (--ls-all-reduce-bucket-mb, 25 by default); the same
# run as ls on one GPU
for _mb in (12, 50, 100):
    VARIANTS[f"ls_bucket_{_mb}"] = dict(_LS, single_gpu_as="ls",
                                        flags=["--ls-all-reduce-bucket-mb", str(_mb)])
# several GPUs: an update's batches matched by cost in runs of 16 updates
# (--ls-cost-matching-window, fairseq_patches, patch 7; same run as ls on one GPU)
VARIANTS["ls_matched"] = dict(_LS, single_gpu_as="ls", flags=["--ls-cost-matching-window", "16"])
# several GPUs: the copy-engine all-reduce with its barriers as one kernel over flags in peer
# memory (LS_FAIRSEQ_PEER_BARRIER=flags) instead of NCCL's one-element all-reduces
VARIANTS["ls_flag_barrier"] = dict(_LS, single_gpu_as="ls", env={"LS_FAIRSEQ_PEER_BARRIER": "flags"})
# several GPUs: each GPU steps Adam on the gradient shards it sums by default
# (distributed/sharded_step.py); ls_whole_step runs the whole step on every GPU (same run on one
# GPU)
VARIANTS["ls_whole_step"] = dict(_LS, single_gpu_as="ls", flags=["--ls-no-sharded-optimizer-step"])
VARIANTS["baseline_nocudnn_grouped"] = dict(VARIANTS["baseline_nocudnn"],
                                            single_gpu_as="baseline_nocudnn",
                                            flags=["--grouped-shuffling"])
# the recommended flags with one attention backend forced (LS_FAIRSEQ_ATTENTION), for A/B runs;
# ls_deferred itself runs auto, which is short wherever rows are <= 128
VARIANTS["ls_deferred_short"] = dict(VARIANTS["ls_deferred"], env={"LS_FAIRSEQ_ATTENTION": "short"})
VARIANTS["ls_deferred_efficient"] = dict(VARIANTS["ls_deferred"],
                                         env={"LS_FAIRSEQ_ATTENTION": "efficient"})


def train_cmd(data, variant, max_tokens, epochs, seed, extra):
    """fairseq-train's command line of ``variant`` (the recipe in the module docstring)."""
    v = VARIANTS[variant]
    cmd = env.fairseq_cmd(
        "train", data, "--arch", v["arch"], "--share-all-embeddings",
        "--optimizer", v["optimizer"], "--adam-betas", "(0.9, 0.98)", "--clip-norm", "0.0",
        "--lr", "7e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4000",
        "--warmup-init-lr", "1e-07", "--dropout", "0.3", "--weight-decay", "0.0",
        "--criterion", v["criterion"], "--label-smoothing", "0.1", "--max-tokens", max_tokens,
        "--bf16" if v.get("bf16") else "--fp16", "--seed", seed, "--max-epoch", epochs,
        "--no-save", "--disable-validation", "--log-format", "json", "--log-interval", "10",
        "--num-workers", "2", "--required-batch-size-multiple", "8")
    if v["arch"].startswith("ls_"):
        cmd += ["--user-dir", env.USER_DIR]
    cmd += v.get("flags", [])
    return cmd + list(extra)


def train_env(variant, **probes):
    """The environment of a variant's fairseq-train run: its probes (cuDNN attention as the
    variant says, the memory sampler, the clock stamps; benchlib/probes) and its own settings."""
    e = env.train_env(BENCH_CUDNN_SDPA="1" if VARIANTS[variant]["cudnn_sdpa"] else "0",
                      BENCH_MEMORY="1", BENCH_STAMPS="1", **probes)
    if variant.startswith("ls"):
        e.setdefault("LS_FAIRSEQ_KERNELS", "require")
    e.update(VARIANTS[variant].get("env", {}))
    return e


def mfu(wps, peak_tflops):
    return wps * FLOP_PER_TOKEN / (peak_tflops * 1e12)


def stamped(inner, ends) -> bool:
    """True when the stamps pair up with fairseq's logged intervals (one each)."""
    return ends is not None and len(ends) == len(inner)


def interval_wps(inner, epoch, ends=None):
    """Tokens/s over the logged intervals of one epoch, leaving out its first interval (it spans
    the end-of-epoch work: iterator and data-loader restart, a few seconds). On this small corpus
    an epoch at 32768 tokens is ~55 updates and that restart is ~20% of the epoch's time; on
    WMT14 an epoch is thousands of updates.

    With ``ends`` (one per logged interval, ``logs.interval_ends``), each interval is timed from
    the previous interval's end to its own, and holds wpb x its updates tokens: the intervals then
    cover the run's time without gaps. Without them (or when they do not pair up with the
    intervals), fairseq's own interval figures, which leave out the wait for the GPU work still
    queued at each log: with no per-update host sync (``--ls-deferred-overflow-check``) that is
    the last update's backward and optimizer step, about 0.7 of an update per log, so they read
    high."""
    if not stamped(inner, ends):
        rows = [s for s in inner if int(s.get("epoch", 0)) == epoch][1:]
        return logs.time_weighted_wps(rows) if rows else None
    from ls_fairseq.cli.compare import timed_tokens

    tokens, seconds = timed_tokens([[(int(s["num_updates"]), float(s["wpb"]), end)
                                     for s, end in zip(inner, ends)
                                     if int(s.get("epoch", 0)) == epoch]])
    return tokens / seconds if seconds > 0 else None


def run_failure(returncode, log):
    """Why a fairseq-train run does not count, or None. On one GPU fairseq's trainer catches an
    out-of-memory error in the forward or backward, skips that batch and goes on, so a batch size
    that does not fit can still exit 0: a run with skipped batches is reported as OOM (the
    largest --max-tokens that fits is the largest without any)."""
    skipped = log.count("attempting to recover from OOM")
    if skipped:
        return f"OOM ({skipped} batches skipped)"
    if returncode != 0:
        return "OOM" if "out of memory" in log.lower() else log[-1500:]
    return None


def row_of_log(log, variant, max_tokens, peak_tflops):
    """One run's row from its log: throughput per epoch and over the steady intervals, memory,
    MFU, the loss curve (the module docstring names the fields)."""
    from ls_fairseq.cli.compare import holds_skipped_update

    run = logs.parse(log)
    inner, epochs = run.inner, run.epochs
    mem = next(iter(logs.memory(log)), {})
    peak = logs.peak_allocated_gb(run, mem.get("total_bytes"))
    row = {"variant": variant, "max_tokens": max_tokens, "peak_gb": peak,
           "reserved_gb": mem["reserved_max_bytes"] / logs.GIB if mem else None,
           "device_gb": mem["used_max_bytes"] / logs.GIB if mem else None}
    row["wps_by_epoch"] = [epochs[e]["wps"] for e in sorted(epochs)]
    row["updates_through_epoch"] = [int(epochs[e]["num_updates"]) for e in sorted(epochs)]
    last = max(epochs, default=2)
    for e, key in ((1, "unseen"), (last, "steady")):
        if e in epochs:
            row[f"wps_{key}"] = epochs[e]["wps"]
            row[f"ups_{key}"] = epochs[e]["ups"]
            row[f"updates_{key}"] = int(epochs[e]["num_updates"]) - (
                int(epochs[e - 1]["num_updates"]) if e > 1 and e - 1 in epochs else 0)
    if epochs:
        ends = logs.interval_ends(log)
        row["wps_steady_intervals"] = interval_wps(inner, last, ends)
        row["intervals_timed"] = stamped(inner, ends)  # else fairseq's own interval figures
        row["wps_steady_intervals_fairseq"] = interval_wps(inner, last)
        row["mfu_steady_intervals"] = mfu(row["wps_steady_intervals"] or 0, peak_tflops)
    row["mfu_steady"] = mfu(row.get("wps_steady", 0), peak_tflops)
    # what ls_ runs log themselves (ls_fairseq/flops.py: the architecture's FLOPs of the real
    # tokens over fairseq's epoch clock, against the GPU's dense 16-bit peak)
    for e, key in ((1, "unseen"), (last, "steady")):
        for field in ("tflops", "mfu"):
            if e in epochs and epochs[e].get(field) is not None:
                row[f"logged_{field}_{key}"] = epochs[e][field]
    losses = [s for s in inner if s.get("loss") is not None]
    row["loss_first"] = losses[0]["loss"] if losses else None
    row["loss_last"] = losses[-1]["loss"] if losses else None
    row["loss_by_update"] = {int(s["num_updates"]): s["loss"] for s in losses}
    # intervals holding an update that overflowed (logged only with --ls-deferred-overflow-check)
    row["skipped_update_intervals"] = [int(s["num_updates"]) for s in inner
                                       if holds_skipped_update(s.get("gnorm") or 0.0)]
    row["fp16_overflows"] = log.count("gradient overflow detected")
    return row


def run_variant(data, variant, max_tokens, args, log_dir, profile_at=None, extra=()):
    probes = {}
    if profile_at is not None:
        probes = dict(BENCH_PROFILE_AT=profile_at,
                      BENCH_PROFILE_OUT=os.path.join(log_dir,
                                                     f"profile_{variant}_{max_tokens}.json"))
    cmd = train_cmd(data, variant, max_tokens, args.epochs, args.seed,
                    list(args.extra) + list(extra))
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=train_env(variant, **probes))
    wall = time.time() - start
    log = proc.stdout + proc.stderr
    tag = "profile" if profile_at is not None else "train"
    seed = "" if args.seed == 1 else f"_seed{args.seed}"  # runs of several seeds share log_dir
    with open(os.path.join(log_dir, f"{tag}_{variant}_{max_tokens}{seed}.log"), "w") as f:
        f.write(log)
    failure = run_failure(proc.returncode, log)
    if failure:
        return {"variant": variant, "max_tokens": max_tokens, "error": failure}
    if profile_at is not None:
        found = re.findall(r"BENCH_PROFILE (\{.*\})", log)
        return {"variant": variant, "max_tokens": max_tokens,
                "profile": json.loads(found[-1]) if found else None}
    return dict(row_of_log(log, variant, max_tokens, args.peak_tflops), wall_s=wall)


def largest_that_fits(fits, low, high, step):
    """(largest, smallest_not_fitting) over the multiples of ``step`` in [low, high], for a
    ``fits(n)`` that holds up to some size and not above it: (None, low) when ``low`` does not
    fit, (high, None) when ``high`` does. Bisection: at most ~log2((high - low) / step) + 2
    probes, each a full training run."""
    if low % step or high % step or not 0 < low <= high:
        raise ValueError(f"--largest needs 0 < LOW <= HIGH, both multiples of STEP; got {low} "
                         f"{high} {step}")
    if not fits(low):
        return None, low
    if fits(high):
        return high, None
    good, bad = low, high
    while bad - good > step:
        mid = good + (bad - good) // step // 2 * step
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good, bad


def largest_markdown(found):
    lines = ["Largest --max-tokens that fits (no batch skipped for lack of memory):", "",
             "| variant | largest that fits | smallest tried that does not |", "|---|---|---|"]
    for variant, (good, bad) in found.items():
        lines.append(f"| {variant} | {fmt(good, 'd')} | {fmt(bad, 'd')} |")
    return "\n".join(lines)


def fmt(x, spec):
    return "–" if x is None else format(x, spec)


def markdown(rows):
    """Steady state is quoted three ways: fairseq's figure for the whole last epoch, the logged
    intervals of that epoch without the one spanning the epoch boundary, timed end to end
    (interval_wps with the stamps; the MFU and the steady ratio use it; marked * where the run
    has no stamps and fairseq's interval figures stand in), and fairseq's own figure for the same
    intervals (which reads high without a per-update host sync)."""
    lines = ["| max-tokens | variant | wps unseen (epoch 1) | wps steady (last epoch) | "
             "wps steady (intervals) | fairseq's interval wps | wps per epoch | upd/s steady | "
             "peak mem GB | reserved / device GB | MFU steady (intervals) | "
             "logged TFLOP/s / MFU steady | ls_/best-baseline unseen | ls_/best-baseline steady (intervals) | "
             "mem ls_/baseline | device ls_/baseline |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by_mt = {}
    for r in rows:
        by_mt.setdefault(r["max_tokens"], {})[r["variant"]] = r
    for mt, group in sorted(by_mt.items()):
        bases = [group[k] for k in ("baseline", "baseline_nocudnn") if k in group and "error" not in group[k]]
        best_u = max((b.get("wps_unseen", 0) for b in bases), default=None)
        best_s = max((b.get("wps_steady_intervals") or 0 for b in bases), default=None)
        base_mem = next((b.get("peak_gb") for b in bases), None)
        base_dev = next((b.get("device_gb") for b in bases), None)
        for name, r in group.items():
            if "error" in r:
                lines.append(f"| {mt} | {name} | {r['error'][:40]!r} | | | | | | | | | | | | | |")
                continue
            ratio_u = ratio_s = mem = dev = None
            if name.startswith("ls") and best_u:
                ratio_u = r.get("wps_unseen", 0) / best_u
                ratio_s = (r.get("wps_steady_intervals") or 0) / best_s if best_s else None
                mem = r["peak_gb"] / base_mem if base_mem and r.get("peak_gb") else None
                dev = r["device_gb"] / base_dev if base_dev and r.get("device_gb") else None
            lines.append(
                f"| {mt} | {name} | {fmt(r.get('wps_unseen'), ',.0f')} | {fmt(r.get('wps_steady'), ',.0f')} | "
                f"{fmt(r.get('wps_steady_intervals'), ',.0f')}"
                f"{'' if r.get('intervals_timed', True) else '*'} | "
                f"{fmt(r.get('wps_steady_intervals_fairseq'), ',.0f')} | "
                f"{' / '.join(format(w, ',.0f') for w in r.get('wps_by_epoch', []))} | "
                f"{fmt(r.get('ups_steady'), '.2f')} | {fmt(r.get('peak_gb'), '.1f')} | "
                f"{fmt(r.get('reserved_gb'), '.1f')} / {fmt(r.get('device_gb'), '.1f')} | "
                f"{fmt(r.get('mfu_steady_intervals'), '.1%')} | "
                f"{fmt(r.get('logged_tflops_steady'), '.0f')} / {fmt(r.get('logged_mfu_steady'), '.1f')}"
                f"{'%' if r.get('logged_mfu_steady') is not None else ''} | "
                f"{fmt(ratio_u, '.2f')}× | "
                f"{fmt(ratio_s, '.2f')}× | {fmt(mem, '.2f')} | {fmt(dev, '.2f')} |"
                .replace("–×", "–"))
    return "\n".join(lines)


def fidelity_markdown(rows, curve_from=None):
    """The loss curve of each run against the first baseline of its --max-tokens (the rows of
    ``ls-fairseq-compare``): the mean and s.d. of their interval losses' differences at the
    updates both logged from ``curve_from`` on, and each run's largest interval loss jump over
    its 10 neighbouring intervals, with its fp16 overflow count. As there, intervals holding an
    update that overflowed (which fairseq does not log) are left out, and counted."""
    from ls_fairseq.cli.compare import CURVE_FROM, largest_jump, loss_curve, loss_difference

    curve_from = CURVE_FROM if curve_from is None else curve_from
    lines = [f"Loss curves, intervals from update {curve_from} on (as `ls-fairseq-compare`):", "",
             "| max-tokens | variant | intervals vs baseline | loss − baseline, mean | s.d. | "
             "largest jump over neighbours (update) | fp16 overflows | intervals left out |",
             "|---|---|---|---|---|---|---|---|"]
    by_mt = {}
    for r in rows:
        if "error" not in r and r.get("loss_by_update"):
            by_mt.setdefault(r["max_tokens"], []).append(r)
    for mt, group in sorted(by_mt.items()):
        curves, left_out = [], []
        for r in group:
            skip = {int(u) for u in r.get("skipped_update_intervals", ())}
            curve, n = loss_curve(((int(u), v, int(u) in skip)
                                   for u, v in r["loss_by_update"].items()), curve_from)
            curves.append(curve)
            left_out.append(n)
        base = next((c for r, c in zip(group, curves) if r["variant"].startswith("baseline")), None)
        for r, curve, n_left_out in zip(group, curves, left_out):
            mean = sd = n = None
            if base is not None and curve is not base:
                mean, sd, n = loss_difference(base, curve)
            jump, at = largest_jump(curve)
            lines.append(f"| {mt} | {r['variant']} | {fmt(n, 'd')} | {fmt(mean, '+.4f')} | "
                         f"{fmt(sd, '.4f')} | {fmt(jump, '+.3f')} ({fmt(at, 'd')}) | "
                         f"{fmt(r.get('fp16_overflows'), 'd')} | "
                         f"{n_left_out} |")
    return "\n".join(lines)


def profile_markdown(profiles):
    if not profiles:
        return ""
    lines = ["| variant | ms/update | GPU busy | GEMM | attention | other kernels | memcpy/set | "
             "GPU idle | kernels/update |", "|---|---|---|---|---|---|---|---|---|"]
    for p in profiles:
        s = p.get("profile")
        if not s:
            lines.append(f"| {p['variant']} | (no profile: {p.get('error', '?')[:60]!r}) |||||||")
            continue
        c = s["ms_per_step_by_category"]
        lines.append(f"| {p['variant']} ({s.get('target_tokens_per_step', 0):,.0f} target tokens) | {s['wall_ms_per_step']:.1f} | {s['gpu_busy_ms_per_step']:.1f} | "
                     f"{c['gemm']:.1f} | {c['attention']:.1f} | {c['other']:.1f} | "
                     f"{c['memcpy/memset']:.1f} | {s['gpu_idle_ms_per_step']:.1f} | "
                     f"{s['kernel_launches_per_step']:.0f} |")
    for p in profiles:
        if p.get("profile"):
            lines.append(f"\nTop kernels, {p['variant']} (ms/update): " + "; ".join(
                f"{n} {v:.2f}" for n, v in p["profile"]["top_kernels_ms_per_step"][:8]))
            if p["profile"].get("idle_gaps_top"):
                lines.append(f"\nGPU idle gaps >= 20 us, {p['variant']} (kernel before -> after: ms/update, "
                             f"count, longest ms): " + "; ".join(
                                 f"{k} {t:.3f}, {n}, {m:.3f}" for k, t, n, m in p["profile"]["idle_gaps_top"][:8]))
            if "host_ms_per_step_by_phase" in p["profile"]:
                s = p["profile"]
                lines.append(f"\nHost ms/update, {p['variant']}: " + "; ".join(
                    f"{k} {v:.1f}" for k, v in s["host_ms_per_step_by_phase"].items())
                    + f"; blocked on the GPU {s['host_wait_ms_per_step']:.1f}. Top host ops: "
                    + "; ".join(f"{n} {v:.2f} ({c:.0f}x)" for n, v, c in s["top_host_ops_ms_per_step"][:10]))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=None,
                    help="corpus and logs (default /tmp/ls_bench_e2e_<corpus>_<sentences>)")
    ap.add_argument("--sentences", type=int, default=40000, help="training pairs (sets the epoch length)")
    ap.add_argument("--corpus", choices=("learnable", "zipf"), default="learnable",
                    help="learnable: the learnable corpus's sentences in WMT-length lines (the "
                         "loss falls); zipf: random Zipf tokens over --vocab types (it does not)")
    ap.add_argument("--vocab", type=int, default=32000, help="--corpus zipf: token types")
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--largest", type=int, nargs=3, metavar=("LOW", "HIGH", "STEP"), default=None,
                    help="instead of --max-tokens: per variant, the largest multiple of STEP in "
                         "[LOW, HIGH] that fits (bisection over full runs)")
    ap.add_argument("--variants", default="baseline,baseline_nocudnn,ls")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--peak-tflops", type=float, default=800.0)
    ap.add_argument("--profile", action="store_true",
                    help="also profile 5 updates of --profile-variants at the first --max-tokens, in "
                         "separate runs that stop after the profiled updates")
    ap.add_argument("--profile-variants", default="baseline_nocudnn,ls")
    ap.add_argument("--profile-epoch", type=int, default=1,
                    help="profile from the 20th update of this epoch (e.g. the last one, where "
                         "ls_graphs replays); its start comes from the variant's training run")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("extra", nargs="*", help="extra fairseq-train flags (after --)")
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants.split(",") + args.profile_variants.split(",")
               if v and v not in VARIANTS]
    if unknown:
        ap.error(f"--variants/--profile-variants: unknown {unknown}; choose from "
                 f"{sorted(VARIANTS)}")

    args.workdir = args.workdir or f"/tmp/ls_bench_e2e_{args.corpus}_{args.sentences}"
    log_dir = args.log_dir or os.path.join(args.workdir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    command = "python bench/e2e.py " + " ".join(sys.argv[1:] if argv is None else argv)
    head = results.header("bench/e2e.py", f"end-to-end training throughput, variants "
                          f"{args.variants}, --max-tokens "
                          f"{' '.join(map(str, args.max_tokens))}, {args.corpus} corpus of "
                          f"{args.sentences} pairs, {args.epochs} epochs", command)
    t0 = time.time()
    mean_len = None
    if not os.path.exists(os.path.join(args.workdir, "train.en")):
        mean_len = (corpora.write_learnable_wmt(args.workdir, args.sentences)
                    if args.corpus == "learnable" else
                    corpora.write_zipf(args.workdir, args.sentences, args.vocab))
    data = corpora.preprocess(args.workdir, args.workers)
    print(f"corpus ready in {time.time() - t0:.0f}s (mean source length {mean_len})", flush=True)

    gemm = [env.gemm_tflops()]
    print(f"fp16 GEMM rate: {fmt(gemm[0], '.0f')} TFLOP/s", flush=True)
    rows = []

    def run(variant, mt):
        r = run_variant(data, variant, mt, args, log_dir)
        rows.append(r)
        print(json.dumps(r), flush=True)
        return r

    found = {}
    if args.largest:
        def fits(variant, mt):
            r = run(variant, mt)
            if "error" in r and not r["error"].startswith("OOM"):
                raise SystemExit(f"{variant} at --max-tokens {mt} failed for another reason than "
                                 f"memory:\n{r['error']}")
            return "error" not in r

        for variant in args.variants.split(","):
            found[variant] = largest_that_fits(lambda mt: fits(variant, mt), *args.largest)
            print(f"{variant}: largest that fits {found[variant][0]}, smallest that does not "
                  f"{found[variant][1]}", flush=True)
    else:
        for mt in args.max_tokens:
            for variant in args.variants.split(","):
                run(variant, mt)
    profiles = []
    if args.profile:
        profile_steps = int(os.environ.get("BENCH_PROFILE_STEPS", "5"))  # the probe's default
        for variant in args.profile_variants.split(","):
            trained = next((r for r in rows if r["variant"] == variant
                            and r["max_tokens"] == args.max_tokens[0] and "error" not in r), {})
            # updates done before each epoch: 0, then the count at the end of each epoch
            starts = [0] + trained.get("updates_through_epoch", [])
            at = (starts[args.profile_epoch - 1] if args.profile_epoch <= len(starts) else 0) + 20
            p = run_variant(data, variant, args.max_tokens[0], args, log_dir, profile_at=at,
                            extra=["--max-update", str(at + profile_steps + 3 + PROFILE_PY_STEPS)])
            p["profile_at"] = at
            profiles.append(p)
            print(json.dumps(p), flush=True)
    gemm.append(env.gemm_tflops())

    table = markdown(rows) + "\n\n" + fidelity_markdown(rows)
    if found:
        table += "\n\n" + largest_markdown(found)
    header = (f"Device: {head['device']}; date: {head['date']}; commit: {head['commit']}; torch "
              f"{head['torch']}\n\nCommand: `{command}`\n\n"
              f"fp16 GEMM rate of this GPU in this call (8192³ matmul, before / after the runs): "
              f"{fmt(gemm[0], '.0f')} / {fmt(gemm[1], '.0f')} TFLOP/s; the MFU column uses "
              f"--peak-tflops {args.peak_tflops:.0f}\n")
    prof_md = profile_markdown(profiles)
    print("\n" + header + "\n" + table + "\n\n" + prof_md)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(header + "\n" + table + "\n\n" + prof_md + "\n")
    if args.json and rows:
        results.write(args.json, head, rows, gemm_tflops=gemm, largest=found, profiles=profiles,
                      corpus=args.corpus, sentences=args.sentences, epochs=args.epochs)
    return rows


if __name__ == "__main__":
    main()
