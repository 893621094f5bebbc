"""fairseq_patches, patch 5: ``FairseqTask.build_generator`` (decoding).

Where fairseq would build its plain ``SequenceGenerator`` (no ``--print-alignment``, no
``--score-reference``, no generator class named by the caller) for models that are all
ls_transformer, it builds :class:`ls_fairseq.generation.LSSequenceGenerator` with the same
arguments: fairseq's generator with a fixed-shape beam search replayed as CUDA graphs, which
falls back to fairseq's own loop for the options it does not cover.
``LS_FAIRSEQ_GENERATOR=fairseq``, other models and every other case: fairseq's method, unchanged.
"""
import functools

NUMBER = 5


def generator_class(models, args, seq_gen_cls):
    """The generator class to build: ``LSSequenceGenerator`` where patch 5 applies, else
    ``seq_gen_cls`` (None: fairseq's choice)."""
    from ..generation import generator
    from ..models.ls_transformer import LSTransformerModel

    if seq_gen_cls is not None or generator.mode() == "fairseq":
        return seq_gen_cls
    if getattr(args, "score_reference", False) or getattr(args, "print_alignment", False):
        return seq_gen_cls
    if not models or not all(isinstance(m, LSTransformerModel) for m in models):
        return seq_gen_cls
    return generator.LSSequenceGenerator


def targets():
    from fairseq.tasks.fairseq_task import FairseqTask

    def make(original):
        @functools.wraps(original)
        def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                            prefix_allowed_tokens_fn=None):
            return original(self, models, args,
                            seq_gen_cls=generator_class(models, args, seq_gen_cls),
                            extra_gen_cls_kwargs=extra_gen_cls_kwargs,
                            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
        return build_generator

    return [(FairseqTask, "build_generator", make)]
