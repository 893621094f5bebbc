"""CUDA binding of :func:`ls_fairseq.ops.layer_norm.layer_norm` (``csrc/layer_norm.cu``).

Ops: ``torch.ops.ls_fairseq.layer_norm_fwd(x, weight, bias, eps, invertible) -> (y, mean, rstd)``,
``layer_norm_bwd(grad, saved, weight, bias, mean, rstd, invertible, weight_grad, bias_grad,
residual_grad=None) -> (dx, dw, db)`` (``dw``/``db`` are empty when not asked for) and
``layer_norm_residual(x, weight, bias, eps) -> (y, residual)``. The autograd is C++
(``csrc/layer_norm_autograd.cpp``: it costs less host time per call than a Python registration,
and LayerNorm runs dozens of times per training step);
fake-tensor shapes of ``layer_norm_fwd``/``_bwd`` are registered here with
``torch.library.register_fake`` once the extension is loaded (``_extension.when_loaded``).
``layer_norm_residual`` is CompositeImplicitAutograd over them, so it has no fake of its own.

``layer_norm_residual_cuda(x, ...) -> (y, residual)`` is the pre-LN block's entry: ``residual`` is
``x`` (a view of it), and the gradient arriving there is added to LayerNorm's input gradient inside
``layer_norm_bwd``'s pass (its ``residual_grad``) instead of by a separate autograd add.

``invertible=True`` saves the output ``y`` (and ``rstd``) for backward instead of the input ``x``,
so a caller that keeps ``y`` anyway (the next sublayer's input) lets ``x`` be freed; backward then
rebuilds ``xhat = (y - bias) / weight``. It needs a weight without zero entries, and in fp16/bf16
its gradient carries the rounding of ``y`` (relative ~1e-3 / ~8e-3). The default saves ``x``.

What the kernels take is :func:`supports`; the public module runs the reference otherwise.
"""
import torch

from . import _extension


def supports(x) -> bool:
    """Whether the kernels take ``x`` [..., C]: float16/bfloat16/float32 with C > 0 (any strides,
    any number of rows; the affine parameters are cast to x's dtype)."""
    return _extension.rows_fit(x)


def _register():
    @torch.library.register_fake("ls_fairseq::layer_norm_fwd")
    def _fwd_fake(x, weight, bias, eps, invertible=False):
        rows = x.numel() // x.size(-1)
        stats = x.new_empty((rows,), dtype=torch.float32)
        return (torch.empty_like(x, memory_format=torch.contiguous_format), stats,
                stats.new_empty((rows,)))

    @torch.library.register_fake("ls_fairseq::layer_norm_bwd")
    def _bwd_fake(grad, saved, weight, bias, mean, rstd, invertible, weight_grad, bias_grad,
                  residual_grad=None):
        c = grad.size(-1)
        return (
            torch.empty_like(grad, memory_format=torch.contiguous_format),
            grad.new_empty((c if weight_grad else 0,)),
            grad.new_empty((c if bias_grad else 0,)),
        )


_extension.when_loaded(_register)


def _affine_like(x, weight, bias):
    if weight is not None and weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return weight, bias


def layer_norm_residual_cuda(x, weight, bias, eps: float = 1e-5):
    """``(layer_norm(x), x)``; the residual's gradient is added inside LayerNorm's backward.
    For inputs :func:`supports` takes."""
    weight, bias = _affine_like(x, weight, bias)
    return torch.ops.ls_fairseq.layer_norm_residual(x, weight, bias, float(eps))


def layer_norm_cuda(x, weight, bias, eps: float = 1e-5, invertible: bool = False):
    """Fused LayerNorm over the last dim; same result as ``layer_norm_reference``. For inputs
    :func:`supports` takes."""
    weight, bias = _affine_like(x, weight, bias)
    y, _mean, _rstd = torch.ops.ls_fairseq.layer_norm_fwd(x, weight, bias, float(eps), bool(invertible))
    return y
