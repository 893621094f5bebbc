"""``--ls-async-stats`` (ls_fairseq/distributed/async_stats.py) on the CPU, two gloo processes.

The wrapped ``Trainer._aggregate_logging_outputs`` must return what fairseq's
``_all_gather_list_sync`` returns: every worker's logging outputs in rank order (a HostCopy
arriving as its number, a CUDA or fp16 tensor as fairseq's ``move_to_cpu`` leaves it), the extra
statistics summed, and nothing of a worker's outputs when it passes ``ignore`` (a dummy batch).
fairseq's own gather needs CUDA, so the expected result is built here from every worker's known
inputs; tests/gpu/test_distributed_stats_cuda.py compares against fairseq's function itself.

The wrapped ``_check_grad_norms`` must raise fairseq's FloatingPointError exactly when fairseq's
own ``_check_grad_norms`` (run here on the same CPU buffer) raises, one update later (or at the
next gather, whichever comes first). The one
intended difference: norms that are not finite on every worker pass (an overflow that every worker
skips). A trainer whose config has ``ls_async_stats`` off gets fairseq's methods unchanged.
"""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from fairseq.trainer import Trainer

from fairseq_helpers import run_workers
from ls_fairseq import fairseq_patches, switches, training_config
from ls_fairseq.distributed import async_stats as distributed_stats
from ls_fairseq.host_copy import HostCopy
from ls_fairseq.optim import deferred_overflow

WORLD = 2


def _fake_trainer(rank, async_stats=True, amp=False):
    """The attributes of fairseq's Trainer that the wrapped methods (and fairseq's) read, and
    the run's config (patch 9 attaches it)."""
    trainer = SimpleNamespace(
        _criterion=SimpleNamespace(), data_parallel_world_size=WORLD,
        data_parallel_rank=rank, data_parallel_process_group=dist.group.WORLD,
        _grad_norm_buf=torch.zeros(WORLD, dtype=torch.float64),
        cfg=SimpleNamespace(common=SimpleNamespace(amp=amp)))
    _with_async_stats(trainer, switches.AUTO if async_stats else switches.OFF)
    return trainer


def _with_async_stats(trainer, mode):
    training_config.attach(trainer, training_config.TrainingConfig(ls_async_stats=mode))


def _logs(rank):
    """Worker ``rank``'s micro-batch logging outputs (rank + 1 of them) and extra statistics,
    as built by the criterion and the trainer, and as they should arrive."""
    sent, arrived = [], []
    for i in range(rank + 1):
        loss = 1.25 + rank + 0.5 * i
        n_correct = torch.tensor(7.0 + i, dtype=torch.float16)
        sent.append({"loss": HostCopy(torch.tensor(loss, dtype=torch.float64)),
                     "ntokens": 10 * rank + i + 3, "nsentences": 2, "n_correct": n_correct})
        arrived.append({"loss": loss, "ntokens": 10 * rank + i + 3, "nsentences": 2,
                        "n_correct": n_correct.float()})
    extra = (float(10 * rank + 4), rank, 0.125 * (rank + 1))  # sample size, ooms, train time
    return sent, arrived, extra


def _same(a, b):
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and \
            torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _gather_worker(rank):
    fairseq_patches.install()
    trainer = _fake_trainer(rank)
    out = {}
    sent, _, extra = _logs(rank)
    logs, sums = Trainer._aggregate_logging_outputs(trainer, sent, *extra)
    expected = [log for r in range(WORLD) for log in _logs(r)[1]]
    expected_sums = [sum(_logs(r)[2][i] for r in range(WORLD)) for i in range(len(extra))]
    out["gathered"] = _same(logs, expected)
    out["summed"] = _same(sums, expected_sums)
    # a dummy batch on worker 1: its outputs are left out, its statistics still summed
    logs, sums = Trainer._aggregate_logging_outputs(trainer, sent, *extra, ignore=rank == 1)
    out["ignored"] = _same(logs, _logs(0)[1]) and _same(sums, expected_sums)
    # a trainer of another criterion: fairseq's own method, unchanged
    other = _fake_trainer(rank, async_stats=False)

    class Task:
        @staticmethod
        def logging_outputs_can_be_summed(criterion):
            return criterion is other._criterion

    other.task, other.get_criterion = Task(), lambda: other._criterion
    other._fast_stat_sync_sum = lambda logs, *extra, ignore=False: ("fairseq", logs, extra)
    out["delegated"] = Trainer._aggregate_logging_outputs(other, ["x"], 1) == (
        "fairseq", ["x"], (1,))
    return out


def test_gather_is_fairseqs_all_gather_list_sync(tmp_path):
    for rank, r in enumerate(run_workers(tmp_path, _gather_worker)):
        assert r == {"gathered": True, "summed": True, "ignored": True, "delegated": True}, rank


INF, NAN = math.inf, math.nan
# (worker 0's norm, worker 1's norm, amp)
NORM_CASES = [(3.0, 3.0, False), (2.0, 2.0 * (1 + 1e-3), False), (5.0, 5.0 * (1 + 1e-7), False),
              (0.0, 0.0, False), (0.0, 1e-5, False), (7.5, 7.5 * (1 + 3e-6), False),
              (1.0, INF, False), (NAN, 1.0, False), (1.0, INF, True), (INF, NAN, True)]
