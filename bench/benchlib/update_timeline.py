"""Where each profiled update's time goes after the backward, rank by rank, from the GPU timelines
the profiler probe (``probes/profile_summary.py``) writes (``BENCH_PROFILE_TIMELINE=1``;
``bench/multi_gpu.py --profile --profile-timelines`` sets it up for every rank).

For each update (from one ``bench_update_<k>`` range's first GPU activity to the next one's), on
the stream that runs the update's kernels (the ranges' stream):

* **wait after backward**: the longest pause of that stream in the second half of the update
  before the optimizer kernel. On several GPUs this is where the stream waits for the gradient
  all-reduce's last buckets (and, through their barriers, for the slowest rank);
* **backward end**: where that pause starts (ms from the update's start);
* **clip and norm**: from the end of the pause to the optimizer kernel (grad norm, clip factor,
  the grad-norm exchange);
* **optimizer**: the optimizer kernel (``--optimizer-kernel``, a regex; ls_adam's by default);
* **boundary idle**: from the optimizer kernel's end to the next update's first compute kernel
  (not a copy), the time the stream has nothing to run: the GPU waiting for the host to queue
  the next update (its batch, its forward);
* **copies / NCCL elsewhere**: the copy-engine all-reduce's copies and NCCL kernels on other
  streams (union of their spans).

    PYTHONPATH=bench python -m benchlib.update_timeline /tmp/prof/profile_*_4gpu_*.timeline.json.gz

A profiler slows the host: boundary idle here is an upper bound on the unprofiled run's.
"""
import argparse
import gzip
import json
import os
import re
import statistics

from benchlib.probes.profile_summary import NCCL, UPDATE, _ANNOTATION, _is_copy, _union_length

FIELDS = ("period_ms", "backward_end_ms", "wait_after_backward_ms", "clip_and_norm_ms",
          "optimizer_ms", "boundary_idle_ms", "side_copies_ms", "side_nccl_ms")
NAME = re.compile(r"profile_(?P<variant>.+)_(?P<gpus>\d+)gpu_(?P<rank>\d+)\.json\.timeline\.json"
                  r"\.gz$")


def load(path):
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    cols = data["columns"]
    return [dict(zip(cols, row)) for row in data["rows"]]


def _is_kernel(row):
    return not row["name"].startswith(UPDATE) and not _ANNOTATION.match(row["name"])


def updates(rows, optimizer_kernel="adam"):
    """One dict per update that has a next update's mark and an optimizer kernel (FIELDS)."""
    marks = sorted((r for r in rows if r["name"].startswith(UPDATE)), key=lambda r: r["start_us"])
    if len(marks) < 2:
        return []
    main = marks[0]["stream"]
    kernels = sorted((r for r in rows if _is_kernel(r)), key=lambda r: r["start_us"])
    on_main = [r for r in kernels if r["stream"] == main]
    opt = re.compile(optimizer_kernel)
    out = []
    for k in range(len(marks) - 1):
        t0, t1 = marks[k]["start_us"], marks[k + 1]["start_us"]
        mine = [r for r in on_main if t0 <= r["start_us"] < t1]
        step = next((r for r in mine if opt.search(r["name"])), None)
        if step is None:
            continue
        t_opt = step["start_us"]
        # the longest pause of the stream between its kernels, second half before the optimizer
        wait, bwd_end, end = 0.0, None, None
        for r in (r for r in mine if r["start_us"] < t_opt):
            if end is not None and r["start_us"] >= t0 + (t_opt - t0) / 2:
                gap = r["start_us"] - end
                if gap > wait:
                    wait, bwd_end = gap, end
            end = r["start_us"] + r["dur_us"] if end is None else max(end, r["start_us"]
                                                                      + r["dur_us"])
        if bwd_end is None:
            bwd_end = t_opt
        opt_end = t_opt + step["dur_us"]
        nxt = next((r for r in on_main if r["start_us"] >= t1 and not _is_copy(r["name"])),
                   None)
        boundary_end = nxt["start_us"] if nxt is not None else t1
        busy = _union_length([(max(r["start_us"], opt_end), min(r["start_us"] + r["dur_us"],
                                                                  boundary_end))
                              for r in on_main if r["start_us"] < boundary_end
                              and r["start_us"] + r["dur_us"] > opt_end])
        side = [r for r in kernels if r["stream"] != main and t0 <= r["start_us"] < t1]
        out.append({
            "update": k,
            "period_ms": (t1 - t0) / 1e3,
            "backward_end_ms": (bwd_end - t0) / 1e3,
            "wait_after_backward_ms": wait / 1e3,
            "clip_and_norm_ms": (t_opt - (bwd_end + wait)) / 1e3,
            "optimizer_ms": step["dur_us"] / 1e3,
            "boundary_idle_ms": max(boundary_end - opt_end - busy, 0.0) / 1e3,
            "side_copies_ms": _union_length([(r["start_us"], r["start_us"] + r["dur_us"])
                                             for r in side if _is_copy(r["name"])]) / 1e3,
            "side_nccl_ms": _union_length([(r["start_us"], r["start_us"] + r["dur_us"])
                                           for r in side if NCCL.search(r["name"])]) / 1e3,
        })
    return out


def medians(rows):
    return {f: statistics.median(r[f] for r in rows) for f in FIELDS} if rows else {}


def summarize(paths, optimizer_kernel="adam"):
    """Per file its updates and medians; per variant (all its ranks' updates) the medians."""
    files, by_variant = {}, {}
    for path in paths:
        rows = updates(load(path), optimizer_kernel)
        name = os.path.basename(path)
        m = NAME.search(name)
        variant = f"{m['variant']}, {m['gpus']} GPUs" if m else name
        files[name] = {"variant": variant, "rank": int(m["rank"]) if m else None,
                       "updates": rows, "median": medians(rows)}
        by_variant.setdefault(variant, []).extend(rows)
    return {"files": files, "variants": {v: {"updates": len(rows), "median": medians(rows)}
                                         for v, rows in by_variant.items()}}


def markdown(summary):
    head = ("| timeline | updates | " + " | ".join(f.replace("_ms", "") for f in FIELDS)
            + " |\n|---|---:|" + "---:|" * len(FIELDS))
    lines = [head]
    rows = [(v, s["updates"], s["median"]) for v, s in summary["variants"].items()]
    rows += [(f"{s['variant']}, rank {s['rank']}" if s["rank"] is not None else name,
              len(s["updates"]), s["median"]) for name, s in summary["files"].items()]
    for label, n, med in rows:
        cells = " | ".join(f"{med[f]:.2f}" if med else "" for f in FIELDS)
        lines.append(f"| {label} | {n} | {cells} |")
    return "Medians over updates, ms:\n\n" + "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("timelines", nargs="+", help="*.timeline.json.gz files (one per rank)")
    ap.add_argument("--optimizer-kernel", default="adam",
                    help="regex naming the optimizer's kernel (ls_adam's: adam)")
    ap.add_argument("--json", help="write every update's figures here")
    args = ap.parse_args(argv)
    try:
        re.compile(args.optimizer_kernel)
    except re.error as e:
        ap.error(f"--optimizer-kernel: not a regex ({e})")
    summary = summarize(args.timelines, args.optimizer_kernel)
    print(markdown(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
