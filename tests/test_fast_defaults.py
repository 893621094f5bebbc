"""The speed mechanisms are on by default where they apply and step aside elsewhere with one
log line; ``--ls-X`` requires one (refused where it cannot apply), ``--ls-no-X`` turns it off
(ls_fairseq/switches.py). Also: ``--bf16`` without torch_xla trains on the usual device.

Every ``--ls-X`` of docs/FLAGS.md both ways, through the checks fairseq-train runs before training
(``fairseq_patches``, patch 9: the criterion's and ls_adam's ``check_run``) on configs parsed by
fairseq's own option parser: for a run where the mechanism applies (a GPU, two GPUs, the CPU,
as the mechanism needs) nothing is refused, and for a run where it cannot, the one line of the
refusal. The mechanisms that apply on the CPU also run in a real fairseq-train
(tests/test_bad_input.py); the GPU-only ones run in tests/gpu/ (graphs:
test_cuda_graphs_cuda.py; fused copy and deferred check: test_adam_cuda.py; copy engine and
sharded step: bench/multi_gpu.py) and with gloo workers in tests/test_end_to_end.py (async stats,
batches fixed to GPUs, cost matching).

The mechanisms themselves are tested elsewhere (graphs: tests/gpu/test_cuda_graphs_cuda.py;
fused copy and deferred check: tests/test_deferred_overflow.py, tests/gpu/test_adam_cuda.py);
here only who decides what, and what the user is told."""
import argparse
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fairseq import criterions, options

from fairseq_helpers import DummyTask, build_model, make_dictionary, random_sample
from ls_fairseq import fairseq_patches, switches
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
    with pytest.raises(switches.Refused, match="^--ls-x: why; drop --ls-x to train without it$"):
        switches.refuse_or_step_aside("on", "--ls-x", "why", log)
    assert issubclass(switches.Refused, ValueError)
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
    sample = random_sample(dictionary, 3, 5, 4, torch.Generator().manual_seed(0))
    crit = _criterion()
    with caplog.at_level("INFO"):
        for _ in range(3):
            assert not crit.graphs.applies(fairseq_model, sample)
    lines = _off_lines(caplog, "ls-cuda-graphs")
    assert len(lines) == 1 and "TransformerModel" in lines[0] and "--ls-cuda-graphs" in lines[0]
    assert _criterion(ls_cuda_graphs=True).graphs.off_reason is None


