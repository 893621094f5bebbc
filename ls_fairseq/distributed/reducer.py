"""The engine's gradient all-reduce (``GradientReducer``): the bucket plan, NCCL's or the copy
engines' reduction, and when it runs; and the record of what it did, handed to the optimizer
once per update as a ``GradientExchange`` (``exchange.py``).

The training-step engine (``graphs.replay.CudaGraphedLoss``) creates one reducer over the model's
flat gradient buffers (``graphs.flat_gradients.FlatGradients``) at its first graphable step and
registers it for the model. Per update it calls, in this order:

* ``start_update()`` at the update's first backward (the gradients are fresh): a record left
  from an update nobody took is dropped;
* ``expect(ddp, ready)`` when a forward's backward ends the update (the last micro-batch, with a
  data-parallel wrapper whose gradient sync is due): ``ready`` are the per-bucket events a
  captured backward records, or None (wait for the whole backward);
* ``queue()`` when that backward starts: ``issue`` is queued for the end of the autograd pass;
* ``issue()`` (autograd calls it): every bucket's all-reduce is queued on a side stream behind
  its event (``grad_buckets.GradBuckets.issue``), by NCCL (``grad_buckets.legacy_reduce``) or by
  copy engines (``peer_all_reduce``: chosen at the first update by every rank together), and the
  record says ``REDUCED`` (or ``SCATTERED`` once the sharded step has asked the copy engines to
  stop after phase 3).

ls_adam's ``all_reduce_grads`` then takes the record (``exchange.exchange_of(model)`` ->
``take_exchange()``) and reduces nothing more where it says the buffers were reduced.
"""
import collections
import logging

import torch

from .. import switches
from ..wrappers import is_torch_ddp, world_size
from . import grad_buckets, peer_all_reduce
from .exchange import NOTHING, REDUCED, SCATTERED, GradientExchange

logger = logging.getLogger(__name__)


class _PendingReduce:
    """The gradient all-reduce due at the end of this backward (the update's last micro-batch)."""

    def __init__(self, ddp, ready):
        self.ddp = ddp
        self.ready = ready  # per bucket an event, or None: wait for the whole backward
        self.queued = False


