"""The elementwise and row kernels (csrc/embedding.cu, layer_norm.cu, dropout_fusions.cu) against
PyTorch eager.

    python bench/kernels.py elementwise          # table: tokens 4096..32768, hidden 512/1024, fp16
    python bench/kernels.py elementwise --dtype bf16 --tokens 8192 --hidden 1024
    python bench/kernels.py elementwise --smoke  # every kernel path once, tiny (compute-sanitizer)

For each op and size: our op (forward and backward timed separately, calling the registered
``torch.ops.ls_fairseq`` ops), PyTorch eager doing the same work (``native_layer_norm`` /
``native_layer_norm_backward``; ``residual + F.dropout(x + b)`` and its autograd backward; ...),
the bandwidth our op achieves counting the fewest bytes it must move (every input read once,
every output written once) and that bandwidth as a percentage of a device-to-device copy measured
here (bytes read + bytes written). Times are medians of CUDA-event timings, each after writing a
256 MiB buffer so that no input is served from L2. Bias+activation+dropout runs at the FFN width
(4 x hidden). Dropout p = 0.1.
"""
import argparse
import math
import statistics
import sys

import torch
import torch.nn.functional as F

from ls_fairseq.ops import _extension  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
P = 0.1
PAD = 1


def _ops():
    if not _extension.load():
        sys.exit(f"CUDA extension unavailable: {_extension.failure_reason()}")
    # the autograd/fake registrations of every binding (embedding_fwd's autograd is Python)
    from ls_fairseq.ops import load_kernels

    load_kernels()

    return torch.ops.ls_fairseq


class Timer:
    def __init__(self, reps):
        self.reps = reps
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn):
        for _ in range(3):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for s, e in zip(starts, ends):
            self.flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_bandwidth(timer):
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    a.random_(0, 255)
    b = torch.empty_like(a)
    ms = timer(lambda: b.copy_(a))
    return 2 * n / (ms * 1e-3) / 1e9


def _grad(out, inputs, g):
    return lambda: torch.autograd.grad(out, inputs, g, retain_graph=True)


