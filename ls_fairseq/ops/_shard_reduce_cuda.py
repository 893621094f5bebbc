"""CUDA binding of :func:`ls_fairseq.ops.shard_reduce.shard_reduce_` (``csrc/shard_reduce.cu``).

Op: ``torch.ops.ls_fairseq.shard_reduce_(out, parts, scale) -> ()``, in place on ``out``; not
differentiable (it runs on gradients, outside autograd). Its fake is registered here once the
extension is loaded. What the kernel takes is :func:`supports`; the public module runs the
reference otherwise.
"""
import torch

from . import _extension

#: the kernel's limit on the number of parts (csrc/shard_reduce.cu, kMaxParts): 16 GPUs
MAX_PARTS = 15


def supports(out, parts) -> bool:
    """Whether the kernel takes ``out`` and ``parts`` (CUDA tensors, as ``use_kernels`` checks):
    contiguous, of one float dtype (float32/float16/bfloat16) and size, at most
    :data:`MAX_PARTS` parts. Peer memory (another GPU's, mapped into this process) is a tensor of
    this process's device."""
    return (out.is_contiguous() and out.dtype in _extension.KERNEL_DTYPES
            and len(parts) <= MAX_PARTS
            and all(p.is_contiguous() and p.dtype == out.dtype and p.numel() == out.numel()
                    for p in parts))


def _register():
    @torch.library.register_fake("ls_fairseq::shard_reduce_")
    def _fake(out, parts, scale):
        return None


_extension.when_loaded(_register)


def shard_reduce_cuda(out, parts, scale: float):
    torch.ops.ls_fairseq.shard_reduce_(out, list(parts), float(scale))
