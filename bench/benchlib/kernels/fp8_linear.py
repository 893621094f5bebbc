"""GPU time of the FP8 linear layer (``--ls-fp8``) against the 16-bit one, per linear shape of a
model and summed over one training step, with the FP8 time split into its parts.

Which linears run FP8, and their shapes, come from the model itself: ``--arch`` (default
transformer big) is built from fairseq's parser with ``--ls-fp8`` and runs one small training
forward on the CPU with ``fp8_linear`` recorded (each call's K, N, bias, and whether its rows are
the batch's source or target positions). Each distinct shape is then timed with ``--tokens`` rows
(a batch's source and target positions both taken as ``--tokens``).

Per shape, milliseconds (CUDA events, mean over ``--iters`` replays of the call captured in a
CUDA graph, as ``--ls-cuda-graphs`` runs the step, or eager calls with ``--no-graphs``; wall
clock on the CPU):

* ``linear_16bit``: ``F.linear`` forward + backward (gradients of x, weight and bias) in
  ``--dtype``;
* ``linear_fp8``: ``fp8_linear`` forward + backward, as the model runs it;
* its parts, each timed alone: the quantization of x and of the weight (forward), of the output
  gradient with its transposed copy (backward), the transposes of the weight's and x's float8
  copies (backward), the three float8 GEMMs, the bias gradient; ``rest`` is ``linear_fp8`` less
  the parts (autograd, allocation, launch gaps);
* ``gemms_16bit``: the three matmuls alone in ``--dtype``.

The step's total is each shape's time times its calls per forward. Which way the FP8 path
goes (``torch._scaled_mm`` or the float32 reference) is ``fp8_linear``'s own choice for the
shape; the table says which. On the CPU (``--device cpu``) only the reference runs: that run
checks the script, not speed.

    python bench/kernels.py fp8_linear --tokens 4096 8192 16384 --json $OUT/fp8_linear.json

``--json``: benchlib/results.py's schema, a row per (tokens, shape), the per-step totals
(``steps``) and the model's calls beside them.
"""
import argparse
import os
import shlex
import sys
import time
from collections import Counter
from unittest import mock

import torch
import torch.nn.functional as F

from benchlib import results
from benchlib.timing import cuda_event_ms
from ls_fairseq.modules import sublayers
from ls_fairseq.ops import _extension
from ls_fairseq.ops import fp8_linear as fp8
from ls_fairseq.testing.fairseq_helpers import build_model, make_dictionary, random_sample

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: the parts of the FP8 path, in the order of the table
PARTS = ("quantize_x", "quantize_w", "quantize_grad", "transposes", "gemms_fp8", "bias_grad")


def linear_calls(arch, extra=()):
    """``Counter`` of ``(side, K, N, bias)`` over the ``fp8_linear`` calls of one training forward
    of ``arch`` with ``--ls-fp8`` (side: "source" or "target", whose positions are the rows)."""
    src_len, tgt_len, bsz = 5, 7, 2  # distinct row counts: 10 source, 14 target positions
    dictionary = make_dictionary()
    model = build_model(arch, dictionary, ["--ls-fp8", *extra])
    model.train()
    sample = random_sample(dictionary, bsz, src_len, tgt_len, torch.Generator().manual_seed(1))
    sides = {bsz * src_len: "source", bsz * tgt_len: "target"}
    calls = Counter()

    def record(x, weight, bias=None):
        rows = x.numel() // x.size(-1)
        if rows not in sides:
            raise RuntimeError(f"an fp8_linear call of {rows} rows: neither the source "
                               f"({bsz * src_len}) nor the target ({bsz * tgt_len}) positions")
        calls[sides[rows], weight.size(1), weight.size(0), bias is not None] += 1
        return F.linear(x, weight, bias)

    # linear_of reads the module's global at each call. The recording forward runs on the CPU:
    # the reference ops, even where the timed runs require the kernels (under
    # LS_FAIRSEQ_KERNELS=require a CPU tensor is an error)
    with mock.patch.object(sublayers, "fp8_linear", record), \
            mock.patch.dict(os.environ, {_extension.ENV_VAR: "off"}), torch.no_grad():
        model(**sample["net_input"])
    if not calls:
        raise RuntimeError(f"{arch} with --ls-fp8 made no fp8_linear call in training")
    return calls


