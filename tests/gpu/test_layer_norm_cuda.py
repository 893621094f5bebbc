"""GPU tests of the fused LayerNorm (ls_fairseq/ops/_layer_norm_cuda.py, csrc/layer_norm.cu).

Truth is the same LayerNorm in float64 on the same (low-precision) inputs. Tolerances: the kernel
does its math in float32 and rounds each output once, so outputs must match the truth to about
one rounding of the storage dtype: elementwise ``|err| <= ATOL + RTOL * |truth|`` for y, and
``||err|| / ||truth|| <= NORM_TOL`` for the gradients (dx, dw, db are sums whose elementwise
relative error is meaningless where they cancel). fp32 1e-5, fp16 2e-3, bf16 1.6e-2 (a few units
of 2^-11 / 2^-8). A wrong statistic, a dropped tail or a mixed-up row is off by O(1) and fails.

Shapes cover every kernel path: warp-per-row forward with 1/2/4/8 vectors per lane, the
block-per-row forward (long rows), the multi-row backward with 1 and 2 vectors per thread, the
block-per-row backward with its separate dw/db kernel, 16-byte vectors and the scalar path (hidden
sizes not a multiple of 8 / 4), one row, 32k rows and empty input.
"""
import pytest
import torch
import torch.nn.functional as F

from ls_fairseq.ops import _extension
from ls_fairseq.ops.layer_norm import layer_norm, layer_norm_reference

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (tests/conftest.py)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}
# (rows, C)
SHAPES = [
    (1, 1), (3, 3), (5, 17), (64, 64), (7, 255), (33, 512), (4096, 512), (129, 768),
    (17, 1000), (1024, 1024), (5, 1030), (3, 2047), (9, 2048), (2, 4096), (3, 5000), (0, 512),
]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert _extension.load(), f"CUDA extension did not build: {_extension.failure_reason()}"
    assert _extension.has_op("layer_norm_fwd")
    from ls_fairseq.ops import _layer_norm_cuda

    return _layer_norm_cuda


def _inputs(rows, C, dtype, offset=0.0, seed=None):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed if seed is not None else torch.randint(0, 2**31, ()).item())
    x = (torch.randn(rows, C, device="cuda", generator=g) * 2 + 0.5 + offset).to(dtype)
    w = (1 + 0.5 * torch.randn(C, device="cuda", generator=g)).to(dtype)
    b = (0.5 * torch.randn(C, device="cuda", generator=g)).to(dtype)
    gy = torch.randn(rows, C, device="cuda", generator=g).to(dtype)
    return x, w, b, gy


def _truth(x, w, b, gy, eps=1e-5):
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    y = F.layer_norm(x64, (x.size(-1),), w64, b64, eps)
    y.backward(gy.double())
    return y.detach(), x64.grad, w64.grad, b64.grad


def _close(ours, truth, dtype, what):
    tol = TOL[dtype]
    ours = ours.double()
    assert torch.isfinite(ours).all(), f"{what}: non-finite values"
    bound = tol + tol * truth.abs()
    bad = (ours - truth).abs() > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements off, max err "
        f"{(ours - truth).abs().max().item():.3g}"
    )


def _norm_close(ours, truth, dtype, what, factor=1.0):
    ours = ours.double()
    assert torch.isfinite(ours).all(), f"{what}: non-finite values"
    err = (ours - truth).norm().item()
    scale = truth.norm().item() + 1e-6 * truth.numel() ** 0.5
    assert err <= factor * TOL[dtype] * scale, f"{what}: relative error {err / scale:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,C", SHAPES)
