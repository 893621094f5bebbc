"""bench/shard_balance.py: its epoch order (fairseq's own iterator, with ls_fairseq's patch 6,
itself tested against fairseq in tests/test_fairseq_patches.py) deals batches as its docstring
says, and its model of the multi-GPU step behaves as its docstring says on a small corpus."""
import pytest

import shard_balance  # bench/ (pytest.ini's pythonpath)


def test_grouped_shuffling_keeps_each_ranks_batches():
    """Grouped: the N batches of an update are neighbours in fairseq's length order, and each
    rank takes the same batches every epoch (only their order changes); the default deals
    batches anew each epoch."""
    def sets(order, epoch):
        return [set(s) for s in shard_balance.epoch_order(40, 4, epoch, 1, order)]

    assert sets("grouped", 1) == sets("grouped", 2) == sets("grouped", 7)
    assert sets("fairseq", 1) != sets("fairseq", 2)
    for update in zip(*shard_balance.epoch_order(40, 4, 1, 1, "grouped")):
        assert max(update) - min(update) == 3 and min(update) % 4 == 0
    last = [shard[-1] for shard in shard_balance.epoch_order(42, 4, 3, 1, "grouped")]
    assert last == [40, 41, None, None]  # the remainder comes last; dummies fill the update


def test_model_of_the_step():
    """One GPU is its own reference; N GPUs of identical batches would scale by N less the
    all-reduce; on the benchmark's lengths grouped shuffling captures nothing after epoch 1
    and loses less to the slowest rank than fairseq's default dealing."""
    raw = [(8, 20, 22)] * 16
    one = shard_balance.simulate(raw, 1, 2, 1, "fairseq", 1e-6, 0.1, 0.0)
    four = shard_balance.simulate(raw, 4, 2, 1, "fairseq", 1e-6, 0.1, 0.0)
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


def test_shape_policies():
    """``cap``: no rank pads past the update's largest grid shape (or its own grid shape), where
    ``own`` may take an earlier, larger shape within the slack; ``shared``: one shape list, so
    ranks with the same raw batch pad alike whatever each saw before."""
    from ls_fairseq.graphs.shape_buckets import bucket, token_slots

    def grid(b):
        return token_slots(tuple(bucket(n, shard_balance.BUCKETS) for n in b))

    big, small = (40, 100, 110), (40, 95, 100)
    for policy, expect_reuse in (("own", True), ("cap", False)):
        gpus = [shard_balance.Rank() for _ in range(2)]
        shard_balance.padded_shapes(gpus, [big, big], policy)  # both ranks hold big's shape
        shapes = shard_balance.padded_shapes(gpus, [small, small], policy)
        reused = token_slots(shapes[0]) == grid(big)
        assert reused == expect_reuse, policy
        if policy == "cap":
            assert all(token_slots(s) <= grid(small) for s in shapes)

    common = shard_balance.ShapeBuckets(shard_balance.BUCKETS, shard_balance.SLACK)
    gpus = [shard_balance.Rank(common) for _ in range(2)]
    shard_balance.padded_shapes(gpus, [big, small], "shared")  # only rank 0 ran big
    shapes = shard_balance.padded_shapes(gpus, [small, small], "shared")
    assert shapes[0] == shapes[1]


def test_sharded_optimizer_step():
    """The optimizer's time per update: one GPU pays it whole; N GPUs whole (today) or 1/N of
    it plus the parameter copies (``--sharded-optimizer``). Identical batches, closed form."""
    raw = [(8, 20, 22)] * 16
    rate, opt, gather = 1e-6, 2e-3, 5e-4
    step = shard_balance.token_slots(shard_balance.Rank().buckets.shape_for(raw[0])) * rate
    one = shard_balance.simulate(raw, 1, 2, 1, "fairseq", rate, 0.0, 0.0, optimizer_s=opt)
    four = shard_balance.simulate(raw, 4, 2, 1, "fairseq", rate, 0.0, 0.0, optimizer_s=opt)
    sharded = shard_balance.simulate(raw, 4, 2, 1, "fairseq", rate, 0.0, 0.0, optimizer_s=opt,
                                     gather_s=gather)
    assert one[1]["seconds"] == pytest.approx(16 * (step + opt))
    assert four[1]["seconds"] == pytest.approx(4 * (step + opt))
    assert sharded[1]["seconds"] == pytest.approx(4 * (step + opt / 4 + gather))

    base = ["--sentences", "6000", "--gpus", "4", "--epochs", "2"]
    plain = shard_balance.main(base + ["--optimizer-ms", "2"])
    shard = shard_balance.main(base + ["--optimizer-ms", "2", "--sharded-optimizer", "0.5"])
    for a, b in zip(plain, shard):
        assert b["scaling"] > a["scaling"]  # 1.5 ms of Adam saved against 0.5 ms of copies
    with pytest.raises(SystemExit):
        shard_balance.main(base + ["--optimizer-ms", "1e6"])


def test_per_rank_order_keeps_each_ranks_batches_and_pairs_them_at_random():
    """per_rank (ls_'s order, patch 7's function): rank r holds batches r, r + N, ... every
    epoch, each rank's order is its own and changes with the epoch, and an update's batches are
    not length neighbours; each shorter shard holds one dummy, and every shard has as many
    steps."""
    epochs = [shard_balance.epoch_order(42, 4, e, 1, "per_rank") for e in (1, 2)]
    for shards in epochs:
        assert [sorted(b for b in s if b is not None) for s in shards] == \
            [list(range(r, 42, 4)) for r in range(4)]
        assert [s.count(None) for s in shards] == [0, 0, 1, 1]
        assert len({len(s) for s in shards}) == 1
    assert epochs[0] != epochs[1]
    one = epochs[0]
    assert one[0][:10] != [b - 1 for b in one[1][:10]]  # not shifted copies of one order
    spreads = [max(u) - min(u) for u in zip(*one) if None not in u]
    assert max(spreads) > 3  # grouped updates span exactly 3


def test_model_orders_on_a_small_corpus():
    """After epoch 1 per_rank captures far fewer shapes than fairseq's dealing (each rank keeps
    its batches; only the slack's choice of an earlier shape varies with the order), and it
    waits for the slowest rank more than grouped does."""
    rows = shard_balance.main(["--sentences", "6000", "--gpus", "4", "--epochs", "3",
                               "--orders", "fairseq", "grouped", "per_rank"])
    by = {(r["order"], r["epoch"]): r for r in rows}
    for epoch in (2, 3):
        assert by["per_rank", epoch]["captures"] * 3 < by["fairseq", epoch]["captures"]
        assert by["per_rank", epoch]["straggler_share"] > by["grouped", epoch]["straggler_share"]


def test_matched_order_waits_less_and_correlates_lengths():
    """In the model, matching costs in windows of 16 updates (--ls-cost-matching-window, patch
    7's own function) waits less for the slowest rank than per_rank, and its updates pair
    lengths more alike than per_rank's (less than grouped's)."""
    rows = shard_balance.main(["--sentences", "40000", "--gpus", "4", "--epochs", "2",
                               "--orders", "grouped", "per_rank", "matched"])
    by = {(r["order"], r["epoch"]): r for r in rows}
    assert by["matched", 2]["straggler_share"] < by["per_rank", 2]["straggler_share"]
    corr = {o: by[o, 2]["length_correlation"] for o in ("grouped", "per_rank", "matched")}
    assert abs(corr["per_rank"]) < corr["matched"] < corr["grouped"]
    assert by["matched", 2]["window"] == 16
