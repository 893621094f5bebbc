"""fairseq_patches, patch 7: ``Trainer.get_train_iterator`` (batches fixed to GPUs on several
GPUs).

fairseq deals each epoch's shuffled batches to the GPUs anew, so each GPU keeps meeting batch
shapes its CUDA graphs have not captured. For ls_ runs (``--criterion
ls_label_smoothed_cross_entropy``) on several GPUs of plain data parallelism, GPU r keeps batches
r, r + N, ... of fairseq's length-ordered batches and shuffles them itself each epoch (seed +
epoch + r; a share that comes up short holds one fairseq dummy batch): fairseq's own order under
``--fix-batches-to-gpus``, which fairseq honours only for prefetching datasets. An update's N
batches are then a random pick, one from each GPU's share, as in fairseq's order. Not
length-grouped updates (fairseq's ``--grouped-shuffling``): their N batches are neighbours in
length, and on a learnable corpus that trains slower for the first ~1,000 updates
(docs/QUALITY.md). One log line says so. ``--ls-cost-matching-window W`` (off by default) then
matches an update's batches by cost: in each run of W updates GPU r > 0 orders its batches so
that its k-th costliest (token slots) meets GPU 0's k-th costliest, which the GPUs would
otherwise wait for. ``--ls-no-fix-batches-to-gpus``, one GPU, other criterions, model
parallelism, prefetching datasets and runs that pass ``--grouped-shuffling`` themselves:
fairseq's method, unchanged (``--fix-batches-to-gpus`` passed by the user is the same order).

The switches are the run's :class:`ls_fairseq.training_config.TrainingConfig`
(``ls_fix_batches_to_gpus``, ``ls_cost_matching_window``); a default that steps aside is recorded
there, for the run. The order is :class:`ls_fairseq.data.batch_order.FixedOrder`. The wrapper
hands it to the iterator it returns as that iterator's own ``ordered_batches``
(:func:`fix_batches`), the method through which fairseq's iterator asks for each epoch's
batches; every other iterator keeps fairseq's (patch 6's) method.
"""
import functools
import logging

from .. import switches, training_config
from ..data.batch_order import FixedOrder

NUMBER = 7

logger = logging.getLogger(__package__)


class FixedOrderedBatches:
    """``ordered_batches`` of one fairseq ``EpochBatchIterator`` whose batches are fixed to
    GPUs: :class:`FixedOrder`'s batches for a shuffled epoch of a dataset that does not
    prefetch, else the iterator's class method (fairseq's, as patch 6 wraps it)."""

    def __init__(self, itr, order: FixedOrder):
        self.itr = itr
        self.order = order

    def __call__(self, epoch, fix_batches_to_gpus, shuffle):
        itr = self.itr
        if shuffle and not itr._supports_prefetch:
            return self.order.batches(itr.frozen_batches, itr.dataset, itr.num_shards,
                                      itr.shard_id, itr.seed + epoch)
        return type(itr).ordered_batches(itr, epoch, fix_batches_to_gpus, shuffle)


def fixed_order(itr):
    """The :class:`FixedOrder` of ``itr``'s batches, or None where fairseq's order stands."""
    own = vars(itr).get("ordered_batches")
    return own.order if isinstance(own, FixedOrderedBatches) else None


def fix_batches(itr, window: int = 0) -> None:
    """Fix ``itr``'s batches to GPUs from its next epoch on (``window``: the cost-matching
    window). fairseq hands the same iterator back each epoch: its order is kept."""
    order = fixed_order(itr)
    if order is None or order.window != window:
        itr.ordered_batches = FixedOrderedBatches(itr, FixedOrder(window))


def fixes_batches(trainer) -> bool:
    """Whether patch 7 applies to ``trainer``'s run (see the module docstring)."""
    return not trainer.cfg.dataset.grouped_shuffling and training_config.data_parallel_switch(
        trainer, "ls_fix_batches_to_gpus", "--ls-fix-batches-to-gpus", logger)


def fixed_batches_train_iterator(original):
    """Patch 7's wrapper of ``Trainer.get_train_iterator`` (``original``: fairseq's method)."""
    @functools.wraps(original)
    def get_train_iterator(self, *args, **kwargs):
        itr = original(self, *args, **kwargs)
        config = training_config.of(self)
        window = config.ls_cost_matching_window if config is not None else 0
        fixed = fixes_batches(self)
        if fixed and getattr(itr, "_supports_prefetch", False):
            # fairseq's own --fix-batches-to-gpus path, which FixedOrderedBatches leaves to fairseq
            reason = ("the dataset prefetches, and fairseq keeps its own order for such datasets "
                      "(its --fix-batches-to-gpus gives this order)")
            config.decline("ls_fix_batches_to_gpus", "--ls-fix-batches-to-gpus", reason, logger)
            fixed = False
        if window > 1 and not fixed:  # the criterion's check_run refused the other cases
            raise switches.refusal("--ls-cost-matching-window", "it orders the batches fixed "
                                   "to GPUs, which this run does not use")
        if fixed:
            fix_batches(itr, window)
        if getattr(self, "_ls_fixed_logged", False):
            return itr
        self._ls_fixed_logged = True
        if fixed:
            workers = self.data_parallel_world_size
            logger.info(
                f"batches fixed to GPUs: each of the {workers} GPUs keeps its share of the "
                f"batches (one in {workers}) and shuffles it itself each epoch (fairseq's "
                f"--fix-batches-to-gpus order); --ls-no-fix-batches-to-gpus for fairseq's order"
                + (f"; an update's batches matched by cost in runs of {window} updates "
                   f"(--ls-cost-matching-window)" if window > 1 else ""))
        return itr
    return get_train_iterator


def targets():
    from fairseq.trainer import Trainer

    return [(Trainer, "get_train_iterator", fixed_batches_train_iterator)]
