"""What a batch shape costs under ``--ls-cuda-graphs``: its eager first sighting, its capture at the
second sighting (split into the warm-up step, the captured forward and backward, and
``capture_end``, which instantiates the graph) and its replays, for transformer big (fp16, dropout
0.3) and the ls_ criterion, on batches of WMT-like shapes (~6.7k target tokens).

    python bench/capture_cost.py --shapes 24 [--warm-up every-shape]

``--warm-up once`` (default) is the product's behaviour: the capture stream runs one eager warm-up
step before its first capture. ``every-shape`` warms it up before every capture, as the product
did before one warm-up per stream. Prints a table: median wall ms per phase, synchronised, and how many
captures failed; then the device memory each further captured shape keeps (its pair of graphs):
in the allocator's pool (``memory_reserved``) and outside it (``mem_get_info`` used minus
reserved: the instantiated graphs' own memory), averaged over the shapes after the first.
"""
import argparse
import collections
import time

import torch

from ls_fairseq.testing.fairseq_helpers import (
    DummyTask, build_model, make_dictionary, random_batch,
)
from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (  # noqa: E402
    LSLabelSmoothedCrossEntropyCriterion,
)

ARCH = "ls_transformer_wmt_en_de_big_t2t"
times = collections.defaultdict(list)


class TimedGraph(torch.cuda.CUDAGraph):
    """CUDAGraph whose capture_end (graph instantiation) is timed."""

    def capture_end(self):
        t = time.perf_counter()
        super().capture_end()
        times["capture_end (instantiate)"].append((time.perf_counter() - t) * 1e3)


def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        times[name].append((time.perf_counter() - t) * 1e3)
        return out
    return wrapper


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=6700)
    ap.add_argument("--warm-up", choices=["once", "every-shape"], default="once")
    ap.add_argument("--memory", choices=["compact", "grow"], default="compact",
                    help="--ls-cuda-graphs-memory (bench/graph_memory.py breaks memory down)")
    args = ap.parse_args()
    torch.cuda.CUDAGraph = TimedGraph  # read by ls_fairseq/graphs/replay.py at each capture
    d = make_dictionary(32000)
    model = build_model(ARCH, d, ["--share-all-embeddings", "--dropout", "0.3",
                                  "--attention-dropout", "0.1", "--activation-dropout", "0.1"])
    model = model.cuda().half().train()
    crit = LSLabelSmoothedCrossEntropyCriterion(DummyTask(d), sentence_avg=False,
                                                label_smoothing=0.1, ls_cuda_graphs=True,
                                                ls_cuda_graphs_memory=args.memory)
    runner = crit.graphs  # the criterion's CudaGraphedLoss
    runner._warm_up = timed("warm-up step", runner._warm_up)
    runner._captured = timed("captured fn + capture_end", runner._captured)
    g = torch.Generator().manual_seed(0)
    failures = 0
    memory = []  # per shape, after its replays: (reserved, outside the allocator, allocated) bytes
    for i in range(args.shapes):
        t_len = 12 + (i * 7) % 60
        bsz = max(1, args.tokens // t_len)
        src, src_len, prev, tgt = random_batch(d, bsz, t_len + i % 5, t_len, generator=g)
        sample = {"net_input": {"src_tokens": src.cuda(), "src_lengths": src_len.cuda(),
                                "prev_output_tokens": prev.cuda()},
                  "target": tgt.cuda(), "ntokens": int(tgt.ne(d.pad()).sum())}
        if args.warm_up == "every-shape":
            runner._stream_warm = False  # the next capture warms the stream up again
        for phase in ("eager (1st sighting)", "capture (2nd sighting)", "replay", "replay"):
            for p in model.parameters():
                p.grad = None
            torch.cuda.synchronize()
            t = time.perf_counter()
            try:
                loss, _, _ = crit(model, sample)
                (loss * 8.0).backward()
                torch.cuda.synchronize()
            except RuntimeError as e:
                failures += 1
                print(f"shape {i} {phase}: FAILED {str(e)[:300]}", flush=True)
                break
            times[phase].append((time.perf_counter() - t) * 1e3)
        free, total = torch.cuda.mem_get_info()
        reserved = torch.cuda.memory_reserved()
        memory.append((reserved, total - free - reserved, torch.cuda.memory_allocated()))
    print(f"\n--warm-up {args.warm_up}: {args.shapes} shapes, {failures} failed, "
          f"stats {dict(runner.stats)}")
    print("| phase | median ms | calls |\n|---|---|---|")
    for name, v in times.items():
        print(f"| {name} | {sorted(v)[len(v) // 2]:.1f} | {len(v)} |")
    if len(memory) > 1:
        n = len(memory) - 1
        pool, outside, live = ((memory[-1][k] - memory[0][k]) / n / 2**20 for k in (0, 1, 2))
        print(f"\nper further captured shape (mean of {n}): {pool:.1f} MiB reserved by the "
              f"allocator ({live:.1f} MiB of it allocated), {outside:.1f} MiB outside it; "
              f"reserved after each shape (GiB): "
              f"{' '.join(f'{m[0] / 2**30:.2f}' for m in memory)}")


if __name__ == "__main__":
    main()
