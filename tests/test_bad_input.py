"""Every mistake a user can make gets one line that says what to do, on CPU.

One place for the bad inputs, so the list grows with every new flag, variable or tool:

* every ``--ls-*`` option the training parser knows: bad values and contradicting pairs, built
  through fairseq's own option parser and registries (``test_every_ls_flag_has_a_bad_input_case``
  fails for a new flag without a case here);
* a flag that cannot apply to the run (``--ls-fused-fp16-copy`` on fp32, ``--ls-async-stats`` on
  one process, ``--ls-cuda-graphs`` on the CPU, ...) and ``--fp16`` on the CPU: refused by
  fairseq-train before training, one line, exit status 2, no traceback (the decision for every
  flag both ways: tests/test_fast_defaults.py); a default CPU run says once that the CUDA graphs
  step aside; the flags that apply on the CPU train;
* an ``--arch`` typo: fairseq's error, then one line with the nearest names;
* every ``LS_FAIRSEQ_*`` variable the package reads (``ENV_VARS`` in ops/_extension.py; a test
  greps the sources so that list stays complete): refused when the plugin loads, exit status 2;
* ``ls-fairseq-convert`` on missing, unreadable and wrong kinds of files, and missing output
  folders: one line, exit status 2, nothing written;
* resuming a fairseq checkpoint as ls_ without converting: the answer names ls-fairseq-convert;
  an ls_ checkpoint decoded or resumed by plain fairseq (no plugin): fairseq's own errors, which
  docs/TROUBLESHOOTING.md explains (checked against the real messages);
* CPU runs: one line saying that the PyTorch reference path runs (speed-ups need a GPU).

(ls-fairseq-compare's bad inputs: tests/test_compare.py; the quickstart's: below and
tests/test_quickstart.py.)

Two fairseq-train processes show the process-level contract (exit status, no traceback); the
other fairseq-train cases run fairseq-train's own ``cli_main`` path in this process
(:func:`train_in_process`), where the plugin is loaded as ``--user-dir`` loads it.
"""
import argparse
import glob
import logging
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch
from fairseq import criterions, optim, options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq_helpers import DummyTask, make_dictionary
from test_end_to_end import TINY_MODEL, fairseq_cli, make_tiny_data
from test_fast_defaults import parsed_config

import ls_fairseq
from ls_fairseq import training_config
from ls_fairseq.cli import convert_checkpoint, quickstart
from ls_fairseq.ops import _extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.dirname(ls_fairseq.__file__)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LS_FAIRSEQ_")}
    env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    env.update(PYTHONPATH=ROOT, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **extra)
    return env


def _run(cmd, **env):
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(**env), cwd=ROOT,
                          timeout=300)


def _last_line(text):
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


# ---- LS_FAIRSEQ_* environment variables ------------------------------------------------------

def test_env_vars_lists_every_variable_the_package_reads():
    read = set()
    for path in glob.glob(os.path.join(ROOT, "ls_fairseq", "**", "*.py"), recursive=True):
        with open(path, encoding="utf-8") as f:
            read |= set(re.findall(r"LS_FAIRSEQ_[A-Z][A-Z_]*", f.read()))
    assert read == set(_extension.ENV_VARS), "add the variable to ENV_VARS in ops/_extension.py"


@pytest.mark.parametrize("name", sorted(_extension.ENV_VARS))
def test_bad_env_value_is_one_line_naming_the_values(name):
    values = _extension.ENV_VARS[name]
    with pytest.raises(ValueError) as info:
        _extension.check_environment({name: "bogus"})
    message = str(info.value)
    assert "\n" not in message
    assert f"{name}='bogus' is not one of {', '.join(values)}" in message
    assert f"unset {name}" in message
    for value in values:  # every documented value, any case, is accepted; so is empty
        _extension.check_environment({name: f" {value.upper()} "})
    _extension.check_environment({name: ""})


def test_unknown_ls_fairseq_variable_is_refused():
    with pytest.raises(ValueError, match=r"^LS_FAIRSEQ_KERNEL is not a variable ls_fairseq reads "
                                         r"\(it reads LS_FAIRSEQ_ANY_FAIRSEQ, "
                                         r"LS_FAIRSEQ_ATTENTION, .*\): fix its name"):
        _extension.check_environment({"LS_FAIRSEQ_KERNEL": "off"})
    _extension.check_environment({"PATH": "/bin", "LS_FAIRSEQ_KERNELS": "off"})


