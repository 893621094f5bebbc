"""Real fairseq-train / fairseq-generate runs with --user-dir on a tiny generated corpus (CPU).

Covers: every ls_ architecture trains with ls_label_smoothed_cross_entropy + ls_adam, saves,
resumes from its checkpoint, and decodes with beam search; --memory-efficient-fp16; a checkpoint
converted to fairseq's architecture generates the same hypotheses (fairseq-generate, and
fairseq-interactive through ls_fairseq's own beam search); checkpoints load under
torch>=2.6 without TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD; several gloo workers log what one worker
logs, and four workers' checkpoint resumes on one.

Every command runs as its own process (tests/fork_cli.py: forked from a server that has torch
and fairseq imported, where no CUDA device is visible; a fresh interpreter otherwise). The tiny
corpus and one trained model are shared by the whole test run (tests/conftest.py's ``data_bin``
and ``trained``, built by :func:`make_tiny_data` and :class:`Trained`).
"""
import os
import random
import re
import sys

import fork_cli
import pytest

import ls_fairseq

pytestmark = pytest.mark.slow
USER_DIR = os.path.dirname(ls_fairseq.__file__)
TINY_MODEL = [
    "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32",
    "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "48", "--decoder-ffn-embed-dim", "48",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
]
ARCHS = [
    ("ls_transformer", ["--share-all-embeddings"]),
    ("ls_transformer_iwslt_de_en", []),
    ("ls_transformer_wmt_en_de", ["--share-decoder-input-output-embed"]),
    ("ls_transformer_vaswani_wmt_en_de_big", ["--share-all-embeddings", "--encoder-learned-pos",
                                              "--decoder-learned-pos"]),
    ("ls_transformer_vaswani_wmt_en_fr_big", ["--share-all-embeddings"]),
    ("ls_transformer_wmt_en_de_big", ["--share-all-embeddings", "--activation-fn", "gelu"]),
    ("ls_transformer_wmt_en_de_big_t2t", ["--share-all-embeddings"]),
]


def _env(plain_fairseq=False):
    env = dict(os.environ)
    env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)  # the plugin must cope on its own
    if plain_fairseq:  # fairseq alone cannot load any checkpoint under torch>=2.6 without it
        env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run(cmd, plain_fairseq=False):
    proc = fork_cli.run(cmd, env=_env(plain_fairseq))
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc.stdout + proc.stderr


def fairseq_cli(name):
    return [sys.executable, "-c", f"import sys; from fairseq_cli.{name} import cli_main; "
            "sys.argv[0] = 'fairseq'; cli_main()"]


def make_tiny_data(root):
    """A reversal task: learnable in a few hundred updates, with varied lengths; binarised into
    ``root / "bin"``."""
    rng = random.Random(0)
    words = [f"w{i}" for i in range(30)]
    for split, n in (("train", 400), ("valid", 40), ("test", 24)):
        with open(root / f"{split}.src", "w") as fs, open(root / f"{split}.tgt", "w") as ft:
            for _ in range(n):
                sent = [rng.choice(words) for _ in range(rng.randint(1, 11))]
                fs.write(" ".join(sent) + "\n")
                ft.write(" ".join(reversed(sent)) + "\n")
    run(fairseq_cli("preprocess") + [
        "--source-lang", "src", "--target-lang", "tgt", "--trainpref", str(root / "train"),
        "--validpref", str(root / "valid"), "--testpref", str(root / "test"),
        "--destdir", str(root / "bin"), "--joined-dictionary", "--workers", "1"])
    return root / "bin"


def train(data_bin, save_dir, arch, extra, max_update, criterion="ls_label_smoothed_cross_entropy",
          optimizer="ls_adam", more=(), plain_fairseq=False):
    return run(train_cmd(data_bin, save_dir, arch, extra, max_update, criterion, optimizer, more,
                         plain_fairseq), plain_fairseq=plain_fairseq)


