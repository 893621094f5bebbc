"""Run by tests/test_cross_entropy_autograd.py in a fresh process: the autograd of the fused
label-smoothed cross-entropy (``ls_fairseq::ls_cross_entropy_rows``, ops/_cross_entropy_cuda.py)
on the CPU, against PyTorch's own autograd of the reference.

The CUDA kernels are not available here, so the schemas of ``ls_cross_entropy_fwd`` / ``_bwd`` /
``_bwd_`` are read from csrc/cross_entropy.cu (the ``m.def`` strings) and given CPU stand-in
kernels: the forward is ``label_smoothed_cross_entropy_rows_reference`` (ops/cross_entropy.py)
plus the row logsumexp and the kernel's argmax (-1 on ignored rows); the backward is the kernel's
closed form ``grad_loss (p - eps_i - (1 - eps - eps_i) [j == t]) + grad_nll (p - [j == t])``,
rounded once to the logits dtype. They check the arguments as the kernels' ``TORCH_CHECK`` do.
Then the binding's registration runs (``_extension.when_loaded``, as after a successful load).

What is checked: forward values; gradients of loss, nll or both, with per-row and scalar upstream
gradients, padding rows and ``ignore_index=None``, odd vocabularies, fp32/fp16/bf16, 3-D and
non-contiguous logits; that the in-place backward runs exactly when the flag is set and the
(prepared) logits are not a leaf, leaves the gradient in the logits' storage and bumps their
version (a node that saved them fails loudly), and that an unused output reaches the kernel as
None; ``torch.library.opcheck`` of the op. The chunked output projection + CE
(ops/fused_output_cross_entropy.py) runs its kernel branch over the same stand-ins and must
match its PyTorch branch.

    python tests/cross_entropy_autograd_check.py
"""
import itertools
import os
import re

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")

lib = torch.library.Library("ls_fairseq", "FRAGMENT")
with open(os.path.join(CSRC, "cross_entropy.cu")) as f:
    for m in re.finditer(r'm\.def\(((?:\s*"[^"]*")+)', f.read()):
        lib.define("".join(re.findall(r'"([^"]*)"', m.group(1))))

from ls_fairseq.ops.cross_entropy import (  # noqa: E402  (after the schemas)
    label_smoothed_cross_entropy_reference,
    label_smoothed_cross_entropy_rows_reference,
)

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CALLS = []  # ("fwd",) / ("bwd" | "bwd_", grad_loss is None, grad_nll is None)


def _check_args(logits, target):  # csrc check_common
    assert logits.dim() == 2 and logits.is_contiguous() and logits.dtype in KERNEL_DTYPES
    assert target.dtype == torch.long and target.dim() == 1 and target.is_contiguous()
    assert target.size(0) == logits.size(0) and logits.size(1) >= 2


def ce_fwd(logits, target, epsilon, ignore_index, compute_argmax):
    _check_args(logits, target)
    CALLS.append(("fwd",))
    loss, nll, _ = label_smoothed_cross_entropy_rows_reference(logits, target, epsilon,
                                                               ignore_index)
    lse = torch.logsumexp(logits.float(), -1)
    argmax = (logits.argmax(-1).masked_fill(target.eq(ignore_index), -1) if compute_argmax
              else target.new_empty(0))
    return loss, nll, lse, argmax


def _grad_of(grad_loss, grad_nll, logits, target, lse, epsilon, ignore_index):
    _check_args(logits, target)
    for g in (grad_loss, grad_nll):
        assert g is None or (g.dtype == torch.float32 and g.numel() in (1, logits.size(0)))
    V = logits.size(1)
    eps_i = epsilon / (V - 1)
    pad = target.eq(ignore_index)
    p = torch.exp(logits.float() - lse[:, None])
    onehot = torch.zeros_like(p).scatter_(1, target.masked_fill(pad, 0)[:, None], 1.0)
    g = torch.zeros_like(p)
    if grad_loss is not None:
        g += grad_loss.reshape(-1, 1) * (p - eps_i - (1.0 - epsilon - eps_i) * onehot)
    if grad_nll is not None:
        g += grad_nll.reshape(-1, 1) * (p - onehot)
    return g.masked_fill_(pad[:, None], 0.0).to(logits.dtype)


