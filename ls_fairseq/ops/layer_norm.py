"""LayerNorm over the last dimension, fairseq's eps (1e-5), fp32 statistics."""
import torch
import torch.nn.functional as F

from . import _extension


def layer_norm_reference(x, weight, bias, eps: float = 1e-5):
    return F.layer_norm(x, (x.size(-1),), weight, bias, eps)


def layer_norm(x, weight, bias, eps: float = 1e-5):
    if _extension.use_kernels(x) and _extension.has_op("layer_norm_fwd"):
        from . import _layer_norm_cuda as cuda

        if cuda.supports(x):
            return cuda.layer_norm_cuda(x, weight, bias, eps)
    return layer_norm_reference(x, weight, bias, eps)


def layer_norm_residual_reference(x, weight, bias, eps: float = 1e-5):
    return layer_norm_reference(x, weight, bias, eps), x


def layer_norm_residual(x, weight, bias, eps: float = 1e-5):
    """``(layer_norm(x), x)`` for a pre-LN block, whose residual branch also reads ``x``. Same
    values and gradients as the reference; the CUDA path adds the residual branch's gradient of
    ``x`` inside LayerNorm's backward kernel (one pass instead of a kernel plus an add)."""
    if _extension.use_kernels(x) and _extension.has_op("layer_norm_fwd"):
        from . import _layer_norm_cuda as cuda

        if cuda.supports(x):
            return cuda.layer_norm_residual_cuda(x, weight, bias, eps)
    return layer_norm_residual_reference(x, weight, bias, eps)


def layer_norm_cuda(x, weight, bias, eps: float = 1e-5, invertible: bool = False):
    """The kernel path itself (``_layer_norm_cuda.layer_norm_cuda``, with its ``invertible``
    mode), for callers that must run the kernels (bench); the extension must be loaded and
    ``_layer_norm_cuda.supports(x)`` hold."""
    from ._layer_norm_cuda import layer_norm_cuda as kernel

    return kernel(x, weight, bias, eps, invertible)