def train_cmd(data_bin, save_dir, arch, extra, max_update,
              criterion="ls_label_smoothed_cross_entropy", optimizer="ls_adam", more=(),
              plain_fairseq=False):
    """The fairseq-train command of :func:`train` (later flags in ``more`` override earlier
    ones)."""
    return fairseq_cli("train") + [
        str(data_bin), *([] if plain_fairseq else ["--user-dir", USER_DIR]), "--arch", arch,
        *TINY_MODEL, *extra,
        "--criterion", criterion, "--label-smoothing", "0.1", "--optimizer", optimizer,
        "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.0001", "--lr", "2e-3",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "20", "--max-tokens", "600",
        "--max-update", str(max_update), "--save-dir", str(save_dir), "--seed", "3",
        "--log-format", "simple", "--log-interval", "5", "--no-epoch-checkpoints",
        "--report-accuracy", "--distributed-world-size", "1",  # fairseq's default: every GPU
        *more]


#: the run behind tests/conftest.py's session fixture ``trained`` (one per test run): the
#: architecture and flags of the loss-curve comparison with fairseq, long enough that beam search
#: gives varied, mostly stable hypotheses (bf16 against fp32 decoding)
TRAINED_ARCH = "ls_transformer_wmt_en_de_big_t2t"
TRAINED_EXTRA = ["--share-all-embeddings", "--dropout", "0.1"]
TRAINED_UPDATES = 200


class Trained:
    """The shared trained model: ``checkpoint`` (checkpoint_last.pt) and the run's ``log``."""

    def __init__(self, data_bin, save_dir):
        self.log = train(data_bin, save_dir, TRAINED_ARCH, TRAINED_EXTRA, TRAINED_UPDATES)
        self.checkpoint = save_dir / "checkpoint_last.pt"


def train_trained(data_bin, save_dir):
    return Trained(data_bin, save_dir)


def generate(data_bin, checkpoint, user_dir=True, extra=()):
    out = run(fairseq_cli("generate") + [
        str(data_bin), "--path", str(checkpoint), "--beam", "4", "--batch-size", "7",
        "--gen-subset", "test", "--seed", "1", "--print-alignment"]
        + (["--user-dir", USER_DIR] if user_dir else []) + list(extra), plain_fairseq=not user_dir)
    hyps = dict(re.findall(r"^H-(\d+)\t\S+\t(.*)$", out, re.M))
    assert hyps, out[-2000:]
    return hyps, out


def losses(log):
    return [float(x) for x in re.findall(r"train_inner .* loss=([\d.]+)", log)]


@pytest.mark.parametrize("arch,extra", ARCHS, ids=[a for a, _ in ARCHS])
def test_train_resume_generate(data_bin, tmp_path, arch, extra):
    log = train(data_bin, tmp_path, arch, extra, max_update=30)
    assert "num_updates 30" in log or "num_updates=30" in log
    assert (tmp_path / "checkpoint_last.pt").exists()
    resumed = train(data_bin, tmp_path, arch, extra, max_update=40)
    assert re.search(r"Loaded checkpoint .*checkpoint_last.pt .*@ 30 updates", resumed), resumed[-2000:]
    assert "num_updates 40" in resumed or "num_updates=40" in resumed
    hyps, out = generate(data_bin, tmp_path / "checkpoint_last.pt")
    assert len(hyps) >= 12
    assert "A-0" in out  # alignments come from the decoder's cross-attention weights


