"""Every change ls_fairseq makes to fairseq's classes (ls_fairseq/fairseq_patches/), in one
file: the table installs each patch once, uninstalls it back to fairseq's own attributes and
installs it again, and refuses a fairseq it was not written for in one line; each patch reaches
fairseq's own method for runs it does not concern, and does what its docstring says. Patch 4
(resuming an unconverted checkpoint) is also run end to end in tests/test_bad_input.py, patch 3
with two gloo workers in tests/test_distributed_stats.py, patches 6 and 7 (and patch 12's
broadcast of a checkpoint) with gloo workers in tests/test_end_to_end.py."""
from types import SimpleNamespace

import numpy as np

import pytest
import torch
from fairseq.optim.fp16_optimizer import FP16Optimizer
from fairseq.trainer import Trainer

from fairseq import options
from fairseq.distributed import utils as distributed_utils

from fairseq_helpers import IndexDataset, fp16_optimizer_cfg
from ls_fairseq import fairseq_patches, switches, training_config
from ls_fairseq.fairseq_patches import _fairseq_version, _patching, p09_trainer_init
from ls_fairseq.optim.ls_adam import LSFusedFP16Optimizer

PATCHED = [(Trainer, "_build_optimizer"), (Trainer, "train_step"),
           (Trainer, "_aggregate_logging_outputs"),
           (Trainer, "_check_grad_norms"), (Trainer, "load_checkpoint"),
           (Trainer, "get_train_iterator"), (Trainer, "clip_grad_norm"), (Trainer, "__init__"),
           (distributed_utils, "call_main"), (options, "add_model_args")]


def test_installed_once_and_fairseqs_methods_stay_reachable():
    fairseq_patches.install()
    first = [getattr(c, n) for c, n in PATCHED] + [FP16Optimizer.build_optimizer.__func__]
    fairseq_patches.install()
    assert [getattr(c, n) for c, n in PATCHED] + [FP16Optimizer.build_optimizer.__func__] == first
    for owner, name in PATCHED:
        module = getattr(owner, "__module__", None) or owner.__name__
        if owner is Trainer:
            module = "fairseq.trainer"
        assert getattr(owner, name).__wrapped__.__module__ == module, name


# ---- the table: install, uninstall, reinstall; the fairseq versions it is written for ----------

def _fairseq_targets():
    from fairseq.data.iterators import EpochBatchIterator
    from fairseq.tasks.fairseq_task import FairseqTask

    from fairseq import checkpoint_utils

    return PATCHED + [(FP16Optimizer, "build_optimizer"), (FairseqTask, "build_generator"),
                      (EpochBatchIterator, "ordered_batches"),
                      (checkpoint_utils, "load_checkpoint_to_cpu"),
                      (checkpoint_utils, "load_ema_from_checkpoint"),
                      (distributed_utils, "_broadcast_object_slow")]


def test_the_table_lists_every_patch_once_and_every_target():
    """PATCHES holds each p<NN>_*.py module once, numbered 1..N in order, and their targets are
    every fairseq attribute the plugin replaces, each once."""
    import os

    folder = os.path.dirname(fairseq_patches.__file__)
    files = sorted(f[:-3] for f in os.listdir(folder) if f[0] == "p" and f.endswith(".py"))
    names = [patch.__name__.rsplit(".", 1)[1] for patch in fairseq_patches.PATCHES]
    assert names == files
    assert [patch.NUMBER for patch in fairseq_patches.PATCHES] == \
        list(range(1, len(files) + 1))
    assert all(name.startswith(f"p{n:02d}_") for n, name in zip(range(1, 99), names))
    found = [(owner, name) for _, owner, name, _ in fairseq_patches.targets()]
    assert len(found) == len(set(found))
    assert set(found) == set(_fairseq_targets())


