"""CUDA binding of :func:`ls_fairseq.ops.bias_dropout_residual_layer_norm.bias_dropout_residual_layer_norm`
(``csrc/bias_dropout_residual_layer_norm.cu``): a pre-LN sublayer boundary in one kernel.

``bias_dropout_residual_layer_norm_fwd(y, bias, residual, weight, ln_bias, p, train, eps) -> (x,
h, mean, rstd, rng)``: ``x = residual + dropout(y + bias)`` (the values and Philox mask of
``bias_dropout_residual_fwd``) and ``h = LayerNorm(x)`` of the stored x, one warp per row. Its
autograd is C++ (``csrc/bias_dropout_residual_layer_norm_autograd.cpp``): with dropout it runs
``bias_dropout_residual_layer_norm_bwd(grad_h, x, weight, ln_bias, mean, rstd, grad_x, rng, p,
train, weight_grad, ln_bias_grad, bias_grad) -> (dx, gy, dw, dlb, dbias)`` (one pass: LayerNorm's
backward plus y's gradient through the mask), else ``layer_norm_bwd`` then
``bias_dropout_residual_bwd``. Fake-tensor shapes are registered here once the extension is
loaded (``_extension.when_loaded``).

What the kernel takes is :func:`supports`; the public module runs the unfused pair otherwise.
"""
import torch

from . import _extension



def supports(y, bias, residual, weight, ln_bias) -> bool:
    """Whether ``bias_dropout_residual_layer_norm_fwd`` takes these tensors: one warp per row in
    16-byte vectors (C a multiple of 8 and at most 2048 for fp16/bf16; 4 and 1024 for fp32),
    contiguous and 16-byte aligned, affine parameters of y's dtype and size."""
    if y.dtype not in _extension.KERNEL_DTYPES or y.dim() == 0 or residual.shape != y.shape:
        return False
    c, vec = y.size(-1), 16 // y.element_size()
    tensors = [t for t in (y, bias, residual, weight, ln_bias) if t is not None]
    return (
        c > 0 and c % vec == 0 and c // vec <= 256
        and all(t.dtype == y.dtype and t.is_contiguous() and t.data_ptr() % 16 == 0
                for t in tensors)
        and all(t.numel() == c for t in (bias, weight, ln_bias) if t is not None)
    )



def _register():
    @torch.library.register_fake("ls_fairseq::bias_dropout_residual_layer_norm_fwd")
    def _fwd_fake(y, bias, residual, weight, ln_bias, p, train, eps):
        rows = y.numel() // y.size(-1)
        stats = y.new_empty((rows,), dtype=torch.float32)
        return (torch.empty_like(y, memory_format=torch.contiguous_format),
                torch.empty_like(y, memory_format=torch.contiguous_format), stats,
                stats.new_empty((rows,)), y.new_empty((2,), dtype=torch.int64))

    @torch.library.register_fake("ls_fairseq::bias_dropout_residual_layer_norm_bwd")
    def _bwd_fake(grad, x, weight, ln_bias, mean, rstd, grad_x, rng, p, train, weight_grad,
                  ln_bias_grad, bias_grad):
        c = grad.size(-1)
        return (torch.empty_like(grad, memory_format=torch.contiguous_format),
                torch.empty_like(grad, memory_format=torch.contiguous_format),
                grad.new_empty((c if weight_grad else 0,)),
                grad.new_empty((c if ln_bias_grad else 0,)),
                grad.new_empty((c if bias_grad else 0,)))


_extension.when_loaded(_register)


def bias_dropout_residual_layer_norm_cuda(y, bias, residual, weight, ln_bias, dropout_p: float,
                                          training: bool, eps: float = 1e-5):
    """(x, LayerNorm(x)) with x = residual + dropout(y + bias), one kernel; for inputs
    :func:`supports` takes."""
    x, h, _mean, _rstd, _rng = torch.ops.ls_fairseq.bias_dropout_residual_layer_norm_fwd(
        y, bias, residual, weight, ln_bias, float(dropout_p), bool(training), float(eps)
    )
    return x, h