def _interactive(data_bin, checkpoint, lines, user_dir=True):
    proc = fork_cli.run(
        fairseq_cli("interactive") + [str(data_bin), "--path", str(checkpoint), "--beam", "3",
                                      "--source-lang", "src", "--target-lang", "tgt",
                                      "--buffer-size", "3", "--batch-size", "2"]
        + (["--user-dir", USER_DIR] if user_dir else []),
        input="".join(line + "\n" for line in lines), env=_env(plain_fairseq=not user_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_interactive_matches_fairseq(data_bin, trained, tmp_path):
    """fairseq-interactive with an ls_ checkpoint decodes with LSSequenceGenerator, in buffers of
    several batches, and prints the hypotheses of fairseq-interactive with the same checkpoint
    converted to fairseq's transformer (fp32, CPU: same tokens; scores printed within 1e-5)."""
    ls_ckpt, fs_ckpt = trained.checkpoint, tmp_path / "as_fairseq.pt"
    run([sys.executable, "-m", "ls_fairseq.cli.convert_checkpoint", str(ls_ckpt), str(fs_ckpt),
         "--to", "fairseq"])
    lines = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9 w10 w11", "w2", "w3 w3 w5 w7 w1", "w9 w8 w7 w6"]
    ours, theirs = (_interactive(data_bin, ls_ckpt, lines),
                    _interactive(data_bin, fs_ckpt, lines, user_dir=False))
    assert "decodes with LSSequenceGenerator (LS_FAIRSEQ_GENERATOR=graphs" in ours, ours[-2000:]
    hyp = re.compile(r"^H-(\d+)\t(\S+)\t(.*)$", re.M)
    a = {i: (float(score), text) for i, score, text in hyp.findall(ours)}
    b = {i: (float(score), text) for i, score, text in hyp.findall(theirs)}
    assert len(a) == len(lines) and sorted(a) == sorted(b), (ours[-2000:], theirs[-2000:])
    for i in a:
        assert a[i][1] == b[i][1], (i, a[i], b[i])
        assert abs(a[i][0] - b[i][0]) <= 1e-5 * max(1.0, abs(b[i][0])), (i, a[i], b[i])
    assert len({text for _, text in a.values()}) > 1  # not one degenerate output for every line


def test_learns_and_matches_fairseq_loss_curve(data_bin, trained, tmp_path):
    """Same data, seed, hyperparameters: the ls_ run's losses (the shared trained run) track the
    fairseq baseline's (same initial weights; dropout masks differ, so curves agree within noise,
    not bit for bit)."""
    assert TRAINED_ARCH == "ls_" + "transformer_wmt_en_de_big_t2t"
    ref_log = train(data_bin, tmp_path / "ref", "transformer_wmt_en_de_big_t2t", TRAINED_EXTRA,
                    TRAINED_UPDATES, criterion="label_smoothed_cross_entropy", optimizer="adam")
    ls_l, ref_l = losses(trained.log), losses(ref_log)
    assert len(ls_l) == len(ref_l) >= 20
    assert abs(ls_l[0] - ref_l[0]) < 0.05  # identical init: first logged losses nearly equal
    assert ls_l[-1] < ls_l[0] - 1.0  # it learns
    worst = max(abs(a - b) for a, b in zip(ls_l, ref_l))
    assert worst < 0.35, (ls_l, ref_l)


def test_memory_efficient_fp16(data_bin, tmp_path):
    log = train(data_bin, tmp_path, "ls_transformer", ["--share-all-embeddings"], 20,
                more=["--memory-efficient-fp16", "--fp16-init-scale", "8"])
    l = losses(log)
    assert l[-1] < l[0]


def test_converted_checkpoint_generates_identical_hypotheses(data_bin, trained, tmp_path):
    ls_ckpt = trained.checkpoint
    fs_ckpt, back_ckpt = tmp_path / "as_fairseq.pt", tmp_path / "back_to_ls.pt"
    convert = [sys.executable, "-m", "ls_fairseq.cli.convert_checkpoint"]
    assert "transformer_wmt_en_de_big_t2t" in run(convert + [str(ls_ckpt), str(fs_ckpt), "--to", "fairseq"])
    run(convert + [str(fs_ckpt), str(back_ckpt), "--to", "ls"])
    ls_hyps, _ = generate(data_bin, ls_ckpt)
    fs_hyps, fs_out = generate(data_bin, fs_ckpt, user_dir=False)
    back_hyps, _ = generate(data_bin, back_ckpt)
    assert ls_hyps == fs_hyps == back_hyps
    # and fairseq can keep training the converted checkpoint with its own components
    log = train(data_bin, tmp_path, "transformer_wmt_en_de_big_t2t", TRAINED_EXTRA,
                TRAINED_UPDATES + 10, criterion="label_smoothed_cross_entropy", optimizer="adam",
                more=["--restore-file", str(fs_ckpt)], plain_fairseq=True)
    assert re.search(r"Loaded checkpoint .*as_fairseq.pt .*@ %d updates" % TRAINED_UPDATES, log), \
        log[-2000:]
    assert "num_updates %d" % (TRAINED_UPDATES + 10) in log or \
        "num_updates=%d" % (TRAINED_UPDATES + 10) in log


def test_bf16_decodes_in_bfloat16(data_bin, trained):
    """fairseq-generate --bf16 with an ls_ checkpoint decodes in bfloat16 (fairseq 0.12 alone
    reads --bf16 as TPU and decodes in fp32): the model's own log line names the dtype its
    parameters have after fairseq's inference set-up, every sentence is translated, and most
    hypotheses are those of fp32 decoding (bf16 rounding flips near-ties between beams; 19 of 21
    agreed on this corpus with the shared trained model, 85% is required)."""
    ckpt = trained.checkpoint
    fp32, _ = generate(data_bin, ckpt, extra=["--cpu"])
    bf16, out = generate(data_bin, ckpt, extra=["--cpu", "--bf16"])
    assert re.search(r"--bf16: decoding in torch\.bfloat16 on cpu", out), out[-3000:]
    assert sorted(bf16) == sorted(fp32)
    same = sum(bf16[k] == v for k, v in fp32.items())
    print(f"bf16: {same}/{len(fp32)} hypotheses as in fp32 decoding")
    assert same >= 0.85 * len(fp32), (same, len(fp32))


def _stats(log):
    """The logged statistics of every train_inner line, without the timings, and the per-token
    ones of every valid line (fairseq averages a validation's sizes over its steps, and a step
    of N workers holds N batches)."""
    train = [re.sub(r"(wps|ups|wall|train_wall|tflops)=[\d.]+", "", line)
             for line in re.findall(r"train_inner .*", log)]
    valid = [re.findall(r"\| ((?:loss|nll_loss|ppl|accuracy) [\d.]+)", line)
             for line in re.findall(r"valid on 'valid' subset .*", log)]
    return train, valid


def _gloo_workers(cmd, workers):
    """``cmd`` as ``workers`` gloo workers of one run (fairseq's own distributed engine, no
    spawn); rank 0's output, after all exit."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--distributed-backend", "gloo", "--distributed-world-size", str(workers),
            "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-no-spawn"]
    env = dict(_env(), OMP_NUM_THREADS="1")  # several processes on a 2-core CI machine
    procs = [fork_cli.Process(cmd + args + ["--distributed-rank", str(rank)], env=env)
             for rank in reversed(range(workers))]
    for p in procs:
        p.wait(timeout=600)
    logs = [p.stdout + p.stderr for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-5000:]
    return logs[-1]


def test_four_cpu_workers_checkpoint_resumes_on_one_worker(data_bin, tmp_path):
    """Four gloo workers train two epochs and save; one worker with update-freq 4 (the same
    batches per update) resumes from that checkpoint for a third epoch. Both halves log what one
    worker with update-freq 4 logs when it trains two epochs, saves and resumes, to the printed
    digit: ls_adam's state, the loss scaler and the schedule move between world sizes. (The
    reference resumes too: a resumed fairseq run, plain fairseq's as well, does not repeat an
    uninterrupted one to the digit.) fairseq's order (--ls-no-fix-batches-to-gpus): one worker
    cannot keep four workers' shares apart."""
    extra = ["--share-all-embeddings", "--dropout", "0", "--cpu", "--ddp-backend", "legacy_ddp",
             "--ls-no-fix-batches-to-gpus"]
    more = ["--max-tokens", "300", "--weight-decay", "0", "--log-interval", "1",
            "--disable-validation"]

    def cmd(save_dir, epochs, *flags):
        return train_cmd(data_bin, tmp_path / save_dir, "ls_transformer", extra, 0,
                         more=more + ["--max-epoch", str(epochs), *flags])

    four = _gloo_workers(cmd("four", 2), 4)
    resumed = run(cmd("four", 3, "--update-freq", "4"))
    assert re.search(r"Loaded checkpoint \S+ \(epoch \d+ @ 6 updates\)", resumed), \
        re.findall(".*Loaded checkpoint.*", resumed)
    one = run(cmd("one", 2, "--update-freq", "4"))
    one_resumed = run(cmd("one", 3, "--update-freq", "4"))
    (train_4, _), (train_r, _) = _stats(four), _stats(resumed)
    (train_1, _), (train_1r, _) = _stats(one), _stats(one_resumed)
    assert len(train_4) == 6 and len(train_r) == 3
    assert train_4 == train_1 and train_r == train_1r


#: each logged update's wpb (--log-interval 1): its batches' target tokens, whatever the weights
WPB = re.compile(r"train_inner .* wpb=([\d.]+)")


def _epoch_totals(log):
    """(updates, target tokens) of each epoch, from fairseq's end-of-epoch train lines (wpb is
    the epoch's mean, printed to 0.1: the tokens are exact to within half an update's 0.1)."""
    out, before = [], 0
    for wpb, total in re.findall(r"\| train \| epoch \d+ .*\| wpb ([\d.]+) .*\| "
                                 r"num_updates (\d+)", log):
        updates, before = int(total) - before, int(total)
        out.append((updates, float(wpb) * updates))
    return out


def test_grouped_shuffling_trains_on_every_batch(data_bin, tmp_path):
    """fairseq's --grouped-shuffling drops the batches after the last full group of N every
    epoch; with ls_fairseq loaded (fairseq_patches patch 6) five gloo workers train on all of
    them: as many target tokens per epoch as one worker, in ceil(batches / 5) updates."""
    extra = ["--share-all-embeddings", "--dropout", "0", "--cpu", "--no-save",
             "--ddp-backend", "legacy_ddp"]
    more = ["--max-tokens", "300", "--max-epoch", "2", "--disable-validation"]
    one = _epoch_totals(run(train_cmd(data_bin, tmp_path, "ls_transformer", extra, 0,
                                      more=more)))
    batches = one[0][0]
    assert batches % 5, f"{batches} batches: no remainder to keep; change --max-tokens"
    five = _epoch_totals(_gloo_workers(train_cmd(data_bin, tmp_path, "ls_transformer", extra, 0,
                                                 more=more + ["--grouped-shuffling"]), 5))
    assert [u for u, _ in one] == [batches] * 2
    assert [u for u, _ in five] == [-(-batches // 5)] * 2
    for (_, tokens_1), (updates, tokens_5) in zip(one, five):
        assert abs(tokens_5 - tokens_1) <= 0.05 * (batches + updates), (one, five)


def test_several_workers_fix_batches_to_gpus_by_default(data_bin, tmp_path):
    """The plain ls_ command on three gloo workers fixes batches to workers (fairseq_patches
    patch 7): one log line says so; the batches are built once for all epochs; every batch is
    trained on, as many target tokens per epoch as one worker in ceil(batches / 3) updates;
    each worker's share spans the lengths, so an update is not a run of length neighbours;
    --ls-no-fix-batches-to-gpus gives fairseq's order, whose updates differ;
    --ls-cost-matching-window trains on the same batches each epoch, paired otherwise."""
    extra = ["--share-all-embeddings", "--dropout", "0", "--cpu", "--no-save",
             "--ddp-backend", "legacy_ddp"]
    more = ["--max-tokens", "300", "--max-epoch", "3", "--disable-validation",
            "--log-interval", "1"]

    def cmd(*flags):
        return train_cmd(data_bin, tmp_path, "ls_transformer", extra, 0, more=more + list(flags))

    one = _epoch_totals(run(cmd()))
    batches = one[0][0]
    fixed = _gloo_workers(cmd(), 3)
    assert fixed.count("batches fixed to GPUs: each of the 3 GPUs keeps its share of the "
                       "batches (one in 3)") == 1
    assert fixed.count("creating new batches for epoch") == 1
    totals = _epoch_totals(fixed)
    assert [u for u, _ in totals] == [-(-batches // 3)] * 3
    for (_, tokens_1), (updates, tokens_3) in zip(one, totals):
        assert abs(tokens_3 - tokens_1) <= 0.05 * (batches + updates), (one, totals)
    plain = _gloo_workers(cmd("--ls-no-fix-batches-to-gpus"), 3)
    assert "batches fixed to GPUs" not in plain
    assert len(WPB.findall(plain)) == len(WPB.findall(fixed)) == 3 * -(-batches // 3)
    assert WPB.findall(plain) != WPB.findall(fixed)
    # --ls-cost-matching-window: the same batches each epoch, paired by cost
    matched = _gloo_workers(cmd("--ls-cost-matching-window", "4"), 3)
    assert matched.count("matched by cost in runs of 4 updates") == 1
    assert _epoch_totals(matched) == totals
    assert WPB.findall(matched) != WPB.findall(fixed)


def test_fixed_batches_resume_mid_epoch_on_the_same_batches(data_bin, tmp_path):
    """Batches fixed to workers across a resume (patch 7 gives the iterator its order before
    fairseq restores its position in the epoch): two gloo workers stopped in the middle of epoch
    2 and resumed (rank 0 broadcasts the checkpoint it read, patch 12) train on the same batches,
    update by update, as two workers that did not stop (each update's wpb: its batches' token
    counts, whatever the weights); their checkpoint also resumes on one worker with
    --update-freq 2."""
    import shutil

    extra = ["--share-all-embeddings", "--dropout", "0", "--cpu", "--ddp-backend", "legacy_ddp"]
    more = ["--max-tokens", "300", "--max-epoch", "3", "--disable-validation",
            "--log-interval", "1"]

    def cmd(save_dir, max_update, *flags):
        return train_cmd(data_bin, tmp_path / save_dir, "ls_transformer", extra, max_update,
                         more=more + list(flags))

    whole = _gloo_workers(cmd("whole", 0, "--no-save"), 2)
    assert "batches fixed to GPUs: each of the 2 GPUs" in whole
    per_epoch = _epoch_totals(whole)[0][0]
    stop = per_epoch + per_epoch // 2
    cut = _gloo_workers(cmd("cut", stop), 2)
    shutil.copytree(tmp_path / "cut", tmp_path / "one")
    resumed = _gloo_workers(cmd("cut", 0), 2)
    assert re.search(r"Loaded checkpoint \S+ \(epoch 2 @ %d updates\)" % stop, resumed), \
        re.findall(".*Loaded checkpoint.*", resumed)
    assert len(WPB.findall(whole)) == 3 * per_epoch
    assert WPB.findall(cut) == WPB.findall(whole)[:stop]
    assert WPB.findall(resumed) == WPB.findall(whole)[stop:]
    one = run(cmd("one", 0, "--update-freq", "2"))
    assert re.search(r"Loaded checkpoint \S+ \(epoch 2 @ %d updates\)" % stop, one)
    assert "done training" in one


def test_two_cpu_workers_with_async_stats_log_what_one_worker_logs(data_bin, tmp_path):
    """Async stats (on by default, no flag given) under fairseq's own distributed engine: two
    gloo workers (update-freq 1) log the same losses, accuracies, sizes, grad norms and
    validation figures as one worker with update-freq 2, to the last printed digit. (Without
    them fairseq cannot even run this on CPUs: its all_gather_list needs CUDA. legacy_ddp:
    fairseq gives torch DDP a GPU device id even on the CPU. fairseq's order: one worker cannot
    keep two workers' shares apart.)"""
    extra = ["--share-all-embeddings", "--dropout", "0", "--cpu", "--no-save",
             "--ddp-backend", "legacy_ddp", "--ls-no-fix-batches-to-gpus"]
    cmd = train_cmd(data_bin, tmp_path, "ls_transformer", extra, 30,
                    more=["--max-tokens", "300", "--weight-decay", "0"])
    two = _gloo_workers(cmd, 2)
    one = run(cmd + ["--update-freq", "2"])
    (train, valid), (train_1, valid_1) = _stats(two), _stats(one)
    assert len(train) == len(train_1) == 6 and len(valid) == len(valid_1) == 5
    assert all(len(v) == 4 for v in valid)
    assert train == train_1 and valid == valid_1
