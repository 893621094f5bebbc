"""Every change ls_fairseq makes to fairseq's classes (ls_fairseq/fairseq_patches.py), in one
file: each patch is installed once, reaches fairseq's own method for runs it does not concern,
and does what its docstring says. Patch 4 (resuming an unconverted checkpoint) is also run end to
end in tests/test_bad_input.py, patch 3 with two gloo workers in tests/test_distributed_stats.py."""
from types import SimpleNamespace

import pytest
import torch
from fairseq.optim.fp16_optimizer import FP16Optimizer
from fairseq.trainer import Trainer

from fairseq_helpers import fp16_optimizer_cfg
from ls_fairseq import fairseq_patches
from ls_fairseq.optim.ls_adam import LSFusedFP16Optimizer

PATCHED = [(Trainer, "train_step"), (Trainer, "_aggregate_logging_outputs"),
           (Trainer, "_check_grad_norms"), (Trainer, "load_checkpoint")]


def test_installed_once_and_fairseqs_methods_stay_reachable():
    fairseq_patches.install()
    first = [getattr(c, n) for c, n in PATCHED] + [FP16Optimizer.build_optimizer.__func__]
    fairseq_patches.install()
    assert [getattr(c, n) for c, n in PATCHED] + [FP16Optimizer.build_optimizer.__func__] == first
    for cls, name in PATCHED:
        assert getattr(cls, name).__wrapped__.__module__ == "fairseq.trainer", name


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
    """A trainer whose criterion lacks ls_async_stats gets fairseq's own methods, unchanged."""
    from ls_fairseq import distributed_stats

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
        self._optimizer = SimpleNamespace(defers_host_reads=defers)
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
