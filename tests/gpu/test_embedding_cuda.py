"""GPU tests of the Transformer input embedding ``dropout(scale * E[tok] + P[pos])`` with padding
(ls_fairseq/ops/_embedding_cuda.py, csrc/embedding.cu).

Inputs are fairseq-shaped: right-padded sentences of random lengths (some all padding), positions
from ``fairseq.utils.make_positions``, a learned positional table (gets a gradient, its padding
row none), a sinusoidal table (no gradient) or none, and small vocabularies so that tokens repeat
many times (gradient accumulation). The dropout mask is checked exactly against ``philox_keep``
(the Philox4x32-10 layout documented in csrc/embedding.cu, from the (seed, offset) the forward
returns). Given the mask, the truth is the float64 formula: forward; token-table gradient
``sum over n with tok[n] = v of scale * g[n] * mask / (1 - p)`` (zero for the padding row and for
zeroed padded positions); learned-table gradient likewise. Both backward modes run: float atomics
(default) and the deterministic sorted one, which must also be bitwise reproducible.

Tolerances: elementwise ``|err| <= tol * (1 + |truth|)`` on the output, ``||err|| / ||truth|| <= tol``
on the table gradients (sums of up to thousands of rows, float32 accumulation, one rounding);
tol = fp32 1e-5, fp16 2e-3, bf16 1.6e-2. A wrong row, a gradient on a padding row or a mask error
is O(1) and fails.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from kernel_oracle import close, norm_close, philox_keep
from ls_fairseq.ops import _extension
from ls_fairseq.ops.embedding import transformer_embedding, transformer_embedding_reference

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (tests/conftest.py)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def _close(ours, truth, dtype, what):
    close(ours, truth, TOL[dtype], what)


def _norm_close(ours, truth, dtype, what, terms=None):
    norm_close(ours, truth, TOL[dtype], what, terms)
PAD = 1
# (batch, time, vocab, C): tiny vocabularies (heavy repetition), odd C (scalar path), 1 .. 32k tokens
CASES = [(1, 1, 10, 8), (3, 7, 5, 17), (8, 33, 100, 512), (4, 50, 1000, 1000), (2, 5, 7, 1026),
         (64, 64, 32000, 1024), (512, 64, 8, 512)]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert _extension.load(), f"CUDA extension did not build: {_extension.failure_reason()}"
    assert _extension.has_op("embedding_fwd")
    from ls_fairseq.ops import _embedding_cuda

    return _embedding_cuda


def make_positions(tokens, pad):
    mask = tokens.ne(pad).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + pad


def sinusoidal_table(num, dim, pad):
    from fairseq.modules import SinusoidalPositionalEmbedding

    return SinusoidalPositionalEmbedding.get_embedding(num, dim, pad)


def _batch(B, T, V, all_pad_rows=True):
    lengths = torch.randint(1, T + 1, (B,))
    if all_pad_rows and B > 1:
        lengths[torch.randint(0, B, (max(1, B // 4),))] = 0  # sentences that are all padding
    tokens = torch.randint(2, V, (B, T)) if V > 2 else torch.full((B, T), 2)
    tokens[torch.arange(T)[None, :] >= lengths[:, None]] = PAD
    tokens = tokens.cuda()
    return tokens, make_positions(tokens, PAD)


def _tables(V, C, T, dtype, pos_kind):
    E = (torch.randn(V, C, device="cuda") * 0.5).to(dtype)
    E[PAD] = 0
    E.requires_grad_()
    if pos_kind == "learned":
        P = (torch.randn(T + PAD + 1, C, device="cuda") * 0.5).to(dtype)
        P[PAD] = 0
        P.requires_grad_()
    elif pos_kind == "sinusoidal":
        P = sinusoidal_table(T + PAD + 1, C, PAD).to(device="cuda", dtype=dtype)
    else:
        P = None
    return E, P


def _truth(tokens, positions, E, P, scale, keep, p, zero_pad, g):
    E64 = E.detach().double().requires_grad_()
    x = scale * F.embedding(tokens, E64, PAD)
    P64 = None
    if P is not None:
        P64 = P.detach().double().requires_grad_(P.requires_grad)
        x = x + F.embedding(positions, P64, PAD)
    if keep is not None:
        x = torch.where(keep.view_as(x), x / (1 - p) if p < 1 else x * 0, torch.zeros_like(x))
    if zero_pad:
        x = x * (1 - tokens.eq(PAD).unsqueeze(-1).double())
    x.backward(g.double())
    return x.detach(), E64.grad, (P64.grad if P64 is not None and P64.requires_grad else None)


def _run(B, T, V, C, dtype, pos_kind, p, train, zero_pad, deterministic, monkeypatch):
    monkeypatch.setenv("LS_FAIRSEQ_DETERMINISTIC", "1" if deterministic else "0")
    tokens, positions = _batch(B, T, V)
    E, P = _tables(V, C, T, dtype, pos_kind)
    scale = math.sqrt(C)
    out, rng = torch.ops.ls_fairseq.embedding_fwd(tokens, positions, E, P, scale, PAD, p, train, zero_pad)
    g = torch.randn_like(out)
    out.backward(g)
    active = train and p > 0
    keep = philox_keep(rng, B * T, C, p) if active else None
    truth, gE, gP = _truth(tokens, positions, E, P, scale, keep, p, zero_pad, g)
    _close(out.detach(), truth, dtype, "out")
    _norm_close(E.grad, gE, dtype, "grad token table")
    assert torch.count_nonzero(E.grad[PAD]) == 0, "padding row of the token table got a gradient"
    if pos_kind == "learned":
        _norm_close(P.grad, gP, dtype, "grad positional table")
        assert torch.count_nonzero(P.grad[PAD]) == 0
    elif P is not None:
        assert P.grad is None
    return tokens, positions, E, P, g, rng


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "sorted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pos_kind", ["learned", "sinusoidal", "none"])
@pytest.mark.parametrize("B,T,V,C", CASES)
def test_forward_backward(B, T, V, C, pos_kind, dtype, deterministic, monkeypatch):
    _run(B, T, V, C, dtype, pos_kind, 0.1, True, True, deterministic, monkeypatch)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p,train,zero_pad", [(0.0, True, True), (0.3, False, True), (0.2, True, False),
                                              (1.0, True, True)])
def test_modes(p, train, zero_pad, dtype, monkeypatch):
    for deterministic in (False, True):
        _run(16, 40, 50, 520, dtype, "learned", p, train, zero_pad, deterministic, monkeypatch)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sorted_backward_is_bitwise_reproducible(dtype, monkeypatch):
    monkeypatch.setenv("LS_FAIRSEQ_DETERMINISTIC", "1")
    tokens, positions = _batch(256, 64, 20)
    E, P = _tables(20, 512, 64, dtype, "learned")
    grads = []
    for _ in range(3):
        E.grad = P.grad = None
        torch.manual_seed(3)
        out = transformer_embedding(tokens, positions, E, P, 8.0, PAD, 0.1, True, True)
        out.backward(torch.ones_like(out))
        grads.append((E.grad.clone(), P.grad.clone()))
    for ge, gp in grads[1:]:
        assert torch.equal(ge, grads[0][0]) and torch.equal(gp, grads[0][1])


def test_deterministic_algorithms_flag_selects_sorted_path(kernels, monkeypatch):
    monkeypatch.delenv("LS_FAIRSEQ_DETERMINISTIC", raising=False)
    assert not kernels.deterministic_backward()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert kernels.deterministic_backward()
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("learned", [True, False], ids=["learned", "sinusoidal"])
def test_matches_fairseq_modules(learned):
    """p = 0: the op equals fairseq's forward_embedding built from its own modules (fp16)."""
    from fairseq.models.transformer import Embedding
    from fairseq.modules import PositionalEmbedding

    V, C, T = 1000, 512, 40
    tokens, positions = _batch(24, T, V)
    embed = Embedding(V, C, PAD).cuda().half()
    pe = PositionalEmbedding(128, C, PAD, learned=learned).cuda().half()
    scale = math.sqrt(C)
    x_ref = scale * embed(tokens) + pe(tokens)
    x_ref = x_ref * (1 - tokens.eq(PAD).unsqueeze(-1).type_as(x_ref))
    g = torch.randn_like(x_ref)
    x_ref.backward(g)
    table = pe.weight if learned else pe.weights
    E = embed.weight.detach().clone().requires_grad_()
    P = table.detach().clone().requires_grad_(learned)
    out = transformer_embedding(tokens, positions, E, P, scale, PAD, 0.0, True, True)
    out.backward(g)
    torch.testing.assert_close(out, x_ref, rtol=2e-3, atol=2e-3)
    _norm_close(E.grad, embed.weight.grad.double(), torch.float16, "token grad vs fairseq")
    if learned:
        _norm_close(P.grad, pe.weight.grad.double(), torch.float16, "positional grad vs fairseq")


