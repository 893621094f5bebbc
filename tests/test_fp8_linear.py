"""``ls_fairseq.ops.fp8_linear`` and ``--ls-fp8`` on the CPU.

The specification is checked against an independent float64 fake quantization written here.
Float8 rounding is done by hand (round-half-even to 3 mantissa bits for e4m3fn and 2 for e5m2,
with subnormals and saturation), not by torch's casts. The scale is the op's definition,
``fp8_max / amax`` in float32, computed here too, as is the scaled operand. The tolerances then
cover only the float32 sums and the final rounding: 1e-5 of the output's max for float32
results, and 2^-8 of the max for bf16/fp16 results (a half-ulp of the max is at most 2^-8).

The model tests compare ``--ls-fp8`` with the same model without it. Each operand has a relative
rounding error of up to 2^-4 in e4m3 (3 mantissa bits), and up to 2^-3 in e5m2 for gradients. In
a scalar loss averaged over tokens these independent errors mostly cancel: the observed
difference on the tiny models here is 6e-4 to 6e-3 of the loss, and the test allows 2e-2.

The ``_scaled_mm`` path itself runs on a GPU (tests/gpu/test_fp8_linear_cuda.py). Where this
torch has a CPU ``_scaled_mm`` for float8, its engine is checked here against the reference
(layouts, inverse scales, the backward's padding, the bias epilogue).
"""
import math

import pytest
import torch

from dispatch_trace import fills_in_backward
from fairseq_helpers import build_model, make_dictionary, model_args, random_sample
from ls_fairseq.ops import _extension
from ls_fairseq.ops import fp8_linear as fp8

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
#: (mantissa bits, smallest normal exponent, max) of each float8 format
FORMATS = {torch.float8_e4m3fn: (3, -6, E4M3_MAX), torch.float8_e5m2: (2, -14, E5M2_MAX)}
#: like ls_fairseq.testing.fairseq_helpers.TINY, but every width a multiple of 16 (what
#: torch._scaled_mm's FP8 GEMMs take; TINY's odd widths would keep the FP8 path away)
FP8_TINY = [
    "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "48", "--decoder-ffn-embed-dim", "48",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0",
]


@pytest.fixture(autouse=True)
def _auto_kernels(monkeypatch):
    monkeypatch.delenv(_extension.ENV_VAR, raising=False)


def round_to_fp8(v, fp8_dtype):
    """float64 ``v`` (already scaled) rounded to the nearest value of ``fp8_dtype``, ties to
    even, saturating at its max."""
    mantissa_bits, min_exp, fmax = FORMATS[fp8_dtype]
    v = v.double().clamp(-fmax, fmax)
    exp = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** (min_exp - 10))))
    step = torch.exp2(exp.clamp_min(min_exp) - mantissa_bits)  # subnormals: the fixed step
    return (torch.round(v / step) * step).clamp(-fmax, fmax)  # torch.round: half to even


def fake_quant(t, fp8_dtype):
    """The dequantized operand (float64): ``round(t * s) / s`` with ``s = fp8_max / amax``, amax
    floored at 1e-12. Like the op, the scale and the scaled value ``t * s`` are float32: a
    product rounded to float32 can land on a float8 tie that the exact one misses."""
    fmax = FORMATS[fp8_dtype][2]
    amax = max(float(t.double().abs().max()) if t.numel() else 0.0, 1e-12)
    scale = torch.tensor(fmax, dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32)
    return round_to_fp8(t.float() * scale, fp8_dtype) / scale.double()


def expected_forward(x, w, b):
    xq, wq = fake_quant(x, torch.float8_e4m3fn), fake_quant(w, torch.float8_e4m3fn)
    out = xq @ wq.t()
    return out if b is None else out + b.detach().double()


def expected_backward(g, x, w):
    """The explicit backward: (grad_x, grad_w, grad_b), the gradient in e5m2 and the saved
    operands in e4m3, over 2-D x [M, K], g [M, N]."""
    gq = fake_quant(g, torch.float8_e5m2)
    xq, wq = fake_quant(x, torch.float8_e4m3fn), fake_quant(w, torch.float8_e4m3fn)
    return gq @ wq, gq.t() @ xq, g.double().sum(0)


def tolerance(dtype, ref):
    scale = float(ref.abs().max()) or 1.0
    return scale * (1e-5 if dtype == torch.float32 else 2.0 ** -8)