def test_uninstall_restores_fairseqs_own_attributes_and_install_applies_them_again():
    """uninstall() puts back the very objects fairseq defines (``is``), install() wraps them
    again, around the same originals; installing twice changes nothing."""
    targets = _fairseq_targets()
    fairseq_patches.install()
    try:
        fairseq_patches.uninstall()
        theirs = {(o, n): vars(o)[n] for o, n in targets}
        assert not any(fairseq_patches.installed().values())
        for (owner, name), attr in theirs.items():
            function = getattr(attr, "__func__", attr)
            assert function.__module__.startswith("fairseq."), (owner, name)
            assert not hasattr(function, _patching.ORIGINAL)
        fairseq_patches.uninstall()  # nothing installed: a no-op
        assert {(o, n): vars(o)[n] for o, n in targets} == theirs
        for attempt in range(2):
            fairseq_patches.install()
            ours = {(o, n): vars(o)[n] for o, n in targets}
            assert all(fairseq_patches.installed().values())
            for key, attr in ours.items():
                assert attr is not theirs[key], key
                assert _patching.original(*key) is theirs[key], key
            fairseq_patches.install()  # twice: a no-op
            assert all(vars(o)[n] is ours[o, n] for o, n in targets)
            fairseq_patches.uninstall()
            for (owner, name), attr in theirs.items():
                assert vars(owner)[name] is attr, (owner, name, attr)
    finally:
        fairseq_patches.install()  # the rest of the session runs with the plugin loaded
    # installed again, fairseq's own method is what the patches run for other runs
    assert Trainer.train_step.__wrapped__ is theirs[Trainer, "train_step"]
    assert FP16Optimizer.build_optimizer.__func__.__wrapped__ is \
        theirs[FP16Optimizer, "build_optimizer"].__func__


@pytest.mark.parametrize("version,ok", [
    ("0.12.2", True), ("0.12.3", True), ("0.12.3.1", True), ("0.12.3.2", True),
    ("0.12.2+4f1a2b3", True), ("0.10.2", False), ("0.12.1", False), ("0.13.0", False),
    ("0.12.30", False), ("1.0.0a0", False),
])
def test_supported_fairseq_versions(version, ok):
    assert _fairseq_version.supported(version) is ok


def test_an_unsupported_fairseq_is_refused_in_one_line(monkeypatch):
    import os

    import fairseq

    want = ("fairseq 0.10.2 is installed, and the plugin's patches to fairseq are written for "
            "fairseq 0.12.2 and fairseq-fixed 0.12.3.x: install one of them (pip install "
            "--no-build-isolation fairseq-fixed==0.12.3.1), or set LS_FAIRSEQ_ANY_FAIRSEQ=1 to "
            "try fairseq 0.10.2 anyway")
    monkeypatch.delenv("LS_FAIRSEQ_ANY_FAIRSEQ", raising=False)
    monkeypatch.setattr(fairseq, "__version__", "0.10.2")
    fairseq_patches.uninstall()
    try:
        with pytest.raises(fairseq_patches.UnsupportedFairseq) as info:
            fairseq_patches.install()
        assert str(info.value) == want
        docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                            "TROUBLESHOOTING.md")
        with open(docs, encoding="utf-8") as f:
            assert f"`ls_fairseq: {want}`" in f.read()  # the message the docs explain
        assert not any(fairseq_patches.installed().values())  # nothing half-installed
        monkeypatch.setenv("LS_FAIRSEQ_ANY_FAIRSEQ", "1")
        fairseq_patches.install()
        assert all(fairseq_patches.installed().values())
    finally:
        monkeypatch.undo()
        fairseq_patches.install()


