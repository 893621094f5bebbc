"""CUDA binding of :func:`ls_fairseq.ops.bias_act_dropout.bias_act_dropout`
(``csrc/dropout_fusions.cu``): ``dropout(act(x + bias))`` in one pass, act = relu or exact-erf gelu.

Ops: ``bias_act_dropout_fwd(x, bias, activation, p, train) -> (out, rng)``,
``bias_act_dropout_bwd(grad, x, bias, rng, activation, p, train, bias_grad) -> (grad_x, grad_bias)``
and ``relu_dropout_bwd(grad, out, p, train, bias_grad) -> (grad_x, grad_bias)``.

What the backward keeps: for relu, ``out`` only (an element passes the gradient exactly when
``out > 0``: kept by dropout and relu active). ``out`` is the tensor fc2 saves for its weight
gradient anyway, so the fc1 output ``x`` is freed after the forward: one [tokens, ffn_dim] tensor
less per layer at the memory peak. For gelu, ``x`` and the int64[2] Philox state ``rng``; the mask
is regenerated, ``x + bias`` and the activation derivative recomputed.
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


@torch.library.register_fake("ls_fairseq::relu_dropout_bwd")
def _relu_bwd_fake(grad, out, p, train, bias_grad):
    return _bwd_fake(grad, out, None, None, "relu", p, train, bias_grad)


def _setup_context(ctx, inputs, output):
    x, bias, activation, p, train = inputs
    out, rng = output
    ctx.mark_non_differentiable(rng)
    ctx.bias_shape = bias.shape if bias is not None else None  # None: no bias
    if activation == "relu":
        ctx.save_for_backward(out)
    else:
        ctx.save_for_backward(x, bias, rng)
    ctx.activation, ctx.p, ctx.train = activation, float(p), bool(train)


def _backward(ctx, grad_out, _grad_rng):
    need_x, need_b = ctx.needs_input_grad[:2]
    bias_grad = bool(need_b and ctx.bias_shape is not None)
    if not (need_x or bias_grad):
        return None, None, None, None, None
    if ctx.activation == "relu":
        (out,) = ctx.saved_tensors
        grad_x, grad_bias = torch.ops.ls_fairseq.relu_dropout_bwd(
            grad_out, out, ctx.p, ctx.train, bias_grad
        )
    else:
        x, bias, rng = ctx.saved_tensors
        grad_x, grad_bias = torch.ops.ls_fairseq.bias_act_dropout_bwd(
            grad_out, x, bias, rng, ctx.activation, ctx.p, ctx.train, bias_grad
        )
    return (
        grad_x if need_x else None,
        grad_bias.view(ctx.bias_shape) if bias_grad else None,
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