def assert_close_to(actual, expected, dtype):
    assert actual.dtype == dtype
    actual, expected = actual.detach(), expected.detach()
    err = float((actual.double() - expected).abs().max())
    assert err <= tolerance(dtype, expected), (err, tolerance(dtype, expected))


def test_round_to_fp8_is_torchs_cast():
    """The hand-written rounding agrees with torch's float8 casts (so the reference's
    quantization is the one specified, not an artefact of the cast)."""
    g = torch.Generator().manual_seed(0)
    v = torch.cat([torch.randn(4000, generator=g) * 10.0 ** e for e in range(-4, 3)])
    v = torch.cat([v, torch.tensor([0.0, 448.0, -448.0, 460.0, 2.0 ** -9, 3 * 2.0 ** -10])])
    for dtype, (_, _, fmax) in FORMATS.items():
        cast = v.clamp(-fmax, fmax).to(dtype).double()
        assert torch.equal(round_to_fp8(v, dtype), cast), dtype


def _operands(shape_x, n, dtype, bias=True, zero_rows=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape_x, generator=g)
    if zero_rows:  # padding-like positions: the rows of pad tokens are all zero
        x.view(-1, x.size(-1))[-zero_rows:] = 0
    w = torch.randn(n, shape_x[-1], generator=g) / math.sqrt(shape_x[-1])
    b = torch.randn(n, generator=g) if bias else None
    return (x.to(dtype), w.to(dtype), None if b is None else b.to(dtype))


