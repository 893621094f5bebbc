#!/usr/bin/env python3
"""Multi-GPU checks through fairseq's own distributed engine (one process per GPU, NCCL).

1. Correctness: the ls_ model on N GPUs with --update-freq 1 and on 1 GPU with --update-freq N
   see the same batches per update (fairseq shards the batch list round-robin), so with dropout 0
   their per-update losses agree within fp16 noise; prints both curves and the largest gap.
2. The N-GPU run's checkpoint resumes on 1 GPU.
3. fairseq's other DDP backends (legacy_ddp, no_c10d) train the ls_ model on N GPUs.
4. Scaling: wps on N GPUs / wps on 1 GPU for ls_ and the fairseq baseline (cuDNN SDPA off) at each
   --max-tokens, all in this one call.

    python bench/multi_gpu.py --gpus 2 --max-tokens 8192 16384 --markdown $OUT/multi_gpu.md
    (--skip-correctness: only step 4; --skip-scaling: only steps 1-3)

Keeps NVLink multicast off (NCCL_NVLS_ENABLE=0) as the device machines require.
"""
import argparse
import functools
import json
import os
import re
import subprocess
import sys

import e2e
import profile_summary

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


LOG_DIR = os.environ.get("OUT", "/tmp")


def losses(log):
    return [(int(s["num_updates"]), float(s["loss"])) for s in e2e.parse_log(log)[0]]


def max_gap(a, b):
    pairs = list(zip(a, b))
    return max(abs(x[1] - y[1]) for x, y in pairs) if pairs else float("nan")


@functools.lru_cache(maxsize=None)
def _sitecustomize_dir():
    """fairseq starts one process per GPU (torch.multiprocessing.spawn): e2e's wrapper, which
    switches cuDNN SDPA off and installs the profiler, runs in the parent only. A sitecustomize
    on PYTHONPATH does both in every process."""
    d = "/tmp/mg_site"
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE)
    return d


_SITECUSTOMIZE = """\
import os, sys
if os.environ.get('BENCH_CUDNN_SDPA') == '0':
    import torch
    torch.backends.cuda.enable_cudnn_sdp(False)
if os.environ.get('BENCH_PROFILE_AT'):
    sys.path.insert(0, os.environ['BENCH_HERE'])
    import profile_summary
    profile_summary.install_from_env()
"""


def corpus(sentences, workers, workdir=None):
    """The binarised synthetic corpus of ``sentences`` pairs (made once per machine)."""
    if workdir is None:
        workdir = "/tmp/ls_bench_e2e" + ("" if sentences == 40000 else f"_{sentences}")
    if not os.path.exists(os.path.join(workdir, "train.en")):
        e2e.make_corpus(workdir, sentences, 32000)
    return e2e.preprocess(workdir, workers)


