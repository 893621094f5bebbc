"""Transformer decoder layer: causal self-attention, cross attention, feed-forward."""
from typing import Dict, Optional

import torch.nn as nn
from torch import Tensor

from .. import ops
from ..ops.bias_act_dropout import check_activation
from .attention import CrossAttention, SelfAttention
from .kv_cache import LayerKVCache
from .sublayers import check_post_ln_call, feed_forward, pre_ln_input, sublayer_output
from .layer_norm import LayerNorm


class TransformerDecoderLayer(nn.Module):
    """Same parameters, defaults and math as fairseq's ``TransformerDecoderLayerBase``.

    The cross attention receives this layer's encoder keys/values precomputed by the decoder's
    layer-batched projection instead of projecting the encoder output itself.
    """

    def __init__(self, embed_dim: int, ffn_embed_dim: int, num_heads: int, encoder_embed_dim: int,
                 dropout: float, attention_dropout: float, activation_dropout: float,
                 activation_fn: str, normalize_before: bool, fp8: bool = False,
                 fp8_attention: Optional[bool] = None):
        super().__init__()
        self.embed_dim = embed_dim
        self.dropout = dropout
        # --ls-fp8 (--ls-fp8-layers): the FFN's (fp8) and the attention projections'
        # (fp8_attention, default fp8) matmuls in FP8 in training
        self.fp8 = fp8
        fp8_attention = fp8 if fp8_attention is None else fp8_attention
        self.self_attn = SelfAttention(embed_dim, num_heads, dropout=attention_dropout,
                                       fp8=fp8_attention)
        self.activation_fn = check_activation(activation_fn)
        self.activation_dropout = activation_dropout
        self.normalize_before = normalize_before
        self.self_attn_layer_norm = LayerNorm(embed_dim)
        self.encoder_attn = CrossAttention(embed_dim, num_heads, kdim=encoder_embed_dim,
                                           vdim=encoder_embed_dim, dropout=attention_dropout,
                                           fp8=fp8_attention)
        self.encoder_attn_layer_norm = LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, embed_dim)
        self.final_layer_norm = LayerNorm(embed_dim)

    def forward(
        self,
        x: Tensor,
        encoder_kv,
        encoder_padding_mask: Optional[Tensor],
        self_attn_padding_mask: Optional[Tensor],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_attn: bool = False,
        causal: bool = True,
        normed: Optional[Tensor] = None,
        next_norm: Optional[nn.Module] = None,
        self_attn_cache: Optional[LayerKVCache] = None,
        encoder_rows: Optional[Tensor] = None,
    ):
        """x [B, T, C]; encoder_kv = (k, v) [B, H, S, D] -> (x, cross-attention probs or None).

        Pre-LN only: ``normed`` is ``self_attn_layer_norm(x)`` when the previous layer computed it;
        with ``next_norm`` the first output is ``(x, next_norm(x))`` (see ``next_norms``).
        ``self_attn_cache``: when decoding, this layer's slot of the decoder's self-attention
        key/value cache (``SelfAttention.forward``'s ``kv_cache``). ``encoder_rows``: when
        decoding with ``encoder_kv`` stored once per sentence, the sentence of each row
        (``CrossAttention.forward``'s ``rows``).
        """
        k, v = encoder_kv
        if self.normalize_before:
            h, residual = pre_ln_input(x, self.self_attn_layer_norm, normed)
            y, _ = self.self_attn(h, self_attn_padding_mask, causal=causal,
                                  incremental_state=incremental_state, kv_cache=self_attn_cache)
            x, h = sublayer_output(y, self.self_attn.out_proj.bias, residual, self.dropout,
                                   self.training, self.encoder_attn_layer_norm)
            y, attn = self.encoder_attn(h, k, v, encoder_padding_mask, need_weights=need_attn,
                                         rows=encoder_rows)
            x, h = sublayer_output(y, self.encoder_attn.out_proj.bias, x, self.dropout,
                                   self.training, self.final_layer_norm)
            return feed_forward(self, h, x, next_norm), attn

        check_post_ln_call(normed, next_norm)
        y, _ = self.self_attn(x, self_attn_padding_mask, causal=causal,
                              incremental_state=incremental_state, kv_cache=self_attn_cache)
        x = self.self_attn_layer_norm(ops.bias_dropout_residual(
            y, self.self_attn.out_proj.bias, x, self.dropout, self.training))
        y, attn = self.encoder_attn(x, k, v, encoder_padding_mask, need_weights=need_attn,
                                     rows=encoder_rows)
        x = self.encoder_attn_layer_norm(ops.bias_dropout_residual(
            y, self.encoder_attn.out_proj.bias, x, self.dropout, self.training))
        return self.final_layer_norm(feed_forward(self, x, x)), attn
