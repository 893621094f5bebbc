#!/usr/bin/env python3
"""End-to-end training throughput: fairseq's transformer vs ls_transformer, real fairseq-train.

On a GPU machine this script
  1. builds a synthetic corpus shaped like WMT14 en-de after joined BPE (lognormal line
     lengths, mean ~29 tokens, tail to 250) that a model can learn: lines of
     ``bench/learnable_corpus.py`` sentences (a deterministic transduction, ~22k joined word
     types), so every run also shows a falling loss (``--corpus zipf``: random Zipf tokens over a
     ~32k vocabulary, whose loss stops at the unigram entropy; the corpus of the figures before
     2026-11-26),
  2. binarises it with fairseq-preprocess,
  3. runs fairseq-train for every variant and --max-tokens, --epochs (2) epochs each: epoch 1
     sees every batch shape for the first time ("unseen shapes"), the last epoch repeats them
     ("steady state"),
  4. prints a markdown table (wps unseen/steady, updates/s, peak memory, MFU, ls_/baseline ratio)
     and a loss-curve table (each run's interval losses against the first baseline's of its
     --max-tokens, and its largest loss spike: ``ls-fairseq-compare``'s statistics), and writes
     them, with device, date, commit and command, to --markdown.

Variants: ``baseline`` (transformer_wmt_en_de_big_t2t, label_smoothed_cross_entropy, adam),
``baseline_nocudnn`` (the same with cuDNN SDPA disabled, the best baseline a careful user gets by
a setting: no per-shape plan cost), ``ls`` (the ls_ twins, with ls_adam's
``--ls-fused-fp16-copy``), ``ls_graphs`` (``ls`` plus ``--ls-cuda-graphs``: batches are
padded to bucketed shapes, each captured at its first sighting and replayed from then on),
``ls_deferred`` (``ls_graphs`` plus ls_adam's ``--ls-deferred-overflow-check``: no update waits
for the GPU; ``ls_deferred_second`` the same with ``--ls-cuda-graphs-capture second-sighting``,
a shape's first sighting eager; ``ls_deferred_grow`` with ``--ls-cuda-graphs-memory grow``, the
allocator's default memory management for the graphs; ``ls_deferred_nobuckets`` with ``--ls-shape-buckets 0``, one
graph per batch shape, captured at its second sighting, so the steady state of the default
corpus needs a third epoch: --epochs 3), ``ls_plain_fp16`` (the ls_ twins
under fairseq's own FP16Optimizer). Same data, seed, hyperparameters
(Ott et al. 2018: adam betas (0.9, 0.98), inverse_sqrt, warmup 4000, dropout 0.3, label
smoothing 0.1, shared embeddings), --fp16.

    python bench/e2e.py --max-tokens 8192 --markdown $OUT/e2e.md --json $OUT/e2e.json

The default corpus (40k pairs, 190 batches at 8192 tokens) meets each batch shape once per epoch;
``--sentences 400000 --epochs 1`` gives a first epoch closer to a real corpus's (1,666 batches, whose
shapes and padded shapes repeat within the epoch, ``bench/shape_buckets.py``).

``--largest LOW HIGH STEP`` finds, per variant, the largest --max-tokens (a multiple of STEP in
[LOW, HIGH]) whose run fits: no batch skipped for lack of memory, over the whole --epochs (the
worst batch of an epoch sets the peak, so short runs do not tell). A bisection, each probe a full
run; the rows of every probe land in the tables, and a last table names each variant's largest
size that fits and the smallest that did not.

    python bench/e2e.py --sentences 200000 --epochs 1 --largest 32768 163840 8192 \
        --variants baseline_nocudnn,ls_deferred

MFU counts 1.27 GFLOP per target token (transformer big, forward + backward) against the dense
fp16 matrix rate --peak-tflops (800, the issue's figure for the H100); each call also measures the
GPU's 8192^3 fp16 matmul rate and prints it in the table's header.
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

import learnable_corpus
import profile_summary

FLOP_PER_TOKEN = 1.27e9
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
from ls_fairseq.cli.compare import (  # noqa: E402
    CURVE_FROM, holds_skipped_update, largest_jump, loss_curve, loss_difference, timed_tokens)

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
# (ls_fairseq/distributed_stats.py); the flag does nothing on one GPU, whose figure is reused
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
# (graphs/peer_all_reduce.py); ls_nccl_all_reduce keeps NCCL's all-reduce (same run on one GPU)
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
# (graphs/sharded_step.py); ls_whole_step runs the whole step on every GPU (same run on one GPU)
VARIANTS["ls_whole_step"] = dict(_LS, single_gpu_as="ls", flags=["--ls-no-sharded-optimizer-step"])
VARIANTS["baseline_nocudnn_grouped"] = dict(VARIANTS["baseline_nocudnn"],
                                            single_gpu_as="baseline_nocudnn",
                                            flags=["--grouped-shuffling"])
# the recommended flags with one attention backend forced (LS_FAIRSEQ_ATTENTION), for A/B runs;
# ls_deferred itself runs auto, which is short wherever rows are <= 128
VARIANTS["ls_deferred_short"] = dict(VARIANTS["ls_deferred"], env={"LS_FAIRSEQ_ATTENTION": "short"})
VARIANTS["ls_deferred_efficient"] = dict(VARIANTS["ls_deferred"],
                                         env={"LS_FAIRSEQ_ATTENTION": "efficient"})


def wmt_like_lengths(rng, n):
    """Source and target lengths in subwords (before fairseq's end-of-sentence token) shaped
    like WMT14 en-de after joined BPE: lognormal, mean ~29, tail to 250."""
    src_len = np.clip(np.round(rng.lognormal(mean=3.15, sigma=0.62, size=n)), 1, 250).astype(int)
    tgt_len = np.clip(np.round(src_len * rng.normal(1.08, 0.15, size=n)), 1, 250).astype(int)
    return src_len, tgt_len


def make_corpus(workdir, sentences, vocab, seed=1, learnable=True):
    """WMT14-like lengths, as fairseq-preprocess input text. ``learnable``: lines of
    ``learnable_corpus`` sentences (a deterministic transduction with ~22k joined word types,
    so the loss falls as the model learns it); otherwise random Zipf tokens over ``vocab`` types
    (the loss stops at their unigram entropy)."""
    rng = np.random.default_rng(seed)
    os.makedirs(workdir, exist_ok=True)
    if learnable:
        gen = learnable_corpus.Generator(learnable_corpus.Lexicon(), rng)
        lengths = []
        for split, n in (("train", sentences), ("valid", 500)):
            src_len, _ = wmt_like_lengths(rng, n)
            pairs = learnable_corpus.write_split(
                workdir, split, (gen.line_of_length(int(length)) for length in src_len))
            lengths += [len(s.split()) for s, _ in pairs]
        return float(np.mean(lengths))
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    p = 1.0 / ranks**1.05
    p /= p.sum()
    for split, n in (("train", sentences), ("valid", 500)):
        src_len, tgt_len = wmt_like_lengths(rng, n)
        for side, lengths in (("en", src_len), ("de", tgt_len)):
            tokens = rng.choice(vocab, size=int(lengths.sum()), p=p)
            words = np.char.add("t", tokens.astype(str))
            with open(os.path.join(workdir, f"{split}.{side}"), "w") as f:
                start = 0
                for length in lengths:
                    f.write(" ".join(words[start:start + length]) + "\n")
                    start += length
    return float(src_len.mean())


def preprocess(workdir, workers, src="en", tgt="de"):
    """Binarises ``workdir/{train,valid[,test]}.{src,tgt}`` into ``workdir/bin`` (joined
    dictionary; test when its file exists) unless that was done already; returns the folder."""
    dest = os.path.join(workdir, "bin")
    if os.path.exists(os.path.join(dest, f"dict.{src}.txt")):
        return dest
    test = os.path.join(workdir, "test")
    subprocess.run(
        [sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", src, "--target-lang",
         tgt, "--trainpref", os.path.join(workdir, "train"), "--validpref",
         os.path.join(workdir, "valid"), "--destdir", dest, "--joined-dictionary",
         "--workers", str(workers)] + (
             ["--testpref", test] if os.path.exists(f"{test}.{src}") else []),
        check=True, capture_output=True,
    )
    return dest


# Runs fairseq-train in this interpreter, then prints the peak allocated memory. Optional: switch
# off cuDNN SDPA, and profile a window of steady-state updates (bench/profile_summary.py).
WRAPPER = r"""
import os, sys, atexit, torch
if os.environ.get("BENCH_CUDNN_SDPA") == "0":
    torch.backends.cuda.enable_cudnn_sdp(False)
# fairseq resets the peak counter at every log interval and logs gb_free = total - peak since
# the last reset; the peak of the run is total - min(gb_free)
if torch.cuda.is_available():  # (tests run the wrapper on CPU)
    print("BENCH_TOTAL_BYTES", torch.cuda.get_device_properties(0).total_memory, flush=True)
# fairseq's figure is allocated memory. What the process holds is more: the allocator's cache,
# the CUDA graphs' private pool (--ls-cuda-graphs), the graphs themselves, the CUDA context.
# Sampled where fairseq resets its peak counter (every update), every 10th call.
_held = [0, 0, 0]  # calls, max memory_reserved, max device memory used (total - free)
_reset = torch.cuda.reset_peak_memory_stats
def _reset_and_sample(*a, **k):
    _held[0] += 1
    if _held[0] % 10 == 1:
        free, total = torch.cuda.mem_get_info()
        _held[1] = max(_held[1], torch.cuda.memory_reserved())
        _held[2] = max(_held[2], total - free)
    return _reset(*a, **k)
if torch.cuda.is_available():
    torch.cuda.reset_peak_memory_stats = _reset_and_sample
atexit.register(lambda: print("BENCH_HELD_BYTES", _held[1], _held[2], flush=True))
# fairseq reads an interval's wps before its gnorm. Without a per-update host sync
# (--ls-deferred-overflow-check) the GPU work still queued then (the last update's backward and
# optimizer step) is waited for while the gnorm is read, after the wps: that wait is in no
# interval's time. The time of each reset of the interval meters (after the whole log, waits
# included) splits the run without gaps.
import time
from fairseq.logging import metrics as _metrics
_reset_meters = _metrics.reset_meters
def _stamped_reset(name):
    if name == "train_inner":
        print("BENCH_INTERVAL_END", repr(time.perf_counter()), flush=True)
    return _reset_meters(name)
_metrics.reset_meters = _stamped_reset
if os.environ.get("BENCH_PROFILE_AT"):
    sys.path.insert(0, os.environ["BENCH_HERE"])
    import profile_summary
    profile_summary.install_from_env()
from fairseq_cli.train import cli_main
sys.argv[0] = "fairseq-train"
cli_main()
"""


# The fp16 matrix rate of this GPU, now, next to the call's figures: the baselines measured
# 72-101k wps at 8192 tokens in different calls, so the machine is one suspect when figures of
# two calls disagree (three H100 machines once gave 669-684 TFLOP/s). In a subprocess: the
# benchmark's own process must not hold a CUDA context while fairseq-train measures the largest
# batch that fits.
GEMM_PROBE = r"""
import torch
n, iters = 8192, 200
a = torch.randn(n, n, device="cuda", dtype=torch.float16)
b = torch.randn(n, n, device="cuda", dtype=torch.float16)
for _ in range(100):  # clocks up, cuBLAS heuristics chosen
    a @ b
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(iters):
    a @ b
end.record()
torch.cuda.synchronize()
print("BENCH_GEMM_TFLOPS", 2 * n**3 * iters / (start.elapsed_time(end) * 1e-3) / 1e12)
"""


def visible_gpus(n):
    """The first n GPUs of this process's CUDA_VISIBLE_DEVICES (0..n-1 when it is unset): the
    ones a run of n GPUs takes, so two benchmarks can run side by side on one host."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is None:
        return [str(i) for i in range(n)]
    return [d.strip() for d in given.split(",") if d.strip()][:n]


def gpu_names():
    """The GPUs' names from nvidia-smi, else from torch in a subprocess (this process holds no
    CUDA context while the runs measure memory), else ["cpu"]."""
    for cmd in (["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                [sys.executable, "-c", "import torch\nfor i in range(torch.cuda.device_count()):"
                                       " print(torch.cuda.get_device_name(i))"]):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        names = [l.strip() for l in out.splitlines() if l.strip()]
        if names:
            return names
    return ["cpu"]


def commit():
    # the device copy of the tree has no .git: the caller passes the commit in LS_BENCH_COMMIT
    if os.environ.get("LS_BENCH_COMMIT"):
        return os.environ["LS_BENCH_COMMIT"]
    try:
        git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        git = ""
    return (git or "unknown") + (" (from git, not LS_BENCH_COMMIT: on the device the tree's git "
                                 "state may be stale)")


def gemm_tflops():
    """Measured fp16 TFLOP/s of an 8192^3 matmul on this GPU, or None (no GPU, error)."""
    proc = subprocess.run([sys.executable, "-c", GEMM_PROBE], capture_output=True, text=True)
    found = re.findall(r"BENCH_GEMM_TFLOPS ([0-9.]+)", proc.stdout)
    return float(found[-1]) if found else None


def train_cmd(data, variant, max_tokens, epochs, seed, extra, wrapper=WRAPPER):
    v = VARIANTS[variant]
    cmd = [
        sys.executable, "-c", wrapper, data, "--arch", v["arch"], "--share-all-embeddings",
        "--optimizer", v["optimizer"], "--adam-betas", "(0.9, 0.98)", "--clip-norm", "0.0",
        "--lr", "7e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4000",
        "--warmup-init-lr", "1e-07", "--dropout", "0.3", "--weight-decay", "0.0",
        "--criterion", v["criterion"], "--label-smoothing", "0.1", "--max-tokens", str(max_tokens),
        "--bf16" if v.get("bf16") else "--fp16", "--seed", str(seed), "--max-epoch", str(epochs), "--no-save",
        "--disable-validation", "--log-format", "json", "--log-interval", "10",
        "--num-workers", "2", "--required-batch-size-multiple", "8",
    ]
    if v["arch"].startswith("ls_"):
        cmd += ["--user-dir", os.path.join(ROOT, "ls_fairseq")]
    cmd += v.get("flags", [])
    return cmd + list(extra)


STATS_LINE = re.compile(r"(?:\| |INFO:)(train_inner|train)(?: \| |:)(\{.*\})\s*$", re.M)


def log_records(text):
    """("train_inner" | "train", stats) for each json stats line of a fairseq-train log, in order:
    "... | INFO | train_inner | {...}" from fairseq-train, "INFO:train_inner:{...}" from the worker
    processes fairseq spawns for --distributed-world-size > 1 (default logging format)."""
    for m in STATS_LINE.finditer(text):
        yield m.group(1), json.loads(m.group(2))


def parse_log(text):
    inner, epochs = [], {}
    for kind, stats in log_records(text):
        if kind == "train_inner":
            inner.append(stats)
        else:  # end-of-epoch stats carry a "train_" prefix
            stats = {k[len("train_"):] if k.startswith("train_") else k: v for k, v in stats.items()}
            epochs[int(stats["epoch"])] = stats
    total = re.findall(r"BENCH_TOTAL_BYTES (\d+)", text)
    free = [float(s["gb_free"]) for s in inner if "gb_free" in s]
    peak = int(total[-1]) - min(free) * 2**30 if total and free else None
    held = re.findall(r"BENCH_HELD_BYTES (\d+) (\d+)", text)
    return inner, epochs, peak, (tuple(int(x) / 2**30 for x in held[-1]) if held else (None, None))


def time_weighted_wps(stats):
    """Tokens/s over logged intervals, each weighted by its time: sum(tokens) / sum(tokens / wps)."""
    return sum(float(s["wpb"]) for s in stats) / sum(float(s["wpb"]) / float(s["wps"]) for s in stats)


def mfu(wps, peak_tflops):
    return wps * FLOP_PER_TOKEN / (peak_tflops * 1e12)


INTERVAL_END = re.compile(r"^BENCH_INTERVAL_END ([0-9.e+-]+)\s*$", re.M)


def interval_ends(log):
    """The host clock (s) at the end of each logged interval, in order: WRAPPER stamps each reset
    of fairseq's interval meters, which follows the interval's whole log (so its waits too)."""
    return [float(t) for t in INTERVAL_END.findall(log)]


def stamped(inner, ends) -> bool:
    """True when the stamps pair up with fairseq's logged intervals (one each)."""
    return ends is not None and len(ends) == len(inner)


def interval_wps(inner, epoch, ends=None):
    """Tokens/s over the logged intervals of one epoch, leaving out its first interval (it spans
    the end-of-epoch work: iterator and data-loader restart, a few seconds). On this small corpus
    an epoch at 32768 tokens is ~55 updates and that restart is ~20% of the epoch's time; on
    WMT14 an epoch is thousands of updates.

    With ``ends`` (one per logged interval, ``interval_ends``), each interval is timed from the
    previous interval's end to its own, and holds wpb x its updates tokens: the intervals then
    cover the run's time without gaps. Without them (or when they do not pair up with the
    intervals, e.g. workers of a multi-GPU run log intervals the main process does not stamp),
    fairseq's own interval figures, which leave out the wait for the GPU work still queued at each
    log: with no per-update host sync (``--ls-deferred-overflow-check``) that is the last update's
    backward and optimizer step, about 0.7 of an update per log, so they read high (before the
    plugin waited for the GPU at logged updates, ls_ with the deferred check read +7% at 8192 tokens
    and --log-interval 10; fairseq's baseline, which syncs every update: within 2%)."""
    if not stamped(inner, ends):
        rows = [s for s in inner if int(s.get("epoch", 0)) == epoch][1:]
        return time_weighted_wps(rows) if rows else None
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


def train_env(variant):
    """The environment of a variant's fairseq-train run (train_cmd's wrapper reads it)."""
    env = dict(os.environ, BENCH_CUDNN_SDPA="1" if VARIANTS[variant]["cudnn_sdpa"] else "0",
               BENCH_HERE=HERE, PYTHONUNBUFFERED="1")
    if variant.startswith("ls"):
        env.setdefault("LS_FAIRSEQ_KERNELS", "require")
    env.update(VARIANTS[variant].get("env", {}))
    return env


def run_variant(data, variant, max_tokens, args, log_dir, profile_at=None, extra=()):
    env = train_env(variant)
    if profile_at is not None:
        env.update(BENCH_PROFILE_AT=str(profile_at),
                   BENCH_PROFILE_OUT=os.path.join(log_dir, f"profile_{variant}_{max_tokens}.json"))
    cmd = train_cmd(data, variant, max_tokens, args.epochs, args.seed, list(args.extra) + list(extra))
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - start
    log = proc.stdout + proc.stderr
    tag = "profile" if profile_at is not None else "train"
    seed = "" if args.seed == 1 else f"_seed{args.seed}"  # runs of several seeds share log_dir
    with open(os.path.join(log_dir, f"{tag}_{variant}_{max_tokens}{seed}.log"), "w") as f:
        f.write(log)
    failure = run_failure(proc.returncode, log)
    if failure:
        return {"variant": variant, "max_tokens": max_tokens, "error": failure}
    inner, epochs, peak, (reserved_gb, device_gb) = parse_log(log)
    if profile_at is not None:
        found = re.findall(r"BENCH_PROFILE (\{.*\})", log)
        return {"variant": variant, "max_tokens": max_tokens,
                "profile": json.loads(found[-1]) if found else None}
    row = {"variant": variant, "max_tokens": max_tokens, "wall_s": wall,
           "peak_gb": peak / 2**30 if peak else None, "reserved_gb": reserved_gb,
           "device_gb": device_gb}
    row["wps_by_epoch"] = [float(epochs[e]["wps"]) for e in sorted(epochs)]
    row["updates_through_epoch"] = [int(epochs[e]["num_updates"]) for e in sorted(epochs)]
    for e, key in ((1, "unseen"), (max(epochs, default=2), "steady")):
        if e in epochs:
            row[f"wps_{key}"] = float(epochs[e]["wps"])
            row[f"ups_{key}"] = float(epochs[e]["ups"])
            row[f"updates_{key}"] = int(epochs[e]["num_updates"]) - (int(epochs[e - 1]["num_updates"]) if e > 1 else 0)
    if epochs:
        ends = interval_ends(log)
        row["wps_steady_intervals"] = interval_wps(inner, max(epochs), ends)
        row["intervals_timed"] = stamped(inner, ends)  # else fairseq's own interval figures
        row["wps_steady_intervals_fairseq"] = interval_wps(inner, max(epochs))
        row["mfu_steady_intervals"] = mfu(row["wps_steady_intervals"] or 0, args.peak_tflops)
    row["mfu_steady"] = mfu(row.get("wps_steady", 0), args.peak_tflops)
    # what ls_ runs log themselves (ls_fairseq/flops.py: the architecture's FLOPs of the real
    # tokens over fairseq's epoch clock, against the GPU's dense 16-bit peak)
    for e, key in ((1, "unseen"), (max(epochs, default=2), "steady")):
        for field in ("tflops", "mfu"):
            if e in epochs and field in epochs[e]:
                row[f"logged_{field}_{key}"] = float(epochs[e][field])
    row["loss_first"] = float(inner[0]["loss"]) if inner else None
    row["loss_last"] = float(inner[-1]["loss"]) if inner else None
    row["loss_by_update"] = {int(s["num_updates"]): float(s["loss"]) for s in inner
                             if "loss" in s and "num_updates" in s}
    # intervals holding an update that overflowed (logged only with --ls-deferred-overflow-check)
    row["skipped_update_intervals"] = [int(s["num_updates"]) for s in inner if "num_updates" in s
                                       and holds_skipped_update(float(s.get("gnorm", 0)))]
    row["fp16_overflows"] = log.count("gradient overflow detected")
    return row


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


def fidelity_markdown(rows, curve_from=CURVE_FROM):
    """The loss curve of each run against the first baseline of its --max-tokens (the rows of
    ``ls-fairseq-compare``): the mean and s.d. of their interval losses' differences at the
    updates both logged from ``curve_from`` on, and each run's largest interval loss jump over
    its 10 neighbouring intervals, with its fp16 overflow count. As there, intervals holding an
    update that overflowed (which fairseq does not log) are left out, and counted."""
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=None,
                    help="corpus and logs (default /tmp/ls_bench_e2e_<corpus>_<sentences>)")
    ap.add_argument("--sentences", type=int, default=40000, help="training pairs (sets the epoch length)")
    ap.add_argument("--corpus", choices=("learnable", "zipf"), default="learnable",
                    help="learnable: bench/learnable_corpus.py sentences in WMT-length lines (the "
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
    args = ap.parse_args()

    args.workdir = args.workdir or f"/tmp/ls_bench_e2e_{args.corpus}_{args.sentences}"
    log_dir = args.log_dir or os.path.join(args.workdir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    t0 = time.time()
    mean_len = make_corpus(args.workdir, args.sentences, args.vocab,
                           learnable=args.corpus == "learnable") if not os.path.exists(
        os.path.join(args.workdir, "train.en")) else None
    data = preprocess(args.workdir, args.workers)
    print(f"corpus ready in {time.time() - t0:.0f}s (mean source length {mean_len})", flush=True)

    gemm = [gemm_tflops()]
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
        for variant in args.profile_variants.split(","):
            trained = next((r for r in rows if r["variant"] == variant
                            and r["max_tokens"] == args.max_tokens[0] and "error" not in r), {})
            # updates done before each epoch: 0, then the count at the end of each epoch
            starts = [0] + trained.get("updates_through_epoch", [])
            profile_steps = int(os.environ.get("BENCH_PROFILE_STEPS", "5"))  # profile_summary's
            at = (starts[args.profile_epoch - 1] if args.profile_epoch <= len(starts) else 0) + 20
            p = run_variant(data, variant, args.max_tokens[0], args, log_dir, profile_at=at,
                            extra=["--max-update", str(at + profile_steps + 3 + profile_summary.PY_STEPS)])
            p["profile_at"] = at
            profiles.append(p)
            print(json.dumps(p), flush=True)
    gemm.append(gemm_tflops())
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    run_commit = commit()
    table = markdown(rows) + "\n\n" + fidelity_markdown(rows)
    if found:
        table += "\n\n" + largest_markdown(found)
    header = (f"Device: {device}; date: {datetime.date.today()}; commit: {run_commit}; torch "
              f"{torch.__version__}\n\nCommand: `python bench/e2e.py {' '.join(sys.argv[1:])}`\n\n"
              f"fp16 GEMM rate of this GPU in this call (8192³ matmul, before / after the runs): "
              f"{fmt(gemm[0], '.0f')} / {fmt(gemm[1], '.0f')} TFLOP/s; the MFU column uses "
              f"--peak-tflops {args.peak_tflops:.0f}\n")
    prof_md = profile_markdown(profiles)
    print("\n" + header + "\n" + table + "\n\n" + prof_md)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(header + "\n" + table + "\n\n" + prof_md + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "commit": run_commit, "gemm_tflops": gemm, "rows": rows,
                       "largest": found, "profiles": profiles}, f, indent=1)


if __name__ == "__main__":
    main()
