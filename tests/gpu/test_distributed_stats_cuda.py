"""``--ls-async-stats`` on two GPUs (NCCL), against fairseq's own trainer methods.

* The gathered logging outputs and summed statistics equal what fairseq's
  ``Trainer._all_gather_list_sync`` returns for the same inputs: the criterion's logged values
  (host copies of CUDA scalars), sizes, and a dummy batch's ``ignore``.
* Neither wrapped method waits for the GPU: with a long kernel queued, both return while it still
  runs. fairseq's gather, run the same way, returns only after it (which shows the probe works).
* The late grad-norm check raises at the next update exactly when fairseq's check raises.
"""
from types import SimpleNamespace

import pytest
import torch

from fairseq_helpers import run_workers  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

SLEEP_CYCLES = 2_000_000_000  # ~1 s on an H100/H200: far longer than any host work here


_HOST_GROUP = []  # the worker's gloo group, for the barrier before each probe


def _trainer(rank, group):
    from ls_fairseq import training_config

    trainer = SimpleNamespace(
        _criterion=SimpleNamespace(), data_parallel_world_size=2,
        data_parallel_rank=rank, data_parallel_process_group=group, tpu=False,
        _grad_norm_buf=torch.zeros(2, dtype=torch.float64, device="cuda"),
        cfg=SimpleNamespace(common=SimpleNamespace(amp=False, all_gather_list_size=16384)))
    training_config.attach(trainer, training_config.TrainingConfig(ls_async_stats="on"))
    return trainer


def _still_running(fn, *args, **kwargs):
    """Queue a long kernel, call ``fn``, and say whether the kernel was still running when it
    returned (plus what it returned or raised). The ranks start together (a host barrier), so
    neither waits long for the other inside ``fn``."""
    import torch.distributed as dist

    torch.cuda.synchronize()
    dist.barrier(group=_HOST_GROUP[0])
    torch.cuda._sleep(SLEEP_CYCLES)
    done = torch.cuda.Event()
    done.record()
    try:
        result = fn(*args, **kwargs)
    except FloatingPointError as e:
        result = e
    running = not done.query()
    torch.cuda.synchronize()
    return running, result


def _worker(rank):
    import torch.distributed as dist
    from fairseq.trainer import Trainer

    from ls_fairseq import fairseq_patches
    from ls_fairseq.distributed import async_stats as distributed_stats
    from ls_fairseq.criterions.host_scalars import for_logging

    fairseq_patches.install()
    group = dist.new_group()  # as fairseq's data-parallel group
    dist.all_reduce(torch.zeros(1, device="cuda"), group=group)  # NCCL set up before timing
    ours_trainer = _trainer(rank, group)  # one trainer: one gloo group, created here
    _HOST_GROUP.append(distributed_stats.host_group(ours_trainer))
    g = torch.Generator(device="cuda").manual_seed(11 + rank)
    logs = []
    for i in range(rank + 2):  # workers hold different numbers of micro-batches
        loss = torch.rand((), device="cuda", generator=g, dtype=torch.float32) * 10
        logs.append({"loss": for_logging(loss), "nll_loss": for_logging(loss * 0.9),
                     "n_correct": for_logging(torch.tensor(5 + i + rank, device="cuda")),
                     "ntokens": 100 * rank + i, "nsentences": 3 + i, "sample_size": 100 * rank + i})
    extra = (float(sum(log["sample_size"] for log in logs)), 0, 1.5 * rank + 0.25)
    torch.cuda.synchronize()
    out = {}
    for ignore in (False, rank == 1):
        ours = _still_running(Trainer._aggregate_logging_outputs, ours_trainer, logs,
                              *extra, ignore=ignore)
        theirs = _still_running(Trainer._all_gather_list_sync, _trainer(rank, group), logs,
                                *extra, ignore=ignore)
        out[f"equal_{ignore}"] = ours[1] == theirs[1] and len(ours[1][0]) >= 2
        out[f"ours_waited_{ignore}"], out[f"theirs_waited_{ignore}"] = not ours[0], not theirs[0]

    fairseq_check = Trainer._check_grad_norms.__wrapped__
    for name, norms in (("consistent", (3.0, 3.0)), ("inconsistent", (2.0, 2.002))):
        norm = torch.tensor(norms[rank], device="cuda")
        try:
            fairseq_check(_trainer(rank, group), norm)
            out[f"fairseq_{name}"] = None
        except FloatingPointError as e:
            out[f"fairseq_{name}"] = str(e)
        trainer = _trainer(rank, group)
        running, raised = _still_running(Trainer._check_grad_norms, trainer, norm)
        out[f"check_waited_{name}"], out[f"check_same_update_{name}"] = not running, raised
        try:
            Trainer._check_grad_norms(trainer, torch.tensor(1.0, device="cuda"))
            out[f"ours_{name}"] = None
        except FloatingPointError as e:
            out[f"ours_{name}"] = str(e)
    return out


def test_async_stats_match_fairseq_and_do_not_wait_for_the_gpu(tmp_path):
    for rank, r in enumerate(run_workers(tmp_path, _worker, backend="nccl")):
        for ignore in ("False", "True" if rank == 1 else "False"):
            assert r[f"equal_{ignore}"], (rank, r)
            assert not r[f"ours_waited_{ignore}"], (rank, r)
            assert r[f"theirs_waited_{ignore}"], (rank, r)  # fairseq's waits: the probe works
        assert r["fairseq_consistent"] is None and r["ours_consistent"] is None, r
        assert r["fairseq_inconsistent"] is not None, r
        assert r["ours_inconsistent"] is not None and "--ls-async-stats" in r["ours_inconsistent"]
        for name in ("consistent", "inconsistent"):
            assert not r[f"check_waited_{name}"] and r[f"check_same_update_{name}"] is None, r
