#!/usr/bin/env bash
# evaluate.sh: BLEU of a run of train.sh (baseline or ls) on newstest2014.
#
#   1. average the last N epoch checkpoints of SAVE_DIR (checkpointEPOCH.pt; --by updates uses
#      checkpoint_EPOCH_UPDATE.pt from --save-interval-updates instead), like fairseq's
#      scripts/average_checkpoints.py (which the pip package does not ship);
#   2. fairseq-generate on the test subset: beam 4, lenpen 0.6, --remove-bpe;
#   3. detokenised sacreBLEU against the raw newstest2014 reference (the WMT-standard number);
#   4. tokenised BLEU with compound splitting (fairseq's scripts/compound_split_bleu.sh, the number
#      reported by Vaswani et al. 2017 and Ott et al. 2018).
#
# Usage:
#   evaluate.sh --data DATA_BIN --save-dir DIR [--last N] [--by epochs|updates]
#               [--checkpoint FILE] [--ref FILE | --sacrebleu-test-set wmt14/full]
#               [--gpu|--cpu] [--batch-size N] [EXTRA fairseq-generate ARGS...]
#
#   --last N          checkpoints to average (default 5; 1 = just the last one)
#   --checkpoint FILE evaluate this checkpoint, no averaging
#   --ref FILE        untokenised reference (default: DATA_BIN/../ref/newstest2014.de, which
#                     prepare.sh writes)
#   --sacrebleu-test-set SET  let sacreBLEU download the reference instead (e.g. wmt14/full)
#   --gpu / --cpu     default: GPU if nvidia-smi sees one
#
# Outputs in DIR/eval/: checkpoint_avg.pt, generate-test.txt, hyp.tok.de, hyp.detok.de,
# sacrebleu.json (sacrebleu -f json), compound_split_bleu.txt (fairseq-score), which
# ls-fairseq-compare reads. ls_ checkpoints are decoded with --user-dir automatically.
set -euo pipefail

DATA=""
SAVE_DIR=""
LAST=5
BY=epochs
CHECKPOINT=""
REF=""
TESTSET=""
DEVICE=""
BATCH_SIZE=128
EXTRA=()
PYTHON=${PYTHON:-python3}
while [ $# -gt 0 ]; do
    case "$1" in
        --data) DATA=$2; shift 2 ;;
        --save-dir) SAVE_DIR=$2; shift 2 ;;
        --last) LAST=$2; shift 2 ;;
        --by) BY=$2; shift 2 ;;
        --checkpoint) CHECKPOINT=$2; shift 2 ;;
        --ref) REF=$2; shift 2 ;;
        --sacrebleu-test-set) TESTSET=$2; shift 2 ;;
        --gpu) DEVICE=gpu; shift ;;
        --cpu) DEVICE=cpu; shift ;;
        --batch-size) BATCH_SIZE=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        --) shift; EXTRA+=("$@"); break ;;
        *) EXTRA+=("$1"); shift ;;
    esac
done
die() { echo "evaluate.sh: error: $*" >&2; exit 1; }
[ -n "$DATA" ] || die "--data DATA_BIN is required (see --help)"
[ -n "$SAVE_DIR" ] || die "--save-dir DIR is required (see --help)"
[ -d "$DATA" ] || die "$DATA is not a directory"
case "$BY" in epochs|updates) ;; *) die "--by must be epochs or updates" ;; esac
if [ -z "$DEVICE" ]; then
    if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then DEVICE=gpu; else DEVICE=cpu; fi
fi
if [ -z "$REF" ] && [ -z "$TESTSET" ]; then
    REF=$(cd "$DATA/.." && pwd)/ref/newstest2014.de
    [ -f "$REF" ] || die "no reference: $REF does not exist; pass --ref FILE or --sacrebleu-test-set wmt14/full"
fi
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
have_tool fairseq-generate fairseq_cli && have_tool sacrebleu sacrebleu && have_tool sacremoses sacremoses \
    || die "needs fairseq, sacrebleu and sacremoses (pip install fairseq-fixed sacrebleu sacremoses)"
EVAL=$SAVE_DIR/eval
mkdir -p "$EVAL"
export TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1  # fairseq checkpoints hold pickled objects (argparse, omegaconf)

# ---- 1. checkpoint averaging (prints the checkpoint to decode and its architecture) -----------
CKPT=""
read -r CKPT ARCH < <("$PYTHON" - "$SAVE_DIR" "$LAST" "$BY" "$CHECKPOINT" "$EVAL/checkpoint_avg.pt" <<'EOF'
import collections, os, re, sys
import torch

save_dir, last, by, given, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]

def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)

def arch_of(state):
    cfg = state.get("cfg")
    if cfg is not None and cfg.get("model") is not None:
        model = cfg["model"]
        name = getattr(model, "arch", None) or getattr(model, "_name", None)
        if name is None and hasattr(model, "get"):
            name = model.get("arch") or model.get("_name")
        if name:
            return name
    args = state.get("args")
    return getattr(args, "arch", "unknown")

if given:
    print(given, arch_of(load(given)))
    sys.exit(0)
