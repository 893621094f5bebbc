"""Run by tests/test_autograd_cpp.py in a fresh process: the C++ autograd of the fused elementwise ops
(csrc/*_autograd.cpp) on the CPU, against PyTorch's own autograd of the same math.

The CUDA kernels are not available here, so the ops' schemas are read from csrc/ (the
``m.def`` strings) and given CPU stand-in kernels (the reference math; dropout masks drawn from a
seed that the forward returns as its "rng", so backward regenerates them). The autograd .cpp files
are compiled as a CPU extension and registered over those ops. What is checked: every gradient
(with and without weight/bias, inputs that do or do not require grad, dropout on/off, train/eval,
relu/gelu, invertible LayerNorm), the non-differentiable outputs, and the weight_grad/bias_grad
flags the backward asks the kernels for (no gradient computed that autograd does not need).
For layer_norm_residual (CompositeImplicitAutograd): its outputs (the second a view of x), the
gradients of either output or both, the kernel calls and their arguments against a Python
autograd.Function making the same calls, x's two gradients summed inside layer_norm_bwd (no add
in autograd), no-grad and inference mode, the binding's entry, FakeTensorMode (through the
binding's fakes of layer_norm_fwd/_bwd) and torch.library.opcheck.

    python tests/autograd_cpp_check.py <build dir>
"""
import itertools
import os
import re
import sys

import torch
import torch.nn.functional as F
from torch.utils import cpp_extension
from torch.utils._python_dispatch import TorchDispatchMode

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
lib = torch.library.Library("ls_fairseq", "FRAGMENT")
for name in ("layer_norm.cu", "bias_dropout_residual_layer_norm.cu", "dropout_fusions.cu"):
    with open(os.path.join(CSRC, name)) as f:
        for m in re.finditer(r'm\.def\(((?:\s*"[^"]*")+)', f.read()):
            lib.define("".join(re.findall(r'"([^"]*)"', m.group(1))))
CALLS = []
ARGS = []  # (name, arguments) of every LayerNorm kernel call, to compare two call patterns exactly
def ln_fwd(x, w, b, eps, inv=False):
    CALLS.append("ln_fwd"); ARGS.append(("ln_fwd", (x, w, b, eps, inv)))
    mean = x.mean(-1); rstd = (x.var(-1, unbiased=False) + eps).rsqrt()
    return F.layer_norm(x, (x.size(-1),), w, b, eps), mean.reshape(-1).float(), rstd.reshape(-1).float()  # float32 as the kernel