def test_loading_the_plugin_on_an_unsupported_fairseq_prints_one_line(tmp_path):
    """What fairseq-train's ``--user-dir`` import does, in a fresh process: one line on stderr,
    exit status 2, no traceback; LS_FAIRSEQ_ANY_FAIRSEQ=1 loads the plugin with a warning."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "import fairseq; fairseq.__version__ = '0.10.2'; import ls_fairseq; print('loaded')"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LS_FAIRSEQ_")}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "tensorboardX" not in line]
    assert lines == ["ls_fairseq: fairseq 0.10.2 is installed, and the plugin's patches to "
                     "fairseq are written for fairseq 0.12.2 and fairseq-fixed 0.12.3.x: "
                     "install one of them (pip install --no-build-isolation "
                     "fairseq-fixed==0.12.3.1), or set LS_FAIRSEQ_ANY_FAIRSEQ=1 to try "
                     "fairseq 0.10.2 anyway"]
    assert "loaded" not in proc.stdout
    proc = subprocess.run([sys.executable, "-c", code], env={**env, "LS_FAIRSEQ_ANY_FAIRSEQ": "1"},
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "loaded", proc.stderr


@pytest.mark.parametrize("optimizer,extra,want", [
    ("adam", [], FP16Optimizer),
    ("ls_adam", [], LSFusedFP16Optimizer),
    ("ls_adam", ["--ls-no-fused-fp16-copy"], FP16Optimizer),
])
def test_fp16_optimizer_class(optimizer, extra, want):
    params = [torch.nn.Parameter(torch.randn(5).half())]
    # per-tensor fp32 masters: fairseq's flat master is built on the GPU
    cfg = fp16_optimizer_cfg(optimizer, ["--fp16-no-flatten-grads", *extra])
    opt = FP16Optimizer.build_optimizer(cfg, params)
    assert type(opt) is want


def test_distributed_stats_wrappers_run_fairseqs_methods_for_other_trainers(monkeypatch):
    """A trainer without a config (built without patch 9) gets fairseq's own methods,
    unchanged."""
    from ls_fairseq.distributed import async_stats as distributed_stats

    calls = []
    trainer = SimpleNamespace(_criterion=SimpleNamespace())
    out = distributed_stats.aggregate_logging_outputs(
        trainer, lambda t, logs, *extra, ignore=False: calls.append(("agg", logs, extra, ignore))
        or "fairseq", [{"loss": 1}], 3, ignore=True)
    assert out == "fairseq" and calls == [("agg", [{"loss": 1}], (3,), True)]
    out = distributed_stats.check_grad_norms(trainer, lambda t, g: calls.append(("check", g))
                                             or "checked", 2.0)
    assert out == "checked" and calls[-1] == ("check", 2.0)


# ---- patch 2: honest interval wps ----------------------------------------------------------

class _Trainer:
    def __init__(self, num_updates, defers, device="cuda", log_interval=10):
        self.cfg = SimpleNamespace(common=SimpleNamespace(log_interval=log_interval))
        training_config.attach(self, training_config.TrainingConfig()).run.host_reads_deferred = \
            defers
        self.device = torch.device(device)
        self._n = num_updates

    def get_num_updates(self):
        return self._n


@pytest.mark.parametrize("num_updates,defers,device,log_output,waits", [
    (20, True, "cuda", {}, True),     # a logged update of a deferred run on the GPU
    (21, True, "cuda", {}, False),    # not logged
    (20, False, "cuda", {}, False),   # the update read its grad norm back already
    (20, True, "cpu", {}, False),     # nothing queued on a CPU
    (20, True, "cuda", None, False),  # no update (OOM, overflow): fairseq-train does not log
])
def test_waits_for_the_gpu_only_before_a_logged_interval_of_a_deferred_run(
        monkeypatch, num_updates, defers, device, log_output, waits):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    trainer = _Trainer(num_updates, defers, device)
    assert fairseq_patches.wait_before_log(trainer, log_output) is waits
    assert len(calls) == int(waits)


def _epoch(n_batches, shards, epoch, original=False, **kwargs):
    """Each rank's batch indices (None: fairseq's dummy batch) of one epoch, through the patched
    ``ordered_batches`` or (``original``) fairseq's own."""
    from fairseq.data import iterators

    fairseq_patches.install()
    method = iterators.EpochBatchIterator.ordered_batches
    method = method.__wrapped__ if original else method
    batches = [np.array([i], dtype=np.int64) for i in range(n_batches)]
    out = []
    for rank in range(shards):
        itr = iterators.EpochBatchIterator(IndexDataset(), collate_fn=lambda x: x,
                                           batch_sampler=batches, seed=5, num_shards=shards,
                                           shard_id=rank, **kwargs)
        out.append([None if len(b) == 0 else int(b[0])
                    for b in method(itr, epoch, False, True)])
    return out


@pytest.mark.parametrize("n_batches", [1, 3, 8, 13, 31])
@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_grouped_shuffling_keeps_the_batches_fairseq_drops(n_batches, shards):
    """Patch 6: with --grouped-shuffling every batch of the epoch is dealt once: fairseq's order
    for its full groups, then the batches after them one per rank (a dummy for the others), so
    every rank takes as many steps as ``len(iterator)`` says. Without grouping: fairseq's own
    order, unchanged."""
    from fairseq.data import iterators

    for epoch in (1, 2):
        ours = _epoch(n_batches, shards, epoch, grouped_shuffling=True)
        theirs = _epoch(n_batches, shards, epoch, original=True, grouped_shuffling=True)
        full = n_batches // shards
        assert [shard[:full] for shard in ours] == [shard[:full] for shard in theirs]
        dealt = [b for shard in ours for b in shard if b is not None]
        assert sorted(dealt) == list(range(n_batches))
        steps = len(iterators.EpochBatchIterator(IndexDataset(), lambda x: x, [[0]] * n_batches,
                                                 num_shards=shards))
        assert all(len(shard) == steps for shard in ours)
        if n_batches % shards:  # fairseq itself drops them
            assert sorted(b for shard in theirs for b in shard if b is not None) == \
                list(range(full * shards))
        plain = _epoch(n_batches, shards, epoch)
        assert plain == _epoch(n_batches, shards, epoch, original=True)


