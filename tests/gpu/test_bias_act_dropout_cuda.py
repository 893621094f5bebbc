"""GPU tests of ``dropout(act(x + bias))``, act = relu | exact-erf gelu
(ls_fairseq/ops/_bias_act_dropout_cuda.py, csrc/dropout_fusions.cu).

The dropout mask is checked exactly against ``philox_keep`` (the Philox4x32-10 layout documented
in csrc/dropout_fusions.cu, recomputed from the (seed, offset) the forward returns; the oracle is
checked against the published known-answer vectors in test_bias_dropout_residual_cuda.py and
here). Given the mask, the truth is the float64 formula on the same inputs, with fairseq's
activations (relu; gelu = x * Phi(x) with erf, not the tanh approximation), forward and backward
(grad_x = grad * mask / (1 - p) * act'(x + b); grad_bias its column sum).

Tolerances: elementwise ``|err| <= tol * (1 + |truth|)``, tol = fp32 1e-5, fp16 2e-3,
bf16 1.6e-2 (fp32 math rounded once to the storage dtype); ``||err|| / ||truth|| <= tol`` for the
bias gradient. A wrong mask element, a tanh-GELU or a wrong derivative is far outside them (the
tanh approximation differs from erf GELU by up to ~1e-3 absolute near |x| ~ 2, above the fp32
tolerance; see test_gelu_is_erf_not_tanh).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from kernel_oracle import close, norm_close, philox_keep
from ls_fairseq.ops import _extension
from ls_fairseq.ops.bias_act_dropout import bias_act_dropout, bias_act_dropout_reference

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (tests/conftest.py)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def _close(ours, truth, dtype, what):
    close(ours, truth, TOL[dtype], what)


def _norm_close(ours, truth, dtype, what, terms=None):
    norm_close(ours, truth, TOL[dtype], what, terms)
ACTS = ["relu", "gelu"]
# (rows, C): FFN widths 2048/4096, odd widths (scalar path), 1 .. 32k rows, empty input
SHAPES = [(1, 1), (3, 7), (5, 17), (64, 2048), (257, 1000), (33, 1026), (4096, 4096), (7, 4095),
          (32768, 512), (0, 64)]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert _extension.load(), f"CUDA extension did not build: {_extension.failure_reason()}"
    assert _extension.has_op("bias_act_dropout_fwd")
    from ls_fairseq.ops import _bias_act_dropout_cuda

    return _bias_act_dropout_cuda


def _act64(name, h):
    return F.relu(h) if name == "relu" else F.gelu(h)  # exact erf GELU


def _check(rows, C, dtype, act, p, train, bias=True):
    x = (2 * torch.randn(rows, C, device="cuda")).to(dtype).requires_grad_()
    b = torch.randn(C, device="cuda").to(dtype).requires_grad_() if bias else None
    g = torch.randn(rows, C, device="cuda").to(dtype)
    out, rng = torch.ops.ls_fairseq.bias_act_dropout_fwd(x, b, act, p, train)
    out.backward(g)
    active = train and p > 0
    keep = philox_keep(rng, rows, C, p) if active else torch.ones(rows, C, dtype=torch.bool, device="cuda")
    scale = (1.0 / (1.0 - p) if p < 1 else 0.0) if active else 1.0
    h = (x.detach().double() + (b.detach().double() if bias else 0.0)).requires_grad_()
    truth = torch.where(keep, _act64(act, h) * scale, torch.zeros_like(h))
    truth.backward(g.double())
    _close(out.detach(), truth.detach(), dtype, "out")
    _close(x.grad, h.grad, dtype, "grad_x")
    if bias:
        upstream = torch.where(keep, g.double() * scale, torch.zeros_like(h))
        _norm_close(b.grad, h.grad.sum(0), dtype, "grad_bias", terms=upstream)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,C", SHAPES)
@pytest.mark.parametrize("p,train", [(0.1, True), (0.0, True), (0.3, False)], ids=["p0.1", "p0", "eval"])
def test_forward_backward(rows, C, dtype, act, p, train):
    _check(rows, C, dtype, act, p, train)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_no_bias_and_p_one(dtype, act):
    _check(129, 520, dtype, act, 0.25, True, bias=False)
    _check(64, 512, dtype, act, 1.0, True)


def test_gelu_is_erf_not_tanh():
    x = torch.linspace(-6, 6, 4096, device="cuda").reshape(4, 1024)
    out, _ = torch.ops.ls_fairseq.bias_act_dropout_fwd(x, None, "gelu", 0.0, False)
    exact = F.gelu(x.double())
    tanh = F.gelu(x.double(), approximate="tanh")
    assert (exact - tanh).abs().max() > 1e-4  # the two differ measurably here
    torch.testing.assert_close(out.double(), exact, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("act", ACTS)
def test_matches_public_reference(act):
    """Eval mode vs the op's PyTorch reference (which rounds x + b to the storage dtype first:
    one extra rounding, so 2x the tolerance)."""
    x = torch.randn(300, 1024, device="cuda", dtype=torch.float16)
    b = torch.randn(1024, device="cuda", dtype=torch.float16)
    ours = bias_act_dropout(x, b, act, 0.1, False)
    ref = bias_act_dropout_reference(x, b, act, 0.1, False)
    torch.testing.assert_close(ours, ref, rtol=4e-3, atol=4e-3)
    torch.manual_seed(5)
    a = bias_act_dropout(x, b, act, 0.1, True)
    torch.manual_seed(5)
    direct, _ = torch.ops.ls_fairseq.bias_act_dropout_fwd(x, b, act, 0.1, True)
    assert torch.equal(a, direct)  # the public op runs the kernel


def test_other_activations_use_the_reference():
    x = torch.randn(8, 64, device="cuda", dtype=torch.float16)
    b = torch.randn(64, device="cuda", dtype=torch.float16)
    for act in ("gelu_accurate", "tanh", "linear"):
        torch.testing.assert_close(
            bias_act_dropout(x, b, act, 0.0, False), bias_act_dropout_reference(x, b, act, 0.0, False)
        )


def test_reproducible_with_seed_and_keep_rate():
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.float16).abs() + 0.5  # relu keeps all
    torch.manual_seed(11)
    o1, rng1 = torch.ops.ls_fairseq.bias_act_dropout_fwd(x, None, "relu", 0.1, True)
    torch.manual_seed(11)
    o2, rng2 = torch.ops.ls_fairseq.bias_act_dropout_fwd(x, None, "relu", 0.1, True)
    o3, _ = torch.ops.ls_fairseq.bias_act_dropout_fwd(x, None, "relu", 0.1, True)
    assert torch.equal(o1, o2) and torch.equal(rng1, rng2)
    assert abs((o1 != o3).double().mean().item() - 0.18) < 0.01
    kept = (o1 != 0).double().mean().item()
    assert abs(kept - 0.9) < 5 * math.sqrt(0.09 / x.numel())


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="activation must be 'relu' or 'gelu'"):
        torch.ops.ls_fairseq.bias_act_dropout_fwd(x, None, "swish", 0.1, True)
    with pytest.raises(RuntimeError, match="bias dtype"):
        torch.ops.ls_fairseq.bias_act_dropout_fwd(x, torch.zeros(64, device="cuda"), "relu", 0.1, True)


def test_opcheck():
    x = torch.randn(37, 520, device="cuda", requires_grad=True)
    b = torch.randn(520, device="cuda", requires_grad=True)
    torch.library.opcheck(torch.ops.ls_fairseq.bias_act_dropout_fwd.default, (x, b, "gelu", 0.0, True))
    _, rng = torch.ops.ls_fairseq.bias_act_dropout_fwd(x.detach(), b.detach(), "gelu", 0.2, True)
    g = torch.randn_like(x)
    torch.library.opcheck(
        torch.ops.ls_fairseq.bias_act_dropout_bwd.default,
        (g, x.detach(), b.detach(), rng, "gelu", 0.2, True, True),
    )


def test_relu_backward_opcheck():
    x = torch.randn(37, 520, device="cuda")
    out, _ = torch.ops.ls_fairseq.bias_act_dropout_fwd(x, None, "relu", 0.2, True)
    g = torch.randn_like(x)
    for bias_grad in (True, False):
        torch.library.opcheck(torch.ops.ls_fairseq.relu_dropout_bwd.default,
                              (g, out, 0.2, True, bias_grad))
    with pytest.raises(RuntimeError, match="out must have the shape"):
        torch.ops.ls_fairseq.relu_dropout_bwd(g, out[:, :10], 0.2, True, True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,C", SHAPES)
def test_relu_backward_from_the_output_equals_the_regenerated_mask(rows, C, dtype):
    """relu_dropout_bwd (reads ``out``) gives bit for bit the grad_x that bias_act_dropout_bwd
    (regenerates the mask, recomputes ``x + b``) gives: a kept, active element has ``out > 0``
    and both scale the same gradient once. The bias gradients sum the same values, but each
    kernel's grid follows its own occupancy, so the float32 partial sums may be grouped
    differently: equal within the dtype's tolerance."""
    x = (2 * torch.randn(rows, C, device="cuda")).to(dtype)
    x[:, ::3] = 0  # ties at zero: relu'(0) = 0 in both
    b = torch.randn(C, device="cuda").to(dtype)
    b[::5] = 0
    g = torch.randn(rows, C, device="cuda").to(dtype)
    for p, train in ((0.1, True), (0.0, True), (0.3, False), (1.0, True)):
        out, rng = torch.ops.ls_fairseq.bias_act_dropout_fwd(x, b, "relu", p, train)
        a = torch.ops.ls_fairseq.bias_act_dropout_bwd(g, x, b, rng, "relu", p, train, True)
        r = torch.ops.ls_fairseq.relu_dropout_bwd(g, out, p, train, True)
        assert torch.equal(a[0], r[0]), (p, train)
        _norm_close(r[1], a[1].double(), dtype, f"grad_bias p={p} train={train}")


@pytest.mark.parametrize("act", ACTS)
def test_what_the_backward_keeps(act):
    """relu keeps only its output (which fc2 saves anyway): its input, the fc1 GEMM output, is
    freed once the caller drops it; gelu keeps the input. Measured as allocated memory between
    the forward and the backward."""
    rows, C = 2048, 4096
    size = rows * C * 2
    w = torch.randn(C, device="cuda", dtype=torch.float16, requires_grad=True)
    b = torch.randn(C, device="cuda", dtype=torch.float16, requires_grad=True)
    x0 = torch.randn(rows, C, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    x = x0 * w  # a non-leaf input (as the GEMM output is): freed unless the op keeps it
    out = bias_act_dropout(x, b, act, 0.1, True)
    del x
    kept = torch.cuda.memory_allocated() - before
    expected = size if act == "relu" else 2 * size  # out (+ x for gelu), plus small tensors
    assert expected <= kept < expected + size // 4, (act, kept / size)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(w.grad).all() and torch.isfinite(b.grad).all()
