"""GPU tests of the short attention kernel (csrc/short_attention.cu, backend "short" of
ls_fairseq/ops/_attention_cuda.py), with its dropout mask rebuilt independently.

The kernel draws its dropout mask from Philox at (row = (b * H + h) * Tq + i, column j), the
scheme of the elementwise kernels, so ``kernel_oracle.philox_keep`` rebuilds the exact mask and
the tests compare forward *and* backward with dropout against a float64 truth computed with that
mask: a mask that differs between forward and backward, a wrong row/column mapping, a wrong
scale, a dropped causal/padding mask or a wrong gradient term all fail.

Tolerance (as tests/gpu/test_attention_cuda.py): ``|got - truth| <= 2 |base - truth| + eps *
max(max|truth|, 1)``, where ``base`` is the same math run in the low precision by PyTorch (scores
and probabilities rounded to the storage dtype as fairseq does) and eps one unit of the dtype's
rounding (fp16 2e-3, bf16 1.6e-2).

Also covered here: every length 1..128 in steps that cross each 16-row tile edge, head sizes 16,
32, 64 and 128, cross attention (Tq != Tk, causal with Tq > Tk), fully padded sequences, p = 1,
packed (d(qkv) in place) == views, bitwise determinism, the routing rules and input errors.
The whole-model check with this backend is in test_model_cuda.py.
"""
import math
import subprocess
import sys

import pytest
import torch

from kernel_oracle import (attention_with_keep, opcheck_attention_inputs, philox_keep,
                           within_reference)
from ls_fairseq.ops import _extension
from ls_fairseq.ops.attention import _mask

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = [torch.float16, torch.bfloat16]
EPS = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert _extension.load(), f"CUDA extension failed to build: {_extension.failure_reason()}"
    assert _extension.has_op("short_attention_fwd"), "short attention op not registered"
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the short kernel needs sm_80+")


def _leaves(b, h, tq, tk, d, dtype, gen, packed):
    if packed:
        return [torch.randn(b, tq, 3, h, d, generator=gen).to(DEV, dtype).requires_grad_()]
    return [torch.randn(b, tq, h, d, generator=gen).to(DEV, dtype).requires_grad_(),
            torch.randn(b, tk, 2, h, d, generator=gen).to(DEV, dtype).requires_grad_()]


def _views(leaves):
    if len(leaves) == 1:
        return tuple(leaves[0].permute(2, 0, 3, 1, 4))
    return (leaves[0].transpose(1, 2), *leaves[1].permute(2, 0, 3, 1, 4))


def _grads(out, leaves, grad):
    return [out.detach()] + list(torch.autograd.grad(out, leaves, grad))


def _run_case(b, h, tq, tk, d, dtype, causal, p, seed, packed=None, pad="random"):
    from ls_fairseq.ops import _attention_cuda as ac

    gen = torch.Generator().manual_seed(seed)
    packed = (tq == tk) if packed is None else packed
    leaves = _leaves(b, h, tq, tk, d, dtype, gen, packed)
    kpm = None
    if pad != "none":
        lens = torch.randint(1, tk + 1, (b,), generator=gen)
        lens[0] = tk
        if pad == "empty" and b > 1:
            lens[1] = 0  # a sequence of padding only: its rows see no key
        kpm = (torch.arange(tk)[None, :] >= lens[:, None]).to(DEV)
    grad = torch.randn(b, h, tq, d, generator=gen).to(DEV, dtype)
    q, k, v = _views(leaves)
    assert ac._pick("short", q, k, v, causal) == "short"
    torch.manual_seed(seed)
    if packed:
        out = ac.attention_cuda_packed(leaves[0], kpm, causal, p, p > 0, backend="short")
    else:
        out = ac.attention_cuda(q, k, v, kpm, causal, p, p > 0, backend="short")
    got = _grads(out, leaves, grad)

    keep = None
    if p > 0:
        # the forward's (seed, offset): rerun the op itself with the same generator state
        torch.manual_seed(seed)
        _, _, rng = torch.ops.ls_fairseq.short_attention_fwd(q, k, v, kpm, causal, p, True)
        keep = philox_keep(rng, b * h * tq, tk, p).view(b, h, tq, tk)
    hidden = _mask(kpm, causal, tq, tk, DEV)
    base_out = attention_with_keep(q, k, v, hidden, keep, p)
    base = _grads(base_out, leaves, grad)
    l64 = [x.detach().double().requires_grad_() for x in leaves]
    t_out = attention_with_keep(*_views(l64), hidden, keep, p)
    truth = _grads(t_out, l64, grad.double())
    names = ["out"] + [f"grad{i}" for i in range(len(leaves))]
    for name, a, t, c in zip(names, got, truth, base):
        within_reference(f"B={b} H={h} Tq={tq} Tk={tk} D={d} causal={causal} p={p} {name}", a, t, c,
                         EPS[dtype])
    return got, keep, kpm


LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 80, 100, 127, 128]


@pytest.mark.parametrize("t", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["enc", "dec", "cross"])
def test_matches_float64_with_dropout(case, dtype, t):
    causal = case == "dec"
    tq = t if case != "cross" else max(1, (2 * t) // 3)
    _run_case(3, 4, tq, t, 64, dtype, causal, 0.1, seed=1000 + t)


@pytest.mark.parametrize("d", [16, 32, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_sizes(dtype, d):
    from ls_fairseq.ops import _attention_cuda as ac

    for (tq, tk) in [(7, 7), (50, 50), (128, 128), (33, 90), (97, 20)]:
        _run_case(2, 3, tq, tk, d, dtype, tq == tk, 0.2, seed=tq * 7 + d)
    q = torch.randn(2, 3, 128, 128, device=DEV, dtype=dtype)  # the largest problem fits (177 KB)
    assert ac._pick("short", q, q, q, False) == "short"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_dropout_probabilities_and_no_padding(dtype, p):
    _run_case(4, 2, 37, 37, 64, dtype, False, p, seed=7, pad="none")
    got, keep, _ = _run_case(4, 2, 24, 61, 64, dtype, False, p, seed=8, pad="random")
    if p == 1.0:
        assert all((g == 0).all() for g in got[:1] + got[2:]), "p = 1 must drop everything"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_that_see_no_key(dtype):
    """A fully padded sequence, and causal cross attention with Tq > Tk (the first queries see no
    key): zeros there, finite gradients, the rest as the truth."""
    got, _, _ = _run_case(3, 2, 40, 40, 64, dtype, True, 0.1, seed=3, pad="empty")
    assert (got[0][1] == 0).all()
    _run_case(2, 2, 50, 20, 64, dtype, True, 0.1, seed=4, packed=False)


def test_kept_fraction_and_seed():
    from ls_fairseq.ops import _attention_cuda as ac

    q = torch.randn(8, 16, 64, 64, device=DEV, dtype=torch.float16)
    torch.manual_seed(5)
    out1, _, rng1 = torch.ops.ls_fairseq.short_attention_fwd(q, q, q, None, False, 0.25, True)
    torch.manual_seed(5)
    out2, _, rng2 = torch.ops.ls_fairseq.short_attention_fwd(q, q, q, None, False, 0.25, True)
    out3, _, rng3 = torch.ops.ls_fairseq.short_attention_fwd(q, q, q, None, False, 0.25, True)
    assert torch.equal(out1, out2) and torch.equal(rng1, rng2)
    assert not torch.equal(rng1, rng3) and not torch.equal(out1, out3)
    keep = philox_keep(rng1, 8 * 16 * 64, 64, 0.25)
    frac = keep.float().mean().item()
    assert abs(frac - 0.75) < 5 * math.sqrt(0.25 * 0.75 / keep.numel()), frac
    # eval / p = 0: deterministic and equal to no dropout
    a = ac.attention_cuda(q, q, q, None, False, 0.25, False, backend="short")
    b = ac.attention_cuda(q, q, q, None, False, 0.0, True, backend="short")
    assert torch.equal(a, b)


def test_packed_equals_views_and_deterministic():
    from ls_fairseq.ops import _attention_cuda as ac

    for dtype in DTYPES:
        for causal in (False, True):
            gen = torch.Generator().manual_seed(11)
            qkv = torch.randn(5, 45, 3, 4, 64, generator=gen).to(DEV, dtype).requires_grad_()
            kpm = (torch.arange(45)[None, :] >= torch.tensor([45, 30, 1, 44, 20])[:, None]).to(DEV)
            grad = torch.randn(5, 4, 45, 64, generator=gen).to(DEV, dtype)
            results = []
            for packed in (True, True, False):
                torch.manual_seed(2)
                if packed:
                    out = ac.attention_cuda_packed(qkv, kpm, causal, 0.1, True, backend="short")
                    results.append(_grads(out, [qkv], grad))
                else:
                    q, k, v = qkv.permute(2, 0, 3, 1, 4)
                    out = ac.attention_cuda(q, k, v, kpm, causal, 0.1, True, backend="short")
                    results.append(_grads(out, [qkv], grad))
            for other in results[1:]:
                for a, b in zip(results[0], other):
                    assert torch.equal(a, b), "short attention must be bitwise deterministic"


def test_routing():
    """auto and short take the short kernel where it applies; what it cannot serve falls to
    efficient, then softmax; a request for efficient never takes short."""
    from ls_fairseq.ops import _attention_cuda as ac

    def qkv(t, d=64, dtype=torch.float16, tk=None):
        q = torch.randn(2, 4, t, d, device=DEV, dtype=dtype)
        k = torch.randn(2, 4, tk or t, d, device=DEV, dtype=dtype)
        return q, k, k

    assert ac._pick("auto", *qkv(100), False) == "short"
    assert ac._pick("auto", *qkv(128), True) == "short"
    assert ac._pick("auto", *qkv(7, tk=128), False) == "short"  # cross attention
    assert ac._pick("auto", *qkv(129), False) == "efficient"
    assert ac._pick("efficient", *qkv(100), False) == "efficient"
    assert ac._pick("softmax", *qkv(100), False) == "softmax"
    assert ac._pick("short", *qkv(100), False) == "short"
    assert ac._pick("short", *qkv(129), False) == "efficient"  # longer rows
    assert ac._pick("short", *qkv(50, d=72), False) == "efficient"  # head size not a multiple of 16
    assert ac._pick("short", *qkv(50, d=48), False) == "efficient"  # not one of 16, 32, 64, 128
    assert ac._pick("short", *qkv(50, dtype=torch.float32), False) == "efficient"
    assert ac._pick("short", *qkv(50, d=20), False) == "softmax"  # neither fused kernel applies
    q, k, v = qkv(50)
    assert ac._pick("short", q[..., 1:17], k[..., 1:17], v[..., 1:17], False) != "short"  # unaligned


INPUT_CHECKS = r"""
import torch, ls_fairseq.ops._extension as e
assert e.load()
op = torch.ops.ls_fairseq.short_attention_fwd
h = dict(device="cuda", dtype=torch.float16)
q = torch.randn(2, 2, 5, 64, **h)
bad = [
    ("lengths", (torch.randn(1, 1, 129, 64, **h), torch.randn(1, 1, 129, 64, **h), torch.randn(1, 1, 129, 64, **h))),
    ("head dim", (torch.randn(2, 2, 5, 72, **h),) * 3),
    ("dtype", (q.float(), q.float(), q.float())),
    ("strides", (q, torch.randn(2, 2, 5, 65, **h)[..., 1:], q)),
    ("key_padding_mask", (q, q, q, torch.zeros(2, 4, dtype=torch.bool, device="cuda"))),
]
for what, args in bad:
    args = tuple(args) + (None,) * (4 - len(args)) + (False, 0.0, False)
    try:
        op(*args)
    except RuntimeError as err:
        assert what in str(err), (what, str(err))
    else:
        raise AssertionError("no error for bad " + what)
print("checks ok")
"""


def test_input_checks():
    """Bad inputs raise a RuntimeError naming the limit (in a subprocess, so a crash in the error
    path fails this test instead of killing the session)."""
    r = subprocess.run([sys.executable, "-c", INPUT_CHECKS], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "checks ok" in r.stdout, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])


def test_opcheck():
    """short_attention_fwd with its autograd, short_attention_bwd, and the packed op (dropout
    0: the outputs are compared)."""
    from ls_fairseq.ops import _attention_cuda as ac

    ac._register()
    ops = torch.ops.ls_fairseq
    h = dict(device=DEV, dtype=torch.float16)
    q, k, v, kpm = opcheck_attention_inputs(DEV)
    torch.library.opcheck(ops.short_attention_fwd.default, (q, k, v, kpm, True, 0.0, False))
    with torch.no_grad():
        q, k, v = q.detach(), k.detach(), v.detach()
        out, lse, rng = ops.short_attention_fwd(q, k, v, kpm, True, 0.0, False)
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        torch.library.opcheck(ops.short_attention_bwd.default,
                              (out, q, k, v, out, lse, kpm, True, rng, 0.0, *grads),
                              test_utils=("test_schema", "test_faketensor"))
    qkv = torch.randn(2, 9, 3, 3, 16, **h).requires_grad_()
    for mask, causal in ((kpm, True), (None, False)):
        torch.library.opcheck(ops.short_attention_packed_fwd.default, (qkv, mask, causal, 0.0))
