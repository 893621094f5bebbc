"""The copy-engine all-reduce's plan and protocol (ls_fairseq/distributed/peer_all_reduce.py) on
the CPU.

Several ranks are simulated in one process: each rank's "peer memory" is the other ranks' tensors
themselves, and the phases run for every rank before the next phase starts (what the barriers
guarantee on the GPUs). The result must be fairseq's legacy all-reduce of the same buckets (sum of
gradient / world size; bit for bit on 2 ranks, see tests/test_shard_reduce.py for more ranks) and
the same bits on every rank. The real thing (CUDA IPC, copy engines, NCCL barriers) runs in
tests/gpu/test_peer_all_reduce_cuda.py.
"""
import logging

import pytest
import torch
import torch.distributed as dist

from ls_fairseq import switches
from ls_fairseq.distributed import peer_all_reduce
from ls_fairseq.distributed.grad_buckets import GradBuckets
from ls_fairseq.distributed.peer_all_reduce import PeerAllReduce
from ls_fairseq.distributed.shard_plan import ALIGN, ShardPlan
from ls_fairseq.graphs.flat_gradients import FlatGradients


def _model_params(dtype16=torch.float16):
    """Parameters of odd sizes in two dtypes (two flat buffers), like a model with fp32 extras."""
    shapes16 = [(37, 11), (1,), (513,), (64, 3), (5, 5, 5), (1000,), (3,)]
    shapes32 = [(17,), (9, 7)]
    ps = [torch.nn.Parameter(torch.zeros(s, dtype=dtype16)) for s in shapes16]
    ps += [torch.nn.Parameter(torch.zeros(s, dtype=torch.float32)) for s in shapes32]
    return ps


def _simulate(world, bucket_bytes, dtype16=torch.float16, seed=0, rounds=1):
    params = _model_params(dtype16)
    grads = [FlatGradients(params) for _ in range(world)]
    buckets = GradBuckets(grads[0].flats, grads[0].spans, bucket_bytes)
    plan = ShardPlan(buckets.buckets, [f.numel() for f in grads[0].flats], world)
    staging = [[torch.zeros(max(plan.staging_numel(r, f), 1), dtype=flat.dtype)
                for f, flat in enumerate(grads[r].flats)] for r in range(world)]
    ranks = [PeerAllReduce(plan, r, grads[r].flats, staging[r],
                           {q: grads[q].flats for q in range(world) if q != r},
                           {q: staging[q] for q in range(world) if q != r})
             for r in range(world)]
    g = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        inputs = []
        for r in range(world):
            for view, (f, off, n) in zip(grads[r].views, grads[r].spans):
                sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
                view.copy_((sign * torch.exp(torch.rand(n, generator=g) * 6 - 3)).view_as(view))
            inputs.append([flat.clone() for flat in grads[r].flats])
        for b in range(len(plan.buckets)):
            for phase in ("push", "reduce", "push_result"):
                for rank in ranks:
                    getattr(rank, phase)(b)
    return grads, inputs, plan


@pytest.mark.parametrize("world", (2, 3, 4, 5, 8))
@pytest.mark.parametrize("bucket_bytes", (64, 1000, 2**20))
def test_plan_tiles_every_bucket(world, bucket_bytes):
    params = _model_params()
    grads = FlatGradients(params)
    buckets = GradBuckets(grads.flats, grads.spans, bucket_bytes)
    plan = ShardPlan(buckets.buckets, [f.numel() for f in grads.flats], world)
    for b, (f, lo, hi) in enumerate(plan.buckets):
        shards = plan.shards[b]
        assert shards[0][0] == lo and shards[-1][1] == hi
        for (s0, e0), (s1, _) in zip(shards, shards[1:]):
            assert e0 == s1 and s0 <= e0
            assert (s0 - lo) % ALIGN == 0
    for dst in range(world):
        for f in range(len(grads.flats)):
            used = torch.zeros(plan.staging_numel(dst, f), dtype=torch.int)
            for b, (bf, _, _) in enumerate(plan.buckets):
                if bf != f:
                    continue
                for src in range(world):
                    if src != dst:
                        start, end = plan.staged(src, dst, b)
                        assert start % ALIGN == 0
                        used[start:end] += 1
            assert bool((used == 1).all())  # every staging slot element used exactly once


