#!/usr/bin/env python3
"""All-reduce bandwidth between the GPUs of one host, through torch.distributed + NCCL, the path
fairseq's DDP takes. Prints a table of size, time and bus bandwidth (NCCL's convention: for
all-reduce, busbw = 2 (n-1)/n * bytes / time), plus what NCCL says about its transport.

    python bench/allreduce_bw.py --gpus 2              # fp16 buffers of 25 MB .. 420 MB
    NCCL_DEBUG=INFO python bench/allreduce_bw.py       # + NCCL's channel/transport lines

Keeps NVLink multicast off (NCCL_NVLS_ENABLE=0) as the device machines require.
"""
import argparse
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, sizes_mb, iters, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    rows = []
    for mb in sizes_mb:
        x = torch.ones(int(mb * 2**20) // 2, dtype=torch.float16, device="cuda")
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / iters
        ok = bool(torch.isfinite(x).all())
        busbw = 2 * (world - 1) / world * x.numel() * 2 / (ms * 1e-3) / 1e9
        rows.append(f"| {mb:g} | {ms:.2f} | {busbw:.1f} | {ok} |")
    if rank == 0:
        print("| MB (fp16) | ms per all_reduce | bus GB/s | finite |\n|---|---|---|---|")
        print("\n".join(rows), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 25, 100, 420])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--port", type=int, default=29517)
    args = ap.parse_args()
    n = args.gpus
    print(f"{n} GPUs: {[torch.cuda.get_device_name(i) for i in range(n)]}")
    for i in range(n):
        for j in range(n):
            if i != j:
                print(f"peer access {i}->{j}: {torch.cuda.can_device_access_peer(i, j)}")
    mp.spawn(worker, args=(n, args.sizes_mb, args.iters, args.port), nprocs=n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
