"""GPU tests of the cuBLASLt-epilogue GEMMs (csrc/gemm_epilogues.cpp, ls_fairseq/ops/linear.py,
ls_fairseq/ops/relu_dropout_linear.py).

Oracles:
* the bit-mask layout: cuBLASLt's own ReLU bit-mask (``relu_bias_gemm_aux``, epilogue
  RELU_AUX_BIAS) for the same relu pattern, on integer-valued inputs whose GEMM is exact in fp16
  and whose pre-activations are never 0, so the two masks must be equal bit for bit;
* the GEMMs: the float64 formulas on the same (rounded) inputs: ``grad_x = (grad @ W) * mask *
  scale``, its column sum, ``grad_W = grad^T x``, ``grad_b = grad.sum(0)``;
* the autograd ops: the unfused path they replace (``bias_act_dropout`` + ``F.linear``, and
  ``F.linear`` with its bias), under the same seed (same Philox mask), forward bit for bit.

Tolerances: element-wise ``|err| <= tol * (1 + |truth|)`` with tol = fp16 2e-3, bf16 1.6e-2: the
GEMMs accumulate in fp32 and round once to the storage dtype (relative 2^-11 / 2^-8); for sums and
weight gradients (reductions over up to 4k rows) the norm-wise ``||err|| <= tol * ||truth||``.
A wrong mask bit, a missing scale (1.43x) or a dropped tail row is far outside them.
"""
import pytest
import torch
import torch.nn.functional as F

from kernel_oracle import close, norm_close
from ls_fairseq.ops import _extension
from ls_fairseq.ops.bias_act_dropout import bias_act_dropout
from ls_fairseq.ops.linear import linear
from ls_fairseq.ops.relu_dropout_linear import relu_dropout_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.float16, torch.bfloat16]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
OPS = torch.ops.ls_fairseq


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert _extension.load(), f"CUDA extension did not build: {_extension.failure_reason()}"
    for op in ("linear_bgrad", "relu_dropout_linear", "relu_dropout_mask_fwd"):
        assert _extension.has_op(op), op
    from ls_fairseq.ops import _bias_act_dropout_cuda, _gemm_epilogues_cuda  # noqa: F401 (fakes)


def unpack(mask, features):
    """uint8 [rows, ld / 8] -> bool [rows, features]: bit f % 8 of byte f / 8."""
    bits = (mask.unsqueeze(-1) >> torch.arange(8, device=mask.device, dtype=torch.uint8)) & 1
    return bits.reshape(mask.size(0), -1)[:, :features].bool()


def small_ints(*shape, dtype, lo=-2, hi=2):
    return torch.randint(lo, hi + 1, shape, device="cuda").to(dtype)


