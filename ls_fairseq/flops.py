"""Model FLOPs of a Transformer training step, and the GPU's dense 16-bit peak from the
vendor's datasheet (for MFU).

What is counted: the matrix multiplies of the model as the paper describes it, for the batch's
real (non-padding) tokens; every multiply-add is 2 FLOPs, and a training step is 3× the forward
(the backward computes the gradients of both operands of every product). Per encoder layer
(width ``d``, FFN width ``f``), for a sentence of ``s`` source and ``t`` target tokens:

* self-attention projections (Q, K, V, out) ``8·d²·s`` and FFN ``4·d·f·s``;
* attention scores and weighted sum ``4·d·s²`` (every query against every key);

per decoder layer: self-attention ``8·d²·t + 4·d·t²`` (the full square: the causal mask is not
discounted, as in the usual MFU convention), cross-attention projections ``4·d²·t`` (Q, out) and
``4·d·d_enc·s`` (K, V of the encoder output), cross scores and sum ``4·d·s·t``, FFN ``4·d·f·t``;
and the output projection ``2·d·V·t``. Embedding lookups, LayerNorm, softmax, dropout and the
loss are not counted (they are not matrix multiplies; PyTorch's FlopCounterMode does not count
them either). tests/test_flops.py checks the formula against FlopCounterMode's count of one
forward+backward of fairseq's ``transformer`` and of ``ls_transformer``.

MFU = achieved model FLOP/s / (the GPU's dense fp16/bf16 tensor-core peak × GPUs), whatever the
training precision. The peaks are the vendors' datasheet figures (``DENSE_16BIT_PEAK_TFLOPS``),
not measured here; on a GPU not in the table the criterion logs ``tflops`` without ``mfu``.
"""
import functools
from dataclasses import dataclass

import torch

from .wrappers import innermost

#: the vendors' datasheet peaks, not measured figures: dense (no sparsity) fp16/bf16 tensor-core
#: TFLOP/s, by a substring of the device name (first match wins)
DENSE_16BIT_PEAK_TFLOPS = (
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM / HBM3
    ("H800", 989.4),
    ("GH200", 989.4),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.1),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("RTX 4090", 165.2),
    ("RTX 3090", 71.0),
    ("V100", 125.0),
)


def peak_tflops(device_name: str):
    """The dense 16-bit peak of a device called ``device_name``, or None if unknown."""
    for key, tflops in DENSE_16BIT_PEAK_TFLOPS:
        if key in device_name:
            return tflops
    return None


@functools.lru_cache(maxsize=None)
def device_peak_tflops(index: int = 0):
    """The peak of CUDA device ``index`` (None without CUDA or for an unknown GPU). Cached: a
    device's name does not change while the process runs."""
    if not torch.cuda.is_available():
        return None
    return peak_tflops(torch.cuda.get_device_name(index))


@dataclass(frozen=True)
class TransformerFlops:
    """Training FLOPs of an encoder-decoder Transformer as a function of a batch's lengths:
    ``per_src·S + per_tgt·T + src_sq·Σs² + tgt_sq·Σt² + cross·Σs·t`` (sums over sentences)."""

    per_src: float
    per_tgt: float
    src_sq: float
    tgt_sq: float
    cross: float

    @classmethod
    def of(cls, enc_dim, enc_ffn, enc_layers, dec_dim, dec_ffn, dec_layers, vocab):
        d, f, n = enc_dim, enc_ffn, enc_layers
        e, g, m = dec_dim, dec_ffn, dec_layers
        fwd = dict(
            per_src=n * (8 * d * d + 4 * d * f) + m * 4 * e * d,
            per_tgt=m * (8 * e * e + 4 * e * e + 4 * e * g) + 2 * e * vocab,
            src_sq=n * 4 * d,
            tgt_sq=m * 4 * e,
            cross=m * 4 * e,
        )
        return cls(**{k: 3.0 * v for k, v in fwd.items()})

    @classmethod
    def of_model(cls, model):
        """From a fairseq encoder-decoder Transformer (fairseq's ``transformer`` or
        ``ls_transformer``, possibly inside the trainer's wrappers), or None for another model."""
        model = innermost(model)
        cfg = getattr(model, "cfg", None)
        enc, dec = getattr(cfg, "encoder", None), getattr(cfg, "decoder", None)
        decoder = getattr(model, "decoder", None)
        if enc is None or dec is None or decoder is None:
            return None
        projection = getattr(decoder, "output_projection", None)
        weight = getattr(projection, "weight", None)
        vocab = weight.shape[0] if weight is not None else len(getattr(decoder, "dictionary", []))
        try:
            return cls.of(int(enc.embed_dim), int(enc.ffn_embed_dim), int(enc.layers),
                          int(dec.embed_dim), int(dec.ffn_embed_dim), int(dec.layers), int(vocab))
        except (TypeError, ValueError):
            return None

    def of_lengths(self, src_lengths: torch.Tensor, tgt_lengths: torch.Tensor) -> torch.Tensor:
        """The batch's training FLOPs as a float64 tensor on the lengths' device (no host
        read: the caller sends it to the host with the other logged values)."""
        s, t = src_lengths.double(), tgt_lengths.double()
        return (self.per_src * s + self.per_tgt * t + self.src_sq * s * s + self.tgt_sq * t * t
                + self.cross * s * t).sum()
