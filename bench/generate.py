#!/usr/bin/env python3
"""Decoding speed: fairseq-generate with fairseq's transformer vs the ls_ twin, same checkpoint.

For each model size, dtype, beam and batch size this script runs real ``fairseq-generate`` twice
on the same weights: **fairseq** (the checkpoint converted by ``ls-fairseq-convert --to fairseq``,
no ``--user-dir``) and **ls_** (the ls_ checkpoint, ``--user-dir ls_fairseq``), one after the
other in the same call on the same GPU. It reports fairseq-generate's own figures (its summary
line ``Translated N sentences (M tokens) in Xs (S sentences/s, T tokens/s)``, which times the
generation loop only: no model load, no data loading, no printing; the first batch's warm-up
counts, as for any user), and compares the hypotheses: the share of identical ``H-`` lines,
sacreBLEU and the hypothesis/reference length ratio of each side against the references.

* batch 1 (``--batch-size 1``): latency, ms per sentence, over the first ``--latency-sentences``
  test sentences (a split of their own, ``latency``: fairseq-generate has no sentence cap);
* batch 128 (``--batch-size 128``): throughput over the whole test split
  (``--test-sentences``);
* beam 1 and 5; fp16 (``--fp16``), bf16 (``--bf16``) and fp32 (no flag); fairseq's own length
  limit (``--max-len-a 0 --max-len-b 200``, its defaults, passed explicitly), ``--seed 1``.

Every run goes through a small wrapper around ``fairseq_cli.generate`` that records the dtype
the loaded models' weights had after decoding (and the peak GPU memory): fairseq 0.12 reads
``--bf16`` as "TPU" and ``fairseq-generate`` casts the model for ``--fp16`` only, so its
``--bf16`` decodes in fp32. Where the installed fairseq-generate has no bf16 cast, the fairseq
side of a bf16 row is not run and the row says "not supported by fairseq 0.12"; wherever a side
decoded in another dtype than asked, the row's notes say so. The commands in the JSON are the
plain ``fairseq-generate`` ones (without the wrapper): copy them to reproduce a run.

Checkpoints: ``--checkpoint-ls PATH`` takes an ls_ checkpoint (its fairseq twin is made with the
converter; ``--data BIN`` then names its binarised data unless it was trained on this script's
corpus). Otherwise one model per ``--sizes`` entry is trained with the plain ls_ command
(``ls_transformer`` for base, ``ls_transformer_wmt_en_de_big_t2t``, the repository's recipe, for
big; shared embeddings, ls_label_smoothed_cross_entropy, ls_adam, ``--fp16`` on a GPU) for
``--train-updates`` on the learnable corpus (``ls_fairseq.testing.learnable_corpus``) in lines
of WMT14-like lengths (``bench/e2e.py``'s, mean ~29 tokens), and converted; corpus and checkpoints
are cached under ``--workdir`` (a later call on the same machine reuses them). The model must be
trained: an untrained one loops to the length limit, so every hypothesis has 200 tokens and the
timing says nothing about real decoding; the rows' length ratio (~1.0 when trained) shows it.

Output: a markdown table (printed, and written with ``--markdown``) and every row as data
(``--json``, benchlib/results.py's schema: device, date, commit from LS_BENCH_COMMIT or git, the
exact commands). Each row's JSON is printed as ``GENERATE_ROW {...}`` and both files are
rewritten as soon as a row is done, so a call cut off by its time limit keeps the rows it
finished. Under the table, the decoding targets
(ls_ ≥ 3x fairseq's sentences/s at big, fp16, beam 5, batch 128 and ≥ 2x at batch 1; fp32
hypotheses identical; fp16 ≥ 99% identical and BLEU within 0.1) are checked for the rows present.
``--floor-batch N`` decodes fairseq's side once more at batch N and adds the share of its lines
that equal its own at the row's batch: in fp16, how closely fairseq agrees with itself.

Examples (one GPU of the H100 class; times are estimates, each with the corpus (~0.5 min) and the
training of its sizes (~1 min base, ~2 min big) the first time a --workdir sees them, plus the
extension's JIT build on a fresh machine; each decoding run also spends ~25-35 s starting fairseq
and loading the model, so a batch-128 row takes ~1.5 minutes):

    # the target rows: big, fp16, beam 5, batch 128 and batch 1 (about 5 minutes)
    python bench/generate.py --sizes big --dtypes fp16 --beams 5 --batches 128,1 \\
        --json $OUT/generate_target.json --markdown $OUT/generate_target.md

    # the full table, 2 sizes x 2 dtypes x 2 beams x 2 batches (about 20 minutes)
    python bench/generate.py --json $OUT/generate.json --markdown $OUT/generate.md

    # the same in calls of at most 10 minutes on one warm machine (same --workdir: the corpus and
    # checkpoints are reused): big fp16 ~7 min, big bf16 ~3 min, base ~6 min
    python bench/generate.py --sizes big --dtypes fp16 --json $OUT/generate_big_fp16.json
    python bench/generate.py --sizes big --dtypes bf16 --json $OUT/generate_big_bf16.json
    python bench/generate.py --sizes base --json $OUT/generate_base.json

    # the CPU check of the pipeline (tests/test_bench_generate.py, ~1 minute): fp32, tiny model
    python bench/generate.py --device cpu --size tiny --dtypes fp32 --beams 1 --batches 1,16 \\
        --lines sentence --train-sentences 600 --test-sentences 48 --latency-sentences 8 \\
        --train-updates 10
"""
import argparse
import glob
import inspect
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time

