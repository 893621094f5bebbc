#!/usr/bin/env python3
"""GPU time of the cuBLASLt-epilogue GEMMs against the unfused kernels they replace, at
transformer-big shapes (csrc/gemm_epilogues.cpp; H100 figures in docs/PERFORMANCE.md, session 24).
Prints one table, ms per call, per layer:

* FFN backward through fc2's input gradient: ``mm(g, W2)`` then ``relu_dropout_bwd`` (reads the
  GEMM's output and h, writes grad_x, sums the bias gradient) against ``relu_dropout_dgrad``
  (DRELU_BGRAD epilogue);
* the FFN forward's elementwise pass without and with the bit-mask it now also writes;
* a linear's weight and bias gradients: ``mm(g^T, x)`` plus aten's ``g.sum(0)`` against
  ``linear_wgrad_bgrad`` (BGRADB epilogue), for the packed QKV (3072), the cross-attention q (1024)
  and the layer-batched encoder K/V (12288) projections.

    python bench/gemm_epilogues.py [--tokens 7552] [--iters 50]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import cuda_event_ms as gpu_ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[7552, 65536])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    from ls_fairseq.ops import _extension

    assert _extension.load(), _extension.failure_reason()
    ops = torch.ops.ls_fairseq
    half = dict(device="cuda", dtype=torch.float16)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| tokens | what | unfused ms | epilogue ms | saved ms |")
    print("|---:|---|---:|---:|---:|")
    for n in args.tokens:
        d, f, p = 1024, 4096, 0.1
        x = torch.randn(n, f, **half)
        b1 = torch.randn(f, **half)
        w2 = torch.randn(d, f, **half) / f ** 0.5
        g = torch.randn(n, d, **half)
        h, _ = ops.bias_act_dropout_fwd(x, b1, "relu", p, True)
        _, mask = ops.relu_dropout_mask_fwd(x, b1, p, True)
        scale = 1 / (1 - p)
        t_un = gpu_ms(lambda: ops.relu_dropout_bwd(torch.mm(g, w2), h, p, True, True), args.iters)
        t_ep = gpu_ms(lambda: ops.relu_dropout_dgrad(g, w2, mask, scale), args.iters)
        print(f"| {n} | FFN fc2 input grad + relu/dropout backward + fc1 bias grad | {t_un:.4f} "
              f"| {t_ep:.4f} | {t_un - t_ep:.4f} |")
        t_un = gpu_ms(lambda: ops.bias_act_dropout_fwd(x, b1, "relu", p, True), args.iters)
        t_ep = gpu_ms(lambda: ops.relu_dropout_mask_fwd(x, b1, p, True), args.iters)
        print(f"| {n} | FFN bias + relu + dropout forward (+ bit-mask) | {t_un:.4f} | {t_ep:.4f} "
              f"| {t_un - t_ep:.4f} |")
        for out_f, name in [(3072, "packed QKV"), (1024, "cross-attention q"),
                            (12288, "layer-batched K/V (6 layers)")]:
            gy = torch.randn(n, out_f, **half)
            xin = torch.randn(n, d, **half)
            t_un = gpu_ms(lambda: (torch.mm(gy.t(), xin), gy.sum(0)), args.iters)
            t_ep = gpu_ms(lambda: ops.linear_wgrad_bgrad(gy, xin), args.iters)
            print(f"| {n} | {name} weight + bias grad | {t_un:.4f} | {t_ep:.4f} "
                  f"| {t_un - t_ep:.4f} |")
        del x, h, mask, g


if __name__ == "__main__":
    main()
