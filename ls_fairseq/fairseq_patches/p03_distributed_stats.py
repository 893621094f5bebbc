"""fairseq_patches, patch 3: ``Trainer._aggregate_logging_outputs`` and
``Trainer._check_grad_norms`` (async stats, several GPUs):
:mod:`ls_fairseq.distributed.async_stats`.
"""
import functools

NUMBER = 3


def targets():
    from fairseq.trainer import Trainer

    from ..distributed import async_stats as distributed_stats

    def make_aggregate(original):
        @functools.wraps(original)
        def _aggregate_logging_outputs(self, logging_outputs, *extra_stats_to_sum, ignore=False):
            return distributed_stats.aggregate_logging_outputs(
                self, original, logging_outputs, *extra_stats_to_sum, ignore=ignore)
        return _aggregate_logging_outputs

    def make_check(original):
        @functools.wraps(original)
        def _check_grad_norms(self, grad_norm):
            return distributed_stats.check_grad_norms(self, original, grad_norm)
        return _check_grad_norms

    return [(Trainer, "_aggregate_logging_outputs", make_aggregate),
            (Trainer, "_check_grad_norms", make_check)]
