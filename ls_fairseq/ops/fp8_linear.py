"""FP8 linear layers (``--ls-fp8``): ``x @ weight.T (+ bias)`` with float8 operands.

The recipe is per-tensor *current* (dynamic) scaling. Each call scales an operand by
``fp8_max / amax(|operand|)``, clamps it to ``±fp8_max`` and casts it to float8. The forward
operands ``x`` and ``weight`` go to ``float8_e4m3fn`` (max 448). The gradient of the output goes
to ``float8_e5m2`` (max 57344: more range, less precision) for the two backward matmuls:

* ``out    = x8 @ w8.T * (1/s_x)(1/s_w)       (+ bias)``  [M, N]
* ``grad_x = g8 @ w8   * (1/s_g)(1/s_w)``                 [M, K]
* ``grad_w = g8.T @ x8 * (1/s_g)(1/s_x)``                 [N, K]
* ``grad_b = sum of the rows of grad_out``, in float32

Products of float8 values are exact in float32, and the sums are float32. The results come out in
``x``'s dtype (gradients: each input's dtype). The amaxes, scales and casts run on the device,
with no ``.item()`` and no host synchronisation, so a CUDA graph can capture the training step.
An all-zero operand does not make its scale inf or NaN: its amax is floored at
:data:`AMAX_FLOOR`. A non-finite operand makes the result non-finite, so fp16 overflow checks
still see it. An inf gives amax inf, scale 0, and inf * 0 = NaN. A NaN stays NaN through the clamp
and the cast (e4m3fn and e5m2 both have NaN). Weights, optimizer and checkpoints are unchanged:
the parameters stay fp16/bf16/fp32, and the operands are cast on every call.

The op and its autograd are Python, one ``torch.library.custom_op``,
``ls_fairseq::fp8_linear_fwd``, whose fake implementation and ``register_autograd`` backward are
registered at import, without the extension. It runs on the CPU, under CUDA graph capture and
under ``torch.compile``. The op returns the output, the float8 copies and the inverse scales.
The copies are returned because ``setup_context`` sees only the op's inputs and outputs, and
they are marked non-differentiable. Autograd saves those float8 copies and scales, never the
high-precision inputs: ``x`` and ``weight`` cost 1 byte per element until the backward, not 2 or
4. The backward quantizes the gradient and runs the same matmuls. The backward's contractions
run over N and M, so it needs ``w8`` and ``x8`` transposed; those are made in the backward from
the saved copies (autograd keeps one float8 layout of each operand, not two).

Quantization: :func:`quantize` and :func:`transposed` are the reference (PyTorch ops, ~6
elementwise passes per operand). On the ``_scaled_mm`` path, where the extension is loaded
(``LS_FAIRSEQ_KERNELS``, ``_extension.use_kernels``), the fused kernels of
``csrc/fp8_quantize.cu`` (binding ``_fp8_quantize_cuda``) do the same bit for bit: one amax pass
and one scale + clamp + cast pass, whose second pass also writes the gradient's transposed copy,
and a one-pass transpose of ``w8`` and ``x8``. Anything they do not take runs the reference.

The two paths differ only in how they multiply two quantized operands:

* :func:`matmul_reference`: float8 -> float32, ``torch.mm`` in float32, times the two inverse
  scales, rounded once to the output dtype. This is the specification. It runs on any device
  (the CPU, CI, GPUs without FP8 tensor cores).
* :func:`matmul_scaled_mm`: ``torch._scaled_mm`` (float32 accumulation, ``use_fast_accum=False``).
  Both paths quantize to the same float8 values and scales (:func:`quantize`, or the kernels
  that equal it), so their results differ only in the accumulation order.

``fp8_linear`` takes ``_scaled_mm`` where :func:`supports` holds. That means CUDA tensors on a
GPU of compute capability >= 8.9 (Ada, Hopper and later), K and N multiples of 16 (M is
zero-padded to 16 in the backward's weight-gradient GEMM), and ``LS_FAIRSEQ_KERNELS`` not
``off``. Otherwise the reference runs. Under ``LS_FAIRSEQ_KERNELS=require`` a CPU tensor or a
GPU without FP8 matmuls raises instead. A shape outside :func:`supports` takes the reference,
as the other ops' shapes do. Under ``auto`` a GPU without FP8 matmuls warns once.
"""
import functools
import warnings
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _extension

