"""Every change ls_fairseq makes to fairseq's own classes, in one module, installed one way.

fairseq-train builds its ``Trainer`` and ``FP16Optimizer`` by name and has no registry for
either, so where the plugin must change what they do it wraps one of their methods. Each patch
below says what it changes, why, and for which runs; every wrapper runs fairseq's own method
unchanged for any run it does not concern. :func:`install` applies them all, once per process;
``ls_fairseq/__init__.py`` calls it, so loading the plugin (``--user-dir``) installs them.
Written against fairseq 0.12.2 (and fairseq-fixed 0.12.3.1, the same code); each wrapper checks
that the method it wraps exists. Tested in tests/test_fairseq_patches.py (and end to end where
the docstring of each test file there says).

1. ``FP16Optimizer.build_optimizer`` (fused fp16 copy): with ``--optimizer ls_adam`` under
   ``--fp16``/``--bf16`` it builds :class:`ls_fairseq.optim.ls_adam.LSFusedFP16Optimizer`
   (fairseq's per-tensor fp16<->fp32 copy loops folded into the Adam kernel) wherever that
   applies, unless ``--ls-no-fused-fp16-copy``. Other optimizers: unchanged.
2. ``Trainer.train_step`` (honest interval wps): fairseq reads a log interval's ``wps`` before
   its ``gnorm``, and resets the interval's clock after the log. When the update does not wait
   for the GPU (ls_adam's deferred overflow check), reading ``gnorm`` waits for the queued GPU
   work, and that wait falls between the wps read and the reset: it counts in no interval, and
   the logged wps reads high. So at the end of an update that
   fairseq-train will log, the GPU is waited for first; the wait fairseq's gnorm read would have
   done anyway, moved before the wps read. Runs whose optimizer reads the gradient norm back
   every update: unchanged.
3. ``Trainer._aggregate_logging_outputs`` and ``Trainer._check_grad_norms``
   (async stats, several GPUs): :mod:`ls_fairseq.distributed_stats`.
4. ``Trainer.load_checkpoint`` (resuming the other side's checkpoint): fairseq refuses to resume
   a checkpoint whose recorded criterion or optimizer class differs from the run's ("please
   reset the optimizer (--reset-optimizer)", which throws the Adam state away). Where the two
   are a fairseq component and its ls_ twin, the refusal names ``ls-fairseq-convert ... --to
   ls|fairseq`` instead (:func:`ls_fairseq.checkpoint_compat.resume_advice`). Where only the
   fp16 wrapper differs (``FP16Optimizer`` against ls_adam's ``LSFusedFP16Optimizer``, e.g. a
   checkpoint saved with ``--ls-no-fused-fp16-copy``), whose saved state is the same, the
   checkpoint is loaded again with its recorded name read as the run's. Every other resume,
   matching or not: fairseq's method and message, unchanged.
5. ``FairseqTask.build_generator`` (decoding): where fairseq would build its plain
   ``SequenceGenerator`` (no ``--print-alignment``, no ``--score-reference``, no generator class
   named by the caller) for models that are all ls_transformer, it builds
   :class:`ls_fairseq.generation.LSSequenceGenerator` with the same arguments: fairseq's
   generator with a fixed-shape beam search replayed as CUDA graphs, which falls back to
   fairseq's own loop for the options it does not cover. ``LS_FAIRSEQ_GENERATOR=fairseq``, other
   models and every other case: fairseq's method, unchanged.
6. ``EpochBatchIterator.ordered_batches`` (``--grouped-shuffling`` keeps every batch): fairseq
   shuffles the epoch's batches in groups of N (one per GPU) and drops the batches after the
   last full group, the same ones every epoch: up to N - 1 batches of the longest sentences are
   never trained on. Here they come last in the epoch, one per rank, and the ranks left
   without one run fairseq's dummy batch (as for any epoch that does not divide by N). The full
   groups keep fairseq's order. It also serves patch 7's order. Without either, on one GPU, with
   ``fix_batches_to_gpus`` or a prefetching dataset: fairseq's method, unchanged.
7. ``Trainer.get_train_iterator`` (batches fixed to GPUs on several GPUs): fairseq deals each
   epoch's shuffled batches to the GPUs anew, so each GPU keeps meeting batch shapes its CUDA
   graphs have not captured. For ls_ runs (``--criterion ls_label_smoothed_cross_entropy``) on
   several GPUs of plain data parallelism, GPU r keeps batches r, r + N, ... of fairseq's
   length-ordered batches and shuffles them itself each epoch (seed + epoch + r; a share that
   comes up short holds one fairseq dummy batch): fairseq's own order under
   ``--fix-batches-to-gpus``, which fairseq honours only for prefetching datasets. An update's
   N batches are then a random pick, one from each GPU's share, as in fairseq's order. Not
   length-grouped updates (fairseq's ``--grouped-shuffling``): their N batches are neighbours in
   length, and on a learnable corpus that trains slower for the first ~1,000 updates
   (docs/QUALITY.md). One log line says so. ``--ls-cost-matching-window W`` (off by default)
   then matches an update's batches by cost: in each run of W updates GPU r > 0 orders its
   batches so that its k-th costliest (token slots) meets GPU 0's k-th costliest, which the
   GPUs would otherwise wait for. ``--ls-no-fix-batches-to-gpus``, one GPU, other
   criterions, model parallelism, prefetching datasets and runs that pass
   ``--grouped-shuffling`` themselves: fairseq's method, unchanged (``--fix-batches-to-gpus``
   passed by the user is the same order).
8. ``Trainer.clip_grad_norm`` (the update count after a deferred overflow): with ls_adam's
   deferred overflow check the trainer counts an update before anyone knows that it overflowed
   (fairseq does not count such an update: its ``num_updates`` and learning rate stay put). The
   check is booked during the next update, before this call; here the trainer then takes the
   skipped updates back (``optimizer.take_skipped_updates()``), before the optimizer step reads
   the learning rate. Optimizers without the method: fairseq's method, unchanged.
9. ``Trainer.__init__`` (flags checked before training): once fairseq's trainer is built, and
   before it loads a checkpoint or the training data, every ``--ls-X`` the user gave that cannot
   apply to the run is refused (:func:`check_run`: the criterion's ``check_run``, ls_adam's
   ``check_run``), and so is ``--fp16`` on the CPU, where fairseq's ``FP16Optimizer`` would
   fail deep inside torch ("Found no NVIDIA driver"). On the CPU the default CUDA graphs step
   aside here, with their one line. Runs with nothing to refuse: fairseq's method, unchanged.
10. ``distributed_utils.call_main`` (one line, not a traceback): fairseq-train reports a
   :class:`ls_fairseq.switches.Refused` (a bad ``--ls-*`` value, a flag that cannot apply, a
   checkpoint to convert first) as one line on stderr, ``ls_fairseq: <message>``, and exits
   with status 2, as argparse does for a usage error; raised in a worker process that
   ``torch.multiprocessing.spawn`` started, it reaches this process as that process's
   traceback, and the same line is printed from it. Every other error: fairseq's, unchanged.
11. ``options.add_model_args`` (architecture typos): fairseq-train's parser answers an unknown
   ``--arch`` with its usage and one line listing every architecture (~3,800 characters).
   After fairseq's message the parser then prints one more line with the nearest names
   (``difflib``) and the ls_ architectures. Every other parser error: argparse's, unchanged.
"""
import difflib
import functools
import logging
import re
import sys

