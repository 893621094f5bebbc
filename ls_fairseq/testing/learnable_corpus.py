"""The learnable synthetic translation corpus: a deterministic transduction with real structure.

One generator for every place that needs a corpus a model can learn: the benchmarks (bench/:
the speed corpus of ``e2e.py``, ``generate.py`` and ``multi_gpu.py``, the smoke recipe of
``quality.py``), the GPU parity tests and the quickstart (:func:`synthetic_corpus`).

Random-token corpora can only show speed: their loss stops at the unigram entropy, so two models
that agree there may translate very differently. This corpus is a small grammar whose "English"
side is translated into a "German" side by fixed rules that a Transformer can learn, and whose
errors show in BLEU and in the hypothesis/reference length ratio:

* **lexicon**: pseudo-words from two syllable inventories, so nothing can be copied; nouns,
  adjectives, verbs and adverbs drawn with Zipf frequencies (rank^-1), so rare words are rare, as
  in real text. ``vocabulary="full"`` (the benchmarks): ~11k source and ~11k target word types;
  ``"small"`` (~60 content words a side): learnable by a tiny model on a CPU in minutes;
* **agreement**: each target noun has one of three genders; the target determiner depends on the
  source determiner *and* the noun's gender (and a preposition's case);
* **local reordering**: adjectives follow the noun in reverse order; the adverb moves before the
  object;
* **long-distance reordering**: separable verbs (a quarter of them) send a particle to the end
  of the clause; subordinate clauses are verb-final;
* **length change**: a third of the nouns are compounds (two target tokens), source auxiliaries
  have no target word, and "that" clauses gain a comma.

Invariants: every sentence pair is fully determined by its source, so a perfect model reaches
BLEU 100 and length ratio 1.0; output depends only on the seeds given (a ``Lexicon`` seed and a
generator seed), so a corpus is reproduced exactly from its arguments. The full lexicon's draws
are those of the corpus behind the figures in docs/results/ (do not reorder them).

    python -m ls_fairseq.testing.learnable_corpus OUTDIR [--train 120000] [--seed 1]

writes ``{train,valid,test}.{en,de}`` (tokenised: one sentence a line, tokens separated by spaces).
Needs numpy only.
"""
import argparse
import os

import numpy as np

SRC_SYLLABLES = ("ba be bi bo bu da de di do du fa fe fi fo ga ge gi go ka ke ki ko ku la le li "
                 "lo lu ma me mi mo mu na ne ni no nu pa pe pi po ra re ri ro ru sa se si so su "
                 "ta te ti to tu va ve vi vo za ze zi zo").split()
TGT_SYLLABLES = ("schm kr pf tz gr st br fl qu schl spr zw ein aus ung heit keit lich ig isch "
                 "er en el ach ich och uch au ei eu ie ö ü ä").split()

# closed classes: source word -> target word(s)
DETERMINERS = ("the", "a", "this", "every", "no", "my")
# target determiner by (source determiner, gender, case): case 0 nominative/accusative, 1 dative
DET_TABLE = {
    ("the", 0, 0): "der", ("the", 1, 0): "die", ("the", 2, 0): "das",
    ("the", 0, 1): "dem", ("the", 1, 1): "der", ("the", 2, 1): "dem",
    ("a", 0, 0): "ein", ("a", 1, 0): "eine", ("a", 2, 0): "ein",
    ("a", 0, 1): "einem", ("a", 1, 1): "einer", ("a", 2, 1): "einem",
    ("this", 0, 0): "dieser", ("this", 1, 0): "diese", ("this", 2, 0): "dieses",
    ("this", 0, 1): "diesem", ("this", 1, 1): "dieser", ("this", 2, 1): "diesem",
    ("every", 0, 0): "jeder", ("every", 1, 0): "jede", ("every", 2, 0): "jedes",
    ("every", 0, 1): "jedem", ("every", 1, 1): "jeder", ("every", 2, 1): "jedem",
    ("no", 0, 0): "kein", ("no", 1, 0): "keine", ("no", 2, 0): "kein",
    ("no", 0, 1): "keinem", ("no", 1, 1): "keiner", ("no", 2, 1): "keinem",
    ("my", 0, 0): "mein", ("my", 1, 0): "meine", ("my", 2, 0): "mein",
    ("my", 0, 1): "meinem", ("my", 1, 1): "meiner", ("my", 2, 1): "meinem",
}
AUXILIARIES = ("will", "does", "did", "can")  # no target word (tense/mood ignored)
PARTICLES = ("an", "auf", "aus", "ein", "mit", "nach", "vor", "weg", "zu", "ab", "bei", "her")

