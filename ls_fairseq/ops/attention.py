"""Scaled dot-product attention with key padding, causal masking and attention dropout.

Same math as fairseq's ``MultiheadAttention``: ``q`` is scaled by ``head_dim ** -0.5`` in its own
dtype, scores are masked with ``-inf``, softmax runs in fp32, dropout applies to the
probabilities. Unlike fairseq, a query row whose keys are all masked yields zeros, never NaN.

Layout: ``q`` [B, H, Tq, D], ``k``/``v`` [B, H, Tk, D] (any strides), ``key_padding_mask``
[B, Tk] bool (True = padding) or None. With ``causal``, query ``i`` sees keys ``<= i + Tk - Tq``
(so a single incremental-decoding query sees every cached key).
"""
import torch
import torch.nn.functional as F

from . import _extension


def _mask(key_padding_mask, causal: bool, tq: int, tk: int, device):
    """Boolean mask broadcastable to [B, H, Tq, Tk], True where attention is not allowed."""
    mask = None
    if key_padding_mask is not None:
        mask = key_padding_mask.to(torch.bool)[:, None, None, :]
    if causal:
        future = torch.ones(tq, tk, dtype=torch.bool, device=device).triu(tk - tq + 1)
        mask = future if mask is None else (mask | future)
    return mask


def attention_reference(
    q, k, v, key_padding_mask=None, causal: bool = False, dropout_p: float = 0.0,
    training: bool = False, need_weights: bool = False,
):
    """Returns ``(out [B, H, Tq, D], probs [B, H, Tq, Tk] (fp32 or wider) or None)``."""
    q = q * (q.size(-1) ** -0.5)
    scores = torch.matmul(q, k.transpose(-1, -2))
    mask = _mask(key_padding_mask, causal, q.size(-2), k.size(-2), q.device)
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    # fp32 statistics for half inputs (never lower than the input precision)
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    if mask is not None:
        # rows with every key masked: softmax gives NaN; define them as attending nowhere
        probs = probs.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)
    dropped = F.dropout(probs.type_as(scores), p=dropout_p, training=training)
    out = torch.matmul(dropped, v)
    return out, (probs if need_weights else None)


def attention(
    q, k, v, key_padding_mask=None, causal: bool = False, dropout_p: float = 0.0,
    training: bool = False, need_weights: bool = False,
):
    if (
        not need_weights
        and _extension.use_kernels(q)
        and _extension.has_op("attention_fwd")
    ):
        from . import _attention_cuda as cuda

        if cuda.supports(q, k, v):
            return cuda.attention_cuda(q, k, v, key_padding_mask, causal, dropout_p, training), None
    return attention_reference(q, k, v, key_padding_mask, causal, dropout_p, training, need_weights)


def attention_packed(
    qkv, key_padding_mask=None, causal: bool = False, dropout_p: float = 0.0,
    training: bool = False,
):
    """Self-attention over one packed projection ``qkv`` [B, T, 3, H, D] -> out [B, H, T, D].

    Same math as ``attention(*qkv.permute(2, 0, 3, 1, 4), ...)``; the CUDA path reads q/k/v in
    place and writes the gradient straight into d(qkv)'s layout (no stack of dq/dk/dv).
    """
    if _extension.use_kernels(qkv) and _extension.has_op("attention_fwd"):
        from . import _attention_cuda as cuda

        if cuda.supports(qkv, qkv, qkv):
            return cuda.attention_cuda_packed(qkv, key_padding_mask, causal, dropout_p, training)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    return attention_reference(q, k, v, key_padding_mask, causal, dropout_p, training)[0]


def attention_cuda(q, k, v, key_padding_mask=None, causal: bool = False, dropout_p: float = 0.0,
                   training: bool = False, backend=None):
    """The kernel path itself, with its ``backend`` choice (``_attention_cuda.attention_cuda``):
    out [B, H, Tq, D], for callers that must run a given kernel (bench); the extension must be
    loaded."""
    from ._attention_cuda import attention_cuda as kernel

    return kernel(q, k, v, key_padding_mask, causal, dropout_p, training, backend)


def attention_cuda_packed(qkv, key_padding_mask=None, causal: bool = False,
                          dropout_p: float = 0.0, training: bool = False, backend=None):
    """The packed kernel path itself (``_attention_cuda.attention_cuda_packed``), for callers
    that must run a given kernel (bench); the extension must be loaded."""
    from ._attention_cuda import attention_cuda_packed as kernel

    return kernel(qkv, key_padding_mask, causal, dropout_p, training, backend)
