"""CUDA binding of :func:`ls_fairseq.ops.embedding.transformer_embedding` (``csrc/embedding.cu``).

Ops: ``embedding_fwd(tokens, positions, token_weight, pos_weight, scale, padding_idx, p, train,
zero_pad) -> (out, rng)`` and ``embedding_bwd(grad, tokens, positions, token_weight, pos_weight,
rng, scale, padding_idx, p, train, zero_pad, token_grad, pos_grad, deterministic) ->
(grad_token_weight, grad_pos_weight)`` (empty when not asked for).

The backward accumulates rows of repeated tokens/positions with float atomics by default. It is
deterministic (stable sort of the indices, one fixed-order float32 sum per distinct index) when
``torch.use_deterministic_algorithms(True)`` is on or ``LS_FAIRSEQ_DETERMINISTIC=1`` is set; the
choice is read at backward time.

The autograd (``torch.library.register_autograd``) and fake-tensor shapes are registered here once
the extension is loaded (``_extension.when_loaded``). What the kernels take is :func:`supports`;
the public module runs the reference otherwise.
"""
import os

import torch

from . import _extension

DETERMINISTIC_ENV = "LS_FAIRSEQ_DETERMINISTIC"


def supports(tokens, positions, token_weight, pos_weight) -> bool:
    """Whether the kernels take these arguments: a float16/bfloat16/float32 table [V, C] with
    C > 0, int64/int32 tokens, and positions whenever there is a 2-D positional table (cast to
    the token table's dtype)."""
    return not (
        token_weight.dtype not in _extension.KERNEL_DTYPES
        or token_weight.dim() != 2
        or token_weight.size(1) == 0
        or tokens.dtype not in (torch.int64, torch.int32)
        or (pos_weight is not None and (positions is None or pos_weight.dim() != 2))
    )


def deterministic_backward() -> bool:
    flag = os.environ.get(DETERMINISTIC_ENV, "0").strip().lower() in ("1", "true", "yes", "on")
    return flag or torch.are_deterministic_algorithms_enabled()


def _setup_context(ctx, inputs, output):
    tokens, positions, token_weight, pos_weight, scale, padding_idx, p, train, zero_pad = inputs
    _out, rng = output
    ctx.mark_non_differentiable(rng)
    ctx.save_for_backward(tokens, positions, token_weight, pos_weight, rng)
    ctx.args = (float(scale), int(padding_idx), float(p), bool(train), bool(zero_pad))


def _backward(ctx, grad_out, _grad_rng):
    tokens, positions, token_weight, pos_weight, rng = ctx.saved_tensors
    need = ctx.needs_input_grad
    token_grad = bool(need[2])
    pos_grad = bool(need[3] and pos_weight is not None)
    ge = gp = None
    if token_grad or pos_grad:
        scale, padding_idx, p, train, zero_pad = ctx.args
        ge, gp = torch.ops.ls_fairseq.embedding_bwd(
            grad_out, tokens, positions, token_weight, pos_weight, rng, scale, padding_idx, p,
            train, zero_pad, token_grad, pos_grad, deterministic_backward(),
        )
    return (
        None,
        None,
        ge if token_grad else None,
        gp if pos_grad else None,
        None, None, None, None, None,
    )


def _register():
    @torch.library.register_fake("ls_fairseq::embedding_fwd")
    def _fwd_fake(tokens, positions, token_weight, pos_weight, scale, padding_idx, p, train,
                  zero_pad):
        out = token_weight.new_empty((*tokens.shape, token_weight.size(1)))
        return out, token_weight.new_empty((2,), dtype=torch.int64)

    @torch.library.register_fake("ls_fairseq::embedding_bwd")
    def _bwd_fake(grad, tokens, positions, token_weight, pos_weight, rng, scale, padding_idx, p,
                  train, zero_pad, token_grad, pos_grad, deterministic):
        ge = token_weight.new_empty(token_weight.shape if token_grad else (0,))
        gp = token_weight.new_empty(pos_weight.shape if pos_grad else (0,))
        return ge, gp

    torch.library.register_autograd("ls_fairseq::embedding_fwd", _backward,
                                    setup_context=_setup_context)


_extension.when_loaded(_register)


def transformer_embedding_cuda(tokens, positions, token_weight, pos_weight, scale: float,
                               padding_idx: int, dropout_p: float, training: bool, zero_pad: bool):
    """The embedding in one kernel (one for the backward); for arguments :func:`supports`
    takes."""
    tokens = tokens.long()
    if pos_weight is None:
        positions = None
    else:
        positions = positions.long()
        if pos_weight.dtype != token_weight.dtype:
            pos_weight = pos_weight.to(token_weight.dtype)
    out, _rng = torch.ops.ls_fairseq.embedding_fwd(
        tokens, positions, token_weight, pos_weight, float(scale), int(padding_idx),
        float(dropout_p), bool(training), bool(zero_pad),
    )
    return out
