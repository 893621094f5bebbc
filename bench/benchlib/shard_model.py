"""The model of the multi-GPU step behind bench/shard_balance.py (its docstring says what it
models and how); fairseq's batches of the end-to-end benchmark's corpus.

Imports fairseq and ls_fairseq: the script imports this module after parsing its options.
"""
import numpy as np
from fairseq.data import data_utils, iterators

from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (
    LSLabelSmoothedCrossEntropyCriterionConfig as CriterionConfig,
)
from ls_fairseq.data.batch_order import batches_fixed_to_gpus
from ls_fairseq.graphs.shape_buckets import ShapeBuckets, bucket, token_slots
from ls_fairseq.testing.fairseq_helpers import IndexDataset
from ls_fairseq.testing.learnable_corpus import wmt_like_lengths


def fairseq_batches(sentences, max_tokens, seed):
    """fairseq's batches (arrays of sentence indices) of a corpus of WMT14-like lengths (the
    end-to-end benchmark's), and its source and target lengths (with end-of-sentence): ordered
    as fairseq's ``LanguagePairDataset`` orders them, batched by fairseq's own ``batch_by_size``
    (``--required-batch-size-multiple 8``)."""
    src, tgt = wmt_like_lengths(np.random.default_rng(seed), sentences)
    src, tgt = src + 1, tgt + 1  # fairseq-preprocess appends end-of-sentence
    indices = np.random.default_rng(seed).permutation(sentences).astype(np.int64)
    indices = indices[np.argsort(tgt[indices], kind="mergesort")]  # ordered_indices()
    indices = indices[np.argsort(src[indices], kind="mergesort")]
    num_tokens = np.maximum(src, tgt)
    out = data_utils.batch_by_size(indices, lambda i: num_tokens[i], max_tokens=max_tokens,
                                   required_batch_size_multiple=8,
                                   num_tokens_vec=num_tokens[indices])
    return out, src, tgt


def batch_shapes(out, src, tgt):
    """(sentences, source length, target length) of each batch."""
    return [(len(b), int(src[b].max()), int(tgt[b].max())) for b in out]


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
