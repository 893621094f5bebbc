#!/usr/bin/env python3
"""How many batch shapes fairseq's batching makes, and what ``--ls-shape-buckets`` does to them.

CPU only, no training: WMT14-like sentence lengths (``e2e.wmt_like_lengths``, the distribution of
the end-to-end benchmark's corpus), ordered as fairseq's ``LanguagePairDataset`` orders them and
batched by fairseq's own ``batch_by_size`` (``--max-tokens``, ``--required-batch-size-multiple
8``). For each setting of ``--ls-shape-buckets`` / ``--ls-shape-bucket-slack`` (the
criterion's ``ShapeBuckets``, fed the batches in training order) it prints

* the distinct batch shapes (batch size, source length, target length) of an epoch,
* the target fill of fairseq's own batches: target tokens / target positions (each batch is
  padded to its longest target; the decoder and the output projection compute every position),
* the padding's cost: token slots (source + target positions) of the padded batches / those of
  the batches as fairseq makes them - 1,
* how ``--ls-cuda-graphs`` runs the steps of epochs 1 and 2 (batches shuffled per epoch as
  fairseq's iterator does): eager, captured (the step is then the first replay) or replayed,
  with the criterion's ``CapturePolicy`` (``--capture``, as ``--ls-cuda-graphs-capture``: auto
  captures padded shapes at their first sighting, unpadded ones at their second) and at most
  ``--ls-cuda-graphs-max`` shapes kept, least recently used dropped. With first-sighting
  captures and ``--memory compact`` (``--ls-cuda-graphs-memory``'s default) a shape larger than
  every step so far is captured at once after a gradient-free forward instead of running
  eagerly: it counts as captured.

    python bench/shape_buckets.py --sentences 40000 400000 4500000 --max-tokens 8192 16384
"""
import argparse
import collections

import numpy as np

from e2e import wmt_like_lengths  # noqa: E402
from fairseq.data import data_utils  # noqa: E402

from ls_fairseq.graphs.capture_policy import (  # noqa: E402
    CAPTURE_CHOICES, CapturePolicy, captures_first_sighting,
)
from ls_fairseq.graphs.memory import MEMORY_CHOICES  # noqa: E402
from ls_fairseq.graphs.shape_buckets import ShapeBuckets, token_slots  # noqa: E402


def fairseq_batches(sentences, max_tokens, seed):
    """fairseq's batches (arrays of sentence indices) of the corpus, and its source and target
    lengths (with end-of-sentence)."""
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


def batches(sentences, max_tokens, seed):
    """fairseq's batches of the corpus as (sentences, source length, target length) shapes."""
    return batch_shapes(*fairseq_batches(sentences, max_tokens, seed))


def target_fill(out, tgt):
    """The share of the batches' target positions that hold tokens (the rest is the padding up
    to each batch's longest target)."""
    return sum(int(tgt[b].sum()) for b in out) / sum(len(b) * int(tgt[b].max()) for b in out)


def simulate(raw, buckets, epochs, max_graphs, seed, first_sighting, compact=True):
    """Runs ``epochs`` epochs of the batches ``raw`` (shuffled per epoch) through the padding
    (``buckets``, None: none) and --ls-cuda-graphs' policy (``compact``: with first-sighting
    captures, what the policy would run eagerly is captured after a gradient-free forward).
    Returns the padded shapes met and, per epoch, the (eager, captured, replayed) step counts."""
    rng = np.random.default_rng(seed + 1)
    policy, kept, per_epoch, padded = CapturePolicy(first_sighting), collections.OrderedDict(), [], []
    for _ in range(epochs):
        counts = collections.Counter()
        for i in rng.permutation(len(raw)):
            key = buckets.shape_for(raw[i]) if buckets else raw[i]
            padded.append(key)
            if key in kept:
                kept.move_to_end(key)
                counts["replayed"] += 1
                continue
            rows, src_len, tgt_len = key  # as CudaGraphedLoss sees them: source, target
            shapes = ((rows, src_len), (rows, tgt_len))
            captured = policy.capture(None, shapes) or (first_sighting and compact)
            policy.ran(None, shapes)
            if not captured:
                counts["eager"] += 1
                continue
            counts["captured"] += 1
            kept[key] = True
            while len(kept) > max_graphs:
                kept.popitem(last=False)
        per_epoch.append(counts)
    return padded, per_epoch


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, nargs="+", default=[40000, 400000, 4500000])
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--grids", nargs="+", default=["0", "16:0", "16:0.2", "8:0.2", "4:0"],
                    help="--ls-shape-buckets:--ls-shape-bucket-slack pairs (0: no padding)")
    ap.add_argument("--max-graphs", type=int, default=256)
    ap.add_argument("--capture", nargs="+", default=["auto"],
                    choices=CAPTURE_CHOICES,
                    help="--ls-cuda-graphs-capture policies to simulate")
    ap.add_argument("--memory", choices=MEMORY_CHOICES, default="compact",
                    help="--ls-cuda-graphs-memory to simulate")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    print("| sentences | max-tokens | batches/epoch | target fill | buckets : slack | capture at | "
          "shapes | padding cost | epoch 1 eager / captured / replayed | "
          "epoch 2 eager / captured / replayed |")
    print("|---:|---:|---:|---:|---|---|---:|---:|---|---|")
    for n in args.sentences:
        for mt in args.max_tokens:
            out, src, tgt = fairseq_batches(n, mt, args.seed)
            raw, fill = batch_shapes(out, src, tgt), target_fill(out, tgt)
            for grid in args.grids:
                steps, _, slack = grid.partition(":")
                for capture in args.capture:
                    buckets = ShapeBuckets(int(steps), float(slack or 0)) if int(steps) else None
                    first = captures_first_sighting(capture, padded=buckets is not None)
                    padded, (e1, e2) = simulate(raw, buckets, 2, args.max_graphs, args.seed,
                                                first, args.memory == "compact")
                    cost = sum(map(token_slots, padded)) / (2 * sum(map(token_slots, raw))) - 1
                    fmt = lambda c: " / ".join(f"{c[k] / len(raw):.0%}" for k in  # noqa: E731
                                               ("eager", "captured", "replayed"))
                    label = "off" if buckets is None else f"{steps} : {float(slack or 0):g}"
                    print(f"| {n:,} | {mt} | {len(raw):,} | {fill:.3f} | {label} | "
                          f"{'first' if first else 'second'} | {len(set(padded)):,} | "
                          f"{cost:.1%} | {fmt(e1)} | {fmt(e2)} |", flush=True)


if __name__ == "__main__":
    main()
