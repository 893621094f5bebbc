"""A value on its way to the host: read it later without waiting for the GPU's later work.

Used by the criterion's logged scalars (``criterions/host_scalars.py``), by ls_adam's deferred
overflow check (``optim/deferred_overflow.py``) and by the late grad-norm agreement check
(``distributed/async_stats.py``).
"""
import torch


class HostCopy:
    """A non-blocking device-to-host copy of one tensor and the event that marks it done (for a
    CPU tensor, a copy taken now). A one-element tensor reads back as a Python number, any other
    as a list."""

    __slots__ = ("_host", "_event")

    def __init__(self, tensor: torch.Tensor):
        tensor = tensor.detach()
        if tensor.numel() == 1:
            tensor = tensor.reshape(())
        if not tensor.is_cuda:
            self._host, self._event = tensor.clone(), None
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def value(self):
        """The value as a Python number (or list); waits for the copy only."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.item() if self._host.dim() == 0 else self._host.tolist()

    def __reduce__(self):  # pickled (gathered across workers): as the plain value
        value = self.value()
        return (type(value), (value,))
