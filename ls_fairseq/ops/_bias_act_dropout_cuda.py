"""CUDA binding of :func:`ls_fairseq.ops.bias_act_dropout.bias_act_dropout`
(``csrc/dropout_fusions.cu``): ``dropout(act(x + bias))`` in one pass, act = relu or exact-erf gelu.

Ops: ``bias_act_dropout_fwd(x, bias, activation, p, train) -> (out, rng)``,
``bias_act_dropout_bwd(grad, x, bias, rng, activation, p, train, bias_grad) -> (grad_x, grad_bias)``
and ``relu_dropout_bwd(grad, out, p, train, bias_grad) -> (grad_x, grad_bias)``.

What the backward keeps: for relu, ``out`` only (an element passes the gradient exactly when
``out > 0``: kept by dropout and relu active). ``out`` is the tensor fc2 saves for its weight
gradient anyway, so the fc1 output ``x`` is freed after the forward: one [tokens, ffn_dim] tensor
less per layer at the memory peak. For gelu, ``x`` and the int64[2] Philox state ``rng``; the mask
is regenerated, ``x + bias`` and the activation derivative recomputed. The forward op's autograd is
C++ (``csrc/dropout_fusions_autograd.cpp``); fake-tensor shapes are registered here once the
extension is loaded (``_extension.when_loaded``). What the kernels take is :func:`supports`; the
public module runs the reference otherwise.
"""
import torch

from . import _extension

#: the activations csrc/dropout_fusions.cu implements (act_code)
ACTIVATIONS = ("relu", "gelu")


def supports(x, bias, activation: str) -> bool:
    """Whether the kernels take these arguments: activation relu or gelu, x [..., C]
    float16/bfloat16/float32 with C > 0, bias None or C values of x's dtype (any strides)."""
    return activation in ACTIVATIONS and _extension.rows_fit(x, bias)


def _register():
    @torch.library.register_fake("ls_fairseq::bias_act_dropout_fwd")
    def _fwd_fake(x, bias, activation, p, train):
        return (
            torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((2,), dtype=torch.int64),
        )

    @torch.library.register_fake("ls_fairseq::bias_act_dropout_bwd")
    def _bwd_fake(grad, x, bias, rng, activation, p, train, bias_grad):
        return (
            torch.empty_like(grad, memory_format=torch.contiguous_format),
            grad.new_empty((grad.size(-1) if bias_grad else 0,)),
        )

    @torch.library.register_fake("ls_fairseq::relu_dropout_bwd")
    def _relu_bwd_fake(grad, out, p, train, bias_grad):
        return _bwd_fake(grad, out, None, None, "relu", p, train, bias_grad)


_extension.when_loaded(_register)


def bias_act_dropout_cuda(x, bias, activation: str, dropout_p: float, training: bool):
    """``dropout(act(x + bias))`` in one kernel; for arguments :func:`supports` takes."""
    out, _rng = torch.ops.ls_fairseq.bias_act_dropout_fwd(
        x, bias, activation, float(dropout_p), bool(training)
    )
    return out