def test_env_readers_use_the_same_check(monkeypatch):
    from ls_fairseq.ops import _attention_cuda

    monkeypatch.setenv("LS_FAIRSEQ_ATTENTION", "fast")
    with pytest.raises(ValueError, match="LS_FAIRSEQ_ATTENTION='fast' is not one of auto, short, "
                                         "efficient, softmax"):
        _attention_cuda.backend_setting()
    monkeypatch.setenv("LS_FAIRSEQ_ATTENTION", "Short")
    assert _attention_cuda.backend_setting() == "short"
    monkeypatch.setenv("LS_FAIRSEQ_VERBOSE_BUILD", "yes")
    assert _extension.env_flag("LS_FAIRSEQ_VERBOSE_BUILD")


@pytest.mark.parametrize("name,value,values", [
    ("LS_FAIRSEQ_KERNELS", "bogus", "auto, require, off"),
    ("LS_FAIRSEQ_ATTENTION", "fast", "auto, short, efficient, softmax"),
])
def test_bad_env_value_refused_when_the_plugin_loads(name, value, values):
    proc = _run([sys.executable, "-c", "import ls_fairseq"], **{name: value})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert _last_line(proc.stderr) == (
        f"ls_fairseq: {name}={value!r} is not one of {values}: set one of them, or unset {name} "
        f"(default auto)")


# ---- the real fairseq-train -------------------------------------------------------------------

@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return make_tiny_data(tmp_path_factory.mktemp("tiny"))


def _train_cmd(data_bin, save_dir, ls=True, more=()):
    return fairseq_cli("train") + [
        str(data_bin), *(["--user-dir", USER_DIR] if ls else []),
        "--arch", "ls_transformer" if ls else "transformer", *TINY_MODEL,
        "--criterion", "ls_label_smoothed_cross_entropy" if ls else "label_smoothed_cross_entropy",
        "--label-smoothing", "0.1", "--optimizer", "ls_adam" if ls else "adam", "--lr", "1e-3",
        "--max-tokens", "600", "--max-update", "2", "--save-dir", str(save_dir), "--cpu",
        "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "1",
        "--distributed-world-size", "1", "--dropout", "0",
        # no data-loader worker process: a run in this process (train_in_process) leaves its
        # loader to the garbage collector, whose shutdown of a worker stalls a later test ~30 s
        "--num-workers", "0", *more]


def _files(folder):
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_fairseq_train_bad_env_value(data_bin, tmp_path):
    proc = _run(_train_cmd(data_bin, tmp_path / "save"), LS_FAIRSEQ_KERNELS="bogus")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert _last_line(proc.stderr).startswith("ls_fairseq: LS_FAIRSEQ_KERNELS='bogus' is not one "
                                              "of auto, require, off")
    assert _files(tmp_path / "save") == []  # no crash.pt, no checkpoint


def _no_traceback(proc):
    return "Traceback" not in proc.stdout + proc.stderr


def test_fairseq_train_refuses_cuda_graphs_on_the_cpu(data_bin, tmp_path):
    """The process: one line on stderr, exit status 2, no traceback, nothing saved."""
    proc = _run(_train_cmd(data_bin, tmp_path / "save", more=["--ls-cuda-graphs"]))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _no_traceback(proc)
    assert proc.stderr.strip() == (  # the logs go to stdout: stderr is the one line
        "ls_fairseq: --ls-cuda-graphs: the model trains on the CPU (--cpu, or no CUDA GPU "
        "visible to torch), and CUDA graphs need a GPU; drop --ls-cuda-graphs to train without "
        "it")
    assert _files(tmp_path / "save") == []


