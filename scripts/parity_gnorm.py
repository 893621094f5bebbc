"""Which ls_ component moves the logged grad norm of tests/gpu/test_training_parity_cuda.py's
recipe, and by how much fairseq moves against itself (GPU; fairseq installed):

    python scripts/parity_gnorm.py --json tests/data/parity_gnorm_h200.json

Five fairseq-train runs side by side on one GPU, the test's own ``prepare``/``train``: fairseq's
criterion + ``adam`` twice, the ls_ criterion alone, ``ls_adam`` alone, both. Prints, per arm and
per ten updates, the largest relative grad-norm difference from fairseq's first run, and the loss
difference; writes every logged update of the runs (fairseq's second only if it differs). The
rows are what ``ls_fairseq/testing/lockstep.py``'s tolerances were set from
(``tests/test_lockstep.py`` replays them).
"""
import argparse
import datetime
import json
import pathlib
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "gpu"), str(ROOT / "tests"), str(ROOT / "bench")]

import torch  # noqa: E402
import test_training_parity_cuda as parity  # noqa: E402
from ls_fairseq.testing.lockstep import gnorm_difference  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the runs' logged updates here")
    args = ap.parse_args()
    ls_crit = parity.LS_CRITERION
    runs = {
        "fairseq": parity.RUNS["fairseq"],
        "fairseq_again": parity.RUNS["fairseq"],
        "crit_only": ("transformer", ls_crit, "adam", "0.3", ["--ls-no-cuda-graphs"]),
        "adam_only": ("transformer", "label_smoothed_cross_entropy", "ls_adam", "0.3",
                      ["--ls-no-fused-fp16-copy"]),
        "ls_parts": parity.RUNS["ls_parts"],
    }
    work = pathlib.Path(tempfile.mkdtemp())
    parity.prepare(work)
    with ThreadPoolExecutor(len(runs)) as pool:
        logs = dict(pool.map(lambda n: parity.train(work, n, runs[n]), runs))
    ref = logs["fairseq"][0]
    kept = {}
    for name, log in logs.items():
        rows = log[0]
        gn = [abs(gnorm_difference(ref[u], rows[u])) for u in range(1, parity.UPDATES + 1)]
        dl = [abs(float(rows[u]["loss"]) - float(ref[u]["loss"]))
              for u in range(1, parity.UPDATES + 1)]
        print(f"{name:14s} grad norm, largest difference per 10 updates: "
              + " ".join(f"{max(gn[i:i + 10]) * 100:.2f}%" for i in range(0, len(gn), 10))
              + f" | loss: largest difference {max(dl):.3f} | valid {log[1]}")
        if name == "fairseq_again" and max(gn) == 0 and max(dl) == 0:
            continue  # bitwise fairseq's: the note says so
        kept[name] = {u: {k: rows[u][k] for k in ("loss", "gnorm", "loss_scale")}
                      for u in sorted(rows)}
    if args.json:
        again = "differed (kept)" if "fairseq_again" in kept else "was bitwise equal (not kept)"
        doc = {"what": "tests/gpu/test_training_parity_cuda.py's recipe (fairseq transformer, "
                       f"{parity.UPDATES} updates, --fp16, dropout 0.3, seed 1, warmup "
                       f"{parity.WARMUP}): every logged update of fairseq's criterion + adam, the "
                       "ls_ criterion alone, ls_adam alone, both (ls_parts); fairseq's second run "
                       + again,
               "script": "scripts/parity_gnorm.py", "device": torch.cuda.get_device_name(0),
               "torch": torch.__version__, "date": datetime.date.today().isoformat(),
               "warmup_updates": parity.WARMUP, "runs": kept}
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=0) + "\n")


if __name__ == "__main__":
    main()
