"""GPU tests of the fused pre-LN sublayer boundary ``(x, LayerNorm(x))``, ``x = residual +
dropout(y + bias)`` (csrc/bias_dropout_residual_layer_norm.cu's bdr_ln_fwd_warp_kernel, its C++
autograd in csrc/bias_dropout_residual_layer_norm_autograd.cpp,
ls_fairseq/ops/bias_dropout_residual_layer_norm.py and _bias_dropout_residual_layer_norm_cuda.py).

Oracle: the unfused pair it replaces, ``bias_dropout_residual`` then ``layer_norm_residual`` (each
tested against float64 truth and the Philox oracle in its own test file, and against fairseq's
layers in test_model_cuda.py). Under the same seed the fused kernel must draw the same mask and
round x once as the pair does, so x, LayerNorm(x) and the element-wise gradients (y's and the
residual's) must be **bit for bit** equal: tolerance 0. The gradients that are sums over rows (the
bias's, LayerNorm's weight and bias) come from the fused backward's own partial sums (with
dropout: one pass, bias_dropout_residual_layer_norm_bwd), so only their fp32 summation order
differs: norm-wise ``||err|| <= tol * ||truth||``, tol = one rounding of the dtype (fp32 1e-5,
fp16 2e-3, bf16 1.6e-2). A different mask, a LayerNorm of the unrounded x, a lost residual
gradient, a missing dropout scale or a swapped gradient slot are all far outside that.

Shapes: every vectors-per-lane case of the warp kernel (C/VEC = 1..32, 64, 128, 256 vectors of 16
bytes), one row, odd row counts, the largest C the fused kernel takes, and empty input; shapes it
does not take (C not a multiple of the vector, C above the limit, a misaligned view) go to the
unfused pair.
"""
import pytest
import torch

from ls_fairseq.ops import _extension
from ls_fairseq.ops.bias_dropout_residual_layer_norm import (
    bias_dropout_residual_layer_norm,
    bias_dropout_residual_layer_norm_reference,
)

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (tests/conftest.py)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}
# (rows, C): C / VEC vectors per row covering 1, 2, 4 and 8 vectors per lane; 2048 = fp16's limit
SHAPES = [(1, 8), (7, 64), (33, 512), (129, 1000), (1024, 1024), (5, 1536), (9, 2048), (0, 1024)]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert _extension.load(), f"CUDA extension did not build: {_extension.failure_reason()}"
    assert _extension.has_op("bias_dropout_residual_layer_norm_fwd")
    from ls_fairseq.ops import (
        _bias_dropout_residual_cuda,
        _bias_dropout_residual_layer_norm_cuda,
        _layer_norm_cuda,
    )

    return _layer_norm_cuda, _bias_dropout_residual_cuda, _bias_dropout_residual_layer_norm_cuda