def test_graphs_step_aside_once_on_the_cpu(caplog):
    """A CPU run: fairseq-train's check (patch 9) sets the graphs aside for the run, with the
    documented line, once; the training steps then run eagerly without another word. Outside
    fairseq-train the first CPU batch does the same."""
    dictionary = make_dictionary()
    model = build_model("ls_transformer", dictionary, TINY)
    sample = random_sample(dictionary, 3, 5, 4, torch.Generator().manual_seed(0))
    want = ["ls-cuda-graphs is off for this run: the model trains on the CPU (--cpu, or no CUDA "
            "GPU visible to torch), and CUDA graphs need a GPU"]
    crit = _criterion()
    with caplog.at_level("INFO"):
        crit.check_run(_parsed(), CPU)
        crit.check_run(_parsed(), CPU)
        assert not any(crit.graphs.applies(model, sample) for _ in range(3))
    assert _off_lines(caplog, "ls-cuda-graphs") == want
    caplog.clear()
    crit = _criterion()
    with caplog.at_level("INFO"):
        assert not any(crit.graphs.applies(model, sample) for _ in range(3))
    assert _off_lines(caplog, "ls-cuda-graphs") == [
        "ls-cuda-graphs is off for this run: the batches are on the CPU, and CUDA graphs need "
        "a GPU"]
    # on a GPU nothing is said, and the graphs stay on
    crit = _criterion()
    caplog.clear()
    with caplog.at_level("INFO"):
        crit.check_run(_parsed(), GPU)
    assert crit.graphs.off_reason is None and _off_lines(caplog, "ls-cuda-graphs") == []


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_graphs_stay_on_under_torch_ddp(one_process_group, caplog):
    """torch DDP (fairseq's default backend) no longer turns the graphs off: the engine runs the
    steps inside DDP and all-reduces itself (tests/gpu/test_cuda_graphs_cuda.py checks the
    gradients). Here the batch is on the CPU: required, the graphs run it eagerly with one
    warning and stay on for CUDA batches (tests/test_criterion.py); by default they step aside
    for the run."""
    dictionary = make_dictionary()
    model = torch.nn.parallel.DistributedDataParallel(
        build_model("ls_transformer", dictionary, TINY))
    sample = random_sample(dictionary, 3, 5, 4, torch.Generator().manual_seed(0))
    required = _criterion(ls_cuda_graphs=True)
    with caplog.at_level("INFO"):
        assert not required.graphs.applies(model, sample)
    assert required.graphs.off_reason is None and _off_lines(caplog, "ls-cuda-graphs") == []
    default = _criterion()
    with caplog.at_level("INFO"):
        assert not default.graphs.applies(model, sample)
    assert "the batches are on the CPU" in default.graphs.off_reason


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
    # (fp16_optimizer_class runs only where fairseq builds its FP16Optimizer: --fp16, --bf16)
    assert ls_adam.fp16_optimizer_class(_cfg()) is ls_adam.LSFusedFP16Optimizer
    assert ls_adam.fp16_optimizer_class(_cfg(optimizer="adam")) is None
    assert ls_adam.fp16_optimizer_class(_cfg(ls_no_fused_fp16_copy=True)) is None


def test_fused_copy_steps_aside_or_is_refused_under_pipeline_parallelism(caplog):
    with caplog.at_level("INFO"):
        assert ls_adam.fp16_optimizer_class(_cfg(pipeline=True)) is None
    assert len(_off_lines(caplog, "ls-fused-fp16-copy")) == 1
    with pytest.raises(switches.Refused, match="^--ls-fused-fp16-copy: pipeline"):
        ls_adam.fp16_optimizer_class(_cfg(pipeline=True, ls_fused_fp16_copy=True))


def test_deferred_check_default_and_where_it_steps_aside(caplog, monkeypatch):
    assert ls_adam.defers_overflow_check(_cfg())
    assert not ls_adam.defers_overflow_check(_cfg(ls_no_deferred_overflow_check=True))
    with caplog.at_level("INFO"):
        assert not ls_adam.defers_overflow_check(_cfg(fp16_adam_stats=True))
    assert "--fp16-adam-stats" in _off_lines(caplog, "ls-deferred-overflow-check")[0]
    with pytest.raises(ValueError, match="^--ls-deferred-overflow-check: .*--fp16-adam-stats"):
        ls_adam.defers_overflow_check(_cfg(fp16_adam_stats=True,
                                            ls_deferred_overflow_check=True))
    # several workers: needs the criterion's async stats (on by default)
    monkeypatch.setattr(deferred_overflow, "several_workers", lambda: True)
    assert ls_adam.defers_overflow_check(_cfg())
    for criterion, why in (("no_async_stats", "--ls-no-async-stats keeps fairseq's check"),
                           ("fairseq", "needs --criterion ls_label_smoothed_cross_entropy")):
        caplog.clear()
        with caplog.at_level("INFO"):
            assert not ls_adam.defers_overflow_check(_cfg(criterion=criterion))
        assert why in _off_lines(caplog, "ls-deferred-overflow-check")[0]
    model_parallel = _cfg()
    model_parallel.common.model_parallel_size = 2
    assert not ls_adam.defers_overflow_check(model_parallel)


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


# ---- every --ls-X, both ways: the checks before training (fairseq_patches, patch 9) ----------

CPU = switches.RunFacts(cuda=False, workers=1, processes=1)
GPU = switches.RunFacts(cuda=True, workers=1, processes=1)
TWO_GPUS = switches.RunFacts(cuda=True, workers=2, processes=2)
TWO_CPU_WORKERS = switches.RunFacts(cuda=False, workers=2, processes=2, backend="gloo")