import torch

from . import switches

logger = logging.getLogger(__name__)

_MARK = "_ls_fairseq_patch"


def _wrap(cls, name, make_wrapper):
    """Replace ``cls.name`` by ``make_wrapper(original)`` unless already done."""
    original = getattr(cls, name, None)
    if original is None:
        raise RuntimeError(f"ls_fairseq: fairseq's {cls.__name__}.{name} is missing; this "
                           f"fairseq version is not supported (fairseq 0.12 is)")
    if getattr(original, _MARK, False):
        return
    wrapper = make_wrapper(original)
    setattr(wrapper, _MARK, True)
    setattr(cls, name, wrapper)


# ---- 1. FP16Optimizer.build_optimizer -----------------------------------------------------

def _patch_fp16_optimizer():
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    from .optim.ls_adam import fp16_optimizer_class

    original = FP16Optimizer.build_optimizer.__func__  # a classmethod
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def build_optimizer(cls, cfg, params, **kwargs):
        if cls is FP16Optimizer:
            cls = fp16_optimizer_class(cfg) or cls
        return original(cls, cfg, params, **kwargs)

    setattr(build_optimizer, _MARK, True)
    FP16Optimizer.build_optimizer = classmethod(build_optimizer)


# ---- 2. Trainer.train_step ----------------------------------------------------------------

