"""fairseq_patches, patch 2: ``Trainer.train_step`` (honest interval wps).

fairseq reads a log interval's ``wps`` before its ``gnorm``, and resets the interval's clock
after the log. When the update does not wait for the GPU (ls_adam's deferred overflow check),
reading ``gnorm`` waits for the queued GPU work, and that wait falls between the wps read and the
reset: it counts in no interval, and the logged wps reads high. So at the end of an update that
fairseq-train will log, the GPU is waited for first; the wait fairseq's gnorm read would have
done anyway, moved before the wps read. Runs whose optimizer reads the gradient norm back every
update: unchanged.
"""
import functools

import torch

from .. import training_config

NUMBER = 2


def update_waits_for_gpu(trainer) -> bool:
    """False when the trainer's update leaves GPU work queued at its end without a host read
    (ls_adam's deferred overflow check: its run's ``TrainingConfig``, as patch 1 recorded it)."""
    config = training_config.of(trainer)
    return not (config is not None and config.run.host_reads_deferred)


def logs_after(trainer) -> bool:
    """True when fairseq-train logs the interval after the update just done (its test)."""
    interval = getattr(trainer.cfg.common, "log_interval", 0) or 0
    return interval > 0 and trainer.get_num_updates() % interval == 0


def wait_before_log(trainer, log_output) -> bool:
    """After ``trainer.train_step``: wait for the GPU if fairseq-train is about to log this
    update's interval and the update left GPU work queued. Returns whether it waited."""
    if log_output is None or update_waits_for_gpu(trainer) or not logs_after(trainer):
        return False
    device = getattr(trainer, "device", None)
    if getattr(device, "type", None) != "cuda" or not torch.cuda.is_available():
        return False
    torch.cuda.synchronize(device)
    return True


def targets():
    from fairseq.trainer import Trainer

    def make(original):
        @functools.wraps(original)
        def train_step(self, samples, raise_oom=False):
            log_output = original(self, samples, raise_oom=raise_oom)
            wait_before_log(self, log_output)
            return log_output
        return train_step

    return [(Trainer, "train_step", make)]
