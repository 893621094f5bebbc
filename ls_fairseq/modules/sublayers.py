"""The pieces every Transformer layer is built from (encoder and decoder alike): the pre-LN input
of a sublayer, the fused close of a sublayer (bias, dropout, residual, and in pre-LN the next
LayerNorm), the feed-forward block, which LayerNorm reads each layer's output, and the matmul of
the layers' linear layers (``F.linear``, or FP8 under ``--ls-fp8``)."""
import torch.nn.functional as F

from .. import ops
from ..ops.fp8_linear import fp8_linear


def linear_of(module):
    """The matmul of ``module``'s linear layers, with ``F.linear``'s signature. ``module.fp8``
    (``--ls-fp8``, set at construction) picks ``fp8_linear`` in training. Evaluation and
    generation (``module.training`` False) keep ``F.linear``."""
    return fp8_linear if module.fp8 and module.training else F.linear


def pre_ln_input(x, norm, normed=None):
    """(sublayer input, residual) of a pre-LN block: ``(normed, x)`` when the previous layer's
    last kernel computed ``norm(x)``, else ``norm.with_residual(x)`` (the residual branch's
    gradient of ``x`` is then added inside the LayerNorm's backward)."""
    return (normed, x) if normed is not None else norm.with_residual(x)


def sublayer_output(y, bias, residual, dropout: float, training: bool, next_norm=None):
    """``residual + dropout(y + bias)``; given ``next_norm`` (pre-LN: the LayerNorm that reads this
    output next), ``(x, next_norm(x))`` from one fused kernel."""
    if next_norm is None:
        return ops.bias_dropout_residual(y, bias, residual, dropout, training)
    return ops.bias_dropout_residual_layer_norm(y, bias, residual, next_norm.weight, next_norm.bias,
                                                dropout, training, next_norm.eps)


def feed_forward(layer, x, residual, next_norm=None):
    """``residual + dropout(fc2(dropout(act(fc1(x)))))`` with both bias epilogues fused (and
    ``next_norm`` of the result, see :func:`sublayer_output`)."""
    linear = linear_of(layer)
    h = ops.bias_act_dropout(linear(x, layer.fc1.weight), layer.fc1.bias, layer.activation_fn,
                             layer.activation_dropout, layer.training)
    return sublayer_output(linear(h, layer.fc2.weight), layer.fc2.bias, residual, layer.dropout,
                           layer.training, next_norm)


def next_norms(layers, final_norm):
    """Per layer of a pre-LN stack, the LayerNorm that first reads its output (the next layer's
    ``self_attn_layer_norm``, or the stack's final LayerNorm, possibly None), so the layer computes
    it in its last kernel; all None for post-LN layers, whose own LayerNorms close them."""
    if len(layers) == 0 or not layers[0].normalize_before:
        return [None] * len(layers)
    return [layers[i + 1].self_attn_layer_norm for i in range(len(layers) - 1)] + [final_norm]


def check_post_ln_call(normed, next_norm):
    if normed is not None or next_norm is not None:
        raise ValueError("a post-LN layer takes no precomputed or fused LayerNorm (normed/next_norm)")
