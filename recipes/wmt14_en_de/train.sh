#!/usr/bin/env bash
# train.sh: WMT14 En-De Transformer big, with plain fairseq (baseline) or with the ls_fairseq
# fused kernels (ls: the --user-dir plugin).
#
# The "Scaling Neural Machine Translation" recipe (Ott et al. 2018; fairseq examples/scaling_nmt)
# on the pre-norm big Transformer (transformer_wmt_en_de_big_t2t): Adam (0.9, 0.98), lr 5e-4,
# inverse_sqrt with 4000 warm-up updates from 1e-7, dropout 0.3, label smoothing 0.1, no weight
# decay, no gradient clipping, shared embeddings, fp16 on GPU.
# The two variants run the same recipe and differ only in the components' names (below).
#
# Usage:
#   train.sh baseline|ls --data DATA_BIN --save-dir DIR [--gpus N] [--max-tokens N]
#            [--update-freq N] [--max-update N] [--lr LR] [--dry-run] [EXTRA fairseq-train ARGS...]
#
#   baseline         fairseq's own transformer_wmt_en_de_big_t2t, label_smoothed_cross_entropy,
#                    adam
#   ls               ls_transformer_wmt_en_de_big_t2t, ls_label_smoothed_cross_entropy, ls_adam,
#                    --user-dir the installed ls_fairseq package
#   --gpus N         GPUs to train on (default: all visible; 0 = CPU, no fp16)
#   --max-tokens N   tokens per GPU per batch (default 3584, as in the paper's V100 runs;
#                    an 80 GB H100 takes 8192 or more)
#   --update-freq N  gradient accumulation (default: 8 / GPUs, i.e. the batch of 8 GPUs); for the
#                    paper's 128-GPU batch use 128 / GPUs with --lr 0.001
#   --max-update N   default 300000 (use a few thousand for a speed comparison)
#   --dry-run        print the fairseq-train command and exit
#   EXTRA            any other argument goes to fairseq-train and wins over the defaults above
#                    (e.g. --encoder-layers 2 for a small test model, --seed 2, --max-epoch 5)
#
# Logs: DIR/train.log (everything fairseq prints, with timestamps; appended to on a restart) and
# DIR/train.fairseq.log (fairseq's --log-file); both are read by ls-fairseq-compare DIR ...
# Re-running the same command resumes from DIR/checkpoint_last.pt.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
PYTHON=${PYTHON:-python3}

# ---- the variant: the only difference (and --user-dir for ls, below) ---------------------------
NAME=${1:-}
case "$NAME" in
    baseline)
        ARCH=transformer_wmt_en_de_big_t2t
        CRITERION=label_smoothed_cross_entropy
        OPTIMIZER=adam ;;
    ls)
        ARCH=ls_transformer_wmt_en_de_big_t2t
        CRITERION=ls_label_smoothed_cross_entropy
        OPTIMIZER=ls_adam ;;
    -h|--help) usage; exit 0 ;;
    *) echo "$0: the first argument is the variant, baseline or ls (see --help)" >&2; exit 2 ;;
esac
shift
# -------------------------------------------------------------------------------------------------

DATA=""
SAVE_DIR=""
GPUS=""
MAX_TOKENS=3584
UPDATE_FREQ=""
MAX_UPDATE=300000
LR=0.0005
DRY_RUN=0
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --data) DATA=$2; shift 2 ;;
        --save-dir) SAVE_DIR=$2; shift 2 ;;
        --gpus) GPUS=$2; shift 2 ;;
        --max-tokens) MAX_TOKENS=$2; shift 2 ;;
        --update-freq) UPDATE_FREQ=$2; shift 2 ;;
        --max-update) MAX_UPDATE=$2; shift 2 ;;
        --lr) LR=$2; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; EXTRA+=("$@"); break ;;
        *) EXTRA+=("$1"); shift ;;
    esac
done
[ -n "$DATA" ] || { echo "$0: --data DATA_BIN is required (see --help)" >&2; exit 2; }
[ -n "$SAVE_DIR" ] || { echo "$0: --save-dir DIR is required (see --help)" >&2; exit 2; }
USER_DIR_ARGS=()
if [ "$NAME" = ls ]; then
    LS_USER_DIR=$("$PYTHON" -c 'import ls_fairseq, os; print(os.path.dirname(ls_fairseq.__file__))') \
        || { echo "$0: cannot import ls_fairseq (pip install . in the ls-fairseq checkout)" >&2; exit 2; }
    USER_DIR_ARGS=(--user-dir "$LS_USER_DIR")
fi
if [ -z "$GPUS" ]; then
    GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if [ -z "$UPDATE_FREQ" ]; then
    if [ "$GPUS" -gt 0 ] && [ "$GPUS" -lt 8 ]; then UPDATE_FREQ=$((8 / GPUS)); else UPDATE_FREQ=1; fi
fi
if [ "$GPUS" -gt 0 ]; then
    DEVICE_ARGS=(--fp16 --distributed-world-size "$GPUS")
else
    DEVICE_ARGS=(--cpu)
fi

if command -v fairseq-train >/dev/null; then
    TRAIN=(fairseq-train)
else  # the console script is not on PATH (pip --user / --target install): its module
    TRAIN=("$PYTHON" -m fairseq_cli.train)
fi
CMD=("${TRAIN[@]}" "$DATA"
    ${USER_DIR_ARGS[@]+"${USER_DIR_ARGS[@]}"}
    --arch "$ARCH" --share-all-embeddings
    --optimizer "$OPTIMIZER" --adam-betas '(0.9, 0.98)' --adam-eps 1e-08 --clip-norm 0.0
    --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-07
    --dropout 0.3 --weight-decay 0.0
    --criterion "$CRITERION" --label-smoothing 0.1
    --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --max-update "$MAX_UPDATE"
    "${DEVICE_ARGS[@]}"
    --seed 1 --keep-last-epochs 10
    --save-dir "$SAVE_DIR"
    --log-format simple --log-interval 100 --log-file "$SAVE_DIR/train.fairseq.log"
    ${EXTRA[@]+"${EXTRA[@]}"})

if [ "$DRY_RUN" = 1 ]; then
    printf '%q ' "${CMD[@]}"; echo
    exit 0
fi
mkdir -p "$SAVE_DIR"  # fairseq opens --log-file before it creates the save dir
# fairseq 0.12 loads its own checkpoints (restarts) with torch.load, which defaults to
# weights_only=True from torch 2.6 on and then refuses them
export TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1
{ echo "# $(date -u '+%Y-%m-%d %H:%M:%S') $NAME"; printf '%q ' "${CMD[@]}"; echo; } >> "$SAVE_DIR/command.txt"
# fairseq logs to stdout; keep everything (with timestamps) in train.log
"${CMD[@]}" 2>&1 | tee -a "$SAVE_DIR/train.log"
