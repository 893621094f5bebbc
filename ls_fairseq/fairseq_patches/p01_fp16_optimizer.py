"""fairseq_patches, patch 1: ``FP16Optimizer.build_optimizer`` (fused fp16 copy) and
``Trainer._build_optimizer`` (what the built optimizer means for the run).

With ``--optimizer ls_adam`` under ``--fp16``/``--bf16`` it builds
:class:`ls_fairseq.optim.ls_adam.LSFusedFP16Optimizer` (fairseq's per-tensor fp16<->fp32 copy
loops folded into the Adam kernel) wherever that applies, unless ``--ls-no-fused-fp16-copy``.
Once fairseq's trainer has built its optimizer, whether an update leaves its GPU work queued
without a host read (the fused copy with ls_adam's deferred overflow check, decided from the
flags as the optimizer decides it) is recorded in the run's
:class:`ls_fairseq.training_config.TrainingConfig`, where patch 2 reads it. Other optimizers:
unchanged.
"""
import functools

from .. import training_config

NUMBER = 1


def record_optimizer(trainer) -> None:
    """After fairseq's ``trainer._build_optimizer``: record in ``trainer``'s config whether its
    updates defer their host reads (a trainer without a config: nothing to record)."""
    from ..optim import ls_adam

    config = training_config.of(trainer)
    if config is None:
        return
    built = type(getattr(trainer, "_optimizer", None))  # fairseq's wrappers (BMUF) defer nothing
    config.run.host_reads_deferred = built is ls_adam.LSFusedFP16Optimizer and \
        ls_adam.defers_overflow_check(trainer.cfg, quiet=True)


def targets():
    from fairseq.optim.fp16_optimizer import FP16Optimizer
    from fairseq.trainer import Trainer

    from ..optim.ls_adam import fp16_optimizer_class

    def make(original):  # the classmethod object
        func = original.__func__

        @functools.wraps(func)
        def build_optimizer(cls, cfg, params, **kwargs):
            if cls is FP16Optimizer:
                cls = fp16_optimizer_class(cfg) or cls
            return func(cls, cfg, params, **kwargs)

        return classmethod(build_optimizer)

    def make_trainer(original):
        @functools.wraps(original)
        def _build_optimizer(self):
            original(self)
            record_optimizer(self)
        return _build_optimizer

    return [(FP16Optimizer, "build_optimizer", make),
            (Trainer, "_build_optimizer", make_trainer)]
