"""Multi-head attention sublayers: decoder/encoder self-attention and cross attention.

Parameter names, shapes, initialisation and construction order are those of fairseq's
``MultiheadAttention`` (``k_proj``, ``v_proj``, ``q_proj``, ``out_proj``). The math differs only in
how it is batched: the three self-attention projections run as one GEMM, and the cross-attention
keys/values of all decoder layers come precomputed from :class:`LayerBatchedEncoderKV`.

When decoding, the self-attention keys/values of earlier steps live in a preallocated, growable
cache (:mod:`.kv_cache`), written in place at each step. A fixed-shape cache (``StaticKVCache``)
and cross-attention keys/values stored once per sentence are read through a row table
(``ops.decode_attention``): beam search then moves no keys/values.

Both modules return the output projection *without its bias*: the layer fuses
``bias + dropout + residual`` in one op. Under ``--ls-fp8`` their projections run as FP8 matmuls
in training (``sublayers.linear_of``); the cross-attention keys/values do not.
"""
import math
from typing import Dict, Optional

import torch
import torch.nn as nn
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor

from .. import ops
from ..ops.decode_attention import gather_rows
from .kv_cache import LayerKVCache, SelfAttentionKVCache
from .sublayers import linear_of


def _projections(module: nn.Module, embed_dim: int, kdim: int, vdim: int):
    """Create k/v/q/out projections in fairseq's order with fairseq's initialisation."""
    module.k_proj = nn.Linear(kdim, embed_dim)
    module.v_proj = nn.Linear(vdim, embed_dim)
    module.q_proj = nn.Linear(embed_dim, embed_dim)
    module.out_proj = nn.Linear(embed_dim, embed_dim)
    gain = 1 / math.sqrt(2) if (kdim == embed_dim and vdim == embed_dim) else 1.0
    nn.init.xavier_uniform_(module.k_proj.weight, gain=gain)
    nn.init.xavier_uniform_(module.v_proj.weight, gain=gain)
    nn.init.xavier_uniform_(module.q_proj.weight, gain=gain)
    nn.init.xavier_uniform_(module.out_proj.weight)
    nn.init.constant_(module.out_proj.bias, 0.0)


def _check_heads(embed_dim: int, num_heads: int):
    if embed_dim % num_heads != 0:
        raise ValueError(
            f"attention embed dim {embed_dim} is not divisible by the number of heads {num_heads} "
            "(--encoder/decoder-attention-heads)"
        )


def _through_table(q: Tensor, k: Tensor, v: Tensor, table: Tensor,
                   key_padding_mask: Optional[Tensor], need_weights: bool):
    """One decoding query per row, q [B, H, 1, D], over keys/values k/v [N, H, T, D] that row
    ``b`` finds at ``table[b, t]`` ([B, T]) -> (ctx [B, H, 1, D], probs or None)."""
    if q.size(2) != 1:
        raise ValueError(f"attention through a row table takes one query per row, got {q.size(2)}")
    if need_weights:  # attention weights: the gathered keys/values through ops.attention
        k, v = gather_rows(k, table), gather_rows(v, table)
        return ops.attention(q, k, v, key_padding_mask, need_weights=True)
    return ops.decode_attention(q.squeeze(2), k, v, table, key_padding_mask).unsqueeze(2), None


def _merge_heads(ctx: Tensor) -> Tensor:
    """[B, H, T, D] -> [B, T, H * D]."""
    b, h, t, d = ctx.shape
    return ctx.transpose(1, 2).reshape(b, t, h * d)


class _Attention(nn.Module):
    """Heads, attention dropout and fairseq's four projections, shared by both kinds; ``fp8``:
    the projections' matmuls in FP8 in training (``--ls-fp8``)."""

    def __init__(self, embed_dim: int, num_heads: int, kdim: int, vdim: int, dropout: float,
                 fp8: bool = False):
        super().__init__()
        _check_heads(embed_dim, num_heads)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.fp8 = fp8
        _projections(self, embed_dim, kdim, vdim)


