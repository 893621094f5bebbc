"""One Adam step over many tensors, fairseq ``adam`` semantics (AdamW-style decoupled decay).

Per element, in fp32 whatever the storage dtype of ``p``/``g``/moments::

    g      = g * grad_scale
    m      = beta1 * m + (1 - beta1) * g
    v      = beta2 * v + (1 - beta2) * g * g
    p      = p - weight_decay * lr * p                      (decay uses lr, not the step size)
    p      = p - lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps)

``grad_scale`` lets fp16 wrappers fold the loss-scale division into the step.
"""
from . import _extension
from ._reference import adam_step_reference, adam_step_skip_nonfinite_reference

__all__ = ["adam_step", "adam_step_cuda", "adam_step_reference",
           "adam_step_skip_nonfinite_reference"]


def adam_step(params, grads, exp_avgs, exp_avg_sqs, **kwargs):
    if _extension.use_kernels(*params) and _extension.has_op("multi_tensor_adam"):
        from ._adam_cuda import adam_step_cuda as kernel

        return kernel(params, grads, exp_avgs, exp_avg_sqs, **kwargs)
    return adam_step_reference(params, grads, exp_avgs, exp_avg_sqs, **kwargs)


def adam_step_cuda(params, grads, exp_avgs, exp_avg_sqs, **kwargs):
    """The kernel path with its whole contract (``grad_scale`` as a device tensor,
    ``model_copies``, ``moment_scales``, ``shared_moment_scale``, ``found_inf``; see
    ``_adam_cuda.adam_step_cuda``), for callers that checked the kernels are there
    (``_extension.use_kernels`` and ``has_op("multi_tensor_adam")``): the fp16 optimizer and
    bench. Its reference is :func:`adam_step_skip_nonfinite_reference`."""
    from ._adam_cuda import adam_step_cuda as kernel

    return kernel(params, grads, exp_avgs, exp_avg_sqs, **kwargs)