def test_public_op_and_reference_agree_in_eval():
    tokens, positions = _batch(8, 30, 200)
    E, P = _tables(200, 1024, 30, torch.bfloat16, "sinusoidal")
    ours = transformer_embedding(tokens, positions, E, P, 32.0, PAD, 0.1, False, True)
    ref = transformer_embedding_reference(tokens, positions, E.double(), P.double(), 32.0, PAD, 0.1, False, True)
    _close(ours.detach(), ref.detach(), torch.bfloat16, "eval vs reference")
    torch.manual_seed(21)
    a = transformer_embedding(tokens, positions, E, P, 32.0, PAD, 0.1, True, True)
    torch.manual_seed(21)
    b, _ = torch.ops.ls_fairseq.embedding_fwd(tokens, positions, E, P, 32.0, PAD, 0.1, True, True)
    assert torch.equal(a, b)  # the public op runs the kernel
    # fp32 sinusoidal buffer with an fp16 token table (fairseq before its first forward): cast
    P32 = sinusoidal_table(31 + PAD, 1024, PAD).cuda()
    E16 = E.detach().half()
    out = transformer_embedding(tokens, positions, E16, P32, 32.0, PAD, 0.0, True, True)
    ref = transformer_embedding_reference(tokens, positions, E16.double(), P32.double(), 32.0, PAD, 0.0, True, True)
    _close(out, ref, torch.float16, "mixed dtypes")