def ce_bwd(grad_loss, grad_nll, logits, target, lse, epsilon, ignore_index):
    CALLS.append(("bwd", grad_loss is None, grad_nll is None))
    return _grad_of(grad_loss, grad_nll, logits, target, lse, epsilon, ignore_index)


def ce_bwd_(grad_loss, grad_nll, logits, target, lse, epsilon, ignore_index):
    CALLS.append(("bwd_", grad_loss is None, grad_nll is None))
    grad = _grad_of(grad_loss, grad_nll, logits, target, lse, epsilon, ignore_index)
    with torch.autograd._unsafe_preserve_version_counter(logits):  # as the kernel: no bump
        logits.copy_(grad)


for name, fn in (("ls_cross_entropy_fwd", ce_fwd), ("ls_cross_entropy_bwd", ce_bwd),
                 ("ls_cross_entropy_bwd_", ce_bwd_)):
    lib.impl(name, fn, "CPU")

from ls_fairseq.ops import _extension  # noqa: E402
from ls_fairseq.ops import _cross_entropy_cuda as cuda  # noqa: E402  (registration deferred)
from ls_fairseq.ops import fused_output_cross_entropy as fused  # noqa: E402

assert not _extension.has_op("ls_cross_entropy_fwd")
_extension._loaded = True  # the schemas above stand for the extension
_extension._run_pending()
assert not _extension._pending
assert torch._C._dispatch_has_kernel_for_dispatch_key("ls_fairseq::ls_cross_entropy_rows",
                                                      "Autograd")

PAD = 1
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=2e-4),
       torch.bfloat16: dict(rtol=1.6e-2, atol=2e-3)}


def inputs(n, v, dtype, ignore, seed, pad_frac=0.3):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    if ignore is not None:
        target[torch.rand(n, generator=g) < pad_frac] = ignore
    return logits, target


def _weighted_sum(loss, nll, gl, gn, used):
    """sum(gl * loss) + sum(gn * nll) over the outputs in ``used``."""
    total = 0
    if "loss" in used:
        total = total + (loss * gl).sum()
    if "nll" in used:
        total = total + (nll * gn).sum()
    return total


def reference(logits, target, eps, ignore, used, gl, gn):
    """Forward rows and gradient of sum(gl * loss) + sum(gn * nll) by PyTorch's autograd."""
    x = logits.detach().clone().requires_grad_()
    ii = cuda._NO_IGNORE if ignore is None else ignore
    loss, nll, _ = label_smoothed_cross_entropy_rows_reference(x, target, eps, ii)
    _weighted_sum(loss, nll, gl, gn, used).backward()
    return loss.detach(), nll.detach(), x.grad


def run(logits, target, eps, ignore, *, leaf, inplace, used, per_row, compute_argmax):
    """The op through the binding's entry and a backward of sum(gl * loss) + sum(gn * nll) over
    the outputs in ``used``: the outputs, the gradient, the kernel calls, the logits passed in
    and their version before the backward, the upstream gradients."""
    n = logits.size(0)
    gl = torch.rand(n) + 0.5 if per_row else torch.tensor(2.5)
    gn = torch.rand(n) - 0.5 if per_row else torch.tensor(0.7)
    a = logits.detach().clone().requires_grad_()
    x = a if leaf else a * 1.0  # a non-leaf: gradient reaches `a` unchanged
    CALLS.clear()
    loss, nll, argmax = cuda.label_smoothed_cross_entropy_rows_cuda(
        x, target, eps, ignore, compute_argmax=compute_argmax, inplace_backward=inplace)
    assert loss.requires_grad and nll.requires_grad and not argmax.requires_grad
    version = x._version
    _weighted_sum(loss, nll, gl, gn, used).backward()
    return dict(loss=loss.detach(), nll=nll.detach(), argmax=argmax, grad=a.grad,
                calls=list(CALLS), x=x, version=version, gl=gl, gn=gn)