# ---- patch 7: batches fixed to GPUs on several GPUs -----------------------------------------
def _trainer(mode, workers, grouped_by_user=False, window=0):
    """A trainer as patch 7 sees it; ``mode``: its config's ``ls_fix_batches_to_gpus`` (None:
    another criterion, whose config has the switch off)."""
    trainer = SimpleNamespace(_criterion=SimpleNamespace(), data_parallel_world_size=workers,
                              cfg=SimpleNamespace(dataset=SimpleNamespace(
                                  grouped_shuffling=grouped_by_user)))
    config = training_config.TrainingConfig() if mode is None else training_config.TrainingConfig(
        ls_criterion=True, ls_fix_batches_to_gpus=mode, ls_cost_matching_window=window)
    training_config.attach(trainer, config)
    return trainer


@pytest.mark.parametrize("mode,workers,grouped,applies", [
    ("auto", 2, False, True), ("on", 4, False, True), ("auto", 3, False, True),
    ("off", 2, False, False),  # --ls-no-fix-batches-to-gpus
    ("auto", 1, False, False), ("on", 1, False, False),  # one GPU
    ("auto", 2, True, False),  # the user's own --grouped-shuffling: fairseq's, as given
    (None, 2, False, False),  # a criterion that is not ls_'s
])
def test_train_iterator_fixes_batches_of_ls_runs_on_several_workers(
        mode, workers, grouped, applies, caplog):
    """Patch 7: the wrapper marks the iterator of ls_ runs on several workers, says so once per
    trainer, and returns fairseq's iterator untouched for every other run."""
    from fairseq.data import iterators

    trainer = _trainer(mode, workers, grouped)
    made = []

    def fairseqs(self, epoch, **kwargs):  # stands for fairseq's get_train_iterator
        made.append(iterators.EpochBatchIterator(
            IndexDataset(), lambda x: x, [[0]] * 6, num_shards=workers,
            grouped_shuffling=self.cfg.dataset.grouped_shuffling))
        return made[-1]

    wrapped = fairseq_patches.fixed_batches_train_iterator(fairseqs)
    with caplog.at_level("INFO", logger="ls_fairseq.fairseq_patches"):
        for epoch in (1, 2, 3):
            itr = wrapped(trainer, epoch, load_dataset=False)
            assert itr is made[-1]
            assert (fairseq_patches.fixed_order(itr) is not None) == applies
            assert itr.grouped_shuffling == grouped  # never set by the patch
    lines = [r.message for r in caplog.records if "batches fixed to GPUs" in r.message]
    assert len(lines) == (1 if applies else 0), lines


