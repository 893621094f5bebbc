"""Every change ls_fairseq makes to fairseq's own classes: one module per patch, installed from
one table (:data:`PATCHES`), and undone by :func:`uninstall`.

fairseq-train builds its ``Trainer`` and ``FP16Optimizer`` by name and has no registry for
either, so where the plugin must change what they do it wraps one of their methods. Each patch
module's docstring says what it changes, why, and for which runs; every wrapper runs fairseq's
own method unchanged for any run it does not concern. ``ls_fairseq/__init__.py`` calls
:func:`install`, so loading the plugin (``--user-dir``) installs them.

=====  =======================  ============================================================
patch  module                   fairseq attribute(s) it wraps
=====  =======================  ============================================================
1      p01_fp16_optimizer       ``FP16Optimizer.build_optimizer`` (fused fp16 copy),
                                ``Trainer._build_optimizer`` (records what it means for the run)
2      p02_train_step           ``Trainer.train_step`` (honest interval wps)
3      p03_distributed_stats    ``Trainer._aggregate_logging_outputs``, ``._check_grad_norms``
4      p04_load_checkpoint      ``Trainer.load_checkpoint`` (the other side's checkpoints)
5      p05_build_generator      ``FairseqTask.build_generator`` (decoding)
6      p06_grouped_shuffling    ``EpochBatchIterator.ordered_batches`` (no batch dropped)
7      p07_fixed_batches        ``Trainer.get_train_iterator`` (batches fixed to GPUs)
8      p08_clip_grad_norm       ``Trainer.clip_grad_norm`` (update count after an overflow)
9      p09_trainer_init         ``Trainer.__init__`` (flags checked before training)
10     p10_call_main            ``distributed_utils.call_main`` (a refusal in one line)
11     p11_arch_hint            ``options.add_model_args`` (architecture typos)
12     p12_checkpoint_loading   ``checkpoint_utils.load_checkpoint_to_cpu``,
                                ``.load_ema_from_checkpoint``,
                                ``distributed_utils._broadcast_object_slow`` (torch's safe
                                loader allows fairseq's checkpoint types, for those loads only)
=====  =======================  ============================================================

Written against fairseq 0.12.2 and fairseq-fixed 0.12.3.x (the same code); on another version
importing this package ends the process with one line (``_fairseq_version``), and each wrapper
checks that the method it wraps exists. A replacement keeps the attribute it replaced
(``_patching``): :func:`install` twice is a no-op, :func:`uninstall` puts fairseq's own
attributes back (the same objects), and :func:`install` then applies the patches again. The
batch orders of patches 6 and 7 are policy of :mod:`ls_fairseq.data.batch_order`. The patches
read the run's ``--ls-*`` switches from its :class:`ls_fairseq.training_config.TrainingConfig`,
built by patch 9. Tested in
tests/test_fairseq_patches.py (and end to end where the docstring of each test file there says).
"""
from . import _patching
from ._fairseq_version import (
    UnsupportedFairseq,
    check_fairseq_version,
    refuse_unsupported_fairseq,
)

refuse_unsupported_fairseq()  # before any patch module runs against this fairseq

from . import (  # noqa: E402
    p01_fp16_optimizer,
    p02_train_step,
    p03_distributed_stats,
    p04_load_checkpoint,
    p05_build_generator,
    p06_grouped_shuffling,
    p07_fixed_batches,
    p08_clip_grad_norm,
    p09_trainer_init,
    p10_call_main,
    p11_arch_hint,
    p12_checkpoint_loading,
)

#: every patch, in the order :func:`install` applies them (:func:`uninstall`: the reverse)
PATCHES = (p01_fp16_optimizer, p02_train_step, p03_distributed_stats, p04_load_checkpoint,
           p05_build_generator, p06_grouped_shuffling, p07_fixed_batches, p08_clip_grad_norm,
           p09_trainer_init, p10_call_main, p11_arch_hint, p12_checkpoint_loading)

# helpers that tests, bench/ and other modules call, by the names they had in one module
from ..data.batch_order import (  # noqa: E402,F401
    batch_costs,
    batches_fixed_to_gpus,
    match_costs,
    remainder_of_groups,
)
from .p02_train_step import logs_after, update_waits_for_gpu, wait_before_log  # noqa: E402,F401
from .p05_build_generator import generator_class  # noqa: E402,F401
from .p07_fixed_batches import (  # noqa: E402,F401
    fix_batches,
    fixed_batches_train_iterator,
    fixed_order,
    fixes_batches,
)
from .p08_clip_grad_norm import take_back_skipped_updates  # noqa: E402,F401
from .p01_fp16_optimizer import record_optimizer  # noqa: E402,F401
from .p09_trainer_init import (  # noqa: E402,F401
    check_run,
    checked_trainer_init,
    configure,
    fp16_device_conflict,
    run_facts,
)
from .p10_call_main import exit_refused, refusal_line, refusal_of_worker  # noqa: E402,F401
from .p11_arch_hint import arch_hint  # noqa: E402,F401


def targets():
    """``(patch number, owner, name, make)`` of every fairseq attribute a patch replaces."""
    return [(patch.NUMBER, owner, name, make)
            for patch in PATCHES for owner, name, make in patch.targets()]


def install() -> None:
    """Apply every patch (a no-op for the ones already installed)."""
    check_fairseq_version()
    for _, owner, name, make in targets():
        _patching.wrap(owner, name, make)


def uninstall() -> None:
    """Put every attribute a patch replaced back to fairseq's own (a no-op where none is
    installed). Objects built while the patches were in place keep what they were given: an
    iterator whose batches patch 7 fixed to GPUs, a parser with patch 11's hint."""
    for _, owner, name, _ in reversed(targets()):
        _patching.unwrap(owner, name)


def installed() -> dict:
    """``{(owner, name): whether the patch is in place}`` for every target."""
    return {(owner, name): _patching.installed(owner, name) for _, owner, name, _ in targets()}
