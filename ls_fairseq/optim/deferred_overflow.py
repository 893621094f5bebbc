"""``--ls-deferred-overflow-check``: the fp16 overflow test of an update is read one update late,
so no update waits for the GPU. On by default with ls_adam's fused fp16 copy where it applies
(``--ls-no-deferred-overflow-check`` off; ``ls_fairseq.switches``).

fairseq's ``FP16Optimizer.clip_grad_norm`` reads the gradient norm back to decide whether the
update overflowed. That read waits for the whole backward; the GPU then idles through the
trainer's bookkeeping until the next forward is queued (the one host synchronisation left per
update; its cost: docs/PERFORMANCE.md). With this
option (used by ``ls_adam``'s ``LSFusedFP16Optimizer``):

* ``clip_grad_norm`` computes the norm, the clip factor and the overflow test on the device
  (:func:`guarded_factor`) and folds them into the factor the Adam kernel multiplies the
  gradients by: NaN when the norm is not finite, which makes the kernel leave every weight and
  moment untouched (the update is skipped, as fairseq skips it). A copy of the norm starts
  towards the host (:class:`PendingOverflowCheck`).
* The next ``backward`` (called after the next forward has been queued, so the GPU has work
  meanwhile) reads that copy and does fairseq's bookkeeping exactly as fairseq would have done it
  one update earlier: ``DynamicLossScaler.check_overflow`` (lower the scale, fairseq's "gradient
  overflow detected" log line, FloatingPointError at the minimum scale) and the Adam step count
  taken back, or ``DynamicLossScaler.update``. So every backward scales its loss by fairseq's
  loss scale, and every Adam step uses fairseq's step count (bias correction).
* The trainer receives the norm as :class:`GradNormForTrainer`.

The update count stays fairseq's. The trainer counts an update before anyone knows that it
overflowed; the booking finds out during the next update, and fairseq's trainer (through
``fairseq_patches``, patch 8, at its ``clip_grad_norm`` call, before the optimizer step) takes the
skipped update back (:meth:`LSFusedFP16Optimizer.take_skipped_updates`). So ``num_updates``, the
learning rate of every step and the data order are fairseq's. What still differs, on overflowing
updates only: the skipped update's loss is logged (its gnorm as inf, NaN where the gradients hold
NaNs; fairseq logs nothing for it, and ``ls-fairseq-compare`` leaves such intervals out of its
loss-curve rows), the batch right after it draws its dropout masks from seed + one more (fairseq
seeds each update with seed + num_updates, set before the booking), the logged ``loss_scale`` lags
one update, the minimum-loss-scale error comes one update later, and an overflow on the very last
update (``--max-update``) ends the run one update short. With fairseq's dynamic loss scaling
overflows are rare after the first updates.

On several GPUs the option needs the criterion's async stats (on by default,
``ls_fairseq.distributed.async_stats``): fairseq's own check that the workers' grad norms agree
treats a non-finite norm as a disagreement and stops the run, and with this option the trainer
does see the norm of an overflowing update.
"""
import logging
import math

import torch
from torch.utils._pytree import tree_map

from ..workers import several_workers
from ..host_copy import HostCopy

logger = logging.getLogger(__name__)


def guarded_factor(total_norm: torch.Tensor, multiply_factor, max_norm: float):
    """``(norm, factor)`` for fairseq's FP16Optimizer step, computed on ``total_norm``'s device
    without reading anything back.

    ``norm = multiply_factor * total_norm`` is fairseq's grad norm (the value ``clip_grad_norm``
    returns). ``factor`` is what the optimizer multiplies the raw gradients by: fairseq's
    ``_multiply_factor`` after clipping (times ``max_norm / norm`` when ``norm > max_norm > 0``),
    or NaN when ``norm`` is inf/NaN (an overflow: the Adam kernel then skips every element).
    ``multiply_factor`` is a Python number or a one-element tensor on that device."""
    norm = total_norm.float() * multiply_factor
    factor = norm * 0 + multiply_factor  # on the device, whatever multiply_factor is
    if max_norm > 0:
        factor = torch.where(norm > max_norm, factor * (max_norm / norm), factor)
    return norm, torch.where(torch.isfinite(norm), factor, float("nan"))


