"""ls_adam vs fairseq's adam (CPU): same parameters after many steps, interchangeable state.

Tolerance: relative 1e-6 on parameters after 60 steps (fp32, same element-wise formula, the only
difference is evaluation order inside fused expressions).
"""
import copy

import pytest
import torch
from fairseq.optim.adam import Adam as FairseqAdamImpl
from omegaconf import OmegaConf

from fairseq_helpers import max_rel_err
from ls_fairseq.optim.ls_adam import FairseqLSAdam, LSAdam, LSAdamConfig

SHAPES = [(1,), (7,), (33, 5), (4, 3, 17), (1025,)]  # odd sizes, tails


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _run(opt, params, steps, seed, grad_dtype=None, scale=None):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(grad_dtype or p.dtype)
        if scale is None:
            opt.step()
        else:
            for p in params:
                p.grad.mul_(scale)
            opt.step(scale=scale)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("betas", [(0.9, 0.98), (0.5, 0.999)])
def test_matches_fairseq_adam_fp32(weight_decay, betas):
    ref_p, ls_p = _params(), _params()
    kw = dict(lr=3e-3, betas=betas, eps=1e-8, weight_decay=weight_decay)
    _run(FairseqAdamImpl(ref_p, **kw), ref_p, 60, seed=1)
    _run(LSAdam(ls_p, **kw), ls_p, 60, seed=1)
    for a, b in zip(ls_p, ref_p):
        assert max_rel_err(a.detach(), b.detach()) <= 1e-6


def test_fp16_params_and_grads_math_in_fp32():
    """--memory-efficient-fp16: fp16 weights/grads, fp32 moments; equals fairseq's adam on the
    same fp16 tensors (it also upcasts to fp32 per step)."""
    ref_p, ls_p = _params(torch.float16), _params(torch.float16)
    kw = dict(lr=1e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    _run(FairseqAdamImpl(ref_p, **kw), ref_p, 50, seed=2)
    opt = LSAdam(ls_p, **kw)
    _run(opt, ls_p, 50, seed=2)
    for a, b in zip(ls_p, ref_p):
        assert a.dtype == torch.float16
        assert torch.equal(a.detach(), b.detach())
    assert opt.state[ls_p[0]]["exp_avg"].dtype == torch.float32


def test_step_with_scale_equals_unscaled_grads():
    a_p, b_p = _params(), _params()
    kw = dict(lr=1e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    _run(LSAdam(a_p, **kw), a_p, 20, seed=3)
    _run(LSAdam(b_p, **kw), b_p, 20, seed=3, scale=128.0)
    for a, b in zip(a_p, b_p):
        assert max_rel_err(a.detach(), b.detach()) <= 1e-6


def test_state_dict_interchangeable_with_fairseq_adam():
    kw = dict(lr=1e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    # 30 steps with ls_adam, then 30 more with fairseq's adam loaded from ls_adam's state ...
    p1 = _params()
    ls = LSAdam(p1, **kw)
    _run(ls, p1, 30, seed=4)
    p2 = [torch.nn.Parameter(p.detach().clone()) for p in p1]
    ref = FairseqAdamImpl(p2, **kw)
    ref.load_state_dict(copy.deepcopy(ls.state_dict()))  # as from a file
    # ... and the reverse direction
    p3 = [torch.nn.Parameter(p.detach().clone()) for p in p1]
    ref_first = FairseqAdamImpl(p3, **kw)
    ref_first.load_state_dict(copy.deepcopy(ls.state_dict()))
    ls_again = LSAdam([torch.nn.Parameter(p.detach().clone()) for p in p1], **kw)
    ls_again.load_state_dict(copy.deepcopy(ref_first.state_dict()))
    p4 = ls_again.param_groups[0]["params"]
    _run(ls, p1, 30, seed=5)
    _run(ref, p2, 30, seed=5)
    _run(ls_again, p4, 30, seed=5)
    for a, b, c in zip(p1, p2, p4):
        assert max_rel_err(a.detach(), b.detach()) <= 1e-6
        assert max_rel_err(c.detach(), b.detach()) <= 1e-6


def _fairseq_optimizer(**overrides):
    cfg = OmegaConf.structured(LSAdamConfig)
    cfg.lr = [1e-3]
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return FairseqLSAdam(cfg, _params())


def test_fairseq_wrapper_options():
    opt = _fairseq_optimizer(adam_betas="(0.9, 0.98)", adam_eps=1e-6, weight_decay=0.1)
    group = opt.optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-6 and group["weight_decay"] == 0.1
    assert opt.supports_memory_efficient_fp16 and opt.supports_flat_params
    assert opt.supports_step_with_scale


def test_amsgrad_is_a_clear_error():
    with pytest.raises(ValueError, match="amsgrad"):
        _fairseq_optimizer(amsgrad=True)


def test_fp16_adam_stats_tracks_fp32_moments():
    ref_p, ls_p = _params(), _params()
    kw = dict(lr=1e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    _run(LSAdam(ref_p, **kw), ref_p, 40, seed=6)
    opt = LSAdam(ls_p, fp16_stats=True, **kw)
    _run(opt, ls_p, 40, seed=6)
    assert opt.state[ls_p[1]]["exp_avg"].dtype == torch.float16
    for a, b in zip(ls_p, ref_p):  # fp16 moments: ~1e-3 relative per step, far below the update
        assert max_rel_err(a.detach(), b.detach()) <= 1e-3
