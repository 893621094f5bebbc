#!/usr/bin/env bash
# prepare.sh: WMT14 English->German data preparation for fairseq (the standard fairseq recipe,
# examples/translation/prepare-wmt14en2de.sh, with maintained PyPI tools instead of git clones).
#
#   1. corpora: Europarl v7 + Common Crawl + News Commentary v9 (= the 4.5M-pair WMT14 set of
#      Vaswani et al. 2017); test = newstest2014 "full" (3003 sentences).
#      --nc-v12 uses News Commentary v12 instead (fairseq's default, "wmt17_en_de").
#   2. Moses normalisation + tokenisation with aggressive hyphen splitting (`sacremoses`,
#      the Python port of the Moses perl scripts: normalize-punctuation, remove-non-printing-char,
#      tokenizer.perl -a; XML-escaped like tokenizer.perl).
#   3. valid = every 100th training pair (as fairseq does), train = the rest.
#   4. joined BPE learnt on train.en + train.de (`subword-nmt learn-bpe -s BPE_TOKENS`, default
#      40000 merges like fairseq; use --bpe-tokens 32000 for the 32k of Vaswani et al.).
#   5. clean train/valid like clean-corpus-n.perl -ratio 1.5 (1 <= length <= 250 tokens).
#   6. fairseq-preprocess --joined-dictionary  ->  OUT/data-bin
#
# The untokenised newstest2014 source/reference are kept in OUT/ref/ for detokenised sacreBLEU
# (evaluate.sh finds them there).
#
# Usage:
#   prepare.sh [--raw-dir DIR] [--out-dir DIR] [--bpe-tokens N] [--workers N] [--nc-v12]
#              [--valid-every N] [--no-download]
#
#   --raw-dir DIR  already-downloaded data: a directory holding the .tgz archives listed below,
#                  or their extracted contents (training/europarl-v7.de-en.{en,de},
#                  commoncrawl.de-en.{en,de}, training/news-commentary-v9.de-en.{en,de},
#                  test-full/newstest2014-deen-{src.en,ref.de}.sgm). Nothing is downloaded then.
#                  Without it, the archives are downloaded into OUT/orig (about 1.5 GB).
#   --out-dir DIR  output directory (default: ./wmt14_en_de, or ./wmt17_en_de with --nc-v12).
#   --no-download  fail instead of downloading anything that is missing.
#
# Needs: sacremoses, subword-nmt (pip install sacremoses subword-nmt), fairseq-preprocess.
# Time on the full data: roughly 1-2 hours on 16 cores (tokenisation and learn-bpe dominate).
set -euo pipefail

RAW_DIR=""
OUT_DIR=""
BPE_TOKENS=40000
WORKERS=$(nproc 2>/dev/null || echo 4)
NC=v9
VALID_EVERY=100
DOWNLOAD=1
PYTHON=${PYTHON:-python3}

die() { echo "prepare.sh: error: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
    case "$1" in
        --raw-dir) RAW_DIR=$2; shift 2 ;;
        --out-dir) OUT_DIR=$2; shift 2 ;;
        --bpe-tokens) BPE_TOKENS=$2; shift 2 ;;
        --workers) WORKERS=$2; shift 2 ;;
        --nc-v12) NC=v12; shift ;;
        --icml17) NC=v9; shift ;;  # fairseq's flag name for the WMT14 corpora (the default here)
        --valid-every) VALID_EVERY=$2; shift 2 ;;
        --no-download) DOWNLOAD=0; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done

# the console tools, or their modules when the scripts are not on PATH (pip --user / --target)
py_tool() {
    local name=$1; shift
    if command -v "$name" >/dev/null; then "$name" "$@"; return; fi
    case "$name" in
        fairseq-*) "$PYTHON" -m "fairseq_cli.${name#fairseq-}" "$@" ;;
        subword-nmt) "$PYTHON" -c 'import sys; from subword_nmt.subword_nmt import main; sys.argv[0] = "subword-nmt"; main()' "$@" ;;
        *) "$PYTHON" -m "$name" "$@" ;;
    esac
}
have_tool() {  # have_tool NAME PYTHON_MODULE
    command -v "$1" >/dev/null || "$PYTHON" -c "import $2" 2>/dev/null
}
have_tool sacremoses sacremoses && have_tool subword-nmt subword_nmt && have_tool fairseq-preprocess fairseq_cli \
    || die "needs sacremoses, subword-nmt and fairseq (pip install sacremoses subword-nmt fairseq-fixed)"

if [ "$NC" = v9 ]; then
    NC_URL="http://statmt.org/wmt14/training-parallel-nc-v9.tgz"
    NC_FILE="training-parallel-nc-v9.tgz"
    NC_CORPUS="training/news-commentary-v9.de-en"
    OUT_DIR=${OUT_DIR:-wmt14_en_de}
else
    NC_URL="http://data.statmt.org/wmt17/translation-task/training-parallel-nc-v12.tgz"
    NC_FILE="training-parallel-nc-v12.tgz"
    NC_CORPUS="training/news-commentary-v12.de-en"
    OUT_DIR=${OUT_DIR:-wmt17_en_de}
