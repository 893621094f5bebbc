"""GPU tests of the fused multi-tensor Adam (csrc/adam.cu, ls_fairseq/ops/_adam_cuda.py), of
ls_adam on the GPU, and of the fused fp16 model copy (LSFusedFP16Optimizer) and its deferred
overflow check.

Compared with: ``ops.adam_step_reference`` (same inputs, several steps), fairseq's ``Adam`` and
fairseq's ``FP16Optimizer`` + ``adam`` (--fp16 flat fp32 master, --clip-norm, --update-freq,
loss-scale overflow), for every storage variant: fp32; fp16/bf16 params + grads with fp32
moments (--memory-efficient-fp16); fp16 moments, plain and scaled (--fp16-adam-stats); fp32
master + fp16 grads + fp16 model copy written in the same launch. Sizes: 1..2^20+3 elements,
odd, around every vector width and chunk edge, views at misaligned offsets, and one tensor of
more than 2^31 elements. Guard elements around every tensor check that nothing outside it is
written; "every element changed" checks that nothing inside is skipped.

Both mechanisms are on by default for ``--optimizer ls_adam`` under ``--fp16``/``--bf16``
(``FP16Optimizer.build_optimizer`` builds LSFusedFP16Optimizer, which defers its overflow check):
every arm below names what it builds with ``--ls-no-fused-fp16-copy``,
``--ls-no-deferred-overflow-check`` or the flags that require them; an arm with no such flag
is what a user's plain ``--optimizer ls_adam --fp16`` gets, and says so.

Tolerances: fp32 state: the kernel and the reference do the same fp32 operations, the kernel
with fused multiply-adds: a few fp32 ulps of the value (2e-6 relative) plus 1e-6 of the tensor's
largest value (rounding of terms that cancel, e.g. in the first moment). fp16/bf16 storage: both round the same fp32 value; one unit in the last place
of the storage dtype where the fp32 values straddle a rounding boundary.
"""
import copy
import math

import pytest
import torch

from fairseq_helpers import fp16_optimizer_cfg
from ls_fairseq.ops import _extension
from ls_fairseq.ops.adam import adam_step_reference

pytestmark = pytest.mark.gpu
DEV = "cuda"
SIZES = [1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 1023, 1024, 1025, 16383, 16384, 16385, 16387,
         65536 + 5, (1 << 20) + 3]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.01)


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert _extension.load(), f"CUDA extension failed to build: {_extension.failure_reason()}"
    assert _extension.has_op("multi_tensor_adam")


def _cuda_step(*args, **kw):
    from ls_fairseq.ops._adam_cuda import adam_step_cuda

    return adam_step_cuda(*args, **kw)