def ln_bwd(g, saved, w, b, mean, rstd, inv, wg, bg, rg=None):
    CALLS.append(("ln_bwd", inv, wg, bg)); ARGS.append(("ln_bwd", (g, saved, w, b, mean, rstd, inv, wg, bg, rg)))
    if inv:
        xhat = (saved - (b if b is not None else 0)) / (w if w is not None else 1)
        x = xhat  # LayerNorm(xhat) == xhat up to eps; test uses inv only for the call pattern
    else: x = saved
    # closed form (no autograd inside a kernel, so that it also runs under dispatch modes)
    c = x.size(-1); rs = (x.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt()
    xhat = (x - x.mean(-1, keepdim=True)) * rs; d = g * w if w is not None else g
    dx = rs * (d - d.mean(-1, keepdim=True) - xhat * (d * xhat).mean(-1, keepdim=True))
    dw = (g * xhat).reshape(-1, c).sum(0); db = g.reshape(-1, c).sum(0)
    if rg is not None: dx = dx + rg
    e = g.new_empty(0)
    return dx, (dw if wg else e), (db if bg else e)
def mask(seed, shape, p):
    gen = torch.Generator().manual_seed(int(seed)); return (torch.rand(shape, generator=gen) >= p).float() / (1 - p)
SEED = itertools.count(7)
def bdr_fwd(x, b, r, p, train):
    CALLS.append("bdr_fwd"); s = next(SEED); y = x + (b if b is not None else 0)
    if train and p > 0: y = y * mask(s, y.shape, p)
    return r + y, torch.tensor([s, 0])
def bdr_bwd(g, rng, p, train, bg):
    CALLS.append(("bdr_bwd", bg)); gx = g * mask(rng[0], g.shape, p)
    return gx, (gx.reshape(-1, g.size(-1)).sum(0) if bg else g.new_empty(0))
def bad_fwd(x, b, act, p, train):
    CALLS.append("bad_fwd"); s = next(SEED); y = x + (b if b is not None else 0)
    y = F.relu(y) if act == "relu" else F.gelu(y)
    if train and p > 0: y = y * mask(s, y.shape, p)
    return y, torch.tensor([s, 0])
def bad_bwd(g, x, b, rng, act, p, train, bg):
    CALLS.append(("bad_bwd", act, bg)); xx = (x + (b if b is not None else 0)).detach().requires_grad_()
    with torch.enable_grad(): y = F.gelu(xx)
    m = mask(rng[0], g.shape, p) if (train and p > 0) else 1
    with torch.enable_grad(): (gx,) = torch.autograd.grad(y, xx, g * m)
    return gx, (gx.reshape(-1, g.size(-1)).sum(0) if bg else g.new_empty(0))
def relu_bwd(g, out, p, train, bg):
    CALLS.append(("relu_bwd", bg)); gx = g * (out > 0) * ((1 / (1 - p)) if (train and p > 0) else 1)
    return gx, (gx.reshape(-1, g.size(-1)).sum(0) if bg else g.new_empty(0))
def bdr_ln_fwd(y, b, r, w, lb, p, train, eps):
    x, rng = bdr_fwd(y, b, r, p, train); h, mean, rstd = ln_fwd(x, w, lb, eps)
    return x, h, mean, rstd, rng
lib.impl("bias_dropout_residual_layer_norm_fwd", bdr_ln_fwd, "CPU")
def bdr_ln_bwd(g, x, w, lb, mean, rstd, gx, rng, p, train, wg, lbg, bg):
    dx, dw, dlb = ln_bwd(g, x, w, lb, mean, rstd, False, wg, lbg, gx); CALLS.pop()
    gy, gb = bdr_bwd(dx, rng, p, train, bg); CALLS.pop()
    CALLS.append(("bdr_ln_bwd", wg, lbg, bg)); return dx, gy, dw, dlb, gb
lib.impl("bias_dropout_residual_layer_norm_bwd", bdr_ln_bwd, "CPU")
for name, fn in [("layer_norm_fwd", ln_fwd), ("layer_norm_bwd", ln_bwd), ("bias_dropout_residual_fwd", bdr_fwd), ("bias_dropout_residual_bwd", bdr_bwd), ("bias_act_dropout_fwd", bad_fwd), ("bias_act_dropout_bwd", bad_bwd), ("relu_dropout_bwd", relu_bwd)]:
    lib.impl(name, fn, "CPU")
AUTOGRAD_SOURCES = ("layer_norm_autograd.cpp", "bias_dropout_residual_layer_norm_autograd.cpp",
                    "dropout_fusions_autograd.cpp")
cpp_extension.load(name="ls_fairseq_autograd_check", sources=[os.path.join(CSRC, f) for f in AUTOGRAD_SOURCES], build_directory=sys.argv[1], is_python_module=False, verbose=False)
ops = torch.ops.ls_fairseq
torch.manual_seed(0)
def leaf(*s): return torch.randn(*s, dtype=torch.double).requires_grad_()
def check(a, b, what):
    assert (a is None) == (b is None), (what, a, b)
    if a is not None: assert torch.allclose(a, b, atol=1e-10), (what, (a - b).abs().max())
# layer norm: weight/bias present or not, requiring grad or not
for has_w, has_b, w_req, b_req in itertools.product([True, False], repeat=4):
    x = leaf(3, 5, 7); w = torch.randn(7, dtype=torch.double).requires_grad_(w_req) if has_w else None
    b = torch.randn(7, dtype=torch.double).requires_grad_(b_req) if has_b else None
    g = torch.randn(3, 5, 7, dtype=torch.double)
    y, mean, rstd = ops.layer_norm_fwd(x, w, b, 1e-5, False)
    assert not mean.requires_grad and not rstd.requires_grad
    ins = [x] + [t for t in (w, b) if t is not None and t.requires_grad]
    got = torch.autograd.grad(y, ins, g)
    ref = torch.autograd.grad(F.layer_norm(x, (7,), w, b, 1e-5), ins, g)
    for a, r in zip(got, ref): check(a, r, ("ln", has_w, has_b, w_req, b_req))
    CALLS.clear(); y, _, _ = ops.layer_norm_fwd(x, w, b, 1e-5, False); y.backward(g)
    assert CALLS[1] == ("ln_bwd", False, bool(has_w and w_req), bool(has_b and b_req)), CALLS
# invertible saves y
x = leaf(2, 4); w = torch.ones(4, dtype=torch.double, requires_grad=True)
CALLS.clear(); y, _, _ = ops.layer_norm_fwd(x, w, None, 1e-5, True); y.sum().backward(); assert CALLS[1][1] is True
# bias dropout residual
for has_b, p, train, x_req, r_req in itertools.product([True, False], [0.0, 0.3], [True, False], [True, False], [True, False]):
    x = leaf(4, 6).requires_grad_(x_req); r = leaf(4, 6).requires_grad_(r_req); b = leaf(6) if has_b else None
    if not (x_req or r_req or has_b): continue
    g = torch.randn(4, 6, dtype=torch.double)
    CALLS.clear(); out, rng = ops.bias_dropout_residual_fwd(x, b, r, p, train)
    s = int(rng[0]); m = mask(s, (4, 6), p) if (train and p > 0) else 1
    ref = r + (x + (b if b is not None else 0)) * m
    ins = [t for t in (x, b, r) if t is not None and t.requires_grad]
    for a, e in zip(torch.autograd.grad(out, ins, g), torch.autograd.grad(ref, ins, g)): check(a, e, ("bdr", has_b, p, train))
# bias act dropout
for act, has_b, p, train in itertools.product(["relu", "gelu"], [True, False], [0.0, 0.3], [True, False]):
    x = leaf(4, 6); b = leaf(6) if has_b else None; g = torch.randn(4, 6, dtype=torch.double)
    out, rng = ops.bias_act_dropout_fwd(x, b, act, p, train)
    s = int(rng[0]); m = mask(s, (4, 6), p) if (train and p > 0) else 1
    y = x + (b if b is not None else 0); ref = (F.relu(y) if act == "relu" else F.gelu(y)) * m
    ins = [t for t in (x, b) if t is not None]
    for a, e in zip(torch.autograd.grad(out, ins, g), torch.autograd.grad(ref, ins, g)): check(a, e, ("bad", act, has_b, p, train))
# bias only requiring grad (x frozen)
x = torch.randn(4, 6, dtype=torch.double); b = leaf(6)
out, _ = ops.bias_act_dropout_fwd(x, b, "gelu", 0.0, True); (gb,) = torch.autograd.grad(out.sum(), [b])
check(gb, torch.autograd.grad(F.gelu(x + b).sum(), [b])[0], "bias only")
# fused pre-LN boundary (x, h) = (r + dropout(y + b), LayerNorm(x)): gradients of either output or
# both, any subset of the inputs present / requiring grad
for has_b, has_w, has_lb, p, train, y_req, r_req, outs in itertools.product(
        [True, False], [True, False], [True, False], [0.0, 0.3], [True, False], [True, False],
        [True, False], ["x", "h", "xh"]):
    y = leaf(3, 7).requires_grad_(y_req); r = leaf(3, 7).requires_grad_(r_req)
    b = leaf(7) if has_b else None; w = leaf(7) if has_w else None; lb = leaf(7) if has_lb else None
    ins = [t for t in (y, b, r, w, lb) if t is not None and t.requires_grad]
    if not ins: continue
    gx, gh = torch.randn(3, 7, dtype=torch.double), torch.randn(3, 7, dtype=torch.double)
    CALLS.clear(); x, h, mean, rstd, rng = ops.bias_dropout_residual_layer_norm_fwd(y, b, r, w, lb, p, train, 1e-5)
    assert not mean.requires_grad and not rng.requires_grad
    m = mask(int(rng[0]), (3, 7), p) if (train and p > 0) else 1
    xr = r + (y + (b if b is not None else 0)) * m; hr = F.layer_norm(xr, (7,), w, lb, 1e-5)
    loss = ((x * gx).sum() if "x" in outs else 0) + ((h * gh).sum() if "h" in outs else 0)
    ref = ((xr * gx).sum() if "x" in outs else 0) + ((hr * gh).sum() if "h" in outs else 0)
    if not ref.requires_grad:  # only LayerNorm's parameters need grad and only x is used: no gradient
        for a in torch.autograd.grad(loss, ins, allow_unused=True): assert a is None or not a.any()
        continue
    got = torch.autograd.grad(loss, ins, allow_unused=True); want = torch.autograd.grad(ref, ins, allow_unused=True)
    for a, e in zip(got, want):
        a = torch.zeros_like(e) if (a is None and e is not None) else a
        e = torch.zeros_like(a) if (e is None and a is not None) else e
        check(a, e, ("bdr_ln", has_b, has_w, has_lb, p, train, y_req, r_req, outs))
    fused = "h" in outs and train and p > 0 and (y_req or has_b)  # one pass for the whole backward
    lnb = [c for c in CALLS if isinstance(c, tuple) and c[0] in ("ln_bwd", "bdr_ln_bwd")]
    assert [c[0] for c in lnb] == (["bdr_ln_bwd"] if fused else ["ln_bwd"] if "h" in outs else []), CALLS
    if lnb and fused: assert lnb[0][1:] == (bool(has_w), bool(has_lb), bool(has_b)), CALLS
    elif lnb: assert lnb[0][2:] == (bool(has_w), bool(has_lb)), CALLS
# layer_norm_residual (CompositeImplicitAutograd): (LayerNorm(x), x), x's two gradients summed
# inside layer_norm_bwd. Oracle of the call pattern: a Python autograd.Function with the same
# kernel calls, whose values and arguments the op must reproduce exactly.
class KeepInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, eps):
        ctx.set_materialize_grads(False)
        y, mean, rstd = ops.layer_norm_fwd(x, w, b, eps, False)
        ctx.save_for_backward(x, w, b, mean, rstd)
        return y, x
    @staticmethod
    def backward(ctx, gy, gr):
        if gy is None: return gr, None, None, None
        x, w, b, mean, rstd = ctx.saved_tensors; nx, nw, nb = ctx.needs_input_grad[:3]
        wg, bg = bool(nw and w is not None), bool(nb and b is not None)
        dx, dw, db = ops.layer_norm_bwd(gy, x, w, b, mean, rstd, False, wg, bg, gr if nx else None)
        return dx if nx else None, dw.view_as(w) if wg else None, db.view_as(b) if bg else None, None