# (rows, features): one row, a feature count below / not a multiple of 128, odd rows, FFN width
MASK_SHAPES = [(1, 8), (7, 136), (333, 1000), (64, 4096), (1025, 264)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,features", MASK_SHAPES)
def test_mask_layout_is_cublaslts(rows, features, dtype):
    torch.manual_seed(rows + features)
    k = 64  # |x . w| <= 256: exact in fp16/bf16 (integers below 2^8)
    x, w = small_ints(rows, k, dtype=dtype), small_ints(features, k, dtype=dtype)
    bias = small_ints(features, dtype=dtype, lo=-4, hi=3) + 0.5  # pre-activation never 0
    y_lt, mask_lt = OPS.relu_bias_gemm_aux(x, w, bias)
    pre = F.linear(x, w)
    out, mask = OPS.relu_dropout_mask_fwd(pre, bias, 0.0, True)
    assert mask.shape == mask_lt.shape == (rows, (features + 127) // 128 * 16)
    assert torch.equal(y_lt, out), "relu(x W^T + b) differs between cuBLASLt and the kernel"
    assert torch.equal(unpack(mask, features), unpack(mask_lt, features)), "bit-mask layout"
    assert torch.equal(unpack(mask, features), out > 0)
    assert 0.2 < (out > 0).float().mean().item() < 0.8  # both bit values occur


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,features", [(3, 8), (257, 1000), (4096, 4096), (0, 64)])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_mask_forward_equals_bias_act_dropout(rows, features, p, dtype):
    x = torch.randn(rows, features, device="cuda", dtype=dtype)
    b = torch.randn(features, device="cuda", dtype=dtype)
    torch.manual_seed(5)
    out, mask = OPS.relu_dropout_mask_fwd(x, b, p, True)
    torch.manual_seed(5)
    ref, _ = OPS.bias_act_dropout_fwd(x, b, "relu", p, True)
    assert torch.equal(out, ref), "same seed, same Philox mask, same values"
    assert torch.equal(unpack(mask, features), out > 0)
    if rows and features % 128:
        assert not (mask[:, features // 8:] != 0).any(), "padding bits are unset"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,out_f,features", [(1, 8, 8), (333, 1024, 4096), (77, 520, 1000),
                                                 (4096, 1024, 4096), (0, 64, 128)])
@pytest.mark.parametrize("scale", [1.0, 1 / 0.7])
def test_relu_dropout_dgrad(rows, out_f, features, scale, dtype):
    torch.manual_seed(rows + features)
    grad = torch.randn(rows, out_f, device="cuda", dtype=dtype)
    w = torch.randn(out_f, features, device="cuda", dtype=dtype) / out_f ** 0.5
    mask = torch.randint(0, 256, (rows, (features + 127) // 128 * 16), device="cuda",
                         dtype=torch.uint8)
    gx, gb = OPS.relu_dropout_dgrad(grad, w, mask, scale)
    keep = unpack(mask, features).double()
    truth = (grad.double() @ w.double()) * keep * scale
    close(gx, truth, TOL[dtype], "grad_x")
    norm_close(gb, truth.sum(0), TOL[dtype], "grad_bias")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,in_f,out_f", [(1, 8, 8), (333, 1024, 3072), (77, 1000, 520),
                                             (4095, 1024, 12288), (0, 64, 128)])
def test_linear_wgrad_bgrad(rows, in_f, out_f, dtype):
    torch.manual_seed(rows + out_f)
    grad = torch.randn(rows, out_f, device="cuda", dtype=dtype)
    x = torch.randn(rows, in_f, device="cuda", dtype=dtype)
    gw, gb = OPS.linear_wgrad_bgrad(grad, x)
    assert gw.shape == (out_f, in_f) and gb.shape == (out_f,)
    norm_close(gw, grad.double().t() @ x.double(), TOL[dtype], "grad_weight")
    norm_close(gb, grad.double().sum(0), TOL[dtype], "grad_bias")


# (leading shape, in, out): a [B, T, C] batch with odd T, a 2-D batch, the layer-batched K/V width
LINEAR_SHAPES = [((3, 17), 1024, 3072), ((333,), 520, 1000), ((2, 9), 1024, 12288)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead,in_f,out_f", LINEAR_SHAPES)
def test_linear_matches_f_linear(lead, in_f, out_f, dtype):
    torch.manual_seed(in_f)
    x = torch.randn(*lead, in_f, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(out_f, in_f, device="cuda", dtype=dtype) / in_f ** 0.5).requires_grad_()
    b = torch.randn(out_f, device="cuda", dtype=dtype, requires_grad=True)
    y = linear(x, w, b)
    assert y.grad_fn is not None and "LinearBgrad" in type(y.grad_fn).__name__, type(y.grad_fn)
    y_ref = F.linear(x, w, b)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), g)
    rx, rw, rb = torch.autograd.grad(y_ref, (x, w, b), g)
    assert torch.equal(gx, rx), "the input gradient is the same GEMM"
    g64 = g.double().reshape(-1, out_f)
    norm_close(gw, g64.t() @ x.detach().double().reshape(-1, in_f), TOL[dtype], "grad_weight")
    norm_close(gb, g64.sum(0), TOL[dtype], "grad_bias")
    norm_close(gw, rw.double(), TOL[dtype], "grad_weight vs aten")


