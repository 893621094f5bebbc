#!/usr/bin/env python3
"""Translation-quality parity: fairseq's baseline against the ls_ components, by BLEU and length.

Loss curves cannot show a model that translates worse at the same loss (over-long, looping
outputs); BLEU, the hypothesis/reference length ratio and the count of degenerate hypotheses can.
This script trains every variant below with real ``fairseq-train`` for a fixed number of updates,
several seeds each, many runs at a time on the one GPU (``--jobs``), decodes the test set with
``fairseq-generate`` (beam search, fairseq's own length limit of 200 tokens, so a looping
hypothesis counts in full), and reports per run and as mean ± s.d.: sacreBLEU, length ratio,
degenerate hypotheses (100 tokens or more, or a 3-gram repeated back to back) and the final
validation loss, then a verdict per variant against the baseline.

Corpora and their recipes (``--corpus``):

* ``real`` (the default, the gate): real English→German text from the machine's gettext
  catalogs (``bench/benchlib/real_corpus.py``: ~50k message/translation pairs, word level,
  lower-cased, joined dictionary, 1,000 test pairs). Recipe: fairseq's base ``transformer``, 3,000 updates of
  4,096 tokens, lr 7e-4, 1,000 warm-up updates, dropout 0.3. Bands: mean BLEU within ±1.0 of the
  baseline's, mean length ratio within ±0.03, mean count of degenerate hypotheses at most 20%
  above the baseline's; n >= 5 seeds. Models here are not converged and can loop, as real
  models do, which is what the gate is for.
* ``synthetic`` (a quick smoke test): the learnable corpus's deterministic transduction
  (``ls_fairseq.testing.learnable_corpus``, ~11k word types a side). Recipe: a 3+3-layer,
  256-wide Transformer, 1,500 updates, lr 1e-3, dropout 0.1; converged at BLEU ~99, so it cannot see a model that loops. Band ±0.5 BLEU,
  ±0.03 length, n >= 3.
* a directory ``DIR/{train,valid,test}.{SRC,TGT}`` of tokenised text: the real recipe.

Verdict (``summarize``): "pass" when every mean is inside its band; a mean outside its band is
tested against the seed-to-seed spread (``permutation_p``): p < ``ALPHA`` is "FAIL", else
"within noise" (the call cannot tell; the table says what it could: ``detectable``); "too few
seeds" below the recipe's n. Beside it: differences paired by seed (``paired_p``).
``--tables-from A,B`` pools calls; an exact repeat of a run (fairseq repeats bitwise on one GPU)
counts once.

Every recipe option can be overridden (``--model``, ``--max-update``, ``--lr`` ...); shared:
shared embeddings, adam (0.9, 0.98), inverse_sqrt, label smoothing 0.1, weight decay 1e-4,
``--fp16`` (``--bf16`` where the variant says), beam 5.

Variants (``--variants``; the baseline is always run):

=================  ==================  =================================  ==========
name               --arch              --criterion                        --optimizer
=================  ==================  =================================  ==========
baseline           transformer         label_smoothed_cross_entropy       adam
arch               ls_transformer      label_smoothed_cross_entropy       adam
criterion          transformer         ls_label_smoothed_cross_entropy    adam
optimizer          transformer         label_smoothed_cross_entropy       ls_adam
crit_opt           transformer         ls_label_smoothed_cross_entropy    ls_adam
ls                 ls_transformer      ls_label_smoothed_cross_entropy    ls_adam
ls_bf16            ``ls`` with --bf16 instead of --fp16
ls_eager           ``ls`` + --ls-no-fused-fp16-copy --ls-no-cuda-graphs --ls-no-deferred-overflow-check
ls_off             ``ls`` with LS_FAIRSEQ_KERNELS=off (the PyTorch reference path)
optimizer_sync     ``optimizer`` + --ls-no-deferred-overflow-check (fused copy, fairseq's check)
optimizer_unfused  ``optimizer`` + --ls-no-fused-fp16-copy (fairseq's FP16Optimizer copies)
optimizer_off      ``optimizer`` with LS_FAIRSEQ_KERNELS=off (the PyTorch Adam reference)
optimizer_shadow   ``optimizer`` under benchlib/probes/adam_shadow.py: every step checked against
                   fairseq's Adam formula on the same inputs (its summary lands in the row)
ls_unfused         ``ls`` + --ls-no-fused-fp16-copy (the README's command, fairseq's fp16 copies)
ls_nccl_all_reduce ``ls`` + --ls-no-copy-engine-all-reduce (several GPUs: NCCL's all-reduce)
ls_whole_step      ``ls`` + --ls-no-sharded-optimizer-step (several GPUs: Adam on every GPU)
ls_matched         ``ls`` + --ls-cost-matching-window 16 (several GPUs: batches matched by cost)
ls_fp8             ``ls`` + --ls-fp8 (FP8 linear layers; ls_fp8_ffn / ls_fp8_attention: one part)
=================  ==================  =================================  ==========

Beside the verdict, not part of it: the medians' Δ BLEU, the runs more than 1.5 BLEU below their
variant's median ("low"), each run's fp16 overflows and final loss scale, and the training loss
curves against the baseline's (the seed means' difference at each logged update from 300 on).
``--tables-from JSON`` prints the tables of a saved ``--json`` again. ``--json`` writes
benchlib/results.py's schema: each run a row, the summary and the recipe beside them.

``--gpus N`` trains every run on N GPUs with fairseq's own data parallelism (one process per GPU,
``--ddp-backend`` as fairseq's default unless given); all runs share those N GPUs, each with its
own rendezvous port, and decoding stays on one GPU. ``--max-tokens`` is per GPU, so an update
takes N times the tokens of a 1-GPU run: pass ``--max-tokens X/N`` to train as a 1-GPU run at X.

    python bench/quality.py --variants baseline,ls,optimizer,ls_bf16 --seeds 1,2,3,4,5 \
        --json docs/results/quality_real.json --markdown $OUT/quality.md
"""
import argparse
import concurrent.futures
import fcntl
import itertools
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time

from benchlib import corpora, env, logs, results

