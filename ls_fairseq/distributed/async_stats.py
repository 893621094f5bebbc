"""Async stats (criterion option, several GPUs; on by default, ``--ls-no-async-stats`` off,
``--ls-async-stats`` required): fairseq's two per-update exchanges between workers, done without
waiting for the GPU.

On N > 1 workers, fairseq's ``Trainer.train_step`` does two things every update that read the GPU:

* ``_aggregate_logging_outputs`` gathers every worker's logged values. For
  ``ls_label_smoothed_cross_entropy`` that is ``all_gather_list``: pickle, copy into a CUDA
  buffer, all-reduce over NCCL, copy back. The copy in waits for the whole backward and the
  gradient all-reduce queued before it; the copy back waits for the exchange.
* ``_check_grad_norms`` all-reduces the workers' grad norms and compares them. It takes
  ``bool()`` of CUDA tensors several times, and each one waits for the norm.

Each wait empties the GPU's queue, and the GPU then idles while the host queues the rest of the
update and the next forward (what that costs: docs/PERFORMANCE.md, "Several GPUs").

With the option:

* The logging outputs and the extra statistics (sample size, OOM count, training time) are
  gathered over a CPU (gloo) process group. The semantics are fairseq's ``_all_gather_list_sync``:
  every worker's outputs in rank order, the extra statistics summed. That exchange never touches
  the GPU, and the criterion's logged values are already host copies (``host_scalars``), which
  wait only for the forward that computed them.
* The grad norms are all-reduced as fairseq does (NCCL, on the stream) and copied to the host
  without waiting. They are compared at the next exchange (the next update's gather, or the
  validation's, which fairseq-train runs after the last update unless validation is disabled),
  so an inconsistency raises fairseq's FloatingPointError one update late. An update whose norm
  is not finite on every worker counts as consistent: it overflowed, and every worker skips it
  the same way. fairseq's own check never sees such a norm, because
  FP16Optimizer raises OverflowError before it; with ``--ls-deferred-overflow-check`` ls_adam
  skips it on the device instead.

fairseq-train builds fairseq's ``Trainer`` by name and has no trainer registry, so replacing these
two methods is the only way to change them short of a trainer of ls_fairseq's own.
``ls_fairseq.fairseq_patches`` wraps both on the ``Trainer`` class when the plugin loads; the
wrappers call :func:`aggregate_logging_outputs` / :func:`check_grad_norms`, which run fairseq's
own methods for every trainer whose ``TrainingConfig`` has ``ls_async_stats`` (a ``switches``
mode) off, as it is for other criteria. Under model parallelism (the data-parallel group is not
every worker) they step aside with one log line, or refuse the run with ``--ls-async-stats``.
Tested in tests/test_distributed_stats.py (gloo, against fairseq's
``_check_grad_norms``), tests/gpu/test_distributed_stats_cuda.py (two GPUs, against fairseq's
``_all_gather_list_sync``; neither wrapped method waits for the GPU) and tests/test_end_to_end.py
(two CPU workers of fairseq-train log what one worker with update-freq 2 logs).
"""
import itertools
import logging
import math

import torch.distributed as dist
from fairseq import utils
from fairseq.distributed import utils as distributed_utils

from .. import training_config
from ..host_copy import HostCopy

logger = logging.getLogger(__name__)


def _applies(trainer) -> bool:
    return training_config.data_parallel_switch(trainer, "ls_async_stats", "--ls-async-stats",
                                                logger)


def host_group(trainer):
    """The trainer's gloo group over every worker, created at its first use (the first exchange,
    which every worker reaches at the same point)."""
    group = getattr(trainer, "_ls_host_group", None)
    if group is None:
        group = dist.new_group(ranks=list(range(dist.get_world_size())), backend="gloo")
        trainer._ls_host_group = group
    return group


def gather_logging_outputs(trainer, logging_outputs, *extra_stats_to_sum, ignore=False):
    """fairseq's ``Trainer._all_gather_list_sync``, exchanged over gloo: ``(every worker's
    logging outputs in rank order, [each extra statistic summed over the workers])``. Values
    arrive as their pickles do (a ``HostCopy`` as its number); CUDA tensors are moved to the CPU
    first, as fairseq does."""
    compare_pending_grad_norms(trainer)
    if ignore:
        logging_outputs = []
    mine = utils.move_to_cpu([logging_outputs] + list(extra_stats_to_sum))
    everyone = [None] * trainer.data_parallel_world_size
    dist.all_gather_object(everyone, mine, group=host_group(trainer))
    results = list(zip(*everyone))
    logging_outputs = list(itertools.chain.from_iterable(results[0]))
    return logging_outputs, [sum(s) for s in results[1:]]


def check_grad_norms_late(trainer, grad_norm) -> None:
    """fairseq's ``Trainer._check_grad_norms``, with the comparison read one update late: raises
    for the previous update's norms (unless the gather compared them already), then queues this
    update's all-reduce and host copy."""
    buf = trainer._grad_norm_buf
    if buf is None:
        return
    compare_pending_grad_norms(trainer)
    buf.zero_()
    buf[trainer.data_parallel_rank] = grad_norm
    distributed_utils.all_reduce(buf, group=trainer.data_parallel_process_group)
    trainer._ls_pending_norms = HostCopy(buf)


def compare_pending_grad_norms(trainer) -> None:
    """Compare the last update's grad norms if not done yet (their copy left long ago: the next
    forward was queued after it)."""
    pending = getattr(trainer, "_ls_pending_norms", None)
    trainer._ls_pending_norms = None
    if pending is not None:
        raise_if_inconsistent(pending.value(), trainer.cfg.common.amp)


def raise_if_inconsistent(norms, amp: bool) -> None:
    """fairseq's test (float64, relative difference to worker 0 below 1e-6), and fairseq's error,
    on the host; a norm that is not finite on every worker passes (an overflow, see above)."""
    finite = [math.isfinite(n) for n in norms]
    max_abs_diff = max(abs(n - norms[0]) for n in norms)
    consistent = ((all(finite) and max_abs_diff / (norms[0] + 1e-6) < 1e-6)
                  or (amp and not all(finite)) or not any(finite))
    if consistent:
        return
    detail = "\n".join("rank {:3d} = {:.8f}".format(r, n) for r, n in enumerate(norms))
    raise FloatingPointError(
        "Fatal error: gradients are inconsistent between workers. "
        "Try --ddp-backend=legacy_ddp. "
        "Or are you mixing up different generation of GPUs in training?"
        "\n" + "-" * 80 + "\ngrad_norm across the workers:\n{}\n\n".format(detail) + "-" * 80
        + "\n(found at the update after the one that produced them: --ls-async-stats)")


def aggregate_logging_outputs(trainer, fairseq_method, logging_outputs, *extra_stats_to_sum,
                              ignore=False):
    """``Trainer._aggregate_logging_outputs`` as wrapped by ``fairseq_patches``: the gather over
    gloo for a trainer whose config has ``ls_async_stats`` on, fairseq's own otherwise."""
    if _applies(trainer):
        return gather_logging_outputs(trainer, logging_outputs, *extra_stats_to_sum,
                                      ignore=ignore)
    return fairseq_method(trainer, logging_outputs, *extra_stats_to_sum, ignore=ignore)


def check_grad_norms(trainer, fairseq_method, grad_norm):
    """``Trainer._check_grad_norms`` as wrapped by ``fairseq_patches``: the late comparison for a
    trainer whose config has ``ls_async_stats`` on, fairseq's own otherwise."""
    if _applies(trainer):
        return check_grad_norms_late(trainer, grad_norm)
    return fairseq_method(trainer, grad_norm)
