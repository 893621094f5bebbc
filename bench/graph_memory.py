#!/usr/bin/env python3
"""The device memory ``--ls-cuda-graphs`` holds, by pool and stream, per ``--ls-cuda-graphs-memory``.

Runs transformer big (fp16, dropout 0.3) through the ls_ criterion on the batch shapes fairseq's
``batch_by_size`` makes of a WMT14-like corpus (``shape_buckets.batches``), padded as
``--ls-shape-buckets 16`` pads them, in a shuffled order, for ``--epochs`` epochs: the shapes an
``e2e.py`` run meets, without the data pipeline and the optimizer. One fresh process per mode:

* ``eager``: no CUDA graphs (the ls_ model as it runs without ``--ls-cuda-graphs``);
* ``grow``: ``--ls-cuda-graphs --ls-cuda-graphs-memory grow`` (the allocator's default);
* ``compact``: ``--ls-cuda-graphs`` with the default ``--ls-cuda-graphs-memory compact``.

Prints a table: steps run eagerly / captured / replayed, median wall ms of each (synchronised),
and at the end the memory the allocator reserves in the default pool on the default stream, in
the default pool on other streams (the capture stream's warm-up), in the graphs' pool, the
allocated total, and the device memory in use (``mem_get_info``). Model weights and gradients are
in every row; an optimizer's state (3.4 GB for fairseq's fp32 master and Adam moments at
transformer big) is not.

    python bench/graph_memory.py --sentences 40000 --max-tokens 8192 --modes eager grow compact
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import time

import numpy as np

ARCH = "ls_transformer_wmt_en_de_big_t2t"
GiB = 2**30


def shape_stream(sentences, max_tokens, epochs, seed):
    """The padded batch shapes (rows, source length, target length) of ``epochs`` shuffled
    epochs, as the criterion's ShapeBuckets pads them (16 steps per doubling, slack 0.2)."""
    from shape_buckets import batches
    from ls_fairseq.graphs.shape_buckets import ShapeBuckets
    raw = batches(sentences, max_tokens, seed)
    buckets, rng, out = ShapeBuckets(16, 0.2), np.random.default_rng(seed + 1), []
    for _ in range(epochs):
        out += [buckets.shape_for(raw[i]) for i in rng.permutation(len(raw))]
    return out


def breakdown(capture_stream):
    """Reserved / allocated bytes by (pool, stream) from the allocator's snapshot."""
    import torch
    rows = collections.Counter()
    for seg in torch.cuda.memory_snapshot():
        default_pool = tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0)
        if not default_pool:
            where = "graphs' pool"
        elif capture_stream is not None and seg["stream"] == capture_stream.cuda_stream:
            where = "default pool, capture stream"
        elif seg["stream"] == 0 or seg["stream"] == torch.cuda.default_stream().cuda_stream:
            where = "default pool, default stream"
        else:
            where = "default pool, other streams"
        rows[where + " reserved"] += seg["total_size"]
        rows[where + " allocated"] += seg["allocated_size"]
    return rows


