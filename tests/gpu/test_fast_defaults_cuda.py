"""The plain fairseq-train command on the GPU gets the fast defaults, end to end.

Three mechanisms are on by default where they apply (ls_fairseq/switches.py): CUDA graphs with
batch padding in ``ls_label_smoothed_cross_entropy`` (for an ls_transformer), ls_adam's fused
fp16 copy (``LSFusedFP16Optimizer``, built by fairseq's ``FP16Optimizer.build_optimizer``) and
its deferred overflow check. Real fairseq-train runs of a small model on the tiny reversal corpus
of tests/test_end_to_end.py, started together (one GPU; each start costs ~10-20 s):

* ``defaults``: ``--arch ls_transformer ... --fp16`` and names only. It must capture graphs, build
  ``LSFusedFP16Optimizer`` with the deferred check (the checkpoint records the trainer's optimizer
  class; the same command line, parsed in this process, builds it), log no "is off for this run"
  line, and carry ``tflops`` and ``mfu`` (percent of the GPU's dense 16-bit peak, where known) in
  every train_inner line, positive after the first ``WARM_UP`` updates (an update that captures
  a graph can take long enough to round to 0.0).
* ``off``: the same with ``--ls-no-cuda-graphs --ls-no-fused-fp16-copy
  --ls-no-deferred-overflow-check``: the same logged losses. Dropout is off in both (the graphs
  pad batches to bucketed shapes, which would change the dropout masks), so what differs is fp16
  rounding: the padded batches' sums and GEMMs in another order, the grad norm summed in another
  order. Tolerance: 0.01 in every update's logged loss (base 2, three decimals; the same bound as
  test_cuda_graphs_cuda.py's graphs-vs-eager runs), over the first 60 updates that updated the
  weights: an update that overflows is skipped by both, but logged (gnorm inf) only by the
  deferred check, which counts it; with a constant learning rate and no dropout nothing after it
  depends on that count, so the updates pair up one to one (with fairseq's schedules they do
  not: test_training_parity_cuda.py).
* ``bf16``: ``--bf16`` instead of ``--fp16`` trains in bfloat16 on the GPU (fairseq alone would
  want a TPU): the log says so, no ``loss_scale`` field (no loss scaling in bf16), and the loss
  falls like the fp16 run's: the mean of the last 10 logged losses within 10% of the fp16 run's
  (measured on an H100: 3.357 and 3.381, from 15.4 at the first update).
* ``fairseq_model``: fairseq's ``transformer`` with the ls_ criterion: the graphs step aside with
  exactly one "ls-cuda-graphs is off for this run" line, and it trains.
* ``contradict``: ``--ls-cuda-graphs --ls-no-cuda-graphs`` is refused (non-zero exit status, the
  "contradict" message).

On one GPU fairseq wraps no DDP. The graphs under torch DDP (fairseq's default on several GPUs,
where they run the steps inside DDP and all-reduce themselves) are tested in
test_cuda_graphs_cuda.py (one process group of one GPU, and two GPUs) and end to end by
``bench/multi_gpu.py``.
"""
import math
import os
import re
import subprocess
from types import SimpleNamespace

import pytest
import torch

from test_end_to_end import fairseq_cli, make_tiny_data, train_cmd  # noqa: E402
from ls_fairseq.flops import device_peak_tflops  # noqa: E402
from ls_fairseq.ops import _extension  # noqa: E402

pytestmark = pytest.mark.gpu

# wide enough, with batches large enough, that an update's model FLOP/s rounds above zero in
# tflops (one decimal) and in mfu (percent of ~1000 TFLOP/s, one decimal; 0.5 TFLOP/s needed): ~60
# MFLOP per token, two layers a side, ~2000 tokens a batch (measured on an H100, the five runs
# sharing it: 2-6 TFLOP/s already at 600 tokens a batch, ~0.5 where an update also captured a
# graph; the whole file took 70 s there)
WIDE = ["--encoder-embed-dim", "512", "--decoder-embed-dim", "512", "--encoder-ffn-embed-dim",
        "1024", "--decoder-ffn-embed-dim", "1024", "--encoder-attention-heads", "8",
        "--decoder-attention-heads", "8", "--share-all-embeddings"]
NO_DROPOUT = ["--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0"]
# log every update; no validation (so no logged interval holds one); one checkpoint, at the end;
# a constant learning rate, so that an update that overflows (logged under the deferred check,
# skipped by fairseq) does not move the schedule of the updates after it (see (b))
LONG = ["--log-interval", "1", "--disable-validation", "--save-interval", "1000",
        "--lr-scheduler", "fixed", "--warmup-updates", "0", "--lr", "5e-4", "--max-tokens", "2000"]
