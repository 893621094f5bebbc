#!/usr/bin/env python3
"""What the shard of each GPU costs: N GPUs wait for the slowest rank at every update.

CPU only, no training: a model of the multi-GPU step, to choose a design before GPU time.
fairseq's batches of the end-to-end benchmark's corpus (``shape_buckets.fairseq_batches``:
WMT14-like lengths, fairseq's ordering and ``batch_by_size``) are shuffled per epoch and dealt
to N ranks as fairseq's ``EpochBatchIterator`` deals them (``ShardedIterator``: rank r takes
batches r, r + N, ...), either shuffled one by one (fairseq's default) or in groups of N
neighbouring batches (fairseq's own ``--grouped-shuffling``: the frozen batches are in length
order, so the N batches of an update have similar lengths; the batches after the last full group
come last, as ls_fairseq keeps them). The order is fairseq's own iterator's. Each rank pads its
batches with its own ``ShapeBuckets`` (the criterion's default buckets and slack) and keeps
CUDA graphs as the criterion's ``CapturePolicy`` does (first sighting, ``compact`` memory: every
shape new to a rank is captured there).

The cost model, GPU-bound as ls_'s step is (docs/PERFORMANCE.md, "Known limits"):

* a step costs its padded token slots (source + target positions) at one rate, set so that one
  GPU replaying every shape runs ``--wps`` target tokens/s;
* a shape new to a rank costs ``--capture-ms`` more on that rank (capture, gradient-free
  forward, host work; the default is fitted to the measured multi-GPU epochs, see its help);
* an update on N > 1 GPUs waits for its slowest rank, plus ``--reduce-ms`` of all-reduce not
  hidden under the backward.
* ``--optimizer-ms``: the optimizer step's time per update, the same for every shape (Adam: 2.06
  ms for transformer big on an H100); the token-slot rate covers the rest. With
  ``--sharded-optimizer GATHER_MS`` (ls_adam's sharded step) each of N ranks runs 1/N of it, on the
  shard of the gradients it sums, and the update waits ``GATHER_MS`` more for the parameters it did
  not update (the copies after the step, not hidden).

``--shape-policy`` tries designs that are not built (``POLICIES``): the ranks of an update pad
by different amounts, as each pads to an earlier shape of its own within the slack.

Scaling = (one GPU's time for the epoch's batches) / (N GPUs' time for them): what
``bench/multi_gpu.py`` measures by wall clock, less what the model leaves out (the data
loader, the host's share, the all-reduce's interference beyond ``--reduce-ms``).

    python bench/shard_balance.py --sentences 200000 --gpus 2 4 --epochs 4 --json out.json
"""
import argparse
import json
import os
import sys

import numpy as np
from fairseq.data import iterators

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shape_buckets import batch_shapes, fairseq_batches  # noqa: E402

from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (  # noqa: E402
    LSLabelSmoothedCrossEntropyCriterionConfig as CriterionConfig,
)
from ls_fairseq.fairseq_patches import batches_fixed_to_gpus  # noqa: E402
from ls_fairseq.graphs.shape_buckets import ShapeBuckets, bucket, token_slots  # noqa: E402
from ls_fairseq.testing.fairseq_helpers import IndexDataset  # noqa: E402

# the criterion's defaults: --ls-shape-buckets, --ls-shape-bucket-slack
BUCKETS, SLACK = CriterionConfig.ls_shape_buckets, CriterionConfig.ls_shape_bucket_slack


#: the orders ``epoch_order`` deals: fairseq's default, fairseq's --grouped-shuffling (as
#: ls_fairseq keeps the batches past the last full group), and per_rank: rank r keeps the frozen
#: batches r, r + N, ... (they span every length) and shuffles them on its own each epoch, so an
#: update pairs batches at random as fairseq's order does, yet every rank keeps meeting the same
#: shapes. That is ls_'s order on several GPUs (fairseq_patches, patch 7), dealt by the
#: product's own function. ``matched``: per_rank with an update's batches matched by cost
#: (``--ls-cost-matching-window``, off by default; the window is ``simulate``'s)
ORDERS = ("fairseq", "grouped", "per_rank", "matched")
#: the matched order's window unless given (``--match-windows``)
MATCH_WINDOW = 16


