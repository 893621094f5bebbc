"""Attention benchmark: ls_fairseq's CUDA attention vs fairseq's attention path, fwd+bwd, on the GPU.

Two tables, both at WMT-like batches of ~8192 tokens (H=16, D=64 as in transformer big):

* core: the attention op alone (q/k/v given, out [B, H, Tq, D], then backward):
  - ``ls short`` / ``ls short packed``: backend "short" (csrc/short_attention.cu, one block per
    (batch, head), rows of <= 128; longer rows fall through to "efficient", so those rows repeat it);
  - ``ls efficient``: ls_fairseq attention_cuda, backend "efficient" (PyTorch's fused
    memory-efficient kernel, key padding as a zero-stride bias, causal without a mask tensor);
  - ``ls softmax``: backend "softmax" (cuBLAS GEMMs around csrc/attention.cu's fused
    scale/mask/softmax/dropout kernel), q/k/v as strided views of the packed projection;
  - ``ls softmax contig``: the same with contiguous [B, H, T, D] q/k/v (what a transform kernel in
    front would give; shows the cost of torch.matmul's copies of strided views);
  - ``F.mha sdpa``: what fairseq's self-attention runs (torch.nn.functional.multi_head_attention_forward
    with need_weights=False: float mask built from the padding (+ causal) mask, then
    scaled_dot_product_attention), with cuDNN attention allowed (default) and with it disabled;
  - ``manual bmm``: fairseq's own bmm/softmax/dropout/bmm path (what its cross attention and
    incremental decoding run).
* module: a whole attention block (projections + attention + output projection, fwd+bwd):
  fairseq's MultiheadAttention (cuDNN on / off) vs the same weights through one packed projection
  GEMM + ls attention + output projection (what the ls_ modules do).

Every row gives the first call on a shape the process has not seen (synchronised wall time: this
is where per-shape planning shows), the steady-state time per fwd+bwd (CUDA events, mean of
--iters) and the peak extra memory of one fwd+bwd.

    python bench/kernels.py attention [--dtypes fp16,bf16] [--dropout 0.1] [--iters 10] [--md out.md]
    python bench/kernels.py attention --sanitize     # small fwd+bwd workload for compute-sanitizer
"""
import argparse
import contextlib
import os
import time

import torch
import torch.nn.functional as F

from benchlib.timing import cuda_event_ms

from ls_fairseq.ops import _extension  # noqa: E402
from ls_fairseq.ops.attention import attention_cuda, attention_cuda_packed  # noqa: E402
from ls_fairseq.ops.attention import attention_reference  # noqa: E402

DEV = "cuda"
H, D = 16, 64
SHAPES = [(256, 32), (128, 64), (64, 128), (32, 256), (16, 512), (8, 1024), (5, 1500)]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def padding_mask(b, t, left, seed=0):
    """Lengths spread over [0.6 t, t] (a length-bucketed batch), one row unpadded."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, int(0.6 * t)), t + 1, (b,), generator=g)
    lens[0] = t
    pos = torch.arange(t)
    mask = pos[None, :] < (t - lens)[:, None] if left else pos[None, :] >= lens[:, None]
    return mask.to(DEV)


@contextlib.contextmanager
def cudnn_sdp(enabled):
    old = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(old)


def gpu_ms(fn, iters):
    """GPU time of one call: the sum of its kernels' durations (torch.profiler), so launch and
    Python overhead (which the wall time includes when the GPU idles between small kernels) is
    left out. NaN when the profiler is unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        total = 0.0
        for e in prof.key_averages():
            total += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        return total / 1e3 / iters
    except Exception as exc:  # noqa: BLE001
        print("profiler failed:", exc)
        return float("nan")


