"""Input embedding of the encoder and decoder: ``dropout(scale * E[tokens] + P[positions])``."""
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor
from fairseq import utils
from fairseq.modules import SinusoidalPositionalEmbedding

from .. import ops


class TransformerEmbedding(nn.Module):
    """Embeds tokens exactly like fairseq's ``forward_embedding``, through one fused op.

    It owns no parameters: the token table (``embed_tokens``, possibly shared between encoder,
    decoder and output projection) and the positional table (``embed_positions``, fairseq's own
    learned or sinusoidal module) stay attributes of the encoder/decoder under fairseq's names, and
    are passed in. ``zero_pad`` zeroes padded positions after dropout (the encoder does this).

    Rare options that sit between the lookup and the sum (``--decoder-input-dim`` projection,
    ``--layernorm-embedding``) run as separate steps with the same math.
    """

    def __init__(self, embed_dim: int, padding_idx: int, scale: float, dropout: float,
                 zero_pad: bool, max_positions: int, side: str):
        super().__init__()
        self.embed_dim = embed_dim
        self.padding_idx = padding_idx
        self.scale = scale
        self.dropout = dropout
        self.zero_pad = zero_pad
        self.max_positions = max_positions
        self.side = side  # "source" or "target": names the --max-*-positions flag in errors
        self._outgrown = []  # sinusoidal tables replaced by larger ones (see positional_table)

    def positional_table(self, embed_positions: Optional[nn.Module], seq_len: int):
        if embed_positions is None:
            return None
        needed = self.padding_idx + 1 + seq_len
        if isinstance(embed_positions, SinusoidalPositionalEmbedding):
            if needed > embed_positions.weights.size(0):  # grow, as fairseq does; no cap
                # CUDA graphs captured before (--ls-cuda-graphs) read the old table's memory: it
                # is kept alive, and its rows are the new table's first rows (a row depends
                # only on its position), so their replays stay right
                self._outgrown.append(embed_positions.weights)
                embed_positions.weights = SinusoidalPositionalEmbedding.get_embedding(
                    needed, embed_positions.embedding_dim, self.padding_idx
                ).to(embed_positions.weights)
            return embed_positions.weights
        if needed > embed_positions.weight.size(0):
            raise ValueError(
                f"a {self.side} sequence of {seq_len} tokens is longer than the learned positional "
                f"table ({embed_positions.weight.size(0) - self.padding_idx - 1} positions); raise "
                f"--max-{self.side}-positions (currently {self.max_positions}) and retrain, or filter "
                "longer sentences"
            )
        return embed_positions.weight

    def positions(self, tokens, incremental: bool):
        if incremental:  # fairseq: every row of a decoding step sits at position pad + len
            return torch.full((tokens.size(0), 1), self.padding_idx + tokens.size(1),
                              dtype=torch.long, device=tokens.device)
        return utils.make_positions(tokens, self.padding_idx)

    def forward(self, tokens, embed_tokens: nn.Embedding, embed_positions: Optional[nn.Module],
                layernorm_embedding: Optional[nn.Module] = None,
                project_in_dim: Optional[nn.Module] = None, incremental: bool = False,
                positions: Optional[Tensor] = None, max_len: Optional[int] = None):
        """tokens [B, T] -> [B, T', C] (T' = 1 for an incremental decoding step).

        ``positions`` [B, T'] (incremental only): given instead of counted from ``tokens``, with
        ``max_len`` the most tokens a sequence can reach (a fixed-shape decoding step, whose
        position lives in a device tensor)."""
        if positions is not None and (not incremental or max_len is None):
            raise ValueError("explicit positions are for incremental decoding, with max_len")
        pos_table = self.positional_table(
            embed_positions, max_len if positions is not None else tokens.size(1))
        if pos_table is None:
            positions = None
        elif positions is None:
            positions = self.positions(tokens, incremental)
        if incremental:
            tokens = tokens[:, -1:]
        if project_in_dim is None and layernorm_embedding is None:
            return ops.transformer_embedding(
                tokens, positions, embed_tokens.weight, pos_table, self.scale, self.padding_idx,
                self.dropout, self.training, self.zero_pad,
            )
        # uncommon configurations: same steps as fairseq, unfused
        x = self.scale * embed_tokens(tokens)
        if project_in_dim is not None:
            x = project_in_dim(x)
        if pos_table is not None:
            x = x + nn.functional.embedding(positions, pos_table, self.padding_idx)
        if layernorm_embedding is not None:
            x = layernorm_embedding(x)
        x = nn.functional.dropout(x, p=self.dropout, training=self.training)
        if self.zero_pad:
            x = x * (1 - tokens.eq(self.padding_idx).unsqueeze(-1).type_as(x))
        return x
