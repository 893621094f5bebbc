"""CUDA binding of :func:`ls_fairseq.ops.decode_attention.decode_attention`
(``csrc/decode_attention.cu``).

Op: ``torch.ops.ls_fairseq.decode_attention(q, k, v, rows, key_padding_mask) -> out [R, H, D]``,
inference only (no autograd). Its fake-tensor shape is registered here once the extension is
loaded (``_extension.when_loaded``). What the kernel takes is :func:`supports`; the public module
runs the reference otherwise.
"""
import torch

from . import _extension

#: head sizes the kernel is built for
HEAD_DIMS = (32, 64, 128)
#: most key positions per call (the scores of one row live in shared memory)
MAX_KEYS = 8192


def _aligned(t, dims) -> bool:
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1
            and all(t.stride(d) % 8 == 0 for d in dims))


def supports(q, k, v, rows, key_padding_mask=None) -> bool:
    """Whether the kernel takes these inputs: float16/bfloat16 ``q``, ``k``, ``v`` of one dtype on
    one device, head size in :data:`HEAD_DIMS`, at most :data:`MAX_KEYS` positions, int64
    ``rows``, and 16-byte vectors: a contiguous last dim, aligned data and strides in multiples of
    8 elements (every tensor a decoding workspace or a projection makes)."""
    return (q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype and v.dtype == q.dtype
            and q.dim() == 3 and k.dim() == 4 and v.shape == k.shape
            and q.size(2) in HEAD_DIMS and k.size(2) <= MAX_KEYS
            and rows.dtype == torch.int64 and k.device == q.device and v.device == q.device
            and rows.device == q.device
            and (key_padding_mask is None or key_padding_mask.device == q.device)
            and _aligned(q, (0, 1)) and _aligned(k, (0, 1, 2)) and _aligned(v, (0, 1, 2)))


def _register():
    @torch.library.register_fake("ls_fairseq::decode_attention")
    def _fake(q, k, v, rows, key_padding_mask):
        return q.new_empty(q.shape)


_extension.when_loaded(_register)


def decode_attention_cuda(q, k, v, rows, key_padding_mask=None):
    """out [R, H, D]; for inputs :func:`supports` takes."""
    return torch.ops.ls_fairseq.decode_attention(q, k, v, rows, key_padding_mask)