pattern = re.compile(r"^checkpoint(\d+)\.pt$" if by == "epochs" else r"^checkpoint_\d+_(\d+)\.pt$")
found = sorted(
    ((int(m.group(1)), f) for f in os.listdir(save_dir) for m in [pattern.match(f)] if m), reverse=True
)
if not found:
    sys.exit("evaluate.sh: no {} checkpoints in {} (checkpoint{}.pt)".format(
        by, save_dir, "EPOCH" if by == "epochs" else "_EPOCH_UPDATE"))
chosen = [os.path.join(save_dir, f) for _, f in found[:last]]
if len(chosen) < last:
    print("evaluate.sh: only {} checkpoints to average (asked for {})".format(len(chosen), last), file=sys.stderr)
print("evaluate.sh: averaging " + ", ".join(os.path.basename(c) for c in chosen), file=sys.stderr)
total, state = collections.OrderedDict(), None
for path in chosen:
    state = load(path)
    for k, v in state["model"].items():
        v = v.float() if v.is_floating_point() else v
        total[k] = v.clone() if k not in total else total[k] + v
n = len(chosen)
avg = collections.OrderedDict(
    (k, v / n if v.is_floating_point() else torch.div(v, n, rounding_mode="floor")) for k, v in total.items()
)
state["model"] = avg  # everything else (config, dictionaries) from the last checkpoint read
torch.save(state, out)
print(out, arch_of(state))
EOF
) || true
[ -n "${CKPT:-}" ] || die "checkpoint averaging failed"
GEN_ARGS=()
case "$ARCH" in
    ls_*) GEN_ARGS+=(--user-dir "$("$PYTHON" -c 'import ls_fairseq, os; print(os.path.dirname(ls_fairseq.__file__))')") ;;
esac
if [ "$DEVICE" = gpu ]; then GEN_ARGS+=(--fp16); else GEN_ARGS+=(--cpu); fi
echo "evaluate.sh: decoding with $CKPT (arch $ARCH, $DEVICE)" >&2

# ---- 2. generate --------------------------------------------------------------------------
# --required-batch-size-multiple 1: with the default (8), fairseq 0.12's batch_by_size drops the
# last batch when its size is not a multiple of 8, i.e. silently skips the longest test sentences
py_tool fairseq-generate "$DATA" --path "$CKPT" --gen-subset test \
    --beam 4 --lenpen 0.6 --remove-bpe --batch-size "$BATCH_SIZE" --required-batch-size-multiple 1 \
    "${GEN_ARGS[@]}" ${EXTRA[@]+"${EXTRA[@]}"} > "$EVAL/generate-test.txt"
grep -q '^Generate test with beam=' "$EVAL/generate-test.txt" || die "fairseq-generate did not finish (see $EVAL/generate-test.txt)"

# ---- 3. detokenised sacreBLEU ----------------------------------------------------------------
grep '^H-' "$EVAL/generate-test.txt" | sed 's/^H-//' | sort -n -k1,1 | cut -f3 > "$EVAL/hyp.tok.de"
py_tool sacremoses -l de -q detokenize < "$EVAL/hyp.tok.de" > "$EVAL/hyp.detok.de"
if [ -n "$TESTSET" ]; then
    py_tool sacrebleu -t "$TESTSET" -l en-de -i "$EVAL/hyp.detok.de" -m bleu -w 2 -f json > "$EVAL/sacrebleu.json"
else
    n_hyp=$(wc -l < "$EVAL/hyp.detok.de")
    n_ref=$(wc -l < "$REF")
    [ "$n_hyp" -eq "$n_ref" ] || die "$n_hyp hypotheses for $n_ref reference lines ($REF)"
    py_tool sacrebleu "$REF" -i "$EVAL/hyp.detok.de" -m bleu -w 2 -f json > "$EVAL/sacrebleu.json"
fi

# ---- 4. tokenised BLEU with compound splitting (fairseq scripts/compound_split_bleu.sh) -------
split_compounds() { "$PYTHON" -c 'import re, sys
for line in sys.stdin:
    sys.stdout.write(re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", line))'; }
grep '^H-' "$EVAL/generate-test.txt" | cut -f3- | split_compounds > "$EVAL/generate-test.txt.sys"
grep '^T-' "$EVAL/generate-test.txt" | cut -f2- | split_compounds > "$EVAL/generate-test.txt.ref"
py_tool fairseq-score --sys "$EVAL/generate-test.txt.sys" --ref "$EVAL/generate-test.txt.ref" 2>/dev/null \
    > "$EVAL/compound_split_bleu.txt"

echo "== $SAVE_DIR"
echo "sacreBLEU (detok):          $("$PYTHON" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["score"], d["signature"])' "$EVAL/sacrebleu.json")"
echo "tokenised, compound split:  $(grep -o 'BLEU4 = [0-9.]*' "$EVAL/compound_split_bleu.txt")"
echo "fairseq-generate (tok):     $(grep -o 'BLEU4 = [0-9.]*' "$EVAL/generate-test.txt" | tail -1)"