def graph_replay_ms(fn, iters):
    """GPU ms of ``fn`` captured in a CUDA graph and replayed, as the training step runs it
    (``--ls-cuda-graphs``): the host's launch time drops out."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (allocator, cuBLAS handles)
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        return cuda_event_ms(graph.replay, iters)
    finally:
        del graph


def timer(device, iters, graphs):
    if device.type == "cuda":
        if graphs:
            return lambda fn: graph_replay_ms(fn, iters)
        return lambda fn: cuda_event_ms(fn, iters)

    def wall_ms(fn):
        fn()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1000 / iters
    return wall_ms


def time_shape(rows, k, n, bias, dtype, device, iters, graphs=True):
    """The row of one shape: milliseconds of the 16-bit and FP8 forward + backward, the FP8
    path's parts, and the 16-bit GEMMs alone."""
    ms = timer(device, iters, graphs)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, k, device=device, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(n, k, device=device, generator=gen) * k ** -0.5).to(dtype).requires_grad_()
    b = torch.zeros(n, device=device, dtype=dtype, requires_grad=True) if bias else None
    g = torch.randn(rows, n, device=device, generator=gen).to(dtype)
    leaves = [t for t in (x, w, b) if t is not None]

    def fwd_bwd(linear):
        return lambda: torch.autograd.grad(linear(x, w, b), leaves, g)

    scaled_mm = fp8._use_scaled_mm(x, w, b)
    matmul = fp8._matmul(scaled_mm)
    x8, x_inv, _ = fp8._quantize(x.detach(), fp8.E4M3, scaled_mm)
    w8, w_inv, _ = fp8._quantize(w.detach(), fp8.E4M3, scaled_mm)
    g8, g_inv, g8_t = fp8._quantize(g, fp8.E5M2, scaled_mm, fp8.ALIGN)
    w8_t = fp8._transposed(w8, 1, scaled_mm)
    x8_t = fp8._transposed(x8, fp8.ALIGN, scaled_mm)
    xd, wd, bd = x.detach(), w.detach(), None if b is None else b.detach()
    row = dict(rows=rows, k=k, n=n, bias=bias, path="_scaled_mm" if scaled_mm else "reference")
    row["linear_16bit"] = ms(fwd_bwd(F.linear))
    row["linear_fp8"] = ms(fwd_bwd(fp8.fp8_linear))
    row["quantize_x"] = ms(lambda: fp8._quantize(xd, fp8.E4M3, scaled_mm))
    row["quantize_w"] = ms(lambda: fp8._quantize(wd, fp8.E4M3, scaled_mm))
    row["quantize_grad"] = ms(lambda: fp8._quantize(g, fp8.E5M2, scaled_mm, fp8.ALIGN))
    row["transposes"] = ms(lambda: (fp8._transposed(w8, 1, scaled_mm),
                                    fp8._transposed(x8, fp8.ALIGN, scaled_mm)))
    row["gemms_fp8"] = ms(lambda: (matmul(x8, x_inv, w8, w_inv, dtype, bd),
                                   matmul(g8, g_inv, w8_t, w_inv, dtype),
                                   matmul(g8_t, g_inv, x8_t, x_inv, dtype)))
    row["bias_grad"] = ms(lambda: g.sum(0, dtype=torch.float32).to(dtype)) if bias else 0.0
    row["rest"] = row["linear_fp8"] - sum(row[p] for p in PARTS)
    row["gemms_16bit"] = ms(lambda: (torch.mm(xd, wd.t()), torch.mm(g, wd), torch.mm(g.t(), xd)))
    # 2 * rows * k * n FLOPs per GEMM
    row["gemm_tflops_fp8"] = 6 * rows * k * n / row["gemms_fp8"] / 1e9
    row["gemm_tflops_16bit"] = 6 * rows * k * n / row["gemms_16bit"] / 1e9
    return row


