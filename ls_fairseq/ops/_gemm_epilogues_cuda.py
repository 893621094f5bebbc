"""CUDA binding of :func:`ls_fairseq.ops.linear.linear` and
:func:`ls_fairseq.ops.relu_dropout_linear.relu_dropout_linear` (``csrc/gemm_epilogues.cpp``):
GEMMs whose cuBLASLt epilogue does the work of a separate pass over their output.

Ops (fp16/bf16):

* ``linear_bgrad(x, weight, bias) -> y``: ``F.linear``; its backward gets the weight and bias
  gradients from one GEMM (``linear_wgrad_bgrad(grad, x) -> (grad_weight, grad_bias)``, epilogue
  BGRADB) instead of a GEMM and a column sum.
* ``relu_dropout_linear(x, bias, weight, p, train) -> (y, h, mask)``: ``h = dropout(relu(x +
  bias))`` with the bit-mask of ``h > 0`` (``relu_dropout_mask_fwd``), ``y = h weight^T``; its
  backward gets ``grad_x`` and the bias gradient from one GEMM (``relu_dropout_dgrad(grad, weight,
  mask, scale)``, epilogue DRELU_BGRAD with alpha = 1 / (1 - p)) instead of a GEMM and a pass that
  reads the GEMM's output and ``h`` again.
* ``relu_bias_gemm_aux(x, weight, bias) -> (relu(x weight^T + bias), mask)``: cuBLASLt's own ReLU
  bit-mask, the tests' oracle for the mask layout.

Autograd is C++ (``csrc/gemm_epilogues_autograd.cpp``); fake-tensor shapes are registered here.

When they run: ``ls_fairseq/ops/gemm_epilogues.py``.
"""
import torch

from .gemm_epilogues import mask_bytes

@torch.library.register_fake("ls_fairseq::linear_wgrad_bgrad")
def _wgrad_fake(grad, x):
    return grad.new_empty((grad.size(-1), x.size(-1))), grad.new_empty((grad.size(-1),))


@torch.library.register_fake("ls_fairseq::relu_dropout_dgrad")
def _dgrad_fake(grad, weight, mask, scale):
    return (grad.new_empty(tuple(grad.shape[:-1]) + (weight.size(1),)),
            grad.new_empty((weight.size(1),)))


@torch.library.register_fake("ls_fairseq::relu_bias_gemm_aux")
def _aux_fake(x, weight, bias):
    return (x.new_empty((x.size(0), weight.size(0))),
            x.new_empty((x.size(0), mask_bytes(weight.size(0))), dtype=torch.uint8))


@torch.library.register_fake("ls_fairseq::linear_bgrad")
def _linear_fake(x, weight, bias):
    return x.new_empty(tuple(x.shape[:-1]) + (weight.size(0),))


@torch.library.register_fake("ls_fairseq::relu_dropout_linear")
def _rdl_fake(x, bias, weight, p, train):
    rows = x.numel() // x.size(-1)
    return (x.new_empty(tuple(x.shape[:-1]) + (weight.size(0),)),
            torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((rows, mask_bytes(x.size(-1))), dtype=torch.uint8))
