"""ls-fairseq-convert and resuming across the two sides, with the real fairseq-train (CPU).

* a checkpoint converted ``--to fairseq`` loads on a machine with plain fairseq under torch >= 2.6
  (``weights_only=True``) without ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` and without the plugin:
  fairseq's own ``load_checkpoint_to_cpu`` / ``load_model_ensemble_and_task`` and
  ``fairseq-generate``, and ``fairseq-train --restore-file``;
* a fairseq ``transformer``/``adam`` checkpoint converted ``--to ls`` resumes as ls_ with the
  Adam state: the losses are fairseq's own continuation, digit for digit;
* under ``--fp16``, the checkpoint's ``FP16Optimizer`` and ls_adam's ``LSFusedFP16Optimizer``
  (the fused fp16 copy, on by default) resume into each other (``fairseq_patches``, patch 4).

Bad inputs (wrong files, missing folders, unconverted resumes) are in tests/test_bad_input.py.
"""
import os
import re
import shutil
import sys

import fork_cli
import pytest
from test_end_to_end import TINY_MODEL, fairseq_cli

import ls_fairseq
from ls_fairseq.cli import convert_checkpoint

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.dirname(ls_fairseq.__file__)
FP16 = ["--fp16", "--fp16-no-flatten-grads"]  # fairseq's fp16 on CPU needs unflattened grads


def _env(weights_only_off=False):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LS_FAIRSEQ_")}
    env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    if weights_only_off:  # plain fairseq reading its own checkpoints under torch >= 2.6
        env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    env.update(PYTHONPATH=ROOT, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return env


def run(cmd, weights_only_off=False, cwd=None, stdout_only=False):
    proc = fork_cli.run(cmd, env=_env(weights_only_off), cwd=cwd or ROOT, timeout=600)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}:\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
    return proc.stdout if stdout_only else proc.stdout + proc.stderr


def train(data_bin, save_dir, ls, max_update, more=(), weights_only_off=False):
    return run(fairseq_cli("train") + [
        str(data_bin), *(["--user-dir", USER_DIR] if ls else []),
        "--arch", "ls_transformer" if ls else "transformer", *TINY_MODEL,
        "--criterion", "ls_label_smoothed_cross_entropy" if ls else "label_smoothed_cross_entropy",
        "--label-smoothing", "0.1", "--optimizer", "ls_adam" if ls else "adam", "--lr", "1e-3",
        "--adam-betas", "(0.9, 0.98)", "--max-tokens", "600", "--max-update", str(max_update),
        "--save-dir", str(save_dir), "--cpu", "--no-epoch-checkpoints", "--log-format", "simple",
        "--log-interval", "1", "--distributed-world-size", "1", "--dropout", "0", "--seed", "2",
        *more], weights_only_off=weights_only_off)


def convert(src, dst, to):
    assert convert_checkpoint.main([str(src), str(dst), "--to", to]) == 0


def logged(log):
    """(num_updates, loss, nll_loss, gnorm) of every train_inner line."""
    return [tuple(re.search(rf"\b{k}=([\d.]+)", line).group(1)
                  for k in ("num_updates", "loss", "nll_loss", "gnorm"))
            for line in re.findall(r"train_inner .*", log)]


def generate(data_bin, checkpoint, ls):
    out = run(fairseq_cli("generate") + [
        str(data_bin), "--path", str(checkpoint), "--beam", "3", "--batch-size", "8",
        "--gen-subset", "test", "--cpu", *(["--user-dir", USER_DIR] if ls else [])])
    hyps = dict(re.findall(r"^H-(\d+)\t\S+\t(.*)$", out, re.M))
    assert hyps, out[-2000:]
    return hyps


PLAIN_FAIRSEQ_LOAD = """
import sys, torch
from fairseq import checkpoint_utils
path = sys.argv[1]
try:
    checkpoint_utils.load_checkpoint_to_cpu(path)
except Exception as exc:
    print("refused:", str(exc).splitlines()[0])
    sys.exit(0)
models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([path])
print("loaded", type(models[0]).__name__, "ls_fairseq" in sys.modules)
"""