def train(data, variant, max_tokens, gpus, update_freq, updates, save_dir, extra=(),
          backend="pytorch_ddp", env_extra=None, epochs=100):
    cmd = e2e.train_cmd(data, variant, max_tokens, epochs, 1, list(extra))
    cmd.remove("--no-save")  # train_cmd's own; a caller that wants no checkpoints passes it
    cmd += ["--distributed-world-size", str(gpus), "--update-freq", str(update_freq),
            "--save-dir", save_dir, "--no-epoch-checkpoints", "--ddp-backend", backend]
    if updates:
        cmd += ["--max-update", str(updates)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(gpus)),
               BENCH_CUDNN_SDPA="1" if e2e.VARIANTS[variant]["cudnn_sdpa"] else "0",
               BENCH_HERE=e2e.HERE, PYTHONUNBUFFERED="1", LS_FAIRSEQ_KERNELS="require")
    env["PYTHONPATH"] = _sitecustomize_dir() + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log = proc.stdout + proc.stderr
    with open(os.path.join(save_dir, "train.log"), "w") as f:
        f.write(log)
    # keep every run's stats lines and the end of its log with the results (the device returns
    # $OUT only): the figures can be recomputed from them if the call is cut short
    with open(os.path.join(LOG_DIR, "multi_gpu_runs.log"), "a") as f:
        f.write(f"\n===== {' '.join(cmd[3:])} gpus={gpus} rc={proc.returncode}\n")
        lines = [l for l in log.splitlines() if "Warning" not in l]
        stats = [l for l in lines[:-40] if e2e.STATS_LINE.search(l)]
        f.write("\n".join(stats + lines[-40:])[-200000:])
    if proc.returncode != 0:
        raise RuntimeError(log[-3000:])
    return log


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--workdir", default=None,
                    help="corpus directory (default /tmp/ls_bench_e2e, or ..._<sentences> for "
                         "another --sentences)")
    ap.add_argument("--sentences", type=int, default=40000,
                    help="training pairs of the synthetic corpus: more pairs, longer epochs (fewer "
                         "epoch boundaries inside the measured updates)")
    ap.add_argument("--workers", type=int, default=8, help="fairseq-preprocess workers")
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--updates", type=int, default=100)
    ap.add_argument("--scaling-updates", type=int, default=120)
    ap.add_argument("--scaling-epochs", type=int, default=None,
                    help="run each scaling point this many epochs (log interval 5) instead of "
                         "--scaling-updates updates: on a small corpus (--sentences 10000) every "
                         "batch recurs often enough on each GPU for --ls-cuda-graphs to replay it, "
                         "as batch shapes recur within an epoch of a WMT14-sized corpus; the "
                         "second half of the run is measured")
    ap.add_argument("--scaling-variants",
                    default="baseline_nocudnn:pytorch_ddp,ls:pytorch_ddp,ls_graphs:legacy_ddp",
                    help="variant:ddp-backend[:epochs] (bench/e2e.py's variants; epochs overrides "
                         "--scaling-epochs, e.g. fewer for a variant without graphs)")
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
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    data = corpus(args.sentences, args.workers, args.workdir)
    out = []

    if not args.skip_correctness:
        out += correctness(data, args)
        print("\n".join(out), flush=True)
    if args.graphs_check:
        out.append(graphs_check(args))
        print(out[-1], flush=True)
    if args.profile:
        out.append(profiles(data, args))
        print(out[-1], flush=True)
    if not args.skip_scaling:
        out.append(scaling(data, args))
    text = "\n\n".join(out)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


def correctness(data, args):
    out = []
    # 1 + 2: correctness and resume, dropout off so the two runs are comparable update by update
    nodrop = ["--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0"]
    multi_dir, single_dir = "/tmp/mg_multi", "/tmp/mg_single"
    for d in (multi_dir, single_dir):
        os.makedirs(d, exist_ok=True)
    mt = args.max_tokens[0]
    multi = losses(train(data, "ls", mt, args.gpus, 1, args.updates, multi_dir, nodrop))
    single = losses(train(data, "ls", mt, 1, args.gpus, args.updates, single_dir, nodrop))
    gap = max_gap(multi, single)
    out.append(f"Correctness ({args.gpus} GPUs x update-freq 1 vs 1 GPU x update-freq {args.gpus}, "
               f"ls_, max-tokens {mt}, dropout 0, {args.updates} updates): largest loss gap {gap:.4f}")
    out.append("updates: " + " ".join(str(u) for u, _ in multi))
    out.append(f"loss {args.gpus} GPUs: " + " ".join(f"{l:.3f}" for _, l in multi))
    out.append("loss 1 GPU:   " + " ".join(f"{l:.3f}" for _, l in single))
    resumed = train(data, "ls", mt, 1, args.gpus, args.updates + 10, multi_dir, nodrop)
    ok = re.search(r"Loaded checkpoint .*@ %d updates" % args.updates, resumed) is not None
    out.append(f"{args.gpus}-GPU checkpoint resumed on 1 GPU: {'yes' if ok else 'NO'}")

    # 3: the other DDP backends
    for backend in ("legacy_ddp", "no_c10d"):
        d = f"/tmp/mg_{backend}"
        os.makedirs(d, exist_ok=True)
        try:
            curve = losses(train(data, "ls", mt, args.gpus, 1, 30, d, nodrop + ["--no-save"], backend))
            gap = max_gap(curve, multi)
            last = f"loss at {curve[-1][0]} updates {curve[-1][1]:.3f}" if curve else "no loss logged"
            out.append(f"--ddp-backend {backend}, {args.gpus} GPUs, 30 updates: trains; {last} "
                       f"(largest gap to pytorch_ddp {gap:.4f})")
        except (RuntimeError, IndexError) as e:
            out.append(f"--ddp-backend {backend}: FAILED: {str(e)[-300:]!r}")
    return ["\n".join(out)]