@pytest.mark.parametrize("dtype16", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("bucket_bytes", (64, 1000, 2**20))
def test_two_ranks_equal_fairseq_legacy_all_reduce(dtype16, bucket_bytes):
    grads, inputs, _ = _simulate(2, bucket_bytes, dtype16)
    for f in range(len(inputs[0])):
        legacy = inputs[0][f] / 2 + inputs[1][f] / 2  # LegacyDistributedDataParallel's math
        for r in range(2):
            assert torch.equal(grads[r].flats[f], legacy)


@pytest.mark.parametrize("world", (3, 4, 5))
def test_every_rank_gets_the_same_mean(world):
    grads, inputs, _ = _simulate(world, 1000, seed=world, rounds=2)
    for f in range(len(inputs[0])):
        for r in range(1, world):
            assert torch.equal(grads[r].flats[f], grads[0].flats[f])
        truth = torch.stack([x[f].double() for x in inputs]).mean(0)
        tol = torch.finfo(grads[0].flats[f].dtype).eps * truth.abs() + 1e-6
        assert bool(((grads[0].flats[f].double() - truth).abs() <= tol).all())


def test_alignment_padding_stays_zero():
    grads, _, _ = _simulate(3, 1000)
    for flats in (g.flats for g in grads):
        for flat, spans in ((f, [s for s in grads[0].spans if s[0] == i])
                            for i, f in enumerate(flats)):
            covered = torch.zeros(flat.numel(), dtype=torch.bool)
            for _, off, n in spans:
                covered[off:off + n] = True
            assert bool((flat[~covered] == 0).all())


def test_bucket_index_finds_each_bucket():
    params = _model_params()
    grads = FlatGradients(params)
    buckets = GradBuckets(grads.flats, grads.spans, 1000)
    plan = ShardPlan(buckets.buckets, [f.numel() for f in grads.flats], 2)
    rank = PeerAllReduce(plan, 0, grads.flats, [], {}, {})
    for b, (f, lo, hi) in enumerate(buckets.buckets):
        assert rank.bucket_index(grads.flats[f][lo:hi]) == b
    with pytest.raises(ValueError, match="outside the flat buffers"):
        rank.bucket_index(torch.zeros(4))


@pytest.fixture
def gloo_world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_cpu_gradients_keep_nccl_path_without_exchange(gloo_world_of_one):
    grads = FlatGradients(_model_params())
    buckets = GradBuckets(grads.flats, grads.spans, 1000)
    peer, reason = peer_all_reduce.create(grads.flats, buckets.buckets, gloo_world_of_one)
    assert peer is None and "not on a CUDA device" in reason


def test_engine_steps_aside_or_refuses(gloo_world_of_one, caplog):
    """The engine's decision (its reducer's ``copy_engine_reduce``, made at the first update):
    AUTO steps aside with one line, ON refuses naming the flag, OFF asks nothing."""
    from ls_fairseq.distributed import GradientReducer
    from ls_fairseq.graphs.replay import CudaGraphedLoss

    def reducer(mode):
        e = CudaGraphedLoss(copy_engine=mode)
        model = torch.nn.Linear(3, 5)
        e._setup(model)
        assert isinstance(e.reducer, GradientReducer) and e.reducer.copy_engine == mode
        return e.reducer

    group = gloo_world_of_one
    with caplog.at_level(logging.INFO):
        r = reducer(switches.AUTO)
        assert r.copy_engine_reduce(group) is None and r.copy_engine_reduce(group) is None
    lines = [r.getMessage() for r in caplog.records if "copy-engine-all-reduce" in r.getMessage()]
    assert lines == ["ls-copy-engine-all-reduce is off for this run: the gradients are not on a "
                     "CUDA device"]
    with pytest.raises(ValueError, match="--ls-copy-engine-all-reduce: the gradients are not"):
        reducer(switches.ON).copy_engine_reduce(group)
    r = reducer(switches.OFF)
    assert r.copy_engine_reduce(group) is None and r.peer is None


def test_exported_fields_read_back():
    """What csrc/peer_memory.cu's peer_export writes (handle, offset, size) is read back as such
    (the GPU test exercises the real export and import)."""
    from ls_fairseq.ops import _peer_memory_cuda as binding

    handle = bytes(range(64))
    exported = torch.cat([torch.tensor(list(handle), dtype=torch.uint8),
                          torch.tensor([512, 3 << 33], dtype=torch.int64).view(torch.uint8)])
    assert exported.numel() == binding.EXPORT_BYTES
    assert binding.exported_fields(exported) == (handle, 512, 3 << 33)


def _create_worker(rank, fail_stage):
    """create() over two gloo workers with the CUDA-only pieces stood in for; rank 1 fails at
    ``fail_stage`` (or nobody fails). Returns what create returned, by rank."""
    from ls_fairseq.ops import peer_memory

    def fails(stage, ok):
        def fn(*args, **kwargs):
            if rank == 1 and stage == fail_stage:
                raise (RuntimeError if stage in ("export", "open") else KeyError)(
                    f"stand-in failure at {stage}\nsecond line")
            return ok(*args, **kwargs)
        return fn

    peer_all_reduce._on_cuda = lambda flats: True
    peer_all_reduce._local_check = fails("check", lambda flats, group: "")
    peer_all_reduce._visible_peers = fails("visible", lambda infos, r, d: ({1 - r: 1 - r}, ""))
    peer_all_reduce.torch.cuda.get_device_properties = lambda d: type("P", (), {"uuid": rank})()
    peer_memory.export = fails("export", lambda t: torch.zeros(80, dtype=torch.uint8))
    peer_memory.open_segments = fails("open", lambda exported, device: [
        torch.zeros(1 << 16, dtype=torch.uint8) for _ in exported])
    grads = FlatGradients(_model_params())
    buckets = GradBuckets(grads.flats, grads.spans, 1000)
    peer, reason = peer_all_reduce.create(grads.flats, buckets.buckets, dist.group.WORLD)
    return {"peer": peer is not None, "reason": reason,
            "peers": sorted(peer.peer_flats) if peer is not None else None}


@pytest.mark.parametrize("stage", [None, "check", "visible", "export", "open"])
def test_create_is_collective_when_one_rank_fails(tmp_path, stage):
    """Every rank gets the same answer, and a failure on one rank at any stage is that answer
    (in one line), not an exception that would leave the other rank waiting in a collective."""
    from fairseq_helpers import run_workers

    results = run_workers(tmp_path, _create_worker, stage)
    assert results[0] == results[1] or stage is None
    if stage is None:
        assert [r["peer"] for r in results] == [True, True] and results[0]["reason"] == ""
        assert [r["peers"] for r in results] == [[1], [0]]
        return
    assert not results[0]["peer"] and "stand-in failure at " + stage in results[0]["reason"]
    assert "\n" not in results[0]["reason"]  # one log line
    if stage == "export":
        assert results[0]["reason"].startswith("its buffers cannot be shared between processes")
    if stage == "open":
        assert results[0]["reason"].startswith("opening another rank's memory failed")


def test_world_limit_is_the_kernels():
    from ls_fairseq.ops import _shard_reduce_cuda

    assert peer_all_reduce.MAX_WORLD == _shard_reduce_cuda.MAX_PARTS + 1


def test_visible_peers_reasons(monkeypatch):
    """Each rank's GPU found by its UUID among this process's devices, or why not."""
    uuids = {0: "GPU-a", 1: "GPU-b", 2: "GPU-c"}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: type("P", (), {"uuid": uuids[d]})())
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: {a, b} != {0, 2})
    info = lambda uuid, host="h/1": {"host": host, "uuid": uuid}  # noqa: E731
    visible = peer_all_reduce._visible_peers
    assert visible([info("GPU-a"), info("GPU-b")], 0, 0) == ({1: 1}, "")
    assert visible([info("GPU-b"), info("GPU-a")], 1, 0) == ({0: 1}, "")  # other order
    assert visible([info("GPU-a"), info("GPU-b", "g/1")], 0, 0)[1] == \
        "the ranks are not all on one host"
    assert visible([info("GPU-a"), info("GPU-z")], 0, 0)[1] == \
        "rank 1's GPU is not visible to rank 0 (CUDA_VISIBLE_DEVICES)"
    assert visible([info("GPU-a"), info("GPU-a")], 0, 0)[1] == "ranks 0 and 1 share one GPU"
    assert visible([info("GPU-a"), info("GPU-c")], 0, 0)[1] == \
        "rank 0's GPU cannot reach rank 1's by peer access"


def test_local_check_reasons(monkeypatch):
    from ls_fairseq.ops import peer_memory

    class Flat:
        is_cuda, dtype = True, torch.float16

    monkeypatch.setattr(peer_memory, "available", lambda t: True)
    for backend, world, dtype, available, reason in [
            ("nccl", 2, torch.float16, True, ""),
            ("nccl", 16, torch.bfloat16, True, ""),
            ("gloo", 2, torch.float16, True, "it needs the NCCL backend, this run uses gloo"),
            ("nccl", 17, torch.float16, True, "it takes 2 to 16 GPUs, this run has 17"),
            ("nccl", 2, torch.float64, True, "the gradients are not float16, bfloat16 or float32"),
            ("nccl", 2, torch.float16, False, "the ls_fairseq CUDA extension is not available")]:
        monkeypatch.setattr(dist, "get_world_size", lambda group, w=world: w)
        monkeypatch.setattr(dist, "get_backend", lambda group, b=backend: b)
        monkeypatch.setattr(peer_memory, "available", lambda t, a=available: a)
        flat = Flat()
        flat.dtype = dtype
        assert peer_all_reduce._local_check([flat], None) == reason