OVERFLOWS = [(INF, INF, False), (NAN, NAN, False), (INF, NAN, False)]


def _raises(fn, *args):
    try:
        fn(*args)
    except FloatingPointError as e:
        return str(e)
    return None


def _norms_worker(rank):
    fairseq_patches.install()
    fairseq_check = Trainer._check_grad_norms.__wrapped__
    out = {"ours": [], "fairseq": [], "same_update": []}
    for case in NORM_CASES + OVERFLOWS:
        norm, amp = torch.tensor(case[rank], dtype=torch.float32), case[2]
        out["fairseq"].append(_raises(fairseq_check, _fake_trainer(rank, amp=amp), norm))
        trainer = _fake_trainer(rank, amp=amp)
        # the update's own check never raises: its comparison is read at the next update
        out["same_update"].append(_raises(Trainer._check_grad_norms, trainer, norm))
        out["ours"].append(_raises(Trainer._check_grad_norms, trainer, torch.tensor(1.0)))
    # the next gather (the next update's, or the validation's after the last update) compares
    # the pending norms too
    trainer = _fake_trainer(rank)
    Trainer._check_grad_norms(trainer, torch.tensor(2.0 + rank * 1e-3))
    out["gather_compares"] = _raises(Trainer._aggregate_logging_outputs, trainer, [], 1.0)
    out["compared_once"] = _raises(Trainer._check_grad_norms, trainer, torch.tensor(1.0))
    # another criterion's trainer: fairseq's check, raising at once
    other = _fake_trainer(rank, async_stats=False)
    out["delegated"] = _raises(Trainer._check_grad_norms, other,
                               torch.tensor(1.0 + rank * 1e-3)) is not None
    # ls_adam's deferred overflow check needs the late check on several workers
    cfg = SimpleNamespace(criterion=SimpleNamespace(ls_async_stats=False, ls_no_async_stats=True))
    out["deferred_refused"] = deferred_overflow.grad_norm_check_conflict(cfg) or ""
    cfg.criterion.ls_no_async_stats = False  # the criterion's default: async stats on
    out["deferred_with_async_stats"] = deferred_overflow.grad_norm_check_conflict(cfg)
    return out


def test_grad_norm_check_raises_one_update_late_where_fairseq_raises(tmp_path):
    for rank, r in enumerate(run_workers(tmp_path, _norms_worker)):
        assert r["same_update"] == [None] * len(NORM_CASES + OVERFLOWS), rank
        assert r["delegated"], rank
        assert r["gather_compares"] is not None and r["compared_once"] is None, rank
        assert "--ls-no-async-stats keeps fairseq's check" in r["deferred_refused"], rank
        assert r["deferred_with_async_stats"] is None, rank
        for case, ours, theirs in zip(NORM_CASES, r["ours"], r["fairseq"]):
            assert (ours is None) == (theirs is None), (rank, case, ours, theirs)
            if theirs is not None:  # fairseq's message, and what it means here
                assert ours.startswith(theirs.rstrip("-").rstrip()), (ours, theirs)
                assert "--ls-async-stats" in ours
        # the intended difference: an overflow on every worker is not an inconsistency
        for case, ours, theirs in zip(OVERFLOWS, r["ours"][len(NORM_CASES):],
                                      r["fairseq"][len(NORM_CASES):]):
            assert ours is None and theirs is not None, (rank, case)
    # the cases cover both outcomes
    assert any(x is None for x in r["fairseq"][:len(NORM_CASES)])
    assert any(x is not None for x in r["fairseq"][:len(NORM_CASES)])


def test_model_parallel_runs_step_aside_or_are_refused(caplog):
    """Under model parallelism async stats step aside for the run (one line), or, required with
    --ls-async-stats, refuse it."""
    trainer = _fake_trainer(0)
    trainer.data_parallel_world_size = 1  # fewer data-parallel workers than processes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist, "get_world_size", lambda group=None: 2)
        mp.setattr(dist, "is_initialized", lambda: True)
        with caplog.at_level("INFO"):
            assert not distributed_stats._applies(trainer)
            assert not distributed_stats._applies(trainer)
        lines = [r.getMessage() for r in caplog.records if "is off for this run" in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith("ls-async-stats is off for this run: it "
                                                       "needs plain data parallelism"), lines
        _with_async_stats(trainer, switches.ON)
        with pytest.raises(ValueError, match="^--ls-async-stats: it needs plain data parallelism"):
            distributed_stats._applies(trainer)


def test_one_process_runs_keep_the_deferred_overflow_check():
    assert deferred_overflow.grad_norm_check_conflict(
        SimpleNamespace(criterion=SimpleNamespace(ls_async_stats=False))) is None


def test_install_is_idempotent_and_keeps_fairseqs_methods_reachable():
    fairseq_patches.install()
    first = Trainer._aggregate_logging_outputs, Trainer._check_grad_norms
    fairseq_patches.install()
    assert (Trainer._aggregate_logging_outputs, Trainer._check_grad_norms) == first
    assert Trainer._check_grad_norms.__wrapped__.__module__ == "fairseq.trainer"
    assert Trainer._aggregate_logging_outputs.__wrapped__.__module__ == "fairseq.trainer"
