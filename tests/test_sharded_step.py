"""The sharded optimizer step (ls_fairseq/distributed/sharded_step.py, driven by ls_adam's
LSFusedFP16Optimizer from the engine's GradientExchange) on the CPU, against the whole step of
the same optimizer.

Several ranks are simulated in one process, each in its own thread: a rank's "peer memory" is
the other ranks' tensors themselves, the barriers are thread barriers and the one-element and
consolidating all-reduces sum the ranks' tensors in rank order. Each rank runs the copy-engine
all-reduce's phases, fairseq's optimizer calls (all_reduce_grads, clip_grad_norm, step) and the
weight pushes as it would on its GPU. The reference is one LSFusedFP16Optimizer stepping the
whole model on the same summed gradients (fairseq's FP16Optimizer + adam semantics, tested in
test_ls_adam.py / test_deferred_overflow.py).

Tolerances: without clipping every rank's weights, fp32 master and moments must equal the
reference bit for bit (Adam is elementwise; the pieces are the same elements). The grad norm is
summed in another order (per shard, then over the ranks): relative 1e-6, and with clipping the
clip factor inherits that: relative 1e-6 on the fp32 master and moments, one fp16 ulp on the
weights. The real thing (CUDA IPC, copy engines, NCCL, the CUDA Adam kernel) runs in
tests/gpu/test_sharded_step_cuda.py.
"""
import logging
import threading
import unittest.mock

import pytest
import torch
from fairseq.optim.fp16_optimizer import FP16Optimizer

from fairseq_helpers import fp16_optimizer_cfg
from ls_fairseq import switches
from ls_fairseq.distributed import GradientReducer, sharded_step
from ls_fairseq.distributed.exchange import register
from ls_fairseq.distributed.grad_buckets import GradBuckets
from ls_fairseq.distributed.peer_all_reduce import PeerAllReduce
from ls_fairseq.distributed.shard_plan import ShardPlan
from ls_fairseq.distributed.sharded_step import ShardedStep, rehome
from ls_fairseq.graphs.flat_gradients import FlatGradients
from ls_fairseq.optim.ls_adam import LSFusedFP16Optimizer

SHAPES = [(37, 11), (1,), (513,), (64, 3), (5, 5, 5), (1000,), (3,), (129, 2)]
TIMEOUT = 60  # s: a rank that fails breaks the barriers instead of leaving the others waiting


class _Collective:
    """A thread barrier and an in-place sum over the ranks' tensors (rank order)."""

    def __init__(self, world):
        self.world = world
        self.wall = threading.Barrier(world, timeout=TIMEOUT)
        self.slots = [None] * world

    def barrier(self):
        self.wall.wait()

    def sum_for(self, rank):
        def all_reduce_sum(t):
            self.slots[rank] = t.clone()
            self.wall.wait()
            total = self.slots[0].clone()
            for s in self.slots[1:]:
                total += s
            self.wall.wait()  # every rank has read the slots before any writes the next ones
            t.copy_(total)
        return all_reduce_sum


def _in_threads(world, fn):
    errors = [None] * world

    def run(rank):
        try:
            fn(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and
                  not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def _init_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * 0.1).half() for s in SHAPES]


class _Rank:
    """One simulated rank: its model (a module of fp16 parameters), flat gradients, the engine's
    gradient reducer (buckets of ``bucket_bytes``) and LSFusedFP16Optimizer (flat fp32 master)."""

    def __init__(self, init, flags, bucket_bytes=300):
        self.params = [torch.nn.Parameter(t.clone()) for t in init]
        self.module = torch.nn.ParameterList(self.params)
        self.grads = FlatGradients(self.params)
        self.reducer = GradientReducer(self.grads, bucket_mb=bucket_bytes / 2**20)
        register(self.module, self.reducer)
        cfg = fp16_optimizer_cfg("ls_adam", flags)
        # fairseq builds the flat fp32 master "on" torch.cuda.current_device() (a dict key); the
        # tensor itself is made like the parameters, here on the CPU
        with unittest.mock.patch.object(torch.cuda, "current_device", lambda: 0):
            self.opt = FP16Optimizer.build_optimizer(cfg, self.params)
        assert isinstance(self.opt, LSFusedFP16Optimizer) and torch.is_tensor(self.opt.master)