import quality  # H-/T- parsing, sacreBLEU scoring, the tiny model, log parsing
from benchlib import corpora, env, results

USER_DIR = env.USER_DIR

# size -> (ls_ architecture trained, extra model options)
SIZES = {
    "tiny": ("ls_transformer", quality.MODELS["tiny"]),  # the CPU smoke test
    "base": ("ls_transformer", []),
    "big": ("ls_transformer_wmt_en_de_big_t2t", []),  # recipes/wmt14_en_de/train.sh's model
}
DTYPE_FLAGS = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}
TORCH_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
SIDES = ("fairseq", "ls")
FAIRSEQ_NO_BF16 = ("not supported by fairseq 0.12 (fairseq-generate --bf16 sets its TPU flag "
                   "and casts the model for --fp16 only: it decodes in fp32)")

SUMMARY = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s "
                     r"\(([\d.]+) sentences/s, ([\d.]+) tokens/s\)")


def parse_summary(text):
    """fairseq-generate's summary line as numbers (the last one in ``text``), or None."""
    found = SUMMARY.findall(text)
    if not found:
        return None
    n, tokens, secs, sent_s, tok_s = found[-1]
    return dict(sentences=int(n.replace(",", "")), tokens=int(tokens.replace(",", "")),
                seconds=float(secs), sent_s=float(sent_s), tok_s=float(tok_s))


def parse_probe(text):
    dtype = re.findall(r"^BENCH_MODEL_DTYPE (\S+)", text, re.M)
    peak = re.findall(r"^BENCH_PEAK_BYTES (\d+)", text, re.M)
    return dict(model_dtype=dtype[-1] if dtype else None,
                peak_gb=round(int(peak[-1]) / 2**30, 2) if peak else None)


# --------------------------------------------------------------------------------------------
# corpus and checkpoints
# --------------------------------------------------------------------------------------------

def write_text_corpus(text_dir, lines, train, test, latency, seed=1):
    """``text_dir/{train,valid,test,latency}.{en,de}`` of the learnable corpus: WMT-like lines
    (``lines="wmt"``: sentences joined to lengths of mean ~29 tokens) or single sentences
    (``"sentence"``, ~13 tokens: the CPU test). ``latency`` is the first lines of ``test``."""
    if lines == "wmt":
        corpora.write_learnable_wmt(text_dir, train, seed=seed, test=test)
    else:
        corpora.write_learnable_sentences(text_dir, train=train, valid=min(500, max(test, 50)),
                                          test=test, seed=seed)
    pairs = list(zip(*(corpora.read_lines(os.path.join(text_dir, f"test.{s}"))
                       for s in ("en", "de"))))
    from ls_fairseq.testing.learnable_corpus import write_split

    write_split(text_dir, "latency", pairs[:latency])


