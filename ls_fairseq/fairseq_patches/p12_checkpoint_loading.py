"""fairseq_patches, patch 12: ``checkpoint_utils.load_checkpoint_to_cpu``,
``checkpoint_utils.load_ema_from_checkpoint`` and ``distributed_utils._broadcast_object_slow``
(fairseq's checkpoints under torch's safe loader).

These are fairseq's ``torch.load`` calls that read a checkpoint: from its file (training's
``--restore-file``, fairseq-generate's ``--path``, pretrained components, EMA), and, on several
workers, from the bytes rank 0 broadcasts of the checkpoint it read. Since torch 2.6 that load is
the safe unpickler, which refuses the non-tensor types of a fairseq checkpoint; each runs here
with exactly those types allowed (:func:`ls_fairseq.checkpoint_compat.fairseq_checkpoint_globals`),
and only while it runs. Everything else: fairseq's functions, unchanged.
"""
import functools

from .. import checkpoint_compat

NUMBER = 12


def _loads_fairseq_checkpoints(original):
    @functools.wraps(original)
    def load(*args, **kwargs):
        with checkpoint_compat.fairseq_checkpoint_globals():
            return original(*args, **kwargs)
    return load


def targets():
    from fairseq import checkpoint_utils
    from fairseq.distributed import utils as distributed_utils

    return [(checkpoint_utils, "load_checkpoint_to_cpu", _loads_fairseq_checkpoints),
            (checkpoint_utils, "load_ema_from_checkpoint", _loads_fairseq_checkpoints),
            (distributed_utils, "_broadcast_object_slow", _loads_fairseq_checkpoints)]