USER_DIR = env.USER_DIR

FAIRSEQ = ("transformer", "label_smoothed_cross_entropy", "adam")
VARIANTS = {
    "baseline": dict(arch="transformer", criterion="label_smoothed_cross_entropy",
                     optimizer="adam"),
    "arch": dict(arch="ls_transformer", criterion="label_smoothed_cross_entropy",
                 optimizer="adam"),
    "criterion": dict(arch="transformer", criterion="ls_label_smoothed_cross_entropy",
                      optimizer="adam"),
    "optimizer": dict(arch="transformer", criterion="label_smoothed_cross_entropy",
                      optimizer="ls_adam"),
    "crit_opt": dict(arch="transformer", criterion="ls_label_smoothed_cross_entropy",
                     optimizer="ls_adam"),
    "ls": dict(arch="ls_transformer", criterion="ls_label_smoothed_cross_entropy",
               optimizer="ls_adam"),
}
# ``ls`` runs the README's command: the fused fp16 copy, CUDA graphs and the deferred overflow
# check are on by default; ``ls_eager`` turns the three off
VARIANTS["ls_eager"] = dict(VARIANTS["ls"], flags=[
    "--ls-no-fused-fp16-copy", "--ls-no-cuda-graphs", "--ls-no-deferred-overflow-check"])
VARIANTS["ls_bf16"] = dict(VARIANTS["ls"], bf16=True)  # --bf16 instead of --fp16 (on a GPU)
VARIANTS["ls_off"] = dict(VARIANTS["ls"], env={"LS_FAIRSEQ_KERNELS": "off"})
# several GPUs: ``ls`` fixes batches to GPUs (fairseq_patches, patch 7); ls_fairseq_order keeps
# fairseq's dealing; ls_grouped and baseline_grouped train length-grouped updates (fairseq's
# --grouped-shuffling), whose early training curve lags fairseq's order (docs/QUALITY.md)
VARIANTS["ls_fairseq_order"] = dict(VARIANTS["ls"], flags=["--ls-no-fix-batches-to-gpus"])
VARIANTS["ls_grouped"] = dict(VARIANTS["ls"], flags=["--grouped-shuffling"])
VARIANTS["baseline_grouped"] = dict(VARIANTS["baseline"], flags=["--grouped-shuffling"])
# ls_matched: ``ls`` with an update's batches matched by cost (--ls-cost-matching-window 16)
VARIANTS["ls_matched"] = dict(VARIANTS["ls"], flags=["--ls-cost-matching-window", "16"])
# several GPUs: ``ls`` sums gradients by copy engines (distributed/peer_all_reduce.py); this keeps
# NCCL's
VARIANTS["ls_nccl_all_reduce"] = dict(VARIANTS["ls"], flags=["--ls-no-copy-engine-all-reduce"])
# several GPUs: ``ls`` steps Adam on each GPU's own shards (distributed/sharded_step.py); this steps
# the whole model on every GPU
VARIANTS["ls_whole_step"] = dict(VARIANTS["ls"], flags=["--ls-no-sharded-optimizer-step"])
# the optimizer path taken apart: ls_adam alone without its deferred overflow check, without its
# fused fp16 copy, with the PyTorch reference instead of the kernel, and checked step by step
VARIANTS["optimizer_sync"] = dict(VARIANTS["optimizer"], flags=["--ls-no-deferred-overflow-check"])
VARIANTS["optimizer_unfused"] = dict(VARIANTS["optimizer"], flags=["--ls-no-fused-fp16-copy"])
VARIANTS["optimizer_off"] = dict(VARIANTS["optimizer"], env={"LS_FAIRSEQ_KERNELS": "off"})
VARIANTS["optimizer_shadow"] = dict(VARIANTS["optimizer"], shadow=True)
# the README's command without the fused fp16 copy (fairseq's FP16Optimizer around ls_adam)
VARIANTS["ls_unfused"] = dict(VARIANTS["ls"], flags=["--ls-no-fused-fp16-copy"])
# FP8 matmuls in the layers (--ls-fp8), in all of them or in one part of each layer
VARIANTS["ls_fp8"] = dict(VARIANTS["ls"], flags=["--ls-fp8"])
VARIANTS["ls_fp8_ffn"] = dict(VARIANTS["ls"], flags=["--ls-fp8", "--ls-fp8-layers", "ffn"])
VARIANTS["ls_fp8_attention"] = dict(VARIANTS["ls"],
                                    flags=["--ls-fp8", "--ls-fp8-layers", "attention"])
DEFAULT_VARIANTS = "baseline,arch,criterion,optimizer,ls,ls_bf16,ls_eager,ls_off"

# model sizes: fairseq's transformer options (the ls_ architectures take the same)
MODELS = {
    "tiny": ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32",
             "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
             "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
             "--decoder-attention-heads", "2"],  # a smoke test of the pipeline, on the CPU
    "small": ["--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "256",
              "--decoder-embed-dim", "256", "--encoder-ffn-embed-dim", "1024",
              "--decoder-ffn-embed-dim", "1024", "--encoder-attention-heads", "4",
              "--decoder-attention-heads", "4"],
    "base": [],  # fairseq's transformer (6+6 layers, 512, 2048, 8 heads)
}

#: each corpus's recipe: the training options and the verdict's bands (module docstring)
RECIPES = {
    "real": dict(model="base", max_update=3000, max_tokens=4096, lr=7e-4, warmup_updates=1000,
                 dropout=0.3, max_bleu_delta=1.0, min_seeds=5),
    "synthetic": dict(model="small", max_update=1500, max_tokens=4096, lr=1e-3,
                      warmup_updates=500, dropout=0.1, max_bleu_delta=0.5, min_seeds=3),
}
MAX_LENGTH_RATIO_DELTA = 0.03
#: a variant's mean count of degenerate hypotheses may exceed the baseline's by this factor
MAX_DEGENERATE_RATIO = 1.2
#: a hypothesis this long (tokens) is degenerate: no test reference comes near it
DEGENERATE_TOKENS = 100