def max_rel_err(a, b):
    """max |a - b| / max |b| (as tests/fairseq_helpers.py)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _ulp_close(got, ref, dtype, name):
    """A few fp32 ulps of each value, plus fp32 rounding of the largest terms that cancelled
    (m = b1 m + (1 - b1) g can be far smaller than its terms); one storage ulp for fp16/bf16."""
    got, ref = got.float(), ref.float()
    floor = 1e-6 * float(ref.abs().max()) + 1e-12 if ref.numel() else 0.0
    if dtype == torch.float32:
        tol = 2e-6 * ref.abs() + floor
    else:
        tol = ref.abs() * (2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7) + floor + 1e-7
    bad = (got - ref).abs() > tol
    assert not bad.any(), f"{name}: {int(bad.sum())} elements off, e.g. {got[bad][:4]} vs {ref[bad][:4]}"


class Buffers:
    """Tensors as views into one buffer per role, with guard gaps (filled with a sentinel)
    between them and a chosen misalignment of each start."""

    SENTINEL = 12345.0

    def __init__(self, sizes, dtype, gap=3, align="scalar"):
        self.sizes = sizes
        self.offsets, off = [], gap
        for i, n in enumerate(sizes):
            if align == "scalar":
                off += i % 3  # starts at 0, +1, +2 elements from the previous gap end
            elif align == "vec8":
                off = (off + 7) // 8 * 8  # starts at multiples of 8 elements (vector path)
            else:
                off = (off + 7) // 8 * 8 + 4  # 4 mod 8: still the 4-wide vector path
            self.offsets.append(off)
            off += n + gap
        self.buf = torch.full((off,), self.SENTINEL, dtype=dtype, device=DEV)
        self.views = [self.buf[o:o + n] for o, n in zip(self.offsets, sizes)]

    def guards_intact(self):
        mask = torch.ones_like(self.buf, dtype=torch.bool)
        for o, n in zip(self.offsets, self.sizes):
            mask[o:o + n] = False
        return bool((self.buf[mask] == self.SENTINEL).all())


VARIANTS = {
    # name: (param dtype, grad dtype, moment dtype, model copy dtype)
    "fp32": (torch.float32, torch.float32, torch.float32, None),
    "mem_eff_fp16": (torch.float16, torch.float16, torch.float32, None),
    "mem_eff_bf16": (torch.bfloat16, torch.bfloat16, torch.float32, None),
    "fp16_moments": (torch.float32, torch.float32, torch.float16, None),
    "master_fp16_copy": (torch.float32, torch.float16, torch.float32, torch.float16),
    "master_bf16_copy": (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16),
    "flat_fp32_grads_fp16_copy": (torch.float32, torch.float32, torch.float32, torch.float16),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("align", ["vec8", "vec4", "scalar"])
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
def test_matches_reference_all_sizes(variant, align, scale_kind):
    pt, gt, mt, ot = VARIANTS[variant]
    g = torch.Generator(device=DEV).manual_seed(hash((variant, align, scale_kind)) % 2**31)
    sizes = SIZES[::-1] if align == "scalar" else SIZES
    P, G, M, V = (Buffers(sizes, t, align=align) for t in (pt, gt, mt, mt))
    O = Buffers(sizes, ot, align=align) if ot is not None else None
    for p in P.views:
        p.copy_(torch.randn(p.shape, generator=g, device=DEV))
    for m, v in zip(M.views, V.views):
        m.zero_()
        v.zero_()
    loss_scale = 64.0
    for step in range(1, 4):
        # the reference starts from exactly the state the kernel holds (one-step comparison)
        ref_p = [p.float().clone() for p in P.views]
        ref_m = [m.float().clone() for m in M.views]
        ref_v = [v.float().clone() for v in V.views]
        before = [p.clone() for p in P.views]
        for gr in G.views:
            gr.copy_(torch.randn(gr.shape, generator=g, device=DEV) * 0.5 * loss_scale)
        gs = 1.0 / loss_scale
        grad_scale = torch.tensor(gs, device=DEV) if scale_kind == "tensor" else gs
        found = _cuda_step(P.views, G.views, M.views, V.views, step=step, grad_scale=grad_scale,
                           model_copies=O.views if O else None, **HYPER)
        assert found.item() == 0
        adam_step_reference(ref_p, [gr.float() for gr in G.views], ref_m, ref_v, step=step,
                            grad_scale=gs, **HYPER)
        for i, n in enumerate(sizes):
            _ulp_close(P.views[i], ref_p[i], pt, f"{variant} param[{n}] step {step}")
            _ulp_close(M.views[i], ref_m[i], mt, f"{variant} exp_avg[{n}]")
            _ulp_close(V.views[i], ref_v[i], mt, f"{variant} exp_avg_sq[{n}]")
            if O is not None:
                assert torch.equal(O.views[i], P.views[i].to(ot)), f"model copy [{n}]"
            # nothing skipped: at step 1 every element moves by ~lr (m / sqrt(v) = +-1)
            if pt == torch.float32 and step == 1:
                assert (P.views[i] != before[i]).all(), f"{variant}: element skipped in [{n}]"
        for b in (P, G, M, V) + ((O,) if O else ()):
            assert b.guards_intact(), f"{variant}: write outside a tensor"


def test_mixed_dtypes_and_strided_grads():
    """Not one dtype combination (one launch per combination) and a transposed gradient (copied
    contiguous first): same result as the reference."""
    g = torch.Generator(device=DEV).manual_seed(7)
    ps = [torch.randn(33, 17, generator=g, device=DEV), torch.randn(1001, generator=g,
          device=DEV).half(), torch.randn(5, generator=g, device=DEV)]
    gs = [torch.randn(17, 33, generator=g, device=DEV).t(), torch.randn(1001, generator=g,
          device=DEV).half(), torch.randn(5, generator=g, device=DEV)]
    ms = [torch.zeros(p.shape, device=DEV) for p in ps]
    vs = [torch.zeros(p.shape, device=DEV) for p in ps]
    ref = [p.float().clone() for p in ps]
    rm, rv = [m.clone() for m in ms], [v.clone() for v in vs]
    found = _cuda_step(ps, gs, ms, vs, step=1, **HYPER)
    assert found.item() == 0
    adam_step_reference(ref, [x.float() for x in gs], rm, rv, step=1, **HYPER)
    for p, r in zip(ps, ref):
        _ulp_close(p, r, p.dtype, "param")


def test_one_launch_for_many_tensors():
    sizes = [(i * 7919) % 5000 + 1 for i in range(300)]
    ps = [torch.randn(n, device=DEV) for n in sizes]
    gs = [torch.randn(n, device=DEV) for n in sizes]
    ms = [torch.zeros(n, device=DEV) for n in sizes]
    vs = [torch.zeros(n, device=DEV) for n in sizes]
    _cuda_step(ps, gs, ms, vs, step=1, **HYPER)  # warm up
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _cuda_step(ps, gs, ms, vs, step=2, **HYPER)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    adam = [n for n in names if "multi_tensor_adam_kernel" in n]
    assert len(adam) == 1, names


def test_nonfinite_grads_leave_elements_untouched_and_flag():
    n = 40000
    p = torch.randn(n, device=DEV)
    m = torch.randn(n, device=DEV) * 0.01
    v = torch.rand(n, device=DEV) * 0.01
    g = torch.randn(n, device=DEV)
    bad_idx = torch.tensor([0, 3, 17, 16384, 39999], device=DEV)
    g[bad_idx[:2]] = float("inf")
    g[bad_idx[2:4]] = float("nan")
    g[bad_idx[4]] = -float("inf")
    p0, m0, v0 = p.clone(), m.clone(), v.clone()
    found = _cuda_step([p], [g], [m], [v], step=5, **HYPER)
    assert found.item() == 1
    good = torch.ones(n, dtype=torch.bool, device=DEV)
    good[bad_idx] = False
    assert torch.equal(p[~good], p0[~good]) and torch.equal(m[~good], m0[~good])
    assert torch.equal(v[~good], v0[~good])
    rp, rm, rv = p0.clone(), m0.clone(), v0.clone()
    adam_step_reference([rp], [g.nan_to_num(0.0, 0.0, 0.0)], [rm], [rv], step=5, **HYPER)
    _ulp_close(p[good], rp[good], torch.float32, "param")
    _ulp_close(m[good], rm[good], torch.float32, "exp_avg")
    # a huge grad_scale that overflows fp32 only after scaling is caught as well
    h = torch.full((5,), 1e30, device=DEV)
    found = _cuda_step([torch.ones(5, device=DEV)], [h], [torch.zeros(5, device=DEV)],
                       [torch.zeros(5, device=DEV)], step=1, grad_scale=1e10, **HYPER)
    assert found.item() == 1


def test_scaled_fp16_moments_match_fairseq_fused_adam_rule():
    """--fp16-adam-stats: moments stored as fp16(true / scale), scale = 1e-8 + max|.| / 65504
    recomputed after each step (fairseq FusedAdamV1's rule), vs that rule in PyTorch, one step at
    a time from the kernel's own state."""
    sizes = [5, 1025, 70001]
    g = torch.Generator(device=DEV).manual_seed(0)
    ps = [torch.randn(n, generator=g, device=DEV) for n in sizes]
    ms = [torch.zeros(n, dtype=torch.float16, device=DEV) for n in sizes]
    vs = [torch.zeros(n, dtype=torch.float16, device=DEV) for n in sizes]
    scales = torch.ones(len(sizes), 2, device=DEV)
    for step in range(1, 6):
        rp = [p.clone() for p in ps]
        rm = [m.float() * scales[i, 0] for i, m in enumerate(ms)]
        rv = [v.float() * scales[i, 1] for i, v in enumerate(vs)]
        grads = [torch.randn(n, generator=g, device=DEV) * 1e-4 for n in sizes]  # v ~ 1e-8:
        _cuda_step(ps, grads, ms, vs, step=step, moment_scales=scales, **HYPER)  # < fp16 min
        for i in range(len(sizes)):
            adam_step_reference([rp[i]], [grads[i]], [rm[i]], [rv[i]], step=step, **HYPER)
            rs = torch.stack([1e-8 + rm[i].abs().max() / 65504, 1e-8 + rv[i].abs().max() / 65504])
            torch.testing.assert_close(scales[i], rs, rtol=1e-5, atol=0)
            # the update used fp16-rounded moments on both sides: fp32 rounding only
            _ulp_close(ps[i], rp[i], torch.float32, "param")
            _ulp_close(ms[i].float() * scales[i, 0], rm[i], torch.float16, "exp_avg")
            _ulp_close(vs[i].float() * scales[i, 1], rv[i], torch.float16, "exp_avg_sq")
            assert (vs[i] != 0).float().mean() > 0.99  # second moments survive (unscaled: 0)


def test_more_than_2_to_31_elements():
    n = 2**31 + 4099  # fp16 params, grads and moments: 8 bytes per element
    if torch.cuda.mem_get_info()[0] < n * 8 + (4 << 30):
        pytest.skip("not enough GPU memory")
    p = torch.empty(n, dtype=torch.float16, device=DEV).normal_()
    g = torch.empty(n, dtype=torch.float16, device=DEV).normal_()
    m = torch.empty(n, dtype=torch.float16, device=DEV).normal_(0, 0.01)
    v = torch.empty(n, dtype=torch.float16, device=DEV).uniform_(0, 0.01)
    windows = [slice(0, 5000), slice(2**31 - 3000, 2**31 + 3000), slice(n - 5000, n)]
    saved = [(p[w].clone(), g[w].clone(), m[w].clone(), v[w].clone()) for w in windows]
    _cuda_step([p], [g], [m], [v], step=3, **HYPER)
    for w, (p0, g0, m0, v0) in zip(windows, saved):
        rp, rm, rv = p0.float(), m0.float(), v0.float()
        adam_step_reference([rp], [g0], [rm], [rv], step=3, **HYPER)
        _ulp_close(p[w], rp, torch.float16, f"param {w}")
        _ulp_close(m[w], rm, torch.float16, f"exp_avg {w}")
        _ulp_close(v[w], rv, torch.float16, f"exp_avg_sq {w}")
        assert (p[w] != p0).float().mean() > 0.5  # the tail was updated, not skipped
    del p, g, m, v


# ---- ls_adam vs fairseq's adam on the GPU ------------------------------------------------------

def _model(dtype, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(37, 1001), torch.nn.ReLU(),
                               torch.nn.Linear(1001, 13), torch.nn.LayerNorm(13)).to(DEV, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ls_adam_matches_fairseq_adam(dtype):
    """20 steps of fairseq's Adam and of ls_adam (one kernel launch) from the same weights and the
    same gradient sequence; fp16/bf16 weights = --memory-efficient-fp16 (fp32 moments)."""
    from fairseq.optim.adam import Adam as FairseqAdamImpl

    from ls_fairseq.optim.ls_adam import LSAdam

    shapes = [(1001, 37), (1001,), (13, 1001), (13,), (3, 5, 7)]
    g = torch.Generator(device=DEV).manual_seed(1)
    init = [torch.randn(s, generator=g, device=DEV).to(dtype) for s in shapes]
    a = [torch.nn.Parameter(t.clone()) for t in init]
    b = [torch.nn.Parameter(t.clone()) for t in init]
    kw = dict(lr=1e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    opt_a, opt_b = FairseqAdamImpl(a, **kw), LSAdam(b, **kw)
    for _ in range(20):
        grads = [torch.randn(s, generator=g, device=DEV).to(dtype) for s in shapes]
        for params, opt in ((a, opt_a), (b, opt_b)):
            for p, gr in zip(params, grads):
                p.grad = gr.clone()
            opt.step()
    for pa, pb in zip(a, b):
        assert pb.dtype == dtype
        if dtype == torch.float32:  # fp32 rounding of 20 steps of ~1e-3
            assert max_rel_err(pb.detach(), pa.detach()) <= 1e-5
        else:  # a rounding flip of the stored weight now and then: a few storage ulps
            ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
            torch.testing.assert_close(pb.detach().float(), pa.detach().float(), rtol=4 * ulp,
                                       atol=1e-5)
    for sa, sb in zip(opt_a.state.values(), opt_b.state.values()):
        assert max_rel_err(sb["exp_avg_sq"], sa["exp_avg_sq"]) <= 1e-5
    sd = opt_b.state_dict()  # a state dict fairseq's adam reads and continues from
    opt_c = FairseqAdamImpl([torch.nn.Parameter(p.detach().clone()) for p in b], **kw)
    opt_c.load_state_dict(copy.deepcopy(sd))
    assert all(s["step"] == 20 for s in opt_c.state_dict()["state"].values())


# ---- --fp16 (FP16Optimizer) with and without the fused fp16 copy ----------------------------
# fairseq's FP16Optimizer around ls_adam: --ls-no-fused-fp16-copy. The fused copy as it was
# before the deferred check existed (reads the grad norm back at every update, raises
# OverflowError as fairseq does): --ls-fused-fp16-copy --ls-no-deferred-overflow-check.

_UNFUSED = ["--ls-no-fused-fp16-copy"]
_FUSED_EAGER_CHECK = ["--ls-fused-fp16-copy", "--ls-no-deferred-overflow-check"]


def _train(opt, model, steps, update_freq, clip, g, overflow_at=()):
    """fairseq's trainer sequence. The gradients are a fixed random sequence (times the loss
    scale, accumulated over update_freq "backward passes"), not the model's: with fp16 weights a
    one-ulp rounding difference would otherwise change every later gradient and no two
    optimizers could be compared after a few steps."""
    overflows = 0
    for step in range(steps):
        opt.zero_grad()
        scale = opt.scaler.loss_scale
        for _ in range(update_freq):
            for p in model.parameters():
                gr = (torch.randn(p.shape, generator=g, device=DEV) * 0.01 * scale).half()
                p.grad = gr if p.grad is None else p.grad + gr
            opt._needs_sync = True  # what FP16Optimizer.backward sets
        if step in overflow_at:
            next(model.parameters()).grad.view(-1)[5] = float("inf")
        opt.multiply_grads(1.0 / update_freq)
        try:
            opt.clip_grad_norm(clip)
        except OverflowError:
            overflows += 1
            continue
        opt.step()
    return overflows


def test_fp16_optimizer_real_backward_smoke():
    """Real loss.backward() through FP16Optimizer.backward (loss scaling): unfused ls_adam
    (fairseq's FP16Optimizer), the fused copy with the eager overflow check, and the plain
    ``--optimizer ls_adam --fp16`` (no flag: fused copy + deferred check) agree (same kernel
    math; the grad norm is summed in another order; no overflow here, so the deferred check
    changes nothing but when the norm is read)."""
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    from ls_fairseq.optim.ls_adam import LSFusedFP16Optimizer

    weights = []
    for extra, fused, deferred in ((_UNFUSED, False, False), (_FUSED_EAGER_CHECK, True, False),
                                   ([], True, True)):
        model = _model(torch.float16, seed=3)
        cfg = fp16_optimizer_cfg("ls_adam", ["--clip-norm", "0.5", *extra])
        opt = FP16Optimizer.build_optimizer(cfg, list(model.parameters()))
        assert isinstance(opt, LSFusedFP16Optimizer) == fused, extra
        assert getattr(opt, "defers_host_reads", False) == deferred, extra
        g = torch.Generator(device=DEV).manual_seed(4)
        for _ in range(5):
            opt.zero_grad()
            for _ in range(2):
                x = torch.randn(64, 37, generator=g, device=DEV).half()
                opt.backward(model(x).float().pow(2).mean())
            opt.multiply_grads(0.5)
            opt.clip_grad_norm(0.5)
            opt.step()
        weights.append([p.detach().float() for p in model.parameters()])
    for other in weights[1:]:
        for a, b in zip(weights[0], other):
            torch.testing.assert_close(a, b, rtol=2 * 2**-10, atol=1e-4)


@pytest.mark.parametrize("clip", [0.0, 0.05])
@pytest.mark.parametrize("update_freq", [1, 3])
@pytest.mark.parametrize("fp16_stats", [False, True])
def test_fp16_optimizer_fused_copy_matches_fairseq(clip, update_freq, fp16_stats):
    """fairseq's FP16Optimizer + adam, the same around ls_adam (--ls-no-fused-fp16-copy) and the
    fused copy with the eager overflow check (the OverflowError at the inf gradient is raised in
    the update, as fairseq's; the deferred check: test_deferred_overflow_check_matches_fairseq)."""
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    from ls_fairseq.optim.ls_adam import LSFusedFP16Optimizer

    stats = ["--fp16-adam-stats"] if fp16_stats else []
    runs = {}
    # fairseq's adam cannot keep fp16 stats without apex: compare against ls_adam's unfused path
    names = ["ls_adam", "ls_adam_fused"] + ([] if fp16_stats else ["adam"])
    for name in names:
        extra = ["--clip-norm", str(clip)] + stats
        if name == "ls_adam_fused":
            extra += _FUSED_EAGER_CHECK
        elif name == "ls_adam":
            extra += _UNFUSED
        cfg = fp16_optimizer_cfg("adam" if name == "adam" else "ls_adam", extra)
        model = _model(torch.float16, seed=3)
        params = list(model.parameters())
        opt = FP16Optimizer.build_optimizer(cfg, params)
        assert isinstance(opt, LSFusedFP16Optimizer) == (name == "ls_adam_fused")
        g = torch.Generator(device=DEV).manual_seed(4)
        overflows = _train(opt, model, 12, update_freq, clip, g, overflow_at=(4,))
        assert overflows == 1  # the inf grad was seen by the grad norm, the step skipped
        runs[name] = (model, opt)
    ref_model, ref_opt = runs["adam" if "adam" in runs else "ls_adam"]
    for name, (model, opt) in runs.items():
        for p, rp in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.float(), rp.float(), rtol=2 * 2**-10, atol=2e-4,
                                       msg=f"{name} vs reference: fp16 weights")
        master = opt.fp32_params[next(iter(opt.fp32_params))]
        ref_master = ref_opt.fp32_params[next(iter(ref_opt.fp32_params))]
        # fp16 stats: a one-ulp flip of a stored fp16 moment moves the update by ~lr * 1e-3
        torch.testing.assert_close(master, ref_master, rtol=1e-5,
                                   atol=2e-5 if fp16_stats else 1e-6)
        # the fp16 weights are exactly the rounded fp32 master (the fused kernel wrote them)
        flat16 = torch.cat([p.detach().view(-1) for p in model.parameters()])
        assert torch.equal(flat16, master.detach().half())
        st = opt.state_dict()
        assert st["loss_scale"] == ref_opt.state_dict()["loss_scale"]
        state = next(iter(st["state"].values()))
        assert state["step"] == 11
    # the fused optimizer's checkpoint is fairseq's: load it into the unfused one and go on
    fused_model, fused_opt = runs["ls_adam_fused"]
    plain_model, plain_opt = runs["ls_adam"]
    plain_opt.load_state_dict(copy.deepcopy(fused_opt.state_dict()))
    with torch.no_grad():
        for p, q in zip(plain_model.parameters(), fused_model.parameters()):
            p.copy_(q)
        for k in plain_opt.fp32_params:
            plain_opt.fp32_params[k].copy_(fused_opt.fp32_params[k])
    g1, g2 = (torch.Generator(device=DEV).manual_seed(9) for _ in range(2))
    _train(fused_opt, fused_model, 3, update_freq, clip, g1)
    _train(plain_opt, plain_model, 3, update_freq, clip, g2)
    for p, q in zip(plain_model.parameters(), fused_model.parameters()):
        torch.testing.assert_close(p.float(), q.float(), rtol=2 * 2**-10, atol=2e-4)


@pytest.mark.parametrize("extra", [[], ["--ls-fused-fp16-copy"]], ids=["default", "required"])
def test_fused_copy_frees_the_fp32_grad_buffer(extra):
    """The plain ``--optimizer ls_adam --fp16`` (no flag) builds the fused copy, as
    ``--ls-fused-fp16-copy`` does; either frees fairseq's fp32 grad buffer."""
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    from ls_fairseq.optim.ls_adam import LSFusedFP16Optimizer

    cfg = fp16_optimizer_cfg("ls_adam", extra)
    opt = FP16Optimizer.build_optimizer(cfg, list(_model(torch.float16).parameters()))
    assert isinstance(opt, LSFusedFP16Optimizer) and opt.defers_host_reads
    assert all(t.grad is None for t in opt.fp32_params.values())


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_fused_copy_grad_norm_is_fairseqs_with_one_host_sync(clip):
    """LSFusedFP16Optimizer.clip_grad_norm with the eager overflow check
    (--ls-no-deferred-overflow-check) returns fairseq's grad norm (within fp32 summation order)
    as a CPU tensor: it waits for the GPU once, and the trainer's later isfinite() tests of the
    result (one of them after the optimizer step) do not wait at all. Reference: fairseq's
    FP16Optimizer around ls_adam (--ls-no-fused-fp16-copy). (The deferred check, the default,
    waits not even once: test_deferred_overflow_check_never_waits_for_the_gpu.)"""
    import warnings

    from fairseq.optim.fp16_optimizer import FP16Optimizer

    norms = {}
    for name, extra in (("fairseq", _UNFUSED), ("fused", _FUSED_EAGER_CHECK)):
        model = _model(torch.float16, seed=3)
        cfg = fp16_optimizer_cfg("ls_adam", ["--clip-norm", str(clip), *extra])
        opt = FP16Optimizer.build_optimizer(cfg, list(model.parameters()))
        g = torch.Generator(device=DEV).manual_seed(4)
        opt.zero_grad()
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=g, device=DEV) * 0.01 * 128).half()
        opt._needs_sync = True
        opt.multiply_grads(1.0 / 3)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                norm = opt.clip_grad_norm(clip)
                finite = bool(torch.isfinite(norm).all())  # what fairseq's trainer asks, twice
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        if name == "fused":
            assert norm.device.type == "cpu" and norm.dtype == torch.float32
            assert finite and len(syncs) == 1, [str(w.message) for w in syncs]
        else:
            assert len(syncs) >= 2  # what the fused path saves (fairseq's checks each wait)
        norms[name] = float(norm)
        opt.step()
    assert norms["fused"] == pytest.approx(norms["fairseq"], rel=1e-5)