def test_forward_backward(rows, C, dtype, kernels):
    x, w, b, gy = _inputs(rows, C, dtype)
    x.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()
    y = kernels.layer_norm_cuda(x, w, b, 1e-5)
    y.backward(gy)
    y64, dx64, dw64, db64 = _truth(x, w, b, gy)
    assert y.dtype == dtype and y.shape == x.shape
    _close(y.detach(), y64, dtype, "y")
    _norm_close(x.grad, dx64, dtype, "dx")
    _norm_close(w.grad, dw64, dtype, "dw")
    _norm_close(b.grad, db64, dtype, "db")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_batch(dtype, kernels):
    x, w, b, gy = _inputs(32768, 1024, dtype)
    for t in (x, w, b):
        t.requires_grad_()
    y = kernels.layer_norm_cuda(x, w, b, 1e-5)
    y.backward(gy)
    y64, dx64, dw64, db64 = _truth(x, w, b, gy)
    _close(y.detach(), y64, dtype, "y")
    _norm_close(x.grad, dx64, dtype, "dx")
    # dw/db sum 32k rows: float32 partial sums, one rounding at the end
    _norm_close(w.grad, dw64, dtype, "dw")
    _norm_close(b.grad, db64, dtype, "db")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_public_op_dispatches_to_kernel(dtype):
    x, w, b, _ = _inputs(37, 512, dtype)
    ours = layer_norm(x, w, b, 1e-5)
    y, _, _ = torch.ops.ls_fairseq.layer_norm_fwd(x, w, b, 1e-5, False)
    assert torch.equal(ours, y)
    # and agrees with the PyTorch reference (same fp32 math, possibly different last bit)
    _close(ours, layer_norm_reference(x.double(), w.double(), b.double(), 1e-5), dtype, "y vs reference")