SHAPES = [((3, 7, 13), 11, 0), ((5, 24), 9, 2), ((1, 5), 3, 0), ((2, 9, 16), 48, 5),
          ((4, 33), 17, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape_x,n,zero_rows", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_reference_forward_and_backward_match_the_fake_quant(dtype, shape_x, n, zero_rows, bias):
    x, w, b = _operands(shape_x, n, dtype, bias, zero_rows)
    x.requires_grad_()
    w.requires_grad_()
    if b is not None:
        b.requires_grad_()
    out = fp8.fp8_linear_reference(x, w, b)
    assert out.shape == (*shape_x[:-1], n)
    assert_close_to(out, expected_forward(x.detach(), w.detach(), b), dtype)
    assert fp8.fp8_linear(x, w, b).equal(out)  # the CPU's dispatch is the reference
    if zero_rows:
        rows = out.detach().view(-1, n)[-zero_rows:]
        assert torch.equal(rows, (b if b is not None else torch.zeros(n, dtype=dtype))
                           .detach().expand_as(rows))

    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad(out, [t for t in (x, w, b) if t is not None], g)
    gx, gw, gb = expected_backward(g.view(-1, n), x.detach().view(-1, shape_x[-1]), w.detach())
    assert_close_to(grads[0].view(-1, shape_x[-1]), gx, dtype)
    assert_close_to(grads[1], gw, dtype)
    if b is not None:
        assert_close_to(grads[2], gb, dtype)


def test_only_the_needed_gradients_are_computed():
    x, w, b = _operands((4, 8), 6, torch.float32)
    w.requires_grad_()
    out = fp8.fp8_linear(x, w, b)
    (gw,) = torch.autograd.grad(out.sum(), [w])
    assert gw.shape == w.shape and x.grad is None


def test_backward_makes_no_zero_gradients_for_the_copies():
    """The float8 copies and scales are outputs without gradients: the backward gets None for
    them, not zero tensors that autograd fills on every call (``set_materialize_grads``): no
    aten op of the backward may create zeros or fill. Fails if they are materialized again."""
    x, w, b = _operands((3, 5, 16), 32, torch.float32)
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    out = fp8.fp8_linear(x, w, b)
    # (the transposes' zero padding, ``zero_`` on a few uint8 columns, is no fill of a gradient)
    assert fills_in_backward(out, torch.randn(out.shape)) == []
    assert x.grad is not None and w.grad is not None and b.grad is not None


def test_zero_operands_give_finite_results():
    """amax 0 meets the floor: no inf/NaN scale, exact zeros out (the bias where there is one)."""
    x, w, b = _operands((3, 5, 8), 4, torch.float32)
    for xs, ws in ((torch.zeros_like(x), w), (x, torch.zeros_like(w))):
        xs, ws = xs.clone().requires_grad_(), ws.clone().requires_grad_()
        out = fp8.fp8_linear(xs, ws, b)
        assert torch.equal(out, b.expand_as(out))
        gx, gw = torch.autograd.grad(out, [xs, ws], torch.randn(out.shape))
        assert torch.isfinite(gx).all() and torch.isfinite(gw).all()
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp8.fp8_linear(xs, ws)
    gx, gw = torch.autograd.grad(out, [xs, ws], torch.zeros_like(out))  # a zero output gradient
    assert torch.equal(gx, torch.zeros_like(gx)) and torch.equal(gw, torch.zeros_like(gw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["x", "weight", "grad_out"])
def test_non_finite_inputs_give_non_finite_results(dtype, bad, where):
    """fp16 overflow detection reads the gradients: an inf or NaN anywhere must come out."""
    x, w, b = _operands((2, 3, 16), 8, dtype)
    if where == "x":
        x[1, 2, 5] = bad
    elif where == "weight":
        w[3, 7] = bad
    x.requires_grad_()
    w.requires_grad_()
    out = fp8.fp8_linear(x, w, b)
    g = torch.randn(out.shape).to(dtype)
    if where == "grad_out":
        g[0, 1, 4] = bad
        assert torch.isfinite(out).all()
    else:
        assert not torch.isfinite(out).all()
    gx, gw = torch.autograd.grad(out, [x, w], g)
    # as in exact arithmetic: grad_x = g @ w, grad_w = g.T @ x
    assert torch.isfinite(gx).all() == (where == "x")
    assert torch.isfinite(gw).all() == (where == "weight")


def test_empty_input():
    x, w, b = _operands((0, 16), 8, torch.float32)
    x.requires_grad_()
    out = fp8.fp8_linear(x, w, b)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert x.grad.shape == (0, 16)


# ---------------------------------------------------------------- the op and its two engines

def _cpu_scaled_mm():
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32)
    try:
        torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


needs_cpu_scaled_mm = pytest.mark.skipif(not _cpu_scaled_mm(),
                                         reason="this torch has no CPU _scaled_mm for float8")


@needs_cpu_scaled_mm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [64, 37, 1])  # 37, 1: the weight gradient's padded contraction
@pytest.mark.parametrize("bias", [True, False])
def test_scaled_mm_engine_matches_the_reference(dtype, m, bias):
    """Both engines quantize alike: only the float32 summation order may differ."""
    x, w, b = _operands((m, 48), 32, dtype, bias)
    outs, grads = [], []
    for scaled_mm in (False, True):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        bs = None if b is None else b.clone().requires_grad_()
        out = fp8._apply(xs, ws, bs, scaled_mm)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
        outs.append(out)
        grads.append(torch.autograd.grad(out, [t for t in (xs, ws, bs) if t is not None], g))
    assert_close_to(outs[1], outs[0].double(), dtype)
    for got, ref in zip(grads[1], grads[0]):
        assert_close_to(got, ref.double(), dtype)


def test_transposed_pads_with_zero_columns():
    t8 = torch.randn(5, 3).to(torch.float8_e4m3fn)
    out = fp8.transposed(t8, 16)
    assert out.dtype == t8.dtype and out.shape == (3, 16) and out.is_contiguous()
    assert torch.equal(out[:, :5].float(), t8.float().t())
    assert torch.equal(out[:, 5:].float(), torch.zeros(3, 11))
    assert fp8.transposed(t8).shape == (3, 5)


@pytest.mark.parametrize("scaled_mm", [False, pytest.param(True, marks=needs_cpu_scaled_mm)])
def test_opcheck(scaled_mm):
    """Schema, autograd registration and fake implementation. opcheck's AOT test sums every
    output, and float8 has no sum kernel, so AOTAutograd is checked by the next test."""
    for bias in (torch.randn(16, requires_grad=True), None):
        args = (torch.randn(20, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True),
                bias, scaled_mm)
        torch.library.opcheck(fp8.fp8_linear_fwd, args,
                              test_utils=("test_schema", "test_autograd_registration",
                                          "test_faketensor"))


def test_traces_under_aot_autograd():
    """The op and its Python backward trace under fake tensors (torch.compile, aot_eager) and
    give the eager values."""
    def loss(x, w, b):
        return fp8.fp8_linear_reference(x, w, b).square().sum()

    args = [torch.randn(3, 7, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True),
            torch.randn(16, requires_grad=True)]
    eager = loss(*args)
    eager_grads = torch.autograd.grad(eager, args)
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)(*args)
    assert torch.equal(compiled, eager)
    for got, ref in zip(torch.autograd.grad(compiled, args), eager_grads):
        assert torch.equal(got, ref)