fi
URLS=(
    "http://statmt.org/wmt13/training-parallel-europarl-v7.tgz"
    "http://statmt.org/wmt13/training-parallel-commoncrawl.tgz"
    "$NC_URL"
    "http://statmt.org/wmt14/test-full.tgz"
)
FILES=(
    "training-parallel-europarl-v7.tgz"
    "training-parallel-commoncrawl.tgz"
    "$NC_FILE"
    "test-full.tgz"
)
CORPORA=(
    "training/europarl-v7.de-en"
    "commoncrawl.de-en"
    "$NC_CORPUS"
)
TEST_SRC="test-full/newstest2014-deen-src.en.sgm"
TEST_REF="test-full/newstest2014-deen-ref.de.sgm"
src=en
tgt=de

mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
TMP=$OUT_DIR/tmp
ORIG=$OUT_DIR/orig
mkdir -p "$TMP" "$ORIG" "$OUT_DIR/ref"

# ---------------------------------------------------------------------------------------------
# 1. locate (or fetch) the raw corpora
# ---------------------------------------------------------------------------------------------
needed_files() {
    for c in "${CORPORA[@]}"; do echo "$c.$src"; echo "$c.$tgt"; done
    echo "$TEST_SRC"; echo "$TEST_REF"
}
all_present() {  # all_present DIR
    local f
    for f in $(needed_files); do [ -f "$1/$f" ] || return 1; done
}
list_missing() {
    local f
    for f in $(needed_files); do [ -f "$1/$f" ] || echo "    $1/$f"; done
}

if [ -n "$RAW_DIR" ]; then
    [ -d "$RAW_DIR" ] || die "--raw-dir $RAW_DIR is not a directory"
    RAW_DIR=$(cd "$RAW_DIR" && pwd)
    if all_present "$RAW_DIR"; then
        SRC_DIR=$RAW_DIR
    else
        # archives in the raw dir: extract them into OUT/orig
        for f in "${FILES[@]}"; do
            if [ -f "$RAW_DIR/$f" ]; then
                echo "extracting $RAW_DIR/$f"
                tar -xzf "$RAW_DIR/$f" -C "$ORIG"
            fi
        done
        SRC_DIR=$ORIG
        all_present "$SRC_DIR" || die "--raw-dir $RAW_DIR has neither the extracted corpora nor the archives ${FILES[*]}; missing:
$(list_missing "$RAW_DIR")"
    fi
else
    SRC_DIR=$ORIG
    if ! all_present "$SRC_DIR"; then
        for i in "${!URLS[@]}"; do
            f=${FILES[$i]}
            if [ ! -f "$ORIG/$f" ]; then
                [ "$DOWNLOAD" = 1 ] || die "$ORIG/$f missing and --no-download given"
                echo "downloading ${URLS[$i]}"
                if command -v curl >/dev/null; then
                    curl -fL --retry 3 -o "$ORIG/$f.part" "${URLS[$i]}"
                else
                    wget -O "$ORIG/$f.part" "${URLS[$i]}"
                fi
                mv "$ORIG/$f.part" "$ORIG/$f"
            fi
            tar -xzf "$ORIG/$f" -C "$ORIG"
        done
        all_present "$SRC_DIR" || die "archives extracted but files are missing:
$(list_missing "$SRC_DIR")"
    fi
fi
echo "raw corpora: $SRC_DIR"

# ---------------------------------------------------------------------------------------------
# 2. normalise + tokenise (split into WORKERS chunks, one sacremoses process each)
# ---------------------------------------------------------------------------------------------
# tok_parallel LANG IN OUT [normalize]
tok_parallel() {
    local lang=$1 in=$2 out=$3 norm=${4:-}
    local steps=(tokenize -a)
    [ "$norm" = normalize ] && steps=(normalize -c tokenize -a)
    local nlines chunkdir
    nlines=$(wc -l < "$in")
    chunkdir=$(mktemp -d "$TMP/chunks.XXXXXX")
    if [ "$WORKERS" -le 1 ] || [ "$nlines" -lt "${CHUNK_MIN_LINES:-10000}" ]; then
        py_tool sacremoses -l "$lang" -j 1 -q "${steps[@]}" < "$in" > "$out"
    else
        split -d -a 4 -n "l/$WORKERS" "$in" "$chunkdir/in."
        local pids=() c
        for c in "$chunkdir"/in.*; do
            py_tool sacremoses -l "$lang" -j 1 -q "${steps[@]}" < "$c" > "$chunkdir/out.${c##*/in.}" &
            pids+=($!)
        done
        for p in "${pids[@]}"; do wait "$p" || die "tokenisation of $in failed"; done
        cat "$chunkdir"/out.* > "$out"
    fi
    rm -rf "$chunkdir"
    [ "$(wc -l < "$out")" -eq "$nlines" ] || die "tokenising $in changed the line count"
}

