"""Output projection + label-smoothed cross-entropy, chunked over tokens (opt-in).

``fused_output_cross_entropy(hidden [..., D], weight [V, D], target [...], epsilon,
ignore_index)`` returns fairseq's ``(loss, nll_loss)`` sums for ``logits = hidden @ weight.T``
(exactly ``label_smoothed_nll_loss(log_softmax(logits.float()), ...)``, reduce=True) without
ever holding the [tokens x V] logits: the tokens are cut into chunks, each chunk's logits are
built, reduced, turned into their gradient in place and multiplied into the gradients w.r.t.
``hidden`` and ``weight`` right away (the gradients are computed in the forward for a unit
upstream gradient and scaled in the backward; the loss is linear in that gradient). Peak extra
memory: one chunk of logits plus fp32 gradient accumulators of the size of ``hidden`` and
``weight``, instead of the [N, V] logits (and, on fairseq's path, their fp32 log-probabilities).

Matmul work is the same as the unfused path (logits, dX = G W, dW = G^T X), only moved into the
forward. On the GPU each chunk uses the fused CE kernels (one reduction pass, one gradient pass
written over the chunk's logits); on the CPU the same chunk loop runs in PyTorch (the spec that
the tests check against fairseq's ``label_smoothed_nll_loss``).

fp16: the per-chunk logit gradient G (|G| <= 1) is stored as ``G * 4096`` so that the smoothing
term ``eps / (V - 1)`` and small probabilities stay out of fp16's subnormal range, and the matmuls
write fp32 (``torch.mm(..., out_dtype=torch.float32)`` when the installed torch has it). The
scale is removed in fp32 in the backward. ``nll_loss`` and ``n_correct`` are not differentiable.

Autograd: the whole forward is one Python custom op, ``ls_fairseq::fused_output_cross_entropy_fwd``
(:func:`fused_output_cross_entropy_fwd`, defined at import, with its fake and
``torch.library.register_autograd`` backward; no extension needed, it runs on any device). It
returns the gradients it computed as two more outputs, non-differentiable and saved by
``setup_context`` (which sees only the op's inputs and outputs): the same two accumulators the
chunk loop fills, no copy. Which gradients to compute is an argument (``grad_hidden``,
``grad_weight``): :func:`fused_output_cross_entropy` asks for those of the inputs that require
grad while grad mode is on, so a forward under ``torch.no_grad`` computes none. The backward
only scales them by the upstream gradient, a device scalar: nothing syncs with the host, so the
op can be captured in a CUDA graph.
"""
import warnings
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _extension

_GRAD_SCALE_FP16 = 4096.0
_CHUNK_BYTES = 256 * 1024 * 1024  # default: one chunk of logits is about 256 MiB
_NO_IGNORE = -(2**63)
_out_dtype_ok = {}


