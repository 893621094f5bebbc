"""CUDA attention for ``ls_fairseq.ops.attention``: three backends behind ``attention_cuda``.

* ``short`` (``csrc/short_attention.cu``, the default where it applies): for rows of at most
  128 queries and keys, head size 16, 32, 64 or 128, fp16/bf16, sm_80+. One thread block per
  (batch, head) keeps q/k/v in shared memory and the scores, probabilities and gradients in
  tensor-core (mma.sync) registers; forward and backward are one launch each. Why: on WMT-like
  shapes it takes less GPU time than ``efficient`` and trains faster end to end, with the same
  loss curve (docs/PERFORMANCE.md, "Components"). (A first design of this backend kept the scores
  in shared memory and was no faster than ``efficient``.) Its index math is also emulated lane by
  lane on the CPU (``scripts/emulate_short_attention.py``).
* ``efficient``: PyTorch's memory-efficient fused attention kernel (the CUTLASS kernel behind
  ``SDPBackend.EFFICIENT_ATTENTION``), called through ``aten::_efficient_attention_forward`` /
  ``_backward`` so that causal masking (bottom-right aligned, no mask tensor) and key padding (an
  additive ``[B, Tk]`` bias broadcast with zero strides, never materialised per query) combine, q/k/v
  are read in place from the strided ``[B, H, T, D]`` views of the projection output, and the
  output comes back as ``[B, Tq, H, D]`` memory (so merging heads is a free view). No per-shape
  planning (unlike cuDNN attention), no length cap, dropout from torch's Philox generator
  (reproducible with ``torch.manual_seed``), fully-masked query rows give zeros.
* ``softmax``: LightSeq-style: q·kᵀ and p·v as batched cuBLAS GEMMs (``torch.matmul``) around one
  fused kernel for scale/mask/softmax(fp32 statistics)/dropout (``csrc/attention.cu``); backward
  fuses softmax-grad and dropout-grad and regenerates the dropout mask from the Philox seed.
  Handles every head size and row length (a template family over row-length buckets up to 1024
  keys, a streaming kernel beyond).

The default (``LS_FAIRSEQ_ATTENTION=auto``, or ``backend=None``) tries the backends in the order
short -> efficient -> softmax and takes the first that can run the problem exactly: ``short`` for
rows up to 128, ``efficient`` for longer rows and other head sizes, ``softmax`` for the rest (head
sizes the fused kernels cannot take, causal masks with more queries than keys, empty sequences).
Why that order after ``short``: on the strided q/k/v the modules produce, ``efficient`` is faster
than ``softmax`` on short rows and close on long ones (docs/PERFORMANCE.md, "Components"), with
O(T) instead of O(T^2) memory and no per-shape planning.
``LS_FAIRSEQ_ATTENTION=short|efficient|softmax`` (or the ``backend`` argument) starts the same
order at that backend: ``efficient`` never picks ``short``, ``softmax`` always runs.

For self-attention, ``attention_cuda_packed(qkv [B, T, 3, H, D], ...)`` also writes the gradient
straight into d(qkv)'s layout (no stack of dq/dk/dv in backward).

Autograd: every backend is one ``torch.library`` op whose backward is registered with
``torch.library.register_autograd`` (``setup_context`` saves what the backward op reads; the
extra outputs are marked non-differentiable and their gradients are never materialised):

======================================  ==============================================  ==========
op                                      forward                                         defined
======================================  ==============================================  ==========
``attention_fwd``                       softmax kernel -> (out, probs, rng)             csrc
``short_attention_fwd``                 short kernel -> (out, lse, rng)                 csrc
``short_attention_packed_fwd``          ``short_attention_fwd`` on qkv's q/k/v views    here
``efficient_attention_fwd``             aten's kernel -> (out, lse, seed, offset)       here
``efficient_attention_packed_fwd``      the same on qkv's q/k/v views                   here
======================================  ==============================================  ==========

The csrc ops get their autograd directly. The other three are Python ops (``Library.define``
with a ``CompositeExplicitAutograd`` kernel, which costs less host time per call than
``torch.library.custom_op``): the packed ones take qkv itself, so that the backward hands back
d(qkv) written in place (the short kernel into one ``[B, T, 3, H, D]`` buffer, aten's via
``shared_storage_dqdkdv``); the efficient ones call aten's kernels with the arguments chosen here
(the log-sum-exp only where a gradient may be needed, as ``needs_input_grad`` says). All of
them, and the fakes (meta kernels) of every op, are registered once the extension is loaded
(``_extension.when_loaded``). The seed and offset of aten's kernel are CPU tensors outside CUDA
graph capture (GPU tensors inside it): the fakes say CPU.

Host time: with ``register_autograd`` a forward + backward costs more host time than a
``torch.autograd.Function`` around the same kernel calls would. Part of it is the registered
forward filling in the defaults of the op's schema, a cost that grows with the square of the
number of arguments, so the Python ops' schemas carry nothing the kernel can derive (the scale,
the training flag). The forward alone under ``no_grad`` costs about what it costs with a
Function.

What the kernels take is :func:`supports` (the softmax backend runs every such problem); the
public module runs the reference otherwise.
"""
import torch