class OpLog(TorchDispatchMode):  # the ops autograd runs in backward (the kernels' insides not)
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        LOGGED.append(func.overloadpacket.__name__); return func(*args, **(kwargs or {}))
LOGGED = []
def same_args(a, b):
    assert [n for n, _ in a] == [n for n, _ in b], (a, b)
    for (n, xs), (_, ys) in zip(a, b):
        for u, v in zip(xs, ys):
            assert (u is None) == (v is None), n
            if isinstance(u, torch.Tensor): assert u.dtype == v.dtype and torch.equal(u, v), n
            else: assert u == v, n
def run_residual(fn, x, w, b, gy, gr, outs, ins):
    ARGS.clear(); CALLS.clear(); y, r = fn(x, w, b, 1e-5)
    loss = ((y * gy).sum() if "y" in outs else 0) + ((r * gr).sum() if "r" in outs else 0)
    LOGGED.clear()
    with OpLog(): grads = torch.autograd.grad(loss, ins, allow_unused=True) if ins else ()
    return y, r, grads, list(ARGS), list(CALLS), list(LOGGED)
for has_w, has_b, x_req, w_req, b_req, outs in itertools.product(
        [True, False], [True, False], [True, False], [True, False], [True, False], ["y", "r", "yr"]):
    if (w_req and not has_w) or (b_req and not has_b): continue
    x = leaf(3, 5, 7).requires_grad_(x_req)
    w = torch.randn(7, dtype=torch.double).requires_grad_(w_req) if has_w else None
    b = torch.randn(7, dtype=torch.double).requires_grad_(b_req) if has_b else None
    gy, gr = torch.randn(3, 5, 7, dtype=torch.double), torch.randn(3, 5, 7, dtype=torch.double)
    ins = [t for t in (x, w, b) if t is not None and t.requires_grad]
    what = ("ln_res", has_w, has_b, x_req, w_req, b_req, outs)
    y, r, got, args, calls, logged = run_residual(ops.layer_norm_residual, x, w, b, gy, gr, outs, ins)
    assert torch.equal(y, F.layer_norm(x, (7,), w, b, 1e-5)), what
    assert r is not x and r._base is x and r.data_ptr() == x.data_ptr() and torch.equal(r, x), what
    assert r.requires_grad == bool(ins) and y.requires_grad == bool(ins), what
    if ins: assert r.grad_fn is y.grad_fn and "LayerNormResidualFunction" in y.grad_fn.name(), what
    yo, ro, want, oargs, ocalls, _ = run_residual(KeepInput.apply, x, w, b, gy, gr, outs, ins)
    assert torch.equal(y, yo) and torch.equal(r, ro), what
    for a, e in zip(got, want): assert (a is None) == (e is None) and (a is None or torch.equal(a, e)), what
    same_args(args, oargs); assert calls == ocalls, (what, calls, ocalls)
    ref = ((F.layer_norm(x, (7,), w, b, 1e-5) * gy).sum() if "y" in outs else 0) + ((x * gr).sum() if "r" in outs else 0)
    if ins:
        if isinstance(ref, torch.Tensor) and ref.requires_grad:
            for a, e in zip(got, torch.autograd.grad(ref, ins, allow_unused=True)):
                check(torch.zeros_like(e) if a is None and e is not None else a,
                      torch.zeros_like(a) if e is None and a is not None else e, what)
        else:
            assert all(a is None for a in got), what
    # one kernel call per direction, x's gradients summed inside it: no add in autograd
    assert calls[0] == "ln_fwd" and calls.count("ln_fwd") == 1, (what, calls)
    lnb = [a for n, a in args if n == "ln_bwd"]
    assert len(lnb) == (1 if "y" in outs and ins else 0), (what, calls)
    if lnb:
        assert lnb[0][7:9] == (bool(has_w and w_req), bool(has_b and b_req)), (what, calls)
        assert (lnb[0][9] is not None) == ("r" in outs and x_req), what  # the residual gradient
    assert not [n for n in logged if n.startswith("add")], (what, logged)
    assert ("layer_norm_bwd" in logged) == bool(lnb), (what, logged)
