"""CUDA binding of :mod:`ls_fairseq.ops.peer_memory` (``csrc/peer_memory.cu``).

Ops: ``torch.ops.ls_fairseq.peer_export(t) -> uint8 [80]`` (CPU: the IPC handle of ``t``'s
allocation, ``t``'s byte offset in it, the allocation's size) and ``peer_import(exported, device,
nbytes) -> uint8 [nbytes]`` (that whole allocation of another process, mapped on ``device``).
Host utilities, not differentiable; their fakes (registered once the extension is loaded) give
the shapes only.
"""
import torch

from . import _extension

#: what peer_export returns: cudaIpcMemHandle_t (64 bytes), the offset and the size (int64 each)
HANDLE_BYTES = 64
EXPORT_BYTES = HANDLE_BYTES + 16


def _register():
    @torch.library.register_fake("ls_fairseq::peer_export")
    def _export_fake(t):
        return torch.empty(EXPORT_BYTES, dtype=torch.uint8, device="cpu")

    @torch.library.register_fake("ls_fairseq::peer_import")
    def _import_fake(exported, device, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device))


_extension.when_loaded(_register)


def peer_export_cuda(t):
    return torch.ops.ls_fairseq.peer_export(t)


def exported_fields(exported):
    """``(handle bytes, offset, segment size)`` of what :func:`peer_export_cuda` returned."""
    offset, size = exported[HANDLE_BYTES:EXPORT_BYTES].view(torch.int64).tolist()
    return bytes(exported[:HANDLE_BYTES].tolist()), offset, size


def peer_import_cuda(exported, device: int, nbytes: int):
    """The allocation ``exported`` names (``nbytes``: its size, from :func:`exported_fields`),
    mapped on ``device``."""
    return torch.ops.ls_fairseq.peer_import(exported.contiguous(), int(device), int(nbytes))