def timed(fn, iters, gpu=False):
    """(first-call ms, steady wall ms per call, GPU ms per call or NaN, peak extra MB of one call)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = (time.perf_counter() - t0) * 1e3
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    wall = cuda_event_ms(fn, iters, warmup=0)
    return first, wall, (gpu_ms(fn, max(3, iters // 2)) if gpu else float("nan")), peak


# ---------------------------------------------------------------------------------------------
# core


def core_methods(case, b, t, dtype, p):
    """name -> zero-arg fwd+bwd closure, for one problem."""
    causal = case == "dec"
    kpm = padding_mask(b, t, left=not causal)
    grad = torch.randn(b, H, t, D, device=DEV, dtype=dtype)
    # ls layout: B x T x C projections, packed
    if case == "cross":
        xq = torch.randn(b, t, H, D, device=DEV, dtype=dtype, requires_grad=True)
        xkv = torch.randn(b, t, 2, H, D, device=DEV, dtype=dtype, requires_grad=True)
        leaves = [xq, xkv]

        def views():
            k, v = xkv.permute(2, 0, 3, 1, 4)
            return xq.transpose(1, 2), k, v
    else:
        qkv = torch.randn(b, t, 3, H, D, device=DEV, dtype=dtype, requires_grad=True)
        leaves = [qkv]

        def views():
            return tuple(qkv.permute(2, 0, 3, 1, 4))

    contig = [torch.randn(b, H, t, D, device=DEV, dtype=dtype, requires_grad=True) for _ in range(3)]
    # fairseq / F.mha layout: T x B x C projections, one per q/k/v
    tbc = [torch.randn(t, b, H * D, device=DEV, dtype=dtype, requires_grad=True) for _ in range(3)]
    future = torch.triu(torch.full((t, t), float("-inf"), device=DEV, dtype=dtype), 1)

    def fmha_views():
        return [x.view(t, b * H, D).transpose(0, 1).view(b, H, t, D) for x in tbc]

    def fmha_core():
        # torch.nn.functional.multi_head_attention_forward, need_weights=False
        m = torch.zeros(b, t, device=DEV, dtype=dtype).masked_fill_(kpm, float("-inf"))
        m = m.view(b, 1, 1, t).expand(-1, H, -1, -1).reshape(b * H, 1, t)
        if causal:
            m = future + m
        q, k, v = fmha_views()
        return F.scaled_dot_product_attention(q, k, v, m.view(b, H, -1, t), dropout_p=p)

    def run(fn, tensors):
        def go():
            for x in tensors:
                x.grad = None
            fn().backward(grad)
        return go

    ms = {
        "ls short": run(lambda: attention_cuda(*views(), kpm, causal, p, True, backend="short"), leaves),
    }
    if case != "cross":
        ms["ls short packed"] = run(lambda: attention_cuda_packed(qkv, kpm, causal, p, True, "short"), leaves)
    ms["ls efficient"] = run(lambda: attention_cuda(*views(), kpm, causal, p, True, backend="efficient"), leaves)
    if case != "cross":
        ms["ls efficient packed"] = run(
            lambda: attention_cuda_packed(qkv, kpm, causal, p, True, "efficient"), leaves)
    ms.update({
        "ls softmax": run(lambda: attention_cuda(*views(), kpm, causal, p, True, backend="softmax"), leaves),
        "ls softmax contig": run(lambda: attention_cuda(*contig, kpm, causal, p, True, backend="softmax"), contig),
    })
    if case != "cross":  # fairseq's cross attention (static_kv) never takes the F.mha path

        def with_cudnn(enabled):
            def go():
                with cudnn_sdp(enabled):
                    for x in tbc:
                        x.grad = None
                    fmha_core().backward(grad)
            return go

        ms["F.mha sdpa cuDNN on"] = with_cudnn(True)
        ms["F.mha sdpa cuDNN off"] = with_cudnn(False)
    ms["manual bmm"] = run(
        lambda: attention_reference(*fmha_views(), kpm, causal, p, True)[0], tbc
    )
    return ms


# ---------------------------------------------------------------------------------------------
# module


def module_methods(case, b, t, dtype, p):
    from fairseq.modules.multihead_attention import MultiheadAttention

    cross = case == "cross"
    causal = case == "dec"
    e = H * D
    torch.manual_seed(0)
    m = MultiheadAttention(e, H, dropout=p, self_attention=not cross, encoder_decoder_attention=cross)
    m = m.to(DEV, dtype).train()
    kpm = padding_mask(b, t, left=not causal)
    x = torch.randn(t, b, e, device=DEV, dtype=dtype, requires_grad=True)
    enc = torch.randn(t, b, e, device=DEV, dtype=dtype, requires_grad=True) if cross else None
    grad = torch.randn(t, b, e, device=DEV, dtype=dtype)
    future = torch.triu(torch.full((t, t), float("-inf"), device=DEV, dtype=dtype), 1)

    def fairseq_fwd():
        if cross:
            return m(query=x, key=enc, value=enc, key_padding_mask=kpm, static_kv=True,
                     need_weights=False)[0]
        return m(query=x, key=x, value=x, key_padding_mask=kpm, need_weights=False,
                 attn_mask=future if causal else None)[0]

    def ls_fwd(backend, packed=False):
        xb = x.transpose(0, 1)
        if packed:
            w = torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight])
            bias = torch.cat([m.q_proj.bias, m.k_proj.bias, m.v_proj.bias])
            o = attention_cuda_packed(F.linear(xb, w, bias).view(b, t, 3, H, D), kpm, causal, p, True,
                                      backend)
            o = o.transpose(1, 2).reshape(b, t, e)
            return F.linear(o, m.out_proj.weight, m.out_proj.bias).transpose(0, 1)
        if cross:
            q = F.linear(xb, m.q_proj.weight, m.q_proj.bias).view(b, t, H, D).transpose(1, 2)
            w = torch.cat([m.k_proj.weight, m.v_proj.weight])
            bias = torch.cat([m.k_proj.bias, m.v_proj.bias])
            k, v = F.linear(enc.transpose(0, 1), w, bias).view(b, t, 2, H, D).permute(2, 0, 3, 1, 4)
        else:
            w = torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight])
            bias = torch.cat([m.q_proj.bias, m.k_proj.bias, m.v_proj.bias])
            q, k, v = F.linear(xb, w, bias).view(b, t, 3, H, D).permute(2, 0, 3, 1, 4)
        o = attention_cuda(q, k, v, kpm, causal, p, True, backend=backend)
        o = o.transpose(1, 2).reshape(b, t, e)
        return F.linear(o, m.out_proj.weight, m.out_proj.bias).transpose(0, 1)

    def run(fwd, cudnn=None):
        def go():
            with cudnn_sdp(cudnn) if cudnn is not None else contextlib.nullcontext():
                m.zero_grad(set_to_none=True)
                x.grad = None
                fwd().backward(grad)
        return go

    ms = {}
    if not cross:
        ms["fairseq MHA cuDNN on"] = run(fairseq_fwd, True)
        ms["fairseq MHA cuDNN off"] = run(fairseq_fwd, False)
    else:
        ms["fairseq MHA (bmm path)"] = run(fairseq_fwd)
    ms["ls short"] = run(lambda: ls_fwd("short"))
    if not cross:
        ms["ls short packed"] = run(lambda: ls_fwd("short", packed=True))
    ms["ls efficient"] = run(lambda: ls_fwd("efficient"))
    if not cross:
        ms["ls efficient packed"] = run(lambda: ls_fwd("efficient", packed=True))
    ms["ls softmax"] = run(lambda: ls_fwd("softmax"))
    return ms


# ---------------------------------------------------------------------------------------------


def warm_up(dtype, p):
    """Load every method's kernels on a tiny shape, so first-call figures show per-shape cost only."""
    for case in ("enc", "dec", "cross"):
        for fn in list(core_methods(case, 2, 8, dtype, p).values()) + list(module_methods(case, 2, 8, dtype, p).values()):
            fn()
    torch.cuda.synchronize()