def graphs_check(args, sentences=4000, updates=100):
    """The CUDA-graphed step under legacy_ddp: the N-GPU run (flat all-reduce of the replayed
    gradients, ls_adam) and the 1-GPU run with update-freq N see the same batches per update;
    with dropout 0 their losses agree within fp16 noise. fairseq's trainer also checks every
    update that the ranks' grad norms agree (it stops the run if not)."""
    data = corpus(sentences, args.workers)
    nodrop = ["--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0",
              "--no-save"]
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
    out = [f"{args.graphs_check_variant}, --ddp-backend legacy_ddp ({args.gpus} GPUs x update-freq "
           f"1 vs 1 GPU x update-freq {args.gpus}, max-tokens {mt}, dropout 0, {updates} updates, "
           f"{sentences}-pair corpus): largest loss gap {max_gap(multi, single):.4f}; flat "
           f"all-reduce used: {'yes' if flat else 'NO'}, during the backward: "
           f"{'yes' if overlapped else 'no'}; shapes captured (rank log, last power of 2): "
           f"{captured[-1] if captured else 'none'}; fp16 overflows: {overflows[args.gpus]} "
           f"({args.gpus} GPUs), {overflows[1]} (1 GPU)",
           "updates: " + " ".join(str(u) for u, _ in multi),
           f"loss {args.gpus} GPUs: " + " ".join(f"{l:.3f}" for _, l in multi),
           "loss 1 GPU:   " + " ".join(f"{l:.3f}" for _, l in single)]
    return "\n".join(out)