def update_waits_for_gpu(trainer) -> bool:
    """False when the trainer's update leaves GPU work queued at its end without a host read
    (ls_adam's deferred overflow check)."""
    optimizer = getattr(trainer, "_optimizer", None)
    return not getattr(optimizer, "defers_host_reads", False)


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


def _patch_train_step():
    from fairseq.trainer import Trainer

    def make(original):
        @functools.wraps(original)
        def train_step(self, samples, raise_oom=False):
            log_output = original(self, samples, raise_oom=raise_oom)
            wait_before_log(self, log_output)
            return log_output
        return train_step

    _wrap(Trainer, "train_step", make)


# ---- 3. Trainer's exchanges between workers -----------------------------------------------

def _patch_distributed_stats():
    from fairseq.trainer import Trainer

    from . import distributed_stats

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

    _wrap(Trainer, "_aggregate_logging_outputs", make_aggregate)
    _wrap(Trainer, "_check_grad_norms", make_check)


def install() -> None:
    """Apply every patch above (idempotent)."""
    _patch_fp16_optimizer()
    _patch_train_step()
    _patch_distributed_stats()
    _patch_load_checkpoint()
    _patch_build_generator()
    _patch_ordered_batches()
    _patch_train_iterator()
    _patch_clip_grad_norm()
    _patch_trainer_init()
    _patch_call_main()
    _patch_arch_hint()


# ---- 4. Trainer.load_checkpoint -----------------------------------------------------------

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


def _patch_load_checkpoint():
    from fairseq.trainer import Trainer

    from . import checkpoint_compat

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

    _wrap(Trainer, "load_checkpoint", make)


# ---- 5. FairseqTask.build_generator -------------------------------------------------------

def generator_class(models, args, seq_gen_cls):
    """The generator class to build: ``LSSequenceGenerator`` where patch 5 applies, else
    ``seq_gen_cls`` (None: fairseq's choice)."""
    from .generation import generator
    from .models.ls_transformer import LSTransformerModel

    if seq_gen_cls is not None or generator.mode() == "fairseq":
        return seq_gen_cls
    if getattr(args, "score_reference", False) or getattr(args, "print_alignment", False):
        return seq_gen_cls
    if not models or not all(isinstance(m, LSTransformerModel) for m in models):
        return seq_gen_cls
    return generator.LSSequenceGenerator


def _patch_build_generator():
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

    _wrap(FairseqTask, "build_generator", make)


# ---- 6. EpochBatchIterator.ordered_batches ------------------------------------------------

def remainder_of_groups(batches, shards: int, shard_id: int):
    """What fairseq's grouped shuffling leaves out for ``shard_id``: the batches after the last
    full group of ``shards``, one per rank in frozen order (``[]``, fairseq's dummy batch, for
    the ranks past them); ``None`` when every batch is in a group."""
    left = len(batches) % shards
    if left == 0:
        return None
    tail = list(batches)[len(batches) - left:]
    return tail[shard_id] if shard_id < left else []


