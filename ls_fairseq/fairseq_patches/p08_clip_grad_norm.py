"""fairseq_patches, patch 8: ``Trainer.clip_grad_norm`` (the update count after a deferred
overflow).

With ls_adam's deferred overflow check the trainer counts an update before anyone knows that it
overflowed (fairseq does not count such an update: its ``num_updates`` and learning rate stay
put). The check is booked during the next update, before this call; here the trainer then takes
the skipped updates back (``optimizer.take_skipped_updates()``), before the optimizer step reads
the learning rate. Optimizers without the method: fairseq's method, unchanged.
"""
import functools

NUMBER = 8


def take_back_skipped_updates(trainer) -> int:
    """Takes the updates the trainer counted but the optimizer skipped (a deferred fp16
    overflow) back from ``trainer``'s update count; the learning rate follows. Returns how many."""
    take = getattr(getattr(trainer, "_optimizer", None), "take_skipped_updates", None)
    skipped = take() if take is not None else 0
    if skipped:
        trainer.set_num_updates(trainer.get_num_updates() - skipped)
    return skipped


def targets():
    from fairseq.trainer import Trainer

    def make(original):
        @functools.wraps(original)
        def clip_grad_norm(self, clip_norm):
            norm = original(self, clip_norm)
            take_back_skipped_updates(self)
            return norm
        return clip_grad_norm

    return [(Trainer, "clip_grad_norm", make)]