def train_in_process(argv, level=logging.INFO):
    """fairseq-train's ``cli_main`` with ``argv``, run in this process: fairseq's option parser,
    its config, ``distributed_utils.call_main`` (patch 10) and ``fairseq_cli.train.main``.
    -> (exit status, what it wrote to stderr, the trainers it built, the messages it logged at
    ``level`` and above)."""
    import contextlib
    import io

    from fairseq.distributed import utils as distributed_utils
    from fairseq_cli import train as fairseq_train

    made, logged = [], []

    class Recorded(fairseq_train.Trainer):
        def __init__(self, *args, **kwargs):
            made.append(self)
            super().__init__(*args, **kwargs)

    class Collect(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    handler, root = Collect(level), logging.getLogger()
    err = io.StringIO()
    old_level = root.level
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        mp.setattr(fairseq_train, "Trainer", Recorded)
        # setLevel, not the attribute: it also clears the loggers' cached isEnabledFor answers,
        # which a logger that was asked before (under WARNING) would otherwise keep
        root.setLevel(min(old_level, level))
        root.addHandler(handler)
        try:
            cfg = convert_namespace_to_omegaconf(
                options.parse_args_and_arch(options.get_training_parser(), argv))
            distributed_utils.call_main(cfg, fairseq_train.main)
            code = 0
        except SystemExit as exc:
            code = exc.code
        finally:
            root.removeHandler(handler)
            root.setLevel(old_level)
    return code, err.getvalue(), made, logged


def _argv(data_bin, save_dir, ls=True, more=()):
    return _train_cmd(data_bin, save_dir, ls, more)[3:]  # without "python -c ..."


DROP = "; drop {} to train without it"
#: (flags, the line fairseq-train ends with): the issue's table and the bad values
REFUSED_RUNS = [
    (["--ls-fused-fp16-copy"], "ls_fairseq: --ls-fused-fp16-copy: this run trains in fp32: there "
     "are no fp16/bf16 weight copies to fuse (--fp16 or --bf16 train with them)"
     + DROP.format("--ls-fused-fp16-copy")),
    (["--ls-deferred-overflow-check"], "ls_fairseq: --ls-deferred-overflow-check: it runs inside "
     "ls_adam's fused fp16 copy, which cannot apply: this run trains in fp32: there are no "
     "fp16/bf16 weight copies to fuse (--fp16 or --bf16 train with them)"
     + DROP.format("--ls-deferred-overflow-check")),
    (["--ls-async-stats"], "ls_fairseq: --ls-async-stats: it works between several workers "
     "(GPUs), and this run has one" + DROP.format("--ls-async-stats")),
    (["--ls-copy-engine-all-reduce"], "ls_fairseq: --ls-copy-engine-all-reduce: it moves the "
     "gradients between GPUs, and this run trains on the CPU"
     + DROP.format("--ls-copy-engine-all-reduce")),
    (["--fp16"], "ls_fairseq: --fp16 needs a CUDA GPU (fairseq's FP16Optimizer keeps its fp32 "
     "master weights on it), and this run trains on the CPU (--cpu, or no CUDA GPU visible to "
     "torch): on the CPU train with --bf16, or drop --fp16"),
    (["--ls-shape-buckets", "3"], "ls_fairseq: --ls-shape-buckets must be 0 (no padding) or a "
     "power of two, got 3"),
    # options of fairseq's transformer the ls_ model does not implement
    (["--encoder-layerdrop", "0.1"], "ls_fairseq: ls_transformer does not support "
     "--encoder-layerdrop=0.1; train with fairseq's transformer for this option"),
    (["--ls-fp8-layers", "ffn"], "ls_fairseq: --ls-fp8-layers 'ffn' needs --ls-fp8"),
]


@pytest.mark.parametrize("flags,line", REFUSED_RUNS, ids=[" ".join(f) for f, _ in REFUSED_RUNS])
def test_fairseq_train_refuses_before_training(data_bin, tmp_path, flags, line):
    code, err, trainers, _ = train_in_process(_argv(data_bin, tmp_path / "save", more=flags))
    assert code == 2
    assert err.strip() == line  # the one line, and nothing else on stderr
    assert all(t.get_num_updates() == 0 for t in trainers)
    assert _files(tmp_path / "save") == []


@pytest.fixture(scope="module")
def ls_checkpoint(data_bin, tmp_path_factory):
    """An ls_ checkpoint of a default CPU run (fp32, 2 updates), and that run's trainer and log."""
    save = tmp_path_factory.mktemp("ls_run")
    code, err, trainers, logged = train_in_process(_argv(data_bin, save))
    assert code == 0, err[-3000:]
    return save / "checkpoint_last.pt", trainers[0], logged


GRAPHS_OFF = ("ls-cuda-graphs is off for this run: the model trains on the CPU (--cpu, or no "
              "CUDA GPU visible to torch), and CUDA graphs need a GPU")


def test_a_default_cpu_run_says_once_that_the_cuda_graphs_step_aside(ls_checkpoint):
    ckpt, trainer, logged = ls_checkpoint
    assert [line for line in logged if "is off for this run" in line] == [GRAPHS_OFF]
    assert trainer.get_num_updates() == 2 and ckpt.exists()
    # the run's switches, read once by patch 9: fp32 on the CPU, so no update defers a read
    config = training_config.of(trainer)
    assert config.ls_criterion and config.ls_adam and config.ls_cuda_graphs == "auto"
    assert not config.run.host_reads_deferred


def test_the_flags_that_apply_on_the_cpu_train(data_bin, tmp_path):
    """--bf16 on the CPU: the fused fp16 copy and the deferred overflow check apply (the PyTorch
    path of the same math), and so do the opt-ins --ls-fused-output-ce and --ls-fp8; asked for,
    they run."""
    from ls_fairseq.optim.ls_adam import LSFusedFP16Optimizer

    flags = ["--bf16", "--ls-fused-fp16-copy", "--ls-deferred-overflow-check",
             "--ls-fused-output-ce", "--ls-fp8", "--no-save"]
    code, err, trainers, logged = train_in_process(_argv(data_bin, tmp_path / "save",
                                                         more=flags))
    assert code == 0, err[-3000:]
    trainer = trainers[0]
    assert type(trainer.optimizer) is LSFusedFP16Optimizer and trainer.optimizer.defers_host_reads
    assert training_config.of(trainer).run.host_reads_deferred  # recorded for patch 2
    assert trainer.get_num_updates() == 2
    assert trainer.get_criterion().ls_fused_output_ce and trainer._model.encoder.layers[0].fp8
    assert [line for line in logged if "is off for this run" in line] == [GRAPHS_OFF]


def test_resume_fairseq_checkpoint_as_ls_names_the_converter(data_bin, tmp_path, monkeypatch):
    """fairseq would say "Criterion does not match; please reset the optimizer
    (--reset-optimizer)", dropping the Adam state; the answer is to convert the checkpoint."""
    fs_dir, ls_dir = tmp_path / "fairseq", tmp_path / "ls"
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    code, err, _, _ = train_in_process(_argv(data_bin, fs_dir, ls=False))
    assert code == 0, err[-3000:]
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    ckpt = fs_dir / "checkpoint_last.pt"
    _extension._reset_for_tests()
    code, err, _, logged = train_in_process(
        _argv(data_bin, ls_dir, more=["--restore-file", str(ckpt), "--max-update", "4"]))
    assert code == 2
    converted = fs_dir / "checkpoint_last_ls.pt"
    assert err.strip() == (
        f"ls_fairseq: {ckpt} holds fairseq's criterion/optimizer state "
        "(LabelSmoothedCrossEntropyCriterion, FairseqAdam) and this run uses their twins: "
        f"convert it, keeping the Adam state: ls-fairseq-convert {ckpt} {converted} --to ls, "
        f"then resume with --restore-file {converted}")
    assert not os.path.exists(ls_dir / "checkpoint_last.pt")
    # --cpu: the promised line, once
    assert logged.count("ls_fairseq: on CPU the PyTorch reference path runs (the CUDA kernels' "
                        "math, not their speed): the speed-ups need a CUDA GPU") == 1


#: what plain fairseq (no plugin) answers for an ls_ checkpoint, run by fairseq's own tools
PLAIN_FAIRSEQ = """
import sys
from fairseq_cli import generate, train
for name, tool, argv in [("generate", generate, GENERATE), ("train", train, TRAIN)]:
    sys.argv = ["fairseq-" + name] + argv
    try:
        tool.cli_main()
    except BaseException as exc:  # the last line of the traceback the user sees
        print(name, "|", type(exc).__name__ + ": " + str(exc).splitlines()[0], flush=True)
"""


def test_ls_checkpoint_with_plain_fairseq_is_explained_in_troubleshooting(data_bin, tmp_path,
                                                                         ls_checkpoint):
    """Without the plugin fairseq cannot read an ls_ checkpoint, and nothing of ours runs to say
    why: decoding fails with a bug of fairseq's own error message (IndexError), resuming as
    fairseq's transformer with "Criterion does not match". docs/TROUBLESHOOTING.md gives both
    messages as fairseq prints them, their cause and the fix (--user-dir, or ls-fairseq-convert
    --to fairseq; not --reset-optimizer, which drops the Adam moments)."""
    ckpt = ls_checkpoint[0]
    generate = [str(data_bin), "--path", str(ckpt), "--cpu", "--beam", "2", "--gen-subset", "test"]
    train = _argv(data_bin, tmp_path / "fs", ls=False, more=["--restore-file", str(ckpt),
                                                             "--max-update", "4"])
    code = f"GENERATE = {generate!r}\nTRAIN = {train!r}\n" + PLAIN_FAIRSEQ
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1"),
                          cwd=str(tmp_path), timeout=300)
    seen = dict(line.split(" | ", 1) for line in proc.stdout.splitlines() if " | " in line
                and line.split(" | ", 1)[0] in ("generate", "train"))
    assert seen["generate"] == ("IndexError: Replacement index 1 out of range for positional args "
                                "tuple"), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert seen["train"].startswith("AssertionError: Criterion does not match; please reset the "
                                    "optimizer (--reset-optimizer). "
                                    "LSLabelSmoothedCrossEntropyCriterion vs "
                                    "LabelSmoothedCrossEntropyCriterion")
    with open(os.path.join(ROOT, "docs", "TROUBLESHOOTING.md"), encoding="utf-8") as f:
        doc = f.read()
    for message in seen.values():
        row = [line for line in doc.splitlines() if message.split(". ")[0] in line]
        assert len(row) == 1, message
        assert all(fix in row[0] for fix in ("--user-dir", "ls-fairseq-convert", "--to fairseq"))


