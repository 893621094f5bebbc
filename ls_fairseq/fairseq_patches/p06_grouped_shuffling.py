"""fairseq_patches, patch 6: ``EpochBatchIterator.ordered_batches`` (``--grouped-shuffling``
keeps every batch).

fairseq shuffles the epoch's batches in groups of N (one per GPU) and drops the batches after
the last full group, the same ones every epoch: up to N - 1 batches of the longest sentences are
never trained on. Here they come last in the epoch, one per rank
(:func:`ls_fairseq.data.batch_order.remainder_of_groups`), and the ranks left without one run
fairseq's dummy batch (as for any epoch that does not divide by N). The full groups keep
fairseq's order. Without ``--grouped-shuffling``, on one GPU, with ``fix_batches_to_gpus`` or a
prefetching dataset: fairseq's method, unchanged.
"""
import functools

from ..data.batch_order import remainder_of_groups

NUMBER = 6


def targets():
    from fairseq.data.iterators import EpochBatchIterator

    def make(original):
        @functools.wraps(original)
        def ordered_batches(self, epoch, fix_batches_to_gpus, shuffle):
            batches = original(self, epoch, fix_batches_to_gpus, shuffle)
            if not (getattr(self, "grouped_shuffling", False) and shuffle
                    and not fix_batches_to_gpus and not self._supports_prefetch):
                return batches
            extra = remainder_of_groups(self.frozen_batches, self.num_shards, self.shard_id)
            return batches if extra is None else list(batches) + [extra]
        return ordered_batches

    return [(EpochBatchIterator, "ordered_batches", make)]
