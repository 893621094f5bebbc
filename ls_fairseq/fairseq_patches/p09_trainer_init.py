"""fairseq_patches, patch 9: ``Trainer.__init__`` (flags checked before training).

Once fairseq's trainer is built, and before it loads a checkpoint or the training data, every
``--ls-X`` the user gave that cannot apply to the run is refused (:func:`check_run`: the
criterion's ``check_run``, ls_adam's ``check_run``), and so is ``--fp16`` on the CPU, where
fairseq's ``FP16Optimizer`` would fail deep inside torch ("Found no NVIDIA driver"). On the CPU
the default CUDA graphs step aside here, with their one line. Runs with nothing to refuse:
fairseq's method, unchanged. Then the run's ``--ls-*`` switches are read once into its
:class:`ls_fairseq.training_config.TrainingConfig` (:func:`configure`), which the other patches
read.
"""
import functools

from .. import switches, training_config

NUMBER = 9


def run_facts(trainer) -> switches.RunFacts:
    """What ``trainer``'s run is, for the checks before training."""
    workers, processes = training_config.workers_and_processes(trainer)
    backend = getattr(trainer.cfg.distributed_training, "distributed_backend", "nccl")
    return switches.RunFacts(cuda=bool(getattr(trainer, "cuda", False)), workers=workers,
                             processes=processes, backend=str(backend))


def fp16_device_conflict(cfg, run: switches.RunFacts):
    """Why ``--fp16`` cannot train ``run`` (None: it can): fairseq's ``FP16Optimizer`` puts its
    flat fp32 master weights on the current CUDA device. ``--memory-efficient-fp16`` and
    ``--fp16-no-flatten-grads`` keep no flat master, and do train on the CPU."""
    common = cfg.common
    if not getattr(common, "fp16", False) or run.cuda or getattr(common, "tpu", False):
        return None
    if getattr(common, "memory_efficient_fp16", False) or \
            getattr(common, "fp16_no_flatten_grads", False) or getattr(common, "amp", False) or \
            getattr(cfg.distributed_training, "ddp_backend", None) == "fully_sharded":
        return None
    return ("--fp16 needs a CUDA GPU (fairseq's FP16Optimizer keeps its fp32 master weights on "
            "it), and this run trains on the CPU (--cpu, or no CUDA GPU visible to torch): on "
            "the CPU train with --bf16, or drop --fp16")


def check_run(trainer) -> None:
    """Patch 9: refuses, with one line, what cannot train on ``trainer``'s run (see the module
    docstring)."""
    from ..criterions.ls_label_smoothed_cross_entropy import (
        LSLabelSmoothedCrossEntropyCriterion,
    )
    from ..optim import ls_adam

    run = run_facts(trainer)
    reason = fp16_device_conflict(trainer.cfg, run)
    if reason is not None:
        raise switches.Refused(reason)
    criterion = getattr(trainer, "_criterion", None)
    if isinstance(criterion, LSLabelSmoothedCrossEntropyCriterion):
        criterion.check_run(trainer.cfg, run, getattr(trainer, "_model", None))
    ls_adam.check_run(trainer.cfg, run)


def configure(trainer) -> training_config.TrainingConfig:
    """Patch 9: ``trainer``'s :class:`TrainingConfig`, read from its ``cfg`` once and kept on it
    (``training_config.of``)."""
    return training_config.attach(trainer, training_config.TrainingConfig.from_cfg(trainer.cfg))


def checked_trainer_init(original):
    """Patch 9's wrapper of ``Trainer.__init__`` (``original``: fairseq's)."""
    @functools.wraps(original)
    def __init__(self, cfg, task, model, criterion, *args, **kwargs):
        original(self, cfg, task, model, criterion, *args, **kwargs)
        check_run(self)
        configure(self)
    return __init__


def targets():
    from fairseq.trainer import Trainer

    return [(Trainer, "__init__", checked_trainer_init)]