def test_arch_typo_names_the_nearest_architectures(capsys):
    with pytest.raises(SystemExit) as info:
        options.parse_args_and_arch(options.get_training_parser(), [
            "/nonexistent", "--arch", "ls_transfomer", "--optimizer", "ls_adam"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "error: argument --arch/-a: invalid choice: 'ls_transfomer'" in err.splitlines()[-2]
    assert err.splitlines()[-1].startswith("ls_fairseq: --arch 'ls_transfomer' is not an "
                                           "architecture; the nearest: ls_transformer")


# ---- the CPU reference path -----------------------------------------------------------------

def test_cpu_runs_say_once_that_the_reference_path_runs(monkeypatch, caplog):
    monkeypatch.delenv("LS_FAIRSEQ_KERNELS", raising=False)
    _extension._reset_for_tests()
    try:
        with caplog.at_level(logging.WARNING, logger=_extension.logger.name):
            _extension.announce_device(argparse.Namespace(cpu=True))
            _extension.announce_device(argparse.Namespace(cpu=True))
        lines = [r.getMessage() for r in caplog.records]
        assert lines == ["ls_fairseq: on CPU the PyTorch reference path runs (the CUDA kernels' "
                         "math, not their speed): the speed-ups need a CUDA GPU"]
        caplog.clear()
        _extension._reset_for_tests()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        with caplog.at_level(logging.WARNING, logger=_extension.logger.name):
            _extension.announce_device(argparse.Namespace(cpu=False))  # a GPU run: nothing
            monkeypatch.setenv("LS_FAIRSEQ_KERNELS", "off")  # the user chose the PyTorch path
            _extension.announce_device(argparse.Namespace(cpu=True))
        assert caplog.records == []
    finally:
        _extension._reset_for_tests()


# ---- --ls-* flags ---------------------------------------------------------------------------

def _build(flags):
    """Parse ``flags`` with fairseq's training parser and build the ls_ criterion and optimizer
    through fairseq's registries, as fairseq-train does."""
    args, _ = parsed_config(*flags)  # fairseq's registries build from the parsed arguments too
    criterions.build_criterion(args, DummyTask(make_dictionary()))
    optim.build_optimizer(args, [torch.nn.Parameter(torch.zeros(3))])


#: (flags, the one line the user sees): "usage: ..." lines are argparse errors (exit status 2),
#: the others the ValueError that ends fairseq-train
FLAG_CASES = [
    (["--ls-cuda-graphs-max", "0"], "--ls-cuda-graphs-max must be >= 1, got 0"),
    (["--ls-cuda-graphs-max", "-3"], "--ls-cuda-graphs-max must be >= 1, got -3"),
    (["--ls-cuda-graphs-max", "many"],
     "usage: argument --ls-cuda-graphs-max: invalid int value: 'many'"),
    (["--ls-shape-buckets", "3"],
     "--ls-shape-buckets must be 0 (no padding) or a power of two, got 3"),
    (["--ls-shape-buckets", "-16"],
     "--ls-shape-buckets must be 0 (no padding) or a power of two, got -16"),
    (["--ls-shape-bucket-slack", "-1"], "--ls-shape-bucket-slack must be >= 0, got -1.0"),
    (["--ls-all-reduce-bucket-mb", "-1"], "--ls-all-reduce-bucket-mb must be >= 0, got -1.0"),
    (["--ls-cuda-graphs-capture", "first"],
     "usage: argument --ls-cuda-graphs-capture: invalid choice: 'first' (choose from 'auto', "
     "'first-sighting', 'second-sighting')"),
    (["--ls-cuda-graphs-memory", "small"],
     "usage: argument --ls-cuda-graphs-memory: invalid choice: 'small' (choose from 'compact', "
     "'grow')"),
    (["--ls-fused-output-ce-chunk", "x"],
     "usage: argument --ls-fused-output-ce-chunk: invalid int value: 'x'"),
    (["--ls-fused-output-ce", "--ls-fused-output-ce-chunk", "-5"],
     "--ls-fused-output-ce-chunk must be >= 0"),
    (["--ls-all-reduce-bucket-mb", "nan"], "--ls-all-reduce-bucket-mb must be >= 0, got nan"),
    (["--ls-shape-bucket-slack", "nan"], "--ls-shape-bucket-slack must be >= 0, got nan"),
    (["--ls-cuda-graphs", "--ls-no-cuda-graphs"],
     "--ls-cuda-graphs and --ls-no-cuda-graphs contradict each other: pass one of them"),
    (["--ls-fused-fp16-copy", "--ls-no-fused-fp16-copy"],
     "--ls-fused-fp16-copy and --ls-no-fused-fp16-copy contradict each other: pass one of them"),
    (["--ls-deferred-overflow-check", "--ls-no-deferred-overflow-check"],
     "--ls-deferred-overflow-check and --ls-no-deferred-overflow-check contradict each other: "
     "pass one of them"),
    (["--ls-async-stats", "--ls-no-async-stats"],
     "--ls-async-stats and --ls-no-async-stats contradict each other: pass one of them"),
    (["--ls-fix-batches-to-gpus", "--ls-no-fix-batches-to-gpus"],
     "--ls-fix-batches-to-gpus and --ls-no-fix-batches-to-gpus contradict each other: pass one of "
     "them"),
    (["--ls-cost-matching-window", "-4"], "--ls-cost-matching-window must be >= 0 (0: off), "
     "got -4"),
    (["--ls-cost-matching-window", "4.5"],
     "usage: argument --ls-cost-matching-window: invalid int value: '4.5'"),
    (["--ls-copy-engine-all-reduce", "--ls-no-copy-engine-all-reduce"],
     "--ls-copy-engine-all-reduce and --ls-no-copy-engine-all-reduce contradict each other: "
     "pass one of them"),
    (["--ls-copy-engine-all-reduce", "--ls-no-cuda-graphs"],
     "--ls-copy-engine-all-reduce: it is part of the CUDA-graph engine; drop --ls-no-cuda-graphs"),
    (["--ls-deferred-overflow-check", "--ls-no-fused-fp16-copy"],
     "--ls-deferred-overflow-check needs the fused fp16 copy: drop --ls-no-fused-fp16-copy"),
    (["--ls-sharded-optimizer-step", "--ls-no-sharded-optimizer-step"],
     "--ls-sharded-optimizer-step and --ls-no-sharded-optimizer-step contradict each other: "
     "pass one of them"),
    (["--ls-sharded-optimizer-step", "--ls-no-fused-fp16-copy"],
     "--ls-sharded-optimizer-step needs the fused fp16 copy: drop --ls-no-fused-fp16-copy"),
    (["--ls-sharded-optimizer-step", "--fp16-adam-stats"],
     "--ls-sharded-optimizer-step does not support --fp16-adam-stats (its moment scales are per "
     "tensor, not per shard)"),
    # (where it cannot apply at run time: tests/test_sharded_step.py)
    # (its need for --ls-fp8 is checked when the model is built: tests/test_fp8_linear.py)
    (["--ls-fp8", "--ls-fp8-layers", "ffn,mlp"],
     "usage: argument --ls-fp8-layers: 'ffn,mlp': a comma-separated list of attention, ffn "
     "(unknown: mlp)"),
    (["--ls-fp8", "--ls-fp8-layers", ""],
     "usage: argument --ls-fp8-layers: '': a comma-separated list of attention, ffn (unknown: "
     "none given)"),
]
#: --ls-* switches that take no value (their contradicting pairs are cases above)
SWITCHES = {"--ls-fused-output-ce", "--ls-async-stats", "--ls-cuda-graphs", "--ls-no-cuda-graphs",
            "--ls-fused-fp16-copy", "--ls-no-fused-fp16-copy", "--ls-deferred-overflow-check",
            "--ls-no-deferred-overflow-check", "--ls-fp8", "--ls-sharded-optimizer-step",
            "--ls-no-sharded-optimizer-step"}


def _case_id(case):
    flags = case.values[0] if hasattr(case, "values") else case[0]
    return " ".join(flags)


@pytest.mark.parametrize("flags,line", FLAG_CASES, ids=[_case_id(c) for c in FLAG_CASES])
def test_bad_flag_is_one_line_naming_flag_and_limit(flags, line, capsys):
    if line.startswith("usage: "):
        with pytest.raises(SystemExit) as info:
            _build(flags)
        assert info.value.code == 2
        assert _last_line(capsys.readouterr().err).endswith("error: " + line[len("usage: "):])
    else:
        with pytest.raises(ValueError) as info:
            _build(flags)
        assert str(info.value) == line or str(info.value).startswith(line)
        assert "\n" not in str(info.value)
        assert flags[0] in str(info.value)


def test_every_ls_flag_has_a_bad_input_case():
    parser = options.get_training_parser()
    options.parse_args_and_arch(parser, [
        "/nonexistent", "--arch", "ls_transformer", "--task", "translation", "--criterion",
        "ls_label_smoothed_cross_entropy", "--optimizer", "ls_adam"])
    ls_flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--ls-")}
    covered = SWITCHES | {f for case in FLAG_CASES
                          for f in (case.values[0] if hasattr(case, "values") else case[0])
                          if f.startswith("--ls-")}
    assert ls_flags - covered == set(), "add a bad-input case for the new flag(s) to FLAG_CASES"


# ---- ls-fairseq-convert ---------------------------------------------------------------------

def _fake_checkpoint(arch="ls_transformer"):
    """The parts of a fairseq checkpoint the converter reads (no weights needed)."""
    return {"model": {"w": torch.zeros(2)}, "args": None,
            "cfg": {"model": argparse.Namespace(_name=arch, arch=arch), "common": {"user_dir": "x"},
                    "criterion": {"_name": "ls_label_smoothed_cross_entropy"},
                    "optimizer": {"_name": "ls_adam"}},
            "optimizer_history": [{"criterion_name": "LSLabelSmoothedCrossEntropyCriterion",
                                   "optimizer_name": "FairseqLSAdam"}]}


class Foreign:
    """A type no fairseq checkpoint holds."""


def _bad_inputs(tmp):
    (tmp / "notes.txt").write_text("these are my notes\n")
    (tmp / "list.txt").write_text("a\nb\n")
    torch.save({"model": {}, "cfg": {"x": Foreign()}}, tmp / "foreign.pt")
    with open(tmp / "pickle.pkl", "wb") as f:
        pickle.dump({"model": {}}, f, protocol=4)
    torch.save(torch.ones(3), tmp / "tensor.pt")
    torch.save({"weights": torch.ones(3)}, tmp / "dict.pt")
    torch.save(_fake_checkpoint(), tmp / "ls.pt")
    torch.save(_fake_checkpoint("lstm"), tmp / "lstm.pt")
    (tmp / "folder").mkdir()
    return tmp


CONVERT_CASES = [  # (input, output, --to, the error after "ls-fairseq-convert: error: ")
    ("notes.txt", "out/x.pt", "ls", r"not a fairseq checkpoint: {t}/notes.txt \(not a file "
                                    r"written by torch.save\)"),
    ("list.txt", "out/x.pt", "ls", r"not a fairseq checkpoint: {t}/list.txt \(not a file written "
                                   r"by torch.save\)"),
    ("foreign.pt", "out/x.pt", "ls", r"not a fairseq checkpoint: {t}/foreign.pt \(it holds "
                                     r"test_bad_input.Foreign, not a type of fairseq's "
                                     r"checkpoints\)"),
    ("pickle.pkl", "out/x.pt", "ls", r"not a fairseq checkpoint: {t}/pickle.pkl \(torch.load "
                                     r"failed: Unsupported operand \d+\)"),
    ("tensor.pt", "out/x.pt", "ls", r"not a fairseq checkpoint: {t}/tensor.pt holds a Tensor, not "
                                    r"fairseq's dict of 'model', 'cfg', 'optimizer_history', ..."),
    ("dict.pt", "out/x.pt", "ls", r"not a fairseq checkpoint: {t}/dict.pt has no 'model' and 'cfg' "
                                  r"entries \(its keys: weights\)"),
    ("missing.pt", "out/x.pt", "ls", r"input {t}/missing.pt does not exist"),
    ("folder", "out/x.pt", "ls", r"input {t}/folder is a folder, not a checkpoint file"),
    ("ls.pt", "nowhere/x.pt", "fairseq", r"output folder {t}/nowhere does not exist: create it "
                                         r"first"),
    ("ls.pt", "out", "fairseq", r"output {t}/out is a folder: give the file name to write"),
    ("ls.pt", "out/x.pt", "ls", r"{t}/ls.pt: architecture 'ls_transformer' is already an ls_ "
                                r"architecture; --to fairseq converts the other way"),
    ("lstm.pt", "out/x.pt", "ls", r"{t}/lstm.pt: fairseq architecture 'lstm' has no ls_ twin; "
                                  r"supported: transformer, .*"),
]


@pytest.mark.parametrize("src,dst,to,error", CONVERT_CASES, ids=[c[0] + ">" + c[1]
                                                                 for c in CONVERT_CASES])
def test_convert_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, src, dst, to,
                                                              error):
    _bad_inputs(tmp_path)
    (tmp_path / "out").mkdir()
    before = _files(tmp_path), _files(tmp_path / "out")
    with pytest.raises(SystemExit) as info:
        convert_checkpoint.main([str(tmp_path / src), str(tmp_path / dst), "--to", to])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert re.fullmatch("ls-fairseq-convert: error: " + error.format(t=re.escape(str(tmp_path))),
                        err.strip()), err
    assert (_files(tmp_path), _files(tmp_path / "out")) == before


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root reads every file")
def test_convert_unreadable_input(tmp_path, capsys):
    torch.save(_fake_checkpoint(), tmp_path / "ls.pt")
    os.chmod(tmp_path / "ls.pt", 0)
    with pytest.raises(SystemExit) as info:
        convert_checkpoint.main([str(tmp_path / "ls.pt"), str(tmp_path / "x.pt"), "--to", "fairseq"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == (f"ls-fairseq-convert: error: cannot read input "
                                               f"{tmp_path}/ls.pt: permission denied")
    assert not (tmp_path / "x.pt").exists()


def test_convert_writes_a_good_input(tmp_path, capsys):
    torch.save(_fake_checkpoint(), tmp_path / "ls.pt")
    assert convert_checkpoint.main([str(tmp_path / "ls.pt"), str(tmp_path / "fs.pt"),
                                    "--to", "fairseq"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path}/fs.pt with arch transformer"
    assert _files(tmp_path) == ["fs.pt", "ls.pt"]  # no temporary file left
    state = torch.load(tmp_path / "fs.pt", weights_only=True)
    assert state["cfg"]["model"] == {"_name": "transformer", "arch": "transformer"}
    assert state["optimizer_history"][-1] == {"criterion_name": "LabelSmoothedCrossEntropyCriterion",
                                              "optimizer_name": "FairseqAdam"}


def test_convert_command_line_bad_input(tmp_path):
    (tmp_path / "notes.txt").write_text("these are my notes\n")
    proc = _run([sys.executable, "-m", "ls_fairseq.cli.convert_checkpoint",
                 str(tmp_path / "notes.txt"), str(tmp_path / "out.pt"), "--to", "ls"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert _last_line(proc.stderr).startswith(
        f"ls-fairseq-convert: error: not a fairseq checkpoint: {tmp_path}/notes.txt")
    assert _files(tmp_path) == ["notes.txt"]


def test_convert_reads_its_arguments_before_importing_torch():
    """--help and usage errors must not wait for torch and fairseq (seconds): the module imports
    them only after argparse. (Loaded by path, without the package's own imports.)"""
    path = os.path.join(ROOT, "ls_fairseq", "cli", "convert_checkpoint.py")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('convert_probe', {path!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "for argv in (['--help'], ['a.pt'], ['a.pt', 'b.pt', '--to', 'both']):\n"
        "    try:\n"
        "        module.main(argv)\n"
        "    except SystemExit as exc:\n"
        "        print('exit', exc.code)\n"
        "print('torch' in sys.modules, 'fairseq' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(), cwd=ROOT, timeout=60)
    assert proc.stdout.splitlines()[-4:] == ["exit 0", "exit 2", "exit 2", "False False"], \
        proc.stdout + proc.stderr
    assert "error: the following arguments are required: output, --to" in proc.stderr
    assert "error: argument --to: invalid choice: 'both'" in proc.stderr


def test_convert_help_through_the_package_imports_neither_torch_nor_fairseq():
    """As the installed console script runs it (``sys.argv[0]`` is the tool's name): the package
    import registers nothing for the plugin's own tools, so --help stays instant."""
    code = ("import sys; sys.argv = ['/usr/bin/ls-fairseq-convert', '--help']\n"
            "from ls_fairseq.cli.convert_checkpoint import main\n"
            "try:\n    main()\nexcept SystemExit as exc:\n    print('exit', exc.code)\n"
            "print('torch' in sys.modules, 'fairseq' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(), cwd=ROOT, timeout=60)
    assert proc.stdout.splitlines()[-2:] == ["exit 0", "False False"], proc.stdout + proc.stderr


# ---- ls-fairseq-quickstart ------------------------------------------------------------------

@pytest.mark.parametrize("argv,error", [
    (["--runs", "baseline,fast"], "--runs 'baseline,fast': choose from baseline, ls "
                                  "(comma-separated)"),
    (["--runs", ","], "--runs ',': choose from baseline, ls (comma-separated)"),
    (["--size", "huge"], "argument --size: invalid choice: 'huge' (choose from 'base', 'big', "
                         "'tiny')"),
])
def test_quickstart_usage_errors(argv, error, capsys):
    with pytest.raises(SystemExit) as info:
        quickstart.parse_args(argv)
    assert info.value.code == 2
    assert _last_line(capsys.readouterr().err) == "ls-fairseq-quickstart: error: " + error


def test_quickstart_workdir_is_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as info:
        quickstart.parse_args(["--workdir", str(tmp_path / "file")])
    assert info.value.code == 2
    assert _last_line(capsys.readouterr().err) == (
        f"ls-fairseq-quickstart: error: --workdir {tmp_path}/file is a file: give a folder")


def test_quickstart_device_cuda_without_gpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert quickstart.main(["--device", "cuda", "--workdir", str(tmp_path / "qs")]) == 2
    assert capsys.readouterr().err.strip() == ("ls-fairseq-quickstart: error: --device cuda: "
                                               "torch sees no GPU; use --device cpu or auto")
    assert not (tmp_path / "qs").exists()