def parsed_config(*flags, criterion="ls_label_smoothed_cross_entropy", optimizer="ls_adam"):
    """fairseq-train's config for the ls_ command line plus ``flags``, parsed by fairseq's option
    parser: ``(args, cfg)``. ``cfg`` has the groups of fairseq's config (``cfg.common``,
    ``cfg.optimizer`` with its ``_name``, ...), each holding the fields of its dataclass, as
    ``convert_namespace_to_omegaconf`` splits them (which takes ~1 s: hydra; here, ms)."""
    import dataclasses
    from fairseq.criterions import CRITERION_DATACLASS_REGISTRY
    from fairseq.dataclass.configs import FairseqConfig
    from fairseq.optim import OPTIMIZER_DATACLASS_REGISTRY

    args = options.parse_args_and_arch(options.get_training_parser(), [
        "/nonexistent", "--arch", "ls_transformer", "--task", "translation", "--criterion",
        criterion, "--optimizer", optimizer, "--lr", "1e-3", *flags])

    def group(dataclass, name=None):
        out = SimpleNamespace(**{f.name: getattr(args, f.name) for f in
                                 dataclasses.fields(dataclass) if hasattr(args, f.name)})
        if name is not None:
            out._name = name
        return out

    cfg = SimpleNamespace(**{f.name: group(f.type) for f in dataclasses.fields(FairseqConfig)
                             if dataclasses.is_dataclass(f.type)})
    cfg.criterion = group(CRITERION_DATACLASS_REGISTRY[criterion], criterion)
    cfg.optimizer = group(OPTIMIZER_DATACLASS_REGISTRY[optimizer], optimizer)
    return args, cfg


def _parsed(*flags):
    return parsed_config(*flags)[1]


def _check(flags, run, model=None):
    """What fairseq_patches.check_run does for the trainer of ``flags`` on ``run``."""
    args, cfg = parsed_config(*flags)
    reason = fairseq_patches.fp16_device_conflict(cfg, run)
    if reason is not None:
        raise switches.Refused(reason)
    criterion = criterions.build_criterion(args, DummyTask(make_dictionary()))
    criterion.check_run(cfg, run, model)
    ls_adam.check_run(cfg, run)
    return cfg, criterion


DROP = "; drop {} to train without it"
FP32 = ("this run trains in fp32: there are no fp16/bf16 weight copies to fuse (--fp16 or --bf16 "
        "train with them)")
ONE = "it works between several workers (GPUs), and this run has one"

#: (flags, a run where the mechanism applies): nothing refused
APPLIES = [
    (["--ls-cuda-graphs"], GPU),
    (["--ls-cuda-graphs"], TWO_GPUS),
    (["--ls-fused-fp16-copy", "--fp16"], GPU),
    (["--ls-fused-fp16-copy", "--fp16", "--fp16-no-flatten-grads"], GPU),
    (["--ls-fused-fp16-copy", "--bf16"], GPU),
    (["--ls-fused-fp16-copy", "--bf16"], CPU),  # the PyTorch path: same math
    (["--ls-deferred-overflow-check", "--fp16"], GPU),
    (["--ls-deferred-overflow-check", "--bf16"], CPU),
    (["--ls-async-stats"], TWO_GPUS),
    (["--ls-async-stats"], TWO_CPU_WORKERS),
    (["--ls-fix-batches-to-gpus"], TWO_GPUS),
    (["--ls-fix-batches-to-gpus"], TWO_CPU_WORKERS),
    (["--ls-cost-matching-window", "8"], TWO_GPUS),
    (["--ls-copy-engine-all-reduce"], TWO_GPUS),
    (["--ls-copy-engine-all-reduce"], switches.RunFacts(cuda=True, workers=16, processes=16)),
    (["--ls-sharded-optimizer-step", "--fp16"], TWO_GPUS),
    (["--ls-fused-output-ce"], CPU),
    (["--ls-fused-output-ce"], GPU),
    (["--ls-fp8"], CPU),  # the float32 reference with the same quantization (docs/FLAGS.md)
    (["--fp16", "--memory-efficient-fp16"], CPU),
    (["--fp16", "--fp16-no-flatten-grads"], CPU),
    (["--fp16"], GPU),
]

