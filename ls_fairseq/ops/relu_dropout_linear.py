"""``F.linear(dropout(relu(x + bias)), weight)``: the middle of the FFN sublayer (fc1's bias and
activation, fc2 without its bias, which the layer fuses into bias + dropout + residual).

On CUDA the forward writes, next to ``h = dropout(relu(x + bias))``, a bit-mask of ``h > 0``, and
the backward computes ``grad_x = (grad @ weight) * mask / (1 - p)`` and fc1's bias gradient inside
fc2's input-gradient GEMM (cuBLASLt's DRELU_BGRAD epilogue), so no pass reads that GEMM's output
and ``h`` again. Other activations, fp32 and shapes cuBLASLt cannot take run
``bias_act_dropout`` then ``F.linear``: the same math.
"""
import torch
import torch.nn.functional as F

from . import _extension
from .gemm_epilogues import usable
from .bias_act_dropout import bias_act_dropout, bias_act_dropout_reference


def relu_dropout_linear_reference(x, bias, weight, dropout_p: float, training: bool):
    return F.linear(bias_act_dropout_reference(x, bias, "relu", dropout_p, training), weight)


def relu_dropout_linear(x, bias, weight, dropout_p: float, training: bool):
    if (
        torch.is_grad_enabled()
        and x.is_cuda
        and x.is_contiguous()
        and _extension.use_kernels(x, bias, weight)
        and _extension.has_op("relu_dropout_linear")
    ):
        from . import _gemm_epilogues_cuda  # noqa: F401 (fake-tensor shapes)

        if usable(x, weight, bias):
            y, _h, _mask = torch.ops.ls_fairseq.relu_dropout_linear(
                x, bias, weight, float(dropout_p), bool(training)
            )
            return y
    return F.linear(bias_act_dropout(x, bias, "relu", dropout_p, training), weight)
