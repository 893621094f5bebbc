"""The Adam references that ``_adam_cuda`` itself needs: its multi-tensor call updates the tensors
the kernel cannot take (non-contiguous, other dtypes) with this math, in the same call. Public
through :mod:`ls_fairseq.ops.adam` (the op's math is documented there); kept here so that the
binding never imports the public module (ls_fairseq/ops/README.md).
"""
import math
from typing import List

import torch


def adam_step_reference(
    params: List[torch.Tensor],
    grads: List[torch.Tensor],
    exp_avgs: List[torch.Tensor],
    exp_avg_sqs: List[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
):
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr * math.sqrt(bias_correction2) / bias_correction1
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        g32 = g.float()
        if grad_scale != 1.0:
            g32 = g32 * grad_scale
        p32 = p.float()
        m32, v32 = m.float(), v.float()
        m32.mul_(beta1).add_(g32, alpha=1 - beta1)
        v32.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
        denom = v32.sqrt().add_(eps)
        if weight_decay != 0:
            p32.add_(p32, alpha=-weight_decay * lr)
        p32.addcdiv_(m32, denom, value=-step_size)
        p.copy_(p32)
        m.copy_(m32)
        v.copy_(v32)


def adam_step_skip_nonfinite_reference(
    params, grads, exp_avgs, exp_avg_sqs, *, model_copies=None, moment_scales=None,
    found_inf=None, grad_scale=1.0, **hyper,
):
    """Reference for the kernel's whole contract (``adam_step_cuda``): ``grad_scale`` may be a
    one-element tensor; an element whose scaled gradient is inf/NaN is left untouched and sets
    ``found_inf``; ``model_copies`` receive the updated values; fp16 moments with
    ``moment_scales`` [n, 2] are stored as ``true / scale`` (scales updated in place, fairseq's
    ``1e-8 + max|moment| / 65504`` rule)."""
    fp16_max = torch.finfo(torch.float16).max
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        g = g.float().reshape(p.shape) * grad_scale  # the kernel reads any same-size layout
        bad = ~torch.isfinite(g)
        if found_inf is not None:
            found_inf.copy_(torch.maximum(found_inf, bad.any().to(found_inf.dtype)))
        if moment_scales is not None:
            m32 = m.float() * moment_scales[i, 0]
            v32 = v.float() * moment_scales[i, 1]
        else:
            m32, v32 = m.float(), v.float()
        p32 = p.float()
        old = (p32.clone(), m32.clone(), v32.clone())
        adam_step_reference([p32], [g.masked_fill(bad, 0.0)], [m32], [v32], grad_scale=1.0,
                            **hyper)
        for new_t, old_t in zip((p32, m32, v32), old):  # untouched where the grad was not finite
            new_t.copy_(torch.where(bad, old_t, new_t))
        if moment_scales is not None:
            moment_scales[i, 0] = 1e-8 + m32.abs().max() / fp16_max
            moment_scales[i, 1] = 1e-8 + v32.abs().max() / fp16_max
            m32 = m32 / moment_scales[i, 0]
            v32 = v32 / moment_scales[i, 1]
        p.copy_(p32)
        m.copy_(m32)
        v.copy_(v32)
        if model_copies is not None:
            model_copies[i].copy_(p32)