@pytest.mark.parametrize("offset", [1e3, 1e4])
@pytest.mark.parametrize("C", [512, 1024, 4099])
def test_statistics_without_cancellation(offset, C, kernels):
    """|mean| >> std: the plain mean-of-squares loses all digits of var in float32 here
    (E[x^2] ~ 1e8 vs var ~ 4); shifted sums keep them."""
    x, w, b, gy = _inputs(64, C, torch.float32, offset=offset)
    for t in (x, w, b):
        t.requires_grad_()
    y, mean, rstd = torch.ops.ls_fairseq.layer_norm_fwd(x, w, b, 1e-5, False)
    y.backward(gy)
    y64, dx64, _, _ = _truth(x, w, b, gy)
    x64 = x.detach().double()
    var64 = x64.var(-1, unbiased=False)
    torch.testing.assert_close(mean.double(), x64.mean(-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(rstd.double(), (var64 + 1e-5).rsqrt(), rtol=1e-4, atol=0)
    # y is as well conditioned as its input allows: a relative change of x by one float32 unit
    # moves y by ~2^-24 * |x| * rstd * |w|; allow 4 such units on top of the usual bound (the
    # mean-of-squares rewrite without a shift is off by O(1) here: var itself is lost).
    cond = 2.0**-22 * x64.abs() * rstd.double()[:, None] * w.detach().double().abs()
    err = (y.detach().double() - y64).abs()
    assert (err <= 1e-5 * (1 + y64.abs()) + cond).all(), f"y: max err {err.max().item():.3g}"
    _norm_close(x.grad, dx64, torch.float32, "dx", factor=10)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_constant_rows_and_eps(dtype, kernels):
    x, w, b, gy = _inputs(8, 256, dtype)
    x[2] = 3.0  # zero variance: rstd = 1/sqrt(eps)
    x[5] = 0.0
    for eps in (1e-5, 1e-3):
        xr = x.clone().requires_grad_()
        y = kernels.layer_norm_cuda(xr, w, b, eps)
        y.backward(gy)
        y64, dx64, _, _ = _truth(x, w, b, gy, eps)
        _close(y.detach(), y64, dtype, f"y eps={eps}")
        _norm_close(xr.grad, dx64, dtype, f"dx eps={eps}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,C", [(33, 512), (1024, 1024), (5, 1030), (7, 4096)])
def test_invertible_backward(rows, C, dtype, kernels):
    """Backward from the output: xhat = (y - b) / w. Needs |w| away from 0; its error is the
    rounding of y amplified by |b| / |w| (here <= ~3 units), hence 3x the tolerance."""
    x, _, b, gy = _inputs(rows, C, dtype)
    sign = torch.where(torch.rand(C, device="cuda") < 0.5, -1.0, 1.0)
    w = (sign * (0.5 + torch.rand(C, device="cuda"))).to(dtype)
    for t in (x, w, b):
        t.requires_grad_()
    saved = []

    def pack(t):
        saved.append(t.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = kernels.layer_norm_cuda(x, w, b, 1e-5, invertible=True)
    assert x.data_ptr() not in saved, "invertible mode must not keep the input"
    assert y.data_ptr() in saved
    y.backward(gy)
    y64, dx64, dw64, db64 = _truth(x, w, b, gy)
    _close(y.detach(), y64, dtype, "y")
    _norm_close(x.grad, dx64, dtype, "dx", factor=3)
    _norm_close(w.grad, dw64, dtype, "dw", factor=3)
    _norm_close(b.grad, db64, dtype, "db")


def test_default_mode_saves_the_input(kernels):
    x, w, b, _ = _inputs(4, 64, torch.float16)
    x.requires_grad_()
    saved = []

    def pack(t):
        saved.append(t.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kernels.layer_norm_cuda(x, w, b, 1e-5)
    assert x.data_ptr() in saved


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_no_affine_noncontiguous_and_frozen(dtype, kernels):
    x, w, b, gy = _inputs(300, 512, dtype)
    xt = x.t().contiguous().t()  # same values, column-major strides
    assert not xt.is_contiguous()
    xt.requires_grad_()
    y = kernels.layer_norm_cuda(xt, None, None, 1e-5)
    y.backward(gy)
    x64 = x.double().requires_grad_()
    y64 = F.layer_norm(x64, (512,), None, None, 1e-5)
    y64.backward(gy.double())
    _close(y.detach(), y64.detach(), dtype, "y (no affine)")
    _norm_close(xt.grad, x64.grad, dtype, "dx (no affine)")
    # weight frozen, bias trained
    xr = x.clone().requires_grad_()
    br = b.clone().requires_grad_()
    y = kernels.layer_norm_cuda(xr, w, br, 1e-5)
    y.backward(gy)
    assert w.grad is None and br.grad is not None
    _, dx64, _, db64 = _truth(x, w, b, gy)
    _norm_close(xr.grad, dx64, dtype, "dx (frozen w)")
    _norm_close(br.grad, db64, dtype, "db (frozen w)")


def test_leading_dims_and_fairseq_module(kernels):
    from fairseq.modules import LayerNorm as FairseqLayerNorm

    ref = FairseqLayerNorm(1024).cuda().half()
    with torch.no_grad():
        ref.weight.normal_(1, 0.3)
        ref.bias.normal_(0, 0.3)
    x = torch.randn(27, 5, 1024, device="cuda", dtype=torch.float16, requires_grad=True)
    gy = torch.randn_like(x)
    w = ref.weight.detach().clone().requires_grad_()
    b = ref.bias.detach().clone().requires_grad_()
    y = kernels.layer_norm_cuda(x, w, b, ref.eps)
    y.backward(gy)
    x2 = x.detach().clone().requires_grad_()
    y_ref = ref(x2)
    y_ref.backward(gy)
    assert y.shape == y_ref.shape
    # both round an fp32 result once: at most one fp16 unit apart
    torch.testing.assert_close(y, y_ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(x.grad, x2.grad, rtol=5e-3, atol=5e-3)
    _norm_close(w.grad, ref.weight.grad.double(), torch.float16, "dw vs fairseq", factor=2)
    _norm_close(b.grad, ref.bias.grad.double(), torch.float16, "db vs fairseq", factor=2)


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 64, device="cuda", dtype=torch.float16)
    w = torch.ones(32, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="weight must have C = 64"):
        torch.ops.ls_fairseq.layer_norm_fwd(x, w, None, 1e-5, False)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        torch.ops.ls_fairseq.layer_norm_fwd(x.double(), None, None, 1e-5, False)


def test_opcheck(kernels):
    x, w, b, gy = _inputs(37, 520, torch.float32)
    for t in (x, w, b):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.ls_fairseq.layer_norm_fwd.default, (x, w, b, 1e-5, False))
    y, mean, rstd = torch.ops.ls_fairseq.layer_norm_fwd(x.detach(), w.detach(), b.detach(), 1e-5, False)
    torch.library.opcheck(
        torch.ops.ls_fairseq.layer_norm_bwd.default,
        (gy, x.detach(), w.detach(), b.detach(), mean, rstd, False, True, True),
    )


# ---------------------------------------------------------------- LayerNorm + residual gradient
# Pre-LN blocks read x twice: z = g(layer_norm(x)) + x. ``layer_norm_residual_cuda`` returns
# (y, x) and adds the residual branch's gradient of x inside the backward kernel; it is the op
# ``ls_fairseq::layer_norm_residual`` (CompositeImplicitAutograd, csrc/layer_norm_autograd.cpp).


def _residual_truth(x, w, b, gy, gr, eps=1e-5):
    """float64 (dx + residual gradient, dw, db)."""
    _, dx64, dw64, db64 = _truth(x, w, b, gy, eps)
    return dx64 + gr.double(), dw64, db64


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,C", [(5, 17), (7, 255), (33, 512), (1024, 1024), (5, 1030),
                                    (3, 2047), (2, 4096), (3, 5000), (0, 512)])
def test_residual_gradient_is_added_in_backward(rows, C, dtype, kernels):
    x, w, b, gy = _inputs(rows, C, dtype)
    gr = torch.randn(rows, C, device="cuda").to(dtype)
    for t in (x, w, b):
        t.requires_grad_()
    y, residual = kernels.layer_norm_residual_cuda(x, w, b, 1e-5)
    assert residual.data_ptr() == x.data_ptr() and torch.equal(residual, x)  # no copy
    torch.autograd.backward([y, residual], [gy, gr])
    y64, _, _, _ = _truth(x, w, b, gy)
    dx64, dw64, db64 = _residual_truth(x, w, b, gy, gr)
    _close(y.detach(), y64, dtype, "y")
    _norm_close(x.grad, dx64, dtype, "dx + residual gradient")
    _norm_close(w.grad, dw64, dtype, "dw")
    _norm_close(b.grad, db64, dtype, "db")


def test_residual_matches_fairseq_pre_ln_block(kernels):
    """Against fairseq's LayerNorm in a pre-LN block ``x + f(LN(x))`` (same weights, fp16), with
    a residual gradient that is ~100x the LayerNorm's: a dropped or doubled residual term is off
    by O(1); a correct fused sum rounds once where autograd's add rounds twice (<= 2 fp16 units)."""
    from fairseq.modules import LayerNorm as FairseqLayerNorm

    ref = FairseqLayerNorm(1024).cuda().half()
    with torch.no_grad():
        ref.weight.normal_(1, 0.3)
        ref.bias.normal_(0, 0.3)
    x = torch.randn(23, 7, 1024, device="cuda", dtype=torch.float16, requires_grad=True)
    scale = torch.randn(1024, device="cuda", dtype=torch.float16)
    gz = torch.randn_like(x)
    w = ref.weight.detach().clone().requires_grad_()
    b = ref.bias.detach().clone().requires_grad_()
    y, residual = kernels.layer_norm_residual_cuda(x, w, b, ref.eps)
    (residual * 100 + y * scale).backward(gz)
    x2 = x.detach().clone().requires_grad_()
    (x2 * 100 + ref(x2) * scale).backward(gz)
    torch.testing.assert_close(x.grad, x2.grad, rtol=2e-3, atol=2e-3 * 100)
    _norm_close(w.grad, ref.weight.grad.double(), torch.float16, "dw vs fairseq", factor=2)
    _norm_close(b.grad, ref.bias.grad.double(), torch.float16, "db vs fairseq", factor=2)


def test_residual_unused_or_layer_norm_unused(kernels):
    x, w, b, gy = _inputs(9, 520, torch.float32)
    x.requires_grad_()
    y, residual = kernels.layer_norm_residual_cuda(x, w, b, 1e-5)
    y.backward(gy)  # residual unused: plain LayerNorm gradient
    _, dx64, _, _ = _truth(x, w, b, gy)
    _norm_close(x.grad, dx64, torch.float32, "dx without residual")
    x.grad = None
    y, residual = kernels.layer_norm_residual_cuda(x, w, b, 1e-5)
    (residual * 3).sum().backward()  # LayerNorm output unused: the residual gradient only
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


def test_residual_public_op_matches_reference_path(kernels):
    from ls_fairseq.ops.layer_norm import layer_norm_residual, layer_norm_residual_reference

    x, w, b, gy = _inputs(41, 1024, torch.float16)
    gr = torch.randn_like(gy)
    outs = []
    for fn in (layer_norm_residual, layer_norm_residual_reference):
        xi = x.detach().clone().requires_grad_()
        y, r = fn(xi, w, b, 1e-5)
        torch.autograd.backward([y, r], [gy, gr])
        outs.append((y.detach(), xi.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=5e-3, atol=5e-3)


def test_residual_bad_shape_raises(kernels):
    x, w, b, gy = _inputs(4, 64, torch.float16)
    _, mean, rstd = torch.ops.ls_fairseq.layer_norm_fwd(x, w, b, 1e-5, False)
    with pytest.raises(RuntimeError, match="residual_grad must have the shape"):
        torch.ops.ls_fairseq.layer_norm_bwd(gy, x, w, b, mean, rstd, False, True, True, gy[:2])


def test_opcheck_residual(kernels):
    x, w, b, gy = _inputs(37, 520, torch.float32)
    y, mean, rstd = torch.ops.ls_fairseq.layer_norm_fwd(x, w, b, 1e-5, False)
    torch.library.opcheck(
        torch.ops.ls_fairseq.layer_norm_bwd.default,
        (gy, x, w, b, mean, rstd, False, True, True, torch.randn_like(gy)),
    )


def test_opcheck_layer_norm_residual(kernels):
    """The composite op: schema (its second output aliases x), autograd (by decomposition), fake
    tensors (through layer_norm_fwd/_bwd's fakes) and AOT, with and without the affine
    parameters."""
    for dtype in (torch.float32, torch.float16):
        x, w, b, _ = _inputs(7, 40, dtype, seed=3)
        for wi, bi in ((w, b), (None, None), (w, None)):
            args = [t.detach().clone().requires_grad_() if t is not None else None
                    for t in (x, wi, bi)]
            torch.library.opcheck(torch.ops.ls_fairseq.layer_norm_residual.default,
                                  (*args, 1e-5))


class _KeepInput(torch.autograd.Function):
    """The same kernel calls from a Python autograd.Function: the op's oracle, bit for bit."""

    @staticmethod
    def forward(ctx, x, w, b, eps):
        ctx.set_materialize_grads(False)
        y, mean, rstd = torch.ops.ls_fairseq.layer_norm_fwd(x, w, b, eps, False)
        ctx.save_for_backward(x, w, b, mean, rstd)
        return y, x

    @staticmethod
    def backward(ctx, gy, gr):
        if gy is None:
            return gr, None, None, None
        x, w, b, mean, rstd = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad[:3]
        wg, bg = bool(nw and w is not None), bool(nb and b is not None)
        dx, dw, db = torch.ops.ls_fairseq.layer_norm_bwd(gy, x, w, b, mean, rstd, False, wg, bg,
                                                         gr if nx else None)
        return (dx if nx else None, dw.view_as(w) if wg else None, db.view_as(b) if bg else None,
                None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("outs", ["y", "r", "yr"])
def test_residual_op_is_bitwise_the_python_function(dtype, outs, kernels):
    x, w, b, gy = _inputs(33, 1030, dtype, seed=5)
    gr = torch.randn_like(gy)
    results = []
    for fn in (kernels.layer_norm_residual_cuda, _KeepInput.apply):
        xi, wi, bi = (t.detach().clone().requires_grad_() for t in (x, w, b))
        y, r = fn(xi, wi, bi, 1e-5)
        assert r.data_ptr() == xi.data_ptr()
        pairs = [(y, gy)] * ("y" in outs) + [(r, gr)] * ("r" in outs)
        torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        results.append([y.detach()] + [t.grad for t in (xi, wi, bi)])
    for a, e in zip(*results):
        assert (a is None) == (e is None) and (a is None or torch.equal(a, e)), outs
    with torch.inference_mode():  # below autograd: the same composite, no graph
        y, r = kernels.layer_norm_residual_cuda(x, w, b, 1e-5)
    assert torch.equal(y, results[0][0]) and r.data_ptr() == x.data_ptr()
