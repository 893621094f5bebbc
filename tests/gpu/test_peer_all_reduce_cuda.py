"""The copy-engine all-reduce (distributed/peer_all_reduce.py) on two GPUs: CUDA IPC, copies into
peer memory, NCCL barriers, against NCCL's bucketed legacy all-reduce of the same buffers
(grad_buckets.legacy_reduce, fairseq's sum of gradient / world size).

On every GPU of the machine (3 or more), where NCCL's chain of roundings differs from the one
rounding of the copy-engine path, each shard must equal ops.shard_reduce_reference of all ranks'
inputs (gathered by NCCL) in the path's order, own shard first then the others in rank order,
bit for bit, on every rank.

On 2 ranks both are one rounding of (a + b) / 2 per element (tests/test_shard_reduce.py), so the
results must be equal bit for bit, on both ranks, on the first update and on the next (the staging
buffers are reused). The copies must be peer-to-peer (profiled: "Memcpy PtoP"), not staged through
the host. Both barriers between the phases run (LS_FAIRSEQ_PEER_BARRIER): NCCL's one-element
all-reduce and ops.peer_barrier's flags in peer memory.
"""
import pytest
import torch

from fairseq_helpers import run_workers  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def _grads(flats, spans, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for f, off, n in spans:
        sign = torch.randint(0, 2, (n,), device="cuda", generator=g) * 2 - 1
        flats[f][off:off + n].copy_(sign * torch.exp(torch.rand(n, device="cuda", generator=g)
                                                     * 6 - 3))


def _setup(shapes):
    """fp16 parameters of ``shapes`` and a float32 one, their flat gradients in 100k-element
    buckets, and the copy-engine all-reduce over the default group: (grads, buckets, peer or
    None, {"reason", "buckets"})."""
    import torch.distributed as dist

    from ls_fairseq.distributed import peer_all_reduce
    from ls_fairseq.distributed.grad_buckets import GradBuckets
    from ls_fairseq.graphs.flat_gradients import FlatGradients

    params = [torch.nn.Parameter(torch.zeros(s, device="cuda", dtype=torch.float16))
              for s in shapes]
    params.append(torch.nn.Parameter(torch.zeros(77, device="cuda")))  # a float32 buffer too
    grads = FlatGradients(params)
    buckets = GradBuckets(grads.flats, grads.spans, 100_000)
    peer, reason = peer_all_reduce.create(grads.flats, buckets.buckets, dist.group.WORLD)
    return grads, buckets, peer, {"reason": reason, "buckets": len(buckets.buckets)}


def _worker(rank):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from ls_fairseq.distributed.grad_buckets import GradBuckets, legacy_reduce

    torch.manual_seed(0)
    grads, buckets, peer, out = _setup([(1000, 37), (1,), (4099,), (512, 512), (3,)])
    if peer is None:
        return out
    nccl = GradBuckets(grads.flats, grads.spans, 100_000)
    for update in range(2):
        _grads(grads.flats, grads.spans, seed=10 * update + rank)
        inputs = [f.clone() for f in grads.flats]
        if update == 1:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                buckets.issue(grads.flats, [None] * len(buckets.buckets), peer)
                torch.cuda.synchronize()
            out["copies"] = sorted({e.key for e in prof.key_averages()
                                    if e.key.startswith("Memcpy")})  # device copies only
        else:
            buckets.issue(grads.flats, [None] * len(buckets.buckets), peer)
        ours = [f.clone() for f in grads.flats]
        for f, x in zip(grads.flats, inputs):
            f.copy_(x)
        nccl.issue(grads.flats, [None] * len(buckets.buckets), legacy_reduce(2, dist.group.WORLD))
        torch.cuda.synchronize()
        out[f"equal_{update}"] = all(torch.equal(a, b) for a, b in zip(ours, grads.flats))
        out[f"bytes_{update}"] = [a.cpu() for a in ours]
    return out


def _worker_every_gpu(rank):
    import torch.distributed as dist

    from ls_fairseq.ops.shard_reduce import shard_reduce_reference

    world = dist.get_world_size()
    grads, buckets, peer, out = _setup([(1000, 37), (1,), (4099,), (512, 512), (3,), (5, 7)])
    if peer is None:
        return out
    for update in range(2):
        _grads(grads.flats, grads.spans, seed=10 * update + rank)
        every = []  # every[q][f]: rank q's inputs
        for f in grads.flats:
            gathered = [torch.empty_like(f) for _ in range(world)]
            dist.all_gather(gathered, f)
            every.append(gathered)
        every = [[every[f][q] for f in range(len(grads.flats))] for q in range(world)]
        buckets.issue(grads.flats, [None] * len(buckets.buckets), peer)
        torch.cuda.synchronize()
        equal = True
        for b, (f, _, _) in enumerate(peer.plan.buckets):
            for q in range(world):
                lo, hi = peer.plan.shards[b][q]
                expected = shard_reduce_reference(
                    every[q][f][lo:hi].clone(),
                    [every[p][f][lo:hi] for p in range(world) if p != q], 1.0 / world)
                equal &= torch.equal(grads.flats[f][lo:hi], expected)
        out[f"equal_{update}"] = equal
        out[f"bytes_{update}"] = [f.cpu() for f in grads.flats]
    return out


BARRIERS = pytest.mark.parametrize("barrier", ("nccl", "flags"))


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 or more GPUs")
@BARRIERS
def test_copy_engine_all_reduce_on_every_gpu(tmp_path, monkeypatch, barrier):
    monkeypatch.setenv("LS_FAIRSEQ_PEER_BARRIER", barrier)  # the spawned workers' too
    results = run_workers(tmp_path, _worker_every_gpu, world=torch.cuda.device_count(),
                          backend="nccl")
    for r in results:
        assert r["reason"] == "" and r["buckets"] > 2
        assert r["equal_0"] and r["equal_1"]
    for update in range(2):
        for other in results[1:]:
            for a, b in zip(results[0][f"bytes_{update}"], other[f"bytes_{update}"]):
                assert torch.equal(a, b)


@BARRIERS
def test_copy_engine_all_reduce_equals_nccl_legacy(tmp_path, monkeypatch, barrier):
    monkeypatch.setenv("LS_FAIRSEQ_PEER_BARRIER", barrier)
    results = run_workers(tmp_path, _worker, backend="nccl")
    for r in results:
        assert r["reason"] == "" and r["buckets"] > 2
        assert r["equal_0"] and r["equal_1"]
        assert r["copies"] and all("PtoP" in c for c in r["copies"]), r["copies"]
    for update in range(2):
        for a, b in zip(results[0][f"bytes_{update}"], results[1][f"bytes_{update}"]):
            assert torch.equal(a, b)