WARM_UP = 5  # logged updates that may include graph captures (~0.1 s each), left out of (a)'s
# positive-FLOP/s check
UPDATES = 100
COMPARED = 60  # updates whose losses test (b) compares
ALL_OFF = ["--ls-no-cuda-graphs", "--ls-no-fused-fp16-copy", "--ls-no-deferred-overflow-check"]
RUNS = {  # name: (arch, extra, max_update, more)
    "defaults": ("ls_transformer", WIDE + NO_DROPOUT, UPDATES, ["--fp16"] + LONG),
    "off": ("ls_transformer", WIDE + NO_DROPOUT, UPDATES, ["--fp16"] + LONG + ALL_OFF),
    "bf16": ("ls_transformer", WIDE + NO_DROPOUT, UPDATES, ["--bf16"] + LONG),
    "fairseq_model": ("transformer", ["--share-all-embeddings"], 30, ["--fp16", "--no-save"]),
    "contradict": ("ls_transformer", ["--share-all-embeddings"], 5,
                   ["--fp16", "--no-save", "--ls-cuda-graphs", "--ls-no-cuda-graphs"]),
}


def start_all(root, runs=RUNS):
    """Starts every run of ``runs`` at once on the tiny corpus under ``root``; returns {name:
    SimpleNamespace(cmd, save_dir, returncode, log)} once all have ended."""
    data = make_tiny_data(root)
    env = dict(os.environ, PYTHONWARNINGS="ignore", LS_FAIRSEQ_KERNELS="require",
               OMP_NUM_THREADS="2")
    env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)  # the plugin must cope on its own
    started = {}
    for name, (arch, extra, updates, more) in runs.items():
        save_dir = root / name
        cmd = train_cmd(data, save_dir, arch, extra, updates, more=more)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)
        started[name] = (cmd, save_dir, proc)
    done = {}
    for name, (cmd, save_dir, proc) in started.items():
        log = proc.communicate(timeout=900)[0]
        done[name] = SimpleNamespace(cmd=cmd, save_dir=save_dir, returncode=proc.returncode,
                                     log=log)
    return done


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    # built once here, not by five fairseq-train processes at once
    assert _extension.load(), f"CUDA extension failed to build: {_extension.failure_reason()}"
    return start_all(tmp_path_factory.mktemp("fast_defaults"))


def _ok(run):
    assert run.returncode == 0, run.log[-5000:]
    return run.log


def inner_rows(log):
    """{num_updates: {field: text}} of the train_inner lines (``--log-format simple``)."""
    rows = {}
    for line in re.findall(r"\| train_inner \| (.*)", log):
        fields = dict(re.findall(r"(\w+)=([^,\s]+)", line))
        rows[int(fields["num_updates"])] = fields
    return rows


def _losses(rows):
    """The logged losses of the updates that updated the weights, in order (an overflowing
    update is logged under the deferred check, with a non-finite gnorm; fairseq skips it)."""
    return [float(rows[u]["loss"]) for u in sorted(rows)
            if math.isfinite(float(rows[u].get("gnorm", 0.0)))]


def _saved_optimizer(run):
    """The class name of the trainer's optimizer, as fairseq records it in the checkpoint."""
    state = torch.load(run.save_dir / "checkpoint_last.pt", map_location="cpu",
                       weights_only=False)
    return state["optimizer_history"][-1]["optimizer_name"]


