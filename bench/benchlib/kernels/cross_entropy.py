"""Benchmark: label-smoothed cross-entropy forward + backward, fairseq's path vs the fused kernels.

fairseq's path (what ``label_smoothed_cross_entropy`` runs): ``log_softmax(logits, dtype=fp32)``
+ ``label_smoothed_nll_loss`` (gather, sum, masks), and autograd back to the fp16 logits.
Ours: ``ls_cross_entropy_fwd`` (one read of the logits) + ``ls_cross_entropy_bwd`` (one read, one
write), out of place and in place over the logits (what the criterion uses on the GPU).

Second table: output projection + CE (``hidden @ W.T`` then the loss, forward + backward) with
fairseq's CE, with the fused CE, and chunked (``--ls-fused-output-ce``).

Prints median time (CUDA events) and peak memory above the inputs. Usage:
    python bench/kernels.py cross_entropy [--dtype fp16|bf16] [--reps 20] [--quick]
"""
import argparse
import statistics

import torch
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

from ls_fairseq.ops import _extension

PAD = 1
EPS = 0.1


class _Passthrough(torch.autograd.Function):
    """Non-leaf view of a leaf (like a decoder output), so the in-place backward is allowed.
    Its backward drops the gradient (in training the output projection's backward consumes it):
    otherwise accumulating a gradient that aliases the leaf would add a full copy to the time."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return None


def _fairseq_ce(logits, target):
    lprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # fairseq utils.log_softmax
    loss, _ = label_smoothed_nll_loss(lprobs.view(-1, lprobs.size(-1)), target, EPS,
                                      ignore_index=PAD)
    return loss


def _ours(inplace):
    from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy_rows_cuda

    def run(logits, target):
        rows = label_smoothed_cross_entropy_rows_cuda(logits, target, EPS, PAD,
                                                      inplace_backward=inplace)
        return rows[0].sum()
    return run


def _measure(fn, make_inputs, reps):
    """Median ms of fn(inputs) forward+backward, and peak bytes above the inputs."""
    times, peak = [], 0
    for r in range(reps + 3):
        inputs = make_inputs()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = fn(*inputs)
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        peak = max(peak, torch.cuda.max_memory_allocated() - base)
        if r >= 3:
            times.append(start.elapsed_time(end))
        del loss, inputs
    return statistics.median(times), peak


def bench_ce(dtype, reps, shapes):
    rows = []
    for n, v in shapes:
        src = (torch.randn(n, v, device="cuda") * 3).to(dtype)
        target = torch.randint(0, v, (n,), device="cuda")
        target[torch.rand(n, device="cuda") < 0.05] = PAD

        def make_leaf():
            return (src.clone().requires_grad_(), target)

        def make_nonleaf():
            x = src.clone().requires_grad_()
            return (_Passthrough.apply(x), target)

        res = {}
        res["fairseq"] = _measure(_fairseq_ce, make_leaf, reps)
        res["ours"] = _measure(_ours(False), make_leaf, reps)
        res["ours_inplace"] = _measure(_ours(True), make_nonleaf, reps)
        # bytes the fused path must move: fwd reads N*V, bwd reads N*V and writes N*V
        gbps = 3 * n * v * src.element_size() / (min(res["ours"][0], res["ours_inplace"][0])
                                                 * 1e-3) / 1e9
        rows.append((n, v, res, gbps))
        del src
        torch.cuda.empty_cache()
    print(f"\nCross-entropy forward+backward, {dtype}, label smoothing {EPS} "
          f"(median of {reps}; memory = peak above the logits)")
    print(f"{'tokens':>7} {'vocab':>6} | {'fairseq ms':>10} {'ours ms':>8} {'inplace ms':>10} "
          f"{'speedup':>7} | {'fairseq MiB':>11} {'ours MiB':>9} {'inplace MiB':>11} | "
          f"{'GB/s':>6}")
    for n, v, res, gbps in rows:
        f, o, i = res["fairseq"], res["ours"], res["ours_inplace"]
        print(f"{n:>7} {v:>6} | {f[0]:>10.3f} {o[0]:>8.3f} {i[0]:>10.3f} "
              f"{f[0] / min(o[0], i[0]):>6.1f}x | "
              f"{f[1] / 2**20:>11.0f} {o[1] / 2**20:>9.0f} {i[1] / 2**20:>11.0f} | {gbps:>6.0f}")


def bench_output_ce(dtype, reps, shapes, d=1024):
    from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy_rows_cuda
    from ls_fairseq.ops.fused_output_cross_entropy import fused_output_cross_entropy

    print(f"\nOutput projection (D={d}) + CE, forward+backward, {dtype} "
          f"(median of {reps}; memory = peak above hidden + weight)")
    print(f"{'tokens':>7} {'vocab':>6} | {'fairseq ms':>10} {'fusedCE ms':>10} "
          f"{'chunked ms':>10} | {'fairseq MiB':>11} {'fusedCE MiB':>11} {'chunked MiB':>11}")
    for n, v in shapes:
        h0 = torch.randn(n, d, device="cuda").to(dtype)
        w0 = (torch.randn(v, d, device="cuda") / d**0.5).to(dtype)
        target = torch.randint(0, v, (n,), device="cuda")

        def make():
            return (h0.clone().requires_grad_(), w0.clone().requires_grad_(), target)

        def fairseq(h, w, t):
            return _fairseq_ce(h @ w.t(), t)

        def fused_ce(h, w, t):
            rows = label_smoothed_cross_entropy_rows_cuda(h @ w.t(), t, EPS, PAD,
                                                          inplace_backward=True)
            return rows[0].sum()

        def chunked(h, w, t):
            return fused_output_cross_entropy(h, w, t, EPS, PAD)[0]

        res = [_measure(fn, make, reps) for fn in (fairseq, fused_ce, chunked)]
        print(f"{n:>7} {v:>6} | {res[0][0]:>10.3f} {res[1][0]:>10.3f} {res[2][0]:>10.3f} | "
              f"{res[0][1] / 2**20:>11.0f} {res[1][1] / 2**20:>11.0f} "
              f"{res[2][1] / 2**20:>11.0f}")
        del h0, w0
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kernels.py cross_entropy",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    args = ap.parse_args(argv)
    assert _extension.load(), _extension.failure_reason()
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    tokens = [4096, 16384] if args.quick else [4096, 8192, 16384, 32768]
    vocabs = [32000, 40000] if args.quick else [32000, 40000]
    shapes = [(n, v) for n in tokens for v in vocabs]
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    bench_ce(dtype, args.reps, shapes)
    bench_output_ce(dtype, max(5, args.reps // 2),
                    [(4096, 40000), (16384, 40000)] if args.quick else
                    [(4096, 40000), (16384, 40000), (32768, 40000)])


if __name__ == "__main__":
    main()