def prepare_corpus(a):
    """The binarised corpus (cached under --workdir) and its raw references per split."""
    key = f"{a.lines}_{a.train_sentences}_{a.test_sentences}_{a.latency_sentences}"
    text_dir = os.path.join(a.workdir, "corpus_" + key)
    if not os.path.exists(os.path.join(text_dir, "latency.de")):
        write_text_corpus(text_dir, a.lines, a.train_sentences, a.test_sentences,
                          a.latency_sentences)
    data = corpora.preprocess(text_dir, 8)
    if not os.path.exists(os.path.join(data, "latency.en-de.de.idx")):
        corpora.binarise_split(text_dir, data, "latency")
    return data, {split: dict(enumerate(corpora.read_lines(os.path.join(text_dir, f"{split}.de"))))
                  for split in ("test", "latency")}


def train_cmd(a, data, size, save_dir):
    """The plain ls_ command (names and --fp16 only), a short schedule for a learnable task."""
    arch, model = SIZES[size]
    return env.fairseq_cmd("train") + [
        data, "--user-dir", USER_DIR, "--arch", arch,
        "--share-all-embeddings", "--optimizer", "ls_adam", "--adam-betas", "(0.9, 0.98)",
        "--clip-norm", "0.0", "--lr", str(a.lr), "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", str(a.warmup_updates), "--dropout", "0.1", "--weight-decay", "0.0001",
        "--criterion", "ls_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-tokens", str(a.train_max_tokens), "--max-update", str(a.train_updates),
        "--fp16" if a.device == "cuda" else "--cpu", "--seed", "1", "--save-dir", save_dir,
        "--no-epoch-checkpoints", "--no-save-optimizer-state", "--save-interval", "100000",
        "--validate-interval", "100000", "--log-format", "simple", "--log-interval", "100",
        "--no-progress-bar", "--num-workers", "0",
    ] + model


def convert_cmd(ls_ckpt, fairseq_ckpt):
    return [sys.executable, "-m", "ls_fairseq.cli.convert_checkpoint", ls_ckpt, fairseq_ckpt,
            "--to", "fairseq"]


def convert(ls_ckpt, fairseq_ckpt):
    """Writes the fairseq twin; returns its architecture (the converter's report)."""
    out = subprocess.run(convert_cmd(ls_ckpt, fairseq_ckpt), capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"converting {ls_ckpt} failed: {out.stderr.strip()[-2000:]}")
    arch = re.findall(r"with arch (\S+)", out.stdout)
    return arch[-1] if arch else "unknown"


def trained_model(a, data, size):
    """(ls_ checkpoint, fairseq checkpoint, info) of ``size``, trained and converted once per
    --workdir and settings."""
    save_dir = os.path.join(os.path.dirname(data), "models",
                            f"{size}_u{a.train_updates}_t{a.train_max_tokens}_lr{a.lr}_"
                            f"w{a.warmup_updates}_{a.device}")
    ls_ckpt = os.path.join(save_dir, "checkpoint_last.pt")
    fs_ckpt = os.path.join(save_dir, "fairseq.pt")
    info_path = os.path.join(save_dir, "info.json")
    if os.path.exists(fs_ckpt) and os.path.exists(info_path):
        with open(info_path) as f:
            return ls_ckpt, fs_ckpt, dict(json.load(f), cached=True)
    shutil.rmtree(save_dir, ignore_errors=True)
    os.makedirs(save_dir)
    cmd = train_cmd(a, data, size, save_dir)
    t0 = time.time()
    with open(os.path.join(save_dir, "train.log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1")).returncode
    with open(os.path.join(save_dir, "train.log")) as f:
        info = dict(quality.parse_train_log(f.read()), train_s=round(time.time() - t0, 1),
                    arch=SIZES[size][0], train_command=shlex.join(cmd))
    if rc != 0 or not os.path.exists(ls_ckpt):
        raise SystemExit(f"fairseq-train exit {rc} for {size} (see {save_dir}/train.log)")
    info["fairseq_arch"] = convert(ls_ckpt, fs_ckpt)
    with open(info_path, "w") as f:
        json.dump(info, f, indent=1)
    print(f"trained {size} in {info['train_s']:.0f}s: {info}", flush=True)
    return ls_ckpt, fs_ckpt, info


