"""Where every shard of every gradient bucket lives on every rank (``ShardPlan``), and the
alignment of the flat gradient layout (``ALIGN``).

The copy-engine all-reduce (``peer_all_reduce.py``) cuts each bucket into one shard per rank and
sums shard ``k`` on rank ``k``; the sharded optimizer step (``sharded_step.py``) then runs Adam on
exactly the shards its rank summed. Both read this one plan, so they agree on every boundary.
"""

#: Flat gradient views (``graphs.flat_gradients``) and every shard start at multiples of this
#: many elements (16 bytes for fp16), so the vectorised optimizer, norm and shard-sum kernels see
#: aligned data; padding between views stays zero.
ALIGN = 16


class ShardPlan:
    """Where every shard of every bucket lives, on every rank (the same on all of them).

    ``buckets``: ``(flat index, lo, hi)`` per bucket, as ``GradBuckets.buckets``; ``numels``: the
    flat buffers' sizes. ``shards[b][k]``: the ``(start, end)`` of bucket ``b``'s shard ``k`` in its
    flat buffer (multiples of ``align`` elements, so every shard starts 16-byte aligned; the last
    ones may be empty). Rank ``r``'s staging buffer for flat buffer ``f`` holds ``world - 1`` slots
    of ``shard_numel[r][f]`` elements, one per other rank in rank order; ``offset[r][b]`` is where
    bucket ``b``'s shard ``r`` sits inside a slot.
    """

    def __init__(self, buckets, numels, world: int, align: int = ALIGN):
        self.buckets, self.world = list(buckets), world
        self.shards = []
        self.offset = [[0] * len(self.buckets) for _ in range(world)]
        self.shard_numel = [[0] * len(numels) for _ in range(world)]
        for b, (f, lo, hi) in enumerate(self.buckets):
            step = -(-(hi - lo) // world)
            step = -(-step // align) * align
            cuts = [min(hi, lo + k * step) for k in range(world + 1)]
            self.shards.append([(cuts[k], cuts[k + 1]) for k in range(world)])
            for r in range(world):
                self.offset[r][b] = self.shard_numel[r][f]
                self.shard_numel[r][f] += cuts[r + 1] - cuts[r]

    def slot(self, src: int, dst: int) -> int:
        """The slot of ``dst``'s staging buffers that receives ``src``'s copies."""
        return src if src < dst else src - 1

    def staging_numel(self, rank: int, f: int) -> int:
        return (self.world - 1) * self.shard_numel[rank][f]

    def staged(self, src: int, dst: int, b: int):
        """``(start, end)`` in ``dst``'s staging buffer (of bucket ``b``'s flat) of the copy of
        ``dst``'s shard of bucket ``b`` that ``src`` pushes."""
        f = self.buckets[b][0]
        start = self.slot(src, dst) * self.shard_numel[dst][f] + self.offset[dst][b]
        lo, hi = self.shards[b][dst]
        return start, start + hi - lo
