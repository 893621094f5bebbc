"""Run by tests/test_attention_autograd.py in a fresh process: the autograd of the attention ops
(ls_fairseq/ops/_attention_cuda.py) on the CPU, against PyTorch's autograd of
``ops.attention.attention_reference``.

The CUDA kernels are not available here. The schemas of the csrc ops are read from
csrc/attention.cu and csrc/short_attention.cu (the ``m.def`` strings) and given CPU stand-in
kernels with the reference math (closed-form backward, so that they also run under opcheck's
dispatch modes). aten's ``_efficient_attention_forward``/``_backward`` (CUDA only) get CPU
stand-ins too: the same math on the kernel's [B, T, H, D] layout, their CPU seed/offset, the
log-sum-exp padded to 32 rows only when asked for, and ``shared_storage_dqdkdv`` as one
[B, T, 3, H, D] buffer. Dropout masks come from the seed the forward returns, so the backward
regenerates them. Then the binding's registration runs (``_extension.when_loaded``) and
``attention_cuda`` / ``attention_cuda_packed`` run every backend on the CPU.

Checked: forward values and every gradient (q, k, v or packed qkv; key padding with a fully
padded sequence, causal, Tq != Tk, odd lengths; subsets of the inputs requiring grad; dropout 0
against the reference, dropout 0.3 against the reference with the forward's mask), the extra
outputs non-differentiable, one forward and one backward kernel call per step with the arguments
the kernels took before (the backward's dropout_p, the log-sum-exp only where a gradient is
needed), d(qkv) written in place (the buffer the kernel wrote *is* the gradient), no forward
bookkeeping under no_grad, the fakes under FakeTensorMode (seed/offset on the CPU), and
``torch.library.opcheck`` of every op the binding defines or registers autograd on.

    python tests/attention_autograd_check.py
"""
import itertools
import logging
import os
import re

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
lib = torch.library.Library("ls_fairseq", "FRAGMENT")
for name in ("attention.cu", "short_attention.cu"):
    with open(os.path.join(CSRC, name)) as f:
        for m in re.finditer(r'm\.def\(((?:\s*"[^"]*")+)', f.read()):
            lib.define("".join(re.findall(r'"([^"]*)"', m.group(1))))

from ls_fairseq.ops import _extension  # noqa: E402
from ls_fairseq.ops.attention import _mask, attention_reference  # noqa: E402

CALLS = []  # (kernel, details) of every stand-in call
SEEDS = iter(range(11, 10**6))


def keep_mask(seed, shape, p):
    gen = torch.Generator().manual_seed(int(seed))
    return (torch.rand(shape, generator=gen) >= p).to(torch.float64)


def probs_of(q, k, hidden, scale):
    """The reference's probabilities (q [B, H, Tq, D]): masked scores, softmax in fp32 or wider,
    rows with every key hidden give zeros."""
    scores = torch.matmul(q * scale, k.transpose(-1, -2))
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, -1, dtype=torch.promote_types(scores.dtype, torch.float32))
    if hidden is not None:
        probs = probs.masked_fill(hidden.all(-1, keepdim=True), 0.0)
    return probs


def dropped(probs, seed, p):
    return probs if p == 0.0 else probs * keep_mask(seed, probs.shape, p) / (1 - p)


def forward_math(q, k, v, hidden, scale, seed, p):
    probs = probs_of(q, k, hidden, scale)
    return torch.matmul(dropped(probs, seed, p).to(q.dtype), v), probs


def backward_from_probs(g, q, k, v, probs, scale, seed, p):
    """Closed-form gradients of forward_math from its probabilities (no autograd inside a kernel;
    hidden keys have probability 0, so no mask is needed)."""
    pd = dropped(probs, seed, p).to(q.dtype)
    dv = torch.matmul(pd.transpose(-1, -2), g)
    dpd = torch.matmul(g, v.transpose(-1, -2)).to(probs.dtype)
    dp = dpd if p == 0.0 else dpd * keep_mask(seed, probs.shape, p) / (1 - p)
    ds = (probs * (dp - (dp * probs).sum(-1, keepdim=True))).to(q.dtype)
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q * scale), dv


