#!/usr/bin/env python3
"""What the shard of each GPU costs: N GPUs wait for the slowest rank at every update.

CPU only, no training: a model of the multi-GPU step, to choose a design before GPU time.
fairseq's batches of the end-to-end benchmark's corpus (``benchlib.shard_model.fairseq_batches``:
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

The model itself is ``benchlib/shard_model.py`` (imported after the options are read); its names
are this module's too (``shard_balance.simulate``, ``shard_balance.epoch_order``, ...).
"""
import argparse
import sys

from benchlib import results

#: the orders and shape policies of the model (benchlib/shard_model.py: ORDERS, POLICIES)
ORDERS = ("fairseq", "grouped", "per_rank", "matched")
POLICIES = ("own", "cap", "shared")
MATCH_WINDOW = 16


def __getattr__(name):
    """The model's names (``simulate``, ``epoch_order``, ``Rank``, ``BUCKETS``, ...), imported
    when first asked for."""
    from benchlib import shard_model

    try:
        return getattr(shard_model, name)
    except AttributeError:
        raise AttributeError(f"module 'shard_balance' has no attribute {name!r}") from None


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
                         "own (each rank its own shape list: the product), cap (an earlier "
                         "shape only up to the update's largest grid shape), shared (one list "
                         "for all ranks). Only 'own' is built.")
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
    from benchlib.shard_model import (BUCKETS, SLACK, ShapeBuckets, batch_shapes,
                                      fairseq_batches, simulate, token_slots)

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
        head = results.header(
            "bench/shard_balance.py", f"CPU model of the multi-GPU step: {a.sentences} pairs, "
            f"--max-tokens {a.max_tokens}, GPUs {a.gpus}, orders {a.orders}, shape policy "
            f"{a.shape_policy}", "python bench/shard_balance.py " + " ".join(
                sys.argv[1:] if argv is None else argv), device="CPU (model)")
        results.write(a.json, head, rows, args=vars(a), batches=len(raw),
                      target_tokens=sum(tgt_tokens), one_gpu=one)
    return rows


if __name__ == "__main__":
    main()