#: (flags, a run where it cannot apply, the one line)
REFUSED = [
    (["--ls-cuda-graphs"], CPU, "--ls-cuda-graphs: the model trains on the CPU (--cpu, or no "
     "CUDA GPU visible to torch), and CUDA graphs need a GPU" + DROP.format("--ls-cuda-graphs")),
    (["--ls-cuda-graphs"], TWO_CPU_WORKERS, "--ls-cuda-graphs: the model trains on the CPU "
     "(--cpu, or no CUDA GPU visible to torch), and CUDA graphs need a GPU"
     + DROP.format("--ls-cuda-graphs")),
    (["--ls-fused-fp16-copy"], GPU, "--ls-fused-fp16-copy: " + FP32
     + DROP.format("--ls-fused-fp16-copy")),
    (["--ls-fused-fp16-copy"], CPU, "--ls-fused-fp16-copy: " + FP32
     + DROP.format("--ls-fused-fp16-copy")),
    (["--ls-fused-fp16-copy", "--fp16", "--memory-efficient-fp16"], GPU,
     "--ls-fused-fp16-copy: --memory-efficient-fp16 keeps no fp32 master weights (fairseq's "
     "MemoryEfficientFP16Optimizer): there is no copy to fuse"
     + DROP.format("--ls-fused-fp16-copy")),
    (["--ls-fused-fp16-copy", "--amp"], GPU, "--ls-fused-fp16-copy: --amp trains through "
     "fairseq's AMPOptimizer, which keeps no fp16 weight copies"
     + DROP.format("--ls-fused-fp16-copy")),
    (["--ls-fused-fp16-copy", "--fp16", "--ddp-backend", "fully_sharded"], TWO_GPUS,
     "--ls-fused-fp16-copy: --ddp-backend fully_sharded trains through fairseq's "
     "MemoryEfficientFP16Optimizer, which keeps no fp32 master weights to copy"
     + DROP.format("--ls-fused-fp16-copy")),
    (["--ls-fused-fp16-copy", "--bf16", "--fp16-adam-stats"], CPU, "--ls-fused-fp16-copy: "
     "--fp16-adam-stats with a flat fp32 master needs the CUDA kernels"
     + DROP.format("--ls-fused-fp16-copy")),
    (["--ls-deferred-overflow-check"], CPU, "--ls-deferred-overflow-check: it runs inside "
     "ls_adam's fused fp16 copy, which cannot apply: " + FP32
     + DROP.format("--ls-deferred-overflow-check")),
    (["--ls-deferred-overflow-check", "--fp16", "--fp16-adam-stats"], GPU,
     "--ls-deferred-overflow-check: it does not support --fp16-adam-stats"
     + DROP.format("--ls-deferred-overflow-check")),
    (["--ls-async-stats"], CPU, "--ls-async-stats: " + ONE + DROP.format("--ls-async-stats")),
    (["--ls-async-stats"], GPU, "--ls-async-stats: " + ONE + DROP.format("--ls-async-stats")),
    (["--ls-async-stats"], switches.RunFacts(cuda=True, workers=2, processes=4),
     "--ls-async-stats: it needs plain data parallelism (the data-parallel group is every "
     "worker); this run has 2 data-parallel workers of 4 (model parallelism)"
     + DROP.format("--ls-async-stats")),
    (["--ls-fix-batches-to-gpus"], GPU, "--ls-fix-batches-to-gpus: " + ONE
     + DROP.format("--ls-fix-batches-to-gpus")),
    (["--ls-fix-batches-to-gpus", "--grouped-shuffling"], TWO_GPUS,
     "--ls-fix-batches-to-gpus: fairseq's --grouped-shuffling, given too, orders the batches "
     "instead" + DROP.format("--ls-fix-batches-to-gpus")),
    (["--ls-cost-matching-window", "8"], GPU, "--ls-cost-matching-window: it orders the "
     "batches fixed to GPUs, which cannot apply: " + ONE
     + DROP.format("--ls-cost-matching-window")),
    (["--ls-cost-matching-window", "8", "--ls-no-fix-batches-to-gpus"], TWO_GPUS,
     "--ls-cost-matching-window: it orders the batches fixed to GPUs, which cannot apply: "
     "--ls-no-fix-batches-to-gpus turns it off" + DROP.format("--ls-cost-matching-window")),
    (["--ls-copy-engine-all-reduce"], CPU, "--ls-copy-engine-all-reduce: it moves the gradients "
     "between GPUs, and this run trains on the CPU"
     + DROP.format("--ls-copy-engine-all-reduce")),
    (["--ls-copy-engine-all-reduce"], GPU, "--ls-copy-engine-all-reduce: it takes 2 to 16 GPUs, "
     "and this run has 1" + DROP.format("--ls-copy-engine-all-reduce")),
    (["--ls-copy-engine-all-reduce"], switches.RunFacts(cuda=True, workers=2, processes=2,
                                                        backend="gloo"),
     "--ls-copy-engine-all-reduce: it needs the NCCL backend, and this run uses gloo"
     + DROP.format("--ls-copy-engine-all-reduce")),
    (["--ls-sharded-optimizer-step", "--fp16"], GPU, "--ls-sharded-optimizer-step: it runs on "
     "the copy-engine all-reduce, which cannot apply: it takes 2 to 16 GPUs, and this run has 1"
     + DROP.format("--ls-sharded-optimizer-step")),
    (["--ls-sharded-optimizer-step"], TWO_GPUS, "--ls-sharded-optimizer-step: it runs inside "
     "ls_adam's fused fp16 copy, which cannot apply: " + FP32
     + DROP.format("--ls-sharded-optimizer-step")),
    (["--ls-sharded-optimizer-step", "--bf16"], TWO_GPUS, "--ls-sharded-optimizer-step: it "
     "needs fairseq's flat fp32 master, which --bf16 training does not build (one fp32 tensor "
     "per parameter): train with --fp16" + DROP.format("--ls-sharded-optimizer-step")),
    (["--ls-sharded-optimizer-step", "--fp16", "--fp16-no-flatten-grads"], TWO_GPUS,
     "--ls-sharded-optimizer-step: it needs fairseq's flat fp32 master (drop "
     "--fp16-no-flatten-grads)" + DROP.format("--ls-sharded-optimizer-step")),
    (["--ls-sharded-optimizer-step", "--fp16", "--ls-no-copy-engine-all-reduce"], TWO_GPUS,
     "--ls-sharded-optimizer-step: it runs on the copy-engine all-reduce, which "
     "--ls-no-copy-engine-all-reduce turns off" + DROP.format("--ls-sharded-optimizer-step")),
    (["--fp16"], CPU, "--fp16 needs a CUDA GPU (fairseq's FP16Optimizer keeps its fp32 master "
     "weights on it), and this run trains on the CPU (--cpu, or no CUDA GPU visible to torch): "
     "on the CPU train with --bf16, or drop --fp16"),
]


