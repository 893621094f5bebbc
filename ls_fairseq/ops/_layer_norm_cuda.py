"""CUDA binding of :func:`ls_fairseq.ops.layer_norm.layer_norm` (``csrc/layer_norm.cu``).

Ops: ``torch.ops.ls_fairseq.layer_norm_fwd(x, weight, bias, eps, invertible) -> (y, mean, rstd)``
and ``layer_norm_bwd(grad, saved, weight, bias, mean, rstd, invertible, weight_grad, bias_grad)
-> (dx, dw, db)`` (``dw``/``db`` are empty when not asked for). ``layer_norm_fwd``'s autograd is
C++ (``csrc/layer_norm_autograd.cpp``: a Python registration cost ~50 us of host time per call);
fake-tensor shapes are registered here with ``torch.library.register_fake``.

``layer_norm_residual_cuda(x, ...) -> (y, residual)`` is the pre-LN block's entry: ``residual`` is
``x`` (a view of it), and the gradient arriving there is added to LayerNorm's input gradient inside
``layer_norm_bwd``'s pass (its ``residual_grad``) instead of by a separate autograd add.

``bias_dropout_residual_layer_norm_fwd(y, bias, residual, weight, ln_bias, p, train, eps) -> (x,
h, mean, rstd, rng)`` fuses a pre-LN sublayer boundary: ``x = residual + dropout(y + bias)`` and
``h = LayerNorm(x)`` in one kernel; its C++ autograd runs, with dropout,
``bias_dropout_residual_layer_norm_bwd(grad_h, x, weight, ln_bias, mean, rstd, grad_x, rng, p,
train, weight_grad, ln_bias_grad, bias_grad) -> (dx, gy, dw, dlb, dbias)`` (one pass: LayerNorm's
backward plus y's gradient through the mask), else ``layer_norm_bwd`` then
``bias_dropout_residual_bwd``.

``invertible=True`` saves the output ``y`` (and ``rstd``) for backward instead of the input ``x``,
so a caller that keeps ``y`` anyway (the next sublayer's input) lets ``x`` be freed; backward then
rebuilds ``xhat = (y - bias) / weight``. It needs a weight without zero entries, and in fp16/bf16
its gradient carries the rounding of ``y`` (relative ~1e-3 / ~8e-3). The default saves ``x``.
"""
import torch

from .layer_norm import layer_norm_reference

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)