def table(title, rows, ref_name):
    lines = [f"\n### {title}\n",
             "| case | B x T | method | first call ms | fwd+bwd wall ms | fwd+bwd GPU ms | vs ref (wall) "
             "| vs ref (GPU) | peak MB |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for (case, shape, name), (first, ms, gms, mb) in rows.items():
        ref = rows.get((case, shape, ref_name)) or rows.get((case, shape, "fairseq MHA (bmm path)")) \
            or rows.get((case, shape, "manual bmm"))
        speed = f"{ref[1] / ms:.2f}x" if ref else ""
        gspeed = f"{ref[2] / gms:.2f}x" if ref and gms == gms and ref[2] == ref[2] else ""
        g = f"{gms:.3f}" if gms == gms else "-"
        lines.append(f"| {case} | {shape} | {name} | {first:.1f} | {ms:.3f} | {g} | {speed} | {gspeed} | {mb:.0f} |")
    return "\n".join(lines)


def sanitize():
    """Small fwd+bwd workload touching every kernel variant, for compute-sanitizer."""
    for dtype in (torch.float16, torch.float32):
        for backend in ("short", "efficient", "softmax"):
            for tk in (5, 33, 128, 130, 1030):
                for case in ("enc", "dec", "cross"):
                    b, tq = 2, (tk if case != "cross" else 7)
                    q = torch.randn(b, 2, tq, 64, device=DEV, dtype=dtype, requires_grad=True)
                    k = torch.randn(b, 2, tk, 64, device=DEV, dtype=dtype, requires_grad=True)
                    v = torch.randn(b, 2, tk, 64, device=DEV, dtype=dtype, requires_grad=True)
                    kpm = torch.zeros(b, tk, dtype=torch.bool, device=DEV)
                    kpm[1, : tk // 2] = True
                    if tk == 33:
                        kpm[1] = True  # fully masked rows
                    out = attention_cuda(q, k, v, kpm, case == "dec", 0.1, True, backend=backend)
                    out.sum().backward()
                    if case != "cross":
                        qkv = torch.randn(b, tk, 3, 2, 64, device=DEV, dtype=dtype, requires_grad=True)
                        attention_cuda_packed(qkv, kpm, case == "dec", 0.1, True, backend).sum().backward()
    torch.cuda.synchronize()
    print("sanitize workload done")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kernels.py attention", description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--shapes", default=",".join(f"{b}x{t}" for b, t in SHAPES))
    ap.add_argument("--module-dtypes", default="fp16")
    ap.add_argument("--gpu-time-dtypes", default="fp16", help="dtypes whose rows also get profiler GPU time")
    ap.add_argument("--what", default="core,module", help="core, module or both (comma separated)")
    ap.add_argument("--md", default=None, help="also write the tables (markdown) to this file")
    ap.add_argument("--sanitize", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault(_extension.ENV_VAR, "require")
    assert _extension.load(), _extension.failure_reason()
    if args.sanitize:
        return sanitize()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    head = (f"GPU {torch.cuda.get_device_name(0)}, torch {torch.__version__}, cuDNN "
            f"{torch.backends.cudnn.version()}, H={H} D={D}, attention dropout {args.dropout}, "
            f"{args.iters} iters")
    print(head)
    out = [head]
    what = args.what.split(",")
    gpu_dtypes = args.gpu_time_dtypes.split(",")
    kinds = [  # (dtype names, the methods of a case, the table's title, its baseline method)
        (args.dtypes if "core" in what else "", core_methods,
         "Attention core, {} (fwd+bwd; 'vs' = speed-up over F.mha sdpa cuDNN on, or over the "
         "manual bmm path for cross attention)", "F.mha sdpa cuDNN on"),
        (args.module_dtypes if "module" in what else "", module_methods,
         "Attention block (projections + attention + out projection), {} ('vs' = speed-up over "
         "fairseq MultiheadAttention, cuDNN on)", "fairseq MHA cuDNN on")]
    for dnames, methods, title, baseline in kinds:
        for dname in filter(None, dnames.split(",")):
            dtype = DTYPES[dname]
            warm_up(dtype, args.dropout)
            rows = {}
            for case in ("enc", "dec", "cross"):
                for b, t in shapes:
                    for name, fn in methods(case, b, t, dtype, args.dropout).items():
                        rows[(case, f"{b}x{t}", name)] = timed(fn, args.iters,
                                                               dname in gpu_dtypes)
                    torch.cuda.empty_cache()
            txt = table(title.format(dname), rows, baseline)
            print(txt)
            out.append(txt)
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
