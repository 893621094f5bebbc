"""``residual + dropout(x + bias)``: the tail of every attention and FFN sublayer."""
import torch.nn.functional as F

from . import _extension


def bias_dropout_residual_reference(x, bias, residual, dropout_p: float, training: bool):
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=dropout_p, training=training)


def bias_dropout_residual(x, bias, residual, dropout_p: float, training: bool):
    if _extension.use_kernels(x) and _extension.has_op("bias_dropout_residual_fwd"):
        from . import _bias_dropout_residual_cuda as cuda

        if cuda.supports(x, bias, residual):
            return cuda.bias_dropout_residual_cuda(x, bias, residual, dropout_p, training)
    return bias_dropout_residual_reference(x, bias, residual, dropout_p, training)