# (leading shape, features, out): transformer-big FFN with odd T, a width that is not a multiple
# of 128, a narrow one
RDL_SHAPES = [((5, 37), 4096, 1024), ((333,), 1000, 520), ((2, 3), 8, 16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead,features,out_f", RDL_SHAPES)
@pytest.mark.parametrize("p,training", [(0.0, True), (0.3, True), (0.3, False)])
def test_relu_dropout_linear_matches_unfused(lead, features, out_f, p, training, dtype):
    torch.manual_seed(features)
    x = torch.randn(*lead, features, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(features, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(out_f, features, device="cuda", dtype=dtype) / features ** 0.5).requires_grad_()
    torch.manual_seed(11)
    y = relu_dropout_linear(x, b, w, p, training)
    assert "ReluDropoutLinear" in type(y.grad_fn).__name__, type(y.grad_fn)
    torch.manual_seed(11)
    h = bias_act_dropout(x, b, "relu", p, training)
    y_ref = F.linear(h, w)
    assert torch.equal(y, y_ref), "same seed: same mask, same h, same GEMM"
    g = torch.randn_like(y)
    gx, gb, gw = torch.autograd.grad(y, (x, b, w), g)
    scale = 1 / (1 - p) if (training and p > 0) else 1.0
    passed = (h.detach() > 0).double().reshape(-1, features)
    g64 = g.double().reshape(-1, out_f)
    gx64 = (g64 @ w.detach().double()) * passed * scale
    close(gx.reshape(-1, features), gx64, TOL[dtype], "grad_x")
    norm_close(gb, gx64.sum(0), TOL[dtype], "grad_bias")
    norm_close(gw, g64.t() @ h.detach().double().reshape(-1, features), TOL[dtype], "grad_weight")
    rx, rb, rw = torch.autograd.grad(y_ref, (x, b, w), g)
    norm_close(gx, rx.double(), TOL[dtype], "grad_x vs the unfused path")
    assert torch.equal(gw, rw), "fc2's weight gradient is the same aten GEMM"


def test_no_grad_and_fallbacks_take_the_plain_path(monkeypatch):
    x = torch.randn(4, 8, 64, device="cuda", dtype=torch.float16)
    w = torch.randn(32, 64, device="cuda", dtype=torch.float16)
    b = torch.randn(32, device="cuda", dtype=torch.float16)
    xg = x.clone().requires_grad_()
    assert "LinearBgrad" in type(linear(xg, w, b).grad_fn).__name__
    with torch.no_grad():
        assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    monkeypatch.setenv("LS_FAIRSEQ_GEMM_EPILOGUES", "off")
    assert "LinearBgrad" not in type(linear(xg, w, b).grad_fn).__name__
    assert "ReluDropoutLinear" not in type(relu_dropout_linear(xg, None, w, 0.1, True).grad_fn).__name__
    monkeypatch.setenv("LS_FAIRSEQ_GEMM_EPILOGUES", "on")
    x32 = xg.float().detach().requires_grad_()
    assert "LinearBgrad" not in type(linear(x32, w.float(), b.float()).grad_fn).__name__
    odd = torch.randn(3, 12, device="cuda", dtype=torch.float16, requires_grad=True)
    w_odd = torch.randn(20, 12, device="cuda", dtype=torch.float16)
    assert "LinearBgrad" not in type(linear(odd, w_odd, torch.randn(20, device="cuda",
                                                                  dtype=torch.float16)).grad_fn).__name__


def test_opcheck():
    x = torch.randn(37, 520, device="cuda", dtype=torch.float16, requires_grad=True)
    w = torch.randn(1000, 520, device="cuda", dtype=torch.float16, requires_grad=True)
    b = torch.randn(1000, device="cuda", dtype=torch.float16, requires_grad=True)
    torch.library.opcheck(OPS.linear_bgrad.default, (x, w, b))
    h = torch.randn(37, 1000, device="cuda", dtype=torch.float16, requires_grad=True)
    w2 = torch.randn(520, 1000, device="cuda", dtype=torch.float16, requires_grad=True)
    torch.library.opcheck(OPS.relu_dropout_linear.default, (h, b, w2, 0.0, True))
    torch.library.opcheck(OPS.relu_dropout_mask_fwd.default, (h.detach(), b.detach(), 0.0, True))
    g = torch.randn(37, 1000, device="cuda", dtype=torch.float16)
    torch.library.opcheck(OPS.linear_wgrad_bgrad.default, (g, x.detach()))
    _, mask = OPS.relu_dropout_mask_fwd(h.detach(), b.detach(), 0.2, True)
    g2 = torch.randn(37, 520, device="cuda", dtype=torch.float16)
    torch.library.opcheck(OPS.relu_dropout_dgrad.default, (g2, w2.detach(), mask, 1 / 0.8))


def test_bad_input_is_a_clear_error():
    h = torch.randn(5, 1000, device="cuda", dtype=torch.float16)
    b = torch.randn(1000, device="cuda", dtype=torch.float16)
    w2 = torch.randn(520, 1000, device="cuda", dtype=torch.float16)
    _, mask = OPS.relu_dropout_mask_fwd(h, b, 0.2, True)
    g = torch.randn(5, 520, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="mask must be relu_dropout_mask_fwd's"):
        OPS.relu_dropout_dgrad(g, w2, mask[:, :16], 1.0)
    with pytest.raises(RuntimeError, match="expected float16 or bfloat16"):
        OPS.relu_dropout_mask_fwd(h.float(), b.float(), 0.2, True)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        OPS.relu_dropout_mask_fwd(h[:, :12].contiguous(), b[:12].contiguous(), 0.2, True)
    with pytest.raises(RuntimeError, match="same rows"):
        OPS.linear_wgrad_bgrad(g, h[:4])
