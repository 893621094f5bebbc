"""Which batches each GPU trains on, in which order, epoch by epoch.

* :func:`remainder_of_groups`: the batches fairseq's ``--grouped-shuffling`` drops, one per rank
  (``fairseq_patches``, patch 6, appends them to the epoch);
* :func:`batches_fixed_to_gpus`: batches fixed to GPUs, fairseq's ``--fix-batches-to-gpus``
  order, optionally matched by cost (:func:`match_costs`, ``--ls-cost-matching-window``);
  :class:`FixedOrder` is that order for one iterator (``fairseq_patches``, patch 7);
* :func:`batch_costs`: each batch's token slots, the cost its GPU pays.
"""


def remainder_of_groups(batches, shards: int, shard_id: int):
    """What fairseq's grouped shuffling leaves out for ``shard_id``: the batches after the last
    full group of ``shards``, one per rank in frozen order (``[]``, fairseq's dummy batch, for
    the ranks past them); ``None`` when every batch is in a group."""
    left = len(batches) % shards
    if left == 0:
        return None
    tail = list(batches)[len(batches) - left:]
    return tail[shard_id] if shard_id < left else []


def batches_fixed_to_gpus(batches, shards: int, shard_id: int, seed: int, costs=None,
                          window: int = 0):
    """``shard_id``'s batches of an epoch as fairseq orders them under ``--fix-batches-to-gpus``
    (its prefetching path): every ``shards``-th batch from ``shard_id`` on, ``[]`` (fairseq's
    dummy batch) where the shard comes up short, shuffled under ``numpy_seed(seed + shard_id)``
    (``seed``: the epoch's). With ``costs`` (one per batch) and ``window`` > 1, the shards'
    orders are then matched by cost (:func:`match_costs`, ``--ls-cost-matching-window``)."""
    mine = _shuffled_share(len(batches), shards, shard_id, seed)
    if costs is not None and window > 1 and shard_id > 0:
        mine = match_costs(_shuffled_share(len(batches), shards, 0, seed), mine, costs, window)
    return [[] if i is None else batches[i] for i in mine]


def _shuffled_share(n_batches: int, shards: int, shard_id: int, seed: int):
    """Indices of ``shard_id``'s batches (None: a dummy), shuffled as fairseq does."""
    import numpy as np
    from fairseq.data import data_utils
    from fairseq.data.iterators import ShardedIterator

    mine = list(ShardedIterator(range(n_batches), shards, shard_id, fill_value=None))
    with data_utils.numpy_seed(seed + shard_id):
        np.random.shuffle(mine)  # the same permutation fairseq draws for a list of this length
    return mine


def match_costs(lead, mine, costs, window: int):
    """``mine`` (a shard's batch indices; None: a dummy, costing the mean) reordered within each
    run of ``window`` steps so that its k-th costliest batch of the run meets the k-th costliest
    of ``lead`` (shard 0's, which keeps its order). A run's batches stay the random pick of the
    shuffle; an update's batches then cost alike, so its GPUs wait less for the slowest one."""
    mean = sum(costs) / max(len(costs), 1)

    def cost(b):
        return mean if b is None else costs[b]

    out = [None] * len(mine)
    for start in range(0, len(mine), window):
        steps = sorted(range(start, min(start + window, len(mine))), key=lambda i: cost(lead[i]))
        for i, b in zip(steps, sorted(mine[start:start + window], key=cost)):
            out[i] = b
    return out


def batch_costs(dataset, batches):
    """Each batch's token slots, the cost its GPU pays: sentences × (longest source + longest
    target) where the dataset has source and target sizes (a language pair), else sentences ×
    its longest ``num_tokens``."""
    import numpy as np

    from ..graphs.shape_buckets import token_slots

    sizes = getattr(dataset, "sizes", None)
    sizes = None if sizes is None else np.asarray(sizes)
    if sizes is not None and sizes.ndim == 2 and sizes.shape[1] == 2:
        return [float(token_slots((len(b), *sizes[np.asarray(b)].max(axis=0)))) if len(b)
                else 0.0 for b in batches]
    return [float(len(b) * max(dataset.num_tokens(int(i)) for i in b)) if len(b) else 0.0
            for b in batches]


class FixedOrder:
    """One training iterator's batches fixed to GPUs: :func:`batches_fixed_to_gpus` of its frozen
    batches each epoch, matched by cost in runs of ``window`` updates when ``window`` > 1 (the
    costs computed once: an iterator's frozen batches never change)."""

    def __init__(self, window: int = 0):
        self.window = window
        self._costs = None

    def batches(self, frozen_batches, dataset, shards: int, shard_id: int, seed: int):
        """``shard_id``'s batches of the epoch whose seed is ``seed``."""
        costs = None
        if self.window > 1:
            if self._costs is None:
                self._costs = batch_costs(dataset, frozen_batches)
            costs = self._costs
        return batches_fixed_to_gpus(frozen_batches, shards, shard_id, seed, costs, self.window)
