"""CUDA binding of :func:`ls_fairseq.ops.bias_dropout_residual.bias_dropout_residual`
(``csrc/dropout_fusions.cu``): ``residual + dropout(x + bias)`` in one pass.

Ops: ``bias_dropout_residual_fwd(x, bias, residual, p, train) -> (out, rng)`` and
``bias_dropout_residual_bwd(grad, rng, p, train, bias_grad) -> (grad_x, grad_bias)``. ``rng`` is an
int64[2] CUDA tensor (Philox seed, offset drawn from torch's CUDA generator): the backward
regenerates the dropout mask from it, so nothing per element is saved for backward. The forward
op's autograd is C++ (``csrc/dropout_fusions_autograd.cpp``); fake-tensor shapes are registered here
once the extension is loaded (``_extension.when_loaded``). What the kernels take is
:func:`supports`; the public module runs the reference otherwise.
"""
import torch

from . import _extension



def supports(x, bias, residual) -> bool:
    """Whether the kernels take these tensors: x [..., C] float16/bfloat16/float32 with C > 0,
    residual of x's shape and dtype, bias None or C values of x's dtype (any strides)."""
    return (_extension.rows_fit(x, bias) and residual.shape == x.shape
            and residual.dtype == x.dtype)


def _register():
    @torch.library.register_fake("ls_fairseq::bias_dropout_residual_fwd")
    def _fwd_fake(x, bias, residual, p, train):
        return (
            torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((2,), dtype=torch.int64),
        )

    @torch.library.register_fake("ls_fairseq::bias_dropout_residual_bwd")
    def _bwd_fake(grad, rng, p, train, bias_grad):
        return (
            torch.empty_like(grad, memory_format=torch.contiguous_format),
            grad.new_empty((grad.size(-1) if bias_grad else 0,)),
        )


_extension.when_loaded(_register)


def bias_dropout_residual_cuda(x, bias, residual, dropout_p: float, training: bool):
    """``residual + dropout(x + bias)`` in one kernel; for inputs :func:`supports` takes."""
    out, _rng = torch.ops.ls_fairseq.bias_dropout_residual_fwd(
        x, bias, residual, float(dropout_p), bool(training)
    )
    return out
