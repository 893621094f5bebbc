"""ls-fairseq-quickstart: train a fairseq baseline and an ls_ model side by side, end to end.

    ls-fairseq-quickstart [--workdir DIR] [--device auto|cpu|cuda] [--size tiny|base|big]
                          [--train-sentences N] [--max-update N] [--minutes M] [--runs baseline,ls]

On a generated English->German-like corpus (a small grammar with word reordering, so a model
learns it in minutes), it

1. writes the corpus (tokenised the way Moses' tokenizer -a does) and runs fairseq-preprocess
   --joined-dictionary;
2. trains ``transformer_wmt_en_de_big_t2t`` with label_smoothed_cross_entropy + adam, then the
   same with ``ls_transformer_wmt_en_de_big_t2t`` + ls_label_smoothed_cross_entropy + ls_adam
   (``--user-dir`` the plugin), with the hyperparameters of recipes/wmt14_en_de (scaled down);
3. decodes the test set with beam 4, lenpen 0.6 and scores it with sacreBLEU;
4. prints the ls-fairseq-compare table and the paths of its plots.

Defaults: on a GPU the real big Transformer (1 GPU, fp16); on CPU a tiny model. Everything lands
in --workdir (default ./ls_fairseq_quickstart, or next to the checkout when started inside an
ls-fairseq source checkout, which it never writes into): runs/<name>/train.log,
runs/<name>/eval/, compare/*.png.

On CPU the ls_ run takes the PyTorch reference path (the kernels' math, not their speed), so it
runs at about the baseline's speed; it says so. The speed-ups need a CUDA GPU. On CPU the runs'
speeds are not compared either: they train one after the other on a machine whose load may
change in between, so the table's speed rows say "not a speed test" and give the load average
seen during each run, and the model-FLOP rows (tflops, mfu: a GPU's measure) are left out.
"""
import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time

# --------------------------------------------------------------------------------------------
# the generated corpus
# --------------------------------------------------------------------------------------------

# English -> German-like lexicon. The target is word-for-word with two reorderings (adverb after
# the verb, verb-final subordinate clauses), so attention has to learn non-monotonic alignments.
NOUNS = {
    "cat": "Katze", "dog": "Hund", "house": "Haus", "tree": "Baum", "car": "Auto",
    "city": "Stadt", "river": "Fluss", "teacher": "Lehrer", "child": "Kind", "book": "Buch",
    "garden": "Garten", "table": "Tisch", "window": "Fenster", "bird": "Vogel", "horse": "Pferd",
    "doctor": "Arzt", "student": "Student", "letter": "Brief", "road": "Straße", "bridge": "Brücke",
    "farmer": "Bauer", "market": "Markt", "school": "Schule", "train": "Zug", "island": "Insel",
    "mountain": "Berg", "friend": "Freund", "king": "König", "village": "Dorf", "apple": "Apfel",
}
ADJS = {
    "big": "große", "small": "kleine", "old": "alte", "new": "neue", "red": "rote",
    "green": "grüne", "quiet": "leise", "happy": "glückliche", "young": "junge", "dark": "dunkle",
    "high-quality": "hochwertige", "well-known": "bekannte", "long-term": "langfristige",
}
VERBS = {
    "sees": "sieht", "finds": "findet", "buys": "kauft", "builds": "baut", "visits": "besucht",
    "paints": "malt", "carries": "trägt", "follows": "folgt", "loves": "liebt", "helps": "hilft",
    "reads": "liest", "sells": "verkauft", "opens": "öffnet", "draws": "zeichnet",
}
ADVS = {"today": "heute", "often": "oft", "again": "wieder", "slowly": "langsam", "never": "nie"}
DETS = {"the": "die", "a": "eine", "every": "jede", "this": "diese"}


def _noun_phrase(rng):
    det = rng.choice(sorted(DETS))
    en, de = [det], [DETS[det]]
    if rng.random() < 0.5:
        adj = rng.choice(sorted(ADJS))
        en.append(adj)
        de.append(ADJS[adj])
    noun = rng.choice(sorted(NOUNS))
    return en + [noun], de + [NOUNS[noun]]


