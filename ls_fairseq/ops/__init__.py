"""Fused ops: one module per op, each with a pure-PyTorch reference and a CUDA path.

Every public function here dispatches to the CUDA extension (``csrc/``) when its inputs are
CUDA tensors and the kernels are available (see ``_extension``), and to its ``*_reference``
twin otherwise. The reference is the specification the CUDA path is tested against.
"""
from .adam import adam_step, adam_step_reference
from .attention import attention, attention_packed, attention_reference
from .bias_act_dropout import bias_act_dropout, bias_act_dropout_reference
from .bias_dropout_residual import bias_dropout_residual, bias_dropout_residual_reference
from .bias_dropout_residual_layer_norm import (
    bias_dropout_residual_layer_norm,
    bias_dropout_residual_layer_norm_reference,
)
from .cross_entropy import (
    label_smoothed_cross_entropy,
    label_smoothed_cross_entropy_reference,
    label_smoothed_cross_entropy_rows,
    label_smoothed_cross_entropy_rows_reference,
)
from .embedding import transformer_embedding, transformer_embedding_reference
from .layer_norm import (
    layer_norm,
    layer_norm_reference,
    layer_norm_residual,
    layer_norm_residual_reference,
)

__all__ = [
    "adam_step",
    "adam_step_reference",
    "attention",
    "attention_packed",
    "attention_reference",
    "bias_act_dropout",
    "bias_act_dropout_reference",
    "bias_dropout_residual",
    "bias_dropout_residual_reference",
    "bias_dropout_residual_layer_norm",
    "bias_dropout_residual_layer_norm_reference",
    "label_smoothed_cross_entropy",
    "label_smoothed_cross_entropy_reference",
    "label_smoothed_cross_entropy_rows",
    "label_smoothed_cross_entropy_rows_reference",
    "layer_norm",
    "layer_norm_reference",
    "layer_norm_residual",
    "layer_norm_residual_reference",
    "transformer_embedding",
    "transformer_embedding_reference",
]