def _run_id(run):
    return ("gpu" if run.cuda else "cpu") + ("" if run.workers == 1 else f"x{run.workers}") + \
        ("" if run.processes == run.workers else f"of{run.processes}") + \
        ("" if run.backend == "nccl" else f"-{run.backend}")


@pytest.mark.parametrize("flags,run", APPLIES, ids=[" ".join(f) + " " + _run_id(r)
                                                    for f, r in APPLIES])
def test_where_the_mechanism_applies_nothing_is_refused(flags, run, caplog):
    model = build_model("ls_transformer", make_dictionary(), TINY) \
        if "--ls-fused-output-ce" in flags else None
    with caplog.at_level("INFO"):
        _, criterion = _check(flags, run, model)
    if "--ls-cuda-graphs" in flags:
        assert criterion.graphs.required and criterion.graphs.off_reason is None
    assert not [r for r in caplog.records if "is off for this run" in r.getMessage()
                and "ls-cuda-graphs" not in r.getMessage()]


@pytest.mark.parametrize("flags,run,line", REFUSED, ids=[" ".join(f) + " " + _run_id(r)
                                                         for f, r, _ in REFUSED])
def test_where_it_cannot_apply_the_run_is_refused_with_one_line(flags, run, line):
    with pytest.raises(switches.Refused) as info:
        _check(flags, run)
    assert str(info.value) == line


