"""CUDA binding of :func:`ls_fairseq.ops.bias_act_dropout.bias_act_dropout`
(``csrc/dropout_fusions.cu``): ``dropout(act(x + bias))`` in one pass, act = relu or exact-erf gelu.

Ops: ``bias_act_dropout_fwd(x, bias, activation, p, train) -> (out, rng)`` and
``bias_act_dropout_bwd(grad, x, bias, rng, activation, p, train, bias_grad) -> (grad_x, grad_bias)``.
Backward keeps ``x`` (the GEMM output) and the int64[2] Philox state ``rng``; the mask is
regenerated, ``x + bias`` and the activation derivative recomputed.
"""
import torch

from .bias_act_dropout import KERNEL_ACTIVATIONS, bias_act_dropout_reference

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)


@torch.library.register_fake("ls_fairseq::bias_act_dropout_fwd")
def _fwd_fake(x, bias, activation, p, train):
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        x.new_empty((2,), dtype=torch.int64),
    )


@torch.library.register_fake("ls_fairseq::bias_act_dropout_bwd")
def _bwd_fake(grad, x, bias, rng, activation, p, train, bias_grad):
    return (
        torch.empty_like(grad, memory_format=torch.contiguous_format),
        grad.new_empty((grad.size(-1) if bias_grad else 0,)),
    )


def _setup_context(ctx, inputs, output):
    x, bias, activation, p, train = inputs
    _out, rng = output
    ctx.mark_non_differentiable(rng)
    ctx.save_for_backward(x, bias, rng)
    ctx.activation, ctx.p, ctx.train = activation, float(p), bool(train)


def _backward(ctx, grad_out, _grad_rng):
    x, bias, rng = ctx.saved_tensors
    need_x, need_b = ctx.needs_input_grad[:2]
    bias_grad = bool(need_b and bias is not None)
    if not (need_x or bias_grad):
        return None, None, None, None, None
    grad_x, grad_bias = torch.ops.ls_fairseq.bias_act_dropout_bwd(
        grad_out, x, bias, rng, ctx.activation, ctx.p, ctx.train, bias_grad
    )
    return (
        grad_x if need_x else None,
        grad_bias.view_as(bias) if bias_grad else None,
        None,
        None,
        None,
    )


torch.library.register_autograd(
    "ls_fairseq::bias_act_dropout_fwd", _backward, setup_context=_setup_context
)


def bias_act_dropout_cuda(x, bias, activation: str, dropout_p: float, training: bool):
    if (
        activation not in KERNEL_ACTIVATIONS
        or x.dtype not in _SUPPORTED
        or x.dim() == 0
        or x.size(-1) == 0
        or (bias is not None and (bias.dtype != x.dtype or bias.numel() != x.size(-1)))
    ):
        return bias_act_dropout_reference(x, bias, activation, dropout_p, training)
    out, _rng = torch.ops.ls_fairseq.bias_act_dropout_fwd(
        x, bias, activation, float(dropout_p), bool(training)
    )
    return out
