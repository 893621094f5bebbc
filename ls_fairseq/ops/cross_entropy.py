"""Label-smoothed cross-entropy straight from logits, fairseq's exact formula.

fairseq's ``label_smoothed_nll_loss`` on ``lprobs = log_softmax(logits.float())``::

    nll_i    = -lprobs[i, t_i]                   smooth_i = -sum_j lprobs[i, j]
    eps_i    = epsilon / (V - 1)
    loss     = (1 - epsilon - eps_i) * sum_i nll_i + eps_i * sum_i smooth_i

with rows whose target is ``ignore_index`` contributing zero. Since ``lprobs = x - lse(x)``, each
row needs only ``max``, ``sum exp`` and ``sum x``: the CUDA path never materialises fp32
log-probabilities.
"""
import torch

from . import _extension


def label_smoothed_cross_entropy_reference(logits, target, epsilon: float, ignore_index: int):
    """logits [N, V] (any float dtype), target [N] int64 -> (loss, nll_loss) fp32 sums."""
    lprobs = torch.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    target = target.unsqueeze(-1)
    nll_loss = -lprobs.gather(dim=-1, index=target)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True)
    pad_mask = target.eq(ignore_index)
    nll_loss = nll_loss.masked_fill(pad_mask, 0.0).sum()
    smooth_loss = smooth_loss.masked_fill(pad_mask, 0.0).sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss
    return loss, nll_loss


def label_smoothed_cross_entropy_rows_reference(logits, target, epsilon: float, ignore_index: int,
                                                compute_argmax: bool = False):
    """Per-token terms of the same formula: logits [N, V], target [N] -> fp32 (loss [N],
    nll [N], argmax [N] or None); rows whose target is ``ignore_index`` are zero."""
    lprobs = torch.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    pad_mask = target.eq(ignore_index)
    nll = (-lprobs.gather(dim=-1, index=target.unsqueeze(-1)).squeeze(-1)).masked_fill(pad_mask, 0.0)
    smooth = (-lprobs.sum(dim=-1)).masked_fill(pad_mask, 0.0)
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
    return loss, nll, (logits.argmax(-1) if compute_argmax else None)


def label_smoothed_cross_entropy_rows(logits, target, epsilon: float, ignore_index: int,
                                      compute_argmax: bool = False, inplace_backward: bool = False):
    """Per-token losses, nll and (optionally) argmax in one pass over the logits.

    ``inplace_backward``: the CUDA backward may write the gradient over the logits buffer, so the
    caller must not read the logits after backward (the criterion drops them at once).
    """
    if _extension.use_kernels(logits) and _extension.has_op("ls_cross_entropy_fwd"):
        from . import _cross_entropy_cuda as cuda

        if cuda.supports(logits):
            loss, nll, argmax = cuda.label_smoothed_cross_entropy_rows_cuda(
                logits, target, epsilon, ignore_index, compute_argmax=compute_argmax,
                inplace_backward=inplace_backward)
            return loss, nll, (argmax if compute_argmax else None)
    return label_smoothed_cross_entropy_rows_reference(logits, target, epsilon, ignore_index,
                                                       compute_argmax)


def label_smoothed_cross_entropy(logits, target, epsilon: float, ignore_index: int):
    if _extension.use_kernels(logits) and _extension.has_op("ls_cross_entropy_fwd"):
        from . import _cross_entropy_cuda as cuda

        if cuda.supports(logits):
            return cuda.label_smoothed_cross_entropy_cuda(logits, target, epsilon, ignore_index)
    return label_smoothed_cross_entropy_reference(logits, target, epsilon, ignore_index)


def label_smoothed_cross_entropy_rows_cuda(logits, target, epsilon: float, ignore_index, *,
                                           compute_argmax=False, inplace_backward=False):
    """The kernel path itself (``_cross_entropy_cuda``): per-token fp32 (loss, nll,
    argmax-or-empty), for callers that must run the kernels (bench); the extension must be
    loaded and :func:`_cross_entropy_cuda.supports` the logits."""
    from ._cross_entropy_cuda import label_smoothed_cross_entropy_rows_cuda as kernel

    return kernel(logits, target, epsilon, ignore_index, compute_argmax=compute_argmax,
                  inplace_backward=inplace_backward)
