"""Transformer encoder layer (post-LN as in the paper, or pre-LN as in tensor2tensor)."""
from typing import Optional

import torch.nn as nn
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

from .. import ops
from ..ops.bias_act_dropout import check_activation
from .attention import SelfAttention
from .layer_norm import LayerNorm
from .sublayers import check_post_ln_call, feed_forward, pre_ln_input, sublayer_output


class TransformerEncoderLayer(nn.Module):
    """Same parameters, defaults and math as fairseq's ``TransformerEncoderLayerBase``."""

    def __init__(self, embed_dim: int, ffn_embed_dim: int, num_heads: int, dropout: float,
                 attention_dropout: float, activation_dropout: float, activation_fn: str,
                 normalize_before: bool, fp8: bool = False,
                 fp8_attention: Optional[bool] = None):
        super().__init__()
        self.embed_dim = embed_dim
        # --ls-fp8 (--ls-fp8-layers): the FFN's (fp8) and the attention projections'
        # (fp8_attention, default fp8) matmuls in FP8 in training
        self.fp8 = fp8
        fp8_attention = fp8 if fp8_attention is None else fp8_attention
        self.self_attn = SelfAttention(embed_dim, num_heads, dropout=attention_dropout,
                                       fp8=fp8_attention)
        self.self_attn_layer_norm = LayerNorm(embed_dim)
        self.dropout = dropout
        self.activation_fn = check_activation(activation_fn)
        self.activation_dropout = activation_dropout
        self.normalize_before = normalize_before
        self.fc1 = nn.Linear(embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, embed_dim)
        self.final_layer_norm = LayerNorm(embed_dim)

    # renames pre-2019 ``layer_norms.N`` keys; pure state_dict bookkeeping shared with fairseq
    upgrade_state_dict_named = TransformerEncoderLayerBase.upgrade_state_dict_named

    def forward(self, x, encoder_padding_mask, normed=None, next_norm=None):
        """x [B, T, C], encoder_padding_mask [B, T] bool (True = pad) -> [B, T, C].

        Pre-LN only: ``normed`` is ``self_attn_layer_norm(x)`` when the previous layer computed it;
        with ``next_norm`` the layer returns ``(x, next_norm(x))`` (see :func:`.sublayers.next_norms`).
        """
        if self.normalize_before:
            h, residual = pre_ln_input(x, self.self_attn_layer_norm, normed)
            y, _ = self.self_attn(h, encoder_padding_mask, causal=False)
            x, h = sublayer_output(y, self.self_attn.out_proj.bias, residual, self.dropout,
                                   self.training, self.final_layer_norm)
            return feed_forward(self, h, x, next_norm)

        check_post_ln_call(normed, next_norm)
        y, _ = self.self_attn(x, encoder_padding_mask, causal=False)
        x = self.self_attn_layer_norm(ops.bias_dropout_residual(
            y, self.self_attn.out_proj.bias, x, self.dropout, self.training))
        return self.final_layer_norm(feed_forward(self, x, x))