from . import _extension

ENV_VAR = "LS_FAIRSEQ_ATTENTION"
BACKENDS = _extension.ENV_VARS[ENV_VAR]  # ("auto", "short", "efficient", "softmax")
#: longest rows and the head sizes the short kernel takes (csrc/short_attention.cu)
SHORT_LIMIT = 128
SHORT_HEAD_DIMS = (16, 32, 64, 128)

# aten's custom_mask_type values for the memory-efficient kernel
_NO_MASK = 0
_CAUSAL_BOTTOM_RIGHT = 2


def supports(q, k, v) -> bool:
    """Whether the CUDA path takes q, k, v: one dtype of float16/bfloat16/float32 (shapes are
    checked by :func:`attention_cuda`, which raises on misuse; every well-formed problem has a
    backend: softmax runs what short and efficient do not)."""
    return q.dtype in _extension.KERNEL_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype


def backend_setting() -> str:
    return _extension.env_value(ENV_VAR)  # also checked when the plugin loads


# ------------------------------------------------------------------------------------ autograd
# setup_context/backward pairs of the ops above. Every setup turns off the materialisation of
# gradients: the extra outputs (probs, lse, rng, seed, offset) get none, and materialising
# them would allocate zeros in every backward.


def _softmax_fwd_fake(q, k, v, key_padding_mask, causal, dropout_p, training):
    b, h, tq, _ = q.shape
    tk, dv = k.shape[2], v.shape[3]
    return (q.new_empty((b, h, tq, dv)), q.new_empty((b, h, tq, tk)),
            q.new_empty((2,), dtype=torch.long))


def _softmax_bwd_fake(grad_out, q, k, v, probs, rng_state, dropout_p):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _softmax_setup(ctx, inputs, output):
    q, k, v, _key_padding_mask, _causal, dropout_p, training = inputs
    _out, probs, rng = output
    ctx.mark_non_differentiable(probs, rng)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, probs, rng)
    ctx.dropout_p = dropout_p if (training and dropout_p > 0.0) else 0.0


def _softmax_backward(ctx, grad, _grad_probs, _grad_rng):
    if grad is None:
        return (None,) * 7
    q, k, v, probs, rng = ctx.saved_tensors
    dq, dk, dv = torch.ops.ls_fairseq.attention_bwd(grad, q, k, v, probs, rng, ctx.dropout_p)
    return dq, dk, dv, None, None, None, None


def _short_fwd_fake(q, k, v, key_padding_mask, causal, dropout_p, training):
    b, h, tq, d = q.shape
    return (q.new_empty((b, tq, h, d)).transpose(1, 2),
            q.new_empty((b, h, tq), dtype=torch.float32), q.new_empty((2,), dtype=torch.long))


def _short_bwd_fake(grad_out, q, k, v, out, lse, key_padding_mask, causal, rng_state, dropout_p,
                    grad_q, grad_k, grad_v):
    return None