def batches_fixed_to_gpus(batches, shards: int, shard_id: int, seed: int, costs=None,
                          window: int = 0):
    """``shard_id``'s batches of an epoch as fairseq orders them under ``--fix-batches-to-gpus``
    (its prefetching path): every ``shards``-th batch from ``shard_id`` on, ``[]`` (fairseq's
    dummy batch) where the shard comes up short, shuffled under ``numpy_seed(seed + shard_id)``
    (``seed``: the epoch's). With ``costs`` (one per batch) and ``window`` > 1, the shards'
    orders are then matched by cost (:func:`match_costs`, ``--ls-cost-matching-window``)."""
    mine = _shuffled_share(len(batches), shards, shard_id, seed)
    if costs is not None and window > 1 and shard_id > 0:
        mine = match_costs(_shuffled_share(len(batches), shards, 0, seed), mine, costs, window)
    return [[] if i is None else batches[i] for i in mine]


def _shuffled_share(n_batches: int, shards: int, shard_id: int, seed: int):
    """Indices of ``shard_id``'s batches (None: a dummy), shuffled as fairseq does."""
    import numpy as np
    from fairseq.data import data_utils
    from fairseq.data.iterators import ShardedIterator

    mine = list(ShardedIterator(range(n_batches), shards, shard_id, fill_value=None))
    with data_utils.numpy_seed(seed + shard_id):
        np.random.shuffle(mine)  # the same permutation fairseq draws for a list of this length
    return mine


def match_costs(lead, mine, costs, window: int):
    """``mine`` (a shard's batch indices; None: a dummy, costing the mean) reordered within each
    run of ``window`` steps so that its k-th costliest batch of the run meets the k-th costliest
    of ``lead`` (shard 0's, which keeps its order). A run's batches stay the random pick of the
    shuffle; an update's batches then cost alike, so its GPUs wait less for the slowest one."""
    mean = sum(costs) / max(len(costs), 1)

    def cost(b):
        return mean if b is None else costs[b]

    out = [None] * len(mine)
    for start in range(0, len(mine), window):
        steps = sorted(range(start, min(start + window, len(mine))), key=lambda i: cost(lead[i]))
        for i, b in zip(steps, sorted(mine[start:start + window], key=cost)):
            out[i] = b
    return out


def batch_costs(dataset, batches):
    """Each batch's token slots, the cost its GPU pays: sentences × (longest source + longest
    target) where the dataset has source and target sizes (a language pair), else sentences ×
    its longest ``num_tokens``."""
    import numpy as np

    from .graphs.shape_buckets import token_slots

    sizes = getattr(dataset, "sizes", None)
    sizes = None if sizes is None else np.asarray(sizes)
    if sizes is not None and sizes.ndim == 2 and sizes.shape[1] == 2:
        return [float(token_slots((len(b), *sizes[np.asarray(b)].max(axis=0)))) if len(b)
                else 0.0 for b in batches]
    return [float(len(b) * max(dataset.num_tokens(int(i)) for i in b)) if len(b) else 0.0
            for b in batches]


def _frozen_batch_costs(itr):
    """``batch_costs`` of ``itr``'s frozen batches, computed once per iterator (they never
    change)."""
    if getattr(itr, "_ls_batch_costs", None) is None:
        itr._ls_batch_costs = batch_costs(itr.dataset, itr.frozen_batches)
    return itr._ls_batch_costs


def _patch_ordered_batches():
    from fairseq.data.iterators import EpochBatchIterator

    def make(original):
        @functools.wraps(original)
        def ordered_batches(self, epoch, fix_batches_to_gpus, shuffle):
            if getattr(self, "ls_fix_batches_to_gpus", False) and shuffle \
                    and not self._supports_prefetch:  # patch 7
                window = getattr(self, "ls_cost_matching_window", 0)
                return batches_fixed_to_gpus(self.frozen_batches, self.num_shards,
                                             self.shard_id, self.seed + epoch,
                                             _frozen_batch_costs(self) if window > 1 else None,
                                             window)
            batches = original(self, epoch, fix_batches_to_gpus, shuffle)
            if not (getattr(self, "grouped_shuffling", False) and shuffle
                    and not fix_batches_to_gpus and not self._supports_prefetch):
                return batches
            extra = remainder_of_groups(self.frozen_batches, self.num_shards, self.shard_id)
            return batches if extra is None else list(batches) + [extra]
        return ordered_batches

    _wrap(EpochBatchIterator, "ordered_batches", make)