def backward_math(g, q, k, v, hidden, scale, seed, p):
    return backward_from_probs(g, q, k, v, probs_of(q, k, hidden, scale), scale, seed, p)


def hidden_of(kpm, causal, tq, tk):
    return _mask(kpm, causal, tq, tk, "cpu")


# ---- csrc/attention.cu: attention_fwd -> (out, probs, rng), attention_bwd -> (dq, dk, dv)
def softmax_fwd(q, k, v, kpm, causal, p, training):
    drop = training and p > 0.0
    seed = next(SEEDS) if drop else 0
    CALLS.append(("attention_fwd", dict(p=p, training=training, seed=seed)))
    out, probs = forward_math(q, k, v, hidden_of(kpm, causal, q.size(2), k.size(2)),
                              q.size(-1) ** -0.5, seed, p if drop else 0.0)
    # the probabilities before dropout, in q's dtype: what the backward reads
    return out, probs.to(q.dtype), torch.tensor([seed, 0])


def softmax_bwd(g, q, k, v, probs, rng, p):
    CALLS.append(("attention_bwd", dict(p=p, seed=int(rng[0]))))
    return backward_from_probs(g, q, k, v, probs, q.size(-1) ** -0.5, int(rng[0]), p)


# ---- csrc/short_attention.cu: out [B, Tq, H, D] memory seen as [B, H, Tq, D], lse, rng;
# the backward writes into grad_q/grad_k/grad_v
def short_fwd(q, k, v, kpm, causal, p, training):
    drop = training and p > 0.0
    seed = next(SEEDS) if drop else 0
    CALLS.append(("short_attention_fwd", dict(p=p, training=training, seed=seed)))
    hidden = hidden_of(kpm, causal, q.size(2), k.size(2))
    res, _ = forward_math(q, k, v, hidden, q.size(-1) ** -0.5, seed, p if drop else 0.0)
    b, h, tq, d = q.shape
    out = q.new_empty((b, tq, h, d)).transpose(1, 2)
    out.copy_(res)
    lse = torch.zeros((b, h, tq), dtype=torch.float32)
    return out, lse, torch.tensor([seed, 0])


def short_bwd(g, q, k, v, out, lse, kpm, causal, rng, p, gq, gk, gv):
    CALLS.append(("short_attention_bwd", dict(p=p, causal=causal, seed=int(rng[0]),
                                              grads=(gq, gk, gv))))
    hidden = hidden_of(kpm, causal, q.size(2), k.size(2))
    for dst, src in zip((gq, gk, gv), backward_math(g, q, k, v, hidden, q.size(-1) ** -0.5,
                                                     int(rng[0]), p)):
        dst.copy_(src)


lib.impl("attention_fwd", softmax_fwd, "CPU")
lib.impl("attention_bwd", softmax_bwd, "CPU")
lib.impl("short_attention_fwd", short_fwd, "CPU")
lib.impl("short_attention_bwd", short_bwd, "CPU")


# ---- aten's memory-efficient kernel on [B, T, H, D]: bias additive (0 / -inf), custom_mask_type
# 2 = causal aligned bottom-right; seed/offset CPU tensors (outside CUDA graph capture)
def efficient_hidden(bias, mask_type, tq, tk):
    hidden = None if bias is None else torch.isinf(bias)
    if mask_type == 2:
        future = torch.ones(tq, tk, dtype=torch.bool).triu(tk - tq + 1)
        hidden = future if hidden is None else hidden | future
    return hidden


