"""Transformer encoder layer (post-LN as in the paper, or pre-LN as in tensor2tensor)."""
import torch.nn as nn
import torch.nn.functional as F
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

from .. import ops
from ..ops.bias_act_dropout import check_activation
from .attention import SelfAttention
from .layer_norm import LayerNorm


def sublayer_input(x, norm, normalize_before: bool):
    """(sublayer input, residual). Pre-LN: ``(norm(x), x)``, with the residual branch's gradient
    of ``x`` added inside the LayerNorm's backward; post-LN: ``(x, x)``."""
    return norm.with_residual(x) if normalize_before else (x, x)


def feed_forward(layer, x, residual):
    """``residual + dropout(fc2(dropout(act(fc1(x)))))`` with both bias epilogues fused."""
    h = ops.bias_act_dropout(F.linear(x, layer.fc1.weight), layer.fc1.bias, layer.activation_fn,
                             layer.activation_dropout, layer.training)
    return ops.bias_dropout_residual(F.linear(h, layer.fc2.weight), layer.fc2.bias, residual,
                                     layer.dropout, layer.training)


class TransformerEncoderLayer(nn.Module):
    """Same parameters, defaults and math as fairseq's ``TransformerEncoderLayerBase``."""

    def __init__(self, embed_dim: int, ffn_embed_dim: int, num_heads: int, dropout: float,
                 attention_dropout: float, activation_dropout: float, activation_fn: str,
                 normalize_before: bool):
        super().__init__()
        self.embed_dim = embed_dim
        self.self_attn = SelfAttention(embed_dim, num_heads, dropout=attention_dropout)
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

    def forward(self, x, encoder_padding_mask):
        """x [B, T, C], encoder_padding_mask [B, T] bool (True = pad) -> [B, T, C]."""
        x, residual = sublayer_input(x, self.self_attn_layer_norm, self.normalize_before)
        y, _ = self.self_attn(x, encoder_padding_mask, causal=False)
        x = ops.bias_dropout_residual(y, self.self_attn.out_proj.bias, residual, self.dropout,
                                      self.training)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        x, residual = sublayer_input(x, self.final_layer_norm, self.normalize_before)
        x = feed_forward(self, x, residual)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x