def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="kernels.py fp8_linear",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="ls_transformer_wmt_en_de_big_t2t")
    ap.add_argument("--model-args", default="",
                    help="more model arguments for the parser, one string (e.g. "
                         "'--encoder-layers 2')")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192],
                    help="rows of every linear: a batch's source and target positions")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-graphs", action="store_true",
                    help="time eager calls back to back (the host's launch time may then show) "
                         "instead of replays of each call captured in a CUDA graph")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU here (--device cpu checks the script only)")
    dtype = DTYPES[a.dtype]
    calls = linear_calls(a.arch, shlex.split(a.model_args))
    shapes = sorted({(k, n, bias) for (_, k, n, bias) in calls})
    per_shape = {s: sum(c for (_, k, n, bias), c in calls.items() if (k, n, bias) == s)
                 for s in shapes}
    rows, steps = [], []
    timing = "eager" if a.no_graphs or device.type != "cuda" else "graph replays"
    print(f"{a.arch}, {a.dtype}, {device_name(device)}, {timing}; "
          f"fp8_linear calls per forward: {sum(calls.values())}\n")
    print("| tokens | K x N | bias | calls | path | 16-bit ms | fp8 ms | fp8 / 16-bit | "
          "quantize x | quantize w | quantize grad + T | transposes | fp8 GEMMs (TFLOP/s) | "
          "bias grad | rest | 16-bit GEMMs (TFLOP/s) |")
    print("|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tokens in a.tokens:
        total = Counter()
        for k, n, bias in shapes:
            row = time_shape(tokens, k, n, bias, dtype, device, a.iters, not a.no_graphs)
            row.update(tokens=tokens, calls=per_shape[k, n, bias])
            rows.append(row)
            # PARTS holds gemms_fp8: each key once
            for key in ("linear_16bit", "linear_fp8", "gemms_16bit", *PARTS, "rest"):
                total[key] += row["calls"] * row[key]
            print(f"| {tokens} | {k} x {n} | {'yes' if bias else 'no'} | {row['calls']} | "
                  f"{row['path']} | {row['linear_16bit']:.3f} | {row['linear_fp8']:.3f} | "
                  f"{row['linear_fp8'] / row['linear_16bit']:.2f} | {row['quantize_x']:.3f} | "
                  f"{row['quantize_w']:.3f} | {row['quantize_grad']:.3f} | "
                  f"{row['transposes']:.3f} | {row['gemms_fp8']:.3f} "
                  f"({row['gemm_tflops_fp8']:.0f}) | {row['bias_grad']:.3f} | "
                  f"{row['rest']:.3f} | {row['gemms_16bit']:.3f} "
                  f"({row['gemm_tflops_16bit']:.0f}) |")
        step = dict(tokens=tokens, **total)
        steps.append(step)
        print(f"| {tokens} | **per step** | | {sum(per_shape.values())} | | "
              f"{step['linear_16bit']:.2f} | {step['linear_fp8']:.2f} | "
              f"{step['linear_fp8'] / step['linear_16bit']:.2f} | {step['quantize_x']:.2f} | "
              f"{step['quantize_w']:.2f} | {step['quantize_grad']:.2f} | "
              f"{step['transposes']:.2f} | {step['gemms_fp8']:.2f} | {step['bias_grad']:.2f} | "
              f"{step['rest']:.2f} | {step['gemms_16bit']:.2f} |")
    if a.json:
        head = results.header(
            "bench/kernels.py", f"FP8 linear layer against the 16-bit one per linear shape of "
            f"{a.arch}, {a.dtype}, tokens {a.tokens}",
            "python bench/kernels.py fp8_linear " + shlex.join(argv), device=device_name(device),
            torch=torch.__version__)
        calls_json = [dict(side=s, k=k, n=n, bias=b, calls=c)
                      for (s, k, n, b), c in sorted(calls.items())]
        results.write(a.json, head, rows, timing=timing, calls=calls_json, steps=steps)
    return rows, steps, calls


if __name__ == "__main__":
    main()