def test_every_mechanism_flag_of_flags_md_is_checked_both_ways():
    """docs/FLAGS.md's --ls-X flags (each mechanism's, and the opt-in ones of its "Other flags"
    table) have a case here where they apply and one where they are refused (the opt-ins that
    apply everywhere, --ls-fp8 and --ls-fused-output-ce, have their refusals in
    tests/test_bad_input.py and tests/test_fp8_linear.py)."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "FLAGS.md"), encoding="utf-8") as f:
        text = f.read()
    mechanisms = set(re.findall(r"`(--ls-no-[a-z0-9-]+)`", text))
    asked = {flag.replace("--ls-no-", "--ls-") for flag in mechanisms}
    assert {"--ls-cuda-graphs", "--ls-fused-fp16-copy", "--ls-sharded-optimizer-step"} <= asked
    asked |= {"--ls-cost-matching-window", "--ls-fused-output-ce", "--ls-fp8"}
    applies = {f for flags, _ in APPLIES for f in flags}
    refused = {f for flags, _, _ in REFUSED for f in flags}
    assert asked - applies == set()
    assert asked - {"--ls-fused-output-ce", "--ls-fp8"} - refused == set()


def test_fused_output_ce_is_refused_for_a_model_without_a_plain_output_projection():
    model = build_model("ls_transformer", make_dictionary(), TINY)
    model.decoder.output_projection = None
    with pytest.raises(switches.Refused, match=r"^--ls-fused-output-ce needs a decoder with a "
                                               r"bias-free decoder.output_projection \(no "
                                               r"adaptive softmax\); drop --ls-fused-output-ce"):
        _check(["--ls-fused-output-ce"], CPU, model)


def test_deferred_check_on_several_workers_is_refused_without_async_stats(monkeypatch):
    monkeypatch.setattr(deferred_overflow, "several_workers", lambda: True)
    _check(["--ls-deferred-overflow-check", "--fp16"], TWO_GPUS)
    with pytest.raises(switches.Refused, match="^--ls-deferred-overflow-check: "
                                               "--ls-no-async-stats keeps fairseq's check"):
        _check(["--ls-deferred-overflow-check", "--fp16", "--ls-no-async-stats"], TWO_GPUS)


def test_on_a_gpu_the_required_mechanisms_are_built(monkeypatch):
    """Where the check lets a required mechanism through on a GPU, the component that runs it is
    the one built (torch.cuda mocked: the config says "GPU")."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # --fp16-adam-stats with a flat master: the CUDA kernels (refused on the CPU, above)
    cfg = _parsed("--fp16", "--ls-fused-fp16-copy", "--fp16-adam-stats")
    assert ls_adam.fp16_optimizer_class(cfg) is ls_adam.LSFusedFP16Optimizer
    cfg = _parsed("--fp16", "--ls-deferred-overflow-check")
    assert ls_adam.defers_overflow_check(cfg)
    criterion = criterions.build_criterion(
        parsed_config("--ls-cuda-graphs", "--ls-copy-engine-all-reduce")[0],
        DummyTask(make_dictionary()))
    assert criterion.graphs.required and criterion.graphs.copy_engine == switches.ON