def _sentence_pair(rng):
    s_en, s_de = _noun_phrase(rng)
    verb = rng.choice(sorted(VERBS))
    o_en, o_de = _noun_phrase(rng)
    en = s_en + [verb] + o_en
    de = s_de + [VERBS[verb]]
    if rng.random() < 0.4:
        adv = rng.choice(sorted(ADVS))
        en.append(adv)
        de.append(ADVS[adv])
    de += o_de
    if rng.random() < 0.4:
        s2_en, s2_de = _noun_phrase(rng)
        verb2 = rng.choice(sorted(VERBS))
        o2_en, o2_de = _noun_phrase(rng)
        en += [",", "because"] + s2_en + [verb2] + o2_en
        de += [",", "weil"] + s2_de + o2_de + [VERBS[verb2]]
    en_s = " ".join(en).replace(" ,", ",") + "."
    de_s = " ".join(de).replace(" ,", ",") + "."
    if rng.random() < 0.15:
        en_s, de_s = '"' + en_s[:-1] + '".', "„" + de_s[:-1] + "“."
    return en_s[0].upper() + en_s[1:], de_s[0].upper() + de_s[1:]


def synthetic_corpus(n, seed=1):
    """n untokenised sentence pairs -> (english list, german-like list)."""
    rng = random.Random(seed)
    pairs = [_sentence_pair(rng) for _ in range(n)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def tokenize(text):
    """Moses tokenizer.perl -a (XML-escaped) output for the generated sentences (tested equal to
    sacremoses on them), without needing sacremoses."""
    text = text.replace('"', " &quot; ")
    text = re.sub(r"([„“,.])", r" \1 ", text)
    text = re.sub(r"(\w)-(\w)", r"\1 @-@ \2", text)
    return " ".join(text.split())


def detokenize(text, lang="de"):
    """Inverse of tokenize(): sacremoses' detokenizer when installed, else a simple fallback."""
    try:
        from sacremoses import MosesDetokenizer
    except ImportError:
        MosesDetokenizer = None
    if MosesDetokenizer is not None:
        return MosesDetokenizer(lang=lang).detokenize(text.split())
    text = text.replace(" @-@ ", "-").replace("&quot;", '"')
    text = re.sub(r"„ ", "„", text)
    text = re.sub(r" ([“,.])", r"\1", text)
    out, open_quote = [], True
    for part in re.split(r'( ?" ?)', text):  # straight quotes: alternate opening / closing
        if part.strip() == '"':
            out.append(' "' if open_quote else '" ')
            open_quote = not open_quote
        else:
            out.append(part)
    return "".join(out).strip().replace('  ', ' ')


def write_sgm(path, lines, setid="newstest2014", lang="en", kind="srcset"):
    """A WMT test set file (the layout of test-full/newstest2014-deen-*.sgm)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write('<{} setid="{}" srclang="any">\n'.format(kind, setid))
        f.write('<doc sysid="ref" docid="synthetic" genre="news" origlang="{}">\n<p>\n'.format(lang))
        for i, line in enumerate(lines, 1):
            f.write('<seg id="{}">{}</seg>\n'.format(i, line))
        f.write("</p>\n</doc>\n</{}>\n".format(kind))


def write_wmt_raw_dir(raw_dir, n_train=600, n_test=40, seed=1, nc="v9"):
    """A raw directory in the layout of the extracted WMT14 archives, for prepare.sh --raw-dir:
    the training pairs split over the three corpora, newstest2014 as sgm files."""
    en, de = synthetic_corpus(n_train, seed)
    corpora = ["training/europarl-v7.de-en", "commoncrawl.de-en", "training/news-commentary-{}.de-en".format(nc)]
    os.makedirs(os.path.join(raw_dir, "training"), exist_ok=True)
    os.makedirs(os.path.join(raw_dir, "test-full"), exist_ok=True)
    parts = [(0, n_train // 2), (n_train // 2, 3 * n_train // 4), (3 * n_train // 4, n_train)]
    for name, (a, b) in zip(corpora, parts):
        for lang, side in (("en", en), ("de", de)):
            with open(os.path.join(raw_dir, name + "." + lang), "w", encoding="utf-8") as f:
                f.write("".join(s + "\n" for s in side[a:b]))
    ten, tde = synthetic_corpus(n_test, seed + 1000)
    write_sgm(os.path.join(raw_dir, "test-full", "newstest2014-deen-src.en.sgm"), ten, lang="en")
    write_sgm(os.path.join(raw_dir, "test-full", "newstest2014-deen-ref.de.sgm"), tde, lang="en", kind="refset")
    return (en, de), (ten, tde)


# --------------------------------------------------------------------------------------------
# the pipeline
# --------------------------------------------------------------------------------------------

MODEL_SIZES = {
    # extra fairseq-train arguments over transformer_wmt_en_de_big_t2t (None = the real big model)
    "tiny": ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64",
             "--decoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
             "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--dropout", "0.1"],
    "base": ["--encoder-embed-dim", "512", "--decoder-embed-dim", "512", "--encoder-ffn-embed-dim", "2048",
             "--decoder-ffn-embed-dim", "2048", "--encoder-attention-heads", "8", "--decoder-attention-heads", "8",
             "--dropout", "0.1"],
    "big": [],
}

RUNS = {
    "baseline": dict(arch="transformer_wmt_en_de_big_t2t", criterion="label_smoothed_cross_entropy",
                     optimizer="adam", plugin=False),
    "ls": dict(arch="ls_transformer_wmt_en_de_big_t2t", criterion="ls_label_smoothed_cross_entropy",
               optimizer="ls_adam", plugin=True),
}


WORKDIR_NAME = "ls_fairseq_quickstart"
#: printed (and shown in train.log by the plugin) when the runs are on the CPU
CPU_NOTE = ("on CPU the ls_ run takes the PyTorch reference path (the CUDA kernels' math, not "
            "their speed), so expect about the baseline's speed: the speed-ups need a CUDA GPU")


def source_checkout(path):
    """The root of the ls-fairseq source checkout that holds ``path`` (a folder with setup.py,
    ls_fairseq/ and csrc/), or None."""
    path = os.path.abspath(path)
    while True:
        if all(os.path.exists(os.path.join(path, p)) for p in ("setup.py", "ls_fairseq", "csrc")):
            return path
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def default_workdir(cwd=None):
    """./ls_fairseq_quickstart, except inside a source checkout (``bash scripts/quickstart.sh``
    from the repository): then beside the checkout, so that no run writes into the source tree."""
    cwd = os.path.abspath(cwd or os.getcwd())
    root = source_checkout(cwd)
    return os.path.join(os.path.dirname(root) if root else cwd, WORKDIR_NAME)


def user_dir():
    import ls_fairseq

    return os.path.dirname(os.path.abspath(ls_fairseq.__file__))


def fairseq_cmd(tool):
    """Run a fairseq command line tool with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-c", "import sys; from fairseq_cli.{} import cli_main; sys.argv[0] = 'fairseq-{}'; "
            "cli_main()".format(tool, tool.replace("_", "-"))]