def _built_optimizer(run):
    """The optimizer fairseq's trainer builds for ``run``'s command line (its
    ``_build_optimizer`` under --fp16/--bf16: ``FP16Optimizer.build_optimizer(cfg, params)``),
    built here from the same arguments parsed by fairseq's parser."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    argv = run.cmd[len(fairseq_cli("train")):]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    cfg = convert_namespace_to_omegaconf(args)
    dtype = torch.bfloat16 if cfg.common.bf16 else torch.float16
    params = [torch.nn.Parameter(torch.randn(n, device="cuda").to(dtype)) for n in (37, 1001)]
    return FP16Optimizer.build_optimizer(cfg, params)


def test_plain_command_uses_all_three_mechanisms_and_logs_model_flops(runs):
    """(a) The plain ls_ command: graphs captured, LSFusedFP16Optimizer with the deferred check,
    nothing stepped aside, and every train_inner line with positive tflops (and mfu on a GPU of
    known peak)."""
    from ls_fairseq.optim.ls_adam import LSFusedFP16Optimizer

    run = runs["defaults"]
    log = _ok(run)
    assert "--ls-cuda-graphs: captured" in log
    assert "is off for this run" not in log, re.findall(r".*is off for this run.*", log)
    assert _saved_optimizer(run) == "LSFusedFP16Optimizer"
    opt = _built_optimizer(run)
    assert isinstance(opt, LSFusedFP16Optimizer) and opt.defers_host_reads
    rows = inner_rows(log)
    assert sorted(rows) == list(range(1, UPDATES + 1))
    tflops = [float(rows[u]["tflops"]) for u in sorted(rows)]
    assert min(tflops[WARM_UP:]) > 0, tflops
    peak = device_peak_tflops(torch.cuda.current_device())
    if peak is not None:
        mfu = [float(rows[u]["mfu"]) for u in sorted(rows)]
        assert min(mfu[WARM_UP:]) > 0, mfu
        # the same FLOP/s over the same clock, as a percentage of the peak (both rounded)
        for t, m in zip(tflops, mfu):
            assert abs(m - 100 * t / peak) <= 0.05 + 100 * 0.05 / peak + 1e-9, (t, m, peak)
    else:
        print(f"{torch.cuda.get_device_name()}: peak unknown, no mfu logged")
        assert all("mfu" not in r for r in rows.values())


def test_all_three_off_logs_the_same_losses(runs):
    """(b) --ls-no-cuda-graphs --ls-no-fused-fp16-copy --ls-no-deferred-overflow-check: fairseq's
    FP16Optimizer around ls_adam, eager steps, the same losses as the defaults (module docstring:
    0.01, dropout off)."""
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    off, defaults = _ok(runs["off"]), _ok(runs["defaults"])
    assert "--ls-cuda-graphs: captured" not in off and "is off for this run" not in off
    assert _saved_optimizer(runs["off"]) == "FP16Optimizer"
    assert type(_built_optimizer(runs["off"])) is FP16Optimizer
    rows_off, rows_on = inner_rows(off), inner_rows(defaults)
    a, b = _losses(rows_off)[:COMPARED], _losses(rows_on)[:COMPARED]
    assert len(a) == len(b) == COMPARED
    worst = max(abs(x - y) for x, y in zip(a, b))
    skipped = len(rows_on) - len(_losses(rows_on))
    print(f"worst loss difference over {COMPARED} updates: {worst:.3f} ({skipped} overflows "
          f"logged by the deferred check, {off.count('gradient overflow detected')} skipped "
          f"by fairseq's)")
    assert worst <= 0.01, list(zip(a, b))
    assert b[-1] < b[0] - 1.0  # and they learn


def test_bf16_trains_on_the_gpu(runs):
    """(c) --bf16 with an ls_ architecture: bfloat16 on the GPU, no loss scaling, the defaults on
    (graphs, fused copy with the deferred check), and the loss falls as the fp16 run's does."""
    from ls_fairseq.optim.ls_adam import LSFusedFP16Optimizer

    log = _ok(runs["bf16"])
    assert "--bf16: training in bfloat16 on the GPU" in log
    assert "--ls-cuda-graphs: captured" in log and "is off for this run" not in log
    assert _saved_optimizer(runs["bf16"]) == "LSFusedFP16Optimizer"
    opt = _built_optimizer(runs["bf16"])
    assert isinstance(opt, LSFusedFP16Optimizer) and opt.scaler is None and opt.defers_host_reads
    rows = inner_rows(log)
    assert sorted(rows) == list(range(1, UPDATES + 1))
    assert all("loss_scale" not in r for r in rows.values())
    bf16 = _losses(rows)
    fp16 = _losses(inner_rows(_ok(runs["defaults"])))
    end_bf16, end_fp16 = sum(bf16[-10:]) / 10, sum(fp16[-10:]) / 10
    print(f"mean of the last 10 losses: bf16 {end_bf16:.3f}, fp16 {end_fp16:.3f}")
    assert end_bf16 < bf16[0] - 1.0
    assert abs(end_bf16 - end_fp16) <= 0.1 * end_fp16


def test_graphs_step_aside_for_fairseqs_transformer(runs):
    """(d) fairseq's ``transformer`` with the ls_ criterion: exactly one line says why the graphs
    are off, and training goes on eagerly (the fused copy and deferred check still apply)."""
    log = _ok(runs["fairseq_model"])
    lines = re.findall(r".*ls-cuda-graphs is off for this run.*", log)
    assert len(lines) == 1, lines
    assert "TransformerModel" in lines[0] and "--ls-cuda-graphs" in lines[0]
    assert "--ls-cuda-graphs: captured" not in log
    assert "is off for this run" not in log.replace(lines[0], "")
    rows = inner_rows(log)
    assert sorted(rows) == [5, 10, 15, 20, 25, 30]
    assert float(rows[30]["loss"]) < float(rows[5]["loss"])


def test_contradicting_flags_are_refused(runs):
    """(e) --ls-cuda-graphs --ls-no-cuda-graphs: the run stops with the reason."""
    run = runs["contradict"]
    assert run.returncode != 0
    assert "--ls-cuda-graphs and --ls-no-cuda-graphs contradict each other" in run.log, \
        run.log[-3000:]
    assert "train_inner" not in run.log
