"""fairseq_patches, patch 4: ``Trainer.load_checkpoint`` (resuming the other side's checkpoint).

fairseq refuses to resume a checkpoint whose recorded criterion or optimizer class differs from
the run's ("please reset the optimizer (--reset-optimizer)", which throws the Adam state away).
Where the two are a fairseq component and its ls_ twin, the refusal names ``ls-fairseq-convert
... --to ls|fairseq`` instead (:func:`ls_fairseq.checkpoint_compat.resume_advice`). Where only
the fp16 wrapper differs (``FP16Optimizer`` against ls_adam's ``LSFusedFP16Optimizer``, e.g. a
checkpoint saved with ``--ls-no-fused-fp16-copy``), whose saved state is the same, the checkpoint
is loaded again with its recorded name read as the run's. Every other resume, matching or not:
fairseq's method and message, unchanged.
"""
import functools
import logging

from .. import switches

NUMBER = 4

logger = logging.getLogger(__package__)


def _reload_with_optimizer_name(original, trainer, name, args, kwargs):
    """fairseq's load_checkpoint again, with the checkpoint's last recorded optimizer name read
    as ``name`` (the fp16 wrappers whose saved state is the same; see the module docstring)."""
    from fairseq import checkpoint_utils

    read = checkpoint_utils.load_checkpoint_to_cpu  # what fairseq's trainer calls, by module

    @functools.wraps(read)
    def load_checkpoint_to_cpu(*a, **k):
        state = read(*a, **k)
        history = state.get("optimizer_history") if isinstance(state, dict) else None
        if history:
            history[-1]["optimizer_name"] = name
        return state

    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu
    try:
        return original(trainer, *args, **kwargs)
    finally:
        checkpoint_utils.load_checkpoint_to_cpu = read


def targets():
    from fairseq.trainer import Trainer

    from .. import checkpoint_compat

    def make(original):
        @functools.wraps(original)
        def load_checkpoint(self, *args, **kwargs):
            try:
                return original(self, *args, **kwargs)
            except AssertionError:
                # fairseq's "Criterion/Optimizer does not match" (trainer.py, after the optimizer
                # is rebuilt): the recorded names are in _optim_history
                history = getattr(self, "_optim_history", None)
                if not history or getattr(self, "_optimizer", None) is None:
                    raise
                saved = history[-1]
                criterion = type(self.get_criterion()).__name__
                optimizer = type(self._optimizer).__name__
                saved_criterion = saved.get("criterion_name")
                saved_optimizer = saved.get("optimizer_name")
                if saved_criterion == criterion and saved_optimizer != optimizer and \
                        checkpoint_compat.optimizer_names_match(saved_optimizer, optimizer):
                    logger.info(f"ls_fairseq: the checkpoint's optimizer state was saved by "
                                f"{saved_optimizer}; {optimizer} keeps the same state: loading it")
                    return _reload_with_optimizer_name(original, self, optimizer, args, kwargs)
                filename = args[0] if args else kwargs.get("filename", "the checkpoint")
                advice = checkpoint_compat.resume_advice(
                    filename, saved_criterion, saved_optimizer, criterion, optimizer)
                if advice is None:
                    raise
                raise switches.Refused(advice) from None
        return load_checkpoint

    return [(Trainer, "load_checkpoint", make)]
