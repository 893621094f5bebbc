"""GPU tests of the CUDA attention (ls_fairseq/ops/_attention_cuda.py, csrc/attention.cu,
csrc/short_attention.cu).

All three backends (``short``: our single-tile kernel for rows of <= 128, the default there, which hands
longer rows, fp32 and odd head sizes to the next backend; ``efficient``: PyTorch's memory-efficient fused
kernel; ``softmax``: cuBLAS GEMMs around the fused softmax kernel of csrc/attention.cu; the short
kernel's exact dropout mask is tested in test_short_attention_cuda.py) are checked against
``ops.attention_reference`` and against fairseq's ``MultiheadAttention`` with the same weights,
forward and backward, fp16/bf16/fp32, rows of 1..1500 keys.

Tolerance (one rule everywhere): the truth is the same computation in float64; the CUDA result
must be within ``2 * e_ref + eps * max(max|truth|, 1)`` of it, where ``e_ref`` is the error of the
PyTorch reference (or of fairseq) run in the same low precision, and ``eps`` is one unit of the
dtype's rounding (fp32 1e-5, fp16 2e-3, bf16 1.6e-2) to absorb a different summation order; the
floor of 1 is the natural scale of these unit-variance inputs (a gradient that is exactly zero in
the truth, e.g. dq with a single key, comes out as rounding noise of that scale). A kernel that
drops a mask, mis-scales, or mixes up rows is off by O(max|truth|) and fails.
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from kernel_oracle import attention_with_keep, opcheck_attention_inputs, within_reference
from ls_fairseq.ops import _extension
from ls_fairseq.ops.attention import _mask, attention, attention_reference

pytestmark = pytest.mark.gpu

BACKENDS = ["short", "efficient", "softmax"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
EPS = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}
# every row-length bucket of the softmax kernel (<=32, 64, 128, 256, 512, 1024, longer) on both
# sides of its edge, plus fairseq's default --max-positions 1024 and beyond
LENGTHS = [1, 2, 17, 32, 33, 64, 65, 100, 128, 129, 256, 300, 512, 513, 1000, 1024, 1025, 1500]
DEV = "cuda"


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert _extension.load(), f"CUDA extension failed to build: {_extension.failure_reason()}"
    assert _extension.has_op("attention_fwd") and _extension.has_op("attention_bwd")


def _cuda_attn(*args, backend, **kw):
    from ls_fairseq.ops._attention_cuda import attention_cuda

    return attention_cuda(*args, backend=backend, **kw)


def _check(name, got, truth, base, dtype):
    """|got - truth| <= 2 |base - truth| + eps * max|truth| (see module docstring)."""
    within_reference(name, got, truth, base, EPS[dtype])


def _padding(b, t, left, min_len=1, gen=None):
    """[b, t] bool key padding mask with random lengths in [min_len, t]; row 0 unpadded."""
    lens = torch.randint(min_len, t + 1, (b,), generator=gen)
    lens[0] = t
    pos = torch.arange(t)
    mask = pos[None, :] < (t - lens)[:, None] if left else pos[None, :] >= lens[:, None]
    return mask.to(DEV)


def _problem(case, t, dtype, b=2, h=3, d=64, seed=0):
    """Leaves (packed like the projection outputs of the ls_ modules) and the q/k/v views."""
    g = torch.Generator().manual_seed(seed)
    if case == "cross":
        tq, tk = max(1, (3 * t) // 4 + 1), t
        xq = torch.randn(b, tq, h, d, generator=g)
        xkv = torch.randn(b, tk, 2, h, d, generator=g)
        leaves = [xq.to(DEV, dtype).requires_grad_(), xkv.to(DEV, dtype).requires_grad_()]
        kpm = _padding(b, tk, left=True, gen=g)
        causal = False
    else:
        tq = tk = t
        leaves = [torch.randn(b, t, 3, h, d, generator=g).to(DEV, dtype).requires_grad_()]
        causal = case == "dec"
        # encoder: source left-padded; decoder: target right-padded (fairseq's defaults)
        kpm = _padding(b, t, left=not causal, gen=g)
    grad = torch.randn(b, h, tq, d, generator=g).to(DEV, dtype)
    return leaves, kpm, causal, grad


def _qkv(leaves):
    if len(leaves) == 1:
        q, k, v = leaves[0].permute(2, 0, 3, 1, 4)
    else:
        q = leaves[0].transpose(1, 2)
        k, v = leaves[1].permute(2, 0, 3, 1, 4)
    return q, k, v


def _run(fn, leaves, grad):
    for x in leaves:
        x.grad = None
    out = fn(*_qkv(leaves))
    out.backward(grad)
    return [out.detach()] + [x.grad.detach().clone() for x in leaves]


def _as(leaves, dtype):
    return [x.detach().to(dtype).requires_grad_() for x in leaves]


@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("case", ["enc", "dec", "cross"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, dtype, case, t):
    leaves, kpm, causal, grad = _problem(case, t, dtype, seed=t)
    got = _run(lambda q, k, v: _cuda_attn(q, k, v, kpm, causal, backend=backend), leaves, grad)
    ref = lambda q, k, v: attention_reference(q, k, v, kpm, causal)[0]  # noqa: E731
    base = _run(ref, leaves, grad)
    truth = _run(ref, _as(leaves, torch.float64), grad.double())
    for name, a, b_, c in zip(["out", "grad0", "grad1"], got, truth, base):
        _check(f"{backend} {case} T={t} {name}", a, b_, c, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows(backend, dtype):
    """All keys of one sequence padded, and causal + left padding (query rows that see only
    padding): zeros there, finite gradients, the rest as the reference."""
    b, h, t, d = 3, 2, 40, 64
    g = torch.Generator().manual_seed(1)
    leaves = [torch.randn(b, t, 3, h, d, generator=g).to(DEV, dtype).requires_grad_()]
    grad = torch.randn(b, h, t, d, generator=g).to(DEV, dtype)
    kpm = torch.zeros(b, t, dtype=torch.bool, device=DEV)
    kpm[1] = True  # a sequence of padding only
    kpm[2, :13] = True  # left padding: with causal, query rows 0..12 see no real key
    for causal in (False, True):
        fn = lambda q, k, v: _cuda_attn(q, k, v, kpm, causal, backend=backend)  # noqa: E731
        got = _run(fn, leaves, grad)
        out = got[0]
        assert torch.isfinite(out).all() and all(torch.isfinite(x).all() for x in got[1:])
        assert (out[1] == 0).all(), "all-padding sequence must attend nowhere (zeros)"
        if causal:
            assert (out[2, :, :13] == 0).all(), "rows that see only padding must be zeros"
        ref = lambda q, k, v: attention_reference(q, k, v, kpm, causal)[0]  # noqa: E731
        base = _run(ref, leaves, grad)
        truth = _run(ref, _as(leaves, torch.float64), grad.double())
        for name, a, b_, c in zip(["out", "grad"], got, truth, base):
            _check(f"{backend} masked causal={causal} {name}", a, b_, c, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_and_odd_shapes(backend):
    """No keys, no queries, odd head sizes (the efficient backend hands these to softmax)."""
    for (b, h, tq, tk, d, dv) in [(2, 2, 5, 0, 64, 64), (2, 2, 0, 7, 64, 64), (3, 5, 9, 11, 20, 20),
                                  (2, 3, 33, 1030, 12, 7), (1, 1, 1, 1, 1, 1)]:
        q = torch.randn(b, h, tq, d, device=DEV, requires_grad=True)
        k = torch.randn(b, h, tk, d, device=DEV, requires_grad=True)
        v = torch.randn(b, h, tk, dv, device=DEV, requires_grad=True)
        kpm = torch.rand(b, tk, device=DEV) < 0.3
        for causal in (False, True):
            out = _cuda_attn(q, k, v, kpm, causal, backend=backend)
            ref = attention_reference(q, k, v, kpm, causal)[0]
            assert out.shape == ref.shape
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
            if out.numel():
                gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
                rq, rk, rv = torch.autograd.grad(ref.sum(), (q, k, v), allow_unused=True)
                for a, r in ((gq, rq), (gk, rk), (gv, rv)):
                    if r is not None and a is not None:
                        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# against fairseq's MultiheadAttention with the same weights


def _fairseq_mha(e, h, cross, dtype):
    from fairseq.modules.multihead_attention import MultiheadAttention

    torch.manual_seed(0)
    m = MultiheadAttention(e, h, dropout=0.0, self_attention=not cross, encoder_decoder_attention=cross)
    return m.to(DEV, dtype)


def _ls_mha(m, query, key, kpm, causal, backend):
    """What the ls_ attention modules do (B x T x C inside, one packed projection), with fairseq's
    parameters: [T, B, C] in and out like fairseq."""
    h = m.num_heads
    d = m.head_dim
    xq = query.transpose(0, 1)
    b, tq, e = xq.shape
    if key is None:  # self-attention: one GEMM for q, k, v
        w = torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight])
        bias = torch.cat([m.q_proj.bias, m.k_proj.bias, m.v_proj.bias])
        q, k, v = F.linear(xq, w, bias).view(b, tq, 3, h, d).permute(2, 0, 3, 1, 4)
    else:
        xk = key.transpose(0, 1)
        q = F.linear(xq, m.q_proj.weight, m.q_proj.bias).view(b, tq, h, d).transpose(1, 2)
        w = torch.cat([m.k_proj.weight, m.v_proj.weight])
        bias = torch.cat([m.k_proj.bias, m.v_proj.bias])
        k, v = F.linear(xk, w, bias).view(b, xk.size(1), 2, h, d).permute(2, 0, 3, 1, 4)
    o = _cuda_attn(q, k, v, kpm, causal, backend=backend)
    o = o.transpose(1, 2).reshape(b, tq, e)
    return F.linear(o, m.out_proj.weight, m.out_proj.bias).transpose(0, 1)


def _fairseq_call(m, query, key, kpm, causal):
    if key is None:
        mask = None
        if causal:
            t = query.size(0)
            mask = torch.triu(torch.full((t, t), float("-inf"), device=DEV), 1).to(query.dtype)
        return m(query=query, key=query, value=query, key_padding_mask=kpm, need_weights=False,
                 attn_mask=mask)[0]
    return m(query=query, key=key, value=key, key_padding_mask=kpm, need_weights=False,
             static_kv=True)[0]


def _mha_grads(m, fn, inputs, grad):
    m.zero_grad(set_to_none=True)
    for x in inputs:
        x.grad = None
    out = fn()
    out.backward(grad)
    params = [m.q_proj.weight, m.k_proj.weight, m.v_proj.weight, m.out_proj.weight, m.q_proj.bias]
    return [out.detach()] + [x.grad.clone() for x in inputs] + [p.grad.clone() for p in params]


@pytest.mark.parametrize("t", [1, 7, 33, 128, 257, 1024, 1100])
@pytest.mark.parametrize("case", ["enc", "dec", "cross"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_fairseq_mha(backend, dtype, case, t):
    e, h, b = 128, 2, 3
    cross = case == "cross"
    causal = case == "dec"
    g = torch.Generator().manual_seed(t)
    m = _fairseq_mha(e, h, cross, dtype)
    m64 = copy.deepcopy(m).double()  # the truth uses the very same (rounded) weights
    tq = max(1, (3 * t) // 4 + 1) if cross else t
    query = torch.randn(tq, b, e, generator=g).to(DEV)
    key = torch.randn(t, b, e, generator=g).to(DEV) if cross else None
    kpm = _padding(b, t, left=not causal, gen=g)
    grad = torch.randn(tq, b, e, generator=g).to(DEV)

    def run(mod, fn, dt):
        qx = query.to(dt, copy=True).requires_grad_()
        kx = key.to(dt, copy=True).requires_grad_() if cross else None
        inputs = [qx] + ([kx] if cross else [])
        return _mha_grads(mod, lambda: fn(mod, qx, kx), inputs, grad.to(dt))

    got = run(m, lambda mod, qx, kx: _ls_mha(mod, qx, kx, kpm, causal, backend), dtype)
    base = run(m, lambda mod, qx, kx: _fairseq_call(mod, qx, kx, kpm, causal), dtype)
    truth = run(m64, lambda mod, qx, kx: _fairseq_call(mod, qx, kx, kpm, causal), torch.float64)
    names = ["out", "d_query"] + (["d_key"] if cross else []) + ["dWq", "dWk", "dWv", "dWo", "dbq"]
    for name, a, b_, c in zip(names, got, truth, base):
        _check(f"{backend} vs fairseq {case} T={t} {name}", a, b_, c, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_incremental_decoding_matches_fairseq(backend, dtype):
    """Step-by-step decoding (Tq = 1 against the cached keys) vs fairseq's incremental_state path,
    and vs our own full causal pass; causal=True and causal=False agree at Tq = 1."""
    e, h, b, steps = 128, 4, 3, 12
    d = e // h
    m = _fairseq_mha(e, h, False, dtype)
    m64 = copy.deepcopy(m).double()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(steps, b, e, generator=g).to(DEV)
    w = torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight])
    bias = torch.cat([m.q_proj.bias, m.k_proj.bias, m.v_proj.bias])
    state, state64, keys, values, outs = {}, {}, [], [], []
    with torch.no_grad():
        for s in range(steps):
            xt = x[s:s + 1].to(dtype)
            ref = m(query=xt, key=xt, value=xt, incremental_state=state, need_weights=False)[0]
            x64 = x[s:s + 1].double()
            truth = m64(query=x64, key=x64, value=x64, incremental_state=state64, need_weights=False)[0]
            q, k, v = F.linear(xt.transpose(0, 1), w, bias).view(b, 1, 3, h, d).permute(2, 0, 3, 1, 4)
            keys.append(k)
            values.append(v)
            kc, vc = torch.cat(keys, 2), torch.cat(values, 2)
            o1 = _cuda_attn(q, kc, vc, None, True, backend=backend)
            o0 = _cuda_attn(q, kc, vc, None, False, backend=backend)
            torch.testing.assert_close(o1, o0, atol=0, rtol=0)
            out = F.linear(o1.transpose(1, 2).reshape(b, 1, e), m.out_proj.weight, m.out_proj.bias)
            out = out.transpose(0, 1)
            outs.append(out)
            _check(f"{backend} incremental step {s}", out, truth, ref, dtype)
        full = _ls_mha(m, x.to(dtype), None, None, True, backend)
        torch.testing.assert_close(torch.cat(outs), full, atol=EPS[dtype] * 4, rtol=EPS[dtype] * 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_incremental_cross_attention_with_padding(backend, dtype):
    """One query per sequence against padded encoder keys (cross attention during generation)."""
    b, h, tk, d = 5, 4, 37, 64
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, h, 1, d, generator=g).to(DEV, dtype)
    k = torch.randn(b, h, tk, d, generator=g).to(DEV, dtype)
    v = torch.randn(b, h, tk, d, generator=g).to(DEV, dtype)
    kpm = _padding(b, tk, left=True, gen=g)
    got = _cuda_attn(q, k, v, kpm, False, backend=backend)
    base = attention_reference(q, k, v, kpm)[0]
    truth = attention_reference(q.double(), k.double(), v.double(), kpm)[0]
    _check(f"{backend} Tq=1 cross", got, truth, base, dtype)


# ---------------------------------------------------------------------------------------------
# dropout


def _masked_reference(q, k, v, kpm, causal, keep, p):
    """The reference with a given dropout keep-mask (so CUDA's own mask can be checked exactly)."""
    return attention_with_keep(q, k, v, _mask(kpm, causal, q.size(-2), k.size(-2), DEV), keep, p)


@pytest.mark.parametrize(
    "backend,tq,tk",
    [("short", 64, 64), ("short", 33, 64), ("efficient", 64, 64), ("softmax", 64, 64), ("softmax", 37, 37),
     ("softmax", 5, 1100)],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_mask_consistent(backend, tq, tk, dtype, causal):
    """With v = identity the output *is* the dropped probability matrix, which exposes the dropout
    mask; forward and backward must then equal the reference run with that same mask (so backward
    regenerates exactly the forward's mask), and the kept fraction must be 1 - p."""
    p = 0.3
    b, h, d = 2, 4, 64
    g = torch.Generator().manual_seed(tk)
    q = torch.randn(b, h, tq, d, generator=g).to(DEV, dtype).requires_grad_()
    k = torch.randn(b, h, tk, d, generator=g).to(DEV, dtype).requires_grad_()
    v = torch.eye(tk).expand(b, h, tk, tk).to(DEV, dtype).contiguous().requires_grad_()
    kpm = _padding(b, tk, left=False, min_len=max(1, tk // 2), gen=g)
    grad = torch.randn(b, h, tq, tk, generator=g).to(DEV, dtype)
    from ls_fairseq.ops import _attention_cuda as ac

    if backend == "short" and dtype == torch.float32:
        pytest.skip("the short kernel takes fp16/bf16 only; fp32 runs the efficient rows above")
    assert ac._pick(backend, q, k, v, causal) == backend
    torch.manual_seed(123)
    out = _cuda_attn(q, k, v, kpm, causal, dropout_p=p, training=True, backend=backend)
    got = [out.detach()] + list(torch.autograd.grad(out, (q, k, v), grad))
    keep = out.detach() != 0
    allowed = ~kpm[:, None, None, :].expand(b, h, tq, tk)
    if causal:
        allowed = allowed & torch.ones(tq, tk, dtype=torch.bool, device=DEV).tril(tk - tq)
    assert not (keep & ~allowed).any(), "dropout output leaked into masked keys"
    frac = keep[allowed].float().mean().item()
    n = allowed.sum().item()
    assert abs(frac - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n) + 1e-3, f"kept fraction {frac:.4f}"
    ref_fn = lambda q_, k_, v_: _masked_reference(q_, k_, v_, kpm, causal, keep, p)  # noqa: E731
    base_out = ref_fn(q, k, v)
    base = [base_out.detach()] + list(torch.autograd.grad(base_out, (q, k, v), grad))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    t_out = ref_fn(q64, k64, v64)
    truth = [t_out.detach()] + list(torch.autograd.grad(t_out, (q64, k64, v64), grad.double()))
    for name, a, b_, c in zip(["out", "dq", "dk", "dv"], got, truth, base):
        _check(f"{backend} dropout {name}", a, b_, c, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_reproducible_from_seed(backend):
    b, h, t, d = 4, 4, 77, 64
    leaves, kpm, causal, grad = _problem("dec", t, torch.float16, b=b, h=h, d=d, seed=3)

    def run(seed):
        torch.manual_seed(seed)
        fn = lambda q, k, v: _cuda_attn(q, k, v, kpm, causal, dropout_p=0.1, training=True,  # noqa: E731
                                        backend=backend)
        return _run(fn, leaves, grad)

    a, b_, c = run(1), run(1), run(2)
    assert torch.equal(a[0], b_[0]), "same seed must give the same forward"
    # the efficient kernel may accumulate dq with atomics: same mask, last-bit differences only
    torch.testing.assert_close(a[1], b_[1], atol=2e-3, rtol=2e-3)
    assert not torch.equal(a[0], c[0]), "another seed must give another dropout mask"
    # eval mode and p = 0 are deterministic and identical to no dropout
    q, k, v = _qkv(leaves)
    no = _cuda_attn(q, k, v, kpm, causal, backend=backend)
    torch.testing.assert_close(_cuda_attn(q, k, v, kpm, causal, dropout_p=0.1, training=False,
                                          backend=backend), no, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# op plumbing


def test_dispatch_uses_cuda_and_env(monkeypatch):
    leaves, kpm, causal, grad = _problem("enc", 50, torch.float16)
    q, k, v = _qkv(leaves)
    out, w = attention(q, k, v, kpm, causal)
    assert w is None
    ref = attention_reference(q, k, v, kpm, causal)[0]
    torch.testing.assert_close(out, ref, atol=4e-3, rtol=4e-3)
    from ls_fairseq.ops import _attention_cuda as ac

    assert ac._pick(None, q, k, v, causal) == "short"  # auto, rows of 50
    monkeypatch.setenv(ac.ENV_VAR, "short")
    assert ac._pick(None, q, k, v, causal) == "short"
    monkeypatch.setenv(ac.ENV_VAR, "softmax")
    assert ac._pick(None, q, k, v, causal) == "softmax"
    monkeypatch.setenv(ac.ENV_VAR, "efficient")
    assert ac._pick(None, q, k, v, causal) == "efficient"
    monkeypatch.setenv(ac.ENV_VAR, "bogus")
    with pytest.raises(ValueError):
        ac._pick(None, q, k, v, causal)


INPUT_CHECKS = r"""
import torch, ls_fairseq.ops._extension as e
assert e.load()
q = torch.randn(2, 2, 5, 8, device="cuda")
k = torch.randn(2, 2, 6, 8, device="cuda")
bad = [
    ("key_padding_mask", (q, k, k, torch.zeros(2, 5, dtype=torch.bool, device="cuda"), False, 0.0, False)),
    ("head dims", (q, k[..., :4], k, None, False, 0.0, False)),
    ("dtype", (q.double(), k.double(), k.double(), None, False, 0.0, False)),
]
for what, args in bad:
    try:
        torch.ops.ls_fairseq.attention_fwd(*args)
    except RuntimeError as err:
        assert what in str(err), str(err)
    else:
        raise AssertionError("no error for bad " + what)
print("checks ok")
"""


def test_input_checks():
    """Bad inputs raise RuntimeError with a clear message (in a subprocess, so that a crash in the
    error path shows up as this test's failure instead of killing the session)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", INPUT_CHECKS], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "checks ok" in r.stdout, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])


def test_python_input_checks():
    from ls_fairseq.ops._attention_cuda import attention_cuda, attention_cuda_packed

    q = torch.randn(2, 2, 5, 8, device=DEV)
    k = torch.randn(2, 2, 6, 8, device=DEV)
    with pytest.raises(ValueError, match="key_padding_mask"):
        attention_cuda(q, k, k, torch.zeros(2, 5, dtype=torch.bool, device=DEV))
    with pytest.raises(ValueError, match="shapes"):
        attention_cuda(q, k[..., :4], k)
    with pytest.raises(TypeError, match="dtype"):
        attention_cuda(q.double(), k.double(), k.double())
    with pytest.raises(ValueError, match="qkv"):
        attention_cuda_packed(q)


def test_packed_self_attention_matches_views():
    """attention_cuda_packed (gradient written straight into d(qkv)) == attention_cuda on views."""
    from ls_fairseq.ops._attention_cuda import attention_cuda_packed

    for dtype in DTYPES:
        for causal in (False, True):
            leaves, kpm, _, grad = _problem("enc", 45, dtype, b=3, h=4, seed=11)
            ref = _run(lambda q, k, v: _cuda_attn(q, k, v, kpm, causal, backend="efficient"), leaves, grad)
            leaves[0].grad = None
            out = attention_cuda_packed(leaves[0], kpm, causal, backend="efficient")
            out.backward(grad)
            torch.testing.assert_close(out, ref[0], atol=0, rtol=0)
            # same kernel; only the order of atomic accumulations in dq may differ
            torch.testing.assert_close(leaves[0].grad, ref[1], atol=EPS[dtype], rtol=EPS[dtype])


OPCHECK_ALL = ("test_schema", "test_autograd_registration", "test_faketensor",
               "test_aot_dispatch_dynamic")


def _aten_efficient_backward_traces():
    """Whether aten's own fake of _efficient_attention_backward runs (torch 2.13's meta kernel
    lacks the schema's ``out`` argument: every call under FakeTensorMode raises TypeError); tracing
    the efficient ops' backward (test_aot_dispatch_dynamic) needs it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode():
            x = torch.empty(1, 2, 1, 8, device=DEV, dtype=torch.float16)
            lse = torch.empty(1, 1, 32, device=DEV)
            s = torch.empty((), dtype=torch.long)
            torch.ops.aten._efficient_attention_backward(x, x, x, x, None, x, None, None, 2, 2, lse,
                                                         0.0, s, s, 0, False, scale=1.0)
    except TypeError:
        return False
    return True


def test_opcheck():
    """Every op of the softmax and efficient backends, with its autograd (dropout 0: the
    outputs are compared)."""
    from ls_fairseq.ops import _attention_cuda as ac

    ac._register()
    ops = torch.ops.ls_fairseq
    h = dict(device=DEV, dtype=torch.float16)
    q, k, v, kpm = opcheck_attention_inputs(DEV)
    torch.library.opcheck(ops.attention_fwd.default, (q, k, v, kpm, True, 0.0, False))
    with torch.no_grad():
        out, probs, rng = ops.attention_fwd(q, k, v, kpm, True, 0.0, False)
        torch.library.opcheck(ops.attention_bwd.default,
                              (out, q.detach(), k.detach(), v.detach(), probs, rng, 0.0),
                              test_utils=("test_schema", "test_faketensor"))
    utils = OPCHECK_ALL if _aten_efficient_backward_traces() else OPCHECK_ALL[:3]
    # 16 keys: opcheck clones the zero-stride bias view into a dense [B, H, Tq, Tk] tensor,
    # whose strides the kernel wants in multiples of 8 (the binding's views always are)
    k, v = (torch.randn(2, 3, 16, 16, **h).requires_grad_() for _ in range(2))
    kpm = torch.rand(2, 16, device=DEV) < 0.3
    bias = ac._padding_bias(kpm, 3, 5, torch.float16)
    torch.library.opcheck(ops.efficient_attention_fwd.default,
                          (q, k, v, bias, ac._CAUSAL_BOTTOM_RIGHT, 0.0, True),
                          test_utils=utils)
    qkv = torch.randn(2, 16, 3, 3, 16, **h).requires_grad_()
    for bias, mask_type in ((None, ac._NO_MASK),
                            (ac._padding_bias(kpm, 3, 16, torch.float16), ac._CAUSAL_BOTTOM_RIGHT)):
        torch.library.opcheck(ops.efficient_attention_packed_fwd.default,
                              (qkv, bias, mask_type, 0.0, True), test_utils=utils)