#: open-class sizes, prepositions and compound tails of each vocabulary
VOCABULARIES = {
    "full": dict(sizes={"noun": 6000, "adj": 2000, "verb": 2400, "adv": 600}, prepositions=40,
                 tails=300),
    "small": dict(sizes={"noun": 30, "adj": 12, "verb": 14, "adv": 5}, prepositions=6,
                  tails=8),
}
SIZES = VOCABULARIES["full"]["sizes"]
PREPOSITIONS = VOCABULARIES["full"]["prepositions"]


class Lexicon:
    """Source words of each class and their target translations, drawn once from ``seed``."""

    def __init__(self, seed=1234, vocabulary="full"):
        if vocabulary not in VOCABULARIES:
            raise ValueError(f"vocabulary {vocabulary!r}: one of {sorted(VOCABULARIES)}")
        sizes, n_prep, n_tails = (VOCABULARIES[vocabulary][k]
                                  for k in ("sizes", "prepositions", "tails"))
        rng = np.random.default_rng(seed)
        taken_src, taken_tgt = set(DETERMINERS) | set(AUXILIARIES) | {"that"}, set()
        for words in DET_TABLE.values(), PARTICLES, (",", "dass"):
            taken_tgt.update(words)

        def word(syllables, taken, lo, hi):
            for _ in range(1000):
                w = "".join(rng.choice(syllables, size=rng.integers(lo, hi + 1)))
                if w not in taken:
                    taken.add(w)
                    return w
            raise RuntimeError(f"no free word of {lo}-{hi} syllables left")

        # the order of the draws below fixes the corpus: keep it
        self.src = {c: [word(SRC_SYLLABLES, taken_src, 2, 4) for _ in range(n)]
                    for c, n in sizes.items()}
        self.src["prep"] = [word(SRC_SYLLABLES, taken_src, 1, 2) for _ in range(n_prep)]
        tails = [word(TGT_SYLLABLES, taken_tgt, 2, 3) for _ in range(n_tails)]
        self.noun = []  # (target tokens, gender)
        for _ in range(sizes["noun"]):
            head = word(TGT_SYLLABLES, taken_tgt, 2, 4)
            compound = rng.random() < 1 / 3
            self.noun.append(([head, str(rng.choice(tails))] if compound else [head],
                              int(rng.integers(0, 3))))
        self.adj = [word(TGT_SYLLABLES, taken_tgt, 2, 4) for _ in range(sizes["adj"])]
        self.adv = [word(TGT_SYLLABLES, taken_tgt, 2, 4) for _ in range(sizes["adv"])]
        self.verb = []  # (target stem, particle or None)
        for _ in range(sizes["verb"]):
            particle = str(rng.choice(PARTICLES)) if rng.random() < 0.25 else None
            self.verb.append((word(TGT_SYLLABLES, taken_tgt, 2, 4), particle))
        # prepositions: target word and the case they govern
        self.prep = [(word(TGT_SYLLABLES, taken_tgt, 2, 3), int(rng.integers(0, 2)))
                     for _ in range(n_prep)]
        self.cdf = {c: np.cumsum(_zipf(len(v))) for c, v in self.src.items()}


def _zipf(n, exponent=1.0):
    p = 1.0 / np.arange(1, n + 1) ** exponent
    return p / p.sum()


class Generator:
    """Sentence pairs from the grammar (source side) and the transduction rules (target side)."""

    def __init__(self, lexicon, rng):
        self.lex, self.rng = lexicon, rng

    def _pick(self, cls):
        cdf = self.lex.cdf[cls]
        return min(int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right")),
                   len(cdf) - 1)

    def noun_phrase(self, case):
        det = DETERMINERS[self.rng.integers(len(DETERMINERS))]
        adjs = [self._pick("adj") for _ in range(self.rng.choice(3, p=(0.55, 0.35, 0.10)))]
        n = self._pick("noun")
        tokens, gender = self.lex.noun[n]
        src = [det] + [self.lex.src["adj"][a] for a in adjs] + [self.lex.src["noun"][n]]
        tgt = [DET_TABLE[(det, gender, case)]] + tokens + [self.lex.adj[a] for a in reversed(adjs)]
        return src, tgt

    def clause(self, subordinate):
        subj_s, subj_t = self.noun_phrase(0)
        src, tgt = list(subj_s), list(subj_t)
        if self.rng.random() < 0.3:
            src.append(AUXILIARIES[self.rng.integers(len(AUXILIARIES))])
        v = self._pick("verb")
        stem, particle = self.lex.verb[v]
        src.append(self.lex.src["verb"][v])
        obj_s, obj_t = self.noun_phrase(0)
        adv = self._pick("adv") if self.rng.random() < 0.4 else None
        src += obj_s + ([self.lex.src["adv"][adv]] if adv is not None else [])
        middle = ([self.lex.adv[adv]] if adv is not None else []) + obj_t
        if self.rng.random() < 0.5:
            p = self._pick("prep")
            pp_s, pp_t = self.noun_phrase(self.lex.prep[p][1])
            src += [self.lex.src["prep"][p]] + pp_s
            middle += [self.lex.prep[p][0]] + pp_t
        if subordinate:  # verb-final: the particle joins the verb at the end
            tgt += middle + ([particle] if particle else []) + [stem]
        else:  # verb second, particle at the end of the clause
            tgt += [stem] + middle + ([particle] if particle else [])
        return src, tgt

    def sentence_tokens(self):
        src, tgt = self.clause(subordinate=False)
        if self.rng.random() < 0.3:
            sub_s, sub_t = self.clause(subordinate=True)
            src += ["that"] + sub_s
            tgt += [",", "dass"] + sub_t
        return src + ["."], tgt + ["."]

    def sentence(self):
        src, tgt = self.sentence_tokens()
        return " ".join(src), " ".join(tgt)

    def line_of_length(self, length):
        """Sentences joined, in the same order on both sides, until the source holds about
        ``length`` tokens (the last sentence is kept if it overshoots by less than half its
        length; one sentence at least): lines as long as a real corpus's from a grammar of short
        sentences, still a deterministic transduction."""
        pairs = [self.sentence_tokens()]
        n = len(pairs[0][0])
        while n < length:
            pairs.append(self.sentence_tokens())
            n += len(pairs[-1][0])
        if len(pairs) > 1 and n - length > len(pairs[-1][0]) / 2:
            pairs.pop()
        return (" ".join(w for s, _ in pairs for w in s),
                " ".join(w for _, t in pairs for w in t))