def _ranks(world, bucket_bytes, flags, monkeypatch):
    init = _init_params()
    ranks = [_Rank(init, flags, bucket_bytes) for _ in range(world)]
    coll = _Collective(world)
    buckets = ranks[0].reducer.buckets
    plan = ShardPlan(buckets.buckets, [f.numel() for f in ranks[0].grads.flats], world)
    staging = [[torch.zeros(max(plan.staging_numel(r, f), 1), dtype=flat.dtype)
                for f, flat in enumerate(ranks[r].grads.flats)] for r in range(world)]

    def barrier():
        coll.barrier()
        return None

    for r, rank in enumerate(ranks):
        rank.peer = PeerAllReduce(plan, r, rank.grads.flats, staging[r],
                                  {q: ranks[q].grads.flats for q in range(world) if q != r},
                                  {q: staging[q] for q in range(world) if q != r}, barrier)
        rank.reducer.use_copy_engines(rank.peer)  # what every rank decides at the first update
    # sharded_step.create's buffer exchange (CUDA IPC) done by hand: every rank's weights moved
    # into flat buffers, every rank reaching the others'
    param_flats = [rehome(rank.grads) for rank in ranks]
    steps = {id(rank.grads): ShardedStep(
        rank.peer, rank.grads, param_flats[r],
        {q: param_flats[q] for q in range(world) if q != r}, coll.sum_for(r))
        for r, rank in enumerate(ranks)}
    monkeypatch.setattr(sharded_step, "create", lambda grads, peer: (steps[id(grads)], ""))
    return ranks, buckets, coll


def _local_grads(rank_index, step, overflow):
    g = torch.Generator().manual_seed(1000 * step + rank_index)
    grads = [(torch.randn(s, generator=g) * 0.05).half() for s in SHAPES]
    if overflow:
        grads[2].view(-1)[7] = float("inf")
    return grads


def _update(rank, r, step, clip, overflow_at, norms):
    """One rank's update as fairseq's trainer and the engine run it."""
    rank.opt.zero_grad()
    rank.grads.bind(True)
    rank.reducer.start_update()
    for p, g in zip(rank.params, _local_grads(r, step, step in overflow_at and r == 1)):
        p.grad.copy_(g)
    # the engine's all-reduce, bucket by bucket, at the end of the last micro-batch's backward
    rank.reducer.expect(None, None)
    rank.reducer.issue()
    rank.opt.all_reduce_grads(rank.module)
    try:
        norms[r] = rank.opt.clip_grad_norm(clip)
    except OverflowError:  # fairseq's trainer skips the step
        norms[r] = None
        return
    rank.opt.step()


def _summed(ranks):
    """The summed gradients, each shard from the rank that sums it."""
    plan = ranks[0].peer.plan
    flats = [torch.zeros_like(f) for f in ranks[0].grads.flats]
    for b, (f, _, _) in enumerate(plan.buckets):
        for q, (lo, hi) in enumerate(plan.shards[b]):
            flats[f][lo:hi] = ranks[q].grads.flats[f][lo:hi]
    return flats


def _reference_update(ref, summed, clip):
    ref.opt.zero_grad()
    ref.grads.bind(True)
    for flat, s in zip(ref.grads.flats, summed):
        flat.copy_(s)
    try:
        norm = ref.opt.clip_grad_norm(clip)
    except OverflowError:
        return None
    ref.opt.step()
    return norm


def _plain(norm):
    return None if norm is None else float(getattr(norm, "plain", lambda: norm)())


