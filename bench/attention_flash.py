"""Which kernel for self-attention in training? The memory-efficient kernel ls_fairseq uses today
vs PyTorch's FlashAttention-2 kernel, on the packed projection qkv [B, T, 3, H, D] the ls_
modules produce (H=16, D=64, fp16, attention dropout 0.1, ~8192 tokens per batch), fwd+bwd.

Rows (GPU ms per fwd+bwd from torch.profiler, so launch overhead is left out: under
``--ls-cuda-graphs`` the step is replayed and only the kernels count):

* ``efficient+bias``: what ls_fairseq runs (``attention_cuda_packed``), padding as a zero-stride
  additive bias; causal for the decoder (right padding), not for the encoder (left padding);
* ``efficient``: the same kernel without the padding bias (what it costs to read the bias);
* ``flash dense``: FlashAttention-2 on the strided [B, T, H, D] views, no padding mask, causal
  for the decoder (exact there: with right padding and a causal mask a real query never sees a
  padded key), gradients stacked back into d(qkv);
* ``flash varlen``: FlashAttention-2 over the non-padded tokens only (gather to [tokens, 3, H, D],
  cu_seqlens, scatter of the output and of d(qkv)): what the encoder's left padding would need.

    python bench/attention_flash.py [--iters 20]
"""
import argparse

import torch

from attention import gpu_ms, padding_mask  # noqa: E402

from ls_fairseq.ops.attention import attention_cuda_packed  # noqa: E402

H, D, P = 16, 64, 0.1
SHAPES = [(256, 32), (224, 36), (128, 64), (64, 128), (32, 256)]


class _Flash(torch.autograd.Function):
    """FlashAttention-2 on ``qkv`` with q/k/v along dim ``qkv_dim``: the dense [B, T, 3, H, D]
    layout (``cu`` None) or packed tokens [N, 3, H, D] with cu_seqlens ``cu``."""

    @staticmethod
    def forward(ctx, qkv, qkv_dim, cu, max_len, causal):
        q, k, v = qkv.unbind(qkv_dim)
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, P, causal, False, scale=D ** -0.5)
        ctx.save_for_backward(qkv, cu, out, lse, rng, unused)
        ctx.qkv_dim, ctx.max_len, ctx.causal = qkv_dim, max_len, causal
        return out

    @staticmethod
    def backward(ctx, grad):
        qkv, cu, out, lse, rng, unused = ctx.saved_tensors
        q, k, v = qkv.unbind(ctx.qkv_dim)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, P,
            ctx.causal, rng, unused, scale=D ** -0.5)
        return torch.stack((dq, dk, dv), ctx.qkv_dim), None, None, None, None


def methods(b, t, causal):
    qkv = torch.randn(b, t, 3, H, D, device="cuda", dtype=torch.float16, requires_grad=True)
    kpm = padding_mask(b, t, left=not causal)
    grad = torch.randn(b, t, H, D, device="cuda", dtype=torch.float16)
    keep = (~kpm).flatten().nonzero().squeeze(1)
    lens = (~kpm).sum(1, dtype=torch.int32)
    cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    max_len = int(lens.max())

    def eff(mask):
        def run():
            qkv.grad = None
            out = attention_cuda_packed(qkv, mask, causal, P, True)  # [B, H, T, D]
            out.transpose(1, 2).backward(grad)
        return run

    def flash_dense():
        qkv.grad = None
        _Flash.apply(qkv, 2, None, t, causal).backward(grad)

    def flash_varlen():
        qkv.grad = None
        packed = qkv.reshape(b * t, 3, H, D).index_select(0, keep)
        out = _Flash.apply(packed, 1, cu, max_len, causal)
        full = out.new_zeros(b * t, H, D).index_copy(0, keep, out)
        full.view(b, t, H, D).backward(grad)

    rows = {"efficient+bias": eff(kpm), "efficient": eff(None), "flash varlen": flash_varlen}
    if causal:
        rows["flash dense"] = flash_dense
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.version.__version__}, H={H} D={D} "
          f"fp16 dropout {P}; GPU ms per fwd+bwd")
    names = ["efficient+bias", "efficient", "flash dense", "flash varlen"]
    print("| case | B x T | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for case, causal in (("decoder self (causal, right pad)", True),
                         ("encoder self (left pad)", False)):
        for b, t in SHAPES:
            rows = methods(b, t, causal)
            cells = []
            for name in names:
                fn = rows.get(name)
                if fn is None:
                    cells.append("–")
                    continue
                for _ in range(3):
                    fn()
                cells.append(f"{gpu_ms(fn, args.iters):.3f}")
            print(f"| {case} | {b} x {t} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