def _env():
    env = dict(os.environ)
    # fairseq 0.12 loads its checkpoints with torch.load, whose weights_only default (torch>=2.6)
    # refuses them; the ls_ plugin copes by itself, the baseline needs this
    env.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    # the ls_fairseq package must be importable by the child processes even when it is run from a
    # source checkout that is not installed
    pkg_parent = os.path.dirname(user_dir())
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class LoadWatch:
    """The machine's 1-minute load average, sampled every ``every`` seconds while a block runs
    (``mean``: None where the system has no load average)."""

    def __init__(self, every=5.0):
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = None

    def _sample(self):
        if hasattr(os, "getloadavg"):
            self.samples.append(os.getloadavg()[0])

    def _loop(self):
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self):
        self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def mean(self):
        return sum(self.samples) / len(self.samples) if self.samples else None


def cpu_speed_note(loads, cores=None):
    """(the text of the speed rows' ratio cells, the line printed above the table) for CPU runs;
    ``loads``: run name -> mean load average while it trained (None: unknown)."""
    cores = cores or os.cpu_count()

    def fmt(load):
        return "?" if load is None else "{:.1f}".format(load)

    cell = "not a speed test (CPU; load {})".format(
        ", ".join("{} {}".format(name, fmt(load)) for name, load in loads.items()))
    line = ("on CPU this is not a speed test: the runs trained one after the other, at a load "
            "average (1 min, {} cores) of {}; the ls_ run takes the PyTorch reference path, at "
            "about the baseline's speed (the speed-ups need a CUDA GPU). The speed rows below say "
            "so instead of giving ratios.").format(
                cores, ", ".join("{} during {}".format(fmt(load), name)
                                 for name, load in loads.items()))
    return cell, line