# short_attention_packed_fwd drops whenever dropout_p > 0 (no training flag; see "Host time")
def _short_packed_impl(qkv, key_padding_mask, causal, dropout_p):
    return torch.ops.ls_fairseq.short_attention_fwd(*qkv.permute(2, 0, 3, 1, 4), key_padding_mask,
                                                    causal, dropout_p, dropout_p > 0.0)


def _short_packed_fake(qkv, key_padding_mask, causal, dropout_p):
    return _short_fwd_fake(*qkv.permute(2, 0, 3, 1, 4), key_padding_mask, causal, dropout_p,
                           dropout_p > 0.0)


def _short_keep(ctx, inputs, key_padding_mask, causal, dropout_p, training, output):
    """What both short ops' backward reads: the inputs (q, k, v or qkv), the mask and the
    forward's out, lse and rng."""
    out, lse, rng = output
    ctx.mark_non_differentiable(lse, rng)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*inputs, key_padding_mask, out, lse, rng)
    # the kernel drops nothing unless training (the backward op has no such flag)
    ctx.causal, ctx.dropout_p = causal, (dropout_p if training else 0.0)


def _short_run_backward(ctx, grad, q, k, v, key_padding_mask, out, lse, rng, grads):
    """The backward op, writing dq/dk/dv into ``grads``."""
    torch.ops.ls_fairseq.short_attention_bwd(
        _grad_for_kernel(grad), q, k, v, out, lse, key_padding_mask, ctx.causal, rng,
        ctx.dropout_p, *grads,
    )


def _short_setup(ctx, inputs, output):
    q, k, v, key_padding_mask, causal, dropout_p, training = inputs
    _short_keep(ctx, (q, k, v), key_padding_mask, causal, dropout_p, training, output)


def _short_backward(ctx, grad, _grad_lse, _grad_rng):
    if grad is None:
        return (None,) * 7
    q, k, v, kpm, out, lse, rng = ctx.saved_tensors
    grads = _bhtd_grads(q, k)
    _short_run_backward(ctx, grad, q, k, v, kpm, out, lse, rng, grads)
    return (*grads, None, None, None, None)


def _short_packed_setup(ctx, inputs, output):
    qkv, key_padding_mask, causal, dropout_p = inputs
    _short_keep(ctx, (qkv,), key_padding_mask, causal, dropout_p, dropout_p > 0.0, output)


def _short_packed_backward(ctx, grad, _grad_lse, _grad_rng):
    """dq/dk/dv written straight into one [B, T, 3, H, D] buffer, which is d(qkv)."""
    if grad is None:
        return (None,) * 4
    qkv, kpm, out, lse, rng = ctx.saved_tensors
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    _short_run_backward(ctx, grad, *qkv.permute(2, 0, 3, 1, 4), kpm, out, lse, rng,
                        dqkv.permute(2, 0, 3, 1, 4))
    return dqkv, None, None, None


def _efficient_forward(q, k, v, bias, mask_type, dropout_p, compute_log_sumexp):
    """aten's kernel on [B, T, H, D] q/k/v, scores scaled by head_dim ** -0.5: (out [B, Tq, H, D]
    memory seen as [B, H, Tq, D], lse, seed, offset)."""
    out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
        q, k, v, bias, None, None, None, None, dropout_p, mask_type, compute_log_sumexp,
        scale=q.size(-1) ** -0.5,
    )
    return out.transpose(1, 2), lse, seed, offset


def _efficient_impl(q, k, v, bias, mask_type, dropout_p, compute_log_sumexp):
    # [B, H, T, D] views -> the kernel's [B, T, H, D] layout (free: strides only)
    return _efficient_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias,
                              mask_type, dropout_p, compute_log_sumexp)


def _efficient_packed_impl(qkv, bias, mask_type, dropout_p, compute_log_sumexp):
    # qkv [B, T, 3, H, D]: q/k/v are [B, T, H, D] views, the kernel's own layout
    return _efficient_forward(*qkv.unbind(2), bias, mask_type, dropout_p, compute_log_sumexp)


