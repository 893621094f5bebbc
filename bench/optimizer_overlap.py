#!/usr/bin/env python3
"""Can the optimizer step hide under the next step's forward on a side stream? (H100 figures in
docs/PERFORMANCE.md.)

Adam over transformer-big-sized fp32 tensors (``torch._fused_adam_``: 28 bytes of traffic per
parameter, like ls_adam's step) runs on a side stream next to a forward-like chain on the current
stream: 12 layers of transformer big's GEMMs (QKV, output, FFN in and out) at ~7.5k tokens with a
ReLU and a LayerNorm. Prints the GPU time of each alone, one after the other, and side by side.

    python bench/optimizer_overlap.py
"""
import argparse

import torch
import torch.nn.functional as F

from timing import cuda_event_ms  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=7552)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/optimizer_overlap.py needs a CUDA device")
    torch.manual_seed(0)
    n, c, f = args.tokens, 1024, 4096
    x = torch.randn(n, c, device="cuda", dtype=torch.half)
    h = torch.randn(n, f, device="cuda", dtype=torch.half)
    w_qkv, w_out, w_fc1, w_fc2 = (torch.randn(o, i, device="cuda", dtype=torch.half) * 0.02
                                  for o, i in [(3 * c, c), (c, c), (f, c), (c, f)])

    def forward_like():
        for _ in range(12):
            F.linear(x, w_qkv)
            F.linear(x, w_out)
            torch.relu(F.linear(x, w_fc1))
            F.layer_norm(F.linear(h, w_fc2) + x, (c,))

    sizes = [c * c] * 4 * 12 + [c * f] * 2 * 12 + [c] * 200 + [32768 * c]
    params, grads, m, v = ([torch.randn(s, device="cuda") for s in sizes] for _ in range(4))
    steps = [torch.tensor(1.0, device="cuda") for _ in sizes]

    def adam():
        torch._fused_adam_(params, grads, m, v, [], steps, lr=1e-4, beta1=0.9, beta2=0.98,
                           weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)

    side = torch.cuda.Stream()

    def side_by_side():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            adam()
        forward_like()
        torch.cuda.current_stream().wait_stream(side)

    def one_after_the_other():
        adam()
        forward_like()

    def gpu_ms(fn):
        return cuda_event_ms(fn, args.iters, warmup=2)

    t_adam, t_fwd = gpu_ms(adam), gpu_ms(forward_like)
    t_seq, t_both = gpu_ms(one_after_the_other), gpu_ms(side_by_side)
    print("| parameters | Adam ms | forward-like ms | one after the other ms | side by side ms "
          f"| Adam hidden ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {sum(sizes) / 1e6:.1f}M | {t_adam:.3f} | {t_fwd:.3f} | {t_seq:.3f} | {t_both:.3f} "
          f"| {t_seq - t_both:.3f} |")


if __name__ == "__main__":
    main()