def default_chunk_size(num_tokens: int, vocab: int, dtype: torch.dtype) -> int:
    elem = torch.finfo(dtype).bits // 8
    c = max(1, _CHUNK_BYTES // max(1, vocab * elem))
    if c >= 64:
        c = c // 64 * 64
    return max(1, min(num_tokens, c))


def _mm_f32(a, b):
    """a @ b with an fp32 result; fp16/bf16 operands use the fp32-output GEMM when available."""
    if a.dtype == torch.float32 or a.dtype == torch.float64:
        return torch.mm(a, b)
    key = (a.device.type, a.dtype)
    if _out_dtype_ok.get(key, True):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            _out_dtype_ok[key] = False
            if a.is_cuda:
                warnings.warn("fused_output_cross_entropy: this torch has no fp16/bf16 GEMM with "
                              f"fp32 output ({exc}); using fp32 GEMMs (slower)", RuntimeWarning)
    return torch.mm(a.float(), b.float())


_addmm_ok = {}


def _addmm_f32_(c, a, b):
    """c += a @ b in place, c fp32, a/b fp16/bf16: one GEMM accumulating into c when the
    installed torch supports it (probed once on a tiny case), else a GEMM into a temporary."""
    key = (a.device.type, a.dtype)
    if a.dtype in (torch.float16, torch.bfloat16) and key not in _addmm_ok:
        try:
            c0 = torch.randn(3, 5, device=a.device)
            a0 = torch.randn(3, 4, device=a.device).to(a.dtype)
            b0 = torch.randn(4, 5, device=a.device).to(a.dtype)
            want = c0 + a0.float() @ b0.float()
            got = c0.clone()
            torch.addmm(got, a0, b0, out_dtype=torch.float32, out=got)
            _addmm_ok[key] = bool(torch.allclose(got, want, rtol=1e-3, atol=1e-3))
        except (RuntimeError, TypeError, NotImplementedError):
            _addmm_ok[key] = False
    if _addmm_ok.get(key, False):
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
    else:
        c += _mm_f32(a, b)


def _use_kernels(logits):
    return (logits.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and _extension.use_kernels(logits) and _extension.has_op("ls_cross_entropy_fwd"))


def _chunk_loss_and_grad(logits, target, epsilon, ignore_index, need_grad, grad_scale,
                         compute_argmax):
    """Per-row loss/nll sums of one chunk; the chunk's logit gradient (times grad_scale)
    overwrites ``logits`` when need_grad. Returns (loss_sum, nll_sum, argmax-or-None, grad)."""
    V = logits.size(-1)
    if _use_kernels(logits):
        loss_rows, nll_rows, lse, argmax = torch.ops.ls_fairseq.ls_cross_entropy_fwd(
            logits, target, float(epsilon), int(ignore_index), bool(compute_argmax))
        if need_grad:
            g = torch.full((1,), grad_scale, dtype=torch.float32, device=logits.device)
            torch.ops.ls_fairseq.ls_cross_entropy_bwd_(
                g, None, logits, target, lse, float(epsilon), int(ignore_index))
        return loss_rows.sum(), nll_rows.sum(), (argmax if compute_argmax else None), logits
    # PyTorch path (CPU or no kernels): same math, fp32 (or fp64) temporaries of one chunk only.
    acc = torch.promote_types(logits.dtype, torch.float32)
    lprobs = torch.log_softmax(logits, dim=-1, dtype=acc)
    pad = target.eq(ignore_index)
    safe_t = target.masked_fill(pad, 0).unsqueeze(-1)
    nll = (-lprobs.gather(-1, safe_t).squeeze(-1)).masked_fill(pad, 0.0)
    smooth = (-lprobs.sum(-1)).masked_fill(pad, 0.0)
    eps_i = epsilon / (V - 1)
    nll_sum, smooth_sum = nll.sum(), smooth.sum()
    loss_sum = (1.0 - epsilon - eps_i) * nll_sum + eps_i * smooth_sum
    argmax = logits.argmax(-1) if compute_argmax else None
    grad = None
    if need_grad:
        grad = lprobs.exp_().sub_(eps_i)
        grad.scatter_add_(-1, safe_t, torch.full_like(safe_t, -(1.0 - epsilon - eps_i), dtype=acc))
        grad.masked_fill_(pad.unsqueeze(-1), 0.0)
        if grad_scale != 1.0:
            grad.mul_(grad_scale)
        grad = grad.to(logits.dtype)
    return loss_sum, nll_sum, argmax, grad


def _grad_scale(dtype):
    return _GRAD_SCALE_FP16 if dtype == torch.float16 else 1.0


def _acc_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@torch.library.custom_op("ls_fairseq::fused_output_cross_entropy_fwd", mutates_args=())
def fused_output_cross_entropy_fwd(hidden: Tensor, weight: Tensor, target: Tensor, epsilon: float,
                                   ignore_index: int, chunk_size: Optional[int],
                                   compute_accuracy: bool, grad_hidden: bool,
                                   grad_weight: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """hidden [N, D] (contiguous), weight [V, D], target [N] int64 -> (loss, nll, n_correct,
    grad_h, grad_w): the sums, and the gradients of ``loss`` w.r.t. hidden [N, D] and weight
    [V, D] for a unit upstream gradient, times the fp16 scale, in the accumulation dtype
    (fp32; fp64 for fp64 inputs). A gradient not asked for (``grad_hidden`` / ``grad_weight``
    False) is an empty tensor and is never computed."""
    N, D = hidden.shape
    V = weight.size(0)
    need_h, need_w = grad_hidden, grad_weight
    need_grad = need_h or need_w
    scale = _grad_scale(hidden.dtype)
    acc = _acc_dtype(hidden.dtype)
    grad_h = torch.empty(N, D, dtype=acc, device=hidden.device) if need_h else None
    grad_w = torch.zeros(V, D, dtype=acc, device=hidden.device) if need_w else None
    loss = torch.zeros((), dtype=acc, device=hidden.device)  # fp32 (fp64 for fp64 inputs)
    nll = torch.zeros((), dtype=acc, device=hidden.device)
    n_correct = torch.zeros((), dtype=torch.long, device=hidden.device)
    C = chunk_size or default_chunk_size(N, V, hidden.dtype)
    for start in range(0, N, C):
        end = min(N, start + C)
        h, t = hidden[start:end], target[start:end]
        logits = torch.nn.functional.linear(h, weight)
        l_sum, n_sum, argmax, g = _chunk_loss_and_grad(
            logits, t, epsilon, ignore_index, need_grad, scale, compute_accuracy)
        loss += l_sum
        nll += n_sum
        if compute_accuracy:
            mask = t.ne(ignore_index)
            n_correct += (argmax.eq(t) & mask).sum()
        if need_h:
            grad_h[start:end] = _mm_f32(g, weight)
        if need_w:
            _addmm_f32_(grad_w, g.t(), h)
        del logits, g
    # an op returns tensors only: a gradient not computed is an empty placeholder
    if grad_h is None:
        grad_h = hidden.new_empty((0,), dtype=acc)
    if grad_w is None:
        grad_w = hidden.new_empty((0,), dtype=acc)
    return loss, nll, n_correct, grad_h, grad_w


@fused_output_cross_entropy_fwd.register_fake
def _fused_fake(hidden, weight, target, epsilon, ignore_index, chunk_size, compute_accuracy,
                grad_hidden, grad_weight):
    acc = _acc_dtype(hidden.dtype)
    scalar = hidden.new_empty((), dtype=acc)
    return (scalar, scalar.clone(), hidden.new_empty((), dtype=torch.long),
            hidden.new_empty(hidden.shape if grad_hidden else (0,), dtype=acc),
            hidden.new_empty(weight.shape if grad_weight else (0,), dtype=acc))


def _fused_setup_context(ctx, inputs, output):
    hidden, weight = inputs[0], inputs[1]
    grad_hidden, grad_weight = inputs[7], inputs[8]
    _loss, nll, n_correct, grad_h, grad_w = output
    ctx.save_for_backward(grad_h if grad_hidden else None, grad_w if grad_weight else None)
    ctx.mark_non_differentiable(nll, n_correct, grad_h, grad_w)
    # None for them in the backward, not zero tensors (grad_w's would be vocab x dim float32)
    ctx.set_materialize_grads(False)
    ctx.scale = _grad_scale(hidden.dtype)
    ctx.h_dtype, ctx.w_dtype = hidden.dtype, weight.dtype


def _fused_backward(ctx, grad_loss, _grad_nll, _grad_n_correct, _grad_h, _grad_w):
    grad_h, grad_w = ctx.saved_tensors
    need = ctx.needs_input_grad
    if (need[0] and grad_h is None) or (need[1] and grad_w is None):
        raise RuntimeError("fused_output_cross_entropy_fwd: an input requires grad but its "
                           "gradient was not asked for (grad_hidden / grad_weight)")
    out_h = out_w = None
    if grad_loss is None:
        return out_h, out_w, None, None, None, None, None, None, None
    acc = grad_h.dtype if grad_h is not None else grad_w.dtype
    factor = grad_loss.to(acc) / ctx.scale  # a device scalar: no host sync
    if grad_h is not None:  # out of place: a second backward (retain_graph) stays right
        out_h = (grad_h * factor).to(ctx.h_dtype)
    if grad_w is not None:
        out_w = (grad_w * factor).to(ctx.w_dtype)
    return out_h, out_w, None, None, None, None, None, None, None


fused_output_cross_entropy_fwd.register_autograd(_fused_backward,
                                                 setup_context=_fused_setup_context)


def fused_output_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    epsilon: float,
    ignore_index: Optional[int],
    *,
    chunk_size: Optional[int] = None,
    compute_accuracy: bool = False,
):
    """hidden [..., D], weight [V, D], target [...] (int64) ->
    (loss, nll_loss, n_correct): fp32 (fp64 for fp64 inputs) sums as fairseq's label_smoothed_nll_loss(reduce=True) on
    log_softmax(hidden @ weight.T); n_correct (int64, not differentiable) counts non-ignored
    tokens whose argmax is the target when compute_accuracy, else 0."""
    D = hidden.size(-1)
    if weight.dim() != 2 or weight.size(1) != D:
        raise ValueError(f"weight must be [V, {D}], got {tuple(weight.shape)}")
    if weight.size(0) < 2:
        raise ValueError("label smoothing needs a vocabulary of at least 2")
    hidden = hidden.reshape(-1, D)
    target = target.reshape(-1)
    if target.numel() != hidden.size(0):
        raise ValueError("target and hidden disagree on the number of tokens")
    if target.dtype != torch.long:
        target = target.long()
    if weight.dtype != hidden.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) dtypes differ")
    ignore = _NO_IGNORE if ignore_index is None else int(ignore_index)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError("chunk_size must be positive")
    # only what the backward will need: nothing under no_grad / inference
    grad_on = torch.is_grad_enabled()
    loss, nll, n_correct, _, _ = fused_output_cross_entropy_fwd(
        hidden.contiguous(), weight, target.contiguous(), float(epsilon), ignore, chunk_size,
        bool(compute_accuracy), grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
    return loss, nll, n_correct
