"""The gradient accumulators: a model's gradients in flat per-dtype buffers (``FlatGradients``).

The engine (``replay.CudaGraphedLoss``) creates one ``FlatGradients`` for the model it trains, at
its first graphable step. Each trainable parameter's ``.grad`` becomes a view of one buffer (its
accumulator); captured backward graphs write into them and eager steps accumulate into them, so
every training step leaves its gradients in the same buffers. The views start at multiples of
``ALIGN`` elements (``distributed.shard_plan``: the shards of the copy-engine all-reduce align
with them); the padding between them stays zero.

This is the layout only: what happened to the gradients in an update (all-reduced during the
backward, scattered to shards) is the engine's ``distributed.GradientReducer``'s record, handed to
the optimizer as a ``distributed.GradientExchange`` (which carries this object as ``grads``).
"""
import collections

import torch

from ..distributed.shard_plan import ALIGN

__all__ = ["ALIGN", "FlatGradients"]


class FlatGradients:
    """The flat gradient buffers of a list of parameters.

    * ``params``: the parameters, in the order given;
    * ``flats``: one zeroed 1-D buffer per (dtype, device), in order of first appearance;
    * ``views``: per parameter, its accumulator, a view of its buffer shaped like it;
    * ``spans``: per parameter, ``(index in flats, offset, numel)`` of its accumulator.
    """

    def __init__(self, params):
        self.params = list(params)
        by_dtype = collections.OrderedDict()
        for p in self.params:
            by_dtype.setdefault((p.dtype, p.device), []).append(p)
        self.flats, views, spans = [], {}, {}
        for (dtype, device), ps in by_dtype.items():
            offsets, total = [], 0
            for p in ps:
                offsets.append(total)
                total += (p.numel() + ALIGN - 1) // ALIGN * ALIGN
            flat = torch.zeros(total, dtype=dtype, device=device)
            for p, off in zip(ps, offsets):
                views[id(p)] = flat[off:off + p.numel()].view_as(p)
                spans[id(p)] = (len(self.flats), off, p.numel())
            self.flats.append(flat)
        self.views = [views[id(p)] for p in self.params]
        self.spans = [spans[id(p)] for p in self.params]

    def holds(self, buffer) -> bool:
        """Whether ``buffer`` is one of the flat buffers."""
        return any(buffer is flat for flat in self.flats)

    def fresh(self) -> bool:
        """No gradient yet in this update (fairseq's zero_grad sets every ``.grad`` to None)."""
        return all(p.grad is None for p in self.params)

    def bound(self) -> bool:
        """Every parameter's ``.grad`` is its accumulator."""
        return all(p.grad is not None and p.grad.data_ptr() == acc.data_ptr()
                   for p, acc in zip(self.params, self.views))

    def bind(self, fresh, zero=True):
        """Points each parameter's ``.grad`` that is None at its accumulator, zeroed (autograd
        then adds into it in place). Returns the (parameter, accumulator) pairs whose ``.grad``
        someone else allocated; those accumulators are zeroed too. ``fresh``: ``fresh()``, the
        start of an update. ``zero=False``: at the start
        of an update the accumulators are left as they are (a backward graph that overwrites
        them follows)."""
        foreign = []
        if fresh:
            if zero:
                for flat in self.flats:
                    flat.zero_()
            for p, acc in zip(self.params, self.views):
                p.grad = acc
            return foreign
        for p, acc in zip(self.params, self.views):
            if p.grad is None:
                acc.zero_()
                p.grad = acc
            elif p.grad.data_ptr() != acc.data_ptr():  # a .grad someone else allocated
                acc.zero_()
                foreign.append((p, acc))
        return foreign
