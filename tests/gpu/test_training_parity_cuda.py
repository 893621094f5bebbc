"""Many updates of real fairseq-train on the GPU, in lockstep: the ls_ components against fairseq's.

One step agreeing is necessary, not sufficient (issue 34: models trained with the ls_ components
were reported to translate worse at the same loss). Here fairseq's ``transformer`` is trained
from the same seed on the same batches with the same dropout masks, once with fairseq's
``label_smoothed_cross_entropy`` + ``adam`` and once with ``ls_label_smoothed_cross_entropy`` +
``ls_adam`` (the CUDA cross-entropy with its in-place backward, the multi-tensor Adam kernel
under fairseq's FP16Optimizer, and again with ``--ls-fused-fp16-copy``), for 60 updates at
``--fp16`` across two epoch ends (validation and checkpoint saving in between). Their training
runs must stay in lockstep: every update's logged loss within 0.005 (fairseq logs three
decimals), the same loss scale (the same overflows), the grad norm within 1%, the same
validation losses within 0.01. Any systematic difference in the criterion's gradient or in the
optimizer's step compounds over the updates and breaks this; rounding alone does not within 60
updates (measured: ≤ 0.001 over 200 updates on Multi30k with the base Transformer).

The ls_ model itself draws its dropout masks differently, so it is compared with dropout off:
``ls_transformer`` + ls criterion + ``ls_adam`` against fairseq's three, 30 updates within 0.01.
"""
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import ls_fairseq

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
USER_DIR = os.path.dirname(os.path.abspath(ls_fairseq.__file__))
MODEL = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "128",
         "--decoder-embed-dim", "128", "--encoder-ffn-embed-dim", "512",
         "--decoder-ffn-embed-dim", "512", "--encoder-attention-heads", "4",
         "--decoder-attention-heads", "4"]
RUNS = {
    "fairseq": ("transformer", "label_smoothed_cross_entropy", "adam", "0.3", []),
    "ls_parts": ("transformer", "ls_label_smoothed_cross_entropy", "ls_adam", "0.3", []),
    "ls_parts_fused_copy": ("transformer", "ls_label_smoothed_cross_entropy", "ls_adam", "0.3",
                            ["--ls-fused-fp16-copy"]),
    "fairseq_no_dropout": ("transformer", "label_smoothed_cross_entropy", "adam", "0.0", []),
    "ls_no_dropout": ("ls_transformer", "ls_label_smoothed_cross_entropy", "ls_adam", "0.0", []),
}
UPDATES = 60


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import learnable_corpus

    work = tmp_path_factory.mktemp("parity")
    learnable_corpus.write_corpus(work / "text", train=4000, valid=200, test=10)
    subprocess.run([sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "en",
                    "--target-lang", "de", "--trainpref", str(work / "text" / "train"),
                    "--validpref", str(work / "text" / "valid"), "--destdir", str(work / "bin"),
                    "--joined-dictionary", "--workers", "4"], check=True, capture_output=True)

    def train(name):
        arch, criterion, optimizer, dropout, flags = RUNS[name]
        cmd = [sys.executable, "-m", "fairseq_cli.train", str(work / "bin"), "--arch", arch,
               "--share-all-embeddings", "--criterion", criterion, "--label-smoothing", "0.1",
               "--optimizer", optimizer, "--adam-betas", "(0.9, 0.98)", "--lr", "1e-3",
               "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "40", "--weight-decay",
               "0.0001", "--dropout", dropout, "--max-tokens", "2048", "--max-update",
               str(UPDATES), "--fp16", "--seed", "1", "--save-dir", str(work / name),
               "--no-epoch-checkpoints", "--log-format", "json", "--log-interval", "1",
               "--no-progress-bar", "--num-workers", "0", "--user-dir", USER_DIR] + MODEL + flags
        p = subprocess.run(cmd, capture_output=True, text=True,
                           env=dict(os.environ, LS_FAIRSEQ_KERNELS="require", OMP_NUM_THREADS="1"))
        out = p.stdout + p.stderr
        assert p.returncode == 0, out[-3000:]
        inner = [json.loads(m) for m in re.findall(r"\| train_inner \| (\{.*\})", out)]
        valid = [float(json.loads(m)["valid_loss"])
                 for m in re.findall(r"\| valid \| (\{.*\})", out)]
        return name, ({int(r["num_updates"]): r for r in inner}, valid)

    with ThreadPoolExecutor(len(RUNS)) as pool:
        return dict(pool.map(train, RUNS))


def _lockstep(logs, ref, other, updates, tol, gnorm_tol):
    a, b = logs[ref][0], logs[other][0]
    assert set(range(1, updates + 1)) <= set(a) and set(range(1, updates + 1)) <= set(b)
    for u in range(1, updates + 1):
        ra, rb = a[u], b[u]
        assert abs(float(ra["loss"]) - float(rb["loss"])) <= tol, (u, ra, rb)
        assert float(ra["loss_scale"]) == float(rb["loss_scale"]), (u, ra, rb)
        assert abs(float(rb["gnorm"]) / float(ra["gnorm"]) - 1) <= gnorm_tol, (u, ra, rb)


@pytest.mark.parametrize("name", ["ls_parts", "ls_parts_fused_copy"])
def test_ls_criterion_and_adam_train_in_lockstep_with_fairseqs(logs, name):
    _lockstep(logs, "fairseq", name, UPDATES, tol=0.005, gnorm_tol=0.01)
    valid_ref, valid = logs["fairseq"][1], logs[name][1]
    assert len(valid) == len(valid_ref) >= 2  # at least one epoch end before the last update
    assert all(abs(x - y) <= 0.01 for x, y in zip(valid, valid_ref)), (valid, valid_ref)


def test_ls_model_without_dropout_follows_fairseqs(logs):
    _lockstep(logs, "fairseq_no_dropout", "ls_no_dropout", 30, tol=0.01, gnorm_tol=0.02)