def epoch_order(n_batches, ranks, epoch, seed, order, costs=None, window=MATCH_WINDOW):
    """Each rank's batch indices of an epoch (None: fairseq's dummy batch) in ``order`` (one of
    ``ORDERS``): "per_rank" and "matched" (``costs``, one per batch, matched in runs of
    ``window`` updates) from patch 7's own function; "fairseq" and "grouped" from fairseq's
    own ``EpochBatchIterator.ordered_batches`` as ls_fairseq runs it, where "grouped"
    (``--grouped-shuffling``) keeps the batches after the last full group, last in the epoch,
    instead of dropping them (``fairseq_patches``, patch 6)."""
    if order in ("per_rank", "matched"):
        batches = [[i] for i in range(n_batches)]
        matched = dict(costs=costs, window=window) if order == "matched" else {}
        return [[b[0] if b else None
                 for b in batches_fixed_to_gpus(batches, ranks, rank, seed + epoch, **matched)]
                for rank in range(ranks)]
    batches = [np.array([i], dtype=np.int64) for i in range(n_batches)]
    return [[int(b[0]) if len(b) else None
             for b in iterators.EpochBatchIterator(
                 IndexDataset(), collate_fn=list, batch_sampler=batches, seed=seed,
                 num_shards=ranks, shard_id=rank, grouped_shuffling=order == "grouped",
             ).ordered_batches(epoch, fix_batches_to_gpus=False, shuffle=True)]
            for rank in range(ranks)]


def length_correlation(shards, lengths):
    """The correlation of log longest length between rank 0's and rank 1's batch over an
    epoch's updates (dummies left out): ~0 when an update pairs batches at random, ~1 for
    length neighbours."""
    pairs = [(lengths[a], lengths[b]) for a, b in zip(shards[0], shards[1])
             if a is not None and b is not None]
    return float(np.corrcoef(np.log(np.array(pairs, dtype=np.float64)).T)[0, 1])


#: ``--shape-policy``: how the ranks of an update choose their padded shapes (N > 1)
POLICIES = {
    "own": "each rank its own ShapeBuckets (the product)",
    "cap": "each rank its own, but an earlier shape only up to the largest grid shape of the "
           "update's batches (the ranks can know each other's lengths)",
    "shared": "one shape list for all ranks, fed the update's batches largest first",
}


class Rank:
    """One GPU: its padding and the shapes it holds graphs for."""

    def __init__(self, buckets=None):
        self.buckets = buckets if buckets is not None else ShapeBuckets(BUCKETS, SLACK)
        self.captured = set()

    def step(self, shape, rate_s, capture_s):
        """Seconds of one step at padded ``shape``."""
        seconds = token_slots(shape) * rate_s
        if shape not in self.captured:
            self.captured.add(shape)
            seconds += capture_s
        return seconds


def padded_shapes(gpus, batches, policy):
    """Each rank's padded shape for the update's raw (rows, source, target) ``batches``."""
    if policy == "shared":  # gpus share one ShapeBuckets
        shapes = [None] * len(batches)
        for i in sorted(range(len(batches)), key=lambda i: -token_slots(batches[i])):
            shapes[i] = gpus[i].buckets.shape_for(batches[i])
        return shapes
    if policy == "own":
        return [gpu.buckets.shape_for(b) for gpu, b in zip(gpus, batches)]
    cap = max(token_slots(tuple(bucket(n, BUCKETS) for n in b)) for b in batches)
    shapes = []
    for gpu, b in zip(gpus, batches):  # the budget (1 + slack) * own slots, capped
        gpu.buckets.slack = min(SLACK, cap / token_slots(b) - 1)
        shapes.append(gpu.buckets.shape_for(b))
        gpu.buckets.slack = SLACK
    return shapes


