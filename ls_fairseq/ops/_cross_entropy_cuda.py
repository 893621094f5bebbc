"""CUDA binding and autograd of the fused label-smoothed cross-entropy (``csrc/cross_entropy.cu``).

``torch.ops.ls_fairseq.ls_cross_entropy_fwd(logits [N, V], target [N], epsilon, ignore_index,
compute_argmax)`` returns fp32 per-row ``loss``, ``nll`` and ``lse`` (logsumexp, kept for the
backward) plus the row argmax (int64, -1 on ignored rows) when asked. ``ls_cross_entropy_bwd``
writes the gradient w.r.t. the logits in the logits dtype; ``ls_cross_entropy_bwd_`` writes it
over the logits themselves. Nothing of size [N, V] is ever held in fp32.

In-place backward (``inplace_backward=True``) saves one [N, V] buffer at the peak of the
backward. It is safe when nothing else needs the logits after the loss (fairseq's decoder output
projection saves its input and weight, not its output). The version counter of the logits is
bumped, so an autograd node that did save them fails loudly ("modified by an inplace
operation") instead of reading gradients.

The autograd is Python (:class:`LabelSmoothedCrossEntropyRows`: the in-place choice and the leaf
check are not op arguments); fake-tensor shapes are registered here once the extension is loaded
(``_extension.when_loaded``). What the kernels take is :func:`supports`; the public module runs the
reference otherwise.
"""
import torch

from . import _extension

_NO_IGNORE = -(2**63)  # ignore_index=None: no target can equal it


def supports(logits) -> bool:
    """Whether the kernels take ``logits`` [..., V]: float16/bfloat16/float32 (any strides: made
    contiguous; the targets are cast to int64)."""
    return logits.dtype in _extension.KERNEL_DTYPES


def _register():
    @torch.library.register_fake("ls_fairseq::ls_cross_entropy_fwd")
    def _fwd_fake(logits, target, epsilon, ignore_index, compute_argmax):
        n = logits.shape[0]
        f = logits.new_empty((n,), dtype=torch.float32)
        return f, f.new_empty((n,)), f.new_empty((n,)), \
            logits.new_empty((n if compute_argmax else 0,), dtype=torch.long)

    @torch.library.register_fake("ls_fairseq::ls_cross_entropy_bwd")
    def _bwd_fake(grad_loss, grad_nll, logits, target, lse, epsilon, ignore_index):
        return torch.empty_like(logits)

    @torch.library.register_fake("ls_fairseq::ls_cross_entropy_bwd_")
    def _bwd_inplace_fake(grad_loss, grad_nll, logits, target, lse, epsilon, ignore_index):
        return None


_extension.when_loaded(_register)


def _grad_arg(g):
    if g is None:
        return None
    return g if g.dtype == torch.float32 else g.float()


class LabelSmoothedCrossEntropyRows(torch.autograd.Function):
    """Per-row (loss, nll, argmax) with the fused kernels; argmax is not differentiable."""

    @staticmethod
    def forward(ctx, logits, target, epsilon, ignore_index, compute_argmax, inplace_backward):
        loss_rows, nll_rows, lse, argmax = torch.ops.ls_fairseq.ls_cross_entropy_fwd(
            logits, target, float(epsilon), int(ignore_index), bool(compute_argmax))
        ctx.save_for_backward(logits, target, lse)
        ctx.epsilon = float(epsilon)
        ctx.ignore_index = int(ignore_index)
        # never over a leaf: its gradient would alias its own data
        ctx.inplace_backward = bool(inplace_backward) and not logits.is_leaf
        ctx.mark_non_differentiable(argmax)
        ctx.set_materialize_grads(False)
        return loss_rows, nll_rows, argmax

    @staticmethod
    def backward(ctx, grad_loss, grad_nll, _grad_argmax):
        logits, target, lse = ctx.saved_tensors
        if grad_loss is None and grad_nll is None:
            return None, None, None, None, None, None
        grad_loss, grad_nll = _grad_arg(grad_loss), _grad_arg(grad_nll)
        if ctx.inplace_backward:
            torch.ops.ls_fairseq.ls_cross_entropy_bwd_(
                grad_loss, grad_nll, logits, target, lse, ctx.epsilon, ctx.ignore_index)
            torch.autograd.graph.increment_version(logits)
            grad = logits
        else:
            grad = torch.ops.ls_fairseq.ls_cross_entropy_bwd(
                grad_loss, grad_nll, logits, target, lse, ctx.epsilon, ctx.ignore_index)
        return grad, None, None, None, None, None


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
    return LabelSmoothedCrossEntropyRows.apply(
        logits, target, epsilon, ignore_index, compute_argmax, inplace_backward)


def label_smoothed_cross_entropy_cuda(logits, target, epsilon: float, ignore_index,
                                      *, inplace_backward=False):
    """Same contract as ``label_smoothed_cross_entropy_reference``: fp32 sums (loss, nll_loss)."""
    loss_rows, nll_rows, _ = label_smoothed_cross_entropy_rows_cuda(
        logits, target, epsilon, ignore_index, inplace_backward=inplace_backward)
    return loss_rows.sum(), nll_rows.sum()
