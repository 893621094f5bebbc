"""bench/shard_balance.py: its epoch order is that of fairseq's EpochBatchIterator.ordered_batches
as ls_fairseq runs it (with and without --grouped-shuffling, whose remainder ls_fairseq keeps:
fairseq_patches patch 6; on 1, 2, 3 and 4 shards), and its model of the multi-GPU step behaves
as its docstring says on a small corpus."""
import numpy as np
import pytest
from fairseq.data import iterators

from fairseq_helpers import IndexDataset

import shard_balance  # bench/ (pytest.ini's pythonpath)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("shards", [1, 2, 3, 4])
@pytest.mark.parametrize("n_batches", [1, 7, 24, 57])
def test_epoch_order_is_fairseqs(grouped, shards, n_batches):
    batches = [np.array([i], dtype=np.int64) for i in range(n_batches)]
    for epoch in (1, 2, 5):
        ours = shard_balance.epoch_order(n_batches, shards, epoch, seed=3, grouped=grouped)
        assert len(ours) == shards
        for rank in range(shards):
            itr = iterators.EpochBatchIterator(
                IndexDataset(), collate_fn=lambda x: x, batch_sampler=batches, seed=3,
                num_shards=shards, shard_id=rank, grouped_shuffling=grouped)
            theirs = itr.ordered_batches(epoch, fix_batches_to_gpus=False, shuffle=True)
            # fairseq's short shard gets [] (its trainer then runs a dummy batch): our None
            assert [None if len(b) == 0 else int(b[0]) for b in theirs] == ours[rank], \
                (epoch, rank)


def test_grouped_shuffling_keeps_each_ranks_batches():
    """Grouped: the N batches of an update are neighbours in fairseq's length order, and each
    rank takes the same batches every epoch (only their order changes); the default deals
    batches anew each epoch."""
    def sets(grouped, epoch):
        return [set(s) for s in shard_balance.epoch_order(40, 4, epoch, 1, grouped)]

    assert sets(True, 1) == sets(True, 2) == sets(True, 7)
    assert sets(False, 1) != sets(False, 2)
    for update in zip(*shard_balance.epoch_order(40, 4, 1, 1, True)):
        assert max(update) - min(update) == 3 and min(update) % 4 == 0
    last = [shard[-1] for shard in shard_balance.epoch_order(42, 4, 3, 1, True)]
    assert last == [40, 41, None, None]  # the remainder comes last; dummies fill the update


def test_model_of_the_step():
    """One GPU is its own reference; N GPUs of identical batches would scale by N less the
    all-reduce; on the benchmark's lengths grouped shuffling captures nothing after epoch 1
    and loses less to the slowest rank than fairseq's default dealing."""
    raw = [(8, 20, 22)] * 16
    tokens = [8 * 22] * 16
    one = shard_balance.simulate(raw, tokens, 1, 2, 1, False, 1e-6, 0.1, 0.0)
    four = shard_balance.simulate(raw, tokens, 4, 2, 1, False, 1e-6, 0.1, 0.0)
    assert [e["captures"] for e in one] == [1, 0] and [e["captures"] for e in four] == [4, 0]
    assert one[1]["seconds"] / four[1]["seconds"] == pytest.approx(4.0)
    assert four[1]["straggler_s"] == 0.0

    rows = shard_balance.main(["--sentences", "6000", "--gpus", "4", "--epochs", "3"])
    by = {(r["grouped_shuffling"], r["epoch"]): r for r in rows}
    assert by[True, 2]["captures"] == by[True, 3]["captures"] == 0
    assert by[False, 2]["captures"] > 0
    for epoch in (2, 3):
        assert by[True, epoch]["straggler_share"] < by[False, epoch]["straggler_share"]
        assert by[True, epoch]["scaling"] > by[False, epoch]["scaling"]
        assert 0 < by[True, epoch]["scaling"] <= 4.0
