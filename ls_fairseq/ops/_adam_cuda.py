"""CUDA binding of the fused multi-tensor Adam step (``csrc/adam.cu``).

``adam_step_cuda`` has the signature of ``adam_step_reference`` (``ops/_reference.py``, public as
:func:`ls_fairseq.ops.adam.adam_step_reference`) plus a few keyword extensions, all optional:

* ``grad_scale`` may be a Python number or a one-element CUDA tensor (fairseq's fp16 wrappers
  keep their multiply factor on the device after ``--clip-norm``; no host sync is needed).
* ``model_copies``: one fp16/bf16 tensor per param; the updated fp32 master value is written
  into it in the same launch (fairseq ``--fp16``: master -> model copy without the per-tensor
  copy loop). ``params``/``exp_avgs``/``exp_avg_sqs`` may be views into fairseq's flat fp32
  buffers and ``grads`` the model's own fp16 grads.
* ``moment_scales``: a float32 CUDA tensor ``[n, 2]`` (column 0 scales ``exp_avgs``, column 1
  ``exp_avg_sqs``) for fp16 moments stored as ``true / scale`` (fairseq's ``--fp16-adam-stats``
  rule: after the step ``scale = 1e-8 + max|moment| / 65504``). Updated in place. This variant
  runs a statistics pass (new moment maxima) before the update pass: two launches. With
  ``shared_moment_scale`` all rows are one state tensor cut into views (fairseq's flat fp32
  master): the maximum, and so the new scale, is taken over all of them.

All tensors of one dtype combination are updated by one kernel launch, whatever their number and
sizes. Returns ``found_inf``, an int32 CUDA tensor that is 1 when some scaled gradient was inf/NaN;
such elements are left untouched (no NaN is written into the optimizer state or the weights).

Unlike the other bindings this one has no ``supports`` predicate: one call takes any list of CUDA
tensors and updates those the kernel cannot take (non-contiguous, other dtypes) with the
reference math (``_reference.adam_step_skip_nonfinite_reference``) in the same call, so that the
caller never splits its one-launch list. The ops mutate their arguments and return nothing;
their fake (meta) implementations are registered here once the extension is loaded
(``_extension.when_loaded``), for ``torch.library.opcheck`` and tracing.
"""
import math
from typing import List, Optional, Sequence

import torch

from . import _extension
from ._reference import adam_step_skip_nonfinite_reference

