"""ops.peer_barrier on the CPU: its effect on the flags step by step (signal, arrived) for several
ranks driven in one process, the errors of its public entry, and peer_all_reduce.create's choice
of barrier (LS_FAIRSEQ_PEER_BARRIER) over two gloo workers with the CUDA-only pieces stood in for.
The kernel itself runs in tests/gpu/test_peer_barrier_cuda.py."""
import pytest
import torch
import torch.distributed as dist

from ls_fairseq.distributed import peer_all_reduce
from ls_fairseq.distributed.grad_buckets import GradBuckets
from ls_fairseq.graphs.flat_gradients import FlatGradients
from ls_fairseq.ops import peer_barrier


def _world(n):
    flags = [torch.zeros(n, dtype=torch.int64) for _ in range(n)]
    peers = [[flags[q] for q in range(n) if q != r] for r in range(n)]
    return flags, peers


@pytest.mark.parametrize("world", (2, 3, 5))
def test_a_rank_arrives_only_when_every_other_rank_has_signalled(world):
    flags, peers = _world(world)
    for epoch in (1, 2, 3):
        late = epoch % world  # this rank signals last
        for r in range(world):
            if r != late:
                peer_barrier.signal(peers[r], r, epoch)
        for r in range(world):
            # everyone but `late` still waits for it; `late` has seen all the others
            assert peer_barrier.arrived(flags[r], r, epoch) == (r == late)
        peer_barrier.signal(peers[late], late, epoch)
        assert all(peer_barrier.arrived(flags[r], r, epoch) for r in range(world))
        assert not any(peer_barrier.arrived(flags[r], r, epoch + 1) for r in range(world))


def test_public_entry_refuses_cpu_tensors_and_bad_epochs():
    flags, peers = _world(2)
    with pytest.raises(ValueError, match="epoch must be positive, got 0"):
        peer_barrier.peer_barrier_(flags[0], peers[0], 0, 0)
    assert not peer_barrier.available(flags[0])
    with pytest.raises(RuntimeError, match="needs the ls_fairseq CUDA extension"):
        peer_barrier.peer_barrier_(flags[0], peers[0], 0, 1)


def test_flags_barrier_needs_the_kernel():
    t = torch.zeros(3)
    assert peer_all_reduce._barrier_check(False, t) == ""
    assert peer_all_reduce._barrier_check(True, t) == (
        "LS_FAIRSEQ_PEER_BARRIER=flags needs the ls_fairseq CUDA extension's peer_barrier_")


def _create_worker(rank, mode):
    """create() with LS_FAIRSEQ_PEER_BARRIER=mode (set by the parent), stand-ins for the CUDA-only
    pieces as in tests/test_peer_all_reduce.py."""
    from ls_fairseq.ops import peer_memory

    peer_all_reduce._on_cuda = lambda flats: True
    peer_all_reduce._local_check = lambda flats, group: ""
    peer_all_reduce._visible_peers = lambda infos, r, d: ({1 - r: 1 - r}, "")
    peer_all_reduce.torch.cuda.get_device_properties = lambda d: type("P", (), {"uuid": rank})()
    peer_barrier.available = lambda t: True
    exported = []
    peer_memory.export = lambda t: exported.append(t) or torch.zeros(80, dtype=torch.uint8)
    peer_memory.open_segments = lambda ex, device: [torch.zeros(1 << 16, dtype=torch.uint8)
                                                    for _ in ex]
    from test_peer_all_reduce import _model_params

    grads = FlatGradients(_model_params())
    buckets = GradBuckets(grads.flats, grads.spans, 1000)
    peer, reason = peer_all_reduce.create(grads.flats, buckets.buckets, dist.group.WORLD)
    if peer is None:
        return {"reason": reason}
    b = peer.barrier
    out = {"reason": reason, "kind": type(b).__name__, "exported": len(exported),
           "flats": len(grads.flats)}
    if isinstance(b, peer_all_reduce.FlagBarrier):
        out.update(flags=(b.flags.dtype, b.flags.numel()), peers=len(b.peer_flags),
                   peer=(b.peer_flags[0].dtype, b.peer_flags[0].numel()), rank=b.rank)
    return out


def _create_worker_per_rank(rank, modes):
    import os

    os.environ["LS_FAIRSEQ_PEER_BARRIER"] = modes[rank]
    return _create_worker(rank, modes[rank])


def test_ranks_that_disagree_on_the_barrier_keep_nccl_all_reduce(tmp_path):
    """A rank with the flags and one without would never pair their barriers: both are told."""
    from fairseq_helpers import run_workers

    results = run_workers(tmp_path, _create_worker_per_rank, ("flags", "nccl"))
    for r in results:
        assert r["reason"] == "the ranks do not all set LS_FAIRSEQ_PEER_BARRIER alike"


@pytest.mark.parametrize("mode", ("nccl", "flags"))
def test_create_takes_the_barrier_the_variable_names(tmp_path, monkeypatch, mode):
    from fairseq_helpers import run_workers

    monkeypatch.setenv("LS_FAIRSEQ_PEER_BARRIER", mode)  # the spawned workers' environment too
    results = run_workers(tmp_path, _create_worker, mode)
    for rank, r in enumerate(results):
        assert r["reason"] == ""
        if mode == "nccl":  # the one-element all-reduce (a function), flats and staging shared
            assert r["kind"] == "function" and r["exported"] == 2 * r["flats"]
        else:  # one int64 per rank shared besides, the other rank's opened as such
            assert r["kind"] == "FlagBarrier" and r["exported"] == 2 * r["flats"] + 1
            assert r["flags"] == (torch.int64, 2) and r["peer"] == (torch.int64, 2)
            assert r["peers"] == 1 and r["rank"] == rank
