"""The three speed mechanisms are on by default where they apply and step aside elsewhere with one
log line; ``--ls-X`` requires one (refused where it cannot apply), ``--ls-no-X`` turns it off
(ls_fairseq/switches.py). Also: ``--bf16`` without torch_xla trains on the usual device.

The mechanisms themselves are tested elsewhere (graphs: tests/gpu/test_cuda_graphs_cuda.py;
fused copy and deferred check: tests/test_deferred_overflow.py, tests/gpu/test_adam_cuda.py);
here only who decides what, and what the user is told."""
import argparse
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fairseq_helpers import DummyTask, build_model, make_dictionary, random_sample
from ls_fairseq import switches
from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (
    LSLabelSmoothedCrossEntropyCriterion,
)
from ls_fairseq.graphs import CudaGraphedLoss
from ls_fairseq.models import ls_transformer
from ls_fairseq.optim import deferred_overflow, ls_adam

TINY = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
        "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "24",
        "--decoder-ffn-embed-dim", "24", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2"]


def _off_lines(caplog, flag):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{flag} is off")]


# ---- switches --------------------------------------------------------------------------------

@pytest.mark.parametrize("on,off,want", [(False, False, "auto"), (True, False, "on"),
                                         (False, True, "off")])
def test_resolve(on, off, want):
    assert switches.resolve(on, off, "--ls-cuda-graphs") == want


def test_contradicting_flags_are_refused_naming_both():
    with pytest.raises(ValueError, match="--ls-cuda-graphs and --ls-no-cuda-graphs contradict"):
        switches.resolve(True, True, "--ls-cuda-graphs")


def test_refuse_or_step_aside(caplog):
    log = logging.getLogger("test")
    with pytest.raises(ValueError, match="^--ls-x: why$"):
        switches.refuse_or_step_aside("on", "--ls-x", "why", log)
    with caplog.at_level("INFO"):
        switches.refuse_or_step_aside("auto", "--ls-x", "why", log)
        switches.refuse_or_step_aside("off", "--ls-x", "why", log)
    assert _off_lines(caplog, "ls-x") == ["ls-x is off for this run: why"]


# ---- CUDA graphs (criterion) -----------------------------------------------------------------

def _criterion(**kwargs):
    return LSLabelSmoothedCrossEntropyCriterion(DummyTask(make_dictionary()), sentence_avg=False,
                                                label_smoothing=0.1, **kwargs)


def test_graphs_on_by_default_and_off_with_the_no_flag():
    assert isinstance(_criterion().graphs, CudaGraphedLoss)
    assert not _criterion().graphs.required
    assert _criterion(ls_cuda_graphs=True).graphs.required
    off = _criterion(ls_no_cuda_graphs=True)
    assert off.graphs is None and off.shape_buckets is None
    with pytest.raises(ValueError, match="contradict"):
        _criterion(ls_cuda_graphs=True, ls_no_cuda_graphs=True)


def test_graphs_step_aside_for_a_model_not_known_to_be_capturable(caplog):
    """fairseq's own transformer tests its padding mask on the host (not capturable): by default
    the graphs step aside for the run with one line; --ls-cuda-graphs still tries them."""
    dictionary = make_dictionary()
    fairseq_model = build_model("transformer", dictionary, TINY)
    ls_model = build_model("ls_transformer", dictionary, TINY)
    sample = random_sample(dictionary, 3, 5, 4, torch.Generator().manual_seed(0))
    crit = _criterion()
    with caplog.at_level("INFO"):
        for _ in range(3):
            assert not crit.graphs.applies(fairseq_model, sample)
    lines = _off_lines(caplog, "ls-cuda-graphs")
    assert len(lines) == 1 and "TransformerModel" in lines[0] and "--ls-cuda-graphs" in lines[0]
    assert _criterion(ls_cuda_graphs=True).graphs.off_reason is None
    # an ls_ model on the CPU: eager steps, the graphs stay on for CUDA batches
    crit = _criterion()
    assert not crit.graphs.applies(ls_model, sample) and crit.graphs.off_reason is None


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_graphs_stay_on_under_torch_ddp(one_process_group, caplog):
    """torch DDP (fairseq's default backend) no longer turns the graphs off: the engine runs the
    steps inside DDP and all-reduces itself (tests/gpu/test_cuda_graphs_cuda.py checks the
    gradients). A CPU batch runs eagerly without turning them off for the run."""
    dictionary = make_dictionary()
    model = torch.nn.parallel.DistributedDataParallel(
        build_model("ls_transformer", dictionary, TINY))
    sample = random_sample(dictionary, 3, 5, 4, torch.Generator().manual_seed(0))
    for crit in (_criterion(), _criterion(ls_cuda_graphs=True)):
        with caplog.at_level("INFO"):
            assert not crit.graphs.applies(model, sample)  # the batch is on the CPU
        assert crit.graphs.off_reason is None
    assert _off_lines(caplog, "ls-cuda-graphs") == []


# ---- fused fp16 copy and deferred overflow check (optimizer) --------------------------------

def _cfg(optimizer="ls_adam", pipeline=False, cpu=False, criterion="ours", **opt):
    """``criterion``: "ours" (ls_label_smoothed_cross_entropy's defaults), "no_async_stats"
    (with --ls-no-async-stats) or "fairseq" (a criterion without the options)."""
    crit = {"ours": SimpleNamespace(ls_async_stats=False, ls_no_async_stats=False),
            "no_async_stats": SimpleNamespace(ls_async_stats=False, ls_no_async_stats=True),
            "fairseq": SimpleNamespace()}[criterion]
    return SimpleNamespace(
        optimizer=SimpleNamespace(_name=optimizer, **opt),
        distributed_training=SimpleNamespace(pipeline_model_parallel=pipeline),
        common=SimpleNamespace(cpu=cpu), criterion=crit)


