"""GPU tests of ``residual + dropout(x + bias)`` (ls_fairseq/ops/_bias_dropout_residual_cuda.py,
csrc/dropout_fusions.cu).

The dropout mask is checked exactly: ``philox_keep`` below recomputes it from the (seed, offset)
the forward returns, with the layout documented in csrc/dropout_fusions.cu (element (r, c) uses
word c % 4 of the Philox4x32-10 block at counter {offset / 4, r * ceil(C / 4) + c / 4}). The
oracle itself is checked against the published Philox4x32-10 known-answer vectors. Given the
mask, the truth is the float64 formula on the same inputs; forward and backward must agree with
it, i.e. the mask is the same in forward and backward and grad_x = grad * mask / (1 - p) exactly
where an element was kept. Statistics (keep rate, independence of neighbours), reproducibility
under ``torch.manual_seed``, independence of the launch configuration and CUDA graph replay are
tested separately.

Tolerances: elementwise ``|err| <= tol * (1 + |truth|)`` with tol = fp32 1e-5, fp16 2e-3,
bf16 1.6e-2 (one rounding of an fp32 result, plus the rounding of the scaled value), and
``||err|| / ||truth|| <= tol`` for the bias gradient (a sum over rows). A wrong mask element is an
O(1) error and fails.
"""
import math

import pytest
import torch

from kernel_oracle import close, norm_close, philox_keep
from ls_fairseq.ops import _extension
from ls_fairseq.ops.bias_dropout_residual import (
    bias_dropout_residual,
    bias_dropout_residual_reference,
)

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (tests/conftest.py)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def _close(ours, truth, dtype, what):
    close(ours, truth, TOL[dtype], what)


def _norm_close(ours, truth, dtype, what, terms=None):
    norm_close(ours, truth, TOL[dtype], what, terms)
# (rows, C): scalar path (C % 8 != 0 for 16-bit, C % 4 != 0 for fp32) and 16-byte vectors,
# one row .. 32k rows, and empty input
SHAPES = [(1, 1), (3, 7), (5, 17), (64, 512), (257, 1000), (33, 1026), (4096, 1024), (7, 4096),
          (32768, 512), (0, 64)]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert _extension.load(), f"CUDA extension did not build: {_extension.failure_reason()}"
    assert _extension.has_op("bias_dropout_residual_fwd")
    from ls_fairseq.ops import _bias_dropout_residual_cuda

    return _bias_dropout_residual_cuda


def _inputs(rows, C, dtype, bias=True):
    x = torch.randn(rows, C, device="cuda").to(dtype).requires_grad_()
    b = torch.randn(C, device="cuda").to(dtype).requires_grad_() if bias else None
    r = torch.randn(rows, C, device="cuda").to(dtype).requires_grad_()
    g = torch.randn(rows, C, device="cuda").to(dtype)
    return x, b, r, g


def _check(rows, C, dtype, p, train, bias=True):
    x, b, r, g = _inputs(rows, C, dtype, bias)
    out, rng = torch.ops.ls_fairseq.bias_dropout_residual_fwd(x, b, r, p, train)
    out.backward(g)
    active = train and p > 0
    keep = philox_keep(rng, rows, C, p) if active else torch.ones(rows, C, dtype=torch.bool, device="cuda")
    scale = 1.0 / (1.0 - p) if (active and p < 1) else (0.0 if active else 1.0)
    h = x.detach().double() + (b.detach().double() if bias else 0.0)
    truth = r.detach().double() + torch.where(keep, h * scale, torch.zeros_like(h))
    _close(out.detach(), truth, dtype, "out")
    gx = torch.where(keep, g.double() * scale, torch.zeros_like(h))
    _close(x.grad, gx, dtype, "grad_x")
    assert torch.equal(r.grad, g), "grad_residual must be the upstream gradient"
    if bias:
        _norm_close(b.grad, gx.sum(0), dtype, "grad_bias", terms=gx)
    return keep


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,C", SHAPES)
@pytest.mark.parametrize("p,train", [(0.1, True), (0.0, True), (0.3, False)], ids=["p0.1", "p0", "eval"])
def test_forward_backward(rows, C, dtype, p, train):
    _check(rows, C, dtype, p, train)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_no_bias_and_p_one(dtype):
    _check(129, 520, dtype, 0.25, True, bias=False)
    keep = _check(64, 512, dtype, 1.0, True)
    assert not keep.any()


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_keep_rate_and_independence(p):
    rows, C = 4096, 1024
    x = torch.randn(rows, C, device="cuda", dtype=torch.float16)
    out, rng = torch.ops.ls_fairseq.bias_dropout_residual_fwd(x, None, torch.zeros_like(x), p, True)
    kept = out != 0
    assert torch.equal(kept, philox_keep(rng, rows, C, p) & (x != 0))
    keep = philox_keep(rng, rows, C, p).double()
    n = keep.numel()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(keep.mean().item() - (1 - p)) < 5 * sigma
    # per column class (word index within a Philox block) and per row parity
    for k in range(4):
        sub = keep[:, k::4]
        assert abs(sub.mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / sub.numel())
    # neighbours are independent: P(same) = p^2 + (1-p)^2
    same = p * p + (1 - p) ** 2
    for a, b_ in ((keep[:, :-1], keep[:, 1:]), (keep[:, :-4], keep[:, 4:]), (keep[:-1], keep[1:])):
        agree = (a == b_).double().mean().item()
        assert abs(agree - same) < 5 * math.sqrt(same * (1 - same) / a.numel())