# --------------------------------------------------------------------------------------------
# decoding runs
# --------------------------------------------------------------------------------------------

def generate_args(data, checkpoint, side, subset, beam, batch, dtype, device, extra=()):
    """fairseq-generate's arguments for one run (without the interpreter): the fairseq side
    without --user-dir, the ls_ side with it."""
    args = [data, "--path", checkpoint, "--gen-subset", subset, "--beam", str(beam),
            "--batch-size", str(batch), "--max-len-a", "0", "--max-len-b", "200",
            # fairseq's default multiple, 8, drops a sentence at --batch-size 1
            "--required-batch-size-multiple", "1", "--seed", "1"] + DTYPE_FLAGS[dtype]
    if device == "cpu":
        args.append("--cpu")
    if side == "ls":
        args += ["--user-dir", USER_DIR]
    return args + list(extra)


def fairseq_generate_casts_bf16():
    """Whether the installed fairseq-generate casts the model for --bf16 (0.12 does not)."""
    import fairseq_cli.generate

    return re.search(r"bf16|bfloat16", inspect.getsource(fairseq_cli.generate)) is not None


def run_generate(args, log_path, device="cuda"):
    """One fairseq-generate run: its summary, probe and hypotheses, or an error."""
    cmd = env.probe_cmd("generate_probe", *args)
    # plain fairseq loads checkpoints only with torch's unsafe loader under torch >= 2.6 (a
    # converted one loads without it); the same loader on both sides
    run_env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    if device == "cpu":  # torch's threads fight over a busy CPU (10x slower seen on 2 cores)
        run_env["OMP_NUM_THREADS"] = "1"
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=run_env)
    text = proc.stdout + proc.stderr
    with open(log_path, "w") as f:
        f.write(text)
    run = dict(wall_s=round(time.time() - t0, 1), **parse_probe(text))
    summary = parse_summary(text)
    hyps, refs = quality.parse_generate(proc.stdout)
    if proc.returncode != 0 or summary is None or not hyps:
        run["error"] = f"fairseq-generate exit {proc.returncode} (see {log_path})"
        # the log may stay on a machine the caller never sees: its last lines go to stdout
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        print(f"{run['error']}; the end of its stderr:\n{tail}", flush=True)
        return run, {}, {}
    run.update(summary)
    return run, hyps, refs


def median_of(runs, key):
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def side_figures(runs, hyps, refs, batch):
    """One side's figures: medians over its runs, BLEU and length ratio of its hypotheses."""
    if not runs or any("error" in r for r in runs):
        return dict(error=next((r["error"] for r in runs if "error" in r), "not run"))
    out = dict(sent_s=median_of(runs, "sent_s"), tok_s=median_of(runs, "tok_s"),
               sentences=runs[0]["sentences"], tokens=runs[0]["tokens"],
               model_dtype=runs[0]["model_dtype"], peak_gb=runs[0]["peak_gb"],
               runs=[{k: r.get(k) for k in ("sent_s", "tok_s", "seconds", "wall_s")}
                     for r in runs])
    if batch == 1 and out["sent_s"]:
        out["ms_per_sentence"] = 1000.0 / out["sent_s"]
    ids = sorted(hyps)
    if ids and all(i in refs for i in ids):
        s = quality.score([hyps[i] for i in ids], [refs[i] for i in ids])
        out.update(bleu=s["bleu"], length_ratio=s["length_ratio"], degenerate=s["degenerate"])
    return out


