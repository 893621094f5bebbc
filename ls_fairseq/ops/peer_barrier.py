"""A barrier between the GPUs of one host through peer memory, for the copy-engine all-reduce
(``distributed/peer_all_reduce.py`` with ``LS_FAIRSEQ_PEER_BARRIER=flags``): one small kernel on the
stream instead of a one-element NCCL all-reduce and its wait, so queuing it costs the host one
launch.

Every rank holds ``flags``, one int64 per rank, which the others reach as peer memory
(``ops.peer_memory``). Barrier number ``epoch`` (1, 2, ...: every rank counts its barriers the
same way, as NCCL pairs collectives by their order) on rank ``r``: **signal**, write ``epoch``
into slot ``r`` of every other rank's flags; **wait**, until every slot ``q != r`` of its own
flags holds ``epoch`` or more. On the GPU both are one kernel (``csrc/peer_barrier.cu``): what
a rank queued before its barrier, its copies into the others' memory included, is visible to what
every rank queues after its own.

There is no math, so no reference of the result: on the CPU, :func:`signal` and :func:`arrived`
give the kernel's effect on the flags step by step, for tests that drive several ranks in one
process.
"""
import functools

from . import _extension


def available(flags) -> bool:
    """Whether the kernel can run for ``flags``' device."""
    return (flags.is_cuda and _extension.use_kernels(flags)
            and _extension.has_op("peer_barrier_"))


def signal(peer_flags, rank: int, epoch: int):
    """Rank ``rank``'s half of barrier ``epoch`` on the CPU: its slot of every other rank's flags
    (``peer_flags``, in rank order, without ``rank``'s own) set to ``epoch``."""
    for peer in peer_flags:
        peer[rank] = epoch


def arrived(flags, rank: int, epoch: int) -> bool:
    """Whether every other rank has signalled barrier ``epoch`` to rank ``rank``."""
    return all(int(flags[q]) >= epoch for q in range(flags.numel()) if q != rank)


def bind(flags, peer_flags, rank: int):
    """Rank ``rank``'s barriers on these flags: a function of the barrier's number that queues it
    on the current stream. The kernel's availability is checked here, once: the copy-engine
    all-reduce queues a barrier per gradient bucket, every update."""
    if not available(flags):
        raise RuntimeError("peer_barrier_ needs the ls_fairseq CUDA extension and a CUDA tensor "
                           "(peer_all_reduce checks available() first)")
    from . import _peer_barrier_cuda as cuda

    return functools.partial(cuda.peer_barrier_cuda, flags, list(peer_flags), rank)


def peer_barrier_(flags, peer_flags, rank: int, epoch: int):
    """Queues barrier ``epoch`` of rank ``rank`` on the current stream (see the module doc):
    the kernel ends once every other rank has queued and reached its own."""
    if epoch <= 0:
        raise ValueError(f"peer_barrier_: epoch must be positive, got {epoch}")
    bind(flags, peer_flags, rank)(epoch)