def log(msg):
    print("[quickstart] " + msg, flush=True)


def run_logged(cmd, log_path, echo=None, stdout_path=None):
    """Run cmd; stdout+stderr (or only stderr if stdout_path) go to log_path; lines matching echo
    are printed as they come. -> exit code."""
    with open(log_path, "a", encoding="utf-8") as logf:
        logf.flush()
        out = open(stdout_path, "w", encoding="utf-8") if stdout_path else None
        try:
            proc = subprocess.Popen(cmd, stdout=out or subprocess.PIPE, stderr=subprocess.STDOUT if not out
                                    else subprocess.PIPE, text=True, env=_env(), bufsize=1)
            stream = proc.stderr if out else proc.stdout
            for line in stream:
                logf.write(line)
                if echo and echo.search(line):
                    print("    " + line.rstrip()[:200], flush=True)
            return proc.wait()
        finally:
            if out:
                out.close()


def _tail(path, n=30):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def prepare_data(work, n_train, n_valid, n_test, seed):
    data = os.path.join(work, "data")
    stamp = os.path.join(data, "params.json")
    params = dict(n_train=n_train, n_valid=n_valid, n_test=n_test, seed=seed, version=1)
    if os.path.isfile(stamp) and os.path.isdir(os.path.join(data, "data-bin")):
        with open(stamp) as f:
            if json.load(f) == params:
                log("data: reusing " + data)
                return data
    shutil.rmtree(data, ignore_errors=True)
    os.makedirs(os.path.join(data, "tok"))
    log("data: generating {} / {} / {} sentence pairs (train / valid / test)".format(n_train, n_valid, n_test))
    splits = {"train": synthetic_corpus(n_train, seed), "valid": synthetic_corpus(n_valid, seed + 1),
              "test": synthetic_corpus(n_test, seed + 2)}
    for split, (en, de) in splits.items():
        for lang, side in (("en", en), ("de", de)):
            with open(os.path.join(data, "tok", "{}.{}".format(split, lang)), "w", encoding="utf-8") as f:
                f.write("".join(tokenize(s) + "\n" for s in side))
    with open(os.path.join(data, "test.raw.de"), "w", encoding="utf-8") as f:
        f.write("".join(s + "\n" for s in splits["test"][1]))
    tok = os.path.join(data, "tok")
    cmd = fairseq_cmd("preprocess") + [
        "--source-lang", "en", "--target-lang", "de", "--trainpref", os.path.join(tok, "train"),
        "--validpref", os.path.join(tok, "valid"), "--testpref", os.path.join(tok, "test"),
        "--destdir", os.path.join(data, "data-bin"), "--joined-dictionary", "--workers", "2"]
    rc = run_logged(cmd, os.path.join(data, "preprocess.log"))
    if rc != 0:
        raise SystemExit("fairseq-preprocess failed:\n" + _tail(os.path.join(data, "preprocess.log")))
    with open(stamp, "w") as f:
        json.dump(params, f)
    return data