def cases(ops, tokens, hidden, dtype):
    """(op name, C, bytes, ours fn, eager fn) for one size."""
    dev = "cuda"
    es = torch.finfo(dtype).bits // 8
    N, C = tokens, hidden
    x = torch.randn(N, C, device=dev, dtype=dtype)
    w = (1 + 0.1 * torch.randn(C, device=dev)).to(dtype)
    b = (0.1 * torch.randn(C, device=dev)).to(dtype)
    g = torch.randn(N, C, device=dev, dtype=dtype)
    res = torch.randn(N, C, device=dev, dtype=dtype)
    out = []

    # LayerNorm
    y, mean, rstd = ops.layer_norm_fwd(x, w, b, 1e-5, False)
    _, m_t, r_t = torch.ops.aten.native_layer_norm(x, [C], w, b, 1e-5)
    out.append(("layer_norm fwd", C, 2 * N * C * es + 8 * N,
                lambda: ops.layer_norm_fwd(x, w, b, 1e-5, False),
                lambda: torch.ops.aten.native_layer_norm(x, [C], w, b, 1e-5)))
    out.append(("layer_norm bwd", C, 3 * N * C * es + 8 * N,
                lambda: ops.layer_norm_bwd(g, x, w, b, mean, rstd, False, True, True),
                lambda: torch.ops.aten.native_layer_norm_backward(g, x, [C], m_t, r_t, w, b,
                                                                  [True, True, True])))
    out.append(("layer_norm bwd (invertible)", C, 3 * N * C * es + 4 * N,
                lambda: ops.layer_norm_bwd(g, y, w, b, None, rstd, True, True, True),
                None))

    # bias + dropout + residual
    _, rng = ops.bias_dropout_residual_fwd(x, b, res, P, True)
    xe, be, re = (t.clone().requires_grad_() for t in (x, b, res))
    eager_out = re + F.dropout(xe + be, P, True)
    out.append(("bias_dropout_residual fwd", C, 3 * N * C * es,
                lambda: ops.bias_dropout_residual_fwd(x, b, res, P, True),
                lambda: res + F.dropout(x + b, P, True)))
    out.append(("bias_dropout_residual bwd", C, 2 * N * C * es,
                lambda: ops.bias_dropout_residual_bwd(g, rng, P, True, True),
                _grad(eager_out, (xe, be, re), g)))

    # bias + activation + dropout at the FFN width
    F4 = 4 * C
    xf = torch.randn(N, F4, device=dev, dtype=dtype)
    bf = (0.1 * torch.randn(F4, device=dev)).to(dtype)
    gf = torch.randn(N, F4, device=dev, dtype=dtype)
    for act, fn in (("relu", F.relu), ("gelu", lambda t: F.gelu(t.float()).type_as(t))):
        out_f, rng_f = ops.bias_act_dropout_fwd(xf, bf, act, P, True)
        xfe, bfe = xf.clone().requires_grad_(), bf.clone().requires_grad_()
        eager_f = F.dropout(fn(xfe + bfe), P, True)
        out.append((f"bias_{act}_dropout fwd", F4, 2 * N * F4 * es,
                    (lambda a=act: ops.bias_act_dropout_fwd(xf, bf, a, P, True)),
                    (lambda f=fn: F.dropout(f(xf + bf), P, True))))
        # the op's autograd runs relu's backward from the output (relu_dropout_bwd)
        bwd = ((lambda o=out_f: ops.relu_dropout_bwd(gf, o, P, True, True)) if act == "relu" else
               (lambda a=act, r=rng_f: ops.bias_act_dropout_bwd(gf, xf, bf, r, a, P, True, True)))
        out.append((f"bias_{act}_dropout bwd", F4, 3 * N * F4 * es, bwd,
                    _grad(eager_f, (xfe, bfe), gf)))

    # embedding: vocab 32000, learned positions, sentences of 64 tokens
    V, T = 32000, 64
    B = max(1, N // T)
    tok = torch.randint(2, V, (B, T), device=dev)
    pos = torch.arange(T, device=dev).expand(B, T) + PAD + 1
    E = (0.05 * torch.randn(V, C, device=dev)).to(dtype)
    Pt = (0.05 * torch.randn(T + PAD + 1, C, device=dev)).to(dtype)
    ge = torch.randn(B, T, C, device=dev, dtype=dtype)
    scale = math.sqrt(C)
    _, rng_e = ops.embedding_fwd(tok, pos, E, Pt, scale, PAD, P, True, True)
    Ee, Pe = E.clone().requires_grad_(), Pt.clone().requires_grad_()
    from ls_fairseq.ops.embedding import transformer_embedding_reference as emb_ref

    eager_e = emb_ref(tok, pos, Ee, Pe, scale, PAD, P, True, True)
    NE = B * T
    out.append(("embedding fwd", C, 3 * NE * C * es + 8 * NE,
                lambda: ops.embedding_fwd(tok, pos, E, Pt, scale, PAD, P, True, True),
                lambda: emb_ref(tok, pos, E, Pt, scale, PAD, P, True, True)))
    for det in (False, True):
        out.append((f"embedding bwd ({'sorted' if det else 'atomic'})", C,
                    NE * C * es + (V + T + PAD + 1) * C * es + 8 * NE,
                    (lambda d=det: ops.embedding_bwd(ge, tok, pos, E, Pt, rng_e, scale, PAD, P, True,
                                                     True, True, True, d)),
                    _grad(eager_e, (Ee, Pe), ge) if not det else None))
    return out


def run_bench(args):
    ops = _ops()
    dtype = DTYPES[args.dtype]
    timer = Timer(args.reps)
    bw = copy_bandwidth(timer)
    name = torch.cuda.get_device_name(0)
    lines = [
        f"device: {name}; torch {torch.__version__}; dtype {args.dtype}; dropout p={P}",
        f"measured device-to-device copy: {bw:.0f} GB/s (read + write)",
        "",
        "| op | tokens | C | ours ms | eager ms | speedup | ours GB/s | % of copy |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    print("\n".join(lines), flush=True)
    for hidden in args.hidden:
        for tokens in args.tokens:
            for op, C, nbytes, ours, eager in cases(ops, tokens, hidden, dtype):
                t_ours = timer(ours)
                t_eager = timer(eager) if eager is not None else float("nan")
                gbs = nbytes / (t_ours * 1e-3) / 1e9
                line = (f"| {op} | {tokens} | {C} | {t_ours:.4f} | "
                        f"{'-' if math.isnan(t_eager) else f'{t_eager:.4f}'} | "
                        f"{'-' if math.isnan(t_eager) else f'{t_eager / t_ours:.2f}x'} | "
                        f"{gbs:.0f} | {100 * gbs / bw:.0f}% |")
                print(line, flush=True)
                lines.append(line)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


def run_smoke():
    """Each kernel path once on tiny inputs: for compute-sanitizer (memcheck / racecheck)."""
    ops = _ops()
    from ls_fairseq.ops.layer_norm import layer_norm_cuda

    torch.manual_seed(0)
    for dtype in (torch.float16, torch.float32):
        # LayerNorm: warp path (vector / scalar), block path, multi-row and block backward
        for rows, C in ((5, 64), (3, 17), (4, 520), (3, 2048), (2, 3000), (2, 1030)):
            x = torch.randn(rows, C, device="cuda", dtype=dtype, requires_grad=True)
            w = torch.randn(C, device="cuda", dtype=dtype, requires_grad=True)
            b = torch.randn(C, device="cuda", dtype=dtype, requires_grad=True)
            layer_norm_cuda(x, w, b).sum().backward()
            layer_norm_cuda(x, w, b, invertible=True).sum().backward()
        for rows, C in ((5, 64), (3, 17), (9, 1026)):
            x = torch.randn(rows, C, device="cuda", dtype=dtype, requires_grad=True)
            b = torch.randn(C, device="cuda", dtype=dtype, requires_grad=True)
            r = torch.randn(rows, C, device="cuda", dtype=dtype, requires_grad=True)
            out, _ = ops.bias_dropout_residual_fwd(x, b, r, 0.1, True)
            out.sum().backward()
            for act in ("relu", "gelu"):
                out, _ = ops.bias_act_dropout_fwd(x, b, act, 0.1, True)
                out.sum().backward()
        for C in (64, 17):
            tok = torch.tensor([[4, 5, 4, 1], [6, 4, 1, 1], [1, 1, 1, 1]], device="cuda")
            pos = torch.tensor([[2, 3, 4, 1], [2, 3, 1, 1], [1, 1, 1, 1]], device="cuda")
            E = torch.randn(8, C, device="cuda", dtype=dtype, requires_grad=True)
            Pt = torch.randn(6, C, device="cuda", dtype=dtype, requires_grad=True)
            for det in (False, True):
                o, rng = ops.embedding_fwd(tok, pos, E, Pt, 2.0, PAD, 0.1, True, True)
                ops.embedding_bwd(torch.ones_like(o), tok, pos, E, Pt, rng, 2.0, PAD, 0.1, True,
                                  True, True, True, det)
    torch.cuda.synchronize()
    print("smoke: all kernels ran")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="kernels.py elementwise",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--smoke", action="store_true", help="run every kernel once, tiny sizes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    if args.smoke:
        run_smoke()
    else:
        run_bench(args)


if __name__ == "__main__":
    main()
