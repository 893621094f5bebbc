#!/usr/bin/env python3
"""What a gradient all-reduce costs a backward it overlaps: NCCL's against the copy engines'.

A stand-in for the backward runs on every GPU: --gemms matrix multiplies (8192 x 1024 x 4096,
fp16; with --mixed every other one is followed by a memory-bound elementwise pass), with a CUDA
event after each 1/B of them marking bucket b of a flat fp16 gradient buffer of --mb MB (buckets
of --bucket-mb, as the engine cuts them) complete. The all-reduce of the buckets is then issued
exactly as the CUDA-graph engine issues it (``grad_buckets.GradBuckets.issue``, a side stream
waiting on each bucket's event), with one of:

* ``none``: no all-reduce (the stand-in alone);
* ``nccl``: fairseq's legacy reduction by NCCL (``grad_buckets.legacy_reduce``);
* ``copy_engine``: ``graphs/peer_all_reduce.py`` (the default on GPUs of one host).

Each mode's time per step is the mean over --iters steps, measured --repeats times in turn
(none, nccl, copy_engine, none, ...); the table gives each mode's mean and its cost over ``none``.
The copy-engine result is also checked against NCCL's (bit for bit on 2 GPUs).

    python bench/all_reduce_overlap.py --gpus 2 --json docs/results/all_reduce_overlap_2x.json
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

MODES = ("none", "nccl", "copy_engine")


def _worker(rank, args, results):
    import torch
    import torch.distributed as dist

    from ls_fairseq.graphs import peer_all_reduce
    from ls_fairseq.graphs.flat_gradients import FlatGradients
    from ls_fairseq.graphs.grad_buckets import GradBuckets, legacy_reduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{args.rendezvous}", rank=rank,
                            world_size=args.gpus, device_id=torch.device("cuda", rank))
    dev = torch.device("cuda", rank)
    a = torch.randn(8192, 1024, device=dev, dtype=torch.half)
    w = torch.randn(1024, 4096, device=dev, dtype=torch.half)
    c = torch.empty(8192, 4096, device=dev, dtype=torch.half)
    # parameters of 4M elements: buckets cut between them, as between a model's parameters
    per = 4 * 2**20
    params = [torch.nn.Parameter(torch.zeros(per, device=dev, dtype=torch.half))
              for _ in range(max(1, args.mb * 2**20 // 2 // per))]
    grads = FlatGradients(params)
    buckets = GradBuckets(grads.flats, grads.spans, args.bucket_mb * 2**20)
    nb = len(buckets.buckets)
    peer, reason = peer_all_reduce.create(grads.flats, buckets.buckets, dist.group.WORLD)
    ready = [torch.cuda.Event() for _ in range(nb)]
    nccl = legacy_reduce(args.gpus, dist.group.WORLD)

    def step(mode):
        # the buckets complete in order (GradBuckets: the first bucket is the last parameters')
        for b in range(nb):
            for k in range(max(1, args.gemms // nb)):
                torch.matmul(a, w, out=c)
                if args.mixed and k % 2:
                    c.mul_(1.0001)
            ready[b].record()
        if mode == "nccl":
            buckets.issue(grads.flats, ready, nccl)
        elif mode == "copy_engine":
            buckets.issue(grads.flats, ready, peer)

    # the copy engines' result against NCCL's, on the same gradients
    g = torch.Generator(device=dev).manual_seed(rank)
    sign = torch.randint(0, 2, grads.flats[0].shape, device=dev, generator=g) * 2 - 1
    x = (sign * torch.exp(torch.rand(grads.flats[0].shape, device=dev, generator=g) * 6 - 3)).half()
    out = {"reason": reason, "buckets": nb, "ms": {m: [] for m in MODES}}
    modes = MODES if peer is not None else MODES[:2]
    if peer is not None:
        grads.flats[0].copy_(x)
        buckets.issue(grads.flats, [None] * nb, peer)
        ours = grads.flats[0].clone()
        grads.flats[0].copy_(x)
        buckets.issue(grads.flats, [None] * nb, nccl)
        torch.cuda.synchronize()
        out["equal_to_nccl"] = bool(torch.equal(ours, grads.flats[0]))
    for _ in range(args.repeats):
        for mode in modes:
            for _ in range(3):
                step(mode)
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step(mode)
            torch.cuda.synchronize()
            out["ms"][mode].append((time.perf_counter() - t0) / args.iters * 1e3)
    results[rank] = out
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--mb", type=int, default=420, help="gradient MB (transformer big: 420)")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--gemms", type=int, default=136, help="stand-in backward: GEMMs per step")
    ap.add_argument("--mixed", action="store_true",
                    help="an elementwise pass after every other GEMM (memory-bound kernels)")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < args.gpus:
        sys.exit(f"all_reduce_overlap: needs {args.gpus} GPUs, torch sees "
                 f"{torch.cuda.device_count()}")
    args.rendezvous = f"/tmp/all_reduce_overlap_{os.getpid()}"
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(args, results), nprocs=args.gpus)
    r0 = results[0]
    from e2e import commit, gpu_names

    rows = []
    base = statistics.mean(r0["ms"]["none"])
    for mode in MODES:
        ms = r0["ms"][mode]
        if ms:
            rows.append({"mode": mode, "ms_per_step": statistics.mean(ms), "runs_ms": ms,
                         "over_none_ms": statistics.mean(ms) - base})
    print(f"{args.gpus}x {gpu_names()[0]}; {args.mb} MB of fp16 gradients in {r0['buckets']} "
          f"buckets; stand-in backward: {args.gemms} GEMMs{' + elementwise' if args.mixed else ''}"
          f"; copy engines: {r0['reason'] or 'on'}; equal to NCCL's: "
          f"{r0.get('equal_to_nccl')}\n")
    print("| all-reduce | ms per step | runs | over none |\n|---|---:|---|---:|")
    for row in rows:
        print(f"| {row['mode']} | {row['ms_per_step']:.2f} | "
              f"{', '.join(f'{v:.2f}' for v in row['runs_ms'])} | {row['over_none_ms']:+.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": gpu_names()[0], "gpus": args.gpus, "commit": commit(),
                       "command": "python bench/all_reduce_overlap.py " + " ".join(sys.argv[1:]),
                       "mb": args.mb, "bucket_mb": args.bucket_mb, "gemms": args.gemms,
                       "mixed": args.mixed, "buckets": r0["buckets"],
                       "copy_engine": r0["reason"] or "on",
                       "equal_to_nccl": r0.get("equal_to_nccl"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
