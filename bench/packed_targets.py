#!/usr/bin/env python3
"""What a decoder that skips padded target positions would save, and what it would cost in graph
shapes (CPU only, no training; a design study for issue 6).

fairseq pads every batch to its longest target, and ``--ls-shape-buckets`` pads the shape further,
so the decoder and the output projection (~58% of transformer big's FLOPs) compute positions that
hold no token. A decoder run on the batch's target tokens only ("packed") needs, under CUDA
graphs, a static token count per graph: the real count rounded up on a grid (``bucket``, the
criterion's grid with ``--packed-grid`` steps per doubling), which becomes one more dimension of
the graph key. For fairseq's own batches of ``bench/e2e.py``'s WMT14-like lengths, in one shuffled
epoch, this prints the target positions computed per real target token, padded (as today) and
packed, and the distinct graph keys without and with the packed count.

    python bench/packed_targets.py --sentences 40000 400000 --max-tokens 8192 65536
"""
import argparse

import numpy as np

from shape_buckets import fairseq_batches  # noqa: E402

from ls_fairseq.graphs.shape_buckets import ShapeBuckets, bucket  # noqa: E402


def study(out, src, tgt, steps, slack, packed_grid, seed):
    buckets = ShapeBuckets(steps, slack)
    keys, packed_keys = set(), set()
    padded = packed = real = 0
    for i in np.random.default_rng(seed + 1).permutation(len(out)):
        b = out[i]
        shape = buckets.shape_for((len(b), int(src[b].max()), int(tgt[b].max())))
        tokens = int(tgt[b].sum())
        count = bucket(tokens, packed_grid)
        keys.add(shape)
        packed_keys.add(shape + (count,))
        padded += shape[0] * shape[2]
        packed += count
        real += tokens
    return padded / real, packed / real, len(keys), len(packed_keys)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, nargs="+", default=[40000, 400000, 4500000])
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[8192, 65536])
    ap.add_argument("--shape-buckets", type=int, default=16)
    ap.add_argument("--slack", type=float, default=0.2)
    ap.add_argument("--packed-grid", type=int, nargs="+", default=[16, 8])
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    print("| sentences | max-tokens | packed grid | target positions / token, padded | "
          "packed | graph keys, padded | with the packed count |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.sentences:
        for mt in args.max_tokens:
            out, src, tgt = fairseq_batches(n, mt, args.seed)
            for grid in args.packed_grid:
                pad, packed, keys, packed_keys = study(out, src, tgt, args.shape_buckets,
                                                       args.slack, grid, args.seed)
                print(f"| {n:,} | {mt} | {grid} | {pad:.3f} | {packed:.3f} | {keys:,} | "
                      f"{packed_keys:,} |", flush=True)


if __name__ == "__main__":
    main()