# ---------------------------------------------------------------- the quantize kernels' dispatch
# csrc/fp8_quantize.cu (binding ops/_fp8_quantize_cuda.py) quantizes and transposes on the
# _scaled_mm path; the kernels themselves run in tests/gpu/test_fp8_linear_cuda.py. Here: the
# scale's rounding they mirror, which calls the dispatch makes (kernels replaced by the
# reference), the predicates on the CPU, and the ops' schemas and fakes with CPU stand-ins.

def test_scale_rounds_as_reciprocal_then_product():
    """``fp8_max / amax`` on a tensor is ``amax.reciprocal() * fp8_max`` (Tensor.__rtruediv__):
    two float32 roundings, not one division; for many amaxes they differ. csrc/fp8_quantize.cu
    computes the scale and the inverse scale that way; mirrored here in numpy float32 (IEEE
    division and product, as the kernel's __fdiv_rn / __fmul_rn) against ``quantize``."""
    import numpy as np

    g = torch.Generator().manual_seed(0)
    exps = torch.randint(-44, 38, (300,), generator=g).double()
    amax = (torch.rand(300, generator=g, dtype=torch.float64) * 10.0 ** exps).float()
    special = torch.tensor([0.0, 1e-12, 1e-13, 1e-45, 3e38, 448.0, 57344.0, 3.0,
                            float("inf"), float("nan")])
    amax = torch.cat([amax, special])
    floor = np.float32(fp8.AMAX_FLOOR)
    for dtype in FORMATS:
        fmax = np.float32(torch.finfo(dtype).max)
        a = amax.numpy()
        with np.errstate(all="ignore"):
            scale = (np.float32(1) / np.maximum(a, floor)) * fmax  # np.maximum keeps NaN
            inv = np.float32(1) / scale
            one_division = fmax / np.maximum(a, floor)
        assert scale.dtype == np.float32 and inv.dtype == np.float32
        assert (scale[np.isfinite(scale)] != one_division[np.isfinite(scale)]).any()
        for value, want in zip(amax, inv):
            _, got = fp8.quantize(value.view(1, 1), dtype)
            assert got.dtype == torch.float32 and got.dim() == 0
            if np.isnan(want):
                assert torch.isnan(got), float(value)
            else:
                assert got.view(torch.int32).item() == np.float32(want).view(np.int32), (
                    float(value), float(got), float(want))


def _stand_in_kernels(monkeypatch, calls):
    """The binding's entry points replaced by the reference (the kernels' specification),
    recording each call; the kernels 'take' every tensor; the GEMMs are the reference's."""
    from ls_fairseq.ops import _fp8_quantize_cuda as cuda

    def quantize_kernel(t, fp8_dtype, transpose_pad=0):
        calls.append(("quantize", tuple(t.shape), fp8_dtype, transpose_pad))
        t8, inv_scale = fp8.quantize(t, fp8_dtype)
        t8_t = fp8.transposed(t8, transpose_pad) if transpose_pad else t8.new_empty((0,))
        return t8, inv_scale, t8_t

    def transpose_kernel(t8, multiple=1):
        calls.append(("transpose", tuple(t8.shape), t8.dtype, multiple))
        return fp8.transposed(t8, multiple)

    monkeypatch.setattr(cuda, "fp8_quantize_cuda", quantize_kernel)
    monkeypatch.setattr(cuda, "fp8_transpose_cuda", transpose_kernel)
    monkeypatch.setattr(fp8, "_kernels_take", lambda t, op: True)


def _run(x, w, b, scaled_mm, grad):
    out = fp8._apply(x, w, b, scaled_mm)
    inputs = [t for t in (x, w, b) if t is not None and t.requires_grad]
    return (out, *torch.autograd.grad(out, inputs, grad))


