#!/usr/bin/env bash
# Acceptance of the kernels built at install, on one GPU machine, in one call (about 6-8 min on
# an H200; every step's result is appended to $OUT/summary.txt as it comes):
#   source .gpu/setup.sh && bash scripts/check_prebuilt_wheel.sh
#
# 1. wheel: LS_FAIRSEQ_BUILD_KERNELS=1 pip wheel . (no deps, no index, no build isolation), for
#    TORCH_CUDA_ARCH_LIST if set, else the local GPU's; timed.
# 2. the wheel installed into a fresh folder; from there on nvcc is off PATH, CUDA_HOME points
#    nowhere (so any just-in-time build fails), TORCH_EXTENSIONS_DIR is a new empty folder,
#    LS_FAIRSEQ_KERNELS=require, and the checkout is off sys.path (python -P, scratch folders):
#    a. python -m ls_fairseq.kernels --load: the prebuilt module, every csrc/ op registered;
#    b. the GPU tests of the model and the optimizer ($CHECK_TESTS), from a copy of tests/;
#    c. fairseq-train with the README's command (a small learnable corpus, $CHECK_UPDATES
#       updates): the log has the "prebuilt at install loaded" line and no just-in-time line;
#       the time from process start to the first logged update;
#    d. the extensions folder is still empty (nothing was built).
# 3. the same fairseq-train from the checkout (pure Python: built just in time, nvcc on PATH, an
#    empty extensions folder, as on a fresh machine); the time to the first logged update.
# Exit status 0 when every check passed. CHECK_SKIP_TESTS=1 / CHECK_SKIP_JIT=1 leave out 2b / 3;
# CHECK_WHEEL=path.whl checks that wheel instead of building one.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
W=$(mktemp -d /tmp/ls_prebuilt.XXXXXX)
CHECK_TESTS=${CHECK_TESTS:-"tests/gpu/test_model_cuda.py tests/gpu/test_adam_cuda.py"}
CHECK_UPDATES=${CHECK_UPDATES:-5}
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
BASE_PYTHONPATH=$(python3 -c 'import fairseq, os; print(os.path.dirname(os.path.dirname(fairseq.__file__)))' 2>/dev/null)
FAILED=0
t_start=$(date +%s)

say() { echo "$*" | tee -a "$OUT/summary.txt"; }
check() {  # check NAME CONDITION-EXIT-STATUS DETAIL
  if [ "$2" = 0 ]; then say "PASS $1: $3"; else say "FAIL $1: $3"; FAILED=1; fi
}
now() { date +%s.%N; }
secs() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$2"; }
without_nvcc() {  # PATH without the folders that hold an nvcc
  local out="" d
  IFS=: read -ra parts <<< "$PATH"
  for d in "${parts[@]}"; do [ -x "$d/nvcc" ] || out="${out:+$out:}$d"; done
  echo "$out"
}

: > "$OUT/summary.txt"
say "check_prebuilt_wheel: $(python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0), "capability %d.%d" % torch.cuda.get_device_capability(0))' 2>&1 | tail -1)"
say "nvcc: $(command -v nvcc || echo none) ($(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo '?')); fairseq from ${BASE_PYTHONPATH:-?}; TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-unset, for the local GPU}"

# ---- 1. the wheel (CHECK_WHEEL=path: one built before)
t0=$(now)
if [ -n "${CHECK_WHEEL:-}" ]; then
  mkdir -p "$W/dist" && cp "$CHECK_WHEEL" "$W/dist/" && rc=0
else
  LS_FAIRSEQ_BUILD_KERNELS=1 python3 -m pip wheel --no-deps --no-index --no-build-isolation \
    -w "$W/dist" "$REPO" > "$OUT/wheel_build.log" 2>&1
  rc=$?
