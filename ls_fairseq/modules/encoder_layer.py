"""Transformer encoder layer (post-LN as in the paper, or pre-LN as in tensor2tensor)."""
import torch.nn as nn
import torch.nn.functional as F
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase

from .. import ops
from ..ops.bias_act_dropout import check_activation
from .attention import SelfAttention
from .layer_norm import LayerNorm


def pre_ln_input(x, norm, normed=None):
    """(sublayer input, residual) of a pre-LN block: ``(normed, x)`` when the previous layer's
    last kernel computed ``norm(x)``, else ``norm.with_residual(x)`` (the residual branch's
    gradient of ``x`` is then added inside the LayerNorm's backward)."""
    return (normed, x) if normed is not None else norm.with_residual(x)


def sublayer_output(y, bias, residual, dropout: float, training: bool, next_norm=None):
    """``residual + dropout(y + bias)``; given ``next_norm`` (pre-LN: the LayerNorm that reads this
    output next), ``(x, next_norm(x))`` from one fused kernel."""
    if next_norm is None:
        return ops.bias_dropout_residual(y, bias, residual, dropout, training)
    return ops.bias_dropout_residual_layer_norm(y, bias, residual, next_norm.weight, next_norm.bias,
                                                dropout, training, next_norm.eps)


def feed_forward(layer, x, residual, next_norm=None):
    """``residual + dropout(fc2(dropout(act(fc1(x)))))`` with both bias epilogues fused (and
    ``next_norm`` of the result, see :func:`sublayer_output`)."""
    h = ops.bias_act_dropout(F.linear(x, layer.fc1.weight), layer.fc1.bias, layer.activation_fn,
                             layer.activation_dropout, layer.training)
    return sublayer_output(F.linear(h, layer.fc2.weight), layer.fc2.bias, residual, layer.dropout,
                           layer.training, next_norm)


def next_norms(layers, final_norm):
    """Per layer of a pre-LN stack, the LayerNorm that first reads its output (the next layer's
    ``self_attn_layer_norm``, or the stack's final LayerNorm, possibly None), so the layer computes
    it in its last kernel; all None for post-LN layers, whose own LayerNorms close them."""
    if len(layers) == 0 or not layers[0].normalize_before:
        return [None] * len(layers)
    return [layers[i + 1].self_attn_layer_norm for i in range(len(layers) - 1)] + [final_norm]


def check_post_ln_call(normed, next_norm):
    if normed is not None or next_norm is not None:
        raise ValueError("a post-LN layer takes no precomputed or fused LayerNorm (normed/next_norm)")


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

    def forward(self, x, encoder_padding_mask, normed=None, next_norm=None):
        """x [B, T, C], encoder_padding_mask [B, T] bool (True = pad) -> [B, T, C].

        Pre-LN only: ``normed`` is ``self_attn_layer_norm(x)`` when the previous layer computed it;
        with ``next_norm`` the layer returns ``(x, next_norm(x))`` (see :func:`next_norms`).
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