def test_reproducible_with_seed():
    tokens, positions = _batch(64, 64, 1000, all_pad_rows=False)
    E, P = _tables(1000, 512, 64, torch.float16, "learned")
    torch.manual_seed(5)
    o1 = transformer_embedding(tokens, positions, E, P, 4.0, PAD, 0.1, True, False)
    o2 = transformer_embedding(tokens, positions, E, P, 4.0, PAD, 0.1, True, False)
    torch.manual_seed(5)
    o3 = transformer_embedding(tokens, positions, E, P, 4.0, PAD, 0.1, True, False)
    assert torch.equal(o1, o3)
    assert not torch.equal(o1, o2)


def test_opcheck():
    tokens, positions = _batch(4, 9, 30)
    E, P = _tables(30, 64, 9, torch.float32, "learned")
    torch.library.opcheck(
        torch.ops.ls_fairseq.embedding_fwd.default, (tokens, positions, E, P, 8.0, PAD, 0.0, True, True)
    )
    out, rng = torch.ops.ls_fairseq.embedding_fwd(tokens, positions, E.detach(), P.detach(), 8.0, PAD, 0.2, True, True)
    g = torch.randn_like(out)
    torch.library.opcheck(
        torch.ops.ls_fairseq.embedding_bwd.default,
        (g, tokens, positions, E.detach(), P.detach(), rng, 8.0, PAD, 0.2, True, True, True, True, True),
    )


def test_bad_inputs_raise_clear_errors():
    tokens, positions = _batch(2, 5, 10)
    E, P = _tables(10, 16, 5, torch.float16, "learned")
    with pytest.raises(RuntimeError, match="tokens must be int64"):
        torch.ops.ls_fairseq.embedding_fwd(tokens.int(), positions, E, P, 1.0, PAD, 0.0, True, True)
    with pytest.raises(RuntimeError, match="positions are required"):
        torch.ops.ls_fairseq.embedding_fwd(tokens, None, E, P, 1.0, PAD, 0.0, True, True)
