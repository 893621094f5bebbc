"""Shared oracles of the kernel GPU tests: the Philox4x32-10 dropout mask the kernels draw
(rebuilt independently in PyTorch, checked against Random123's known answers in
tests/test_philox_oracle.py), attention with a given keep mask, and the closeness checks against
float64 truths."""
import math

import torch

M32 = 0xFFFFFFFF


def _mulhilo(a, m):
    """(hi, lo) 32-bit halves of a * m for int64 tensors a < 2^32 and a constant m < 2^32,
    without int64 overflow."""
    mh, ml = m >> 16, m & 0xFFFF
    t1, t0 = a * mh, a * ml
    s = t0 + ((t1 & 0xFFFF) << 16)
    return (t1 >> 16) + (s >> 32), s & M32


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    for _ in range(10):
        hi0, lo0 = _mulhilo(c0, 0xD2511F53)
        hi1, lo1 = _mulhilo(c2, 0xCD9E8D57)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


def philox_keep(rng, rows, C, p, device="cuda"):
    """Keep mask [rows, C] the kernels draw for (seed, offset) = rng."""
    seed, offset = [int(v) & (2**64 - 1) for v in rng.tolist()]
    groups = (C + 3) // 4
    g = torch.arange(rows * groups, device=device, dtype=torch.int64)
    ctr = offset // 4
    words = philox4x32_10(
        torch.full_like(g, ctr & M32), torch.full_like(g, (ctr >> 32) & M32), g & M32,
        (g >> 32) & M32, seed & M32, (seed >> 32) & M32,
    )
    words = torch.stack(words, 1).reshape(rows, groups * 4)[:, :C]
    threshold = min(math.floor(p * 2**32), 2**32 - 1)
    return words >= threshold


def close(ours, truth, tol, what):
    """Element-wise |ours - truth| <= tol * (1 + |truth|), all finite."""
    ours = ours.double()
    assert torch.isfinite(ours).all(), f"{what}: non-finite values"
    bad = (ours - truth).abs() > tol * (1 + truth.abs())
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements off, max err "
        f"{(ours - truth).abs().max().item():.3g}"
    )


def norm_close(ours, truth, tol, what, terms=None):
    """||ours - truth|| <= tol * scale. For a column sum, ``terms`` are the summed rows of the
    upstream gradient: 0.01 times their absolute sum is added to the scale, since a float32 term can
    only be as exact as its factors (erf-GELU's derivative in its tails carries an absolute error of
    ~1e-7 |g|, large relative to the tiny derivative there)."""
    assert ours.shape == truth.shape, what
    err = (ours.double() - truth).norm().item()
    scale = truth.norm().item() + 1e-6 * truth.numel() ** 0.5
    if terms is not None:
        scale += 0.01 * terms.abs().sum(0).norm().item()
    assert err <= tol * scale, f"{what}: relative error {err / scale:.3g}"


def attention_with_keep(q, k, v, hidden, keep, p):
    """Attention with an explicit dropout keep mask, in q's dtype: fp32 softmax statistics,
    probabilities rounded to the dtype before P.V (as fairseq). ``hidden`` [B, 1|H, Tq, Tk] bool
    (True: key hidden from query) or None; ``keep`` like the probabilities, or None (no dropout)."""
    scores = torch.matmul(q * (q.size(-1) ** -0.5), k.transpose(-1, -2))
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores.to(torch.promote_types(q.dtype, torch.float32)), -1)
    if hidden is not None:
        probs = probs.masked_fill(hidden.all(-1, keepdim=True), 0.0)
    probs = probs.to(q.dtype)
    if keep is not None:
        # p = 1: zeros that stay in the autograd graph (callers differentiate through them)
        probs = probs * keep.to(q.dtype) / (1 - p) if p < 1 else probs * 0
    return torch.matmul(probs, v)


def within_reference(name, got, truth, base, eps):
    """|got - truth| <= 2 |base - truth| + eps * max(max|truth|, 1), all finite: ``base`` is the
    same math in the low precision, ``eps`` one unit of the dtype's rounding."""
    got, truth, base = got.double(), truth.double(), base.double()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    if got.numel() == 0:
        return
    err = (got - truth).abs().max().item()
    err_base = (base - truth).abs().max().item()
    scale = truth.abs().max().item()
    tol = 2 * err_base + eps * max(scale, 1.0)
    assert err <= tol, f"{name}: max err {err:.3g} > tol {tol:.3g} (reference err {err_base:.3g}, max {scale:.3g})"


def opcheck_attention_inputs(device="cuda"):
    """(q, k, v, key_padding_mask) of the attention ops' opcheck tests: fp16 [2, 3, 5, 16]
    queries over 9 keys (an odd length), q/k/v requiring grad, each key padded with probability
    0.3."""
    h = dict(device=device, dtype=torch.float16)
    q = torch.randn(2, 3, 5, 16, **h).requires_grad_()
    k = torch.randn(2, 3, 9, 16, **h).requires_grad_()
    v = torch.randn(2, 3, 9, 16, **h).requires_grad_()
    return q, k, v, torch.rand(2, 9, device=device) < 0.3