def _cpu_seed_offset(outputs):
    """aten's meta kernel gives the seed and offset on the meta device; the kernel gives CPU
    tensors (outside CUDA graph capture), which is what the fakes must say."""
    out, lse, _, _ = outputs
    return (out, lse, torch.empty((), dtype=torch.long, device="cpu"),
            torch.empty((), dtype=torch.long, device="cpu"))


def _efficient_fake(*args):
    return _cpu_seed_offset(_efficient_impl(*args))


def _efficient_packed_fake(*args):
    return _cpu_seed_offset(_efficient_packed_impl(*args))


def _efficient_keep(ctx, inputs, bias, mask_type, dropout_p, output):
    out, lse, seed, offset = output
    ctx.mark_non_differentiable(lse, seed, offset)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*inputs, bias, out, lse, seed, offset)
    ctx.mask_type, ctx.dropout_p = mask_type, dropout_p


def _efficient_run_backward(ctx, grad, q, k, v, bias, out, lse, seed, offset, **kwargs):
    """aten's backward on [B, T, H, D] q/k/v -> (dq, dk, dv) in that layout."""
    dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
        grad.transpose(1, 2), q, k, v, bias, out.transpose(1, 2), None, None, q.size(1),
        k.size(1), lse, ctx.dropout_p, seed, offset, ctx.mask_type, False,
        scale=q.size(-1) ** -0.5, **kwargs,
    )
    return dq, dk, dv


def _efficient_setup(ctx, inputs, output):
    q, k, v, bias, mask_type, dropout_p, _compute_log_sumexp = inputs
    _efficient_keep(ctx, (q, k, v), bias, mask_type, dropout_p, output)


def _efficient_backward(ctx, grad, _grad_lse, _grad_seed, _grad_offset):
    if grad is None:
        return (None,) * 7
    q, k, v, bias, out, lse, seed, offset = ctx.saved_tensors
    dq, dk, dv = _efficient_run_backward(ctx, grad, q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), bias, out, lse, seed, offset)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None, None, None


def _efficient_packed_setup(ctx, inputs, output):
    qkv, bias, mask_type, dropout_p, _compute_log_sumexp = inputs
    _efficient_keep(ctx, (qkv,), bias, mask_type, dropout_p, output)


def _efficient_packed_backward(ctx, grad, _grad_lse, _grad_seed, _grad_offset):
    """The kernel writes dq/dk/dv into one [B, T, 3, H, D] buffer (``shared_storage_dqdkdv``),
    which *is* d(qkv), so no stack/copy of the three gradients follows."""
    if grad is None:
        return (None,) * 5
    qkv, bias, out, lse, seed, offset = ctx.saved_tensors
    dq, dk, dv = _efficient_run_backward(ctx, grad, *qkv.unbind(2), bias, out, lse, seed, offset,
                                         shared_storage_dqdkdv=True)
    b, t, _, h, d = qkv.shape
    strides = (t * 3 * h * d, 3 * h * d, h * d, d, 1)
    # storages and offsets, not data pointers: also traceable (fake tensors have none)
    if (
        dq.stride() == (strides[0], strides[1], strides[3], 1)
        and torch._C._is_alias_of(dk, dq) and torch._C._is_alias_of(dv, dq)
        and dk.storage_offset() == dq.storage_offset() + h * d
        and dv.storage_offset() == dq.storage_offset() + 2 * h * d
    ):
        dqkv = dq.as_strided(qkv.shape, strides, dq.storage_offset())
    else:  # another torch lays the gradients out differently: pack them
        dqkv = torch.stack((dq, dk, dv), 2)
    return dqkv, None, None, None, None


