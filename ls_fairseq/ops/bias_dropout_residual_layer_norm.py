"""``x = residual + dropout(y + bias)`` and ``LayerNorm(x)``: a pre-LN sublayer's output and the
next sublayer's normalized input (the boundary between two pre-LN sublayers).

On CUDA one kernel writes both (x is not read back for the LayerNorm), with exactly the values of
``bias_dropout_residual`` followed by ``layer_norm_residual`` (same Philox mask); with dropout the
backward is one pass too (LayerNorm's backward also writes y's gradient through the mask and its
bias sums). Shapes the fused kernel does not take run that pair.
"""
from . import _extension
from .bias_dropout_residual import bias_dropout_residual, bias_dropout_residual_reference
from .layer_norm import layer_norm_reference, layer_norm_residual


def bias_dropout_residual_layer_norm_reference(y, bias, residual, weight, ln_bias,
                                               dropout_p: float, training: bool, eps: float = 1e-5):
    x = bias_dropout_residual_reference(y, bias, residual, dropout_p, training)
    return x, layer_norm_reference(x, weight, ln_bias, eps)


def bias_dropout_residual_layer_norm(y, bias, residual, weight, ln_bias, dropout_p: float,
                                     training: bool, eps: float = 1e-5):
    """(x, LayerNorm(x)) with x = residual + dropout(y + bias)."""
    if _extension.use_kernels(y) and _extension.has_op("bias_dropout_residual_layer_norm_fwd"):
        from . import _bias_dropout_residual_layer_norm_cuda as cuda

        if cuda.supports(y, bias, residual, weight, ln_bias):
            return cuda.bias_dropout_residual_layer_norm_cuda(y, bias, residual, weight, ln_bias,
                                                              dropout_p, training, eps)
    # the pair, each op on its own path (its kernel, or on the CPU its reference)
    x = bias_dropout_residual(y, bias, residual, dropout_p, training)
    h, x = layer_norm_residual(x, weight, ln_bias, eps)
    return x, h
