"""Fused ops: one module per op, each with a pure-PyTorch reference and a CUDA path.

Every public function here dispatches to the CUDA extension (``csrc/``) when its inputs are
CUDA tensors, the kernels are available (see ``_extension``) and the op's binding supports the
inputs, and to its ``*_reference`` twin otherwise. The reference is the specification the CUDA
path is tested against. The convention (public module, binding, reference, tests) is
``ls_fairseq/ops/README.md``.
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
from .decode_attention import decode_attention, decode_attention_reference
from .embedding import transformer_embedding, transformer_embedding_reference
from .layer_norm import (
    layer_norm,
    layer_norm_reference,
    layer_norm_residual,
    layer_norm_residual_reference,
)
from .shard_reduce import shard_reduce_, shard_reduce_reference

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
    "decode_attention",
    "decode_attention_reference",
    "label_smoothed_cross_entropy",
    "label_smoothed_cross_entropy_reference",
    "label_smoothed_cross_entropy_rows",
    "label_smoothed_cross_entropy_rows_reference",
    "layer_norm",
    "layer_norm_reference",
    "layer_norm_residual",
    "layer_norm_residual_reference",
    "shard_reduce_",
    "shard_reduce_reference",
    "transformer_embedding",
    "transformer_embedding_reference",
]

#: the binding modules (``_<op>_cuda``), imported by :func:`load_kernels`
BINDINGS = (
    "_adam_cuda",
    "_attention_cuda",
    "_bias_act_dropout_cuda",
    "_bias_dropout_residual_cuda",
    "_bias_dropout_residual_layer_norm_cuda",
    "_cross_entropy_cuda",
    "_decode_attention_cuda",
    "_embedding_cuda",
    "_fp8_quantize_cuda",
    "_layer_norm_cuda",
    "_peer_barrier_cuda",
    "_peer_memory_cuda",
    "_shard_reduce_cuda",
)


def load_kernels() -> bool:
    """Build/load the CUDA extension and import every binding, so that each op's Python
    autograd and fake (meta) registrations are in place; True when the kernels are usable. For
    callers that call ``torch.ops.ls_fairseq.*`` directly (bench): the public ops need no such
    call (they load the extension and their binding on first use)."""
    import importlib

    from . import _extension

    if not _extension.load():
        return False
    for name in BINDINGS:
        importlib.import_module(f"{__name__}.{name}")
    return True