def identical_fraction(a, b):
    """Share of sentence ids whose hypotheses are the same on both sides (over both sides' ids:
    a sentence one side lacks counts as different)."""
    ids = set(a) | set(b)
    return sum(a.get(i) == b.get(i) for i in ids) / len(ids) if ids else None


def make_row(config, figures, hyps, commands):
    """The row of one configuration from each side's figures and hypotheses: speedup (ls_ over
    fairseq sentences/s), identical fraction, dtype notes."""
    fs, ls = figures["fairseq"], figures["ls"]
    row = dict(config)
    for side, f in (("fairseq", fs), ("ls", ls)):
        for k, v in f.items():
            row[f"{side}_{k}"] = v
    row["speedup"] = (ls["sent_s"] / fs["sent_s"]
                      if fs.get("sent_s") and ls.get("sent_s") else None)
    row["identical"] = (identical_fraction(hyps["fairseq"], hyps["ls"])
                        if hyps.get("fairseq") and hyps.get("ls") else None)
    notes = []
    want = TORCH_DTYPE[config["dtype"]]
    for side, f in (("fairseq", fs), ("ls_", ls)):
        if f.get("model_dtype") not in (None, want):
            notes.append(f"{side} decoded in {f['model_dtype']}")
        if f.get("error") and f["error"] != FAIRSEQ_NO_BF16:
            notes.append(f"{side}: {f['error']}")
    if fs.get("error") == FAIRSEQ_NO_BF16:
        notes.append("fairseq: " + FAIRSEQ_NO_BF16)
    row["notes"] = notes
    row["commands"] = commands
    return row


def run_config(a, config, checkpoints, data, refs):
    """Both sides of one (size, dtype, beam, batch), alternating for --repeats."""
    subset = "latency" if config["batch"] == 1 else "test"
    name = "{size}_{dtype}_beam{beam}_batch{batch}".format(**config)
    runs, hyps, commands, figures, gold = {s: [] for s in SIDES}, {}, {}, {}, refs.get(subset)
    skip_fairseq = config["dtype"] == "bf16" and not a.fairseq_bf16
    for s in SIDES:
        commands[s] = "fairseq-generate " + shlex.join(generate_args(
            data, checkpoints[s], s, subset, config["beam"], config["batch"], config["dtype"],
            a.device, shlex.split(a.ls_args) if s == "ls" else []))
    for r in range(a.repeats):
        order = SIDES if r % 2 == 0 else SIDES[::-1]  # alternate: drift hits both sides alike
        for s in order:
            if s == "fairseq" and skip_fairseq:
                continue
            args = shlex.split(commands[s])[1:]
            run, h, t = run_generate(
                args, os.path.join(a.workdir, "runs", f"{name}_{s}_{r}.txt"), a.device)
            runs[s].append(run)
            if r == 0:
                hyps[s] = h
                gold = gold or t  # --data without raw text: fairseq's T- lines
    for s in SIDES:
        if s == "fairseq" and skip_fairseq:
            figures[s] = dict(error=FAIRSEQ_NO_BF16)
        else:
            figures[s] = side_figures(runs[s], hyps.get(s, {}), gold or {}, config["batch"])
    row = make_row(dict(config, subset=subset), figures, hyps, commands)
    if a.floor_batch and config["batch"] > 1 and hyps.get("fairseq"):
        row.update(noise_floor(a, config, checkpoints["fairseq"], data, subset, name, hyps))
    return row


def noise_floor(a, config, checkpoint, data, subset, name, hyps):
    """fairseq against itself: its hypotheses at --floor-batch against those at the row's batch.
    In fp16 a batch of another size pads and groups sentences differently, so the same model's
    scores round differently and near-ties flip; no decoder can agree with fairseq's
    more closely than fairseq agrees with itself."""
    args = generate_args(data, checkpoint, "fairseq", subset, config["beam"], a.floor_batch,
                         config["dtype"], a.device, [])
    run, floor, _ = run_generate(
        args, os.path.join(a.workdir, "runs", f"{name}_fairseq_floor{a.floor_batch}.txt"),
        a.device)
    if "error" in run:
        return dict(floor_batch=a.floor_batch, floor_error=run["error"])
    return dict(floor_batch=a.floor_batch,
                fairseq_floor_identical=identical_fraction(hyps["fairseq"], floor),
                ls_floor_identical=(identical_fraction(hyps["ls"], floor)
                                    if hyps.get("ls") else None))


