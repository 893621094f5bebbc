import torch.nn as nn

from .. import ops


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (fairseq's eps 1e-5, same parameter names) running the fused op."""

    def forward(self, x):
        return ops.layer_norm(x, self.weight, self.bias, self.eps)