class GradientReducer:
    """The all-reduce of one model's flat gradients (see the module doc).

    ``grads``: the ``FlatGradients``; ``bucket_mb``: ``--ls-all-reduce-bucket-mb`` (0: one bucket
    per buffer, all-reduced after the backward); ``copy_engine``: ``--ls-(no-)copy-engine-all-
    reduce`` (``switches.AUTO``/``ON``/``OFF``); ``reduce_bucket``: a function ``bucket -> work``
    used instead of NCCL's or the copy engines' reduction (tests swap it); ``stats``: the
    engine's counter (``overlapped_all_reduce``: updates whose all-reduce was issued here)."""

    def __init__(self, grads, bucket_mb=25.0, copy_engine=switches.AUTO, reduce_bucket=None,
                 stats=None):
        self.grads = grads
        self.bucket_mb = bucket_mb
        self.copy_engine = copy_engine
        self.reduce_bucket = reduce_bucket
        self.stats = collections.Counter() if stats is None else stats
        bucket_bytes = bucket_mb * 2**20 if bucket_mb > 0 else float("inf")
        #: the bucket plan (grad_buckets.GradBuckets): the engine's captured backward records
        #: one event per bucket
        self.buckets = grad_buckets.GradBuckets(grads.flats, grads.spans, bucket_bytes)
        self._peer = None  # the copy-engine all-reduce; False: NCCL's; None: not decided yet
        self._pending = None  # the pending all-reduce of this update (_PendingReduce)
        self._kind = NOTHING  # what this update's all-reduce did so far (exchange.py)

    @property
    def peer(self):
        """The copy-engine all-reduce (``peer_all_reduce.PeerAllReduce``) chosen for this run,
        or None (NCCL's, or not decided yet)."""
        return self._peer or None

    # -- the engine's calls, in the order of one update ------------------------------------------

    def start_update(self):
        """The update's first backward: a record nobody took is dropped."""
        self._kind = NOTHING

    def expect(self, ddp, ready):
        """This forward's backward ends the update: all-reduce the gradients at its end."""
        if self._pending is not None and not self._pending.queued:
            # a second forward before the backward: both end in one autograd pass, and the
            # replay's events do not cover the other's gradients, so wait for the whole pass
            self._pending.ready = None
            return
        self._pending = _PendingReduce(ddp, ready)

    def queue(self):
        """Called when the backward starts: the all-reduce runs when the autograd pass ends
        (every gradient of the pass is then accumulated)."""
        if self._pending is not None and not self._pending.queued:
            self._pending.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.issue)

    def issue(self):
        """Issues the expected all-reduce now (autograd calls it at the end of the backward)."""
        pending, self._pending = self._pending, None
        ddp, buckets = pending.ddp, self.buckets
        if not self.grads.bound():
            if is_torch_ddp(ddp):  # DDP's hooks are idle: nobody else reduces these
                self._all_reduce_each(ddp)
            return  # legacy DDP: a .grad someone else allocated; all_reduce_grads decides
        reduce = (self.reduce_bucket or self._peer
                  or (self._peer is None and self.copy_engine_reduce(ddp.process_group))
                  or grad_buckets.legacy_reduce(world_size(ddp), ddp.process_group))
        ready = pending.ready or [None] * len(buckets.buckets)
        buckets.issue(self.grads.flats, ready, reduce)
        self._kind = SCATTERED if getattr(reduce, "scatter_only", False) else REDUCED
        if not self.stats["overlapped_all_reduce"]:
            logger.info(f"--ls-cuda-graphs: all-reducing gradients in {len(buckets.buckets)} "
                        f"buckets (--ls-all-reduce-bucket-mb {self.bucket_mb:g}) as the backward "
                        f"completes them")
        self.stats["overlapped_all_reduce"] += 1

    def take_exchange(self) -> GradientExchange:
        """This update's ``GradientExchange``; the record is reset (handed over once)."""
        kind, self._kind = self._kind, NOTHING
        return GradientExchange(self.grads, kind, self.peer)

    # -- NCCL or copy engines --------------------------------------------------------------------

    def copy_engine_reduce(self, group):
        """The copy-engine all-reduce (``peer_all_reduce.py``), or None for NCCL's. Decided at
        the first call (the first update), by every rank of ``group`` together (it exchanges the
        buffers' IPC handles): ``--ls-copy-engine-all-reduce`` refuses where it cannot apply,
        the default steps aside with one line."""
        if self._peer is None:
            self._peer = False
            if self.copy_engine != switches.OFF:
                peer, reason = peer_all_reduce.create(self.grads.flats, self.buckets.buckets,
                                                      group)
                if peer is None:
                    switches.refuse_or_step_aside(self.copy_engine, peer_all_reduce.FLAG,
                                                  reason, logger)
                else:
                    logger.info(f"{peer_all_reduce.FLAG[2:]}: the gradients travel between the "
                                f"{peer.plan.world} GPUs by copy engines (peer memory), one sum "
                                f"kernel per bucket shard; --ls-no-copy-engine-all-reduce for "
                                f"NCCL's all-reduce")
                    self._peer = peer
        return self.peer

    def use_copy_engines(self, peer):
        """Takes ``peer`` (a ``PeerAllReduce`` every rank has agreed on) as this run's reduction,
        as ``copy_engine_reduce`` does at the first update (tests that simulate several ranks in
        one process build theirs by hand)."""
        if self._peer is not None:
            raise RuntimeError("GradientReducer: the reduction is already chosen")
        self._peer = peer

    def _all_reduce_each(self, ddp):
        """Under torch DDP, gradients not all in the flat buffers (a ``.grad`` someone else
        allocated): each parameter's, averaged as DDP would have done."""
        n = world_size(ddp)
        for p in self.grads.params:
            if p.grad is not None:
                p.grad.div_(n)
                torch.distributed.all_reduce(p.grad, group=ddp.process_group)
        self._kind = REDUCED
