"""Batches padded up to a few bucketed shapes, so CUDA graphs are replayed from the first epoch on.

Why: ``--ls-cuda-graphs`` captures one graph pair per batch shape (batch size, source length,
target length) and replays it at the shape's later sightings. fairseq's batches
(``--max-tokens``) have many shapes: ``bench/shape_buckets.py`` finds thousands in an epoch of a
WMT14-sized corpus (4.5M pairs) at 8192 tokens, so with at most 256 graphs kept most steps run
eagerly or pay for a capture (a capture costs more than an eager step).

``--ls-shape-buckets N`` pads each training batch up to a shape chosen by ``ShapeBuckets``:
an earlier batch's padded shape when that one holds the batch and costs at most
``--ls-shape-bucket-slack`` more token slots than the batch's own shape, otherwise the batch's
shape rounded up on a grid with ``N`` steps per doubling of each dimension (``bucket``; 16: each
dimension grows by less than 1/16). On the WMT14-sized corpus that leaves a few hundred shapes
at the cost of a few percent more token slots, and nearly every step of epoch 1 replays
(``bench/shape_buckets.py`` with N 16, slack 0.2); the first epoch then runs faster than with one
graph per batch shape (docs/PERFORMANCE.md).

The padding keeps every real token's math (``pad_batch``):

* the source grows on the side the task pads (fairseq's ``--left-pad-source``, default True),
  the target on the right, with the padding index: the encoder and the decoder mask padded keys,
  positions count only non-padding tokens (fairseq's ``make_positions``), and the decoder is
  causal, so no real position sees an added one. Left-padded targets (``--left-pad-target``)
  are not padded: a decoder query on a left padding column has no key to attend to;
* extra batch rows are dummies: a source of one end-of-sentence token (an all-padding row would
  make its attention softmax divide by zero, and NaN times a zero gradient is still NaN in the
  weight gradients), a decoder input that starts with end-of-sentence, and an all-padding target;
* the loss ignores padding targets, so the dummy rows and padded positions get exactly zero
  gradient, and the logged values (tokens, sentences, sample size) come from the unpadded batch.

What changes is only which random numbers dropout draws for which position (the masks have
another shape), as between any two runs with different batch layouts.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import switches

# the net_input keys of fairseq's translation batches; any other key (e.g. alignments) is not
# padded and the batch runs at its own shape
PADDED_KEYS = frozenset({"src_tokens", "src_lengths", "prev_output_tokens"})

Shape = Tuple[int, int, int]  # rows, source length, target length


def bucket(n: int, steps: int) -> int:
    """The smallest value >= n on a grid with ``steps`` points per doubling: 2**k + j * step in
    [2**k, 2**(k+1)], step = max(1, 2**k // steps), so it exceeds n by less than n / steps.
    0 steps: n itself."""
    if steps <= 0 or n <= steps:
        return n
    low = 1 << (n.bit_length() - 1)
    step = max(1, low // steps)
    return min(low + -(-(n - low) // step) * step, 2 * low)


def _pad_rows(x: torch.Tensor, length: int, rows: int, value: int, left: bool) -> torch.Tensor:
    """[B, T] -> [rows, length]: columns added on the left or right, rows at the bottom."""
    extra = length - x.size(1)
    return F.pad(x, (extra, 0, 0, rows - x.size(0)) if left else (0, extra, 0, rows - x.size(0)),
                 value=value)


def token_slots(shape: Shape) -> int:
    """Source plus target positions of a batch shape, padding included."""
    rows, src_len, tgt_len = shape
    return rows * (src_len + tgt_len)


class ShapeBuckets:
    """Chooses each batch's padded shape and pads the batch (``pad``, which needs ``tokens``).
    One instance per criterion: the shapes chosen so far are its own (no process-wide state)."""

    def __init__(self, steps: int, slack: float, tokens: Optional["Tokens"] = None):
        if steps < 0 or steps & (steps - 1):
            # powers of two: grid steps are then powers of two too, so lengths padded to a
            # multiple of a power of two (--required-seq-len-multiple) stay multiples of it
            raise switches.Refused(f"--ls-shape-buckets must be 0 (no padding) or a power of "
                                   f"two, got {steps}")
        switches.at_least("--ls-shape-bucket-slack", slack, 0)
        self.steps, self.slack, self.tokens = steps, slack, tokens
        self.shapes: List[Shape] = []  # padded shapes chosen so far, in order of first use

    def pad(self, sample: Dict) -> Dict:
        """``sample`` padded up to its chosen shape, or ``sample`` itself when it is already
        that shape or is not a batch ``pad_batch`` can pad."""
        shape = batch_shape(sample)
        if shape is None:
            return sample
        padded = self.shape_for(shape)
        return sample if padded == shape else pad_batch(sample, padded, self.tokens)

    def shape_for(self, shape: Shape) -> Shape:
        """The cheapest earlier padded shape that holds ``shape`` within the slack, else
        ``shape`` rounded up on the grid (remembered for later batches)."""
        budget = (1 + self.slack) * token_slots(shape)
        best, best_slots = None, None
        for s in self.shapes:  # a few hundred at most (bench/shape_buckets.py)
            if s[0] >= shape[0] and s[1] >= shape[1] and s[2] >= shape[2]:
                slots = token_slots(s)
                if slots <= budget and (best is None or slots < best_slots):
                    best, best_slots = s, slots
        if best is None:
            best = tuple(bucket(n, self.steps) for n in shape)
            if best not in self.shapes:  # its own rounding may exceed the slack
                self.shapes.append(best)
        return best


def batch_shape(sample: Dict) -> Optional[Shape]:
    """(rows, source length, target length) of a translation batch ``pad_batch`` can pad, or
    None (other ``net_input`` keys, missing tensors, unexpected ranks)."""
    net_input, target = sample.get("net_input"), sample.get("target")
    if not isinstance(net_input, dict) or set(net_input) != PADDED_KEYS or \
            not all(torch.is_tensor(net_input[k]) for k in PADDED_KEYS) or \
            not torch.is_tensor(target):
        return None
    src, prev = net_input["src_tokens"], net_input["prev_output_tokens"]
    if src.dim() != 2 or prev.dim() != 2 or target.shape != prev.shape or \
            src.size(0) != prev.size(0) or net_input["src_lengths"].shape != (src.size(0),):
        return None
    return src.size(0), src.size(1), prev.size(1)


@dataclass(frozen=True)
class Tokens:
    """What ``pad_batch`` writes: the dictionaries' padding and end-of-sentence indices and the
    side the task pads sources on (targets are right-padded)."""
    src_pad: int
    src_eos: int
    tgt_pad: int
    tgt_eos: int
    left_pad_source: bool


def pad_batch(sample: Dict, shape: Shape, tokens: Tokens) -> Dict:
    """The batch padded up to ``shape`` (>= ``batch_shape(sample)`` in every dimension): a new
    dict, ``sample`` is not changed."""
    net_input, target = sample["net_input"], sample["target"]
    src, prev = net_input["src_tokens"], net_input["prev_output_tokens"]
    rows, src_len, tgt_len = shape
    b, left = src.size(0), tokens.left_pad_source
    src = _pad_rows(src, src_len, rows, tokens.src_pad, left)
    prev = _pad_rows(prev, tgt_len, rows, tokens.tgt_pad, False)
    if rows > b:  # dummy rows: one end-of-sentence token in the source and the decoder input
        src[b:, -1 if left else 0] = tokens.src_eos
        prev[b:, 0] = tokens.tgt_eos
    lengths = F.pad(net_input["src_lengths"], (0, rows - b), value=1)
    padded = dict(sample)
    padded["net_input"] = {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev}
    padded["target"] = _pad_rows(target, tgt_len, rows, tokens.tgt_pad, False)
    return padded