def synthetic_corpus(n, seed=1, vocabulary="full", lexicon_seed=1234):
    """``n`` sentence pairs as two lists of tokenised lines, ``(english, german)``: the corpus
    for code that writes its own files (the quickstart: ``vocabulary="small"``)."""
    gen = Generator(Lexicon(lexicon_seed, vocabulary), np.random.default_rng(seed))
    pairs = [gen.sentence() for _ in range(n)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def wmt_like_lengths(rng, n):
    """Source and target lengths in subwords (before fairseq's end-of-sentence token) shaped
    like WMT14 en-de after joined BPE: lognormal, mean ~29, tail to 250."""
    src_len = np.clip(np.round(rng.lognormal(mean=3.15, sigma=0.62, size=n)), 1, 250).astype(int)
    tgt_len = np.clip(np.round(src_len * rng.normal(1.08, 0.15, size=n)), 1, 250).astype(int)
    return src_len, tgt_len


def write_split(outdir, split, pairs):
    """Writes (source, target) line pairs to ``outdir/{split}.en`` and ``.de``; returns them."""
    pairs = list(pairs)
    for side, lang in ((0, "en"), (1, "de")):
        with open(os.path.join(outdir, f"{split}.{lang}"), "w") as f:
            f.writelines(pair[side] + "\n" for pair in pairs)
    return pairs


def write_corpus(outdir, train=120000, valid=1000, test=1000, seed=1, lexicon_seed=1234,
                 vocabulary="full"):
    """Writes ``{train,valid,test}.{en,de}`` of single sentences under ``outdir``; returns the
    number of word types seen on each side of the training data."""
    os.makedirs(outdir, exist_ok=True)
    gen = Generator(Lexicon(lexicon_seed, vocabulary), np.random.default_rng(seed))
    for split, n in (("train", train), ("valid", valid), ("test", test)):
        pairs = write_split(outdir, split, (gen.sentence() for _ in range(n)))
        if split == "train":
            types = [{w for pair in pairs for w in pair[side].split()} for side in (0, 1)]
    return len(types[0]), len(types[1])


def write_wmt_like(outdir, sentences, seed=1, valid=500):
    """Writes ``{train,valid}.{en,de}`` of lines of WMT14-like lengths (``wmt_like_lengths``,
    each line sentences joined by ``line_of_length``): the speed benchmarks' corpus. Returns the
    mean source length in tokens."""
    rng = np.random.default_rng(seed)
    os.makedirs(outdir, exist_ok=True)
    gen = Generator(Lexicon(), rng)
    lengths = []
    for split, n in (("train", sentences), ("valid", valid)):
        src_len, _ = wmt_like_lengths(rng, n)
        pairs = write_split(outdir, split, (gen.line_of_length(int(length)) for length in src_len))
        lengths += [len(s.split()) for s, _ in pairs]
    return float(np.mean(lengths))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir")
    p.add_argument("--train", type=int, default=120000)
    p.add_argument("--valid", type=int, default=1000)
    p.add_argument("--test", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--vocabulary", choices=sorted(VOCABULARIES), default="full")
    a = p.parse_args(argv)
    src_types, tgt_types = write_corpus(a.outdir, a.train, a.valid, a.test, a.seed,
                                        vocabulary=a.vocabulary)
    print(f"wrote {a.outdir}: {a.train}/{a.valid}/{a.test} pairs, {src_types} source and "
          f"{tgt_types} target word types in train")


if __name__ == "__main__":
    main()
