"""The benchmarks' corpora, as fairseq-preprocess input text, and their binarisation.

* ``learnable``: ``ls_fairseq.testing.learnable_corpus`` (the one learnable synthetic corpus,
  shared with the quickstart and the GPU tests). ``write_learnable_sentences``: one sentence a
  line (bench/quality.py's smoke recipe); ``write_learnable_wmt``: sentences joined into lines of
  WMT14-like lengths (lognormal, mean ~29 tokens, tail to 250: the speed benchmarks' corpus);
* ``zipf``: random tokens over a Zipf vocabulary in WMT-like lines: the corpus of figures before
  the learnable one (its loss stops at the unigram entropy); ``e2e.py --corpus zipf``;
* ``real``: English-German pairs from the machine's gettext catalogs (``real_corpus``), the
  quality gate's corpus.

``preprocess`` binarises a text folder once (a joined dictionary); ``binarise_split`` adds one
more split under its own name.
"""
import glob
import os
import shutil
import subprocess

from benchlib import env


def write_learnable_sentences(outdir, train, valid=1000, test=1000, seed=1):
    """``{train,valid,test}.{en,de}`` of single learnable sentences; (source, target) word
    types of the training split."""
    from ls_fairseq.testing import learnable_corpus

    return learnable_corpus.write_corpus(outdir, train=train, valid=valid, test=test, seed=seed)


def write_learnable_wmt(outdir, sentences, seed=1, test=0):
    """``{train,valid}.{en,de}`` (500 valid lines) of learnable sentences in WMT-length lines,
    and ``test`` lines more unlike the training ones (their own generator seed, ``seed + 1000``)
    when asked. Returns the mean source length of train and valid."""
    import numpy as np

    from ls_fairseq.testing import learnable_corpus as lc

    mean = lc.write_wmt_like(outdir, sentences, seed=seed)
    if test:
        rng = np.random.default_rng(seed + 1000)
        gen = lc.Generator(lc.Lexicon(), rng)
        src_len, _ = lc.wmt_like_lengths(rng, test)
        lc.write_split(outdir, "test", (gen.line_of_length(int(n)) for n in src_len))
    return mean


def write_zipf(outdir, sentences, vocab=32000, seed=1):
    """``{train,valid}.{en,de}`` (500 valid lines) of random Zipf tokens (exponent 1.05) over
    ``vocab`` types in WMT-length lines; returns the mean source length of the valid split (as
    the figures' runs printed it)."""
    import numpy as np

    from ls_fairseq.testing.learnable_corpus import wmt_like_lengths

    rng = np.random.default_rng(seed)
    os.makedirs(outdir, exist_ok=True)
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    p = 1.0 / ranks ** 1.05
    p /= p.sum()
    for split, n in (("train", sentences), ("valid", 500)):
        src_len, tgt_len = wmt_like_lengths(rng, n)
        for side, lengths in (("en", src_len), ("de", tgt_len)):
            tokens = rng.choice(vocab, size=int(lengths.sum()), p=p)
            words = np.char.add("t", tokens.astype(str))
            with open(os.path.join(outdir, f"{split}.{side}"), "w") as f:
                start = 0
                for length in lengths:
                    f.write(" ".join(words[start:start + length]) + "\n")
                    start += length
    return float(src_len.mean())


def write_real(outdir):
    """The gettext corpus (``real_corpus.write_corpus``); its description (corpus.json)."""
    from benchlib import real_corpus

    return real_corpus.write_corpus(outdir)


def preprocess(workdir, workers, src="en", tgt="de", dest=None):
    """Binarises ``workdir/{train,valid[,test]}.{src,tgt}`` into ``dest`` (default
    ``workdir/bin``; joined dictionary; test when its file exists) unless that was done already;
    returns the folder."""
    dest = dest or os.path.join(workdir, "bin")
    if os.path.exists(os.path.join(dest, f"dict.{src}.txt")):
        return dest
    test = os.path.join(workdir, "test")
    subprocess.run(
        env.fairseq_cmd("preprocess", "--source-lang", src, "--target-lang", tgt, "--trainpref",
                        os.path.join(workdir, "train"), "--validpref",
                        os.path.join(workdir, "valid"), "--destdir", dest, "--joined-dictionary",
                        "--workers", workers)
        + (["--testpref", test] if os.path.exists(f"{test}.{src}") else []),
        check=True, capture_output=True)
    return dest


def binarise_split(text_dir, data, split, src="en", tgt="de"):
    """Adds ``text_dir/split.{src,tgt}`` to the binarised folder ``data`` under the name
    ``split`` with its dictionary (fairseq-preprocess names every --testpref "test", so it writes
    to a folder of its own first)."""
    tmp = os.path.join(data, f"_{split}")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(
        env.fairseq_cmd("preprocess", "--source-lang", src, "--target-lang", tgt, "--testpref",
                        os.path.join(text_dir, split), "--destdir", tmp, "--srcdict",
                        os.path.join(data, f"dict.{src}.txt"), "--joined-dictionary",
                        "--workers", 1),
        check=True, capture_output=True)
    for path in glob.glob(os.path.join(tmp, f"test.{src}-{tgt}.*")):
        os.replace(path, os.path.join(data, split + os.path.basename(path)[len("test"):]))
    shutil.rmtree(tmp)


def read_lines(path):
    with open(path) as f:
        return f.read().splitlines()
