"""When the cuBLASLt-epilogue GEMMs (``csrc/gemm_epilogues.cpp``) replace the unfused path.

``LS_FAIRSEQ_GEMM_EPILOGUES=off`` (default ``on``) keeps the unfused path (aten's GEMMs and column
sums, the separate relu/dropout backward) for A/B runs; both compute the same math. The fused path
takes fp16/bf16 with a weight whose sizes are multiples of 8; anything else runs the unfused path.
"""
import os

import torch

ENV_VAR = "LS_FAIRSEQ_GEMM_EPILOGUES"
_SUPPORTED = (torch.float16, torch.bfloat16)
MASK_BITS = 128  # cuBLASLt: the ReLU bit-mask's leading dimension is a multiple of 128 bits


def enabled() -> bool:
    value = os.environ.get(ENV_VAR, "on").strip().lower() or "on"
    if value not in ("on", "off"):
        raise ValueError(f"{ENV_VAR}={value!r} is not one of on, off")
    return value == "on"


def mask_bytes(features: int) -> int:
    """Bytes per row of the ReLU bit-mask of ``features`` columns."""
    return (features + MASK_BITS - 1) // MASK_BITS * MASK_BITS // 8


def usable(x, weight, bias) -> bool:
    """True when the epilogue ops take these tensors (the extension is loaded): fp16/bf16 of one
    dtype, a 2-D weight whose sizes are multiples of 8 (16-byte rows for cuBLASLt), 16-byte aligned
    data, and the epilogues switched on."""
    tensors = [t for t in (x, weight, bias) if t is not None]
    return (
        x.dtype in _SUPPORTED
        and all(t.dtype == x.dtype for t in tensors)
        and weight.dim() == 2
        and weight.size(0) % 8 == 0
        and weight.size(1) % 8 == 0
        and all(t.data_ptr() % 16 == 0 for t in tensors)
        and enabled()
    )