#: the Python ops: name -> (schema, kernel, fake, setup_context, backward)
PYTHON_OPS = {
    "short_attention_packed_fwd": (
        "(Tensor qkv, Tensor? key_padding_mask, bool causal, float dropout_p) -> "
        "(Tensor, Tensor, Tensor)",
        _short_packed_impl, _short_packed_fake, _short_packed_setup, _short_packed_backward),
    "efficient_attention_fwd": (
        "(Tensor q, Tensor k, Tensor v, Tensor? bias, int mask_type, float dropout_p, "
        "bool compute_log_sumexp) -> (Tensor, Tensor, Tensor, Tensor)",
        _efficient_impl, _efficient_fake, _efficient_setup, _efficient_backward),
    "efficient_attention_packed_fwd": (
        "(Tensor qkv, Tensor? bias, int mask_type, float dropout_p, bool compute_log_sumexp) -> "
        "(Tensor, Tensor, Tensor, Tensor)",
        _efficient_packed_impl, _efficient_packed_fake, _efficient_packed_setup,
        _efficient_packed_backward),
}

_lib = None  # the torch.library.Library of the Python ops (kept alive: it owns them)


def _register():
    """Fakes and autograd of the csrc ops, and the Python ops (run once, by
    ``_extension.when_loaded``; calling it again does nothing)."""
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("ls_fairseq", "FRAGMENT")
    register_fake, register_autograd = torch.library.register_fake, torch.library.register_autograd
    register_fake("ls_fairseq::attention_fwd", _softmax_fwd_fake)
    register_fake("ls_fairseq::attention_bwd", _softmax_bwd_fake)
    register_autograd("ls_fairseq::attention_fwd", _softmax_backward, setup_context=_softmax_setup)
    names = ["efficient_attention_fwd", "efficient_attention_packed_fwd"]
    if _extension.has_op("short_attention_fwd"):
        register_fake("ls_fairseq::short_attention_fwd", _short_fwd_fake)
        register_fake("ls_fairseq::short_attention_bwd", _short_bwd_fake)
        register_autograd("ls_fairseq::short_attention_fwd", _short_backward,
                          setup_context=_short_setup)
        names.insert(0, "short_attention_packed_fwd")
    for name in names:
        schema, kernel, fake, setup, backward = PYTHON_OPS[name]
        _lib.define(name + schema)
        _lib.impl(name, kernel, "CompositeExplicitAutograd")
        register_fake(f"ls_fairseq::{name}", fake, lib=_lib)
        register_autograd(f"ls_fairseq::{name}", backward, setup_context=setup, lib=_lib)


_extension.when_loaded(_register)


_device_info = {}


def _sm_and_smem(device):
    """(compute capability major, max opt-in shared memory per block) of a device, cached."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _device_info:
        props = torch.cuda.get_device_properties(index)
        _device_info[index] = (props.major, props.shared_memory_per_block_optin)
    return _device_info[index]


def _short_smem_bytes(tq: int, tk: int, d: int, elem: int) -> int:
    """Shared memory of the short backward kernel with dropout (the larger of the two): mirrors
    bwd_smem() in csrc/short_attention.cu."""
    up16 = lambda x: (x + 15) // 16 * 16  # noqa: E731
    tq_, tk_ = up16(tq), up16(tk)
    kt = 32 if tk <= 32 else 64 if tk <= 64 else 128
    rows_q, rows_k, ds = tq_ * (d + 8) * elem, tk_ * (d + 8) * elem, tk_ * (tq_ + 8) * elem
    return 2 * rows_q + 2 * rows_k + max(ds, rows_q) + 2 * tq_ * 4 + tq_ * (kt // 32) * 4


def _aligned_view(x) -> bool:
    if not (x.stride(-1) == 1 and all(s % 8 == 0 for s in x.stride()[:-1])):
        return False
    try:
        return x.data_ptr() % 16 == 0
    except RuntimeError:  # a traced tensor (fake, functional) has no data: storages are aligned
        return x.storage_offset() * x.element_size() % 16 == 0


def short_supported(q, k, v) -> bool:
    """True when the short kernel can run this problem exactly as specified."""
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.is_cuda:
        return False
    d, tq, tk = q.size(-1), q.size(-2), k.size(-2)
    if not (v.size(-1) == d and d in SHORT_HEAD_DIMS and 1 <= tq <= SHORT_LIMIT
            and 1 <= tk <= SHORT_LIMIT and q.size(0) * q.size(1) < 2**31):
        return False
    if not all(_aligned_view(x) for x in (q, k, v)):
        return False
    major, smem = _sm_and_smem(q.device)
    return major >= 8 and _short_smem_bytes(tq, tk, d, q.element_size()) <= smem


def efficient_supported(q, k, v, causal: bool) -> bool:
    """True when PyTorch's memory-efficient kernel can run this problem exactly as specified."""
    if not hasattr(torch.ops.aten, "_efficient_attention_forward"):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    head_dim, tq, tk = q.size(-1), q.size(-2), k.size(-2)
    align = 4 if q.dtype == torch.float32 else 8
    return (
        v.size(-1) == head_dim
        and head_dim % align == 0
        and head_dim <= 256
        and tq > 0
        and tk > 0
        and not (causal and tq > tk)  # rows that see no key: keep that corner in the softmax path
        and q.size(0) <= 65535
        and q.size(1) <= 65535
    )


