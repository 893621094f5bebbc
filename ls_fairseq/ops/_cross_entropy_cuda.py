"""CUDA binding and autograd of the fused label-smoothed cross-entropy (``csrc/cross_entropy.cu``).

``torch.ops.ls_fairseq.ls_cross_entropy_fwd(logits [N, V], target [N], epsilon, ignore_index,
compute_argmax)`` returns fp32 per-row ``loss``, ``nll`` and ``lse`` (logsumexp, kept for the
backward) plus the row argmax (int64, -1 on ignored rows) when asked. ``ls_cross_entropy_bwd``
writes the gradient w.r.t. the logits in the logits dtype; ``ls_cross_entropy_bwd_`` writes it
over the logits themselves. Nothing of size [N, V] is ever held in fp32.

Autograd: the Python custom op ``ls_fairseq::ls_cross_entropy_rows`` (:func:`ls_cross_entropy_rows`,
defined at import) runs ``ls_cross_entropy_fwd`` and carries the backward
(``torch.library.register_autograd``) and its fake. It takes one argument more than the kernel,
``inplace_backward``, which only the backward reads; ``lse`` is one of its outputs
(non-differentiable) because ``setup_context`` sees only the op's inputs and outputs.

In-place backward (``inplace_backward=True``, taken only when the logits are not a leaf: a leaf's
gradient would alias its own data) saves one [N, V] buffer at the peak of the backward. It is
safe when nothing else needs the logits after the loss (fairseq's decoder output projection
saves its input and weight, not its output). The version counter of the logits is bumped, so an
autograd node that did save them fails loudly ("modified by an inplace operation") instead of
reading gradients.

The fakes of the csrc ops are registered once the extension is loaded
(``_extension.when_loaded``). What the kernels take is :func:`supports`; the public module runs
the reference otherwise.
"""
from typing import Tuple

import torch
from torch import Tensor

from . import _extension

_NO_IGNORE = -(2**63)  # ignore_index=None: no target can equal it


def supports(logits) -> bool:
    """Whether the kernels take ``logits`` [..., V]: float16/bfloat16/float32 (any strides: made
    contiguous; the targets are cast to int64)."""
    return logits.dtype in _extension.KERNEL_DTYPES


def _fwd_fake(logits, compute_argmax):
    n = logits.shape[0]
    f = logits.new_empty((n,), dtype=torch.float32)
    return f, f.new_empty((n,)), f.new_empty((n,)), \
        logits.new_empty((n if compute_argmax else 0,), dtype=torch.long)


def _register():
    @torch.library.register_fake("ls_fairseq::ls_cross_entropy_fwd")
    def _fwd_fake_csrc(logits, target, epsilon, ignore_index, compute_argmax):
        return _fwd_fake(logits, compute_argmax)

    @torch.library.register_fake("ls_fairseq::ls_cross_entropy_bwd")
    def _bwd_fake(grad_loss, grad_nll, logits, target, lse, epsilon, ignore_index):
        return torch.empty_like(logits)

    @torch.library.register_fake("ls_fairseq::ls_cross_entropy_bwd_")
    def _bwd_inplace_fake(grad_loss, grad_nll, logits, target, lse, epsilon, ignore_index):
        return None


_extension.when_loaded(_register)


@torch.library.custom_op("ls_fairseq::ls_cross_entropy_rows", mutates_args=())
def ls_cross_entropy_rows(logits: Tensor, target: Tensor, epsilon: float, ignore_index: int,
                          compute_argmax: bool,
                          inplace_backward: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``ls_cross_entropy_fwd``: logits [N, V] (contiguous), target [N] int64 -> fp32 (loss [N],
    nll [N], lse [N], argmax [N] or [0]). ``inplace_backward`` is read by the backward only."""
    return torch.ops.ls_fairseq.ls_cross_entropy_fwd(logits, target, epsilon, ignore_index,
                                                     compute_argmax)


@ls_cross_entropy_rows.register_fake
def _rows_fake(logits, target, epsilon, ignore_index, compute_argmax, inplace_backward):
    return _fwd_fake(logits, compute_argmax)


def _rows_setup_context(ctx, inputs, output):
    logits, target, epsilon, ignore_index, _compute_argmax, inplace_backward = inputs
    _loss, _nll, lse, argmax = output
    ctx.save_for_backward(logits, target, lse)
    ctx.epsilon = float(epsilon)
    ctx.ignore_index = int(ignore_index)
    # never over a leaf: its gradient would alias its own data
    ctx.inplace_backward = bool(inplace_backward) and not logits.is_leaf
    ctx.mark_non_differentiable(lse, argmax)
    ctx.set_materialize_grads(False)  # an unused loss or nll reaches the kernel as None


def _grad_arg(g):
    if g is None:
        return None
    return g if g.dtype == torch.float32 else g.float()


def _rows_backward(ctx, grad_loss, grad_nll, _grad_lse, _grad_argmax):
    logits, target, lse = ctx.saved_tensors
    if grad_loss is None and grad_nll is None:
        return None, None, None, None, None, None
    grad_loss, grad_nll = _grad_arg(grad_loss), _grad_arg(grad_nll)
    if ctx.inplace_backward:
        torch.ops.ls_fairseq.ls_cross_entropy_bwd_(
            grad_loss, grad_nll, logits, target, lse, ctx.epsilon, ctx.ignore_index)
        torch.autograd.graph.increment_version(logits)  # the kernel op does not bump it
        grad = logits
    else:
        grad = torch.ops.ls_fairseq.ls_cross_entropy_bwd(
            grad_loss, grad_nll, logits, target, lse, ctx.epsilon, ctx.ignore_index)
    return grad, None, None, None, None, None


ls_cross_entropy_rows.register_autograd(_rows_backward, setup_context=_rows_setup_context)


def _prepare(logits, target, ignore_index):
    if logits.dim() != 2:
        logits = logits.reshape(-1, logits.size(-1))
    if not logits.is_contiguous():
        logits = logits.contiguous()
    target = target.reshape(-1)
    if target.dtype != torch.long:
        target = target.long()
    if not target.is_contiguous():
        target = target.contiguous()
    return logits, target, _NO_IGNORE if ignore_index is None else int(ignore_index)


def label_smoothed_cross_entropy_rows_cuda(logits, target, epsilon: float, ignore_index,
                                           *, compute_argmax=False, inplace_backward=False):
    """logits [..., V] -> per-token fp32 (loss, nll, argmax-or-empty), ignored rows zero."""
    logits, target, ignore_index = _prepare(logits, target, ignore_index)
    loss_rows, nll_rows, _lse, argmax = ls_cross_entropy_rows(
        logits, target, float(epsilon), ignore_index, bool(compute_argmax), bool(inplace_backward))
    return loss_rows, nll_rows, argmax


def label_smoothed_cross_entropy_cuda(logits, target, epsilon: float, ignore_index,
                                      *, inplace_backward=False):
    """Same contract as ``label_smoothed_cross_entropy_reference``: fp32 sums (loss, nll_loss)."""
    loss_rows, nll_rows, _ = label_smoothed_cross_entropy_rows_cuda(
        logits, target, epsilon, ignore_index, inplace_backward=inplace_backward)
    return loss_rows.sum(), nll_rows.sum()
