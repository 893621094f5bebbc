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
"""
import warnings
from typing import Optional

import torch

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


class _FusedOutputCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, epsilon, ignore_index, chunk_size, compute_accuracy):
        N, D = hidden.shape
        V = weight.size(0)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_grad = need_h or need_w
        low = hidden.dtype in (torch.float16, torch.bfloat16)
        scale = _GRAD_SCALE_FP16 if hidden.dtype == torch.float16 else 1.0
        acc = torch.float32 if low else hidden.dtype
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
        ctx.save_for_backward(grad_h, grad_w)
        ctx.scale = scale
        ctx.h_dtype, ctx.w_dtype = hidden.dtype, weight.dtype
        ctx.mark_non_differentiable(nll, n_correct)
        return loss, nll, n_correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_nll, _grad_n_correct):
        grad_h, grad_w = ctx.saved_tensors
        out_h = out_w = None
        if grad_loss is None:
            return out_h, out_w, None, None, None, None, None
        acc = grad_h.dtype if grad_h is not None else grad_w.dtype
        factor = grad_loss.to(acc) / ctx.scale  # a device scalar: no host sync
        if grad_h is not None:  # out of place: a second backward (retain_graph) stays right
            out_h = (grad_h * factor).to(ctx.h_dtype)
        if grad_w is not None:
            out_w = (grad_w * factor).to(ctx.w_dtype)
        return out_h, out_w, None, None, None, None, None


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
    return _FusedOutputCrossEntropy.apply(
        hidden.contiguous(), weight, target.contiguous(), float(epsilon), ignore, chunk_size,
        bool(compute_accuracy))
