"""CUDA binding of :func:`ls_fairseq.ops.peer_barrier.peer_barrier_` (``csrc/peer_barrier.cu``).

Op: ``torch.ops.ls_fairseq.peer_barrier_(flags, peer_flags, rank, epoch) -> ()``: writes into
the other ranks' flags, waits on its own (in place on both); not differentiable. Its fake is
registered here once the extension is loaded.
"""
import torch

from . import _extension

def _register():
    @torch.library.register_fake("ls_fairseq::peer_barrier_")
    def _fake(flags, peer_flags, rank, epoch):
        return None


_extension.when_loaded(_register)


def peer_barrier_cuda(flags, peer_flags, rank: int, epoch: int):
    torch.ops.ls_fairseq.peer_barrier_(flags, list(peer_flags), int(rank), int(epoch))