def _validate(q, k, v, key_padding_mask):
    """Shape/dtype checks in Python, so misuse raises here with a clear message."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention: q, k, v must be 4-D [B, H, T, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype \
            or v.dtype != q.dtype:
        raise TypeError(f"attention: q, k, v must share one dtype of float16/bfloat16/float32, got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    b, h, _, d = q.shape
    if k.shape[:2] != (b, h) or v.shape[:2] != (b, h) or k.size(3) != d or v.size(2) != k.size(2):
        raise ValueError(f"attention: shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (b, k.size(2)):
        raise ValueError(f"attention: key_padding_mask must be [B, Tk] = [{b}, {k.size(2)}], got "
                         f"{tuple(key_padding_mask.shape)}")


def _pick(backend, q, k, v, causal) -> str:
    choice = backend_setting() if backend is None else backend
    if choice not in BACKENDS:
        raise ValueError(f"attention backend {choice!r} is not one of {', '.join(BACKENDS)}")
    if choice in ("auto", "short") and _extension.has_op("short_attention_fwd") \
            and short_supported(q, k, v):
        return "short"
    if choice != "softmax" and efficient_supported(q, k, v, causal):
        return "efficient"
    return "softmax"


def _padding_bias(key_padding_mask, heads: int, tq: int, dtype):
    """Additive bias [B, H, Tq, Tk] (0 / -inf) as a zero-stride view of one [B, Tk] row per batch.

    The row stride is rounded up to 16 elements, the alignment the kernel asks for (otherwise SDPA
    would pad it with a copy). The rows are built once per mask tensor and dtype and kept on the
    mask itself (until it is modified in place): one encoder padding mask serves its 6 encoder
    self-attentions and the decoder's 6 cross-attentions, and each build costs 3 launches of
    host time."""
    b, tk = key_padding_mask.shape
    memo = getattr(key_padding_mask, "_ls_padding_bias", None)
    if memo is None or memo[0] != key_padding_mask._version:
        memo = (key_padding_mask._version, {})
        key_padding_mask._ls_padding_bias = memo
    bias = memo[1].get(dtype)
    if bias is None:
        width = (tk + 15) // 16 * 16
        bias = torch.zeros((b, width), dtype=dtype, device=key_padding_mask.device)
        bias[:, :tk].masked_fill_(key_padding_mask, float("-inf"))
        memo[1][dtype] = bias
    return bias[:, None, None, :tk].expand(b, heads, tq, tk)


def _bhtd_grads(like_q, like_k):
    """Fresh dq/dk/dv as [B, H, T, D] views of [B, T, H, D] memory (the kernel's aligned layout)."""
    b, h, tq, d = like_q.shape
    tk = like_k.size(2)
    dq = like_q.new_empty((b, tq, h, d)).transpose(1, 2)
    dk = like_q.new_empty((b, tk, h, d)).transpose(1, 2)
    dv = like_q.new_empty((b, tk, h, d)).transpose(1, 2)
    return dq, dk, dv


def _grad_for_kernel(grad):
    return grad if _aligned_view(grad) else grad.contiguous()


def _short_mask(key_padding_mask):
    return None if key_padding_mask is None else key_padding_mask.contiguous()


def attention_cuda_packed(
    qkv, key_padding_mask=None, causal: bool = False, dropout_p: float = 0.0,
    training: bool = False, backend=None,
):
    """Self-attention over the packed projection ``qkv`` [B, T, 3, H, D] (last dim contiguous), as
    ``attention_cuda(*qkv.permute(2, 0, 3, 1, 4), ...)`` but with the gradient written straight
    into d(qkv)'s layout. Returns out [B, H, T, D]."""
    if qkv.dim() != 5 or qkv.size(2) != 3:
        raise ValueError(f"attention_cuda_packed: qkv must be [B, T, 3, H, D], got {tuple(qkv.shape)}")
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    _validate(q, k, v, key_padding_mask)
    if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
        key_padding_mask = key_padding_mask.to(torch.bool)
    causal = bool(causal)
    p = float(dropout_p) if training else 0.0
    choice = _pick(backend, q, k, v, causal) if qkv.stride(-1) == 1 else "softmax"
    if choice == "short":
        return torch.ops.ls_fairseq.short_attention_packed_fwd(
            qkv, _short_mask(key_padding_mask), causal, p)[0]
    if choice != "efficient":
        return attention_cuda(q, k, v, key_padding_mask, causal, dropout_p, training, backend)
    t = qkv.size(1)
    bias = None
    if key_padding_mask is not None:
        bias = _padding_bias(key_padding_mask, qkv.size(3), t, qkv.dtype)
    mask_type = _CAUSAL_BOTTOM_RIGHT if (causal and t > 1) else _NO_MASK
    return torch.ops.ls_fairseq.efficient_attention_packed_fwd(qkv, bias, mask_type, p,
                                                               qkv.requires_grad)[0]


def attention_cuda(
    q, k, v, key_padding_mask=None, causal: bool = False, dropout_p: float = 0.0,
    training: bool = False, backend=None,
):
    """Attention of ``q`` [B, H, Tq, D] over ``k``/``v`` [B, H, Tk, D]; returns out [B, H, Tq, D].

    Same contract as ``ls_fairseq.ops.attention.attention_reference`` (without ``need_weights``).
    ``backend``: None (from ``LS_FAIRSEQ_ATTENTION``, default ``auto``), ``"auto"``,
    ``"short"``, ``"efficient"`` or ``"softmax"``; a request the kernel cannot serve runs the
    next backend of short -> efficient -> softmax that can."""
    _validate(q, k, v, key_padding_mask)
    if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
        key_padding_mask = key_padding_mask.to(torch.bool)
    p = float(dropout_p) if training else 0.0
    causal = bool(causal)
    choice = _pick(backend, q, k, v, causal)
    if choice == "short":
        return torch.ops.ls_fairseq.short_attention_fwd(
            q, k, v, _short_mask(key_padding_mask), causal, p, p > 0.0)[0]
    if choice == "efficient":
        tq, tk = q.size(-2), k.size(-2)
        bias = None
        if key_padding_mask is not None:
            bias = _padding_bias(key_padding_mask, q.size(1), tq, q.dtype)
        # a single query (incremental decoding) sees every cached key: no causal mask needed
        mask_type = _CAUSAL_BOTTOM_RIGHT if (causal and tq > 1) else _NO_MASK
        # the log-sum-exp only where a backward may need it (as needs_input_grad would say)
        lse = q.requires_grad or k.requires_grad or v.requires_grad
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        return torch.ops.ls_fairseq.efficient_attention_fwd(q, k, v, bias, mask_type, p, lse)[0]
    return torch.ops.ls_fairseq.attention_fwd(q, k, v, key_padding_mask, causal, p,
                                              bool(training))[0]