def needs_plugin(variant):
    """Whether any part of the variant is ls_'s (its config then names them: --user-dir)."""
    v = VARIANTS[variant]
    return (v["arch"], v["criterion"], v["optimizer"]) != FAIRSEQ


def distributed_flags(a, port):
    """fairseq-train's data-parallel options: none for one GPU unless asked (today's command)."""
    flags = []
    if a.gpus > 1:
        # fairseq-train spawns one process per GPU. On a single node its --distributed-port alone
        # starts nothing (infer_init_method leaves the init method unset: one process, one GPU),
        # so pass the init method fairseq would build itself, with this run's own port
        assert port is not None, "--gpus > 1 needs a rendezvous port per run"
        flags += ["--distributed-world-size", str(a.gpus),
                  "--distributed-init-method", f"tcp://localhost:{port}"]
    if a.ddp_backend:
        flags += ["--ddp-backend", a.ddp_backend]
    if a.update_freq:
        flags += ["--update-freq", str(a.update_freq)]
    return flags


def train_cmd(a, data, variant, seed, save_dir, port=None):
    v = VARIANTS[variant]
    runner = env.probe_cmd("adam_shadow", "--out", os.path.join(save_dir, "shadow.jsonl"),
                           "--") if v.get("shadow") else env.fairseq_cmd("train")
    cmd = [
        *runner, data, "--arch", v["arch"],
        "--share-all-embeddings", "--optimizer", v["optimizer"], "--adam-betas", "(0.9, 0.98)",
        "--clip-norm", "0.0", "--lr", str(a.lr), "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", str(a.warmup_updates), "--dropout", str(a.dropout),
        "--weight-decay", "0.0001", "--criterion", v["criterion"], "--label-smoothing", "0.1",
        "--max-tokens", str(a.max_tokens), "--max-update", str(a.max_update),
        ("--bf16" if v.get("bf16") else "--fp16") if a.cuda else "--cpu", "--seed", str(seed),
        "--save-dir", save_dir,
        "--no-epoch-checkpoints", "--no-last-checkpoints", "--save-interval", "100000",
        "--validate-interval", "100000",
        "--log-format", "simple", "--log-interval", "100", "--no-progress-bar",
        "--num-workers", "0",
    ] + MODELS[a.model] + distributed_flags(a, port)
    if needs_plugin(variant):
        cmd += ["--user-dir", USER_DIR]
    return cmd + v.get("flags", [])


def generate_cmd(a, data, variant, save_dir):
    # fairseq-generate's own length limit (200 tokens): a looping hypothesis shows in full;
    # one GPU whatever --gpus (no distributed flags), as users decode. No data-loader worker:
    # a worker passes batches through /dev/shm, which a dozen decodes at once can fill
    cmd = env.fairseq_cmd("generate") + [data, "--path",
           os.path.join(save_dir, "checkpoint_best.pt"), "--gen-subset", "test", "--beam",
           str(a.beam), "--lenpen", str(a.lenpen), "--batch-size", "128",
           "--num-workers", "0"] + ([] if a.cuda else ["--cpu"])
    if needs_plugin(variant):
        cmd += ["--user-dir", USER_DIR]
    return cmd


def job_list(variants, seeds, port_base):
    """(variant, seed, port) of every run, every variant's seed 1 first. The port is the run's
    rendezvous with --gpus > 1: one of its own, since up to --jobs runs start at once."""
    pairs = [(v, s) for s in seeds for v in variants]
    return [(v, s, port_base + i) for i, (v, s) in enumerate(pairs)]


