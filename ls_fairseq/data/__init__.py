"""The order of an epoch's batches, as the plugin deals them to GPUs (``batch_order``).

Policy only: functions of batch lists, shard counts and seeds, with fairseq's own shuffle. The
fairseq patches that hand these orders to fairseq's ``EpochBatchIterator``
(``ls_fairseq.fairseq_patches``, patches 6 and 7) call them.

Imports: fairseq's data utilities and ``ls_fairseq.graphs.shape_buckets`` (a batch's token
slots); nothing from ``criterions``, ``optim``, ``models``, ``generation`` or
``fairseq_patches``.
"""
from .batch_order import (
    FixedOrder,
    batch_costs,
    batches_fixed_to_gpus,
    match_costs,
    remainder_of_groups,
)

__all__ = ["FixedOrder", "batch_costs", "batches_fixed_to_gpus", "match_costs",
           "remainder_of_groups"]