def test_fixed_batches_refused_or_stepped_aside_under_model_parallelism(monkeypatch, caplog):
    """Fewer data-parallel workers than processes (model parallelism): --ls-fix-batches-to-gpus
    is refused with the reason, the default steps aside with one line."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    with pytest.raises(ValueError, match="--ls-fix-batches-to-gpus: it needs plain data"):
        fairseq_patches.fixes_batches(_trainer("on", 2))
    trainer = _trainer("auto", 2)
    with caplog.at_level("INFO", logger="ls_fairseq.fairseq_patches"):
        assert not fairseq_patches.fixes_batches(trainer)
        assert not fairseq_patches.fixes_batches(trainer)  # the next epoch's iterator
    said = [r for r in caplog.records
            if "ls-fix-batches-to-gpus is off for this run" in r.message]
    assert len(said) == 1


@pytest.mark.parametrize("n_batches", [1, 5, 14, 31])
@pytest.mark.parametrize("shards", [2, 3, 4])
def test_fixed_batches_order_as_fairseqs_fix_batches_to_gpus(n_batches, shards):
    """Patch 7's order is fairseq's own under --fix-batches-to-gpus, taken from fairseq's
    prefetching path (the only one where fairseq honours the flag): each rank keeps batches
    r, r + N, ... every epoch, in an order of its own that changes with the epoch; every batch
    is dealt once, and every rank takes as many steps as ``len(iterator)`` says."""
    from fairseq.data import iterators

    fairseq_patches.install()
    batches = [np.array([i], dtype=np.int64) for i in range(n_batches)]

    class Prefetching(IndexDataset):
        supports_prefetch = True

        def prefetch(self, indices):
            pass

    orders = {}
    for rank in range(shards):
        marked = iterators.EpochBatchIterator(IndexDataset(), lambda x: x, batches, seed=5,
                                              num_shards=shards, shard_id=rank)
        fairseq_patches.fix_batches(marked)
        fairseqs = iterators.EpochBatchIterator(Prefetching(), lambda x: x, batches, seed=5,
                                                num_shards=shards, shard_id=rank)
        for epoch in (1, 2, 3):
            order = [list(b) for b in marked.ordered_batches(epoch, False, True)]
            assert order == [list(b) for b in fairseqs.ordered_batches(epoch, True, True)]
            # the user's own --fix-batches-to-gpus: the same order
            assert order == [list(b) for b in marked.ordered_batches(epoch, True, True)]
            assert len(order) == len(marked)
            orders[rank, epoch] = [b[0] if b else None for b in order]
            assert sorted(b for b in orders[rank, epoch] if b is not None) == \
                list(range(rank, n_batches, shards))
    dealt = sorted(b for (r, e), o in orders.items() if e == 1 for b in o if b is not None)
    assert dealt == list(range(n_batches))
    if n_batches >= 14:  # long enough that two shuffles differ
        assert orders[0, 1] != orders[0, 2]
        assert [b - 1 for b in orders[1, 1] if b is not None] != \
            [b for b in orders[0, 1] if b is not None][:len(orders[1, 1])]  # not one shuffle


def _pair_dataset(n_sentences, seed=0):
    """fairseq's LanguagePairDataset over random lengths (only its sizes are read)."""
    from fairseq.data import Dictionary, LanguagePairDataset

    rng = np.random.default_rng(seed)
    src, tgt = rng.integers(1, 60, n_sentences), rng.integers(1, 60, n_sentences)
    items = [torch.zeros(int(n), dtype=torch.long) for n in src]
    targets = [torch.zeros(int(n), dtype=torch.long) for n in tgt]
    return LanguagePairDataset(items, src, Dictionary(), targets, tgt, Dictionary()), src, tgt


def test_batch_costs_are_token_slots():
    """A batch's cost: sentences × (longest source + longest target) of a language pair; a
    dataset of one size per item: sentences × its longest num_tokens; an empty batch 0."""
    dataset, src, tgt = _pair_dataset(20)
    batches = [np.array([0, 3, 7]), np.array([5]), np.array([], dtype=np.int64)]
    assert fairseq_patches.batch_costs(dataset, batches) == [
        3 * (max(src[[0, 3, 7]]) + max(tgt[[0, 3, 7]])), src[5] + tgt[5], 0.0]

    class OneSize(IndexDataset):
        sizes = np.arange(20)

        def num_tokens(self, i):
            return 2 * i

    assert fairseq_patches.batch_costs(OneSize(), batches[:2]) == [3 * 14, 10]


@pytest.mark.parametrize("shards,window", [(2, 4), (3, 5), (4, 16), (4, 3)])
def test_cost_matching_pairs_the_kth_costliest_of_each_window(shards, window):
    """--ls-cost-matching-window: GPU 0 keeps the order of batches fixed to GPUs; every other
    GPU keeps the batches of each run of ``window`` updates and orders them so that its k-th
    costliest meets GPU 0's k-th costliest (a dummy costs the mean); every batch is dealt once
    an epoch, the order changes with the epoch, and a window of 1 is no matching."""
    from fairseq.data import data_utils, iterators

    fairseq_patches.install()
    dataset, src, tgt = _pair_dataset(700, seed=shards)
    order = np.lexsort((tgt, src))
    batches = data_utils.batch_by_size(order, lambda i: max(src[i], tgt[i]), max_tokens=300)
    costs = fairseq_patches.batch_costs(dataset, batches)
    mean = sum(costs) / len(costs)

    index = {id(b): i for i, b in enumerate(batches)}

    def cost(b):
        return mean if not len(b) else costs[index[id(b)]]

    def key(b):  # a batch's identity (-1: a dummy, a new [] each epoch)
        return id(b) if len(b) else -1

    def epoch(w, rank, e):
        itr = iterators.EpochBatchIterator(dataset, lambda x: x, batches, seed=3,
                                           num_shards=shards, shard_id=rank)
        fairseq_patches.fix_batches(itr, w)
        return itr.ordered_batches(e, False, True)

    for e in (1, 2):
        plain = [epoch(0, r, e) for r in range(shards)]
        assert [epoch(1, r, e) for r in range(shards)] == plain
        matched = [epoch(window, r, e) for r in range(shards)]
        assert matched[0] == plain[0]
        assert sorted(id(b) for m in matched for b in m if len(b)) == \
            sorted(id(b) for b in batches)
        lead = [cost(b) for b in matched[0]]
        for mine, theirs in zip(matched[1:], plain[1:]):
            assert len(mine) == len(theirs)
            for start in range(0, len(mine), window):
                run = slice(start, start + window)
                assert sorted(map(key, mine[run])) == sorted(map(key, theirs[run]))
                steps = sorted(range(len(lead[run])), key=lambda i: lead[run][i])
                assert [cost(mine[run][i]) for i in steps] == sorted(map(cost, mine[run]))
            assert list(map(key, mine)) != list(map(key, theirs))  # the matching moved batches
    assert list(map(key, epoch(window, 1, 1))) != list(map(key, epoch(window, 1, 2)))


