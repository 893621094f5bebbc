"""Attention of one decoding step over keys/values addressed through a row table.

Beam search reorders its hypotheses at every step. A cache that moves every row's keys/values
to follow them (fairseq's ``reorder_incremental_state``) copies the whole cache each step; here
the keys/values stay where they were written and a small table says where each one is:

    out[r, h] = softmax_t(q[r, h] . k[rows[r, t], h, t] * D^-0.5, masked) @ v[rows[r, t], h, t]

* ``q`` [R, H, D]: one query per row (this step's);
* ``k``, ``v`` [N, H, T, D], any strides: a self-attention cache (N = R, each position written
  once, by the row that was at that index then) or cross-attention keys/values stored once per
  sentence (N = sentences; ``rows[r, t] = r // beam`` for every ``t``, an expanded view);
* ``rows`` [R, T] integer, any strides (an expanded view is fine), values in ``[0, N)``;
* ``key_padding_mask`` [R, T] bool (True: not attended) or None.

The math is :func:`~ls_fairseq.ops.attention.attention_reference`'s (fairseq's): ``q`` scaled by
``D ** -0.5`` in its own dtype, scores in the input dtype, softmax in fp32, probabilities cast back
to the input dtype before the product with ``v``; a row whose keys are all masked yields zeros.
Inference only (no autograd).

The CUDA kernel (``csrc/decode_attention.cu``) reads only the unmasked positions, so a
fixed-capacity cache costs what its filled positions cost, with the same shapes at every step (a
CUDA graph replays it); where it does not apply (fp32, other head sizes, ``_decode_attention_cuda.
supports``) the reference runs: it gathers the keys/values (one copy of each per call).
"""
from typing import Optional

import torch
from torch import Tensor

from . import _extension
from .attention import attention_reference


def _check(q: Tensor, k: Tensor, v: Tensor, rows: Tensor, key_padding_mask: Optional[Tensor]):
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"decode_attention needs q [R, H, D] and k, v [N, H, T, D] of one shape; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    rows_n, heads, head_dim = q.shape
    if k.size(1) != heads or k.size(3) != head_dim:
        raise ValueError(f"decode_attention: k/v {tuple(k.shape)} do not have q's {heads} heads of "
                         f"{head_dim}")
    if rows.shape != (rows_n, k.size(2)) or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"decode_attention needs rows [R, T] = {(rows_n, k.size(2))} of int32 or "
                         f"int64, got {tuple(rows.shape)} {rows.dtype}")
    if key_padding_mask is not None and (key_padding_mask.shape != rows.shape
                                         or key_padding_mask.dtype != torch.bool):
        raise ValueError(f"decode_attention needs key_padding_mask [R, T] = {tuple(rows.shape)} "
                         f"bool, got {tuple(key_padding_mask.shape)} {key_padding_mask.dtype}")


def gather_rows(k: Tensor, rows: Tensor) -> Tensor:
    """``k`` [N, H, T, D] -> [R, H, T, D] with ``out[r, :, t] = k[rows[r, t], :, t]``."""
    positions = torch.arange(k.size(2), device=k.device)
    return k[rows.long(), :, positions].permute(0, 2, 1, 3)  # indexing puts [R, T] first


def decode_attention_reference(q: Tensor, k: Tensor, v: Tensor, rows: Tensor,
                               key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """out [R, H, D] (see the module docstring): the gathered keys/values through
    :func:`attention_reference`."""
    _check(q, k, v, rows, key_padding_mask)
    return _gathered(q, k, v, rows, key_padding_mask)


def _gathered(q, k, v, rows, key_padding_mask):
    """The reference's math on checked inputs."""
    values = gather_rows(v, rows)
    if key_padding_mask is not None:  # masked positions are never read (they may be unwritten)
        values = values.masked_fill(key_padding_mask[:, None, :, None], 0)
    out, _ = attention_reference(q.unsqueeze(2), gather_rows(k, rows), values, key_padding_mask)
    return out.squeeze(2)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, rows: Tensor,
                     key_padding_mask: Optional[Tensor] = None) -> Tensor:
    _check(q, k, v, rows, key_padding_mask)
    if _extension.use_kernels(q) and _extension.has_op("decode_attention"):
        from . import _decode_attention_cuda as cuda

        if cuda.supports(q, k, v, rows, key_padding_mask):
            return cuda.decode_attention_cuda(q, k, v, rows, key_padding_mask)
    return _gathered(q, k, v, rows, key_padding_mask)