# ---- --ls-deferred-overflow-check (flat fp32 master, the CUDA kernel) -------------------------
# The per-tensor master on CPU: tests/test_deferred_overflow.py (same comparison, same reasons).

_DEFERRED = ["--ls-fused-fp16-copy", "--ls-deferred-overflow-check"]


@pytest.mark.parametrize("clip", [0.0, 0.05])
@pytest.mark.parametrize("update_freq", [1, 2])
def test_deferred_overflow_check_matches_fairseq(clip, update_freq):
    """fairseq's FP16Optimizer + adam (OverflowError, step skipped by the trainer) vs the deferred
    optimizer (never raises; the kernel skips the step on a NaN factor; booked at the next
    backward), same gradients, consecutive overflows and a growing scale: same weights (fp32
    master relative 1e-5: kernel vs PyTorch fp32 rounding over 12 steps), loss scale, step
    count, and the same norms for the updates that did not overflow. The plain ``--optimizer
    ls_adam --fp16`` (no flag) is this same optimizer: bit for bit the deferred run."""
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    from fairseq_helpers import fp16_trainer_run

    overflow_at = (3, 4, 9, 11)
    runs = {}
    for name, optimizer, extra in (("fairseq", "adam", []), ("deferred", "ls_adam", _DEFERRED),
                                   ("default", "ls_adam", [])):
        model = _model(torch.float16, seed=3)
        params = list(model.parameters())
        cfg = fp16_optimizer_cfg(optimizer, ["--clip-norm", str(clip), "--fp16-scale-window",
                                             "3", *extra])
        opt = FP16Optimizer.build_optimizer(cfg, params)
        overflows, norms = fp16_trainer_run(opt, params, 12, 5, overflow_at, update_freq, clip)
        runs[name] = (params, opt, overflows, norms, opt.state_dict())
    ref_params, ref, ref_overflows, ref_norms, ref_state = runs["fairseq"]
    params, opt, overflows, norms, state = runs["deferred"]
    assert (ref_overflows, overflows) == (len(overflow_at), 0)
    assert state["loss_scale"] == ref_state["loss_scale"]
    assert next(iter(state["state"].values()))["step"] == 12 - len(overflow_at)
    finite = [float(n) for n in norms if math.isfinite(float(n))]
    assert len(finite) == len(ref_norms)
    torch.testing.assert_close(torch.tensor(finite), torch.tensor([float(n) for n in ref_norms]),
                               rtol=1e-5, atol=0)
    master = next(iter(opt.fp32_params.values()))
    ref_master = next(iter(ref.fp32_params.values()))
    assert max_rel_err(master, ref_master) <= 1e-5
    flat16 = torch.cat([p.detach().view(-1) for p in params])
    assert torch.equal(flat16, master.detach().half())  # the kernel wrote the fp16 weights
    d_params, d_opt, d_overflows, d_norms, d_state = runs["default"]
    assert d_opt.defers_host_reads and d_overflows == 0
    assert d_state["loss_scale"] == state["loss_scale"]
    assert torch.equal(next(iter(d_opt.fp32_params.values())), master)
    torch.testing.assert_close(torch.tensor([float(n) for n in d_norms]),
                               torch.tensor([float(n) for n in norms]), rtol=0, atol=0,
                               equal_nan=True)