@pytest.mark.parametrize("workers,window,fixed_line", [(2, 16, True), (2, 0, False), (1, 1, False)])
def test_train_iterator_passes_the_cost_matching_window(workers, window, fixed_line, caplog):
    """Patch 7's wrapper hands --ls-cost-matching-window to the iterator of batches fixed to
    GPUs and says so in its line."""
    from fairseq.data import iterators

    trainer = _trainer("auto", workers, window=window)

    def fairseqs(self, epoch, **kwargs):
        return iterators.EpochBatchIterator(IndexDataset(), lambda x: x, [[0]] * 6,
                                            num_shards=workers)

    wrapped = fairseq_patches.fixed_batches_train_iterator(fairseqs)
    with caplog.at_level("INFO", logger="ls_fairseq.fairseq_patches"):
        for epoch in (1, 2):
            order = fairseq_patches.fixed_order(wrapped(trainer, epoch, load_dataset=False))
            assert (order and order.window) == (window if workers > 1 else None)
    said = [r.message for r in caplog.records]
    assert sum("matched by cost in runs of 16 updates" in m for m in said) == fixed_line


def test_cost_matching_window_without_fixed_batches_is_refused():
    """A window > 1 where batches are not fixed to GPUs cannot apply: the criterion's check
    refuses it before training (tests/test_fast_defaults.py); the iterator wrapper refuses what
    that check cannot know (here: one worker, as a backstop)."""
    from fairseq.data import iterators

    trainer = _trainer("auto", 1, window=16)
    wrapped = fairseq_patches.fixed_batches_train_iterator(
        lambda self, epoch, **kw: iterators.EpochBatchIterator(IndexDataset(), lambda x: x,
                                                               [[0]] * 6))
    with pytest.raises(switches.Refused, match="^--ls-cost-matching-window: it orders the "
                                               "batches fixed to GPUs, which this run does not "
                                               "use; drop --ls-cost-matching-window"):
        wrapped(trainer, 1, load_dataset=False)


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_prefetching_datasets_keep_fairseqs_order(mode, monkeypatch, caplog):
    """fairseq honours --fix-batches-to-gpus itself for prefetching datasets, and patch 6 leaves
    their order to fairseq: batches fixed to GPUs step aside with their one line, or are
    refused when required."""
    import torch.distributed as dist
    from fairseq.data import iterators

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def fairseqs(self, epoch, **kwargs):
        itr = iterators.EpochBatchIterator(IndexDataset(), lambda x: x, [[0]] * 6, num_shards=2)
        itr._supports_prefetch = True
        return itr

    wrapped = fairseq_patches.fixed_batches_train_iterator(fairseqs)
    trainer = _trainer(mode, 2)
    if mode == "on":
        with pytest.raises(switches.Refused, match="^--ls-fix-batches-to-gpus: the dataset "
                                                   "prefetches"):
            wrapped(trainer, 1, load_dataset=False)
        return
    with caplog.at_level("INFO", logger="ls_fairseq.fairseq_patches"):
        for epoch in (1, 2):
            assert fairseq_patches.fixed_order(wrapped(trainer, epoch, load_dataset=False)) \
                is None
    # stepped aside for the run: recorded on the run's config, the flags' mode kept
    config = training_config.of(trainer)
    assert config.mode("ls_fix_batches_to_gpus") == switches.OFF
    assert config.ls_fix_batches_to_gpus == mode and \
        list(config.run.stepped_aside) == ["ls_fix_batches_to_gpus"]
    assert vars(trainer._criterion) == {}
    said = [r.message for r in caplog.records if "is off for this run" in r.message]
    assert said == ["ls-fix-batches-to-gpus is off for this run: the dataset prefetches, and "
                    "fairseq keeps its own order for such datasets (its --fix-batches-to-gpus "
                    "gives this order)"]


