"""The gradient accumulators: a model's gradients in flat per-dtype buffers (``FlatGradients``).

The engine (``replay.CudaGraphedLoss``) creates one ``FlatGradients`` for the model it trains, at
its first graphable step. Each trainable parameter's ``.grad`` becomes a view of one buffer (its
accumulator); captured backward graphs write into them and eager steps accumulate into them, so
every training step leaves its gradients in the same buffers. The views start at multiples of
``ALIGN`` elements; the padding between them stays zero.

The optimizer side reaches the object through ``flat_gradients_of(module)`` (ls_adam's
``all_reduce_grads``, by way of ``flat_all_reduce.all_reduce_flat``): whether this update's
all-reduce was already issued during the backward (``all_reduced``, set by the engine after it
queued the buckets of ``grad_buckets.GradBuckets``, taken off by ``all_reduce_flat``).

Why a registry: fairseq hands the optimizer the trainer's model and nothing of the criterion, so
the object is found from the model. ``_REGISTRY`` is a ``weakref.WeakKeyDictionary`` keyed by
the innermost model (the one inside the trainer's wrappers): an entry lives exactly as long as
its model, and the engine, which owns the object, registers it. It is the package's only
process-wide state.
"""
import collections
import weakref

import torch

from ..wrappers import innermost

# Flat accumulator views start at multiples of this many elements (16 bytes for fp16), so the
# vectorised optimizer and norm kernels see aligned gradients.
ALIGN = 16

_REGISTRY = weakref.WeakKeyDictionary()  # innermost model -> its FlatGradients


def register(model, flat_gradients):
    """``flat_gradients`` holds the gradients of ``model`` (or of the model inside its wrappers)."""
    _REGISTRY[innermost(model)] = flat_gradients


def flat_gradients_of(module):
    """The ``FlatGradients`` registered for ``module`` (or for the model inside its wrappers:
    ModuleProxyWrapper, legacy DDP), or None: no engine keeps this model's gradients flat."""
    return _REGISTRY.get(innermost(module))


class FlatGradients:
    """The flat gradient buffers of a list of parameters, and this update's all-reduce state.

    * ``params``: the parameters, in the order given;
    * ``flats``: one zeroed 1-D buffer per (dtype, device), in order of first appearance;
    * ``views``: per parameter, its accumulator, a view of its buffer shaped like it;
    * ``spans``: per parameter, ``(index in flats, offset, numel)`` of its accumulator;
    * ``all_reduced``: True once this update's all-reduce of every buffer has been issued during
      the backward (the engine sets it, ``flat_all_reduce.all_reduce_flat`` and the start of the
      next update take it off);
    * ``peer_reduce``: the engine's copy-engine all-reduce (``peer_all_reduce.PeerAllReduce``)
      once it has decided on it, else None; ``scattered``: this update's all-reduce left each
      rank only its own summed shards (``scatter_only``: the sharded optimizer step follows,
      ``sharded_step.py``; the optimizer takes the mark off).
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
        self.all_reduced = False
        self.peer_reduce = None
        self.scattered = False

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
        start of an update (the ``all_reduced`` mark is taken off). ``zero=False``: at the start
        of an update the accumulators are left as they are (a backward graph that overwrites
        them follows)."""
        foreign = []
        if fresh:
            if zero:
                for flat in self.flats:
                    flat.zero_()
            self.all_reduced = False
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