# ---- values, gradients and the in-place decision ----------------------------------------------
cases = 0
for dtype, (n, v), ignore, leaf, inplace, used in itertools.product(
        KERNEL_DTYPES, [(7, 2), (13, 5), (9, 37), (33, 101)], [PAD, None], [True, False],
        [False, True], [("loss",), ("nll",), ("loss", "nll")]):
    # the rest varies across the cases (every combination of these three every 8 cases)
    eps, per_row, compute_argmax = (0.1, 0.0)[cases % 2], cases % 4 < 2, cases % 8 < 4
    logits, target = inputs(n, v, dtype, ignore, seed=n * 1000 + v)
    r = run(logits, target, eps, ignore, leaf=leaf, inplace=inplace, used=used, per_row=per_row,
            compute_argmax=compute_argmax)
    ref_loss, ref_nll, ref_grad = reference(logits, target, eps, ignore, used, r["gl"], r["gn"])
    what = (dtype, n, v, ignore, eps, leaf, inplace, used, per_row, compute_argmax)
    assert torch.equal(r["loss"], ref_loss) and torch.equal(r["nll"], ref_nll), what
    pad = target.eq(PAD) if ignore is not None else torch.zeros(n, dtype=torch.bool)
    assert (r["loss"][pad] == 0).all() and (r["nll"][pad] == 0).all(), what
    if compute_argmax:
        assert torch.equal(r["argmax"][~pad], logits.argmax(-1)[~pad]), what
        assert (r["argmax"][pad] == -1).all(), what
    else:
        assert r["argmax"].numel() == 0, what
    assert r["grad"].dtype == dtype, what
    torch.testing.assert_close(r["grad"], ref_grad, **TOL[dtype], msg=lambda m: f"{what}: {m}")
    assert (r["grad"][pad] == 0).all(), what
    in_place = inplace and not leaf  # the rule: the flag, and never over a leaf
    kind = "bwd_" if in_place else "bwd"
    assert r["calls"] == [("fwd",), (kind, "loss" not in used, "nll" not in used)], (what, r["calls"])
    if in_place:  # the gradient is left in the logits' storage, their version bumped
        assert torch.equal(r["x"].detach(), r["grad"]) and r["x"]._version > r["version"], what
    else:
        assert torch.equal(r["x"].detach(), logits), what  # the logits untouched
    cases += 1

# ---- the decision is taken on the logits the op sees (after reshape / contiguous) ------------
logits, target = inputs(12, 11, torch.float32, PAD, seed=5)
a = logits.clone().requires_grad_()  # a 2-D contiguous leaf: out of place, data untouched
CALLS.clear()
cuda.label_smoothed_cross_entropy_rows_cuda(a, target, 0.1, PAD, inplace_backward=True)[0].sum().backward()
assert CALLS[-1][0] == "bwd" and torch.equal(a.detach(), logits)
ref = reference(logits, target, 0.1, PAD, ("loss",), torch.tensor(1.0), None)[2]
torch.testing.assert_close(a.grad, ref)
# a non-contiguous leaf: the op sees a contiguous copy (not a leaf): in place over the copy only
base = logits.t().contiguous().requires_grad_()
CALLS.clear()
cuda.label_smoothed_cross_entropy_rows_cuda(base.t(), target, 0.1, PAD,
                                            inplace_backward=True)[0].sum().backward()
assert CALLS[-1][0] == "bwd_" and torch.equal(base.detach(), logits.t())
torch.testing.assert_close(base.grad.t(), ref)
# 3-D non-leaf logits and targets of another integer dtype: reshaped, cast, in place
x3 = (logits.clone().requires_grad_() * 1.0).view(3, 4, 11)
CALLS.clear()
loss, nll, _ = cuda.label_smoothed_cross_entropy_rows_cuda(x3, target.view(3, 4).int(), 0.1, PAD,
                                                           inplace_backward=True)
assert loss.shape == (12,)
loss.sum().backward()
assert CALLS[-1][0] == "bwd_"
# logits that do not require grad: no graph, no backward
CALLS.clear()
loss, nll, _ = cuda.label_smoothed_cross_entropy_rows_cuda(logits, target, 0.1, PAD,
                                                           inplace_backward=True)
