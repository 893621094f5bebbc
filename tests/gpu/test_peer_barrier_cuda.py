"""The peer_barrier_ kernel (csrc/peer_barrier.cu) on one GPU, two ranks simulated on two
streams: a rank's copy queued before its barrier is visible to what the other rank queues after
its own, whichever arrives first, barrier after barrier (the flags are reused, the numbers grow);
its checks name what is wrong; torch.library.opcheck checks the schema and the fake. Across real
GPUs (CUDA IPC) it runs in tests/gpu/test_peer_all_reduce_cuda.py (LS_FAIRSEQ_PEER_BARRIER=flags).
"""
import pytest
import torch

from ls_fairseq.ops import _peer_barrier_cuda as cuda
from ls_fairseq.ops import peer_barrier

pytestmark = pytest.mark.gpu

CYCLES = 20_000_000  # ~10 ms of torch.cuda._sleep: the other rank is sure to wait


@pytest.fixture(scope="module", autouse=True)
def _kernels(extension):
    assert extension.has_op("peer_barrier_")
    # One process plays every rank here, so every kernel the tests launch is loaded first: with
    # CUDA's lazy loading, a kernel's first launch may wait for the whole device, and with a
    # barrier kernel spinning for a rank this same thread has yet to queue, that wait never ends.
    # (Across processes it cannot: a barrier waits only for other processes' signals.)
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(1)
    x.copy_(torch.full_like(x, 1.0))
    assert bool((x == 1).all())
    flags = [torch.zeros(2, dtype=torch.int64, device="cuda") for _ in range(2)]
    flags[0][1] = 1  # rank 1 has arrived: rank 0's barrier returns at once
    peer_barrier.peer_barrier_(flags[0], [flags[1]], 0, 1)
    torch.cuda.synchronize()
    assert flags[1].tolist() == [1, 0]


def test_the_copy_before_a_barrier_is_seen_after_the_other_ranks():
    flags = [torch.zeros(2, dtype=torch.int64, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    inbox = torch.zeros(1 << 20, device="cuda")  # rank 1's memory, written by rank 0's copy
    seen = torch.zeros_like(inbox)
    torch.cuda.synchronize()
    for epoch in range(1, 5):
        data = torch.full_like(inbox, float(epoch))
        slow = epoch % 2  # the rank that arrives late alternates
        torch.cuda.synchronize()
        with torch.cuda.stream(streams[0]):  # rank 0: copy, then barrier
            if slow == 0:
                torch.cuda._sleep(CYCLES)
            inbox.copy_(data, non_blocking=True)
            peer_barrier.peer_barrier_(flags[0], [flags[1]], 0, epoch)
        with torch.cuda.stream(streams[1]):  # rank 1: barrier, then read what rank 0 wrote
            if slow == 1:
                torch.cuda._sleep(CYCLES)
            peer_barrier.peer_barrier_(flags[1], [flags[0]], 1, epoch)
            seen.copy_(inbox, non_blocking=True)
        torch.cuda.synchronize()
        assert bool((seen == epoch).all()), epoch
        assert flags[0].tolist() == [0, epoch] and flags[1].tolist() == [epoch, 0]


def test_three_ranks_on_three_streams():
    n = 3
    flags = [torch.zeros(n, dtype=torch.int64, device="cuda") for _ in range(n)]
    streams = [torch.cuda.Stream() for _ in range(n)]
    torch.cuda.synchronize()
    for epoch in (1, 2):
        for r in range(n):
            with torch.cuda.stream(streams[r]):
                if r == epoch:
                    torch.cuda._sleep(CYCLES)
                peer_barrier.peer_barrier_(flags[r], [flags[q] for q in range(n) if q != r], r,
                                           epoch)
        torch.cuda.synchronize()
        for r in range(n):
            assert flags[r].tolist() == [0 if q == r else epoch for q in range(n)]


def test_checks_name_the_problem():
    f = torch.zeros(2, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match="flags must be a contiguous int64 CUDA tensor of "
                                           "world size"):
        cuda.peer_barrier_cuda(f.int(), [f], 0, 1)
    with pytest.raises(RuntimeError, match="rank 2 outside 0..1"):
        cuda.peer_barrier_cuda(f, [f.clone()], 2, 1)
    with pytest.raises(RuntimeError, match="epoch must be positive"):
        cuda.peer_barrier_cuda(f, [f.clone()], 0, 0)
    with pytest.raises(RuntimeError, match="at most 32 ranks"):
        big = torch.zeros(33, dtype=torch.int64, device="cuda")
        cuda.peer_barrier_cuda(big, [big.clone() for _ in range(32)], 0, 1)


def test_opcheck():
    flags = torch.tensor([0, 1 << 40], dtype=torch.int64, device="cuda")  # rank 1 long arrived
    peer = torch.zeros(2, dtype=torch.int64, device="cuda")
    torch.library.opcheck(torch.ops.ls_fairseq.peer_barrier_.default, (flags, [peer], 0, 7))
    # opcheck runs the op on copies of its arguments; the kernel's effect, on these:
    peer_barrier.peer_barrier_(flags, [peer], 0, 7)
    torch.cuda.synchronize()
    assert peer.tolist() == [7, 0]
