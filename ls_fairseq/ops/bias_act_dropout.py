"""``dropout(activation(x + bias))``: the first half of the FFN sublayer.

Activations follow fairseq's ``utils.get_activation_fn`` exactly: ``gelu`` is the exact erf GELU
computed in fp32 (fairseq's ``gelu`` upcasts), ``gelu_accurate`` is the tanh approximation.
"""
import math

import torch
import torch.nn.functional as F

from . import _extension

#: activations the CUDA kernel implements (``_bias_act_dropout_cuda.ACTIVATIONS``, read here
#: before the extension loads); the others run the reference path.
KERNEL_ACTIVATIONS = ("relu", "gelu")


def _gelu_accurate(x):
    a = math.sqrt(2 / math.pi)
    return 0.5 * x * (1 + torch.tanh(a * (x + 0.044715 * torch.pow(x, 3))))


_ACTIVATIONS = {
    "relu": F.relu,
    "relu_squared": lambda x: F.relu(x).pow(2),
    "gelu": lambda x: F.gelu(x.float()).type_as(x),
    "gelu_fast": _gelu_accurate,
    "gelu_accurate": _gelu_accurate,
    "tanh": torch.tanh,
    "linear": lambda x: x,
    "swish": F.silu,
}


def check_activation(name: str) -> str:
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"--activation-fn {name!r} is not supported by ls_fairseq; choose one of "
            f"{', '.join(sorted(_ACTIVATIONS))}"
        )
    return name


def bias_act_dropout_reference(x, bias, activation: str, dropout_p: float, training: bool):
    if bias is not None:
        x = x + bias
    return F.dropout(_ACTIVATIONS[check_activation(activation)](x), p=dropout_p, training=training)


def bias_act_dropout(x, bias, activation: str, dropout_p: float, training: bool):
    if (
        activation in KERNEL_ACTIVATIONS
        and _extension.use_kernels(x)
        and _extension.has_op("bias_act_dropout_fwd")
    ):
        from . import _bias_act_dropout_cuda as cuda

        if cuda.supports(x, bias, activation):
            return cuda.bias_act_dropout_cuda(x, bias, activation, dropout_p, training)
    return bias_act_dropout_reference(x, bias, activation, dropout_p, training)
