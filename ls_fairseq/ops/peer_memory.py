"""Another process's GPU memory in this one (CUDA IPC), for the copy-engine all-reduce
(``distributed/peer_all_reduce.py``).

``export(t)`` describes where ``t`` lives (a CPU tensor of bytes that can travel to other
processes of the host); ``open_segments(exported)`` maps each distinct allocation named there into
this process once, on this process's current CUDA device, and returns one uint8 view of the
remote bytes per entry. Copies into such a view are device-to-device copies that the GPUs' copy
engines carry over NVLink (or PCIe peer access), without kernels.

CUDA only: there is no reference path, because there is nothing to compute. On the CPU, or without
the extension, :func:`available` is False and the caller keeps NCCL.
"""
from . import _extension


def available(t) -> bool:
    """Whether the kernels that export and open peer memory can run for ``t``'s device."""
    return (t.is_cuda and _extension.use_kernels(t) and _extension.has_op("peer_export")
            and _extension.has_op("peer_import"))


def export(t):
    """``t``'s allocation: a CPU uint8 tensor (IPC handle, byte offset of ``t``, segment size)."""
    from . import _peer_memory_cuda as cuda

    return cuda.peer_export_cuda(t)


def open_segments(exported, device: int):
    """For each entry of ``exported`` (what :func:`export` returned in another process of this
    host), a uint8 CUDA tensor on ``device`` over its remote bytes, from its offset to the end of
    its segment. Entries that share an allocation share one mapping."""
    from . import _peer_memory_cuda as cuda

    opened, views = {}, []
    for e in exported:
        handle, offset, size = cuda.exported_fields(e)
        if handle not in opened:
            opened[handle] = cuda.peer_import_cuda(e, device, size)
        views.append(opened[handle][offset:])
    return views
