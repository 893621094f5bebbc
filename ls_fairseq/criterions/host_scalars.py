"""Logged scalars that reach the host without waiting for the GPU's later work.

fairseq's criterions log CUDA scalars (``loss.data``); the trainer turns them into Python numbers in
``_reduce_and_log_stats``, after it has queued the optimizer step, so each ``.item()`` there waits
for the whole Adam kernel while nothing else is queued: the GPU then idles through the trainer's
bookkeeping, every update. Here the criterion starts a copy of each logged scalar into pinned host
memory as soon as the scalar is computed and records an event behind it; ``reduce_metrics`` waits
for that event only, which the GPU has long passed, and sees the same value as a Python number.

With several GPUs fairseq's trainer exchanges the logged values between ranks before it queues
anything else. Its fast path (``all_reduce_dict``) turns them into fresh CUDA tensors, which
lose their host copies: ``sample_size or 1.0`` and ``reduce_metrics`` then wait for the GPU, the
latter for the whole optimizer step. So under data parallelism the criterion logs
:class:`HostCopy` objects themselves, and says its logging outputs cannot be summed on the GPU:
fairseq then gathers them with ``all_gather_list`` (pickled), and each rank receives plain Python
numbers (a :class:`HostCopy` pickles as its value). ``all_gather_list`` itself still waits for the
GPU (it stages the pickles through a CUDA buffer); async stats (on by default) gathers the same pickles
over a CPU group instead (``distributed/async_stats.py``).
"""
import torch

from ..workers import several_workers
from ..host_copy import HostCopy


def for_logging(t):
    """What the criterion logs for ``t``: for a one-element CUDA tensor, ``t`` carrying a
    :class:`HostCopy` of itself (one process), or the :class:`HostCopy` alone (several processes:
    gathered as a number); any other value unchanged."""
    if not (torch.is_tensor(t) and t.is_cuda and t.numel() == 1):
        return t
    if several_workers():
        return HostCopy(t)
    t.ls_host_copy = HostCopy(t)
    return t


def to_host(value):
    """The host number of a :class:`HostCopy` or of a logged tensor that carries one; any other
    value unchanged (a tensor summed across workers, or modified since, has none and is left to
    fairseq)."""
    if isinstance(value, HostCopy):
        return value.value()
    copy = getattr(value, "ls_host_copy", None) if torch.is_tensor(value) else None
    return value if copy is None else copy.value()