def test_converted_to_fairseq_loads_on_plain_fairseq_under_weights_only(data_bin, tmp_path):
    import torch

    assert tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 6), \
        "this test needs torch's weights_only default (torch >= 2.6)"
    train(data_bin, tmp_path / "ls", ls=True, max_update=3)
    ls_ckpt, fs_ckpt = tmp_path / "ls" / "checkpoint_last.pt", tmp_path / "fs.pt"
    convert(ls_ckpt, fs_ckpt, "fairseq")
    def plain_fairseq_load(path):  # a process that never imports the plugin
        return run([sys.executable, "-c", PLAIN_FAIRSEQ_LOAD, str(path)], cwd=tmp_path,
                   stdout_only=True).splitlines()[-1]

    # the ls_ checkpoint itself needs the plugin's allow-list (or the variable) ...
    assert plain_fairseq_load(ls_ckpt).startswith("refused: Weights only load failed")
    # ... the converted one loads with fairseq alone, as fairseq's transformer
    assert plain_fairseq_load(fs_ckpt) == "loaded TransformerModel False"
    # (same hypotheses as the ls_ model: tests/test_end_to_end.py, on a trained model)
    assert len(generate(data_bin, fs_ckpt, ls=False)) == 24
    # and plain fairseq-train resumes it (weights and Adam state)
    log = train(data_bin, tmp_path / "fs_run", ls=False, max_update=5,
                more=["--restore-file", str(fs_ckpt)])
    assert re.search(r"Loaded checkpoint .*fs.pt \(epoch 1 @ 3 updates\)", log)
    assert [u for u, *_ in logged(log)] == ["4", "5"]


def test_converted_to_ls_resumes_as_fairseqs_own_continuation(data_bin, tmp_path):
    train(data_bin, tmp_path / "fs", ls=False, max_update=3, weights_only_off=True)
    shutil.copytree(tmp_path / "fs", tmp_path / "fs_cont")
    fairseq_log = train(data_bin, tmp_path / "fs_cont", ls=False, max_update=6,
                        weights_only_off=True)
    ls_ckpt = tmp_path / "ls.pt"
    convert(tmp_path / "fs" / "checkpoint_last.pt", ls_ckpt, "ls")
    ls_log = train(data_bin, tmp_path / "ls", ls=True, max_update=6,
                   more=["--restore-file", str(ls_ckpt)])
    assert re.search(r"Loaded checkpoint .*ls.pt \(epoch 1 @ 3 updates\)", ls_log)
    assert len(logged(fairseq_log)) == 3
    assert logged(ls_log) == logged(fairseq_log)  # loss, nll_loss, gnorm to the last digit


def test_fp16_optimizer_state_moves_between_fairseq_and_fused_copy(data_bin, tmp_path):
    train(data_bin, tmp_path / "fs", ls=False, max_update=3, more=FP16, weights_only_off=True)
    ls_ckpt = tmp_path / "ls.pt"
    convert(tmp_path / "fs" / "checkpoint_last.pt", ls_ckpt, "ls")  # records LSFusedFP16Optimizer
    fused = train(data_bin, tmp_path / "fused", ls=True, max_update=5,
                  more=FP16 + ["--restore-file", str(ls_ckpt)])
    # without the fused copy ls_adam runs in fairseq's FP16Optimizer: the same state, loaded
    unfused = train(data_bin, tmp_path / "unfused", ls=True, max_update=5,
                    more=FP16 + ["--restore-file", str(ls_ckpt), "--ls-no-fused-fp16-copy"])
    assert "ls_fairseq: the checkpoint's optimizer state was saved by LSFusedFP16Optimizer; " \
           "FP16Optimizer keeps the same state: loading it" in unfused
    for log in (fused, unfused):
        assert re.search(r"Loaded checkpoint .*ls.pt \(epoch 1 @ 3 updates\)", log)
        assert "loss_scale=128" in log  # the scaler's state came along
    assert [row[:2] for row in logged(fused)] == [row[:2] for row in logged(unfused)]
    # and back: the ls_ fp16 checkpoint converted to fairseq resumes on plain fairseq
    fs_ckpt = tmp_path / "back.pt"
    convert(tmp_path / "fused" / "checkpoint_last.pt", fs_ckpt, "fairseq")
    log = train(data_bin, tmp_path / "fs_again", ls=False, max_update=7,
                more=FP16 + ["--restore-file", str(fs_ckpt)])
    assert re.search(r"Loaded checkpoint .*back.pt \(epoch 1 @ 5 updates\)", log)