def run_one(args):
    import torch
    from ls_fairseq.testing.fairseq_helpers import (
        DummyTask, build_model, make_dictionary, random_batch,
    )
    from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (
        LSLabelSmoothedCrossEntropyCriterion,
    )
    shapes = shape_stream(args.sentences, args.max_tokens, args.epochs, args.seed)
    d = make_dictionary(args.vocab)
    model = build_model(ARCH, d, ["--share-all-embeddings", "--dropout", "0.3",
                                  "--attention-dropout", "0.1", "--activation-dropout", "0.1"])
    model = model.cuda().half().train()
    graphs = args.one != "eager"
    crit = LSLabelSmoothedCrossEntropyCriterion(
        DummyTask(d), sentence_avg=False, label_smoothing=0.1, ls_cuda_graphs=graphs,
        ls_cuda_graphs_capture="first-sighting", ls_shape_buckets=0,
        ls_cuda_graphs_memory=args.one if graphs else "compact")
    runner = crit.graphs
    g = torch.Generator().manual_seed(args.seed)
    times = collections.defaultdict(list)
    samples = {}
    t_all = time.perf_counter()
    for rows, src_len, tgt_len in shapes:
        if (rows, src_len, tgt_len) not in samples:  # token contents do not matter here
            src, src_lengths, prev, tgt = random_batch(d, rows, src_len, tgt_len, generator=g)
            samples[rows, src_len, tgt_len] = {
                "net_input": {"src_tokens": src.cuda(), "src_lengths": src_lengths.cuda(),
                              "prev_output_tokens": prev.cuda()},
                "target": tgt.cuda(), "ntokens": int(tgt.ne(d.pad()).sum())}
        sample = samples[rows, src_len, tgt_len]
        before = dict(runner.stats) if graphs else {}
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss, _, _ = crit(model, sample)
        (loss * 8.0).backward()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        kind = "eager"
        if graphs:
            kind = next(k for k in ("captured", "replayed", "eager")
                        if runner.stats[k] != before.get(k, 0))
        times[kind].append(ms)
    wall = time.perf_counter() - t_all
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    out = {"mode": args.one, "steps": len(shapes), "shapes": len(set(shapes)),
           "wall_s": wall, "reserved": torch.cuda.memory_reserved(),
           "allocated": torch.cuda.memory_allocated(), "device_used": total - free,
           "max_allocated": torch.cuda.max_memory_allocated(),
           "times": {k: (len(v), float(np.median(v))) for k, v in times.items()},
           "pools": dict(breakdown(runner._stream if graphs else None))}
    if graphs and runner._memory is not None:
        out["arena"] = runner._memory.arena_bytes
        out["memory_stats"] = runner._memory.stats
    print("RESULT " + json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=40000)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=["eager", "grow", "compact"],
                    choices=["eager", "grow", "compact"])
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child process: run one mode
    args = ap.parse_args()
    if args.one:
        return run_one(args)
    results = []
    for mode in args.modes:
        cmd = [sys.executable, __file__, "--one", mode] + [
            f"--{k.replace('_', '-')}={getattr(args, k)}"
            for k in ("sentences", "max_tokens", "epochs", "vocab", "seed")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            print(f"{mode}: FAILED\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", flush=True)
            continue
        results.append(json.loads(line[0][len("RESULT "):]))
        print(json.dumps(results[-1]), flush=True)
    if not results:
        sys.exit(1)
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    print(f"\n{args.sentences:,} pairs, --max-tokens {args.max_tokens}, {args.epochs} epochs, "
          f"PYTORCH_CUDA_ALLOC_CONF={conf!r}")
    kinds = ("eager", "captured", "replayed")
    places = ("default pool, default stream", "default pool, capture stream",
              "default pool, other streams", "graphs' pool")
    print("| mode | steps eager / captured / replayed | median ms eager / capture / replay | "
          "wall s | " + " | ".join(f"{p} GiB" for p in places) +
          " | reserved GiB | allocated GiB | device used GiB | arena GiB | releases |")
    print("|---" * (len(places) + 9) + "|")
    for r in results:
        t = r["times"]
        steps = " / ".join(str(t.get(k, (0, 0))[0]) for k in kinds)
        ms = " / ".join(f"{t[k][1]:.1f}" if k in t else "-" for k in kinds)
        pools = " | ".join(f"{r['pools'].get(p + ' reserved', 0) / GiB:.2f}" for p in places)
        stats = r.get("memory_stats", {})
        print(f"| {r['mode']} | {steps} | {ms} | {r['wall_s']:.1f} | {pools} | "
              f"{r['reserved'] / GiB:.2f} | {r['allocated'] / GiB:.2f} | "
              f"{r['device_used'] / GiB:.2f} | {r.get('arena', 0) / GiB:.2f} | "
              f"{stats.get('released', '-')} |")


if __name__ == "__main__":
    main()
