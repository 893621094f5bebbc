"""CUDA binding of :mod:`ls_fairseq.ops.peer_memory` (``csrc/peer_memory.cu``).

Ops: ``torch.ops.ls_fairseq.peer_export(t) -> uint8 [80]`` (CPU: the IPC handle of ``t``'s
allocation, ``t``'s byte offset in it, the allocation's size) and ``peer_import(exported, device)
-> uint8 [size]`` (the whole allocation of another process, mapped on ``device``). Host utilities,
neither differentiable nor traceable: no fakes.
"""
import torch


def peer_export_cuda(t):
    return torch.ops.ls_fairseq.peer_export(t)


def peer_import_cuda(exported, device: int):
    return torch.ops.ls_fairseq.peer_import(exported.contiguous(), int(device))
