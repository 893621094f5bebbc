"""Logged scalars that reach the host without waiting for the GPU's later work.

fairseq's criterions log CUDA scalars (``loss.data``); the trainer turns them into Python numbers
in ``_reduce_and_log_stats``, after it has queued the optimizer step, so each ``.item()`` there
waits for the whole Adam kernel while nothing else is queued: the GPU then idles through the
trainer's bookkeeping (about 2 ms per update at 8192 tokens on the H100). Here the criterion
starts a copy of each logged scalar into pinned host memory as soon as the scalar is computed
and records an event behind it; ``reduce_metrics`` waits for that event only, which the GPU has
long passed, and sees the same value as a Python number.
"""
import torch


class HostCopy:
    """A non-blocking device-to-host copy of one scalar and the event that marks it done."""

    __slots__ = ("_host", "_event")

    def __init__(self, scalar: torch.Tensor):
        self._host = torch.empty((), dtype=scalar.dtype, pin_memory=True)
        self._host.copy_(scalar.detach().reshape(()), non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def value(self):
        self._event.synchronize()
        return self._host.item()

    def __reduce__(self):  # pickled (e.g. gathered across workers): as the settled number
        return (_Settled, (self.value(),))


class _Settled:
    __slots__ = ("_value",)

    def __init__(self, value):
        self._value = value

    def value(self):
        return self._value


def with_host_copy(t):
    """``t``, carrying a :class:`HostCopy` of itself when it is a one-element CUDA tensor."""
    if torch.is_tensor(t) and t.is_cuda and t.numel() == 1:
        t.ls_host_copy = HostCopy(t)
    return t


def to_host(value):
    """The host number of a logged value that carries a host copy; any other value unchanged
    (a tensor summed across workers, or modified since, has none and is left to fairseq)."""
    copy = getattr(value, "ls_host_copy", None) if torch.is_tensor(value) else None
    return value if copy is None else copy.value()
