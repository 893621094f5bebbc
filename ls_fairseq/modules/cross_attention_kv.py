"""Layer-batched cross-attention keys and values.

The encoder output is the same input for every decoder layer's ``encoder_attn.k_proj`` and
``v_proj``. Stacking those 2L weight matrices turns 2L GEMMs into one; autograd of the same
``F.linear`` then computes the weight gradient of all layers in one GEMM and the encoder-output
gradient in another. The stacked weight is rebuilt from the layers' own parameters on every call,
so there is no state beyond the parameters (no process-global registry), and several models in
one process are independent.
"""
from typing import List, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .attention import CrossAttention


class LayerBatchedEncoderKV(nn.Module):
    """Projects the encoder output to every decoder layer's cross-attention keys and values."""

    def project(self, encoder_out: Tensor, attns: Sequence[CrossAttention]) -> Tensor:
        """encoder_out [B, S, C_enc] -> kv [B, S, 2L, H, D] (layer l: k at 2l, v at 2l + 1)."""
        weight = torch.cat([w for m in attns for w in (m.k_proj.weight, m.v_proj.weight)])
        bias = torch.cat([b for m in attns for b in (m.k_proj.bias, m.v_proj.bias)])
        bsz, src_len, _ = encoder_out.shape
        return F.linear(encoder_out, weight, bias).view(
            bsz, src_len, 2 * len(attns), attns[0].num_heads, attns[0].head_dim
        )

    @staticmethod
    def split(kv: Tensor) -> List[Tuple[Tensor, Tensor]]:
        """kv [B, S, 2L, H, D] -> per layer (k, v), [B, H, S, D] views."""
        # unbind's backward stacks the per-layer gradients into one buffer (one copy, no zero-fill
        # per layer), which then feeds the two GEMMs of F.linear's backward
        parts = [t.transpose(1, 2) for t in kv.unbind(2)]
        return [(parts[2 * i], parts[2 * i + 1]) for i in range(len(parts) // 2)]
