"""One Adam step over many tensors, fairseq ``adam`` semantics (AdamW-style decoupled decay).

Per element, in fp32 whatever the storage dtype of ``p``/``g``/moments::

    g      = g * grad_scale
    m      = beta1 * m + (1 - beta1) * g
    v      = beta2 * v + (1 - beta2) * g * g
    p      = p - weight_decay * lr * p                      (decay uses lr, not the step size)
    p      = p - lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps)

``grad_scale`` lets fp16 wrappers fold the loss-scale division into the step.
"""
import math
from typing import List

import torch

from . import _extension


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


def adam_step(params, grads, exp_avgs, exp_avg_sqs, **kwargs):
    if _extension.use_kernels(*params) and _extension.has_op("multi_tensor_adam"):
        from ._adam_cuda import adam_step_cuda

        return adam_step_cuda(params, grads, exp_avgs, exp_avg_sqs, **kwargs)
    return adam_step_reference(params, grads, exp_avgs, exp_avg_sqs, **kwargs)


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