def grad_norm_check_conflict(cfg):
    """Why the deferred check cannot run, or None: a run of several workers needs fairseq's
    grad-norm agreement check replaced (async stats of ``ls_label_smoothed_cross_entropy``, on by
    default: ``ls_fairseq.distributed.async_stats``), which would otherwise stop it at the first
    overflow. ``cfg`` is the trainer's whole config."""
    if not several_workers():
        return None
    criterion = getattr(cfg, "criterion", None)
    if not hasattr(criterion, "ls_no_async_stats"):  # not ls_label_smoothed_cross_entropy
        return ("on several GPUs it needs --criterion ls_label_smoothed_cross_entropy (its async "
                "stats replace fairseq's check that the workers' grad norms agree, which would "
                "stop the run at the first fp16 overflow)")
    if getattr(criterion, "ls_no_async_stats", False):
        return ("--ls-no-async-stats keeps fairseq's check that the workers' grad norms agree, "
                "which would stop the run at the first fp16 overflow")
    if getattr(getattr(cfg, "common", None), "model_parallel_size", 1) > 1:
        return ("async stats step aside under model parallelism, and fairseq's check that the "
                "workers' grad norms agree would stop the run at the first fp16 overflow")
    return None


def _plain(x):
    if isinstance(x, GradNormForTrainer):
        with torch._C.DisableTorchFunctionSubclass():
            return x.as_subclass(torch.Tensor)
    return x


class GradNormForTrainer(torch.Tensor):
    """The update's grad norm, on the device, as returned to fairseq's trainer.

    The trainer tests it with ``torch.isfinite`` twice (to raise FloatingPointError on NaN
    gradients, and before logging it), and on a CUDA tensor each test waits for the GPU. Here an
    overflow has already been handled on the device (the update is skipped) and is booked at the
    next update, so the test answers True at once (a CPU tensor). Every other operation sees the
    plain tensor and returns plain tensors, and it pickles as a plain tensor (fairseq's meters
    keep the last logged value, and checkpoints save the meters)."""

    @staticmethod
    def wrap(norm: torch.Tensor) -> "GradNormForTrainer":
        return norm.as_subclass(GradNormForTrainer)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.isfinite or func is torch.Tensor.isfinite:
            return torch.ones((), dtype=torch.bool)
        args, kwargs = tree_map(_plain, (args, kwargs or {}))
        return func(*args, **kwargs)

    def plain(self) -> torch.Tensor:
        return _plain(self)

    def __reduce_ex__(self, protocol):
        return self.plain().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return self.plain().clone()


class PendingOverflowCheck:
    """The grad norm of an update whose optimizer step was queued without knowing whether it
    overflowed, on its way to the host, and the optimizer states that step counted."""

    __slots__ = ("_norm", "states")

    def __init__(self, norm: torch.Tensor):
        self._norm = HostCopy(norm)
        self.states = []

    def book(self, scaler) -> bool:
        """fairseq's bookkeeping for the update, done now: on overflow, the step counts taken
        back and ``scaler.check_overflow`` (lowers the scale; FloatingPointError at the
        minimum), otherwise ``scaler.update()``. Without a scaler (``--bf16``) a non-finite norm
        raises fairseq's FloatingPointError (the update itself was skipped on the device).
        Returns whether the update overflowed (it was skipped)."""
        value = float(self._norm.value())
        if scaler is None:
            if not math.isfinite(value):
                for state in self.states:
                    state["step"] -= 1
                raise FloatingPointError(
                    f"gradients are Nan/Inf (grad norm {value} at the previous update, which was "
                    f"skipped; found one update late: --ls-deferred-overflow-check, or pass "
                    f"--ls-no-deferred-overflow-check to stop at the update itself)")
            return False
        if math.isfinite(value):
            scaler.update()
            return False
        for state in self.states:
            state["step"] -= 1
        try:
            scaler.check_overflow(value)
        except OverflowError as e:  # what fairseq's trainer logs, one update late
            logger.info(f"NOTE: gradient overflow detected, ignoring gradient, {e} (found at "
                        f"the next update: --ls-deferred-overflow-check; the update is taken "
                        f"back from the update count, its loss was logged)")
        return True