def simulate(raw, ranks, epochs, seed, order, rate_s, capture_s, reduce_s, policy="own",
             optimizer_s=0.0, gather_s=None, window=MATCH_WINDOW):
    """Per epoch: seconds, straggler seconds (the wait for the slowest rank), captures, the
    share of updates whose ranks ran one shape, the most shapes a rank holds graphs for, and
    (N > 1) ``length_correlation``. One GPU (``ranks`` 1, always ``own``) is the reference;
    ``policy``: :data:`POLICIES`. Every update costs ``optimizer_s`` more; with ``gather_s`` (a
    sharded optimizer step, N > 1) each rank runs ``optimizer_s / N`` and waits ``gather_s`` for
    the others' parameters. ``window``: the "matched" order's, which matches the batches' raw
    token slots (what the data loader knows before padding), as the product does."""
    if ranks == 1:
        policy = "own"
    common = ShapeBuckets(BUCKETS, SLACK) if policy == "shared" else None
    gpus = [Rank(common) for _ in range(ranks)]
    slots = [float(token_slots(r)) for r in raw]  # what the matched order matches
    lengths = [max(r[1], r[2]) for r in raw]
    out = []
    for epoch in range(1, epochs + 1):
        shards = epoch_order(len(raw), ranks, epoch, seed, order, slots, window)
        seconds = straggle = 0.0
        captures = same_shape = 0
        for update in zip(*shards):
            # fairseq's dummy batch (a short shard) repeats a real batch's work, loss * 0
            batches = [raw[b if b is not None else update[0]] for b in update]
            shapes = padded_shapes(gpus, batches, policy)
            costs = []
            for gpu, shape in zip(gpus, shapes):
                before = len(gpu.captured)
                costs.append(gpu.step(shape, rate_s, capture_s))
                captures += len(gpu.captured) - before
            sharded = ranks > 1 and gather_s is not None
            seconds += max(costs) + (reduce_s if ranks > 1 else 0.0) + (
                optimizer_s / ranks + gather_s if sharded else optimizer_s)
            straggle += max(costs) - sum(costs) / len(costs)
            same_shape += len(set(shapes)) == 1
        updates = len(shards[0])
        out.append(dict(epoch=epoch, seconds=seconds, straggler_s=straggle, captures=captures,
                        updates=updates, same_shape_updates=same_shape / updates,
                        shapes_per_rank=max(len(g.captured) for g in gpus)))
        if ranks > 1:
            out[-1]["length_correlation"] = length_correlation(shards, lengths)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=200000)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--gpus", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--wps", type=float, default=328000.0,
                    help="one GPU's target tokens/s replaying every shape (ls_ on an H200 in "
                         "bench/multi_gpu.py's 1-GPU run, docs/PERFORMANCE.md)")
    ap.add_argument("--capture-ms", type=float, default=25.0,
                    help="a new shape's extra cost on its rank. 25 ms: the model then gives 4 "
                         "GPUs 2.38x / 2.90x / 3.16x in epochs 2-4 of the 200k-pair corpus, "
                         "against 2.29x / 2.80x / 3.15x measured on 4x H200, and 2 GPUs "
                         "1.54x / 1.73x / 1.76x on 100k pairs against 1.62x / 1.73x / 1.81x "
                         "on 2x H100 (docs/PERFORMANCE.md, Several GPUs)")
    ap.add_argument("--reduce-ms", type=float, default=1.5,
                    help="all-reduce time per update not hidden under the backward")
    ap.add_argument("--optimizer-ms", type=float, default=0.0,
                    help="the optimizer step per update, whatever the shape (2.06: ls_adam on "
                         "transformer big, H100, docs/PERFORMANCE.md); 0 folds it into the "
                         "token-slot rate")
    ap.add_argument("--sharded-optimizer", type=float, metavar="GATHER_MS",
                    help="(ls_adam's sharded step) on N GPUs each rank steps 1/N of the "
                         "parameters and then waits GATHER_MS for the rest (the parameter "
                         "copies not hidden)")
    ap.add_argument("--shape-policy", choices=sorted(POLICIES), default="own",
                    help="how the ranks of an update choose their padded shapes on N GPUs: "
                         + "; ".join(f"{k}: {v}" for k, v in POLICIES.items())
                         + ". Only 'own' is built.")
    ap.add_argument("--orders", nargs="+", choices=ORDERS, default=["fairseq", "grouped"],
                    help="how the epoch's batches reach the ranks: " + "; ".join(ORDERS)
                         + " (per_rank: ls_'s batches fixed to GPUs; matched: the same "
                           "with --ls-cost-matching-window)")
    ap.add_argument("--match-windows", type=int, nargs="+", default=[MATCH_WINDOW],
                    help="the matched order's windows: each run of W updates is matched")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    if min(a.match_windows) < 1:
        ap.error(f"--match-windows: each window is >= 1 update, got {a.match_windows}")

    out, src, tgt = fairseq_batches(a.sentences, a.max_tokens, a.seed)
    raw = batch_shapes(out, src, tgt)
    tgt_tokens = [int(tgt[b].sum()) for b in out]
    # the rate of a token slot: one GPU replaying every shape runs --wps target tokens/s
    slots = sum(token_slots(ShapeBuckets(BUCKETS, SLACK).shape_for(r)) for r in raw)
    optimizer_s = a.optimizer_ms / 1000
    replay_s = sum(tgt_tokens) / a.wps - len(raw) * optimizer_s
    if replay_s <= 0:
        ap.error(f"--optimizer-ms {a.optimizer_ms:g}: longer than a whole step at --wps "
                 f"{a.wps:g}")
    rate_s = replay_s / slots
    capture_s, reduce_s = a.capture_ms / 1000, a.reduce_ms / 1000
    gather_s = None if a.sharded_optimizer is None else a.sharded_optimizer / 1000
    one = simulate(raw, 1, a.epochs, a.seed, "fairseq", rate_s, capture_s, reduce_s,
                   optimizer_s=optimizer_s)
    rows = []
    print(f"{a.sentences:,} pairs, --max-tokens {a.max_tokens}: {len(raw):,} batches; one GPU "
          f"{a.wps:,.0f} wps replaying; capture {a.capture_ms:g} ms, all-reduce "
          f"{a.reduce_ms:g} ms; shape policy {a.shape_policy}; optimizer {a.optimizer_ms:g} ms"
          + ("" if gather_s is None else
             f", sharded (parameter copies {a.sharded_optimizer:g} ms)") + "\n")
    print("| GPUs | shuffling | epoch | updates | scaling | straggler share | captures | "
          "updates of one shape | shapes per rank | length correlation |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    runs = [(order, w) for order in a.orders
            for w in (a.match_windows if order == "matched" else [None])]
    for n in a.gpus:
        for order, window in runs:
            sim = simulate(raw, n, a.epochs, a.seed, order, rate_s, capture_s, reduce_s,
                           a.shape_policy, optimizer_s, gather_s, window=window)
            for ref, e in zip(one, sim):
                row = dict(gpus=n, order=order, grouped_shuffling=order == "grouped", **e,
                           scaling=ref["seconds"] / e["seconds"],
                           straggler_share=e["straggler_s"] / e["seconds"])
                if window is not None:
                    row["window"] = window
                rows.append(row)
                print(f"| {n} | {order}{'' if window is None else f' ({window})'} | "
                      f"{e['epoch']} | "
                      f"{e['updates']} | {row['scaling']:.2f}x | {row['straggler_share']:.1%} | "
                      f"{e['captures']} | {e['same_shape_updates']:.0%} | "
                      f"{e['shapes_per_rank']} | {e.get('length_correlation', 0):.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), batches=len(raw), target_tokens=sum(tgt_tokens),
                           one_gpu=one, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
