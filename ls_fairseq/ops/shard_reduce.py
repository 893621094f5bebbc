"""The reduction step of the copy-engine all-reduce (``distributed/peer_all_reduce.py``): one rank's
shard of a gradient bucket plus the same shard from every other rank, times ``scale`` (1 / world
size), accumulated in float32 in the order given and rounded once, in place.

fairseq's legacy all-reduce divides each rank's gradient by the world size in its dtype and lets
NCCL add them in that dtype, rounding at every addition; this sums the same terms with one
rounding (on 2 GPUs: the same result but for float16 subnormals).
"""
import torch

from . import _extension


def shard_reduce_reference(out, parts, scale: float):
    acc = out.float()
    for part in parts:
        acc = acc + part.float()
    out.copy_(acc * scale)
    return out


def shard_reduce_(out, parts, scale: float):
    """``out = (out + sum(parts)) * scale`` in place (see the module doc); returns ``out``."""
    parts = list(parts)
    if _extension.use_kernels(out, *parts) and _extension.has_op("shard_reduce_"):
        from . import _shard_reduce_cuda as cuda

        if cuda.supports(out, parts):
            cuda.shard_reduce_cuda(out, parts, scale)
            return out
    return shard_reduce_reference(out, parts, scale)