# ---- 7. Trainer.get_train_iterator ----------------------------------------------------------

def fixes_batches(trainer) -> bool:
    """Whether patch 7 applies to ``trainer``'s run (see the module docstring)."""
    return not trainer.cfg.dataset.grouped_shuffling and switches.data_parallel_switch(
        trainer, "ls_fix_batches_to_gpus", "--ls-fix-batches-to-gpus", logger)


def fixed_batches_train_iterator(original):
    """Patch 7's wrapper of ``Trainer.get_train_iterator`` (``original``: fairseq's method)."""
    @functools.wraps(original)
    def get_train_iterator(self, *args, **kwargs):
        itr = original(self, *args, **kwargs)
        window = getattr(getattr(self, "_criterion", None), "ls_cost_matching_window", 0)
        fixed = fixes_batches(self)
        if fixed and getattr(itr, "_supports_prefetch", False):
            # fairseq's own --fix-batches-to-gpus path, which patch 6 leaves to fairseq
            criterion = self._criterion
            switches.refuse_or_step_aside(
                criterion.ls_fix_batches_to_gpus, "--ls-fix-batches-to-gpus",
                "the dataset prefetches, and fairseq keeps its own order for such datasets "
                "(its --fix-batches-to-gpus gives this order)", logger)
            criterion.ls_fix_batches_to_gpus, fixed = switches.OFF, False  # for the run
        if window > 1 and not fixed:  # the criterion's check_run refused the other cases
            raise switches.refusal("--ls-cost-matching-window", "it orders the batches fixed "
                                   "to GPUs, which this run does not use")
        if fixed:
            itr.ls_fix_batches_to_gpus = True  # read by each epoch's ordered_batches
            itr.ls_cost_matching_window = window
        if getattr(self, "_ls_fixed_logged", False):
            return itr
        self._ls_fixed_logged = True
        if fixed:
            workers = self.data_parallel_world_size
            logger.info(
                f"batches fixed to GPUs: each of the {workers} GPUs keeps its share of the "
                f"batches (one in {workers}) and shuffles it itself each epoch (fairseq's "
                f"--fix-batches-to-gpus order); --ls-no-fix-batches-to-gpus for fairseq's order"
                + (f"; an update's batches matched by cost in runs of {window} updates "
                   f"(--ls-cost-matching-window)" if window > 1 else ""))
        return itr
    return get_train_iterator


def _patch_train_iterator():
    from fairseq.trainer import Trainer

    _wrap(Trainer, "get_train_iterator", fixed_batches_train_iterator)


# ---- 8. Trainer.clip_grad_norm ----------------------------------------------------------------

def take_back_skipped_updates(trainer) -> int:
    """Takes the updates the trainer counted but the optimizer skipped (a deferred fp16
    overflow) back from ``trainer``'s update count; the learning rate follows. Returns how many."""
    take = getattr(getattr(trainer, "_optimizer", None), "take_skipped_updates", None)
    skipped = take() if take is not None else 0
    if skipped:
        trainer.set_num_updates(trainer.get_num_updates() - skipped)
    return skipped


def _patch_clip_grad_norm():
    from fairseq.trainer import Trainer

    def make(original):
        @functools.wraps(original)
        def clip_grad_norm(self, clip_norm):
            norm = original(self, clip_norm)
            take_back_skipped_updates(self)
            return norm
        return clip_grad_norm

    _wrap(Trainer, "clip_grad_norm", make)


# ---- 9. Trainer.__init__ ----------------------------------------------------------------------

