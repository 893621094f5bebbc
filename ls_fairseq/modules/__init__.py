"""Transformer layers built on the fused ops (``ls_fairseq.ops``).

Every module keeps fairseq's parameter names and shapes (``self_attn.q_proj.weight``,
``fc1.bias``, ...), so an ls_ model's state_dict is exactly fairseq's, and constructs its
parameters in fairseq's order, so the same ``--seed`` gives the same initial weights.
Internally activations are batch-major ``[B, T, C]``. When decoding, the self-attention keys and
values of all decoder layers live in one preallocated, growable buffer (:mod:`.kv_cache`).
"""
from .attention import CrossAttention, SelfAttention
from .cross_attention_kv import LayerBatchedEncoderKV
from .decoder_layer import TransformerDecoderLayer
from .embedding import TransformerEmbedding
from .encoder_layer import TransformerEncoderLayer
from .kv_cache import LayerKVCache, SelfAttentionKVCache, StaticKVCache
from .layer_norm import LayerNorm

__all__ = [
    "CrossAttention",
    "LayerBatchedEncoderKV",
    "LayerKVCache",
    "LayerNorm",
    "SelfAttention",
    "SelfAttentionKVCache",
    "StaticKVCache",
    "TransformerDecoderLayer",
    "TransformerEmbedding",
    "TransformerEncoderLayer",
]
