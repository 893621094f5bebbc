"""Transformer input embedding: ``dropout(scale * E[tokens] + P[positions])``.

Matches fairseq's ``forward_embedding``: the token table lookup is scaled, the positional table
(learned or sinusoidal; its ``padding_idx`` row is zero) is added, dropout is applied, and for the
encoder the padded positions are zeroed afterwards. Gradients flow to the token table (the
``padding_idx`` row gets none, as in ``nn.Embedding``) and to a learned positional table.
"""
import torch
import torch.nn.functional as F

from . import _extension


def transformer_embedding_reference(
    tokens,
    positions,
    token_weight,
    pos_weight,
    scale: float,
    padding_idx: int,
    dropout_p: float,
    training: bool,
    zero_pad: bool,
):
    x = scale * F.embedding(tokens, token_weight, padding_idx)
    if pos_weight is not None:
        x = x + F.embedding(positions, pos_weight, padding_idx)
    x = F.dropout(x, p=dropout_p, training=training)
    if zero_pad:
        x = x * (1 - tokens.eq(padding_idx).unsqueeze(-1).type_as(x))
    return x


def transformer_embedding(
    tokens,
    positions,
    token_weight,
    pos_weight,
    scale: float,
    padding_idx: int,
    dropout_p: float,
    training: bool,
    zero_pad: bool,
):
    """tokens, positions: [B, T] int64; token_weight: [V, C]; pos_weight: [P, C] or None."""
    if _extension.use_kernels(token_weight) and _extension.has_op("embedding_fwd"):
        from . import _embedding_cuda as cuda

        if cuda.supports(tokens, positions, token_weight, pos_weight):
            return cuda.transformer_embedding_cuda(
                tokens, positions, token_weight, pos_weight, scale, padding_idx, dropout_p,
                training, zero_pad,
            )
    return transformer_embedding_reference(
        tokens, positions, token_weight, pos_weight, scale, padding_idx, dropout_p, training,
        zero_pad,
    )