@pytest.mark.parametrize("needs", ["x and weight", "x", "weight"])
def test_scaled_mm_path_quantizes_with_the_kernels(monkeypatch, needs):
    """On the _scaled_mm path: x and weight quantized by the kernel (no transpose), the gradient
    once with its transpose padded to 16 rows when the weight gradient is needed, w8 and x8
    transposed by the kernel where their gradient needs them; the results are the reference
    path's, bit for bit. The reference engine (scaled_mm False) calls no kernel."""
    monkeypatch.setattr(fp8, "matmul_scaled_mm", fp8.matmul_reference)  # no FP8 GEMM here
    x, w, b = _operands((37, 48), 32, torch.bfloat16)
    x.requires_grad_("x" in needs.split())
    w.requires_grad_("weight" in needs)
    grad = torch.randn(37, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    expected = _run(x, w, b, True, grad)  # _kernels_take is False for CPU tensors
    calls = []
    _stand_in_kernels(monkeypatch, calls)
    got = _run(x, w, b, True, grad)
    for a, r in zip(got, expected):
        assert a.dtype == r.dtype and torch.equal(a, r)
    need_x, need_w = x.requires_grad, w.requires_grad
    assert calls == ([("quantize", (37, 48), fp8.E4M3, 0), ("quantize", (32, 48), fp8.E4M3, 0),
                      ("quantize", (37, 32), fp8.E5M2, 16 if need_w else 0)]
                     + ([("transpose", (32, 48), fp8.E4M3, 1)] if need_x else [])
                     + ([("transpose", (37, 48), fp8.E4M3, 16)] if need_w else [])), calls
    calls.clear()
    reference = _run(x, w, b, False, grad)
    assert calls == []
    for a, r in zip(reference, expected):
        assert torch.equal(a, r)


def test_kernel_predicates_on_the_cpu(monkeypatch):
    """A CPU tensor never asks for the extension (no build, and no error under ``require``:
    the _scaled_mm dispatch decides that); the binding's ``supports`` predicates."""
    from ls_fairseq.ops import _fp8_quantize_cuda as cuda

    builds = []
    monkeypatch.setattr(_extension, "_build", lambda: builds.append(1))
    monkeypatch.setattr(_extension, "_loaded", None)
    x = torch.randn(4, 16)
    x8 = x.to(fp8.E4M3)
    for mode in ("auto", "require", "off"):
        monkeypatch.setenv(_extension.ENV_VAR, mode)
        assert not fp8._kernels_take(x, "fp8_quantize")
        assert not fp8._kernels_take(x8, "fp8_transpose")
    assert builds == []
    assert cuda.supports(x) and cuda.supports(x[:0]) and cuda.supports(x.half().t())
    assert cuda.supports(x.bfloat16())
    assert not cuda.supports(x.double()) and not cuda.supports(x[0]) and not cuda.supports(x8)
    assert cuda.supports_transpose(x8) and cuda.supports_transpose(x.to(fp8.E5M2))
    assert not cuda.supports_transpose(x) and not cuda.supports_transpose(x8[0])
    assert not cuda.supports_transpose(x.to(torch.uint8))


QUANTIZE_OPS_CHECK = r"""
import os, re, sys
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

text = open(os.path.join(sys.argv[1], "fp8_quantize.cu")).read()
lib = torch.library.Library("ls_fairseq", "FRAGMENT")
names = []
for m in re.finditer(r'm\.def\(((?:\s*"[^"]*")+)', text):
    schema = "".join(re.findall(r'"([^"]*)"', m.group(1)))
    lib.define(schema)
    names.append(schema.split("(")[0])
assert names == ["fp8_quantize", "fp8_transpose"], names

from ls_fairseq.ops import _extension, _fp8_quantize_cuda as cuda, fp8_linear as fp8


def quantize_cpu(t, dtype, transpose_pad):  # the reference, as the ops' CPU kernel
    t8, inv_scale = fp8.quantize(t, dtype)
    t8_t = fp8.transposed(t8, transpose_pad) if transpose_pad else t8.new_empty((0,))
    return t8, inv_scale, t8_t


lib.impl("fp8_quantize", quantize_cpu, "CPU")
lib.impl("fp8_transpose", lambda t8, pad: fp8.transposed(t8, pad), "CPU")
_extension._loaded = True  # the schemas above stand for the extension
_extension._run_pending()
assert not _extension._pending

o = torch.ops.ls_fairseq
# float8 outputs: opcheck's AOT tests sum them, and float8 has no sum kernel
utils = ("test_schema", "test_autograd_registration", "test_faketensor")
for shape in ((37, 32), (0, 16), (1, 5), (5, 0)):
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            for pad in (0, 1, 16):
                t = torch.randn(shape).to(dtype)
                torch.library.opcheck(o.fp8_quantize.default, (t, fp8_dtype, pad), test_utils=utils)
    # the schema test compares float8 inputs before and after with allclose (none for float8):
    # the same bytes as uint8 (the op takes any 1-byte dtype)
    t8 = torch.randn(shape).to(torch.float8_e5m2)
    for pad in (1, 3, 16):
        torch.library.opcheck(o.fp8_transpose.default, (t8.view(torch.uint8), pad),
                              test_utils=utils)
        torch.library.opcheck(o.fp8_transpose.default, (t8, pad), test_utils=utils[1:])

with FakeTensorMode():
    t = torch.empty(37, 32, dtype=torch.bfloat16)
    t8, inv, t8_t = cuda.fp8_quantize_cuda(t, torch.float8_e5m2, 16)
    assert (t8.shape, t8.dtype, inv.shape, inv.dtype, t8_t.shape, t8_t.dtype) == (
        (37, 32), torch.float8_e5m2, (), torch.float32, (32, 48), torch.float8_e5m2)
    assert cuda.fp8_quantize_cuda(t, torch.float8_e4m3fn)[2].shape == (0,)
    out = cuda.fp8_transpose_cuda(t8, 16)
    assert (out.shape, out.dtype) == ((32, 48), torch.float8_e5m2)
    assert cuda.fp8_transpose_cuda(t8).shape == (32, 37)
print("fp8 quantize ops ok")
"""


def test_quantize_ops_schemas_and_fakes(tmp_path):
    """In a fresh process: the schemas of csrc/fp8_quantize.cu with the reference as their CPU
    kernels, the binding's fakes registered at the 'load'; opcheck (schema, fake tensors against
    the outputs) over dtypes, float8 formats, pads and empty shapes."""
    import os
    import subprocess
    import sys

    script = tmp_path / "quantize_ops_check.py"
    script.write_text(QUANTIZE_OPS_CHECK)
    # the ls_fairseq this process imports (the checkout's, not another installed copy)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(fp8.__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, LS_FAIRSEQ_KERNELS="auto", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, str(script), _extension.csrc_dir()],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and "fp8 quantize ops ok" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-5000:])


# ---------------------------------------------------------------- --ls-fp8 in the ls_ model

@pytest.fixture(scope="module")
def dictionary():
    return make_dictionary(45)


def test_flag_in_the_parser():
    assert model_args("ls_transformer", FP8_TINY).ls_fp8 is False
    assert model_args("ls_transformer_wmt_en_de_big_t2t", FP8_TINY + ["--ls-fp8"]).ls_fp8 is True


@pytest.mark.parametrize("layers, ffn, attention", [
    (None, True, True), ("ffn", True, False), ("attention", False, True),
    (" attention , ffn ", True, True),
])
def test_fp8_layers_choose_the_parts(dictionary, monkeypatch, layers, ffn, attention):
    """--ls-fp8-layers: the FFN's fc1/fc2 and the attention projections (self and cross) run in
    FP8 as listed; the others keep F.linear. Counted in one training forward of 2 + 2 layers:
    attention 2 per encoder layer, 4 per decoder layer; FFN 2 per layer."""
    extra = FP8_TINY + ["--ls-fp8"] + ([] if layers is None else ["--ls-fp8-layers", layers])
    model = build_model("ls_transformer", dictionary, extra, seed=1)
    for layer in (*model.encoder.layers, *model.decoder.layers):
        assert layer.fp8 is ffn and layer.self_attn.fp8 is attention
    assert all(layer.encoder_attn.fp8 is attention for layer in model.decoder.layers)

    calls = []
    linear = fp8.fp8_linear_fwd
    monkeypatch.setattr(fp8, "fp8_linear_fwd", lambda *a: calls.append(a[0].shape) or linear(*a))
    model.train()
    model(**random_sample(dictionary, 3, 6, 5, torch.Generator().manual_seed(0))["net_input"])
    assert len(calls) == (2 * 2 + 2 * 4) * attention + (2 * 2 + 2 * 2) * ffn


def test_fp8_layers_bad_input(dictionary):
    """--ls-fp8-layers without --ls-fp8 fails when the model is built, naming both flags; a bad
    list fails at parse time (tests/test_bad_input.py), and in a config that skipped the parser
    (an edited checkpoint) when the model is built, naming the flag."""
    with pytest.raises(ValueError, match="^--ls-fp8-layers 'ffn' needs --ls-fp8$"):
        build_model("ls_transformer", dictionary, FP8_TINY + ["--ls-fp8-layers", "ffn"])
    from ls_fairseq.models.ls_transformer import fp8_layers

    cfg = model_args("ls_transformer", FP8_TINY + ["--ls-fp8"])
    cfg.ls_fp8_layers = "ffn,mlp"
    with pytest.raises(ValueError, match=r"^--ls-fp8-layers 'ffn,mlp': a comma-separated list "
                                         r"of attention, ffn \(unknown: mlp\)$"):
        fp8_layers(cfg)
    cfg.ls_fp8_layers = "ffn"
    assert fp8_layers(cfg) == {"ffn"}


def _loss(model, sample, pad):
    out, _ = model(**sample["net_input"])
    lprobs = torch.log_softmax(out.float(), -1).view(-1, out.size(-1))
    return torch.nn.functional.nll_loss(lprobs, sample["target"].view(-1), ignore_index=pad)


@pytest.mark.parametrize("arch", ["ls_transformer", "ls_transformer_wmt_en_de_big_t2t"])
def test_model_with_fp8_trains_close_to_without(arch, dictionary, monkeypatch):
    plain = build_model(arch, dictionary, FP8_TINY, seed=1)
    with_fp8 = build_model(arch, dictionary, FP8_TINY + ["--ls-fp8"], seed=1)
    assert all(layer.fp8 and layer.self_attn.fp8 for layer in with_fp8.encoder.layers)
    assert all(layer.encoder_attn.fp8 for layer in with_fp8.decoder.layers)
    assert not any(layer.fp8 for layer in plain.decoder.layers)
    # the same parameters: the weights, optimizer and checkpoints do not change
    assert list(plain.state_dict()) == list(with_fp8.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(value, with_fp8.state_dict()[key]), key

    calls = []
    linear = fp8.fp8_linear_fwd
    monkeypatch.setattr(fp8, "fp8_linear_fwd", lambda *a: calls.append(a[0].shape) or linear(*a))
    sample = random_sample(dictionary, 4, 9, 7, torch.Generator().manual_seed(0))
    losses = {}
    for name, model in (("plain", plain), ("fp8", with_fp8)):
        model.train()
        loss = _loss(model, sample, dictionary.pad())
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert all(torch.isfinite(g).all() for g in grads), name
        losses[name] = float(loss)
    # per layer: self-attention QKV and out (+ cross-attention q and out) and FFN fc1, fc2
    assert len(calls) == 2 * 4 + 2 * 6
    assert abs(losses["fp8"] - losses["plain"]) <= 2e-2 * losses["plain"], losses

    # evaluation and generation: the normal matmuls, bit for bit
    calls.clear()
    plain.eval()
    with_fp8.eval()
    with torch.no_grad():
        assert torch.equal(plain(**sample["net_input"])[0], with_fp8(**sample["net_input"])[0])
    assert calls == []


def test_a_few_steps_reduce_the_loss(dictionary):
    """Adam on one fixed batch (memorised): fp8 training makes progress."""
    model = build_model("ls_transformer", dictionary, FP8_TINY + ["--ls-fp8"], seed=2)
    model.train()
    sample = random_sample(dictionary, 6, 8, 8, torch.Generator().manual_seed(5))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        opt.zero_grad()
        loss = _loss(model, sample, dictionary.pad())
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.slow
def test_fp8_checkpoint_converts_to_fairseq(data_bin, tmp_path):
    """fairseq-train --ls-fp8 (CPU: the reference path) writes a checkpoint that records the
    flag, generates with the plugin (no fp8 in evaluation), and converts to a fairseq checkpoint
    that plain fairseq loads as its transformer (no fp8 there)."""
    import sys

    import test_convert_checkpoint as cc

    log = cc.train(data_bin, tmp_path / "ls", ls=True, max_update=3, more=["--ls-fp8"])
    assert len(cc.logged(log)) == 3
    ls_ckpt, fs_ckpt = tmp_path / "ls" / "checkpoint_last.pt", tmp_path / "fs.pt"
    state = torch.load(ls_ckpt, map_location="cpu", weights_only=False)
    assert state["cfg"]["model"].ls_fp8 is True
    assert len(cc.generate(data_bin, ls_ckpt, ls=True)) == 24
    cc.convert(ls_ckpt, fs_ckpt, "fairseq")
    out = cc.run([sys.executable, "-c", cc.PLAIN_FAIRSEQ_LOAD, str(fs_ckpt)], cwd=tmp_path,
                 stdout_only=True)
    assert out.splitlines()[-1] == "loaded TransformerModel False"
