"""The training-step engine behind ``--ls-cuda-graphs``: the criterion's forward and backward
captured as CUDA graphs, one pair per (bucketed) batch shape, and replayed, with the gradients in
flat per-dtype buffers that every step, replayed or eager, accumulates into; under fairseq's legacy
DDP those buffers are all-reduced bucket by bucket while the backward runs, or after it in place.
The criterion (``criterions/ls_label_smoothed_cross_entropy.py``) owns the flags and the loss and
runs its loss through ``CudaGraphedLoss``; ls_adam's ``all_reduce_grads`` calls ``all_reduce_flat``.

Map:

* ``replay``: ``CudaGraphedLoss``, capture, replay and the legacy-DDP all-reduce's timing;
* ``capture_policy``: when a new shape is captured (``CapturePolicy``: --ls-cuda-graphs-capture);
* ``flat_gradients``: the accumulators (``FlatGradients``) and ``flat_gradients_of(model)``;
* ``grad_buckets`` / ``flat_all_reduce``: the all-reduce during the backward / after it;
* ``peer_all_reduce``: a bucket's all-reduce by copy engines (GPUs of one host), instead of NCCL;
* ``sharded_step``: the optimizer step on the shards a rank sums (ls_adam drives it);
* ``memory`` / ``shape_buckets``: the graphs' memory pool; batches padded to bucketed shapes.

Imports: this package uses ``ls_fairseq.switches``, ``ls_fairseq.wrappers`` and, for the
copy-engine all-reduce, ``ls_fairseq.ops`` (peer memory, the shard sum), never
``criterions``, ``optim`` or ``models`` (criterions and optim import it). Its one piece of
process-wide state is the weak registry of ``flat_gradients`` (why: see there).
"""
from .capture_policy import CAPTURE_CHOICES, CapturePolicy, captures_first_sighting
from .flat_all_reduce import all_reduce_flat
from .flat_gradients import FlatGradients, flat_gradients_of
from .memory import MEMORY_CHOICES
from .replay import CudaGraphedLoss

__all__ = ["CAPTURE_CHOICES", "MEMORY_CHOICES", "CapturePolicy", "CudaGraphedLoss",
           "FlatGradients", "all_reduce_flat", "captures_first_sighting", "flat_gradients_of"]
