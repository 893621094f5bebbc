"""GPU time of the LayerNorm backward ops at transformer big's width (fp16, C = 1024): the fused
pre-LN boundary's backward (``bias_dropout_residual_layer_norm_bwd``: LayerNorm backward, the
residual gradient, y's gradient through the dropout mask, three column sums) and
``layer_norm_bwd`` with a residual gradient, with the bandwidth each reaches at its minimal traffic
(10 and 8 bytes per element).

To compare two trees, run it from each on the same GPU (each builds its own extension):

    python bench/kernels.py layer_norm_bwd new
    (cd /path/to/other/tree && PYTHONPATH=. python /path/to/this/bench/kernels.py layer_norm_bwd old)
"""
import argparse

import torch

from benchlib.timing import cuda_event_ms
from ls_fairseq.ops import _extension


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kernels.py layer_norm_bwd",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("tag", nargs="?", default="this tree", help="the tree's name in the table")
    tag = ap.parse_args(argv).tag
    assert _extension.load(), _extension.failure_reason()
    ops = torch.ops.ls_fairseq
    H = dict(device="cuda", dtype=torch.float16)
    C, p = 1024, 0.3
    print("| tree | rows x C | fused boundary bwd ms (TB/s at 10 B/elem) | "
          "layer_norm_bwd + residual grad ms (TB/s at 8 B/elem) |")
    print("|---|---|---:|---:|")
    for rows in (8520, 65536):  # ~ an 8192-token batch's positions; a large batch
        y, r = torch.randn(rows, C, **H), torch.randn(rows, C, **H)
        b, w, lb = torch.randn(C, **H), torch.randn(C, **H), torch.randn(C, **H)
        x, _, mean, rstd, rng = ops.bias_dropout_residual_layer_norm_fwd(y, b, r, w, lb, p, True, 1e-5)
        gh, gx = torch.randn(rows, C, **H), torch.randn(rows, C, **H)
        _, mean2, rstd2 = ops.layer_norm_fwd(x, w, lb, 1e-5, False)
        fused = cuda_event_ms(lambda: ops.bias_dropout_residual_layer_norm_bwd(
            gh, x, w, lb, mean, rstd, gx, rng, p, True, True, True, True), 100)
        plain = cuda_event_ms(lambda: ops.layer_norm_bwd(
            gh, x, w, lb, mean2, rstd2, False, True, True, gx), 100)
        n = rows * C
        print(f"| {tag} | {rows} x {C} | {fused:.4f} ({n * 10 / 1e9 / fused:.2f}) | "
              f"{plain:.4f} ({n * 8 / 1e9 / plain:.2f}) |")


if __name__ == "__main__":
    main()
