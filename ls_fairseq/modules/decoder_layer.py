"""Transformer decoder layer: causal self-attention, cross attention, feed-forward."""
from typing import Dict, Optional

import torch.nn as nn
from torch import Tensor

from .. import ops
from ..ops.bias_act_dropout import check_activation
from .attention import CrossAttention, SelfAttention
from .encoder_layer import feed_forward, sublayer_input
from .layer_norm import LayerNorm


class TransformerDecoderLayer(nn.Module):
    """Same parameters, defaults and math as fairseq's ``TransformerDecoderLayerBase``.

    The cross attention receives this layer's encoder keys/values precomputed by the decoder's
    layer-batched projection instead of projecting the encoder output itself.
    """

    def __init__(self, embed_dim: int, ffn_embed_dim: int, num_heads: int, encoder_embed_dim: int,
                 dropout: float, attention_dropout: float, activation_dropout: float,
                 activation_fn: str, normalize_before: bool):
        super().__init__()
        self.embed_dim = embed_dim
        self.dropout = dropout
        self.self_attn = SelfAttention(embed_dim, num_heads, dropout=attention_dropout)
        self.activation_fn = check_activation(activation_fn)
        self.activation_dropout = activation_dropout
        self.normalize_before = normalize_before
        self.self_attn_layer_norm = LayerNorm(embed_dim)
        self.encoder_attn = CrossAttention(embed_dim, num_heads, kdim=encoder_embed_dim,
                                           vdim=encoder_embed_dim, dropout=attention_dropout)
        self.encoder_attn_layer_norm = LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, embed_dim)
        self.final_layer_norm = LayerNorm(embed_dim)

    def _sublayer_out(self, y, bias, residual, norm):
        x = ops.bias_dropout_residual(y, bias, residual, self.dropout, self.training)
        return x if self.normalize_before else norm(x)

    def forward(
        self,
        x: Tensor,
        encoder_kv,
        encoder_padding_mask: Optional[Tensor],
        self_attn_padding_mask: Optional[Tensor],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_attn: bool = False,
        causal: bool = True,
    ):
        """x [B, T, C]; encoder_kv = (k, v) [B, H, S, D] -> (x, cross-attention probs or None)."""
        h, residual = sublayer_input(x, self.self_attn_layer_norm, self.normalize_before)
        y, _ = self.self_attn(h, self_attn_padding_mask, causal=causal,
                              incremental_state=incremental_state)
        x = self._sublayer_out(y, self.self_attn.out_proj.bias, residual,
                               self.self_attn_layer_norm)

        k, v = encoder_kv
        h, residual = sublayer_input(x, self.encoder_attn_layer_norm, self.normalize_before)
        y, attn = self.encoder_attn(h, k, v, encoder_padding_mask, need_weights=need_attn)
        x = self._sublayer_out(y, self.encoder_attn.out_proj.bias, residual,
                               self.encoder_attn_layer_norm)

        h, residual = sublayer_input(x, self.final_layer_norm, self.normalize_before)
        x = feed_forward(self, h, residual)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x, attn