def train_command(name, data_bin, save_dir, args, device):
    spec = RUNS[name]
    warmup = max(10, min(4000, args.max_update // 5))
    lr = args.lr if args.lr else (1e-3 if args.size == "tiny" else 5e-4)
    cmd = fairseq_cmd("train") + [data_bin]
    if spec["plugin"]:
        cmd += ["--user-dir", user_dir()]
    cmd += [
        # recipes/wmt14_en_de/train.sh, scaled down (warm-up, learning rate, batch)
        "--arch", spec["arch"], "--share-all-embeddings",
        "--optimizer", spec["optimizer"], "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-08", "--clip-norm", "0.0",
        "--lr", str(lr), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(warmup),
        "--warmup-init-lr", "1e-07", "--dropout", "0.3", "--weight-decay", "0.0",
        "--criterion", spec["criterion"], "--label-smoothing", "0.1",
        "--max-tokens", str(args.max_tokens), "--max-update", str(args.max_update),
        "--stop-time-hours", "{:.6f}".format(args.minutes / 60.0),
        # one checkpoint, at the end (fairseq saves when it stops), weights only: it is for decoding
        "--seed", str(args.seed), "--save-dir", save_dir, "--no-epoch-checkpoints", "--save-interval", "1000000",
        "--no-save-optimizer-state",
        "--log-format", "simple", "--log-interval", str(args.log_interval),
        "--num-workers", "1",
    ]
    cmd += ["--fp16"] if device == "cuda" else ["--cpu"]
    cmd += MODEL_SIZES[args.size]
    return cmd


def evaluate(name, data, save_dir, device):
    """fairseq-generate + detokenised sacreBLEU -> (score or None, message)."""
    import sacrebleu

    eval_dir = os.path.join(save_dir, "eval")
    os.makedirs(eval_dir, exist_ok=True)
    gen_out = os.path.join(eval_dir, "generate-test.txt")
    ckpt = os.path.join(save_dir, "checkpoint_last.pt")
    cmd = fairseq_cmd("generate") + [os.path.join(data, "data-bin"), "--path", ckpt, "--gen-subset", "test",
                                     "--beam", "4", "--lenpen", "0.6", "--batch-size", "128",
                                     "--required-batch-size-multiple", "1", "--max-len-a", "1.5",
                                     "--max-len-b", "10"]
    if RUNS[name]["plugin"]:
        cmd += ["--user-dir", user_dir()]
    cmd += ["--fp16"] if device == "cuda" else ["--cpu"]
    rc = run_logged(cmd, os.path.join(eval_dir, "generate.log"), stdout_path=gen_out)
    if rc != 0:
        return None, "fairseq-generate failed:\n" + _tail(os.path.join(eval_dir, "generate.log"))
    hyps = {}
    with open(gen_out, encoding="utf-8") as f:
        for line in f:
            if line.startswith("H-"):
                idx, _score, text = line.rstrip("\n").split("\t", 2)
                hyps[int(idx[2:])] = text
    with open(os.path.join(data, "test.raw.de"), encoding="utf-8") as f:
        refs = [line.rstrip("\n") for line in f]
    if len(hyps) != len(refs):
        return None, "fairseq-generate wrote {} hypotheses for {} test sentences".format(len(hyps), len(refs))
    detok = [detokenize(hyps[i]) for i in range(len(refs))]
    with open(os.path.join(eval_dir, "hyp.detok.de"), "w", encoding="utf-8") as f:
        f.write("".join(h + "\n" for h in detok))
    bleu = sacrebleu.metrics.BLEU()
    score = bleu.corpus_score(detok, [refs])
    result = {"name": "BLEU", "score": round(score.score, 2), "signature": str(bleu.get_signature()),
              "verbose_score": str(score).split(" = ", 1)[-1]}
    with open(os.path.join(eval_dir, "sacrebleu.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return result["score"], "sacreBLEU {:.2f}".format(result["score"])


def parse_args(argv):
    p = argparse.ArgumentParser(prog="ls-fairseq-quickstart", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", help="where everything goes (default: ./{}, or beside the source "
                   "checkout when run inside one)".format(WORKDIR_NAME))
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: the first GPU if there is one, else CPU")
    p.add_argument("--size", choices=sorted(MODEL_SIZES), help="model size (default: big on GPU, tiny on CPU)")
    p.add_argument("--runs", default="baseline,ls", help="comma-separated, from: baseline, ls (default: %(default)s)")
    p.add_argument("--train-sentences", type=int, help="default: 200000 on GPU, 20000 on CPU")
    p.add_argument("--valid-sentences", type=int, default=500)
    p.add_argument("--test-sentences", type=int, default=500)
    p.add_argument("--max-update", type=int, help="updates per model (default: 1500 on GPU, 600 on CPU)")
    p.add_argument("--minutes", type=float, default=5.0,
                   help="wall-clock cap per model (fairseq --stop-time-hours), default %(default)s")
    p.add_argument("--max-tokens", type=int, help="default: 8192 on GPU, 2048 on CPU")
    p.add_argument("--lr", type=float, help="default: 5e-4 (1e-3 for the tiny model)")
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fresh", action="store_true",
                   help="regenerate the corpus even if --workdir has one with the same settings")
    args = p.parse_args(argv)
    args.run_names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in args.run_names if n not in RUNS]
    if unknown or not args.run_names:
        p.error("--runs {!r}: choose from {} (comma-separated)".format(args.runs, ", ".join(RUNS)))
    if args.workdir and os.path.exists(args.workdir) and not os.path.isdir(args.workdir):
        p.error("--workdir {} is a file: give a folder".format(args.workdir))
    return args


def main(argv=None):
    args = parse_args(argv)
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("ls-fairseq-quickstart: error: --device cuda: torch sees no GPU; use --device cpu "
              "or auto", file=sys.stderr)
        return 2
    gpu = device == "cuda"
    args.size = args.size or ("big" if gpu else "tiny")
    args.train_sentences = args.train_sentences or (200000 if gpu else 20000)
    args.max_update = args.max_update or (1500 if gpu else 600)
    args.max_tokens = args.max_tokens or (8192 if gpu else 2048)
    names = args.run_names
    work = os.path.abspath(args.workdir or default_workdir())
    try:
        os.makedirs(work, exist_ok=True)
    except OSError as exc:
        print("ls-fairseq-quickstart: error: cannot create --workdir {}: {}".format(
            work, exc.strerror or exc), file=sys.stderr)
        return 2
    where = torch.cuda.get_device_name(0) if gpu else "CPU"
    log("device: {} | model: {} | {} updates or {:g} min per model | workdir {}".format(
        where, args.size, args.max_update, args.minutes, work))
    if "ls" in names:
        log("plugin: " + user_dir())  # the installed package, unless run from a source tree
        if not gpu:
            log(CPU_NOTE)

    if args.fresh:
        shutil.rmtree(os.path.join(work, "data"), ignore_errors=True)
    data = prepare_data(work, args.train_sentences, args.valid_sentences, args.test_sentences, args.seed)
    failures, run_dirs, loads = [], [], {}
    echo = re.compile(r"\| (train_inner|valid|train) \||Stopping training|done training|Error|error:|ls_fairseq: ")
    for name in names:
        save_dir = os.path.join(work, "runs", name)
        shutil.rmtree(save_dir, ignore_errors=True)  # a quickstart always trains from scratch
        os.makedirs(save_dir)
        cmd = train_command(name, os.path.join(data, "data-bin"), save_dir, args, device)
        with open(os.path.join(save_dir, "command.txt"), "w") as f:
            f.write(" ".join(cmd) + "\n")
        log("train {}: {}".format(name, RUNS[name]["arch"]))
        t0 = time.time()
        with LoadWatch() as load:
            rc = run_logged(cmd, os.path.join(save_dir, "train.log"), echo=echo)
        loads[name] = load.mean
        if rc != 0:
            failures.append("{}: fairseq-train exited with {}; end of {}:\n{}".format(
                name, rc, os.path.join(save_dir, "train.log"), _tail(os.path.join(save_dir, "train.log"))))
            log("train {} FAILED (exit {}), see {}".format(name, rc, os.path.join(save_dir, "train.log")))
            continue
        log("train {}: done in {:.0f} s".format(name, time.time() - t0))
        if RUNS[name]["plugin"] and device == "cuda":
            with open(os.path.join(save_dir, "train.log"), encoding="utf-8", errors="replace") as f:
                if "CUDA kernels unavailable" in f.read():
                    log("WARNING: the {} run fell back to the PyTorch reference ops (see 'ls_fairseq: CUDA "
                        "kernels unavailable' in its train.log): its speed is not the kernels'".format(name))
        score, msg = evaluate(name, data, save_dir, device)
        log("eval {}: {}".format(name, msg))
        if score is None:
            failures.append("{}: {}".format(name, msg))
        run_dirs.append((name, save_dir))

    if run_dirs:
        from . import compare

        print()
        extra = {}
        if not gpu:  # a CPU's speeds under whatever load it had: not compared
            note, line = cpu_speed_note({n: loads.get(n) for n, _ in run_dirs})
            extra = dict(omit=("tflops_", "mfu_"), speed_note=note)
            log(line)
            print()
        runs, report, plots = compare.compare([d for _, d in run_dirs], labels=[n for n, _ in run_dirs],
                                              out_dir=os.path.join(work, "compare"), **extra)
        print(report)
        print()
        print("## Plots")
        print()
        for p in plots:
            print("- " + p)
        if not plots:
            print("- none written (is matplotlib installed?)")
    if failures:
        print("\nFAILED:\n" + "\n".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