fi
t1=$(now)
WHEEL=$(ls "$W"/dist/ls_fairseq-*.whl 2>/dev/null | head -1)
check wheel $(( rc != 0 || ${#WHEEL} == 0 )) "$(basename "${WHEEL:-none}") ($(du -h "${WHEEL:-/dev/null}" | cut -f1)) built in $(secs "$t0" "$t1") s (log: wheel_build.log)"
if [ -z "$WHEEL" ]; then tail -20 "$OUT/wheel_build.log"; exit 1; fi
python3 - "$WHEEL" "$OUT/_C_build.json" <<'PY' | tee -a "$OUT/summary.txt"
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for i in z.infolist():
    if i.filename.startswith("ls_fairseq/_C"):
        print(f"  {i.filename} ({i.file_size / 2**20:.1f} MiB)")
open(sys.argv[2], "wb").write(z.read("ls_fairseq/_C_build.json"))
PY

# ---- 2. installed, without nvcc
SITE=$W/site
python3 -m pip install -q --no-deps --no-index --target "$SITE" "$WHEEL" > "$OUT/wheel_install.log" 2>&1
check install $? "into $SITE"
mkdir -p "$W/run" "$W/tex_prebuilt"
node_without_nvcc() {  # in a subshell: the environment of a GPU node without nvcc
  export PATH="$(without_nvcc)" CUDA_HOME=/nonexistent/cuda TORCH_EXTENSIONS_DIR="$W/tex_prebuilt" \
         LS_FAIRSEQ_KERNELS=require PYTHONPATH="$SITE${BASE_PYTHONPATH:+:$BASE_PYTHONPATH}"
  unset CUDA_PATH
  cd "$W/run"
}
where=$(node_without_nvcc; python3 -P -c 'import ls_fairseq, shutil; print(ls_fairseq.__file__, shutil.which("nvcc"))' 2>/dev/null | tail -1)
check isolation $([[ "$where" == "$SITE/ls_fairseq/__init__.py None" ]]; echo $?) "ls_fairseq and nvcc seen: $where"

# 2a. the report, loading the kernels
(node_without_nvcc; python3 -P -m ls_fairseq.kernels --load > "$OUT/kernels_prebuilt.txt" 2>&1)
rc=$?
loaded=$(grep "^loaded" "$OUT/kernels_prebuilt.txt")
check kernels $(( rc != 0 )) "${loaded:-$(tail -2 "$OUT/kernels_prebuilt.txt")}"
grep -E "^(prebuilt|  built|  GPU code|this process)" "$OUT/kernels_prebuilt.txt" | tee -a "$OUT/summary.txt"
[[ "$loaded" == "loaded (prebuilt"* ]] && ! grep -q "missing" <<< "$loaded"
check kernels_prebuilt $? "every op from the prebuilt module"

# 2b. the GPU tests of the model and the optimizer, from a copy of the tests (the checkout is
# not importable from there)
if [ "${CHECK_SKIP_TESTS:-0}" != 1 ]; then
  mkdir -p "$W/t" && cp -r "$REPO/tests" "$REPO/bench" "$REPO/pytest.ini" "$W/t/"
  t0=$(now)
  (node_without_nvcc; cd "$W/t" && python3 -P -m pytest $CHECK_TESTS -q -p no:cacheprovider -x) \
    > "$OUT/gpu_tests_prebuilt.log" 2>&1
  rc=$?
  check gpu_tests $rc "$(tail -1 "$OUT/gpu_tests_prebuilt.log") ($CHECK_TESTS; $(secs "$t0" "$(now)") s)"
  [ $rc = 0 ] || tail -30 "$OUT/gpu_tests_prebuilt.log"
fi

# 2c. fairseq-train, README's command, on a small corpus
PYTHONPATH="$REPO" python3 -m ls_fairseq.testing.learnable_corpus "$W/raw" --train 20000 --valid 200 --test 200 > /dev/null \
  && (cd "$W/run" && PYTHONPATH="$BASE_PYTHONPATH" python3 -P -m fairseq_cli.preprocess \
        --source-lang en --target-lang de --trainpref "$W/raw/train" --validpref "$W/raw/valid" \
        --destdir "$W/bin" --joined-dictionary --workers 8 > "$OUT/preprocess.log" 2>&1)
check corpus $? "20000 pairs in $W/bin"

train() {  # train LOG USER_DIR: fairseq-train, README's command; prints seconds to the first update
  local log=$1 user_dir=$2 t0
  t0=$(now)
  (cd "$W/run" && python3 -P -m fairseq_cli.train "$W/bin" --user-dir "$user_dir" \
      --arch ls_transformer_wmt_en_de_big_t2t --share-all-embeddings \
      --criterion ls_label_smoothed_cross_entropy --label-smoothing 0.1 \
      --optimizer ls_adam --adam-betas '(0.9, 0.98)' --lr 7e-4 --lr-scheduler inverse_sqrt \
      --warmup-updates 4000 --dropout 0.3 --max-tokens 8192 --fp16 \
      --max-update "$CHECK_UPDATES" --log-interval 1 --log-format simple --no-save \
      --disable-validation --seed 1) 2>&1 \
    | T0=$t0 python3 -c '
import os, re, sys, time
t0, first = float(os.environ["T0"]), None
for line in sys.stdin:
    sys.stdout.write(line)
    if first is None and re.search(r"\| train_inner \|", line):
        first = time.time() - t0
sys.stderr.write(f"{first:.1f}\n" if first is not None else "none\n")
' > "$log" 2> "$log.first"
  cat "$log.first"
}

t_first=$(node_without_nvcc; train "$OUT/train_prebuilt.log" "$SITE/ls_fairseq")
grep -q "CUDA kernels prebuilt at install loaded" "$OUT/train_prebuilt.log"; has_prebuilt=$?
grep -q "just-in-time build" "$OUT/train_prebuilt.log"; has_jit=$?
[[ "$t_first" =~ ^[0-9] ]]; timed=$?
check train_prebuilt $(( has_prebuilt != 0 || has_jit == 0 || timed != 0 )) "first update after ${t_first:-?} s from process start; prebuilt line: $([ $has_prebuilt = 0 ] && echo yes || echo NO); just-in-time line: $([ $has_jit = 0 ] && echo YES || echo no)"
grep -m1 "prebuilt at install\|just-in-time" "$OUT/train_prebuilt.log" | cut -c1-300 | tee -a "$OUT/summary.txt"
[[ "$t_first" =~ ^[0-9] ]] || tail -30 "$OUT/train_prebuilt.log"

# 2d. nothing was built
n=$(find "$W/tex_prebuilt" -mindepth 1 | wc -l)
check nothing_built $(( n != 0 )) "$n entries in the extensions folder after 2a-2c"

# ---- 3. the same command, built just in time on a fresh machine
if [ "${CHECK_SKIP_JIT:-0}" != 1 ]; then
  mkdir -p "$W/tex_jit"
  t_jit=$(export TORCH_EXTENSIONS_DIR="$W/tex_jit" LS_FAIRSEQ_KERNELS=require \
                 PYTHONPATH="$REPO${BASE_PYTHONPATH:+:$BASE_PYTHONPATH}"
          train "$OUT/train_jit.log" "$REPO/ls_fairseq")
  grep -q "using the just-in-time build" "$OUT/train_jit.log"; has_jit=$?
  [[ "$t_jit" =~ ^[0-9] ]]; timed=$?
  check train_jit $(( has_jit != 0 || timed != 0 )) "first update after ${t_jit:-?} s from process start (built just in time, empty cache)"
  [[ "$t_jit" =~ ^[0-9] ]] || tail -30 "$OUT/train_jit.log"
  say "time to the first update, README command, 1 GPU: prebuilt ${t_first:-?} s, just in time ${t_jit:-?} s"
fi

say "$([ $FAILED = 0 ] && echo ALL PASSED || echo SOME FAILED) in $(( $(date +%s) - t_start )) s; work folder $W"
exit $FAILED