def run_facts(trainer) -> switches.RunFacts:
    """What ``trainer``'s run is, for the checks before training."""
    import torch.distributed as dist

    workers = trainer.data_parallel_world_size
    processes = dist.get_world_size() if dist.is_available() and dist.is_initialized() \
        else workers
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
    from .criterions.ls_label_smoothed_cross_entropy import (
        LSLabelSmoothedCrossEntropyCriterion,
    )
    from .optim import ls_adam

    run = run_facts(trainer)
    reason = fp16_device_conflict(trainer.cfg, run)
    if reason is not None:
        raise switches.Refused(reason)
    criterion = getattr(trainer, "_criterion", None)
    if isinstance(criterion, LSLabelSmoothedCrossEntropyCriterion):
        criterion.check_run(trainer.cfg, run, getattr(trainer, "_model", None))
    ls_adam.check_run(trainer.cfg, run)


def checked_trainer_init(original):
    """Patch 9's wrapper of ``Trainer.__init__`` (``original``: fairseq's)."""
    @functools.wraps(original)
    def __init__(self, cfg, task, model, criterion, *args, **kwargs):
        original(self, cfg, task, model, criterion, *args, **kwargs)
        check_run(self)
    return __init__


def _patch_trainer_init():
    from fairseq.trainer import Trainer

    _wrap(Trainer, "__init__", checked_trainer_init)


# ---- 10. distributed_utils.call_main ----------------------------------------------------------

_REFUSED_IN_TRACEBACK = re.compile(r"^ls_fairseq\.switches\.Refused: (.+)$", re.M)


def refusal_line(message: str) -> str:
    """The line fairseq-train prints for a refusal."""
    return message if message.startswith("ls_fairseq: ") else f"ls_fairseq: {message}"


def exit_refused(message: str):
    sys.stdout.flush()
    sys.stderr.write(refusal_line(message) + "\n")
    sys.stderr.flush()
    raise SystemExit(2)


def refusal_of_worker(exc):
    """The refusal a spawned worker raised, from the traceback it sent (None: another error)."""
    found = _REFUSED_IN_TRACEBACK.findall(str(exc))
    return found[-1] if found else None


def _patch_call_main():
    from fairseq.distributed import utils as distributed_utils

    def make(original):
        @functools.wraps(original)
        def call_main(cfg, main, **kwargs):
            try:
                return original(cfg, main, **kwargs)
            except switches.Refused as exc:
                exit_refused(str(exc))
            except torch.multiprocessing.ProcessRaisedException as exc:
                message = refusal_of_worker(exc)
                if message is None:
                    raise
                exit_refused(message)
        return call_main

    _wrap(distributed_utils, "call_main", make)


# ---- 11. options.add_model_args ---------------------------------------------------------------

_BAD_ARCH = re.compile(r"^argument --arch(?:/-a)?: invalid choice: '([^']*)'")


def arch_hint(message: str):
    """The line printed after fairseq's error for an unknown ``--arch`` (None for any other
    error): the nearest registered names, and the ls_ architectures."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    from .models.ls_transformer import ARCHITECTURES

    found = _BAD_ARCH.match(message)
    if not found:
        return None
    given = found.group(1)
    # an ls_ name with a typo: the nearest ls_ names; anything else: the nearest of all
    names = list(ARCHITECTURES) if given.startswith("ls") else list(ARCH_MODEL_REGISTRY)
    near = difflib.get_close_matches(given, names, n=3, cutoff=0.6)
    nearest = f"; the nearest: {', '.join(near)}" if near else ""
    return (f"ls_fairseq: --arch {given!r} is not an architecture{nearest} (the ls_ "
            f"architectures: {', '.join(ARCHITECTURES)})")


def _with_arch_hint(parser):
    """``parser.error`` also prints :func:`arch_hint`'s line, after argparse's message."""
    if getattr(parser, "_ls_arch_hint", False):
        return
    parser._ls_arch_hint = True
    error = parser.error

    def error_with_hint(message):
        hint = arch_hint(message)
        try:
            error(message)
        finally:
            if hint is not None:
                sys.stderr.write(hint + "\n")

    parser.error = error_with_hint


def _patch_arch_hint():
    from fairseq import options

    def make(original):
        @functools.wraps(original)
        def add_model_args(parser):
            group = original(parser)
            _with_arch_hint(parser)
            return group
        return add_model_args

    _wrap(options, "add_model_args", make)
