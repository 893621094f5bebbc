"""The training-step engine behind ``--ls-cuda-graphs``: the criterion's forward and backward
captured as CUDA graphs, one pair per (bucketed) batch shape, and replayed, with the gradients in
flat per-dtype buffers that every step, replayed or eager, accumulates into. The criterion
(``criterions/ls_label_smoothed_cross_entropy.py``) owns the flags and the loss and runs its loss
through ``CudaGraphedLoss``. With several GPUs the engine holds the buffers' all-reduce
(``ls_fairseq.distributed.GradientReducer``), which hands ls_adam one ``GradientExchange`` per
update. Who calls whom in one update, on one GPU and on several: docs/DESIGN.md.

Map:

* ``replay``: ``CudaGraphedLoss``, capture and replay (and the DDP bypass);
* ``capture_policy``: when a new shape is captured (``CapturePolicy``: --ls-cuda-graphs-capture);
* ``flat_gradients``: the accumulators (``FlatGradients``);
* ``memory`` / ``shape_buckets``: the graphs' memory pool; batches padded to bucketed shapes.

The all-reduce, the copy-engine all-reduce and the sharded optimizer step live in
``ls_fairseq.distributed``.

Imports: this package uses ``ls_fairseq.switches``, ``ls_fairseq.wrappers`` and
``ls_fairseq.distributed`` (the engine's reducer; the flat layout's ``ALIGN``), never
``criterions``, ``optim`` or ``models`` (criterions import it; optim imports only
``distributed``). It holds no process-wide state.
"""
from .capture_policy import CAPTURE_CHOICES, CapturePolicy, captures_first_sighting
from .flat_gradients import FlatGradients
from .memory import MEMORY_CHOICES
from .replay import CudaGraphedLoss

__all__ = ["CAPTURE_CHOICES", "MEMORY_CHOICES", "CapturePolicy", "CudaGraphedLoss",
           "FlatGradients", "captures_first_sighting"]