def test_deferred_overflow_check_never_waits_for_the_gpu():
    """clip_grad_norm, the trainer's isfinite test and step return while earlier GPU work is
    still running, and the next backward's bookkeeping waits only for the last norm, not for
    work queued after it (the next forward)."""
    import time

    from fairseq.optim.fp16_optimizer import FP16Optimizer


    half_second = int(0.5 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    model = _model(torch.float16, seed=3)
    params = list(model.parameters())
    opt = FP16Optimizer.build_optimizer(
        fp16_optimizer_cfg("ls_adam", ["--clip-norm", "0.05", *_DEFERRED]), params)
    x = torch.randn(64, 37, device=DEV).half()
    for _ in range(2):  # warm-up (allocations, kernels loaded)
        opt.zero_grad()
        opt.backward(model(x).float().pow(2).mean())
        opt.multiply_grads(0.5)
        opt.clip_grad_norm(0.05)
        opt.step()
    opt.zero_grad()
    opt.backward(model(x).float().pow(2).mean())
    opt.multiply_grads(0.5)
    torch.cuda.synchronize()
    torch.cuda._sleep(half_second)  # the backward, still running
    t = time.perf_counter()
    norm = opt.clip_grad_norm(0.05)
    assert bool(torch.isfinite(norm).all())  # fairseq's trainer, twice
    opt.step()
    host = time.perf_counter() - t
    busy = torch.cuda.Event()
    busy.record()
    assert host < 0.1 and not busy.query(), f"the step waited for the GPU ({host:.3f} s)"
    torch.cuda.synchronize()
    opt.zero_grad()
    loss = model(x).float().pow(2).mean()
    torch.cuda._sleep(half_second)  # the next forward, still running
    t = time.perf_counter()
    opt.backward(loss)  # books the last update: waits for its norm only
    host = time.perf_counter() - t
    assert opt.pending_overflow_check is None
    assert host < 0.1, f"the bookkeeping waited for later GPU work ({host:.3f} s)"
    torch.cuda.synchronize()


def test_nonfinite_scale_skips_everything_and_fp16_moments_keep_true_values():
    """A NaN grad_scale tensor (the deferred check's overflow signal) leaves every tensor
    untouched. With scaled fp16 moments, skipped elements keep their true moment values, which
    count towards the new scales (as in the PyTorch reference)."""
    from ls_fairseq.ops.adam import adam_step_skip_nonfinite_reference

    g = torch.Generator(device=DEV).manual_seed(2)
    sizes = [5, 1025, 70001]
    ps = [torch.randn(n, generator=g, device=DEV) for n in sizes]
    ms = [torch.randn(n, generator=g, device=DEV) * 0.01 for n in sizes]
    vs = [torch.rand(n, generator=g, device=DEV) * 0.01 for n in sizes]
    copies = [torch.zeros(n, dtype=torch.float16, device=DEV) for n in sizes]
    old = [t.clone() for t in ps + ms + vs + copies]
    grads = [torch.randn(n, generator=g, device=DEV) for n in sizes]
    found = _cuda_step(ps, grads, ms, vs, step=3, grad_scale=torch.tensor(float("nan"),
                       device=DEV), model_copies=copies, **HYPER)
    assert found.item() == 1
    assert all(torch.equal(a, b) for a, b in zip(ps + ms + vs + copies, old))
    # scaled fp16 moments, one inf element in the largest tensor: kernel vs reference
    ms16 = [(m * 100).half() for m in ms]
    vs16 = [(v * 100).half() for v in vs]
    scales = torch.full((len(sizes), 2), 0.01, device=DEV)
    grads[2][12345] = float("inf")
    grads[2][3] = 1e4  # moves the max |m| of the good elements
    ref = [[t.clone() for t in ts] for ts in (ps, ms16, vs16)]
    ref_scales = scales.clone()
    found = _cuda_step(ps, grads, ms16, vs16, step=3, moment_scales=scales, **HYPER)
    adam_step_skip_nonfinite_reference(*ref[:1], grads, *ref[1:], step=3,
                                       moment_scales=ref_scales, **HYPER)
    assert found.item() == 1
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    for i in range(len(sizes)):
        _ulp_close(ps[i], ref[0][i], torch.float32, "param")
        _ulp_close(ms16[i].float() * scales[i, 0], ref[1][i].float() * ref_scales[i, 0],
                   torch.float16, "exp_avg")
        _ulp_close(vs16[i].float() * scales[i, 1], ref[2][i].float() * ref_scales[i, 1],
                   torch.float16, "exp_avg_sq")
    # the skipped element kept its true moments under the new scale
    true_m = float((old[len(sizes) + 2][12345] * 100).half()) * 0.01
    got = float(ms16[2][12345].float() * scales[2, 0])
    assert abs(got - true_m) <= abs(true_m) * 2**-10 + float(scales[2, 0])


def test_opcheck():
    """torch.library.opcheck of both Adam ops on small tensors: the schema (exactly the arguments
    declared mutable are written, nothing aliases) and the fake (meta) implementations. The
    autograd checks do not apply (optimizer ops, no gradient)."""
    from ls_fairseq.ops import _adam_cuda  # noqa: F401  (registers the ops' fakes)

    ops = torch.ops.ls_fairseq
    utils = ("test_schema", "test_faketensor")
    g = torch.Generator(device=DEV).manual_seed(0)
    shapes = [(7,), (33, 5)]
    params = [torch.randn(s, device=DEV, generator=g) for s in shapes]
    grads = [torch.randn(s, device=DEV, generator=g) for s in shapes]
    ms = [torch.randn(s, device=DEV, generator=g) * 0.1 for s in shapes]
    vs = [torch.rand(s, device=DEV, generator=g) * 0.01 for s in shapes]
    copies = [torch.empty(s, device=DEV, dtype=torch.float16) for s in shapes]
    found_inf = torch.zeros(1, dtype=torch.int32, device=DEV)
    # lr, beta1, beta2, eps, weight_decay, step_size, grad_scale
    hyper = (1e-3, 0.9, 0.98, 1e-8, 0.01, 1e-3, 0.5)
    torch.library.opcheck(ops.multi_tensor_adam.default,
                          (params, grads, ms, vs, copies, None, None, None, found_inf, *hyper),
                          test_utils=utils)
    # fp16 moments stored as true / scale (--fp16-adam-stats): the statistics pass, then the step
    m16 = [m.half() for m in ms]
    v16 = [v.half() for v in vs]
    m_sc = torch.ones(len(shapes), 2, device=DEV)
    v_sc = torch.ones(len(shapes), 2, device=DEV)
    maxima = torch.zeros(len(shapes), 2, device=DEV)
    torch.library.opcheck(ops.multi_tensor_adam_moment_max.default,
                          (params, grads, m16, v16, torch.ones(1, device=DEV), m_sc, v_sc,
                           found_inf, maxima, 0.9, 0.98, 1.0), test_utils=utils)
    torch.library.opcheck(ops.multi_tensor_adam.default,
                          (params, grads, m16, v16, [], None, m_sc, v_sc, found_inf, *hyper),
                          test_utils=utils)