def test_reproducible_with_seed_and_fresh_per_call():
    x, b, r, _ = _inputs(1000, 1024, torch.float16)
    torch.manual_seed(1234)
    o1 = bias_dropout_residual(x, b, r, 0.1, True)
    o2 = bias_dropout_residual(x, b, r, 0.1, True)
    torch.manual_seed(1234)
    o1b = bias_dropout_residual(x, b, r, 0.1, True)
    torch.manual_seed(4321)
    o3 = bias_dropout_residual(x, b, r, 0.1, True)
    assert torch.equal(o1, o1b)
    frac_12 = (o1 != o2).double().mean().item()
    frac_13 = (o1 != o3).double().mean().item()
    expected = 2 * 0.1 * 0.9  # elements kept in one draw and dropped in the other
    assert abs(frac_12 - expected) < 0.01 and abs(frac_13 - expected) < 0.01


def test_public_op_dispatches_to_kernel():
    x, b, r, _ = _inputs(100, 512, torch.bfloat16)
    torch.manual_seed(7)
    ours = bias_dropout_residual(x, b, r, 0.2, True)
    torch.manual_seed(7)
    direct, _ = torch.ops.ls_fairseq.bias_dropout_residual_fwd(x, b, r, 0.2, True)
    assert torch.equal(ours, direct)
    # eval: identity dropout, same as the PyTorch reference up to its extra roundings
    ref = bias_dropout_residual_reference(x.double(), b.double(), r.double(), 0.2, False)
    _close(bias_dropout_residual(x, b, r, 0.2, False).detach(), ref.detach(), torch.bfloat16, "eval")


def test_mask_independent_of_launch_shape():
    """The mask of element (r, c) depends only on (seed, offset, r, c): a prefix of the rows
    (a different grid) draws the same mask."""
    x, b, r, _ = _inputs(3001, 1024, torch.float16)
    torch.manual_seed(99)
    full, rng_full = torch.ops.ls_fairseq.bias_dropout_residual_fwd(x, b, r, 0.3, True)
    torch.manual_seed(99)
    part, rng_part = torch.ops.ls_fairseq.bias_dropout_residual_fwd(x[:7], b, r[:7], 0.3, True)
    assert torch.equal(rng_full, rng_part)
    assert torch.equal(full[:7], part)


def test_cuda_graph_replay_draws_new_masks():
    x, b, r, _ = _inputs(256, 512, torch.float16)
    x, b, r = x.detach(), b.detach(), r.detach()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up outside the graph
            torch.ops.ls_fairseq.bias_dropout_residual_fwd(x, b, r, 0.5, True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, rng = torch.ops.ls_fairseq.bias_dropout_residual_fwd(x, b, r, 0.5, True)
    results = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        keep = philox_keep(rng, 256, 512, 0.5)
        truth = r.double() + torch.where(keep, (x.double() + b.double()) * 2.0, torch.zeros_like(x, dtype=torch.float64))
        _close(out, truth, torch.float16, "graph replay")
        results.append(out.clone())
    assert not torch.equal(results[0], results[1])


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="residual shape"):
        torch.ops.ls_fairseq.bias_dropout_residual_fwd(x, None, x[:2], 0.1, True)
    with pytest.raises(RuntimeError, match="bias must have C = 64"):
        torch.ops.ls_fairseq.bias_dropout_residual_fwd(x, x[0, :3], x, 0.1, True)
    with pytest.raises(RuntimeError, match=r"p must be in \[0, 1\]"):
        torch.ops.ls_fairseq.bias_dropout_residual_fwd(x, None, x, 1.5, True)


def test_opcheck():
    x, b, r, g = _inputs(37, 520, torch.float32)
    # p = 0: deterministic, so the fake/compiled comparisons are meaningful
    torch.library.opcheck(torch.ops.ls_fairseq.bias_dropout_residual_fwd.default, (x, b, r, 0.0, True))
    _, rng = torch.ops.ls_fairseq.bias_dropout_residual_fwd(x.detach(), b.detach(), r.detach(), 0.2, True)
    torch.library.opcheck(torch.ops.ls_fairseq.bias_dropout_residual_bwd.default, (g, rng, 0.2, True, True))