def test_fused_copy_is_the_default_for_ls_adam_only():
    assert ls_adam.fp16_optimizer_class(_cfg()) is ls_adam.LSFusedFP16Optimizer
    assert ls_adam.fp16_optimizer_class(_cfg(optimizer="adam")) is None
    assert ls_adam.fp16_optimizer_class(_cfg(ls_no_fused_fp16_copy=True)) is None


def test_fused_copy_steps_aside_or_is_refused_under_pipeline_parallelism(caplog):
    with caplog.at_level("INFO"):
        assert ls_adam.fp16_optimizer_class(_cfg(pipeline=True)) is None
    assert len(_off_lines(caplog, "ls-fused-fp16-copy")) == 1
    with pytest.raises(ValueError, match="^--ls-fused-fp16-copy: pipeline"):
        ls_adam.fp16_optimizer_class(_cfg(pipeline=True, ls_fused_fp16_copy=True))


def test_deferred_check_default_and_where_it_steps_aside(caplog, monkeypatch):
    assert ls_adam._defers_overflow_check(_cfg())
    assert not ls_adam._defers_overflow_check(_cfg(ls_no_deferred_overflow_check=True))
    with caplog.at_level("INFO"):
        assert not ls_adam._defers_overflow_check(_cfg(fp16_adam_stats=True))
    assert "--fp16-adam-stats" in _off_lines(caplog, "ls-deferred-overflow-check")[0]
    with pytest.raises(ValueError, match="^--ls-deferred-overflow-check: .*--fp16-adam-stats"):
        ls_adam._defers_overflow_check(_cfg(fp16_adam_stats=True,
                                            ls_deferred_overflow_check=True))
    # several workers: needs the criterion's async stats (on by default)
    monkeypatch.setattr(deferred_overflow, "several_workers", lambda: True)
    assert ls_adam._defers_overflow_check(_cfg())
    for criterion, why in (("no_async_stats", "--ls-no-async-stats keeps fairseq's check"),
                           ("fairseq", "needs --criterion ls_label_smoothed_cross_entropy")):
        caplog.clear()
        with caplog.at_level("INFO"):
            assert not ls_adam._defers_overflow_check(_cfg(criterion=criterion))
        assert why in _off_lines(caplog, "ls-deferred-overflow-check")[0]
    model_parallel = _cfg()
    model_parallel.common.model_parallel_size = 2
    assert not ls_adam._defers_overflow_check(model_parallel)


def test_deferred_check_needs_the_fused_copy_when_required():
    with pytest.raises(ValueError, match="drop --ls-no-fused-fp16-copy"):
        ls_adam.FairseqLSAdam(SimpleNamespace(
            amsgrad=False, ls_fused_fp16_copy=False, ls_no_fused_fp16_copy=True,
            ls_deferred_overflow_check=True, ls_no_deferred_overflow_check=False,
            fp16_adam_stats=False), [torch.nn.Parameter(torch.zeros(2))])


def test_bf16_deferred_check_stops_the_run_on_a_non_finite_norm():
    """No loss scaler under --bf16: fairseq's trainer raises FloatingPointError on a non-finite
    grad norm; the deferred check raises it one update late (the update itself was skipped), and
    takes the step count back."""
    pending = deferred_overflow.PendingOverflowCheck(torch.tensor(float("inf")))
    pending.states = [{"step": 5}]
    with pytest.raises(FloatingPointError, match="gradients are Nan/Inf"):
        pending.book(None)
    assert pending.states[0]["step"] == 4
    ok = deferred_overflow.PendingOverflowCheck(torch.tensor(3.0))
    ok.states = [{"step": 5}]
    ok.book(None)
    assert ok.states[0]["step"] == 5


# ---- --bf16 without torch_xla ----------------------------------------------------------------

def test_bf16_means_the_usual_device_without_torch_xla(monkeypatch, caplog):
    args = argparse.Namespace(bf16=True, tpu=True, cpu=True)
    with caplog.at_level("INFO"):
        ls_transformer.bf16_without_tpu(args)
    assert args.tpu is False
    assert any("--bf16: training in bfloat16 on the CPU" in r.getMessage() for r in caplog.records)
    # fairseq's meaning where torch_xla is installed, and nothing to do without --bf16
    monkeypatch.setattr(ls_transformer.importlib.util, "find_spec", lambda name: object())
    args = argparse.Namespace(bf16=True, tpu=True, cpu=False)
    ls_transformer.bf16_without_tpu(args)
    assert args.tpu is True
    args = argparse.Namespace(bf16=False, tpu=True)
    ls_transformer.bf16_without_tpu(args)
    assert args.tpu is True


def test_ls_architectures_apply_it():
    from fairseq.models import ARCH_CONFIG_REGISTRY

    for name in ls_transformer.ARCHITECTURES:
        args = argparse.Namespace(bf16=True, tpu=True, cpu=True)
        ARCH_CONFIG_REGISTRY[name](args)
        assert args.tpu is False, name
        assert args.encoder_embed_dim > 0  # fairseq's defaults were applied too