def steady_wps(log):
    """Tokens/s over the logged intervals in the second half of a run (e2e.time_weighted_wps),
    leaving out each interval that spans an epoch boundary: that interval carries the
    end-of-epoch work (iterator and data-loader restart, ~3 s) and falls at a different place in
    the 1- and N-GPU runs (N GPUs finish an epoch in 1/N of the updates), so keeping it would
    bias the ratio; on WMT14 an epoch is thousands of updates."""
    rows, after_epoch = [], False
    for kind, stats in e2e.log_records(log):
        if kind == "train":
            after_epoch = True
            continue
        if not after_epoch:
            rows.append(stats)
        after_epoch = False
    steady = rows[len(rows) // 2:]
    return e2e.time_weighted_wps(steady) if steady else float("nan")


def profiles(data, args):
    """Where an update's time goes on 1 and N GPUs (bench/profile_summary.py in every worker), and
    where the host waits for the GPU. On N GPUs each update is split per rank into NCCL kernels
    (transfer, plus waiting for the slower rank), other kernels and idle GPU time: a rank's
    compute next to the other's shows how unequal the ranks' batches are."""
    mt, found, lines = args.max_tokens[0], [], []
    at, steps = args.profile_at, args.profile_steps
    for spec in args.profile_variants.split(","):
        variant, backend = spec.split(":")
        for gpus in (1, args.gpus):
            d = f"/tmp/mg_profile_{variant}_{backend}_{gpus}"
            os.makedirs(d, exist_ok=True)
            # beside the results ($OUT): the JSON has the per-update rows and host profile
            out = os.path.join(LOG_DIR, f"profile_{variant}_{backend}_{gpus}gpu_{{rank}}.json")
            env = {"BENCH_PROFILE_AT": str(at), "BENCH_PROFILE_STEPS": str(steps),
                   "BENCH_PROFILE_OUT": out}
            name = f"{variant} ({backend}), {gpus} GPU{'s' if gpus > 1 else ''}"
            try:
                train(data, variant, mt, gpus, 1, at + steps + 2 + profile_summary.PY_STEPS + 1, d,
                      ["--no-save"], backend, env_extra=env)
                ranks = []
                for r in range(gpus):
                    with open(out.format(rank=r)) as f:
                        ranks.append(json.load(f))
                for r, prof in enumerate(ranks):
                    found.append({"variant": name + (f", rank {r}" if gpus > 1 else ""),
                                  "profile": prof})
                if gpus > 1:
                    lines.append(ranks_table(name, ranks))
            except (RuntimeError, OSError) as e:
                found.append({"variant": name, "error": str(e)[-300:]})
    head = [f"Profiles at max-tokens {mt} (per GPU), updates {at}-{at + steps - 1}:",
            e2e.profile_markdown(found)]
    for p in found:
        s = p.get("profile") or {}
        if s.get("median_ms_per_update"):
            m = s["median_ms_per_update"]
            head.append(f"\nMedian per update, {p['variant']}: period {m['ms']:.1f} ms = compute "
                        f"{m['compute_ms']:.1f} + NCCL {m['nccl_ms']:.1f} + idle {m['idle_ms']:.1f}")
        if s.get("host_syncs_per_step_by_site"):
            head.append(f"\nHost syncs per update, {p['variant']}: " + "; ".join(
                f"{site} {n:.1f}" for site, n in s["host_syncs_per_step_by_site"][:8]))
    return "\n".join(head + lines)


def ranks_table(name, ranks):
    """Update by update, each rank's compute / NCCL / idle ms, and what unequal batches cost: the
    mean over updates of max(compute) - mean(compute) (the faster rank waits that long)."""
    rows = [f"\nPer update, {name} (ms; compute / NCCL / idle per rank):",
            "| update | " + " | ".join(f"rank {r}" for r in range(len(ranks))) + " | period |",
            "|---|" + "---|" * (len(ranks) + 1)]
    per = [r.get("per_update") or [] for r in ranks]
    n = min(len(p) for p in per)
    waits = []
    for i in range(n):
        cells = [f"{p[i]['compute_ms']:.1f} / {p[i]['nccl_ms']:.1f} / {p[i]['idle_ms']:.1f}"
                 for p in per]
        compute = [p[i]["compute_ms"] for p in per]
        waits.append(max(compute) - sum(compute) / len(compute))
        rows.append(f"| {i} | " + " | ".join(cells) + f" | {per[0][i]['ms']:.1f} |")
    if waits:
        rows.append(f"\nUnequal batches, {name}: max - mean compute per update {sum(waits) / n:.2f} "
                    f"ms on average over {n} updates")
    return "\n".join(rows)


def scaling(data, args):
    """4: wps on N GPUs over wps on 1 GPU, each GPU with --max-tokens per batch (update-freq 1),
    the mean of the logged intervals of the second half of the run (the first half warms up)."""
    rows = ["| max-tokens | variant | ddp-backend | wps 1 GPU | wps %d GPUs | scaling |" % args.gpus,
            "|---|---|---|---|---|---|"]
    extra, updates, epochs = ["--no-save"], args.scaling_updates, 100
    if args.scaling_epochs:
        # fairseq's --fix-batches-to-gpus does not apply to translation datasets (no prefetch):
        # each GPU sees a random half of the batches every epoch, and a graph is captured at
        # a batch's second sighting on that GPU, so N-GPU runs need more epochs to replay
        extra, updates, epochs = extra + ["--log-interval", "5"], None, args.scaling_epochs
    single = {}  # (variant, backend, max-tokens) -> 1-GPU wps measured in this call
    for mt in args.max_tokens:
        for spec in args.scaling_variants.split(","):
            variant, backend, *own = spec.split(":")
            run_epochs = int(own[0]) if own and args.scaling_epochs else epochs
            wps = []
            for gpus in (1, args.gpus):
                same = (e2e.VARIANTS[variant].get("single_gpu_as"), backend, mt)
                if gpus == 1 and same in single:  # multi-GPU-only flags: the same 1-GPU run
                    wps.append(single[same])
                    continue
                d = f"/tmp/mg_{variant}_{backend}_{mt}_{gpus}"
                os.makedirs(d, exist_ok=True)
                try:
                    log = train(data, variant, mt, gpus, 1, updates, d, extra, backend,
                                epochs=run_epochs)
                except RuntimeError as e:  # keep the rest of the table; the log is in $OUT
                    print(f"{variant} {mt} tokens {gpus} GPU(s) FAILED: {str(e)[-500:]}", flush=True)
                    log = ""
                wps.append(steady_wps(log))
                if gpus == 1:
                    single[(variant, backend, mt)] = wps[0]
            rows.append(f"| {mt} | {variant} | {backend} | {wps[0]:,.0f} | {wps[1]:,.0f} | "
                        f"{wps[1] / wps[0]:.2f}x |")
            print(rows[-1], flush=True)
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