@pytest.mark.parametrize("world", (2, 3, 4))
@pytest.mark.parametrize("bucket_bytes", (300, 2**20))
@pytest.mark.parametrize("clip", (0.0, 0.05))
@pytest.mark.parametrize("deferred", (True, False), ids=("deferred", "read-back"))
def test_sharded_step_equals_the_whole_step(world, bucket_bytes, clip, deferred, monkeypatch):
    flags = ["--clip-norm", str(clip)]
    flags += [] if deferred else ["--ls-no-deferred-overflow-check"]
    ranks, _, _ = _ranks(world, bucket_bytes, flags, monkeypatch)
    ref = _Rank(_init_params(), flags)
    overflow_at = (3,)
    for step in range(6):
        norms = [None] * world
        _in_threads(world, lambda r: _update(ranks[r], r, step, clip, overflow_at,
                                             norms))
        # the first update is whole (the engine drops phase 4 from the next one on)
        assert all(rank.peer.scatter_only for rank in ranks)
        assert all(isinstance(rank.opt.sharding, ShardedStep) for rank in ranks)
        ref_norm = _reference_update(ref, _summed(ranks), clip)
        got = [_plain(n) for n in norms]
        want = _plain(ref_norm)
        if want is None or not torch.isfinite(torch.tensor(want)):
            assert step in overflow_at
            assert all(g is None or not torch.isfinite(torch.tensor(g)) for g in got)
        else:
            torch.testing.assert_close(torch.tensor(got), torch.tensor([want] * world),
                                       rtol=1e-6, atol=0)
        for rank in ranks:  # every rank holds every weight, the same bits
            for p, q in zip(rank.params, ranks[0].params):
                assert torch.equal(p, q)
        for p, rp in zip(ranks[0].params, ref.params):
            if clip == 0:
                assert torch.equal(p, rp)
            else:
                torch.testing.assert_close(p.float(), rp.float(), rtol=2**-10, atol=0)
    with pytest.raises(RuntimeError, match="--ls-sharded-optimizer-step: the optimizer state "
                                           "is sharded"):
        ranks[0].opt.state_dict()
    # fairseq's Trainer.consolidate_optimizer, on every rank, before a checkpoint
    _in_threads(world, lambda r: ranks[r].opt.optimizer.consolidate_state_dict())
    want = ref.opt.state_dict()
    for rank in ranks:
        state = rank.opt.state_dict()
        assert state["loss_scale"] == want["loss_scale"]
        (s,), (w,) = state["state"].values(), want["state"].values()
        assert s["step"] == w["step"] == 5  # one update overflowed
        for key in ("exp_avg", "exp_avg_sq"):
            if clip == 0:
                assert torch.equal(s[key], w[key]), key
            else:
                torch.testing.assert_close(s[key], w[key], rtol=1e-6, atol=1e-12)
        if clip == 0:
            assert torch.equal(rank.opt.master, ref.opt.master)
        else:
            torch.testing.assert_close(rank.opt.master, ref.opt.master, rtol=1e-6, atol=1e-9)


def test_a_whole_update_after_sharded_ones_consolidates_first(monkeypatch):
    """An update that arrives all-reduced in full (not through the engine's buckets) after
    sharded steps: the whole Adam step needs the whole master and moments, so the ranks
    consolidate them first; the result stays the reference's."""
    world = 3
    ranks, _, _ = _ranks(world, 300, [], monkeypatch)
    ref = _Rank(_init_params(), [])
    for step in range(4):
        norms = [None] * world
        if step == 2:
            for rank in ranks:
                rank.peer.scatter_only = False  # this update: the whole all-reduce
        _in_threads(world, lambda r: _update(ranks[r], r, step, 0.0, (), norms))
        if step == 2:
            assert not any(rank.opt.sharding.stale for rank in ranks)
            for rank in ranks:
                rank.peer.scatter_only_from_next_update()
        _reference_update(ref, _summed(ranks), 0.0)
        for p, rp in zip(ranks[0].params, ref.params):
            assert torch.equal(p, rp)
    _in_threads(world, lambda r: ranks[r].opt.optimizer.consolidate_state_dict())
    assert torch.equal(ranks[1].opt.master, ref.opt.master)


@pytest.mark.parametrize("world", (2, 3, 5))
@pytest.mark.parametrize("bucket_bytes", (64, 1000, 2**20))
def test_pieces_cover_every_element_once(world, bucket_bytes):
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float16)) for s in SHAPES]
    params += [torch.nn.Parameter(torch.zeros(s)) for s in ((17,), (9, 7))]  # a second flat
    grads = FlatGradients(params)
    buckets = GradBuckets(grads.flats, grads.spans, bucket_bytes)
    plan = ShardPlan(buckets.buckets, [f.numel() for f in grads.flats], world)
    seen = [torch.zeros(p.numel(), dtype=torch.int) for p in params]
    order = list(reversed(params))  # any order of the optimizer's parameters
    index = {id(p): k for k, p in enumerate(params)}
    for r in range(world):
        peer = PeerAllReduce(plan, r, grads.flats, [], {}, {})
        step = ShardedStep(peer, grads, [torch.zeros_like(f) for f in grads.flats], {}, None)
        for i, a, e in step.pieces(order):
            assert 0 <= a < e <= order[i].numel()
            seen[index[id(order[i])]][a:e] += 1
    for s in seen:
        assert torch.equal(s, torch.ones_like(s))


def test_rehome_keeps_values_and_parameters():
    init = _init_params()
    params = [torch.nn.Parameter(t.clone()) for t in init]
    ids = [id(p) for p in params]
    grads = FlatGradients(params)
    flats = rehome(grads)
    assert [id(p) for p in params] == ids
    for p, t, (f, off, n) in zip(params, init, grads.spans):
        assert torch.equal(p.data, t)
        assert p.data_ptr() == flats[f][off:off + n].data_ptr()
    for flat in flats:  # padding between the views stays zero
        assert int(flat.ne(0).sum()) == sum(int(t.ne(0).sum()) for t in init)


