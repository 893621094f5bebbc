"""A scalar on its way to the host: read it later without waiting for the GPU's later work.

Used by the criterion's logged scalars (``criterions/host_scalars.py``) and by ls_adam's deferred
overflow check (``optim/deferred_overflow.py``).
"""
import torch


class HostCopy:
    """A non-blocking device-to-host copy of one scalar and the event that marks it done (for a
    CPU scalar, a copy taken now)."""

    __slots__ = ("_host", "_event")

    def __init__(self, scalar: torch.Tensor):
        scalar = scalar.detach().reshape(())
        if not scalar.is_cuda:
            self._host, self._event = scalar.clone(), None
            return
        self._host = torch.empty((), dtype=scalar.dtype, pin_memory=True)
        self._host.copy_(scalar, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def value(self):
        """The scalar as a Python number; waits for the copy only."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.item()

    def __reduce__(self):  # pickled (gathered across workers): as the plain number
        value = self.value()
        return (type(value), (value,))
