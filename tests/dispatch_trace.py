"""What aten ops a piece of autograd runs: a ``TorchDispatchMode`` that records each op and the
dtype and shape of what it returns. Used to check that a backward creates no zero gradients
(autograd fills a zero tensor for every output without a gradient unless the op's
``setup_context`` calls ``ctx.set_materialize_grads(False)``)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class RecordOps(TorchDispatchMode):
    """``with RecordOps() as rec: ...``; ``rec.ops`` = [(op name, dtype, shape), ...]."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.ops += [(str(func), t.dtype, tuple(t.shape))
                     for t in outs if isinstance(t, torch.Tensor)]
        return out


def fills_in_backward(out, grad):
    """The ops of ``out.backward(grad)`` that create zeros or fill a tensor (``zeros``,
    ``zeros_like``, ``fill_``; not ``zero_`` of a slice, which pads). ``grad`` is made before
    recording."""
    with RecordOps() as rec:
        out.backward(grad)
    return [op for op in rec.ops if "fill" in op[0] or "zeros" in op[0]]
