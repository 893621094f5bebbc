"""``F.linear(x, weight, bias)`` whose backward reduces the bias gradient inside the
weight-gradient GEMM (cuBLASLt's BGRADB epilogue) instead of a separate column sum over the
output gradient: the attention input projections (packed QKV, cross-attention q, the
layer-batched encoder K/V).

Same math as ``F.linear``; only the order of the bias gradient's fp32 sum differs.
"""
import torch
import torch.nn.functional as F

from . import _extension
from .gemm_epilogues import usable


def linear_reference(x, weight, bias):
    return F.linear(x, weight, bias)


def linear(x, weight, bias):
    if (
        bias is not None
        and torch.is_grad_enabled()
        and x.is_cuda
        and _extension.use_kernels(x, weight, bias)
        and _extension.has_op("linear_bgrad")
    ):
        from . import _gemm_epilogues_cuda  # noqa: F401 (fake-tensor shapes)

        if usable(x, weight, bias):
            return torch.ops.ls_fairseq.linear_bgrad(x, weight, bias)
    return linear_reference(x, weight, bias)