# --------------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------------

def fmt(v, spec):
    return "–" if v is None else format(v, spec)


def pair(row, key, spec):
    return f"{fmt(row.get('fairseq_' + key), spec)} / {fmt(row.get('ls_' + key), spec)}"


def notes(row):
    out = list(row.get("notes", []))
    if row.get("fairseq_floor_identical") is not None:
        out.append(f"fairseq at batch {row['floor_batch']}: "
                   f"{100 * row['fairseq_floor_identical']:.1f}% identical to itself")
    return out


def markdown(rows):
    lines = ["| size | dtype | beam | batch | fairseq sent/s | ls_ sent/s | speedup | "
             "fairseq tok/s | ls_ tok/s | ms/sentence fairseq / ls_ | identical | "
             "BLEU fairseq / ls_ | length ratio fairseq / ls_ | notes |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ms = pair(r, "ms_per_sentence", ".1f") if r["batch"] == 1 else ""
        speedup = "–" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
        ident = "–" if r.get("identical") is None else f"{100 * r['identical']:.1f}%"
        lines.append(
            f"| {r['size']} | {r['dtype']} | {r['beam']} | {r['batch']} | "
            f"{fmt(r.get('fairseq_sent_s'), ',.1f')} | {fmt(r.get('ls_sent_s'), ',.1f')} | "
            f"{speedup} | {fmt(r.get('fairseq_tok_s'), ',.0f')} | "
            f"{fmt(r.get('ls_tok_s'), ',.0f')} | {ms} | {ident} | {pair(r, 'bleu', '.2f')} | "
            f"{pair(r, 'length_ratio', '.3f')} | {'; '.join(notes(r))} |")
    return "\n".join(lines)


BLEU_EQUAL = 0.1  # "equal BLEU" for fp16: within 0.1


def targets(rows):
    """The decoding targets, checked on the rows present: (text, met or None if not measured)."""
    out = []
    for r in rows:
        where = f"{r['size']} {r['dtype']} beam {r['beam']} batch {r['batch']}"
        if r["size"] == "big" and r["dtype"] == "fp16" and r["beam"] == 5 and \
                r["batch"] in (1, 128):
            need = 3.0 if r["batch"] == 128 else 2.0
            got = r.get("speedup")
            out.append((f"{where}: ls_ {fmt(got, '.2f')}x fairseq's sentences/s "
                        f"(target ≥ {need:.0f}x)", None if got is None else got >= need))
        if r.get("identical") is None:
            continue
        if r["dtype"] == "fp32":
            out.append((f"{where}: {100 * r['identical']:.1f}% identical hypotheses "
                        "(target 100%)", r["identical"] == 1.0))
        elif r["dtype"] == "fp16":
            d = (None if r.get("fairseq_bleu") is None or r.get("ls_bleu") is None
                 else r["ls_bleu"] - r["fairseq_bleu"])
            floor = ("" if r.get("fairseq_floor_identical") is None else
                     f"; fairseq against itself at batch {r['floor_batch']}: "
                     f"{100 * r['fairseq_floor_identical']:.1f}%")
            out.append((f"{where}: {100 * r['identical']:.1f}% identical, Δ BLEU "
                        f"{fmt(d, '+.2f')} (target ≥ 99%, |Δ| ≤ {BLEU_EQUAL}{floor})",
                        d is not None and r["identical"] >= 0.99 and abs(d) <= BLEU_EQUAL))
    return out


def targets_markdown(rows):
    found = targets(rows)
    if not found:
        return ""
    mark = {True: "met", False: "**not met**", None: "not measured"}
    return "Targets:\n\n" + "\n".join(f"- {t}: {mark[ok]}" for t, ok in found)


# --------------------------------------------------------------------------------------------
# the call
# --------------------------------------------------------------------------------------------

def cuda_available():
    import torch

    return torch.cuda.is_available()


def device_name(device):
    """The GPU's name (``env.gpu_names``: no CUDA context in this process), or "cpu"."""
    return "cpu" if device == "cpu" else env.gpu_names()[0]


def csv_of(text, cast=str):
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", "--size", default="base,big",
                   help=f"model sizes, of {', '.join(SIZES)} (tiny: the CPU smoke test)")
    p.add_argument("--dtypes", default="fp16,bf16", help="of fp16, bf16, fp32")
    p.add_argument("--beams", default="1,5")
    p.add_argument("--batches", default="1,128",
                   help="--batch-size values; batch 1 decodes the latency split")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per side and configuration (alternating sides); the median counts")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the tests' pipeline check (fp32 only, no --fp16/--bf16)")
    p.add_argument("--checkpoint-ls",
                   help="an ls_ checkpoint to decode instead of training one per size (its "
                        "fairseq twin is written beside it by ls-fairseq-convert)")
    p.add_argument("--data",
                   help="with --checkpoint-ls: its binarised data, with splits 'test' and "
                        "'latency' (default: this script's corpus); references from its T- lines")
    p.add_argument("--lines", choices=("wmt", "sentence"), default="wmt",
                   help="corpus lines: wmt (sentences joined to WMT14-like lengths, mean ~29 "
                        "tokens) or sentence (single sentences, ~13 tokens)")
    p.add_argument("--train-sentences", type=int, default=40000, help="training lines")
    p.add_argument("--test-sentences", type=int, default=3000,
                   help="test lines decoded at batch > 1 (3000: several seconds per batch-128 "
                        "run on an H100, so the first batch's warm-up is a small share)")
    p.add_argument("--latency-sentences", type=int, default=200,
                   help="the first test lines, decoded one at a time for batch 1")
    p.add_argument("--train-updates", type=int, default=1500,
                   help="updates of the trained checkpoints: enough to learn the task, so "
                        "hypotheses have realistic lengths (an untrained model loops to the "
                        "200-token limit and the timing means nothing)")
    p.add_argument("--train-max-tokens", type=int,
                   help="tokens per training batch (default 8192 on a GPU, 1024 on the CPU)")
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--warmup-updates", type=int, default=500)
    p.add_argument("--floor-batch", type=int, default=0,
                   help="also decode fairseq's side at this --batch-size (rows of batch > 1) and "
                        "report how many of its hypotheses equal its own at the row's batch: "
                        "the fp16 noise floor of the identical column (0: not run)")
    p.add_argument("--ls-args", default="",
                   help="more fairseq-generate options for the ls_ side only (quoted)")
    p.add_argument("--fairseq-bf16", action="store_true",
                   help="run the fairseq side of bf16 rows even where fairseq-generate has no "
                        "bf16 cast (it then decodes in fp32; the row notes it)")
    p.add_argument("--workdir", default="/tmp/ls_generate")
    p.add_argument("--json", help="write every row and the call's details here")
    p.add_argument("--markdown", help="write the table here")
    a = p.parse_args(argv)
    a.sizes, a.dtypes = csv_of(a.sizes), csv_of(a.dtypes)
    a.beams, a.batches = csv_of(a.beams, int), csv_of(a.batches, int)
    bad = [s for s in a.sizes if s not in SIZES] + [d for d in a.dtypes if d not in DTYPE_FLAGS]
    if bad:
        p.error(f"unknown size/dtype {bad}: sizes {list(SIZES)}, dtypes {list(DTYPE_FLAGS)}")
    if a.device == "cpu" and set(a.dtypes) != {"fp32"}:
        p.error("--device cpu decodes in fp32 only: pass --dtypes fp32")
    if a.device == "cuda" and not cuda_available():
        p.error("no CUDA device visible (torch.cuda.is_available() is False): this benchmark "
                "measures GPU decoding; --device cpu --size tiny --dtypes fp32 checks the "
                "pipeline on the CPU")
    if a.floor_batch < 0 or a.floor_batch in a.batches:
        p.error(f"--floor-batch {a.floor_batch}: a batch size >= 1 other than those of "
                f"--batches {a.batches} (fairseq against itself at the same batch is the same "
                "run), or 0 for none")
    if a.data and not a.checkpoint_ls:
        p.error("--data goes with --checkpoint-ls")
    if a.checkpoint_ls and not os.path.isfile(a.checkpoint_ls):
        p.error(f"--checkpoint-ls {a.checkpoint_ls}: no such file")
    if a.data:
        for split in ("test", "latency"):
            if not glob.glob(os.path.join(a.data, f"{split}.*.idx")):
                p.error(f"--data {a.data} has no binarised '{split}' split")
    if a.train_max_tokens is None:
        a.train_max_tokens = 8192 if a.device == "cuda" else 1024
    a.fairseq_bf16 = a.fairseq_bf16 or ("bf16" in a.dtypes and fairseq_generate_casts_bf16())
    return a


