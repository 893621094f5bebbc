#!/usr/bin/env python3
"""GPU time of the gradient bookkeeping kernels around the replayed backward (H100 figures in
docs/PERFORMANCE.md). Prints two tables:

* bias gradients of a linear layer, ``g.sum(0)`` (what aten's linear backward runs) against a GEMM
  with a ones vector, ``ones[1, N] @ g``, for the row/column counts of transformer big at ~7.5k and
  64k tokens (packed QKV 3072, layer-batched cross-attention K/V 12288), with the traffic floor at
  3 TB/s and each one's largest error against a float64 sum;
* the replay's gradient accumulation over transformer-big-sized fp16 parameters:
  ``_foreach_add_`` into the buffers, ``_foreach_copy_`` into them, and zeroing one flat buffer of
  the same size.

    python bench/grad_reductions.py
"""
import argparse

import torch

from timing import cuda_event_ms as gpu_ms  # noqa: E402


def bias_gradients(iters):
    print("| rows x columns | aten sum(0) ms | mm(ones, g) ms | sum(0, fp32) ms "
          "| floor ms (3 TB/s) | max error vs float64: sum / mm |")
    print("|---|---:|---:|---:|---:|---|")
    for n, c in [(7552, 1024), (7552, 3072), (7552, 12288), (65536, 3072), (65536, 1024)]:
        g = torch.randn(n, c, device="cuda", dtype=torch.float16)
        ones = torch.ones(1, n, device="cuda", dtype=torch.float16)
        t_sum = gpu_ms(lambda: g.sum(0), iters)
        t_mm = gpu_ms(lambda: torch.mm(ones, g), iters)
        t_f32 = gpu_ms(lambda: g.sum(0, dtype=torch.float32), iters)
        truth = g.double().sum(0)
        e_sum = (g.sum(0).double() - truth).abs().max().item()
        e_mm = (torch.mm(ones, g)[0].double() - truth).abs().max().item()
        floor = n * c * 2 / 3e12 * 1e3
        print(f"| {n} x {c} | {t_sum:.4f} | {t_mm:.4f} | {t_f32:.4f} | {floor:.4f} "
              f"| {e_sum:.3g} / {e_mm:.3g} |")


def accumulation(iters):
    # transformer big's weight matrices (12 layers x 4 attention + 2 FFN) plus small vectors and
    # the 32k x 1024 shared embedding
    sizes = [1024 * 1024] * 4 * 12 + [1024 * 4096] * 2 * 12 + [1024] * 200 + [32768 * 1024]
    acc = [torch.zeros(s, device="cuda", dtype=torch.float16) for s in sizes]
    grads = [torch.randn(s, device="cuda", dtype=torch.float16) for s in sizes]
    flat = torch.zeros(sum(sizes), device="cuda", dtype=torch.float16)
    t_add = gpu_ms(lambda: torch._foreach_add_(acc, grads), iters)
    t_copy = gpu_ms(lambda: torch._foreach_copy_(acc, grads), iters)
    t_zero = gpu_ms(lambda: flat.zero_(), iters)
    print("\n| fp16 parameters | _foreach_add_ ms | _foreach_copy_ ms | zero one flat buffer ms |")
    print("|---:|---:|---:|---:|")
    print(f"| {sum(sizes) / 1e6:.1f}M | {t_add:.3f} | {t_copy:.3f} | {t_zero:.3f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/grad_reductions.py needs a CUDA device")
    torch.manual_seed(0)
    bias_gradients(args.iters)
    accumulation(max(1, args.iters // 2))


if __name__ == "__main__":
    main()
