"""fairseq_patches, patch 1: ``FP16Optimizer.build_optimizer`` (fused fp16 copy).

With ``--optimizer ls_adam`` under ``--fp16``/``--bf16`` it builds
:class:`ls_fairseq.optim.ls_adam.LSFusedFP16Optimizer` (fairseq's per-tensor fp16<->fp32 copy
loops folded into the Adam kernel) wherever that applies, unless ``--ls-no-fused-fp16-copy``.
Other optimizers: unchanged.
"""
import functools

NUMBER = 1


def targets():
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    from ..optim.ls_adam import fp16_optimizer_class

    def make(original):  # the classmethod object
        func = original.__func__

        @functools.wraps(func)
        def build_optimizer(cls, cfg, params, **kwargs):
            if cls is FP16Optimizer:
                cls = fp16_optimizer_class(cfg) or cls
            return func(cls, cfg, params, **kwargs)

        return classmethod(build_optimizer)

    return [(FP16Optimizer, "build_optimizer", make)]