# ---- patch 9: Trainer.__init__ checks the run ---------------------------------------------

def _facts(cuda, workers=1, processes=None):
    return switches.RunFacts(cuda=cuda, workers=workers, processes=processes or workers)


def _common(**kw):
    base = dict(fp16=False, bf16=False, tpu=False, amp=False, memory_efficient_fp16=False,
                fp16_no_flatten_grads=False)
    base.update(kw)
    return SimpleNamespace(common=SimpleNamespace(**base),
                           distributed_training=SimpleNamespace(ddp_backend="pytorch_ddp"))


@pytest.mark.parametrize("flags,cuda,refused", [
    (dict(fp16=True), False, True),  # fairseq's FP16Optimizer: flat fp32 master on the GPU
    (dict(fp16=True), True, False),
    (dict(fp16=True, memory_efficient_fp16=True), False, False),  # no flat master: runs on CPU
    (dict(fp16=True, fp16_no_flatten_grads=True), False, False),
    (dict(bf16=True), False, False),
    ({}, False, False),
])
def test_fp16_on_the_cpu_is_refused_where_fairseq_would_fail(flags, cuda, refused):
    reason = fairseq_patches.fp16_device_conflict(_common(**flags), _facts(cuda))
    if not refused:
        assert reason is None
        return
    assert reason == ("--fp16 needs a CUDA GPU (fairseq's FP16Optimizer keeps its fp32 master "
                      "weights on it), and this run trains on the CPU (--cpu, or no CUDA GPU "
                      "visible to torch): on the CPU train with --bf16, or drop --fp16")


def test_trainer_init_runs_the_check(monkeypatch):
    """Patch 9 calls check_run with the built trainer, after fairseq's own __init__ (the checks
    themselves: tests/test_fast_defaults.py; through fairseq-train: tests/test_bad_input.py)."""
    seen = []
    monkeypatch.setattr(p09_trainer_init, "check_run", lambda trainer: seen.append(trainer.cfg))

    def fairseqs(self, cfg, task, model, criterion, quantizer=None):
        self.cfg = cfg

    init = fairseq_patches.checked_trainer_init(fairseqs)
    trainer = SimpleNamespace()
    init(trainer, "cfg", None, None, None)
    assert seen == ["cfg"]
    # then the run's config is read once and kept on the trainer (a cfg of neither the criterion
    # nor ls_adam: every switch off)
    assert training_config.of(trainer) == training_config.TrainingConfig()
    assert Trainer.__init__.__wrapped__.__qualname__ == "Trainer.__init__"


# ---- patch 10: call_main reports a refusal as one line ----------------------------------------

def test_call_main_turns_a_refusal_into_one_line_and_exit_2(capsys):
    def main(cfg, **kwargs):
        raise switches.Refused("--ls-x: why; drop --ls-x to train without it")

    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(
        options.get_training_parser(), ["/nonexistent", "--arch", "transformer", "--cpu",
                                        "--distributed-world-size", "1"]))
    with pytest.raises(SystemExit) as info:
        distributed_utils.call_main(cfg, main)
    assert info.value.code == 2
    assert capsys.readouterr().err == "ls_fairseq: --ls-x: why; drop --ls-x to train without it\n"

    def fails(cfg, **kwargs):
        raise ValueError("not a refusal")

    with pytest.raises(ValueError, match="not a refusal"):  # fairseq's traceback, as before
        distributed_utils.call_main(cfg, fails)


