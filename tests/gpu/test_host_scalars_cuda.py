"""The criterion's logged scalars reach ``reduce_metrics`` as host numbers without waiting for GPU
work queued after them (the optimizer step, in fairseq's trainer), and log exactly what fairseq's
``label_smoothed_cross_entropy.reduce_metrics`` logs from the same CUDA scalars (tolerance:
relative 1e-6 before fairseq's rounding: fp32 vs double sums of the same few numbers). With
several processes the logs go through fairseq's own gather (two gloo processes on one GPU)."""
import time

import pytest
import torch
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq.logging import metrics

from fairseq_helpers import DummyTask, make_dictionary  # noqa: E402
from ls_fairseq.criterions.host_scalars import HostCopy, to_host  # noqa: E402
from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (  # noqa: E402
    LSLabelSmoothedCrossEntropyCriterion,
)

pytestmark = pytest.mark.gpu


def _logging_outputs(crit, n, report_accuracy, g):
    outs = []
    for i in range(n):
        tgt = torch.randint(2, 40, (3 + i, 5 + 2 * i), generator=g).cuda()
        sample = {"target": tgt, "ntokens": int(tgt.numel())}
        loss = torch.rand((), generator=g).cuda() * 100 * (i + 1)
        nll = loss * 0.9
        corr = torch.tensor(3 * i + 1).cuda() if report_accuracy else None
        total = torch.tensor(tgt.numel()).cuda() if report_accuracy else None
        outs.append(crit._logging_output(loss, nll, sample, corr, total)[1])
    return outs


def _reduced(cls, outs):
    with metrics.aggregate(new_root=True) as agg:
        cls.reduce_metrics(outs)
        return agg.get_smoothed_values()


@pytest.mark.parametrize("update_freq", [1, 3])
@pytest.mark.parametrize("report_accuracy", [False, True])
def test_reduce_metrics_matches_fairseq_without_waiting(update_freq, report_accuracy):
    d = make_dictionary(41)
    crit = LSLabelSmoothedCrossEntropyCriterion(DummyTask(d), False, 0.1,
                                               report_accuracy=report_accuracy)
    outs = _logging_outputs(crit, update_freq, report_accuracy, torch.Generator().manual_seed(5))
    assert all(isinstance(o["loss"].ls_host_copy, HostCopy) for o in outs)
    torch.cuda.synchronize()
    # ~0.5 s of GPU work queued behind the logged scalars, as the optimizer step is in fairseq
    torch.cuda._sleep(int(0.5 * torch.cuda.get_device_properties(0).clock_rate * 1e3))
    t0 = time.perf_counter()
    ours = _reduced(LSLabelSmoothedCrossEntropyCriterion, outs)
    ours_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = _reduced(LabelSmoothedCrossEntropyCriterion, outs)  # .item() waits for the sleep
    ref_s = time.perf_counter() - t0
    assert ref_s > 0.2, "the queued work was too short for this test to tell"
    assert ours_s < 0.05, f"reduce_metrics waited {ours_s:.3f} s for later GPU work"
    assert set(ours) == set(ref)
    for key, value in ref.items():
        assert float(ours[key]) == pytest.approx(float(value), rel=1e-6, abs=1e-3), key


def test_host_copy_values_and_pickling():
    import pickle

    t = torch.tensor(3.25, device="cuda")
    copy = HostCopy(t)
    t.add_(1)  # later changes are not seen: the copy was queued before them
    assert copy.value() == 3.25
    settled = pickle.loads(pickle.dumps(copy))  # gathered across workers: the plain number
    assert type(settled) is float and settled == 3.25
    assert to_host(torch.tensor(2.0, device="cuda")).item() == 2.0  # no copy: left as it is
    assert to_host(7) == 7


def _gather_worker(rank, init_file, update_freq, report_accuracy, world):
    """One of ``world`` processes (gloo, all on this GPU): logs as in a data-parallel run and
    exchanges the logs through fairseq's trainer (``_all_gather_list_sync``, the path fairseq
    takes when the criterion's logging outputs cannot be summed)."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from fairseq.trainer import Trainer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    d = make_dictionary(41)
    crit = LSLabelSmoothedCrossEntropyCriterion(DummyTask(d), False, 0.1,
                                               report_accuracy=report_accuracy)
    outs = _logging_outputs(crit, update_freq, report_accuracy,
                            torch.Generator().manual_seed(5 + rank))
    assert all(isinstance(o["loss"], HostCopy) for o in outs)  # not tensors: gathered as numbers
    assert not LSLabelSmoothedCrossEntropyCriterion.logging_outputs_can_be_summed()
    sample_size = float(sum(o["sample_size"] for o in outs))
    trainer = SimpleNamespace(tpu=False, data_parallel_process_group=None,
                              cfg=SimpleNamespace(common=SimpleNamespace(all_gather_list_size=16384)))
    gathered, (total_size,) = Trainer._all_gather_list_sync(trainer, outs, sample_size)
    assert len(gathered) == world * update_freq
    for log in gathered:
        for key, value in log.items():
            assert isinstance(value, (int, float)) and not torch.is_tensor(value), (key, value)
    # the optimizer step comes next in fairseq's train_step; reduce_metrics must not wait for it
    torch.cuda._sleep(int(0.5 * torch.cuda.get_device_properties(0).clock_rate * 1e3))
    t0 = time.perf_counter()
    ours = _reduced(LSLabelSmoothedCrossEntropyCriterion, gathered)
    assert time.perf_counter() - t0 < 0.05, "reduce_metrics waited for later GPU work"
    # reference: fairseq's reduce_metrics on every rank's CUDA scalars in one process
    everyone = []
    for r in range(world):
        logs = _logging_outputs(crit, update_freq, report_accuracy,
                                torch.Generator().manual_seed(5 + r))
        everyone += [{k: v._host.cuda() if isinstance(v, HostCopy) else v
                      for k, v in log.items()} for log in logs]
    ref = _reduced(LabelSmoothedCrossEntropyCriterion, everyone)
    assert total_size == sum(float(log["sample_size"]) for log in everyone)
    assert set(ours) == set(ref)
    for key, value in ref.items():
        assert float(ours[key]) == pytest.approx(float(value), rel=1e-6, abs=1e-3), key
    dist.destroy_process_group()


@pytest.mark.parametrize("update_freq,report_accuracy", [(1, False), (3, True)])
def test_data_parallel_logs_are_gathered_as_numbers(tmp_path, update_freq, report_accuracy):
    import torch.multiprocessing as mp

    mp.spawn(_gather_worker, args=(str(tmp_path / "init"), update_freq, report_accuracy, 2),
             nprocs=2, join=True)