FP16_MAX = 65504.0
_SUPPORTED = {
    (torch.float32, torch.float32), (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
    (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
}


def _register():
    @torch.library.register_fake("ls_fairseq::multi_tensor_adam")
    def _adam_fake(params, grads, exp_avgs, exp_avg_sqs, model_copies, grad_scale_t, m_scales,
                   v_scales, found_inf, lr, beta1, beta2, eps, weight_decay, step_size,
                   grad_scale):
        return None

    @torch.library.register_fake("ls_fairseq::multi_tensor_adam_moment_max")
    def _moment_max_fake(params, grads, exp_avgs, exp_avg_sqs, grad_scale_t, m_scales, v_scales,
                         found_inf, moment_max, beta1, beta2, grad_scale):
        return None


_extension.when_loaded(_register)


def _scale_tensor(grad_scale, device):
    if torch.is_tensor(grad_scale):
        t = grad_scale.detach().to(device=device, dtype=torch.float32).reshape(1)
        return 1.0, t
    return float(grad_scale), None


def adam_step_cuda(
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
    grad_scale=1.0,
    model_copies: Optional[Sequence[torch.Tensor]] = None,
    moment_scales: Optional[torch.Tensor] = None,
    shared_moment_scale: bool = False,
    found_inf: Optional[torch.Tensor] = None,
):
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ValueError("adam_step: params, grads, exp_avgs and exp_avg_sqs differ in length")
    if model_copies is not None and len(model_copies) != n:
        raise ValueError("adam_step: model_copies must have one tensor per param")
    if n == 0:
        return found_inf
    device = params[0].device
    if found_inf is None:
        found_inf = torch.zeros(1, dtype=torch.int32, device=device)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr * math.sqrt(bias_correction2) / bias_correction1
    scale_f, scale_t = _scale_tensor(grad_scale, device)

    if moment_scales is None:
        # Fast path (the usual case: one dtype combination, contiguous tensors): no per-tensor
        # Python work, the C++ op checks every tensor before it launches anything and raises
        # without having modified anything otherwise.
        try:
            torch.ops.ls_fairseq.multi_tensor_adam(
                params, grads, exp_avgs, exp_avg_sqs,
                [] if model_copies is None else model_copies, scale_t, None, None, found_inf,
                float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
                float(step_size), scale_f)
            return found_inf
        except RuntimeError:
            pass  # mixed dtypes or non-contiguous tensors: grouped below

    # One launch per dtype combination (normally exactly one). Non-contiguous state or params
    # (never seen in fairseq) go through the reference math tensor by tensor.
    groups = {}
    for i in range(n):
        p, g, m, v = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]
        if p.numel() == 0:
            continue
        contiguous = p.is_contiguous() and m.is_contiguous() and v.is_contiguous() and (
            model_copies is None or model_copies[i].is_contiguous())
        key = (p.dtype, g.dtype, m.dtype, v.dtype,
               None if model_copies is None else model_copies[i].dtype)
        if not contiguous or (p.dtype, g.dtype) not in _SUPPORTED or m.dtype != v.dtype or \
                m.dtype not in (torch.float32, torch.float16) or moment_scales is not None and \
                m.dtype != torch.float16:
            key = "fallback"
        groups.setdefault(key, []).append(i)

    if shared_moment_scale and (len(groups) > 1 or "fallback" in groups):
        raise ValueError("adam_step: shared_moment_scale needs contiguous tensors of one "
                         "supported dtype combination")
    for key, idx in groups.items():
        if key == "fallback":
            _fallback(params, grads, exp_avgs, exp_avg_sqs, idx, model_copies, moment_scales,
                      lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                      step=step, grad_scale=grad_scale, found_inf=found_inf)
            continue
        ps = [params[i] for i in idx]
        gs = [grads[i] if grads[i].is_contiguous() else grads[i].contiguous() for i in idx]
        ms = [exp_avgs[i] for i in idx]
        vs = [exp_avg_sqs[i] for i in idx]
        outs = [] if model_copies is None else [model_copies[i] for i in idx]
        m_sc = v_sc = None
        if moment_scales is not None:
            sel = moment_scales if len(idx) == n else moment_scales[idx]
            m_sc = torch.empty(len(idx), 2, dtype=torch.float32, device=device)
            v_sc = torch.empty_like(m_sc)
            m_sc[:, 0] = sel[:, 0]
            v_sc[:, 0] = sel[:, 1]
            maxima = torch.zeros(len(idx), 2, dtype=torch.float32, device=device)
            torch.ops.ls_fairseq.multi_tensor_adam_moment_max(
                ps, gs, ms, vs, scale_t, m_sc, v_sc, found_inf, maxima, beta1, beta2, scale_f)
            if shared_moment_scale:
                maxima = maxima.amax(0, keepdim=True).expand(len(idx), 2)
            new = maxima / FP16_MAX + 1e-8  # fairseq FusedAdamV1's rule
            m_sc[:, 1] = new[:, 0]
            v_sc[:, 1] = new[:, 1]
        torch.ops.ls_fairseq.multi_tensor_adam(
            ps, gs, ms, vs, outs, scale_t, m_sc, v_sc, found_inf,
            float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
            float(step_size), scale_f)
        if moment_scales is not None:
            if len(idx) == n:
                moment_scales.copy_(new)
            else:
                moment_scales[idx] = new
    return found_inf


def _fallback(params, grads, exp_avgs, exp_avg_sqs, idx, model_copies, moment_scales, **kw):
    """Reference math for tensors the kernel does not take (non-contiguous, odd dtypes)."""
    pick = (lambda ts: None if ts is None else [ts[i] for i in idx])
    scales = None if moment_scales is None else moment_scales[idx]
    adam_step_skip_nonfinite_reference(pick(params), pick(grads), pick(exp_avgs),
                                       pick(exp_avg_sqs), model_copies=pick(model_copies),
                                       moment_scales=scales, **kw)
    if moment_scales is not None:
        moment_scales[idx] = scales