def test_refusal_of_a_spawned_worker_is_read_from_its_traceback():
    """torch.multiprocessing.spawn (fairseq's launcher on several GPUs) sends a worker's
    traceback to the parent: the refusal's line comes from there."""
    trace = ("\n\n-- Process 1 terminated with the following error:\nTraceback (most recent "
             "call last):\n  File \"x.py\", line 1, in <module>\n    main()\n"
             "ls_fairseq.switches.Refused: --ls-x: why; drop --ls-x to train without it\n")
    exc = torch.multiprocessing.ProcessRaisedException(trace, 1, 1234)
    assert fairseq_patches.refusal_of_worker(exc) == \
        "--ls-x: why; drop --ls-x to train without it"
    other = torch.multiprocessing.ProcessRaisedException(
        "Traceback (most recent call last):\nRuntimeError: CUDA error\n", 0, 1)
    assert fairseq_patches.refusal_of_worker(other) is None
    assert fairseq_patches.refusal_line("ls_fairseq: x holds ...") == "ls_fairseq: x holds ..."


# ---- patch 11: a hint after fairseq's error for an unknown --arch ------------------------------

def test_arch_typo_gets_the_nearest_names(capsys):
    parser = options.get_training_parser()
    with pytest.raises(SystemExit) as info:
        options.parse_args_and_arch(parser, ["/nonexistent", "--arch", "ls_transfomer_wmt_en_de"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert ": error: argument --arch/-a: invalid choice: 'ls_transfomer_wmt_en_de' (choose " \
        "from 'transformer_tiny'" in err[-2]  # fairseq's (argparse's) message, unchanged
    assert err[-1].startswith("ls_fairseq: --arch 'ls_transfomer_wmt_en_de' is not an "
                              "architecture; the nearest: ls_transformer_wmt_en_de, ")
    assert err[-1].endswith(
        " (the ls_ architectures: ls_transformer, ls_transformer_iwslt_de_en, "
        "ls_transformer_wmt_en_de, ls_transformer_vaswani_wmt_en_de_big, "
        "ls_transformer_vaswani_wmt_en_fr_big, ls_transformer_wmt_en_de_big, "
        "ls_transformer_wmt_en_de_big_t2t)")
    assert fairseq_patches.arch_hint("argument --arch/-a: invalid choice: 'transfomer' "
                                     "(choose from ...)").startswith(
        "ls_fairseq: --arch 'transfomer' is not an architecture; the nearest: transformer")
    # every other error: argparse's alone
    with pytest.raises(SystemExit):
        options.parse_args_and_arch(options.get_training_parser(),
                                    ["/nonexistent", "--arch", "ls_transformer", "--lr", "x"])
    assert "ls_fairseq:" not in capsys.readouterr().err


# ---- patch 12: fairseq's checkpoint loads under torch's safe loader ----------------------------

def test_checkpoint_types_are_allowed_during_fairseqs_loads_only(tmp_path):
    """fairseq's load_checkpoint_to_cpu reads a checkpoint holding fairseq's non-tensor types
    (argparse.Namespace, omegaconf) under torch's safe loader; the process's allow-list is the
    same before and after, and a plain ``torch.load(weights_only=True)`` still refuses them. A
    type the process allowed itself stays allowed."""
    import argparse

    from fairseq import checkpoint_utils
    from omegaconf import OmegaConf

    fairseq_patches.install()
    state = {"model": {"w": torch.arange(3.0)}, "args": None,
             "cfg": OmegaConf.create({"model": {"_name": "ls_transformer"}}),
             "optimizer_history": [{"criterion_name": "LSLabelSmoothedCrossEntropyCriterion",
                                    "optimizer_name": "FairseqLSAdam", "num_updates": 7,
                                    "lr_scheduler_state": {"best": None}}],
             "extra_state": {"epoch": 2, "train_iterator": {"epoch": 2},
                             "previous_args": argparse.Namespace(arch="ls_transformer")}}
    path = tmp_path / "checkpoint.pt"
    torch.save(state, path)
    before = set(torch.serialization.get_safe_globals())
    assert argparse.Namespace not in before  # the plugin changed nothing for the process
    with pytest.raises(Exception, match="Unsupported global"):
        torch.load(path, weights_only=True)
    loaded = checkpoint_utils.load_checkpoint_to_cpu(str(path))
    assert torch.equal(loaded["model"]["w"], torch.arange(3.0))
    assert loaded["cfg"].model._name == "ls_transformer"
    assert set(torch.serialization.get_safe_globals()) == before
    # fairseq's own function (the patch uninstalled) meets torch's refusal
    with pytest.raises(Exception, match="Unsupported global"):
        _patching.original(checkpoint_utils, "load_checkpoint_to_cpu")(str(path))
    torch.serialization.add_safe_globals([argparse.Namespace])
    try:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
        assert argparse.Namespace in torch.serialization.get_safe_globals()
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(list(before))