@with_incremental_state
class SelfAttention(_Attention):
    """Self-attention with one fused QKV projection; causal and incremental for the decoder."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, fp8: bool = False):
        super().__init__(embed_dim, num_heads, embed_dim, embed_dim, dropout, fp8)

    def qkv_weight_and_bias(self):
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        b = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        return w, b

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Optional[Tensor],
        causal: bool,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = False,
        kv_cache: Optional[LayerKVCache] = None,
    ):
        """x [B, T, C] -> (out_proj(ctx) without bias [B, T, C], probs [B, H, T, S] or None).

        With ``incremental_state`` (decoding), the keys/values of earlier steps come from
        ``kv_cache``, this layer's slot of the decoder's cache, or without it from a cache of
        this module's own in ``incremental_state``."""
        bsz, tgt_len, _ = x.shape
        linear = linear_of(self)
        weight, bias = self.qkv_weight_and_bias()
        qkv = linear(x, weight, bias).view(bsz, tgt_len, 3, self.num_heads, self.head_dim)
        if incremental_state is None and not need_weights:  # training: one packed op
            ctx = ops.attention_packed(qkv, key_padding_mask, causal=causal,
                                       dropout_p=self.dropout, training=self.training)
            return linear(_merge_heads(ctx), self.out_proj.weight), None
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, T, D]
        if incremental_state is not None:
            if kv_cache is None:
                kv_cache = self._own_kv_cache(incremental_state)
            k, v, key_padding_mask = kv_cache.append(qkv[:, :, 1:], key_padding_mask)
            table = kv_cache.row_table
            if table is not None:  # one query per row over a fixed-shape cache
                ctx, probs = _through_table(q, k, v, table, key_padding_mask, need_weights)
                return linear(_merge_heads(ctx), self.out_proj.weight), probs
        ctx, probs = ops.attention(
            q, k, v, key_padding_mask, causal=causal, dropout_p=self.dropout,
            training=self.training, need_weights=need_weights,
        )
        return linear(_merge_heads(ctx), self.out_proj.weight), probs

    def _own_kv_cache(self, incremental_state) -> LayerKVCache:
        state = self.get_incremental_state(incremental_state, "kv_cache")
        if state is None:
            state = {"cache": SelfAttentionKVCache(num_layers=1)}
            self.set_incremental_state(incremental_state, "kv_cache", state)
        return state["cache"].layers[0]

    def reorder_incremental_state(
        self, incremental_state: Dict[str, Dict[str, Optional[Tensor]]], new_order: Tensor
    ):
        """Reorders this module's own cache; a decoder's shared cache is its decoder's to
        reorder."""
        state = self.get_incremental_state(incremental_state, "kv_cache")
        if state is not None:
            state["cache"].reorder(new_order)
        return incremental_state


class CrossAttention(_Attention):
    """Decoder-to-encoder attention. Keys/values are computed outside, for all layers at once.

    ``k_proj``/``v_proj`` live here (fairseq's ``encoder_attn.k_proj``...), but the decoder's
    :class:`LayerBatchedEncoderKV` reads them to project the encoder output in one GEMM.
    """

    def __init__(self, embed_dim: int, num_heads: int, kdim: int, vdim: int, dropout: float = 0.0,
                 fp8: bool = False):
        super().__init__(embed_dim, num_heads, kdim, vdim, dropout, fp8)

    def forward(self, x: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
                need_weights: bool = False, rows: Optional[Tensor] = None):
        """x [B, T, C], k/v [B, H, S, D] -> (out_proj(ctx) without bias, probs or None).

        With ``rows`` [B] (decoding, one query per row), k/v are [N, H, S, D], stored once per
        sentence: row ``b`` attends over ``k[rows[b]]``, ``v[rows[b]]``."""
        bsz, tgt_len, _ = x.shape
        linear = linear_of(self)
        q = linear(x, self.q_proj.weight, self.q_proj.bias)
        q = q.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        if rows is not None:
            table = rows.unsqueeze(1).expand(bsz, k.size(2))
            ctx, probs = _through_table(q, k, v, table, key_padding_mask, need_weights)
            return linear(_merge_heads(ctx), self.out_proj.weight), probs
        ctx, probs = ops.attention(
            q, k, v, key_padding_mask, causal=False, dropout_p=self.dropout,
            training=self.training, need_weights=need_weights,
        )
        return linear(_merge_heads(ctx), self.out_proj.weight), probs
