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


def label_smoothed_cross_entropy(logits, target, epsilon: float, ignore_index: int):
    if _extension.use_kernels(logits) and _extension.has_op("ls_cross_entropy_fwd"):
        from ._cross_entropy_cuda import label_smoothed_cross_entropy_cuda

        return label_smoothed_cross_entropy_cuda(logits, target, epsilon, ignore_index)
    return label_smoothed_cross_entropy_reference(logits, target, epsilon, ignore_index)