def _inputs(rows, C, dtype, has_bias, has_w, has_lb, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def leaf(*shape, scale=1.0, shift=0.0):
        t = (torch.randn(*shape, device="cuda", generator=g) * scale + shift).to(dtype)
        return t.requires_grad_()

    y, r = leaf(rows, C), leaf(rows, C, scale=2.0, shift=0.5)
    b = leaf(C, scale=0.5) if has_bias else None
    w = leaf(C, scale=0.5, shift=1.0) if has_w else None
    lb = leaf(C, scale=0.5) if has_lb else None
    return y, b, r, w, lb


def _unfused(kernels, y, b, r, w, lb, p, train):
    ln, bdr, _ = kernels
    x = bdr.bias_dropout_residual_cuda(y, b, r, p, train)
    h, x = ln.layer_norm_residual_cuda(x, w, lb, 1e-5)
    return x, h


def _check_equal(kernels, rows, C, dtype, has_bias, has_w, has_lb, p, train, outs):
    _, _, fused = kernels
    y, b, r, w, lb = _inputs(rows, C, dtype, has_bias, has_w, has_lb, seed=rows * 7 + C)
    assert fused.supports(y, b, r, w, lb)
    torch.manual_seed(123)
    x, h = bias_dropout_residual_layer_norm(y, b, r, w, lb, p, train)
    torch.manual_seed(123)
    x2, h2 = _unfused(kernels, y, b, r, w, lb, p, train)
    assert torch.equal(x, x2), "x"
    assert torch.equal(h, h2), "LayerNorm(x)"
    if rows == 0:
        return
    gen = torch.Generator(device="cuda").manual_seed(5)
    gx = torch.randn(rows, C, device="cuda", generator=gen).to(dtype)
    gh = torch.randn(rows, C, device="cuda", generator=gen).to(dtype)
    ins = [t for t in (y, b, r, w, lb) if t is not None]
    pick = [("x" in outs, x, x2, gx), ("h" in outs, h, h2, gh)]
    got = torch.autograd.grad([o for use, o, _, _ in pick if use], ins,
                              [g for use, _, _, g in pick if use], allow_unused=True)
    want = torch.autograd.grad([o for use, _, o, _ in pick if use], ins,
                               [g for use, _, _, g in pick if use], allow_unused=True)
    names = ["y", "bias", "residual", "weight", "ln_bias"]
    for name, a, e in zip([n for n, t in zip(names, (y, b, r, w, lb)) if t is not None], got, want):
        assert (a is None) == (e is None), name
        if a is None:
            continue
        if name in ("y", "residual"):
            assert torch.equal(a, e), f"grad {name}: max diff {(a.float() - e.float()).abs().max()}"
        else:  # a column sum: same terms, another fp32 order
            err = (a.double() - e.double()).norm().item()
            assert err <= TOL[dtype] * e.double().norm().item() + 1e-6, f"grad {name}: {err}"


# fp32 rows hold 4 values a vector: its limit is C = 1024
CASES = [(dtype, rows, C) for dtype in DTYPES for rows, C in SHAPES
         if C <= (1024 if dtype == torch.float32 else 2048)]


@pytest.mark.parametrize("dtype,rows,C", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("p,train", [(0.1, True), (0.0, True), (0.3, False)])
def test_fused_equals_the_unfused_pair(kernels, rows, C, dtype, p, train):
    _check_equal(kernels, rows, C, dtype, True, True, True, p, train, "xh")


@pytest.mark.parametrize("has_bias,has_w,has_lb", [(False, True, True), (True, False, False),
                                                   (False, False, True)])
@pytest.mark.parametrize("outs", ["x", "h", "xh"])
def test_optional_parameters_and_either_output(kernels, has_bias, has_w, has_lb, outs):
    _check_equal(kernels, 77, 1024, torch.float16, has_bias, has_w, has_lb, 0.1, True, outs)


@pytest.mark.parametrize("dtype,C", [(torch.float16, 1002), (torch.float16, 4096),
                                     (torch.float32, 2048), (torch.bfloat16, 12)])
def test_shapes_the_kernel_does_not_take_use_the_pair(kernels, dtype, C):
    _, _, fused = kernels
    y, b, r, w, lb = _inputs(9, C, dtype, True, True, True, seed=C)
    assert not fused.supports(y, b, r, w, lb)
    torch.manual_seed(9)
    x, h = bias_dropout_residual_layer_norm(y, b, r, w, lb, 0.1, True)
    torch.manual_seed(9)
    x2, h2 = _unfused(kernels, y, b, r, w, lb, 0.1, True)
    assert torch.equal(x, x2) and torch.equal(h, h2)
    with pytest.raises(RuntimeError, match="must be a multiple of"):
        torch.ops.ls_fairseq.bias_dropout_residual_layer_norm_fwd(y, b, r, w, lb, 0.1, True, 1e-5)


def test_misaligned_views_use_the_pair(kernels):
    _, _, fused = kernels
    big = torch.randn(9 * 1024 + 1, device="cuda", dtype=torch.float16)
    y = big[1:].view(9, 1024)  # 2-byte offset
    r = torch.randn(9, 1024, device="cuda", dtype=torch.float16)
    assert not fused.supports(y, None, r, None, None)
    x, h = bias_dropout_residual_layer_norm(y, None, r, None, None, 0.0, True)
    rx, rh = bias_dropout_residual_layer_norm_reference(y.float(), None, r.float(), None, None,
                                                        0.0, True)
    assert (x.float() - rx).abs().max() < 1e-2 and (h.float() - rh).abs().max() < 2e-2


def test_fused_backward_op_matches_the_pair_of_kernels(kernels):
    """The one-pass backward against layer_norm_bwd then bias_dropout_residual_bwd, called directly
    (with and without x's own gradient, with and without the parameter gradients)."""
    ops = torch.ops.ls_fairseq
    g = torch.Generator(device="cuda").manual_seed(3)
    rows, C = 333, 1024
    h16 = dict(device="cuda", dtype=torch.float16)
    y, r = torch.randn(rows, C, **h16), torch.randn(rows, C, **h16)
    bias, w, lb = torch.randn(C, **h16), torch.randn(C, **h16), torch.randn(C, **h16)
    x, _, mean, rstd, rng = ops.bias_dropout_residual_layer_norm_fwd(y, bias, r, w, lb, 0.2, True,
                                                                      1e-5)
    grad = torch.randn(rows, C, device="cuda", generator=g).half()
    for grad_x in (None, torch.randn(rows, C, device="cuda", generator=g).half()):
        for need in (True, False):
            dx, gy, dw, dlb, db = ops.bias_dropout_residual_layer_norm_bwd(
                grad, x, w, lb, mean, rstd, grad_x, rng, 0.2, True, need, need, need)
            dx2, dw2, dlb2 = ops.layer_norm_bwd(grad, x, w, lb, mean, rstd, False, need, need,
                                                grad_x)
            gy2, db2 = ops.bias_dropout_residual_bwd(dx2, rng, 0.2, True, need)
            assert torch.equal(dx, dx2) and torch.equal(gy, gy2)
            for a, e in ((dw, dw2), (dlb, dlb2), (db, db2)):
                assert a.shape == e.shape == ((C,) if need else (0,))
                if need:
                    assert (a.double() - e.double()).norm() <= 2e-3 * e.double().norm()
    with pytest.raises(RuntimeError, match="only with dropout"):
        ops.bias_dropout_residual_layer_norm_bwd(grad, x, w, lb, mean, rstd, None, rng, 0.0, True,
                                                 False, False, False)


def test_opcheck(kernels):
    y = torch.randn(37, 512, device="cuda", requires_grad=True)
    r = torch.randn(37, 512, device="cuda", requires_grad=True)
    w = torch.randn(512, device="cuda", requires_grad=True)
    b = torch.randn(512, device="cuda", requires_grad=True)
    ops = torch.ops.ls_fairseq
    torch.library.opcheck(ops.bias_dropout_residual_layer_norm_fwd.default,
                          (y, b, r, w, b, 0.0, True, 1e-5))
    x, _, mean, rstd, rng = ops.bias_dropout_residual_layer_norm_fwd(
        y.detach(), b.detach(), r.detach(), w.detach(), b.detach(), 0.3, True, 1e-5)
    g = torch.randn_like(x)
    torch.library.opcheck(ops.bias_dropout_residual_layer_norm_bwd.default,
                          (g, x, w.detach(), b.detach(), mean, rstd, g, rng, 0.3, True, True,
                           True, True))
