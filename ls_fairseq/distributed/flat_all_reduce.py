"""One all-reduce per flat gradient buffer under fairseq's ``--ddp-backend legacy_ddp``/``no_c10d``;
under torch DDP, the bookkeeping of the engine's own all-reduce.

fairseq's ``LegacyDistributedDataParallel.all_reduce_grads`` copies every gradient into a
staging buffer (as large as the model: 420 MB of fp16 for transformer big), divides it by the
world size, all-reduces it and copies every gradient back: two Python loops over ~260 tensors and
~520 copy kernels per update. When the gradients already live in flat buffers (the CUDA-graph
replay of ``--ls-cuda-graphs`` accumulates them there), dividing and all-reducing each buffer in
place gives the same numbers with one launch per buffer and no staging memory.

The flat path is taken only when it is provably the same operation: every parameter has a
gradient, each gradient is a view of a 1-D contiguous buffer, the views of a buffer do not
overlap, and what they leave uncovered is at most alignment padding (fewer than ``_MAX_PAD``
elements per view; the graph runner keeps it zero). Otherwise fairseq's own method runs.

All ranks must take the same path: fairseq's method all-reduces packed gradients (no padding, in
chunks of its buffer size), so a rank on it and a rank on the flat path could pair NCCL calls of
different sizes. With ``--ls-cuda-graphs`` every training step, replayed or eager, accumulates
into the flat buffers (``graphs/flat_gradients.py``), so every rank takes the flat path.

With ``--ls-cuda-graphs`` the buffers are normally all-reduced earlier, bucket by bucket during
the backward (``grad_buckets.py``, scheduled by the engine's ``reducer.GradientReducer``); the
update's ``GradientExchange`` (``exchange.py``) then says ``reduced``, and this function reduces
nothing. Otherwise (``--ls-all-reduce-bucket-mb 0``, or gradients that are flat without an engine
behind them) it does the whole reduction itself.

Under torch DDP (``--ddp-backend c10d``/``pytorch_ddp``) the engine runs the training steps inside
DDP and always all-reduces the gradients itself at the end of the update's backward
(``graphs/replay.py``'s module doc); this function then only checks that it did. Without an
engine, DDP's own hooks did.
"""
import torch

from ..wrappers import data_parallel_of, grad_sync_due, is_torch_ddp, world_size
from .shard_plan import ALIGN

# the engine's accumulators align each view to ALIGN (16) elements
_MAX_PAD = ALIGN


def flat_grad_buffers(params):
    """The 1-D buffers that hold all of ``params``' gradients and nothing else, or None."""
    by_base = {}
    for p in params:
        g = p.grad
        if g is None or g._base is None or hasattr(p, "expert"):
            return None
        base = g._base
        if base.dim() != 1 or not base.is_contiguous() or not g.is_contiguous():
            return None
        by_base.setdefault(id(base), (base, []))[1].append(
            (g.storage_offset() - base.storage_offset(), g.numel()))
    buffers = []
    for base, spans in by_base.values():
        spans.sort()
        end = 0
        for start, n in spans:
            if start < end or start - end >= _MAX_PAD:
                return None  # overlapping views, or a gap wider than padding
            end = start + n
        if end > base.numel() or base.numel() - end >= _MAX_PAD:
            return None
        buffers.append(base)
    return buffers


def all_reduce_flat(module, exchange):
    """fairseq's legacy all-reduce of the model's gradients (sum / world size), done in place on
    their flat buffers. True if done; False if the caller should use fairseq's own method (no
    data-parallel wrapper, torch DDP without the engine, or the gradients are not flat).
    ``exchange``: this update's ``GradientExchange`` from the engine that keeps ``module``'s
    gradients (``exchange.exchange_of``), or None where no engine keeps them."""
    ddp = data_parallel_of(module)
    if ddp is None:
        return False
    if is_torch_ddp(ddp):
        return _engine_reduced(ddp, exchange)
    buffers = flat_grad_buffers([p for p in ddp.module.parameters() if p.requires_grad])
    if buffers is None:
        return False
    if not grad_sync_due(ddp):  # inside no_sync(): fairseq's method does nothing there either
        return True
    reduced = [exchange is not None and exchange.reduced and exchange.grads.holds(buf)
               for buf in buffers]
    if all(reduced):  # during the backward (grad_buckets.py); no buffers: nothing to reduce
        return True
    if any(reduced):
        raise RuntimeError("ls_fairseq: some flat gradient buffers were all-reduced during the "
                           "backward and others not; please report this")
    for buf in buffers:
        buf.div_(world_size(ddp))
        torch.distributed.all_reduce(buf, group=ddp.process_group)
    return True


def _engine_reduced(ddp, exchange):
    """Under torch DDP: True if the engine keeps this model's gradients (it has all-reduced them
    at the end of the backward), False if DDP's own hooks did."""
    if exchange is None:
        return False
    if not grad_sync_due(ddp):  # inside no_sync(): nothing is due yet
        return True
    if not exchange.reduced:
        raise RuntimeError("ls_fairseq: under torch DDP the CUDA-graph engine keeps the gradients, "
                           "but it did not all-reduce them at the end of this update's backward; "
                           "train with --ls-no-cuda-graphs, and please report this")
    return True
