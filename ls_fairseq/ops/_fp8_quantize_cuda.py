"""CUDA binding of :mod:`ls_fairseq.ops.fp8_linear`'s quantization (``csrc/fp8_quantize.cu``).

Ops:

* ``fp8_quantize(t, dtype, transpose_pad) -> (t8, inv_scale, t8_transposed)``: for a 2-D ``t``
  [R, C] (float32/float16/bfloat16), ``fp8_linear.quantize(t, dtype)`` bit for bit (the float8
  bytes and the float32 inverse scale), in two passes over ``t`` (amax, then scale + clamp +
  cast). With ``transpose_pad > 0`` the second pass also writes ``fp8_linear.transposed(t8,
  transpose_pad)`` [C, R'] (R' = R rounded up to ``transpose_pad``, the extra columns zero);
  with 0 the third output is empty ([0]).
* ``fp8_transpose(t8, pad) -> [C, R']``: ``fp8_linear.transposed(t8, pad)`` in one pass, for a
  2-D tensor of any 1-byte dtype (float8 here; uint8 too, the same bytes).

Neither op is differentiable (fp8_linear's autograd calls them). Their fake-tensor shapes are
registered here once the extension is loaded (``_extension.when_loaded``). What they take is
:func:`supports` / :func:`supports_transpose`; the public module runs the reference otherwise.
"""
import torch

from . import _extension

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def supports(t) -> bool:
    """Whether ``fp8_quantize`` takes ``t``: 2-D (any rows, any strides) of float32, float16 or
    bfloat16."""
    return t.dim() == 2 and t.dtype in _extension.KERNEL_DTYPES


def supports_transpose(t8) -> bool:
    """Whether ``fp8_transpose`` takes ``t8``: 2-D float8 (e4m3fn or e5m2)."""
    return t8.dim() == 2 and t8.dtype in FP8_DTYPES


def _padded(rows, multiple):
    return (rows + multiple - 1) // multiple * multiple


def _register():
    @torch.library.register_fake("ls_fairseq::fp8_quantize")
    def _quantize_fake(t, dtype, transpose_pad):
        rows, cols = t.shape
        transposed = ((cols, _padded(rows, transpose_pad)) if transpose_pad > 0 else (0,))
        return (t.new_empty((rows, cols), dtype=dtype), t.new_empty((), dtype=torch.float32),
                t.new_empty(transposed, dtype=dtype))

    @torch.library.register_fake("ls_fairseq::fp8_transpose")
    def _transpose_fake(t8, pad):
        rows, cols = t8.shape
        return t8.new_empty((cols, _padded(rows, pad)))


_extension.when_loaded(_register)


def fp8_quantize_cuda(t, fp8_dtype, transpose_pad: int = 0):
    """``(t8, inv_scale, t8_transposed)`` (see the module docstring); the third is empty when
    ``transpose_pad`` is 0. For ``t`` that :func:`supports` takes."""
    return torch.ops.ls_fairseq.fp8_quantize(t, fp8_dtype, int(transpose_pad))


def fp8_transpose_cuda(t8, multiple: int = 1):
    """``t8`` [R, C] -> [C, R'] (R' = R rounded up to ``multiple``, the extra columns zero), for
    ``t8`` that :func:`supports_transpose` takes."""
    return torch.ops.ls_fairseq.fp8_transpose(t8, int(multiple))
