#!/usr/bin/env python3
"""A real English→German parallel corpus built from the machine's own gettext catalogs.

Debian packages install their German translations as compiled gettext catalogs
(``/usr/share/locale/de/LC_MESSAGES/*.mo``): tens of thousands of real message/translation pairs
(program messages, menu entries, descriptions). Python's ``gettext`` reads them, so the quality
benchmark gets real text with no download. Real text is what the synthetic corpus cannot give:
rare words, varied lengths, and models that can learn to loop.

The ``iso_*`` catalogs (iso-codes: names of languages, countries, regions and currencies) are
left out: they are name lists, mostly copied or transliterated, not sentences. Pairs are
lower-cased and split into words and punctuation (word level, for a joined
dictionary). Multi-line messages are split into line pairs where both sides have the same
number of lines. A pair is kept when both sides have 1..``MAX_TOKENS`` tokens and neither is more
than three times as long as the other (plus three): that drops messages whose translation is a
different text (help screens, format tables). Duplicated sources keep their first translation in
catalog order. The split is by a hash of the source side, so it does not depend on the order of
the files: ``TEST`` pairs for test, ``VALID`` for validation, the rest for training.

    python bench/benchlib/real_corpus.py OUT_DIR   # writes {train,valid,test}.{en,de} + corpus.json

Stdlib only (it runs as a program from its own folder).
"""
import argparse
import gettext
import glob
import hashlib
import json
import os
import re

CATALOG_GLOB = "/usr/share/locale/de/LC_MESSAGES/*.mo"
MAX_TOKENS = 60
TEST = VALID = 1000
MIN_TRAIN = 10000  # fewer training pairs than this: the machine lacks the catalogs
_TOKEN = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def tokenize(text: str):
    """Lower-cased words and punctuation marks; menu accelerators (``&``, ``_``) dropped."""
    return _TOKEN.findall(text.replace("&", "").replace("_", " ").lower())


def catalog_pairs(path: str):
    """(msgid, msgstr) of one compiled catalog, singular forms only; [] if unreadable."""
    try:
        with open(path, "rb") as f:
            catalog = gettext.GNUTranslations(f)._catalog
    except (OSError, UnicodeDecodeError, ValueError):
        return []
    pairs = []
    for key, value in catalog.items():
        if isinstance(key, tuple):  # plural forms: (msgid, n); keep the singular
            if key[1] != 0:
                continue
            key = key[0]
        key = key.split("\x04", 1)[-1]  # drop a msgctxt
        if isinstance(value, str) and key.strip() and value.strip():
            pairs.append((key, value))
    return pairs


def is_name_list(path: str) -> bool:
    """The iso-codes catalogs: names, not sentences (module docstring)."""
    return os.path.basename(path).startswith("iso")


def sentence_pairs(files):
    """{source: target} of tokenised, filtered pairs, in catalog order (module docstring)."""
    out = {}
    for path in files:
        if is_name_list(path):
            continue
        for src, tgt in catalog_pairs(path):
            lines = zip(src.split("\n"), tgt.split("\n")) if src.count("\n") == tgt.count("\n") \
                else [(src, tgt)]
            for s, t in lines:
                s, t = tokenize(s), tokenize(t)
                if not (0 < len(s) <= MAX_TOKENS and 0 < len(t) <= MAX_TOKENS):
                    continue
                if len(s) > 3 * len(t) + 3 or len(t) > 3 * len(s) + 3:
                    continue
                out.setdefault(" ".join(s), " ".join(t))
    return out


def split(pairs):
    """(train, valid, test) lists of (src, tgt), by the hash of the source side."""
    ranked = sorted(pairs.items(), key=lambda p: hashlib.sha1(p[0].encode()).hexdigest())
    return ranked[TEST + VALID:], ranked[TEST:TEST + VALID], ranked[:TEST]


def write_corpus(out_dir: str, pattern: str = CATALOG_GLOB, src="en", tgt="de") -> dict:
    """Writes ``out_dir/{train,valid,test}.{src,tgt}`` and ``corpus.json`` (counts, the catalogs
    read, a digest of the text); returns that description. Raises if too few pairs are found."""
    files = sorted(f for f in glob.glob(pattern) if not is_name_list(f))
    pairs = sentence_pairs(files)
    if len(pairs) < TEST + VALID + MIN_TRAIN:
        raise RuntimeError(f"real_corpus: {len(pairs)} sentence pairs from {len(files)} catalogs "
                           f"matching {pattern}; at least {TEST + VALID + MIN_TRAIN} are needed "
                           f"(install German translations, e.g. Debian's *-l10n or locales)")
    os.makedirs(out_dir, exist_ok=True)
    digest = hashlib.sha256()
    info = dict(source="gettext catalogs", pattern=pattern, catalogs=len(files), pairs={})
    for name, part in zip(("train", "valid", "test"), split(pairs)):
        for side, k in ((src, 0), (tgt, 1)):
            text = "".join(p[k] + "\n" for p in part)
            digest.update(text.encode())
            with open(os.path.join(out_dir, f"{name}.{side}"), "w") as f:
                f.write(text)
        info["pairs"][name] = len(part)
        info[f"{name}_tokens"] = sum(len(p[1].split()) for p in part)
    info["sha256"] = digest.hexdigest()
    with open(os.path.join(out_dir, "corpus.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--catalogs", default=CATALOG_GLOB, help="glob of compiled .mo catalogs")
    a = p.parse_args(argv)
    print(json.dumps(write_corpus(a.out_dir, a.catalogs), indent=1))


if __name__ == "__main__":
    main()