def efficient_fwd(q, k, v, bias, cu_q, cu_k, max_q, max_k, p, mask_type, compute_lse=False, *,
                  scale=None, seqlen_k=None, window_size=None):
    assert cu_q is None and cu_k is None and max_q is None and max_k is None
    assert scale == q.size(-1) ** -0.5
    seed = next(SEEDS) if p > 0.0 else 0
    CALLS.append(("efficient_fwd", dict(p=p, mask_type=mask_type, lse=compute_lse, seed=seed,
                                        q=q, k=k, v=v)))
    b, tq, h, _ = q.shape
    tk = k.size(1)
    res, probs = forward_math(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              efficient_hidden(bias, mask_type, tq, tk), scale, seed, p)
    out = res.transpose(1, 2).contiguous()  # [B, Tq, H, D]
    lse = torch.zeros((b, h, (tq + 31) // 32 * 32 if compute_lse else 0), dtype=torch.float32)
    return out, lse, torch.tensor(seed), torch.tensor(0), tq, tk


def efficient_bwd(g, q, k, v, bias, out, cu_q, cu_k, max_q, max_k, lse, p, seed, offset,
                  mask_type, bias_requires_grad, *, scale=None, num_splits_key=None,
                  window_size=None, shared_storage_dqdkdv=False):
    assert lse.size(-1) >= q.size(1), "backward without the forward's log-sum-exp"
    assert not bias_requires_grad and max_q == q.size(1) and max_k == k.size(1)
    assert scale == q.size(-1) ** -0.5
    hidden = efficient_hidden(bias, mask_type, q.size(1), k.size(1))
    grads = backward_math(g.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2),
                          v.transpose(1, 2), hidden, scale, int(seed), p)
    if shared_storage_dqdkdv:  # one [B, T, 3, H, D] buffer, as the CUDA kernel (and its meta)
        chunk = q.new_empty((*q.shape[:-2], 3, *q.shape[-2:]))
        out_grads = [chunk.select(-3, i) for i in range(3)]
    else:
        chunk, out_grads = None, [torch.empty_like(x) for x in (q, k, v)]
    for dst, src in zip(out_grads, grads):
        dst.copy_(src.transpose(1, 2))
    CALLS.append(("efficient_bwd", dict(p=p, mask_type=mask_type, seed=int(seed),
                                        shared=shared_storage_dqdkdv, chunk=chunk)))
    return (*out_grads, torch.empty(()))


aten_lib = torch.library.Library("aten", "IMPL")
aten_lib.impl("_efficient_attention_forward", efficient_fwd, "CPU")
aten_lib.impl("_efficient_attention_backward", efficient_bwd, "CPU")

# the schemas above stand for the extension: the binding registers its fakes, autograd and ops
from ls_fairseq.ops import _attention_cuda as ac  # noqa: E402

assert not torch._C._dispatch_has_kernel_for_dispatch_key("ls_fairseq::short_attention_fwd",
                                                          "Autograd")
_extension._loaded = True
_extension._run_pending()
for op in ("attention_fwd", "short_attention_fwd", "short_attention_packed_fwd",
           "efficient_attention_fwd", "efficient_attention_packed_fwd"):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ls_fairseq::{op}", "Autograd"), op
ac._register()  # a second call does nothing
ac._pick = lambda backend, q, k, v, causal: backend  # the CUDA-only support checks aside
_validate = ac._validate  # float64 here (the kernels' dtypes checked on float32 copies)
ac._validate = lambda q, k, v, kpm: _validate(q.float(), k.float(), v.float(), kpm)

ops = torch.ops.ls_fairseq
torch.manual_seed(0)
B, H, D = 3, 2, 8
DT = torch.float64


def close(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    assert torch.allclose(a, b, atol=1e-10, rtol=1e-10), (what, (a - b).abs().max().item())


def padding(tk, kind):
    if kind == "none":
        return None
    kpm = torch.zeros(B, tk, dtype=torch.bool)
    kpm[1, tk - 2:] = True  # right padding
    if kind == "empty":
        kpm[2] = True  # a sequence of padding only: its rows attend nowhere (zeros)
    return kpm


def problem(packed, tq, tk):
    if packed:
        qkv = torch.randn(B, tq, 3, H, D, dtype=DT)
        return [qkv], tuple(qkv.permute(2, 0, 3, 1, 4))
    xq = torch.randn(B, tq, H, D, dtype=DT)  # the projections' [B, T, H, D] memory
    xkv = torch.randn(B, tk, 2, H, D, dtype=DT)
    return [xq, xkv], (xq.transpose(1, 2), *xkv.permute(2, 0, 3, 1, 4))


def views(leaves):
    if len(leaves) == 1:
        return tuple(leaves[0].permute(2, 0, 3, 1, 4))
    return (leaves[0].transpose(1, 2), *leaves[1].permute(2, 0, 3, 1, 4))


def run_kernel_path(backend, packed, leaves, kpm, causal, p, training):
    q, k, v = views(leaves)
    if packed:
        return ac.attention_cuda_packed(leaves[0], kpm, causal, p, training, backend=backend)
    return ac.attention_cuda(q, k, v, kpm, causal, p, training, backend=backend)


BWD = {"softmax": "attention_bwd", "short": "short_attention_bwd", "efficient": "efficient_bwd"}
FWD = {"softmax": "attention_fwd", "short": "short_attention_fwd", "efficient": "efficient_fwd"}
SHAPES = [(False, 5, 7), (False, 6, 6), (False, 1, 9), (True, 7, 7), (True, 1, 1)]
checked = 0
for backend, (packed, tq, tk), pad, causal, p, training in itertools.product(
        ["softmax", "short", "efficient"], SHAPES, ["none", "right", "empty"], [False, True],
        [0.0, 0.3], [True, False]):
    if backend == "efficient" and causal and tq > tk:
        continue  # efficient_supported hands these rows to softmax
    kpm = padding(tk, pad)
    base, _ = problem(packed, tq, tk)
    g = torch.randn(B, H, tq, D, dtype=DT)
    for req in ([True] * len(base), [True, False][:len(base)], [False, True][:len(base)]):
        if packed and not req[0]:
            continue
        leaves = [x.clone().requires_grad_(r) for x, r in zip(base, req)]
        CALLS.clear()
        out = run_kernel_path(backend, packed, leaves, kpm, causal, p, training)
        fwd = [c for c in CALLS if c[0] == FWD[backend]]
        assert len(CALLS) == 1 and len(fwd) == 1, CALLS
        drop = training and p > 0.0
        seed = fwd[0][1]["seed"]
        if backend == "efficient":
            assert fwd[0][1]["lse"] is True and fwd[0][1]["p"] == (p if training else 0.0)
            memory = {x.untyped_storage().data_ptr() for x in leaves}
            for x in ("q", "k", "v"):  # read in place: [B, T, H, D] views of the leaves' memory
                assert fwd[0][1][x].untyped_storage().data_ptr() in memory, x
        hidden = hidden_of(kpm, causal, tq, tk)
        ref_leaves = [x.detach().clone().requires_grad_(r) for x, r in zip(base, req)]
        if drop:  # the reference with the forward's mask
            ref, _ = forward_math(*views(ref_leaves), hidden, D ** -0.5, seed, p)
        else:  # the specification itself
            ref = attention_reference(*views(ref_leaves), kpm, causal)[0]
        close(out, ref, ("out", backend, packed, tq, tk, pad, causal, p, training))
        assert out.requires_grad
        need = [x for x in leaves if x.requires_grad]
        got = torch.autograd.grad(out, need, g)
        want = torch.autograd.grad(ref, [x for x in ref_leaves if x.requires_grad], g)
        for a, b_ in zip(got, want):
            close(a, b_, ("grad", backend, packed, tq, tk, pad, causal, p, training, req))
        bwd = [c for c in CALLS if c[0] == BWD[backend]]
        assert len(CALLS) == 2 and len(bwd) == 1, CALLS
        assert bwd[0][1]["p"] == (p if drop else 0.0) and bwd[0][1]["seed"] == seed, (bwd, p)
        if backend == "short":
            assert bwd[0][1]["causal"] == causal
            gq, gk, gv = bwd[0][1]["grads"]  # [B, H, T, D] views of [B, T, H, D] / [B, T, 3, H, D]
            for x in (gq, gk, gv):
                assert x.stride(-1) == 1 and x.stride(2) == (3 if packed else 1) * H * D, x.stride()
            if packed:
                assert gk.data_ptr() == gq.data_ptr() + H * D * 8 == got[0].data_ptr() + H * D * 8
        if backend == "efficient":
            assert bwd[0][1]["shared"] is packed
            if packed:  # the kernel's [B, T, 3, H, D] buffer is d(qkv) itself: no stack
                assert got[0].data_ptr() == bwd[0][1]["chunk"].data_ptr()
                assert got[0].stride() == leaves[0].stride()
        checked += 1


# extra outputs: non-differentiable, and their gradients never materialised (zeros allocated
# and filled in every backward): no zero-fill runs in the backward
class Fills(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.zero_, torch.ops.aten.fill_,
                                   torch.ops.aten.zeros, torch.ops.aten.zeros_like):
            CALLS.append(("fill", func))
        return func(*args, **(kwargs or {}))


q, k, v = (torch.randn(B, H, 5, D, dtype=DT, requires_grad=True) for _ in range(3))
qkv = torch.randn(B, 5, 3, H, D, dtype=DT, requires_grad=True)
for outs in (ops.attention_fwd(q, k, v, None, False, 0.0, False),
             ops.short_attention_fwd(q, k, v, None, False, 0.0, False),
             ops.short_attention_packed_fwd(qkv, None, False, 0.0),
             ops.efficient_attention_fwd(q, k, v, None, 0, 0.0, True),
             ops.efficient_attention_packed_fwd(qkv, None, 0, 0.0, True)):
    assert outs[0].requires_grad and not any(x.requires_grad for x in outs[1:]), outs
    CALLS.clear()
    with Fills():
        outs[0].backward(torch.ones_like(outs[0]))
    assert not [c for c in CALLS if c[0] == "fill"], CALLS

# dropout_p with training=False: the csrc ops drop nothing, so their backward must not either
CALLS.clear()
out = ops.short_attention_fwd(q, k, v, None, False, 0.3, False)[0]
out.sum().backward()
assert CALLS[-1][0] == "short_attention_bwd" and CALLS[-1][1]["p"] == 0.0, CALLS
CALLS.clear()
out = ops.attention_fwd(q, k, v, None, False, 0.3, False)[0]
out.sum().backward()
assert CALLS[-1][0] == "attention_bwd" and CALLS[-1][1]["p"] == 0.0, CALLS

# no grad needed: no log-sum-exp for the efficient kernel, no graph, same values
for grad_mode, leaf_req in ((False, True), (True, False)):
    with torch.set_grad_enabled(grad_mode):
        x = [t.detach().requires_grad_(leaf_req) for t in (q, k, v)]
        CALLS.clear()
        out = ac.attention_cuda(*x, None, True, 0.0, False, backend="efficient")
        # as the autograd.Function's needs_input_grad: requires_grad, whatever the grad mode
        assert CALLS[0][1]["lse"] is leaf_req and not out.requires_grad
        close(out, attention_reference(*x, None, True)[0].detach(), "efficient no grad")

# the fakes: shapes, dtypes, devices (seed/offset on the CPU, as the kernel outside capture)
with FakeTensorMode():
    q = torch.empty(2, 3, 5, 16, dtype=torch.float16)
    k = torch.empty(2, 3, 9, 16, dtype=torch.float16)
    kpm = torch.empty(2, 9, dtype=torch.bool)
    qkv = torch.empty(2, 9, 3, 3, 16, dtype=torch.float16)
    out, lse, rng = ops.short_attention_packed_fwd(qkv, kpm, True, 0.1)
    assert (out.shape, out.stride(), lse.shape, lse.dtype, rng.shape) == (
        (2, 3, 9, 16), (432, 16, 48, 1), (2, 3, 9), torch.float32, (2,))
    for lse_wanted in (True, False):
        out, lse, seed, offset = ops.efficient_attention_fwd(q, k, k, None, 2, 0.0, lse_wanted)
        assert (out.shape, out.stride(), lse.shape, lse.dtype) == (
            (2, 3, 5, 16), (240, 16, 48, 1), (2, 3, 32 if lse_wanted else 0), torch.float32)
        assert seed.device.type == offset.device.type == "cpu" and seed.dtype == torch.long
        bias = torch.empty(2, 16)[:, None, None, :9].expand(2, 3, 9, 9).to(torch.float16)
        out, lse, seed, offset = ops.efficient_attention_packed_fwd(qkv, bias, 0, 0.1,
                                                                   lse_wanted)
        assert (out.shape, out.stride(), lse.shape) == (
            (2, 3, 9, 16), (432, 16, 48, 1), (2, 3, 32 if lse_wanted else 0))
        assert seed.device.type == "cpu" and seed.shape == ()

# opcheck of every op the binding defines or registers autograd on (dropout 0: deterministic)
q = torch.randn(2, 3, 5, 8, dtype=DT, requires_grad=True)
k = torch.randn(2, 3, 9, 8, dtype=DT, requires_grad=True)
v = torch.randn(2, 3, 9, 8, dtype=DT, requires_grad=True)
kpm = torch.zeros(2, 9, dtype=torch.bool)
kpm[1, 6:] = True
qkv = torch.randn(2, 7, 3, 3, 8, dtype=DT, requires_grad=True)
bias = torch.zeros(2, 16, dtype=DT).masked_fill_(torch.arange(16) >= 5, float("-inf"))
bias = bias[:, None, None, :7].expand(2, 3, 7, 7)
cases = [
    (ops.attention_fwd.default, (q, k, v, kpm, True, 0.0, False)),
    (ops.short_attention_fwd.default, (q, k, v, kpm, True, 0.0, False)),
    (ops.short_attention_packed_fwd.default, (qkv, kpm[:, :7], True, 0.0)),
    (ops.efficient_attention_fwd.default, (q, k, v, None, 2, 0.0, True)),
    (ops.efficient_attention_packed_fwd.default, (qkv, bias, 2, 0.0, True)),
]


def aten_efficient_backward_traces():
    """Whether aten's own fake of _efficient_attention_backward runs (torch 2.13's meta kernel
    lacks the schema's ``out`` argument: every call under FakeTensorMode raises TypeError)."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)  # FakeTensorMode logs the error it re-raises
    try:
        with FakeTensorMode():
            x, lse = torch.empty(1, 2, 1, 8), torch.empty(1, 1, 32)
            s = torch.empty((), dtype=torch.long)
            torch.ops.aten._efficient_attention_backward(x, x, x, x, None, x, None, None, 2, 2, lse,
                                                         0.0, s, s, 0, False, scale=1.0)
    except TypeError:
        return False
    finally:
        log.setLevel(level)
    return True


ALL = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
skipped = []
for op, args in cases:
    utils = ALL
    if "efficient" in op.name() and not aten_efficient_backward_traces():
        utils = ALL[:3]  # tracing their backward needs aten's fake of the backward
        skipped.append(op.name())
    result = torch.library.opcheck(op, args, test_utils=utils)
    assert all(r == "SUCCESS" for r in result.values()), (op, result)
note = f"; test_aot_dispatch_dynamic skipped for {', '.join(skipped)} (aten's meta of " \
    "_efficient_attention_backward is broken in this torch)" if skipped else ""
print(f"all attention autograd checks passed ({checked} cases, {len(cases)} ops opchecked{note})")