echo "pre-processing train data..."
for l in $src $tgt; do
    : > "$TMP/train.tags.$l"
    for c in "${CORPORA[@]}"; do
        echo "  $c.$l"
        tok_parallel "$l" "$SRC_DIR/$c.$l" "$TMP/part.$l" normalize
        cat "$TMP/part.$l" >> "$TMP/train.tags.$l"
    done
    rm -f "$TMP/part.$l"
done
[ "$(wc -l < "$TMP/train.tags.$src")" -eq "$(wc -l < "$TMP/train.tags.$tgt")" ] \
    || die "the $src and $tgt training corpora have different line counts"

echo "pre-processing test data..."
extract_sgm() {  # the same text extraction as fairseq's script (and sacreBLEU's sgm reader)
    grep '<seg id' "$1" | sed -e 's/<seg id="[0-9]*">\s*//g' | sed -e 's/\s*<\/seg>\s*//g'
}
extract_sgm "$SRC_DIR/$TEST_SRC" > "$OUT_DIR/ref/newstest2014.$src"
extract_sgm "$SRC_DIR/$TEST_REF" > "$OUT_DIR/ref/newstest2014.$tgt"
for l in $src $tgt; do
    sed -e "s/\’/\'/g" "$OUT_DIR/ref/newstest2014.$l" > "$TMP/test.raw.$l"
    tok_parallel "$l" "$TMP/test.raw.$l" "$TMP/test.$l"
done

echo "splitting train and valid (every ${VALID_EVERY}th pair -> valid)..."
for l in $src $tgt; do
    awk -v n="$VALID_EVERY" '{if (NR%n == 0) print $0; }' "$TMP/train.tags.$l" > "$TMP/valid.$l"
    awk -v n="$VALID_EVERY" '{if (NR%n != 0) print $0; }' "$TMP/train.tags.$l" > "$TMP/train.$l"
done

# ---------------------------------------------------------------------------------------------
# 3. joined BPE
# ---------------------------------------------------------------------------------------------
BPE_CODE=$OUT_DIR/code
echo "learning $BPE_TOKENS joined BPE merges..."
cat "$TMP/train.$src" "$TMP/train.$tgt" > "$TMP/train.$tgt-$src"
py_tool subword-nmt learn-bpe -s "$BPE_TOKENS" < "$TMP/train.$tgt-$src" > "$BPE_CODE"
rm -f "$TMP/train.$tgt-$src"
for l in $src $tgt; do
    for f in train valid test; do
        echo "  apply-bpe $f.$l"
        py_tool subword-nmt apply-bpe -c "$BPE_CODE" --num-workers "$WORKERS" \
            --input "$TMP/$f.$l" --output "$TMP/bpe.$f.$l"
    done
done

# ---------------------------------------------------------------------------------------------
# 4. clean (clean-corpus-n.perl -ratio 1.5 PREFIX en de OUT 1 250)
# ---------------------------------------------------------------------------------------------
clean_corpus() {  # clean_corpus IN_PREFIX OUT_PREFIX MIN MAX RATIO
    "$PYTHON" - "$@" "$src" "$tgt" <<'EOF'
import re, sys
inp, out, lo, hi, ratio, src, tgt = sys.argv[1:]
lo, hi, ratio = int(lo), int(hi), float(ratio)
kept = total = 0
with open(f"{inp}.{src}", encoding="utf-8") as fs, open(f"{inp}.{tgt}", encoding="utf-8") as ft, \
        open(f"{out}.{src}", "w", encoding="utf-8") as os_, open(f"{out}.{tgt}", "w", encoding="utf-8") as ot:
    for s, t in zip(fs, ft):
        total += 1
        s = re.sub(r"\s+", " ", s.strip())
        t = re.sub(r"\s+", " ", t.strip())
        if not s or not t:
            continue
        ns, nt = len(s.split(" ")), len(t.split(" "))
        if ns < lo or nt < lo or ns > hi or nt > hi:
            continue
        if ns / nt > ratio or nt / ns > ratio:
            continue
        os_.write(s + "\n")
        ot.write(t + "\n")
        kept += 1
print(f"  clean {inp}: kept {kept} of {total} pairs")
EOF
}
clean_corpus "$TMP/bpe.train" "$OUT_DIR/train" 1 250 1.5
clean_corpus "$TMP/bpe.valid" "$OUT_DIR/valid" 1 250 1.5
for l in $src $tgt; do
    cp "$TMP/bpe.test.$l" "$OUT_DIR/test.$l"
done

# ---------------------------------------------------------------------------------------------
# 5. binarise
# ---------------------------------------------------------------------------------------------
echo "fairseq-preprocess --joined-dictionary..."
rm -rf "$OUT_DIR/data-bin"
py_tool fairseq-preprocess --source-lang $src --target-lang $tgt \
    --trainpref "$OUT_DIR/train" --validpref "$OUT_DIR/valid" --testpref "$OUT_DIR/test" \
    --destdir "$OUT_DIR/data-bin" --joined-dictionary --workers "$WORKERS"

echo "done."
echo "  binarised data:       $OUT_DIR/data-bin"
echo "  BPE codes:            $BPE_CODE"
echo "  newstest2014 (raw):   $OUT_DIR/ref/newstest2014.{$src,$tgt}"