E4M3 = torch.float8_e4m3fn  # forward operands: x, weight
E5M2 = torch.float8_e5m2  # gradient of the output
#: amax floor: an all-zero operand gets a finite scale (fp8_max / 1e-12, fine in float32)
AMAX_FLOOR = 1e-12
#: FP8 tensor cores: Ada (8.9), Hopper (9.0) and later
MIN_CAPABILITY = (8, 9)
#: _scaled_mm's alignment: K and N of every GEMM (the backward's M is padded to it)
ALIGN = 16

_warned_no_fp8_gpu = False


def quantize(t: Tensor, fp8_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """``(t8, inv_scale)``: ``t * scale`` clamped to ``±fp8_max`` and cast to ``fp8_dtype``
    (contiguous), with ``scale = fp8_max / max(amax(|t|), AMAX_FLOOR)`` and ``inv_scale = 1 /
    scale`` as 0-dim float32 tensors on ``t``'s device (``t8 * inv_scale`` approximates ``t``)."""
    fp8_max = torch.finfo(fp8_dtype).max
    if t.numel() > 0:
        amax = t.abs().amax().float()
    else:  # amax has no identity: an empty operand has nothing to scale
        amax = torch.zeros((), dtype=torch.float32, device=t.device)
    # Tensor.__rtruediv__: reciprocal, then times fp8_max (two float32 roundings; the kernels
    # of csrc/fp8_quantize.cu round the same way)
    scale = fp8_max / amax.clamp_min(AMAX_FLOOR)
    # scaled in float32 (a fp16 product of a huge scale could overflow). The clamp saturates:
    # e4m3fn has no inf, and a value past its range would cast to NaN
    t8 = (t.float() * scale).clamp_(-fp8_max, fp8_max).to(fp8_dtype,
                                                         memory_format=torch.contiguous_format)
    return t8, scale.reciprocal()


def matmul_reference(a8: Tensor, a_inv: Tensor, b8: Tensor, b_inv: Tensor,
                     out_dtype: torch.dtype, bias: Optional[Tensor] = None) -> Tensor:
    """``a8 @ b8.T * a_inv * b_inv (+ bias)`` for a8 [M, C], b8 [N, C]: float32 matmul of the
    float8 values (exact products, float32 sums), rounded once to ``out_dtype``."""
    out = torch.mm(a8.float(), b8.float().t()).mul_(a_inv * b_inv)
    if bias is not None:
        out.add_(bias.float())
    return out.to(out_dtype)


def matmul_scaled_mm(a8: Tensor, a_inv: Tensor, b8: Tensor, b_inv: Tensor,
                     out_dtype: torch.dtype, bias: Optional[Tensor] = None) -> Tensor:
    """:func:`matmul_reference` with ``torch._scaled_mm``: a8 [M, C] row-major, b8 [N, C]
    row-major, so ``b8.t()`` is the column-major [C, N] operand it takes. Its scales are the
    dequantization factors (``out = scale_a * scale_b * (a8 @ mat2)``): the inverse scales."""
    # cuBLASLt adds a bias of the output's dtype in its epilogue (fp16/bf16 outputs only)
    epilogue = bias is not None and bias.dtype == out_dtype and out_dtype != torch.float32
    out = torch._scaled_mm(a8, b8.t(), a_inv, b_inv, bias=bias if epilogue else None,
                           out_dtype=out_dtype, use_fast_accum=False)
    if bias is not None and not epilogue:
        out = out + bias.to(out_dtype)
    return out


def transposed(t8: Tensor, multiple: int = 1) -> Tensor:
    """t8 [R, C] -> its transpose [C, R'] row-major, with R' = R rounded up to ``multiple`` and
    the extra columns zero (zeros add nothing to a contraction over R). The copy runs on uint8
    views: a plain byte copy and fill on every device, whatever float8 support it has."""
    rows, cols = t8.shape
    padded = -(-rows // multiple) * multiple
    out = torch.empty(cols, padded, dtype=torch.uint8, device=t8.device)
    out[:, :rows].copy_(t8.view(torch.uint8).t())
    if padded > rows:
        out[:, rows:].zero_()
    return out.view(t8.dtype)


def _matmul(scaled_mm: bool):
    return matmul_scaled_mm if scaled_mm else matmul_reference


def _kernels_take(t: Tensor, op: str) -> bool:
    """Whether the kernel ``op`` of ``csrc/fp8_quantize.cu`` (``fp8_quantize`` or
    ``fp8_transpose``) takes ``t``: a CUDA tensor, the extension loaded (``LS_FAIRSEQ_KERNELS``
    applies: a failed build warns once under ``auto``, raises under ``require``), and the
    binding's ``supports``. Asked on the ``_scaled_mm`` path only."""
    # a CPU tensor never reaches use_kernels (under require it would raise)
    if not (t.is_cuda and _extension.use_kernels(t) and _extension.has_op(op)):
        return False
    from . import _fp8_quantize_cuda as cuda

    return cuda.supports(t) if op == "fp8_quantize" else cuda.supports_transpose(t)


def _quantize(t: Tensor, fp8_dtype: torch.dtype, scaled_mm: bool,
              transpose_pad: int = 0) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(t8, inv_scale, transposed(t8, transpose_pad))`` (the third None for a pad of 0): the
    fused kernel on the ``_scaled_mm`` path where it takes ``t``, else :func:`quantize` and
    :func:`transposed`. Both give the same bytes and scale."""
    if scaled_mm and _kernels_take(t, "fp8_quantize"):
        from . import _fp8_quantize_cuda as cuda

        t8, inv_scale, t8_t = cuda.fp8_quantize_cuda(t, fp8_dtype, transpose_pad)
        return t8, inv_scale, (t8_t if transpose_pad else None)
    t8, inv_scale = quantize(t, fp8_dtype)
    return t8, inv_scale, (transposed(t8, transpose_pad) if transpose_pad else None)


def _transposed(t8: Tensor, multiple: int, scaled_mm: bool) -> Tensor:
    """:func:`transposed`, by the one-pass kernel on the ``_scaled_mm`` path where it takes
    ``t8``."""
    if scaled_mm and _kernels_take(t8, "fp8_transpose"):
        from . import _fp8_quantize_cuda as cuda

        return cuda.fp8_transpose_cuda(t8, multiple)
    return transposed(t8, multiple)


@torch.library.custom_op("ls_fairseq::fp8_linear_fwd", mutates_args=())
def fp8_linear_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                   scaled_mm: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [M, K], weight [N, K] -> (out [M, N] in x's dtype, x8, x_inv, w8, w_inv): the output
    and what the backward reads (float8 copies and inverse scales)."""
    x8, x_inv, _ = _quantize(x, E4M3, scaled_mm)
    w8, w_inv, _ = _quantize(weight, E4M3, scaled_mm)
    return _matmul(scaled_mm)(x8, x_inv, w8, w_inv, x.dtype, bias), x8, x_inv, w8, w_inv


@fp8_linear_fwd.register_fake
def _fp8_linear_fwd_fake(x, weight, bias, scaled_mm):
    scale = x.new_empty((), dtype=torch.float32)
    return (x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape, dtype=E4M3), scale,
            weight.new_empty(weight.shape, dtype=E4M3), scale.clone())


def _setup_context(ctx, inputs, output):
    _, weight, bias, scaled_mm = inputs
    ctx.save_for_backward(*output[1:])
    ctx.mark_non_differentiable(*output[1:])
    # the copies get no gradient: None, not zero tensors (autograd would otherwise fill one per
    # float8 copy and scale on every call)
    ctx.set_materialize_grads(False)
    ctx.scaled_mm = scaled_mm
    ctx.weight_dtype = weight.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad_out, *_saved_outputs_grads):
    x8, x_inv, w8, w_inv = ctx.saved_tensors
    scaled_mm = ctx.scaled_mm
    matmul = _matmul(scaled_mm)
    # g8 and (for the weight gradient) its transpose padded to 16 rows, from one quantization
    g8, g_inv, g8_t = _quantize(grad_out, E5M2, scaled_mm,
                                ALIGN if ctx.needs_input_grad[1] else 0)
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:  # [M, N] x [N, K]: contraction over N (a multiple of 16)
        grad_x = matmul(g8, g_inv, _transposed(w8, 1, scaled_mm), w_inv, grad_out.dtype)
    if ctx.needs_input_grad[1]:  # [N, M] x [M, K]: contraction over the tokens, padded to 16
        grad_w = matmul(g8_t, g_inv, _transposed(x8, ALIGN, scaled_mm), x_inv, ctx.weight_dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        grad_b = grad_out.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return grad_x, grad_w, grad_b, None


fp8_linear_fwd.register_autograd(_backward, setup_context=_setup_context)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_device(t: Tensor) -> bool:
    """Whether ``t`` is on a GPU with FP8 tensor cores (compute capability >= 8.9)."""
    return t.is_cuda and _capability(t.device.index) >= MIN_CAPABILITY


def supports(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> bool:
    """What ``torch._scaled_mm`` takes for all three GEMMs of the op: x [M, K] (M > 0) and
    weight [N, K] on a GPU with FP8 tensor cores, of the kernels' dtypes (fp16, bf16, fp32),
    K and N multiples of 16 (its alignment; M is padded in the backward), bias None or N
    values."""
    return (x.dim() == 2 and weight.dim() == 2 and x.size(0) > 0
            and x.size(1) == weight.size(1) and x.size(1) % ALIGN == 0
            and weight.size(0) % ALIGN == 0
            and x.dtype in _extension.KERNEL_DTYPES and weight.dtype in _extension.KERNEL_DTYPES
            and (bias is None or bias.numel() == weight.size(0))
            and fp8_device(x) and weight.device == x.device)


def _use_scaled_mm(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """The dispatch: ``_scaled_mm`` or the reference (see the module docstring)."""
    global _warned_no_fp8_gpu
    if _extension.mode() == "off":
        return False
    if fp8_device(x):
        return supports(x, weight, bias)
    if not _extension.wants_cuda(x):  # a CPU tensor (an error under require)
        return False
    where = "a GPU of compute capability %d.%d" % _capability(x.device.index)
    if _extension.mode() == "require":
        raise RuntimeError(
            f"{_extension.ENV_VAR}=require but fp8_linear (--ls-fp8) got {where}: FP8 "
            f"matmuls need a GPU of compute capability >= 8.9; unset {_extension.ENV_VAR} "
            "or drop --ls-fp8")
    if not _warned_no_fp8_gpu:
        _warned_no_fp8_gpu = True
        warnings.warn(f"ls_fairseq: --ls-fp8 on {where}: FP8 matmuls need compute "
                      "capability >= 8.9; running the float32 reference path (the same "
                      "math, slower than without --ls-fp8)", RuntimeWarning, stacklevel=3)
    return False


def _apply(x: Tensor, weight: Tensor, bias: Optional[Tensor], scaled_mm: Optional[bool]):
    x2 = x.reshape(-1, x.size(-1))
    if scaled_mm is None:
        scaled_mm = _use_scaled_mm(x2, weight, bias)
    out = fp8_linear_fwd(x2, weight, bias, scaled_mm)[0]
    return out.view(*x.shape[:-1], weight.size(0))


def fp8_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)`` with FP8 operands: x [..., K], weight [N, K], bias [N] ->
    [..., N] in x's dtype; ``torch._scaled_mm`` where :func:`supports` holds, else
    :func:`fp8_linear_reference`. Differentiable (FP8 backward, see the module docstring)."""
    return _apply(x, weight, bias, None)


def fp8_linear_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """The specification of :func:`fp8_linear` on any device: each operand fake-quantized by
    :func:`quantize`, the matmuls in float32 (:func:`matmul_reference`), the same backward."""
    return _apply(x, weight, bias, False)