# the check above sees an add where autograd sums x's two gradients itself
x = leaf(4, 7); LOGGED.clear()
with OpLog(): torch.autograd.grad((F.layer_norm(x, (7,), None, None, 1e-5) + x).sum(), [x])
assert [n for n in LOGGED if n.startswith("add")], LOGGED
# no grad mode, inference mode (the Autograd key skipped: the composite runs at the CPU key): the
# same forward, the residual still x's storage, no graph
x, w = leaf(4, 7), leaf(7)
for mode in (torch.no_grad, torch.inference_mode):
    with mode():
        y, r = ops.layer_norm_residual(x, w, None, 1e-5)
    assert torch.equal(y, F.layer_norm(x, (7,), w, None, 1e-5)) and r.data_ptr() == x.data_ptr()
    assert r.grad_fn is None and not y.requires_grad
# the binding's entry: affine parameters cast to x's dtype, their gradients back through the cast
from ls_fairseq.ops import _layer_norm_cuda  # noqa: E402
x = torch.randn(5, 7, requires_grad=True); w = leaf(7); b = leaf(7)
y, r = _layer_norm_cuda.layer_norm_residual_cuda(x, w, b, 1e-5)
assert y.dtype == torch.float32 and torch.equal(y, F.layer_norm(x, (7,), w.float(), b.float(), 1e-5))
g = torch.randn(5, 7); ins = [x, w, b]
for a, e in zip(torch.autograd.grad((y * g).sum() + (r * g).sum(), ins),
                torch.autograd.grad((F.layer_norm(x, (7,), w.float(), b.float(), 1e-5) * g).sum() + (x * g).sum(), ins)):
    assert torch.allclose(a, e, atol=1e-5), (a - e).abs().max()
# fake tensors: the op decomposes into layer_norm_fwd/_bwd, whose fakes are the binding's;
# then torch.library.opcheck (schema, autograd registration, fake, AOT) over the CPU stand-ins
_layer_norm_cuda._register()
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
with FakeTensorMode():
    x = torch.empty(6, 8, requires_grad=True); w = torch.empty(8, requires_grad=True)
    y, r = ops.layer_norm_residual(x, w, None, 1e-5)
    assert y.shape == r.shape == (6, 8) and r._base is x
    dx, dw = torch.autograd.grad((y + r).sum(), [x, w])
    assert dx.shape == (6, 8) and dw.shape == (8,)
for w, b in ((leaf(8), leaf(8)), (None, None), (leaf(8), None)):
    torch.library.opcheck(ops.layer_norm_residual.default, (leaf(6, 8), w, b, 1e-5))
print("all C++ autograd checks passed")