def run_envs(a, variant):
    """The environments of fairseq-train and fairseq-generate for one run."""
    train = dict(os.environ, OMP_NUM_THREADS="1", **VARIANTS[variant].get("env", {}))
    # plain fairseq (the baseline's decoder) loads its checkpoints only with torch's unsafe
    # loader under torch >= 2.6; the same loader for every variant
    gen = dict(train, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    if a.gpus > 1:
        gpus = env.visible_gpus(a.gpus)
        train["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)  # fairseq spawns one process per device
        gen["CUDA_VISIBLE_DEVICES"] = gpus[0]
    return train, gen


def setup_text(a):
    """How each run trains, for the title: GPUs, DDP backend, tokens per update."""
    per_update = a.max_tokens * a.gpus * (a.update_freq or 1)
    text = f"{a.gpus} GPU{'s' if a.gpus > 1 else ''} per run"
    if a.gpus > 1 or a.ddp_backend:
        text += f" (--ddp-backend {a.ddp_backend or 'fairseq default, pytorch_ddp'})"
    text += f", {a.max_update} updates of {per_update} tokens"
    if per_update != a.max_tokens:
        text += f" ({a.gpus} GPU{'s' if a.gpus > 1 else ''} × {a.max_tokens}" + (
            f" × update-freq {a.update_freq})" if a.update_freq else ")")
    return text


SHADOW = re.compile(r"^SHADOW_SUMMARY (\{.*\})$", re.M)


def parse_train_log(text):
    """The run's last validation loss, updates and fp16 overflows, and its curves as
    [update, loss] pairs: training loss at each log interval, validation loss at each epoch end
    (where a bad run parts from the others). The log is read by ``ls-fairseq-compare``'s parser
    (benchlib/logs.py)."""
    run = logs.parse(text)
    valid = [r for r in run.valid if r.get("subset", "valid") == "valid" and r.get("loss") is not None]
    scales = [r["loss_scale"] for r in run.records if r.get("loss_scale") is not None]
    row = dict(valid_loss=valid[-1]["loss"] if valid else None,
               valid_nll=valid[-1].get("nll_loss") if valid else None,
               updates=int(max(r["num_updates"] for r in run.records)) if run.records else None,
               overflows=text.count("gradient overflow detected"),
               loss_scale=scales[-1] if scales else None,
               train_curve=[[int(u), loss] for u, loss in logs.losses(run)],
               valid_curve=[[int(r["num_updates"]), r["loss"]] for r in valid])
    shadow = SHADOW.findall(text)
    if shadow:
        row["shadow"] = json.loads(shadow[-1])
    return row


def parse_generate(text):
    """{sentence id: hypothesis} and {sentence id: reference} of fairseq-generate's output."""
    hyps, refs = {}, {}
    for line in text.splitlines():
        if line.startswith("H-"):
            sid, _score, hyp = (line[2:].split("\t") + ["", ""])[:3]
            hyps[int(sid)] = hyp
        elif line.startswith("T-"):
            sid, ref = (line[2:].split("\t", 1) + [""])[:2]
            refs[int(sid)] = ref
    return hyps, refs


def repeats_back_to_back(tokens, n=3):
    """Whether some ``n``-gram is followed at once by itself (``a b c a b c``): a loop."""
    return any(tokens[i:i + n] == tokens[i + n:i + 2 * n] for i in range(len(tokens) - 2 * n + 1))


def degenerate(tokens):
    """A looping or runaway hypothesis: ``DEGENERATE_TOKENS`` tokens or more, or a 3-gram
    repeated back to back."""
    return len(tokens) >= DEGENERATE_TOKENS or repeats_back_to_back(tokens)


def score(hyps, refs):
    """sacreBLEU (tokenize none: the corpora are tokenised already) and length ratio of the
    hypotheses against the references (lists in the same order), and the number of degenerate
    hypotheses. Beside them, the length ratio over the hypotheses that are not degenerate
    (``clean_length_ratio``): the loops' share of the length ratio taken out, what is left moves
    far less from seed to seed and shows a model that writes shorter or longer sentences."""
    import sacrebleu

    bleu = sacrebleu.corpus_bleu(hyps, [refs], force=True, tokenize="none")
    loops = [degenerate(h.split()) for h in hyps]
    clean_sys = sum(len(h.split()) for h, d in zip(hyps, loops) if not d)
    clean_ref = sum(len(r.split()) for r, d in zip(refs, loops) if not d)
    return dict(bleu=bleu.score, length_ratio=bleu.sys_len / bleu.ref_len,
                degenerate=sum(loops), sys_len=bleu.sys_len, ref_len=bleu.ref_len,
                clean_length_ratio=clean_sys / clean_ref if clean_ref else None)


def overlong_examples(hyps, refs, k=3, chars=200):
    """The ``k`` hypotheses longest against their references (words), with them: what an
    over-long run writes (loops, repeated words), kept in its row."""
    extra = [len(h.split()) - len(r.split()) for h, r in zip(hyps, refs)]
    worst = sorted(range(len(hyps)), key=lambda i: -extra[i])[:k]
    return [{"hypothesis": hyps[i][:chars], "reference": refs[i][:chars],
             "extra_words": extra[i]} for i in worst if extra[i] > 0]


#: fairseq-generate runs again after running out of GPU memory, this many times at most, this
#: many seconds apart: the runs of a call share one GPU, and another run's training or decoding
#: can hold the memory for a moment; a trained model is not thrown away for that
DECODE_RETRIES, DECODE_RETRY_WAIT_S = 3, 30


def decode(cmd, env, retries=DECODE_RETRIES, wait_s=DECODE_RETRY_WAIT_S):
    """fairseq-generate's completed process, and how many times it ran again for lack of GPU
    memory (any other failure is final)."""
    for attempt in range(retries + 1):
        gen = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if gen.returncode == 0 or "out of memory" not in gen.stderr or attempt == retries:
            return gen, attempt
        time.sleep(wait_s)


def run_one(a, data, variant, seed, raw_refs, lock, port=None):
    name = f"{variant}_s{seed}"
    run_dir = os.path.join(a.workdir, "runs", name)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    train_env, gen_env = run_envs(a, variant)
    # the GPU count in every row: 1- and N-GPU results cannot be mixed up
    row = dict(variant=variant, seed=seed, gpus=a.gpus)
    if a.ddp_backend:
        row["ddp_backend"] = a.ddp_backend
    if a.update_freq:
        row["update_freq"] = a.update_freq
    t0 = time.time()
    with open(os.path.join(run_dir, "train.log"), "w") as log:
        rc = subprocess.run(train_cmd(a, data, variant, seed, run_dir, port), stdout=log,
                            stderr=subprocess.STDOUT, env=train_env).returncode
    row["train_s"] = round(time.time() - t0, 1)
    with open(os.path.join(run_dir, "train.log")) as f:
        row.update(parse_train_log(f.read()))
    if rc != 0 or not os.path.exists(os.path.join(run_dir, "checkpoint_best.pt")):
        with open(os.path.join(run_dir, "train.log")) as f:
            tail = " | ".join(f.read().strip().splitlines()[-3:])[-600:]
        row["error"] = f"fairseq-train exit {rc}: {tail}"
    else:
        t1 = time.time()
        gen, retries = decode(generate_cmd(a, data, variant, run_dir), gen_env)
        if retries:
            row["generate_retries"] = retries
        with open(os.path.join(run_dir, "generate.txt"), "w") as f:
            f.write(gen.stdout + gen.stderr)
        hyps, _ = parse_generate(gen.stdout)  # scored against the raw test text (no <unk>)
        row["generate_s"] = round(time.time() - t1, 1)
        if gen.returncode != 0 or not hyps:
            tail = " | ".join(gen.stderr.strip().splitlines()[-3:])[-600:]
            row["error"] = f"fairseq-generate exit {gen.returncode}: {tail}"
        else:
            ids = sorted(hyps)
            hyp_list, ref_list = [hyps[i] for i in ids], [raw_refs[i] for i in ids]
            row.update(score(hyp_list, ref_list))
            row["overlong_examples"] = overlong_examples(hyp_list, ref_list)
        if not a.keep_checkpoints:
            os.remove(os.path.join(run_dir, "checkpoint_best.pt"))
    with lock:
        print("QUALITY_ROW " + json.dumps(row), flush=True)
    return row


def mean_sd(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


#: a run this far below its variant's median BLEU counts as "low" (reported, not judged)
LOW_RUN_BLEU = 1.5


def median(xs):
    xs = sorted(xs)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def degenerate_limit(baseline_mean):
    """The most degenerate hypotheses a variant may have on average: 20% above the baseline's
    mean, and at least one more (a baseline with none leaves room for one)."""
    return max(MAX_DEGENERATE_RATIO * baseline_mean, baseline_mean + 1)


#: a difference outside its band fails only when it is this unlikely under "no difference"
ALPHA = 0.05
#: permutations drawn when there are more splits than this (else every split is counted)
PERMUTATIONS = 20000


def permutation_p(xs, ys, one_sided=False):
    """The p-value of mean(xs) - mean(ys) under "both are one population": the share of the ways
    to split the pooled runs into groups of len(xs) and len(ys) whose difference is at least as
    large (in size; ``one_sided``: as large upwards). Exact up to ``PERMUTATIONS`` splits, else
    that many random splits from a fixed seed. Assumes nothing about the runs' distribution,
    which at 3,000 updates is skewed by the runs that loop."""
    if not xs or not ys:
        return None
    return paired_p([(xs, ys)], one_sided)[1]  # one group: every split of the pooled runs


def values(rows, variant, key, seed=None):
    """``key``'s values of ``variant``'s decoded runs (of ``seed`` only, if given)."""
    return [r[key] for r in rows if r["variant"] == variant and "bleu" in r
            and r.get(key) is not None and (seed is None or r.get("seed") == seed)]


def by_seed(rows, variant, key):
    """``[(variant's values, baseline's values)]`` of ``key``, one pair per seed both trained."""
    seeds = sorted({r.get("seed") for r in rows if r["variant"] == variant and "bleu" in r})
    pairs = [(values(rows, variant, key, seed), values(rows, "baseline", key, seed))
             for seed in seeds]
    return [(a, b) for a, b in pairs if a and b]


def paired_p(pairs, one_sided=False):
    """``(Δ, p)`` paired by seed: Δ is the mean over seeds of (variant's mean - baseline's mean)
    at that seed; p the share of relabelings within each seed (the seed fixes the initial
    weights and the batch order both sides share) whose Δ is at least as large. Exact up to
    ``PERMUTATIONS`` relabelings, else that many random ones from a fixed seed. With one run a
    side per seed there are 2^seeds relabelings: 5 seeds cannot go below p = 2/32 two-sided,
    which is why this test stands beside the verdict, not in it."""
    if not pairs:
        return None, None

    def delta(groups):
        return sum(sum(a) / len(a) - sum(b) / len(b) for a, b in groups) / len(groups)

    splits = [(list(a) + list(b), len(a)) for a, b in pairs]  # (pooled runs, variant's count)

    def relabel(choice):
        out = []
        for (pool, n), idx in zip(splits, choice):
            chosen = set(idx)
            out.append(([pool[i] for i in idx], [x for i, x in enumerate(pool) if i not in chosen]))
        return out

    observed, tol = delta(pairs), 1e-9  # tol: the same split summed in another order
    beyond = (lambda d: d >= observed - tol) if one_sided else \
        (lambda d: abs(d) >= abs(observed) - tol)
    total = math.prod(math.comb(len(pool), n) for pool, n in splits)
    if total <= PERMUTATIONS:
        choices = itertools.product(*(itertools.combinations(range(len(pool)), n)
                                      for pool, n in splits))
        return observed, sum(1 for c in choices if beyond(delta(relabel(c)))) / total
    rng = random.Random(0)
    hits = sum(1 for _ in range(PERMUTATIONS)
               if beyond(delta(relabel([rng.sample(range(len(pool)), n)
                                        for pool, n in splits]))))
    return observed, (hits + 1) / (PERMUTATIONS + 1)


def detectable(sd_a, n_a, sd_b, n_b):
    """The smallest true difference of means a call of these runs finds with 80% power at
    ``ALPHA`` (two-sided, normal approximation: 2.8 standard errors)."""
    if not n_a or not n_b or sd_a is None or sd_b is None:
        return None
    return 2.8 * math.sqrt(sd_a ** 2 / n_a + sd_b ** 2 / n_b)


#: the judged measures: (row key, summary key of the band check, one-sided upwards?)
JUDGED = (("bleu", "bleu", False), ("length_ratio", "length", False),
          ("degenerate", "degenerate", True))


def summarize(rows, variants, recipe="real"):
    """One summary per variant: mean/sd of each metric and the verdict against the baseline
    (the bands of ``RECIPES[recipe]``).

    Each judged mean (BLEU, length ratio, degenerate count) is inside its band, or outside it.
    Outside, the permutation test says whether the difference stands out of the seed-to-seed
    spread (p < ``ALPHA``: the variant "FAIL"s) or not ("within noise": this call cannot tell
    the difference from the spread; ``detectable`` says what it could tell). The verdict is
    "pass" when every mean is inside its band with n >= the recipe's seeds on both sides."""
    bands = RECIPES[recipe]
    out = {}
    for v in variants:
        good = [r for r in rows if r["variant"] == v and "bleu" in r]
        s = dict(variant=v, n=len(good), failed=sum(1 for r in rows
                                                    if r["variant"] == v and "bleu" not in r))
        for k in ("bleu", "length_ratio", "degenerate", "valid_loss", "clean_length_ratio"):
            s[k], s[k + "_sd"] = mean_sd([r.get(k) for r in good])
        s["bleu_median"] = median([r["bleu"] for r in good])
        s["low_runs"] = sum(1 for r in good if r["bleu"] < s["bleu_median"] - LOW_RUN_BLEU)
        out[v] = s
    base = out.get("baseline")
    for v, s in out.items():
        if v == "baseline" or base is None or base["n"] == 0 or s["n"] == 0:
            continue
        s["d_bleu"] = s["bleu"] - base["bleu"]
        s["d_bleu_median"] = s["bleu_median"] - base["bleu_median"]
        s["d_length_ratio"] = s["length_ratio"] - base["length_ratio"]
        inside = {"bleu": abs(s["d_bleu"]) <= bands["max_bleu_delta"],
                  "length": abs(s["d_length_ratio"]) <= MAX_LENGTH_RATIO_DELTA}
        if s["degenerate"] is not None and base["degenerate"] is not None:
            inside["degenerate"] = s["degenerate"] <= degenerate_limit(base["degenerate"])
        s["p"], s["outside"] = {}, []
        for key, name, upwards in JUDGED:
            if name not in inside:
                continue
            s["p"][name] = permutation_p(values(rows, v, key), values(rows, "baseline", key),
                                         upwards)
            if not inside[name]:
                s["outside"].append(name)
        pairs = {key: by_seed(rows, v, key)
                 for key in ("bleu", "length_ratio", "degenerate", "clean_length_ratio")}
        s["paired"] = {key: paired_p(p, key == "degenerate") for key, p in pairs.items()}
        s["paired_seeds"] = len(pairs["bleu"])
        s["detectable_bleu"] = detectable(s["bleu_sd"], s["n"], base["bleu_sd"], base["n"])
        s["detectable_length"] = detectable(s["length_ratio_sd"], s["n"],
                                            base["length_ratio_sd"], base["n"])
        enough = min(s["n"], base["n"]) >= bands["min_seeds"]
        if any(s["p"][name] is not None and s["p"][name] < ALPHA for name in s["outside"]):
            s["verdict"] = "FAIL"
        elif not enough:
            s["verdict"] = "too few seeds"
        elif s["outside"]:
            s["verdict"] = "within noise"
        else:
            s["verdict"] = "pass"
        s["pass"] = s["verdict"] == "pass"
    return out


def distinct_runs(rows):
    """``rows`` less the exact repeats of a run (same variant, seed and results): fairseq's
    baseline is bitwise repeatable on one GPU, so a call that trains it again adds no run."""
    seen, out = set(), []
    for r in rows:
        key = (r.get("variant"), r.get("seed"), r.get("bleu"), r.get("length_ratio"),
               r.get("degenerate"), r.get("valid_loss"))
        if "bleu" in r and key in seen:
            continue
        seen.add(key)
        out.append(r)
    return out


#: the loss-curve comparison starts here: before it the curves fall by whole nats per interval
CURVE_FROM_UPDATE = 300


def curve_gaps(rows, variants, start=CURVE_FROM_UPDATE):
    """Training-loss curves against the baseline's: at every logged update >= ``start`` that
    every finished run of both has, the variant's mean over its seeds minus the baseline's;
    per variant the mean and s.d. of those differences over the updates, their count and the
    last update (as bench/e2e.py's "loss − baseline" over intervals)."""
    def curves(v):
        return [dict(r["train_curve"]) for r in rows
                if r["variant"] == v and "bleu" in r and r.get("train_curve")]

    base = curves("baseline")
    out = {}
    for v in variants:
        mine = curves(v)
        if v == "baseline" or not base or not mine:
            continue
        updates = sorted(u for u in set.intersection(*(set(c) for c in base + mine))
                         if u >= start)
        if not updates:
            continue
        gaps = [sum(c[u] for c in mine) / len(mine) - sum(c[u] for c in base) / len(base)
                for u in updates]
        mean, sd = mean_sd(gaps)
        out[v] = dict(mean=mean, sd=sd, intervals=len(updates), first=updates[0],
                      last=updates[-1], runs=len(mine), baseline_runs=len(base))
    return out


def fmt(m, sd, digits):
    return "–" if m is None else f"{m:.{digits}f} ± {sd:.{digits}f}"


def tables(rows, summary):
    lines = ["| variant | n | BLEU | length ratio | degenerate | valid loss | Δ BLEU | Δ length | "
             "verdict | p BLEU / length / degenerate | detectable Δ BLEU / length | "
             "median BLEU (Δ) | low |",
             "|---|---:|---|---|---|---|---:|---:|---|---|---|---|---:|"]
    for v, s in summary.items():
        verdict = "reference" if v == "baseline" else (
            "–" if "verdict" not in s else s["verdict"] if s["verdict"] != "FAIL"
            else "**FAIL**")
        ps = " / ".join("–" if s.get("p", {}).get(k) is None else f"{s['p'][k]:.2f}"
                        for k in ("bleu", "length", "degenerate")) if "p" in s else ""
        det = (f"{s['detectable_bleu']:.1f} / {s['detectable_length']:.3f}"
               if s.get("detectable_bleu") is not None
               and s.get("detectable_length") is not None else "")
        d_b = f"{s['d_bleu']:+.2f}" if "d_bleu" in s else ""
        d_l = f"{s['d_length_ratio']:+.3f}" if "d_length_ratio" in s else ""
        med = "–" if s.get("bleu_median") is None else f"{s['bleu_median']:.2f}" + (
            f" ({s['d_bleu_median']:+.2f})" if "d_bleu_median" in s else "")
        lines.append(f"| {v} | {s['n']} | {fmt(s['bleu'], s['bleu_sd'], 2)} | "
                     f"{fmt(s['length_ratio'], s['length_ratio_sd'], 3)} | "
                     f"{fmt(s.get('degenerate'), s.get('degenerate_sd'), 1)} | "
                     f"{fmt(s['valid_loss'], s['valid_loss_sd'], 3)} | {d_b} | {d_l} | "
                     f"{verdict} | {ps} | {det} | {med} | {s.get('low_runs', 0)} |")
    lines += ["", "| variant | seed | BLEU | length ratio | degenerate | valid loss | updates | "
              "overflows | loss scale | train s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (list(summary).index(r["variant"]), r["seed"])):
        if "bleu" not in r:
            lines.append(f"| {r['variant']} | {r['seed']} | {r.get('error', 'failed')} ||||||||")
            continue
        lines.append(f"| {r['variant']} | {r['seed']} | {r['bleu']:.2f} | "
                     f"{r['length_ratio']:.3f} | {r.get('degenerate', '–')} | {r['valid_loss']} | "
                     f"{r['updates']} | {r['overflows']} | {r.get('loss_scale', '–')} | "
                     f"{r['train_s']} |")
    shadows = [r for r in rows if r.get("shadow")]
    if shadows:
        lines += ["", "ls_adam's steps against fairseq's Adam on the same inputs "
                  "(bench/benchlib/probes/adam_shadow.py; float32 spacings, bad = beyond "
                  f"{shadows[0]['shadow'].get('max_ulps')}):", "",
                  "| run | updates | real steps | overflows | worst master / m / v | "
                  "bad master / m / v | fp16 copy wrong | step count wrong | skip not clean |",
                  "|---|---:|---:|---:|---|---|---:|---:|---:|"]
        for r in shadows:
            sh, w, b = r["shadow"], r["shadow"]["worst_ulps"], r["shadow"]["bad_updates"]
            lines.append(f"| {r['variant']} s{r['seed']} | {sh['updates']} | {sh['real_steps']} | "
                         f"{sh['overflows']} | {w['master']:.1f} / {w['exp_avg']:.1f} / "
                         f"{w['exp_avg_sq']:.1f} | {b['master']} / {b['exp_avg']} / "
                         f"{b['exp_avg_sq']} | {b['fp16']} | {b['step']} | {b['untouched']} |")
    paired = [(v, s) for v, s in summary.items() if s.get("paired_seeds")]
    if paired:
        def cell(s, key, digits):
            d, p = s["paired"].get(key) or (None, None)
            return "–" if d is None else f"{d:+.{digits}f} ({p:.2f})"

        lines += ["", "Beside the verdict: Δ paired by seed (the mean over the seeds both sides "
                  "trained of the variant's mean minus the baseline's at that seed; p from "
                  "relabelings within each seed), and the length ratio over the hypotheses that "
                  "are not degenerate (the loops taken out):", "",
                  "| variant | seeds | paired Δ BLEU (p) | paired Δ length (p) | "
                  "paired Δ degenerate (p) | length ratio, loops out | paired Δ (p) |",
                  "|---|---:|---|---|---|---|---|"]
        for v, s in paired:
            lines.append(f"| {v} | {s['paired_seeds']} | {cell(s, 'bleu', 2)} | "
                         f"{cell(s, 'length_ratio', 3)} | {cell(s, 'degenerate', 1)} | "
                         f"{fmt(s.get('clean_length_ratio'), s.get('clean_length_ratio_sd'), 3)} "
                         f"| {cell(s, 'clean_length_ratio', 3)} |")
    gaps = curve_gaps(rows, list(summary))
    if gaps:
        lines += ["", f"Training loss − baseline's, mean over the seeds at each logged update "
                  f"from {CURVE_FROM_UPDATE} on:", "",
                  "| variant | updates | intervals | loss − baseline, mean | s.d. |",
                  "|---|---|---:|---:|---:|"]
        for v, g in gaps.items():
            lines.append(f"| {v} | {g['first']}–{g['last']} | {g['intervals']} | "
                         f"{g['mean']:+.4f} | {g['sd']:.4f} |")
    return "\n".join(lines)


def cuda_available():
    import torch

    return torch.cuda.is_available()


def cuda_device_count():
    import torch

    return torch.cuda.device_count()


def device_name(a):
    """The GPUs' names (no CUDA context in this process), or "cpu"."""
    return ", ".join(env.gpu_names()) if a.cuda else "cpu"


def prepare_corpus(a):
    """``(text dir, binarised dir, src, tgt)`` of ``a.corpus``, written and binarised once per
    --workdir. Benches started side by side (one per GPU pair) share --workdir: one prepares,
    the others wait for it (a file lock) and find it done."""
    src, tgt = a.langs.split(",")
    os.makedirs(a.workdir, exist_ok=True)
    with open(os.path.join(a.workdir, ".prepare.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        dest = None  # the corpora written here: binarised beside their text, under --workdir
        if a.corpus == "synthetic":
            text_dir = os.path.join(a.workdir, f"synthetic_{a.train_sentences}")
            if not os.path.exists(os.path.join(text_dir, "test.de")):
                corpora.write_learnable_sentences(text_dir, train=a.train_sentences)
            src, tgt = "en", "de"
        elif a.corpus == "real":
            text_dir = os.path.join(a.workdir, "real_gettext")
            if not os.path.exists(os.path.join(text_dir, "corpus.json")):
                corpora.write_real(text_dir)
            src, tgt = "en", "de"
        else:
            text_dir = a.corpus
            # binarised under --workdir (an absolute path), never beside a given text folder: the
            # device tool replaces a carried folder at each call, under runs still decoding
            dest = os.path.join(os.path.abspath(a.workdir), os.path.basename(text_dir) + "_bin")
        dest = dest or os.path.join(text_dir, "bin")
        return text_dir, corpora.preprocess(text_dir, 8, src, tgt, dest), src, tgt


def arg_parser():
    """The bench's options; their defaults are the recipe (bench/cpu_curve.py trains it too)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="real",
                   help="'real' (the gate: gettext catalogs, bench/benchlib/real_corpus.py), "
                        "'synthetic' (a smoke test: the learnable corpus) or a directory of tokenised "
                        "text {train,valid,test}.{SRC,TGT} (the real recipe)")
    p.add_argument("--langs", default="en,de", help="SRC,TGT file suffixes of --corpus DIR")
    p.add_argument("--train-sentences", type=int, default=120000,
                   help="synthetic corpus: training pairs")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--seeds", default="1,2,3")
    # None: the corpus's recipe (RECIPES)
    p.add_argument("--model", choices=sorted(MODELS), help="real: base; synthetic: small")
    p.add_argument("--max-update", type=int, help="real: 3000; synthetic: 1500")
    p.add_argument("--max-tokens", type=int,
                   help="4096. Per GPU: with --gpus N an update takes N times this (2X tokens "
                        "for --gpus 2 --max-tokens X); to train as a 1-GPU run at X, pass X/N")
    p.add_argument("--lr", type=float, help="real: 7e-4; synthetic: 1e-3")
    p.add_argument("--warmup-updates", type=int, help="real: 1000; synthetic: 500")
    p.add_argument("--dropout", type=float,
                   help="real: 0.3; synthetic: 0.1 (deterministic, needs little regularisation)")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--lenpen", type=float, default=1.0)
    p.add_argument("--jobs", type=int, default=12,
                   help="runs at a time on the one GPU (with --gpus N, all runs share the same N "
                        "GPUs). 25 base-model runs at once exhausted an H200's memory at start "
                        "and decoding; 12 keep it busy")
    p.add_argument("--gpus", type=int, default=1,
                   help="GPUs per training run, by fairseq's own data parallelism "
                        "(--distributed-world-size N, one process per GPU; decoding stays on "
                        "one GPU). --max-tokens is per GPU: to compare with 1-GPU rows at "
                        "--max-tokens X, pass X/N")
    p.add_argument("--ddp-backend",
                   help="passed to fairseq-train as given (default: not passed, so fairseq's "
                        "default, pytorch_ddp, as users get it)")
    p.add_argument("--update-freq", type=int,
                   help="passed to fairseq-train as given (default: not passed, i.e. 1); e.g. "
                        "--update-freq 2 on 1 GPU trains as --gpus 2 at the same --max-tokens")
    p.add_argument("--port-base", type=int, default=29600,
                   help="with --gpus > 1, run i rendezvouses at tcp://localhost:PORT_BASE+i "
                        "(change it for two benchmarks at once on one machine)")
    p.add_argument("--workdir", default="/tmp/ls_quality")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--json", help="write the rows and summary here")
    p.add_argument("--markdown", help="write the tables here")
    p.add_argument("--commit", default=None,
                   help="the commit measured (default: LS_BENCH_COMMIT, else git's HEAD)")
    p.add_argument("--tables-from", metavar="JSON[,JSON...]",
                   help="print the tables of --json files written earlier (their rows and "
                        "variants together), without training")
    p.add_argument("--no-baseline", action="store_true",
                   help="do not add the baseline (a call beside another that trains it: join "
                        "their --json files with --tables-from A,B)")
    return p


def recipe_name(corpus):
    return "synthetic" if corpus == "synthetic" else "real"


def parse_args(argv=None, parser=None):
    """The options, with those left unset taken from the corpus's recipe (``RECIPES``)."""
    a = (parser or arg_parser()).parse_args(argv)
    a.recipe = recipe_name(a.corpus)
    for key, value in RECIPES[a.recipe].items():
        if getattr(a, key, None) is None:
            setattr(a, key, value)
    return a


def main(argv=None):
    p = arg_parser()
    a = parse_args(argv, p)
    if a.tables_from:
        rows, variants, recipe = [], [], None
        for path in a.tables_from.split(","):  # several files: one table (e.g. side-by-side runs)
            with open(path) as f:
                saved = json.load(f)
            rows += saved["rows"]
            variants += [v for v in saved["summary"] if v not in variants]
            recipe = recipe or saved.get("recipe", "synthetic")
        variants += [r["variant"] for r in rows if r["variant"] not in variants]
        kept = distinct_runs(rows)
        if len(kept) < len(rows):
            print(f"({len(rows) - len(kept)} runs left out: exact repeats of a run in another "
                  f"file)\n")
        rows = kept
        summary = summarize(rows, variants, recipe)
        print(tables(rows, summary))
        return summary

    a.cuda = cuda_available()
    if a.gpus < 1:
        p.error(f"--gpus {a.gpus}: at least 1")
    if a.gpus > 1:
        found = cuda_device_count() if a.cuda else 0
        if found < a.gpus:
            p.error(f"--gpus {a.gpus}: only {found} CUDA device(s) visible (torch.cuda."
                    f"device_count(), CUDA_VISIBLE_DEVICES="
                    f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    if "baseline" not in variants and not a.no_baseline:
        variants.insert(0, "baseline")
    seeds = [int(s) for s in a.seeds.split(",")]
    jobs = job_list(variants, seeds, a.port_base)
    if a.gpus > 1 and not 1024 <= a.port_base <= jobs[-1][2] <= 65535:
        p.error(f"--port-base {a.port_base}: ports up to {jobs[-1][2]} must lie in 1024..65535")
    t0 = time.time()
    text_dir, data, src, tgt = prepare_corpus(a)
    with open(os.path.join(text_dir, f"test.{tgt}")) as f:
        raw_refs = dict(enumerate(line.rstrip("\n") for line in f))
    corpus_info = None
    if os.path.exists(os.path.join(text_dir, "corpus.json")):
        with open(os.path.join(text_dir, "corpus.json")) as f:
            corpus_info = json.load(f)
    print(f"corpus ready in {time.time() - t0:.0f}s: {data}", flush=True)

    if a.cuda and any(needs_plugin(v) for v in variants) and \
            os.environ.get("LS_FAIRSEQ_KERNELS", "auto") != "off":
        env.build_extension()  # once, before the runs load it concurrently

    lock = threading.Lock()
    with concurrent.futures.ThreadPoolExecutor(max_workers=a.jobs) as pool:
        rows = list(pool.map(lambda j: run_one(a, data, j[0], j[1], raw_refs, lock, j[2]), jobs))

    summary = summarize(rows, variants, a.recipe)
    text = tables(rows, summary)
    command = "python bench/quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    info = results.header("bench/quality.py", f"translation quality of {', '.join(variants)} "
                          f"against fairseq's baseline, {a.corpus} corpus, seeds {a.seeds}",
                          command, device=device_name(a), commit=a.commit)
    head = (f"Quality parity: {info['device']}, {setup_text(a)}, {info['date']}, "
            f"commit {info['commit']}, corpus {a.corpus}, model {a.model}, beam {a.beam}, "
            f"seeds {a.seeds}; {time.time() - t0:.0f}s in all")
    print("\n" + head + "\n\n" + text, flush=True)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(head + "\n\nCommand: `" + command + "`\n\n" + text + "\n")
    if a.json:
        results.write(a.json, info, rows, corpus=a.corpus, corpus_info=corpus_info,
                      recipe=a.recipe, lr=a.lr, warmup_updates=a.warmup_updates,
                      dropout=a.dropout, model=a.model, max_update=a.max_update,
                      max_tokens=a.max_tokens, gpus=a.gpus, ddp_backend=a.ddp_backend,
                      update_freq=a.update_freq, setup=setup_text(a), beam=a.beam, seeds=seeds,
                      summary=summary)
    return summary


if __name__ == "__main__":
    main()