assert not loss.requires_grad and CALLS == [("fwd",)]
# the sums (label_smoothed_cross_entropy_cuda) against the reference's
x = logits.clone().requires_grad_()
got = cuda.label_smoothed_cross_entropy_cuda(x, target, 0.1, PAD)
want = label_smoothed_cross_entropy_reference(logits, target, 0.1, PAD)
torch.testing.assert_close(got, want)
got[0].backward()
torch.testing.assert_close(x.grad, ref)
# no rows
empty = torch.empty(0, 7, requires_grad=True)
loss, nll, _ = cuda.label_smoothed_cross_entropy_rows_cuda(empty, torch.empty(0, dtype=torch.long),
                                                           0.1, PAD)
loss.sum().backward()
assert empty.grad.shape == (0, 7)

# ---- the in-place backward fails loudly when another node saved the logits ------------------
w = torch.ones((), requires_grad=True)
x = logits * w
other = (x * x).sum()  # saves x; created before the CE node, so it runs after it
loss = cuda.label_smoothed_cross_entropy_rows_cuda(x, target, 0.1, PAD, inplace_backward=True)[0]
try:
    (loss.sum() + other).backward()
    raise AssertionError("the in-place backward did not invalidate the saved logits")
except RuntimeError as exc:
    assert "modified by an inplace operation" in str(exc), exc
# a second backward through the in-place node is refused as well (its saved logits changed)
x = logits.clone().requires_grad_() * 1.0
loss = cuda.label_smoothed_cross_entropy_rows_cuda(x, target, 0.1, PAD, inplace_backward=True)[0]
loss.sum().backward(retain_graph=True)
try:
    loss.sum().backward()
    raise AssertionError("a second in-place backward read gradients as logits")
except RuntimeError as exc:
    assert "modified by an inplace operation" in str(exc), exc

# ---- opcheck (schema, autograd registration, fake, AOT autograd) ----------------------------
op = torch.ops.ls_fairseq.ls_cross_entropy_rows.default
for dtype, compute_argmax, inplace, ignore in itertools.product(
        (torch.float32, torch.float16), (True, False), (False, True), (PAD, cuda._NO_IGNORE)):
    logits, target = inputs(11, 37, dtype, PAD, seed=8)
    torch.library.opcheck(op, (logits.requires_grad_(), target, 0.1, ignore, compute_argmax,
                               inplace))
    torch.library.opcheck(op, (logits.detach(), target, 0.1, ignore, compute_argmax, inplace))

# ---- the fused output projection + CE: its kernel branch over the same stand-ins -------------
pytorch_branch = fused._use_kernels
for dtype, (n, d, v, chunk), eps, ignore in itertools.product(
        KERNEL_DTYPES, [(37, 16, 53, 8), (64, 24, 101, None), (5, 8, 2, 3)], [0.0, 0.1],
        [PAD, None]):
    g = torch.Generator().manual_seed(n + v)
    hidden = (torch.randn(n, d, generator=g) * 2).to(dtype)
    weight = (torch.randn(v, d, generator=g) / d**0.5).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    if ignore is not None:
        target[::3] = ignore
    results = []
    for kernels in (False, True):
        fused._use_kernels = (lambda logits: True) if kernels else pytorch_branch
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        CALLS.clear()
        loss, nll, n_correct = fused.fused_output_cross_entropy(
            h, w, target, eps, ignore, chunk_size=chunk, compute_accuracy=True)
        (loss * 3.0).backward()
        assert bool(CALLS) == kernels
        results.append((loss.detach(), nll, n_correct, h.grad, w.grad))
    fused._use_kernels = pytorch_branch
    what = (dtype, n, d, v, chunk, eps, ignore)
    (l0, n0, c0, gh0, gw0), (l1, n1, c1, gh1, gw1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
    torch.testing.assert_close(n1, n0, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
    assert abs(int(c1) - int(c0)) <= 1, what  # argmax of the same logits; a rounding tie at most
    for got, want in ((gh1, gh0), (gw1, gw0)):  # sums of rounded logit gradients: relative norm
        err = (got.double() - want.double()).norm().item()
        rel = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        assert err <= rel * want.double().norm().item() + 1e-6, (what, err)

print(f"all cross-entropy autograd checks passed ({cases} cases)")