def test_consolidate_rejects_a_tensor_of_another_layout():
    world = 2
    params = [torch.nn.Parameter(t.clone()) for t in _init_params()]
    grads = FlatGradients(params)
    buckets = GradBuckets(grads.flats, grads.spans, 300)
    plan = ShardPlan(buckets.buckets, [f.numel() for f in grads.flats], world)
    step = ShardedStep(PeerAllReduce(plan, 0, grads.flats, [], {}, {}), grads,
                       [torch.zeros_like(f) for f in grads.flats], {}, lambda t: None)
    with pytest.raises(RuntimeError, match="a state tensor of 5 elements"):
        step.consolidate(params, [torch.zeros(5)])


def _reduced_by_nccl(rank):
    """The engine's all-reduce of this update ran, by NCCL (a stand-in that reduces nothing:
    one rank)."""
    rank.grads.bind(True)
    rank.reducer.expect(None, None)
    rank.reducer.issue()


def _one_rank_opt(flags):
    rank = _Rank(_init_params(), flags)
    rank.reducer.reduce_bucket = lambda bucket: None
    _reduced_by_nccl(rank)
    return rank


def test_steps_aside_with_one_line_where_the_gradients_travel_by_nccl(caplog):
    rank = _one_rank_opt([])
    with caplog.at_level(logging.INFO, logger="ls_fairseq.optim.ls_adam"):
        rank.opt.all_reduce_grads(rank.module)
        _reduced_by_nccl(rank)
        rank.opt.all_reduce_grads(rank.module)
    lines = [r.getMessage() for r in caplog.records if "sharded-optimizer-step" in r.getMessage()]
    assert lines == ["ls-sharded-optimizer-step is off for this run: it needs the copy-engine "
                     "all-reduce (GPUs of one host with peer access; "
                     "--ls-copy-engine-all-reduce)"]
    assert rank.opt.sharding is False


def test_required_is_refused_where_it_cannot_apply():
    rank = _one_rank_opt(["--ls-sharded-optimizer-step"])
    with pytest.raises(ValueError, match="^--ls-sharded-optimizer-step: it needs the copy-engine"):
        rank.opt.all_reduce_grads(rank.module)


def test_off_with_the_no_flag(monkeypatch):
    ranks, _, _ = _ranks(2, 300, ["--ls-no-sharded-optimizer-step"], monkeypatch)
    assert ranks[0].opt.fp32_optimizer.sharded_step_mode == switches.OFF
    norms = [None, None]
    _in_threads(2, lambda r: _update(ranks[r], r, 0, 0.0, (), norms))
    assert all(rank.opt.sharding is False and not rank.peer.scatter_only for rank in ranks)


def test_steps_aside_for_criterion_parameters(monkeypatch, caplog):
    rank = _one_rank_opt([])
    extra = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    rank.opt.fp16_params = rank.opt.fp16_params + [extra]  # an optimized tensor not the model's
    rank.reducer.use_copy_engines(object())
    with caplog.at_level(logging.INFO, logger="ls_fairseq.optim.ls_adam"):
        rank.opt.all_reduce_grads(rank.module)
    assert rank.opt.sharding is False
    assert any("criterion parameters" in r.getMessage() for r in caplog.records)


def test_no_consolidation_while_one_rank_handles_its_own_error(monkeypatch):
    """fairseq saves crash.pt after an exception in one rank's forward/backward: the other ranks
    would never join the sums, so that rank does not wait for them and its state_dict refuses
    (after the error itself is on the screen); a FloatingPointError (a non-finite grad norm,
    the same on every rank) still consolidates."""
    world = 2
    ranks, _, _ = _ranks(world, 300, [], monkeypatch)
    for step in range(2):
        norms = [None] * world
        _in_threads(world, lambda r: _update(ranks[r], r, step, 0.0, (), norms))
    try:
        raise KeyError("a rank's own error")
    except KeyError:
        ranks[0].opt.optimizer.consolidate_state_dict()  # returns at once
        with pytest.raises(RuntimeError, match="the optimizer state is sharded"):
            ranks[0].opt.state_dict()

    def after_floating_point_error(r):
        try:
            raise FloatingPointError("non-finite grad norm")
        except FloatingPointError:
            ranks[r].opt.optimizer.consolidate_state_dict()
    _in_threads(world, after_floating_point_error)
    assert not any(rank.opt.sharding.stale for rank in ranks)