@torch.library.register_fake("ls_fairseq::layer_norm_fwd")
def _fwd_fake(x, weight, bias, eps, invertible=False):
    rows = x.numel() // x.size(-1)
    stats = x.new_empty((rows,), dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, stats.new_empty((rows,))


@torch.library.register_fake("ls_fairseq::layer_norm_bwd")
def _bwd_fake(grad, saved, weight, bias, mean, rstd, invertible, weight_grad, bias_grad,
              residual_grad=None):
    c = grad.size(-1)
    return (
        torch.empty_like(grad, memory_format=torch.contiguous_format),
        grad.new_empty((c if weight_grad else 0,)),
        grad.new_empty((c if bias_grad else 0,)),
    )


@torch.library.register_fake("ls_fairseq::bias_dropout_residual_layer_norm_fwd")
def _bdr_ln_fake(y, bias, residual, weight, ln_bias, p, train, eps):
    rows = y.numel() // y.size(-1)
    stats = y.new_empty((rows,), dtype=torch.float32)
    return (torch.empty_like(y, memory_format=torch.contiguous_format),
            torch.empty_like(y, memory_format=torch.contiguous_format), stats,
            stats.new_empty((rows,)), y.new_empty((2,), dtype=torch.int64))


@torch.library.register_fake("ls_fairseq::bias_dropout_residual_layer_norm_bwd")
def _bdr_ln_bwd_fake(grad, x, weight, ln_bias, mean, rstd, grad_x, rng, p, train, weight_grad,
                     ln_bias_grad, bias_grad):
    c = grad.size(-1)
    return (torch.empty_like(grad, memory_format=torch.contiguous_format),
            torch.empty_like(grad, memory_format=torch.contiguous_format),
            grad.new_empty((c if weight_grad else 0,)), grad.new_empty((c if ln_bias_grad else 0,)),
            grad.new_empty((c if bias_grad else 0,)))


def _input_grads(ctx, grad_y, residual_grad=None):
    """(dx, dw, db) for the inputs that need them (None for the others), from ``layer_norm_bwd``
    on the saved input (not invertible); ``residual_grad`` is added to dx in the same pass."""
    saved, weight, bias, mean, rstd = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    weight_grad = bool(need_w and weight is not None)
    bias_grad = bool(need_b and bias is not None)
    dx, dw, db = torch.ops.ls_fairseq.layer_norm_bwd(
        grad_y, saved, weight, bias, mean, rstd, False, weight_grad, bias_grad,
        residual_grad if need_x else None,
    )
    return (
        dx if need_x else None,
        dw.view_as(weight) if weight_grad else None,
        db.view_as(bias) if bias_grad else None,
    )


def _affine_like(x, weight, bias):
    if weight is not None and weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return weight, bias


class _LayerNormKeepInput(torch.autograd.Function):
    """(LayerNorm(x), x): the second output is ``x`` itself (autograd returns it as a view with
    this node as its grad_fn), so both gradients of ``x`` meet in this backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        ctx.set_materialize_grads(False)
        y, mean, rstd = torch.ops.ls_fairseq.layer_norm_fwd(x, weight, bias, eps, False)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y, x

    @staticmethod
    def backward(ctx, grad_y, grad_residual):
        if grad_y is None:
            return grad_residual, None, None, None
        return _input_grads(ctx, grad_y, grad_residual) + (None,)


def layer_norm_residual_cuda(x, weight, bias, eps: float = 1e-5):
    """``(layer_norm(x), x)``; the residual's gradient is added inside LayerNorm's backward."""
    if x.dtype not in _SUPPORTED or x.dim() == 0 or x.size(-1) == 0:
        return layer_norm_reference(x, weight, bias, eps), x
    weight, bias = _affine_like(x, weight, bias)
    return _LayerNormKeepInput.apply(x, weight, bias, float(eps))


def layer_norm_cuda(x, weight, bias, eps: float = 1e-5, invertible: bool = False):
    """Fused LayerNorm over the last dim; same result as ``layer_norm_reference``."""
    if x.dtype not in _SUPPORTED or x.dim() == 0 or x.size(-1) == 0:
        return layer_norm_reference(x, weight, bias, eps)
    weight, bias = _affine_like(x, weight, bias)
    y, _mean, _rstd = torch.ops.ls_fairseq.layer_norm_fwd(x, weight, bias, float(eps), bool(invertible))
    return y


def fused_boundary_fits(y, bias, residual, weight, ln_bias) -> bool:
    """Whether ``bias_dropout_residual_layer_norm_fwd`` takes these tensors: one warp per row in
    16-byte vectors (C a multiple of 8 and at most 2048 for fp16/bf16; 4 and 1024 for fp32),
    contiguous and 16-byte aligned, affine parameters of y's dtype and size."""
    if y.dtype not in _SUPPORTED or y.dim() == 0 or residual.shape != y.shape:
        return False
    c, vec = y.size(-1), 16 // y.element_size()
    tensors = [t for t in (y, bias, residual, weight, ln_bias) if t is not None]
    return (
        c > 0 and c % vec == 0 and c // vec <= 256
        and all(t.dtype == y.dtype and t.is_contiguous() and t.data_ptr() % 16 == 0
                for t in tensors)
        and all(t.numel() == c for t in (bias, weight, ln_bias) if t is not None)
    )


def bias_dropout_residual_layer_norm_cuda(y, bias, residual, weight, ln_bias, dropout_p: float,
                                          training: bool, eps: float = 1e-5):
    """(x, LayerNorm(x)) with x = residual + dropout(y + bias), one kernel (see the op's doc)."""
    x, h, _mean, _rstd, _rng = torch.ops.ls_fairseq.bias_dropout_residual_layer_norm_fwd(
        y, bias, residual, weight, ln_bias, float(dropout_p), bool(training), float(eps)
    )
    return x, h