def _version(package):
    import importlib.metadata

    for name in (package, f"{package}-fixed"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    t0 = time.time()
    os.makedirs(os.path.join(a.workdir, "runs"), exist_ok=True)
    info = results.header(
        "bench/generate.py", f"decoding speed and agreement, fairseq-generate with fairseq's "
        f"transformer and the ls_ twin: sizes {','.join(a.sizes)}, dtypes {','.join(a.dtypes)}, "
        f"beams {','.join(map(str, a.beams))}, batches {','.join(map(str, a.batches))}",
        "python bench/generate.py " + shlex.join(argv), device=device_name(a.device))
    info.update(fairseq_bf16=a.fairseq_bf16, fairseq=_version("fairseq"))
    if a.device == "cuda" and os.environ.get("LS_FAIRSEQ_KERNELS", "auto") != "off":
        env.build_extension()

    if a.data:
        data, refs = a.data, {}
    else:
        data, refs = prepare_corpus(a)
        print(f"corpus ready in {time.time() - t0:.0f}s: {data}", flush=True)
    if a.checkpoint_ls:  # one model, named by its fairseq architecture
        fs_ckpt = os.path.splitext(os.path.abspath(a.checkpoint_ls))[0] + ".fairseq.pt"
        arch = convert(a.checkpoint_ls, fs_ckpt)
        given = dict(arch="ls_" + arch, fairseq_arch=arch)
        models = [(arch, lambda: (a.checkpoint_ls, fs_ckpt, given))]
    else:  # trained when its rows come: a call cut short keeps the rows of the sizes before
        models = [(size, lambda size=size: trained_model(a, data, size)) for size in a.sizes]
    info["models"] = {}
    rows = []
    head = (f"Decoding: {info['device']}, {info['date']}, commit {info['commit']}, "
            f"fairseq {info.get('fairseq', '?')}, torch {info.get('torch', '?')}")

    def write():
        text = markdown(rows)
        goals = targets_markdown(rows)
        if a.markdown:
            with open(a.markdown, "w") as f:
                f.write(f"{head}\n\nCommand: `{info['command']}`\n\n{text}\n"
                        + (f"\n{goals}\n" if goals else ""))
        if a.json and rows:
            results.write(a.json, info, rows, targets=targets(rows))
        return text, goals

    for size, model in models:
        ls_ckpt, fs_ckpt, info["models"][size] = model()
        for dtype in a.dtypes:
            for beam in a.beams:
                for batch in a.batches:
                    config = dict(size=size, dtype=dtype, beam=beam, batch=batch)
                    row = run_config(a, config, dict(fairseq=fs_ckpt, ls=ls_ckpt), data, refs)
                    rows.append(row)
                    print("GENERATE_ROW " + json.dumps(row), flush=True)
                    write()
    text, goals = write()
    print(f"\n{head}; {time.time() - t0:.0f}s in all\n\n{text}\n" + (f"\n{goals}\n" if goals
                                                                       else ""), flush=True)
    return rows


if __name__ == "__main__":
    main()
