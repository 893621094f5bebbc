"""docs/PERFORMANCE.md's tables and docs/results/README.md, generated from docs/results's files.

Every table of PERFORMANCE.md sits between ``<!-- table: NAME -->`` and ``<!-- /table -->``;
:func:`render` replaces each block with what ``TABLES[NAME]`` makes of the files now, headed by
the files it read (device, date, commit, command from their headers). A figure in a table can
therefore not drift from its data: tests/test_bench_base.py fails when a block differs from
what ``python bench/results.py tables --write`` would write.

Memory has one definition throughout (bench/e2e.py's fields): **peak allocated** is
``torch.cuda.max_memory_allocated`` over the run (fairseq's own figure), **peak reserved** is
``torch.cuda.memory_reserved`` at its highest (allocated plus the allocator's cache and the CUDA
graphs' pool), both GiB; "device used" (total - free) also counts the CUDA context and the
graphs themselves. Multi-GPU rows give each rank's peak reserved and device used.
"""
import json
import math
import os
import re

BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)

#: the scripts once in bench/ whose files are still in docs/results: the last commit with them
REMOVED_SCRIPTS = {
    "bench/all_reduce_overlap.py": "f1ed489",
    "bench/host_slack.py": "f1ed489",
    "bench/fp8_linear.py": "f1ed489 (now `bench/kernels.py fp8_linear`)",
}


def _load(results_dir, name):
    with open(os.path.join(results_dir, name + ".json")) as f:
        return json.load(f)


def fmt(x, spec, suffix=""):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, spec) + suffix


def _table(head, rows, align):
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def _sources(results_dir, names):
    """One line per file: its link, device, date, commit and command."""
    lines = []
    for name in names:
        d = _load(results_dir, name)
        lines.append(f"- [`{name}.json`](results/{name}.json): {d['device']}, {d['date']}, "
                     f"commit {d['commit']}; `{d['command']}`")
    return "\n".join(lines)


def _block(results_dir, names, head, rows, align):
    return _sources(results_dir, names) + "\n\n" + _table(head, rows, align)


# ---- one GPU, end to end ----------------------------------------------------------------------

NAMES = {"baseline": "fairseq, cuDNN attention", "baseline_nocudnn": "fairseq, cuDNN attention off",
         "ls": "**ls_ (default command)**", "ls_flags": "ls_, mechanisms by their flags",
         "ls_bf16": "ls_ `--bf16`", "ls_deferred": "ls_ (all mechanisms by their flags)",
         "ls_fp8": "ls_ `--ls-fp8`"}


def _bests(rows, key):
    """Per --max-tokens, the faster fairseq row's ``key``."""
    out = {}
    for r in rows:
        if r["variant"].startswith("baseline") and r.get(key):
            out[r["max_tokens"]] = max(out.get(r["max_tokens"], 0), r[key])
    return out


def _ratio(a, b):
    return a / b if a and b else None


def e2e_defaults(results_dir):
    names = ["e2e_defaults_4096", "e2e_defaults_8192_16384"]
    rows = sorted((r for n in names for r in _load(results_dir, n)["rows"]),
                  key=lambda r: (r["max_tokens"], not r["variant"].startswith("baseline"),
                                 r["variant"] != "baseline", r["variant"] != "ls"))
    best1, best2 = _bests(rows, "wps_unseen"), _bests(rows, "wps_steady")
    base = {r["max_tokens"]: r for r in rows if r["variant"] == "baseline"}
    out = []
    for r in rows:
        mt, ls = r["max_tokens"], r["variant"].startswith("ls")
        b = base.get(mt, {})
        out.append([str(mt), NAMES.get(r["variant"], r["variant"]),
                    fmt(r.get("wps_unseen"), ",.0f"), fmt(r.get("wps_steady"), ",.0f"),
                    (f"{fmt(_ratio(r.get('wps_unseen'), best1.get(mt)), '.2f')}× / "
                     f"{fmt(_ratio(r.get('wps_steady'), best2.get(mt)), '.2f')}×") if ls else "",
                    fmt(r.get("logged_mfu_steady"), ".1f", "%"),
                    fmt(r.get("peak_gb"), ".1f"), fmt(r.get("reserved_gb"), ".1f"),
                    (f"{fmt(_ratio(r.get('peak_gb'), b.get('peak_gb')), '.2f')}× / "
                     f"{fmt(_ratio(r.get('reserved_gb'), b.get('reserved_gb')), '.2f')}×")
                    if ls else ""])
    return _block(results_dir, names, [
        "max-tokens", "variant", "wps epoch 1", "wps epoch 2", "× best fairseq, epoch 1 / 2",
        "logged MFU, epoch 2", "peak allocated GiB", "peak reserved GiB",
        "ls_ / fairseq: allocated / reserved"], out,
        ["---:", "---", "---:", "---:", "---", "---:", "---:", "---:", "---"])


def e2e_learnable(results_dir):
    name = "e2e_learnable_8192"
    rows = _load(results_dir, name)["rows"]
    best1, best2 = _bests(rows, "wps_unseen"), _bests(rows, "wps_steady_intervals")
    out = []
    for r in rows:
        ls = r["variant"].startswith("ls")
        out.append([r["variant"], fmt(r.get("wps_unseen"), ",.0f") + (
            f" ({_ratio(r['wps_unseen'], best1[8192]):.2f}×)" if ls else ""),
            fmt(r.get("wps_steady_intervals"), ",.0f") + (
                f" ({_ratio(r['wps_steady_intervals'], best2[8192]):.2f}×)" if ls else ""),
            fmt(r.get("ups_steady"), ".2f"), fmt(r.get("peak_gb"), ".1f"),
            fmt(r.get("reserved_gb"), ".1f"), fmt(r.get("device_gb"), ".1f"),
            f"{fmt(r.get('loss_first'), '.2f')} → {fmt(r.get('loss_last'), '.2f')}"])
    return _block(results_dir, [name], [
        "variant", "wps epoch 1", "wps steady (timed intervals, epochs 2–11)", "updates/s",
        "peak allocated GiB", "peak reserved GiB", "device used GiB",
        "loss, first → last interval"],
        out, ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---"])


def fp8_e2e(results_dir):
    names = ["e2e_fp8_4096_h100", "e2e_fp8_8192_h100", "e2e_fp8_16384_h100"]
    rows = [r for n in names for r in _load(results_dir, n)["rows"]]
    best = _bests(rows, "wps_steady_intervals")
    ls = {r["max_tokens"]: r for r in rows if r["variant"] == "ls"}
    out = []
    for r in rows:
        mt = r["max_tokens"]
        is_ls = r["variant"].startswith("ls")
        out.append([str(mt), NAMES.get(r["variant"], r["variant"]),
                    fmt(r.get("wps_unseen"), ",.0f"), fmt(r.get("wps_steady_intervals"), ",.0f"),
                    fmt(_ratio(r.get("wps_steady_intervals"), best.get(mt)), ".2f", "×")
                    if is_ls else "",
                    fmt(_ratio(r.get("wps_steady_intervals"),
                               ls.get(mt, {}).get("wps_steady_intervals")), ".2f")
                    if r["variant"] == "ls_fp8" else "",
                    fmt(r.get("peak_gb"), ".1f")])
    return _block(results_dir, names, [
        "max-tokens", "variant", "wps epoch 1", "wps epoch 2 (timed intervals)",
        "× best fairseq", "FP8 / 16-bit", "peak allocated GiB"], out,
        ["---:", "---", "---:", "---:", "---:", "---:", "---:"])


def step_profile(results_dir):
    name = "e2e_fp8_8192_h100"
    out = []
    for p in _load(results_dir, name)["profiles"]:
        s = p["profile"]
        c = s["ms_per_step_by_category"]
        out.append([f"{p['variant']} ({s['target_tokens_per_step']:,.0f} target tokens)",
                    f"{s['wall_ms_per_step']:.1f}", f"{s['gpu_busy_ms_per_step']:.1f}",
                    f"{c['gemm']:.1f}", f"{c['attention']:.1f}", f"{c['other']:.1f}",
                    f"{c['memcpy/memset']:.2f}", f"{s['gpu_idle_ms_per_step']:.1f}",
                    f"{s['kernel_launches_per_step']:.0f}"])
    return _block(results_dir, [name], [
        "variant (per update)", "wall ms", "GPU busy", "GEMM", "attention", "other kernels",
        "memcpy/set", "GPU idle", "kernels"], out,
        ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---:"])


def fp8_linear(results_dir):
    name = "fp8_linear_h100"
    out = [[str(s["tokens"]), f"{s['linear_16bit']:.2f}", f"{s['linear_fp8']:.2f}",
            f"{s['gemms_fp8']:.2f}", f"{s['gemms_16bit']:.2f}",
            f"{s['quantize_x']:.2f} / {s['quantize_w']:.2f} / {s['quantize_grad']:.2f}",
            f"{s['transposes']:.2f}", f"{s['bias_grad']:.2f}", f"{s['rest']:.2f}"]
           for s in _load(results_dir, name)["steps"]]
    return _block(results_dir, [name], [
        "tokens", "16-bit linears", "FP8 linears", "FP8 GEMMs", "16-bit GEMMs",
        "quantize x / w / grad", "transposes", "bias grad", "rest"], out,
        ["---:"] * 5 + ["---"] + ["---:"] * 3)


# ---- several GPUs -----------------------------------------------------------------------------

def _held(row):
    mem = row.get("memory_by_rank") or []
    if not mem:
        return ""

    def span(key):
        lo, hi = (f(m[key] for m in mem) / 2 ** 30 for f in (min, max))
        return f"{lo:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}–{hi:.1f}"

    return f"{span('reserved_max_bytes')} / {span('used_max_bytes')}"


def _scaling_rows(results_dir, names, n_gpus_only=False):
    out = []
    for name in names:
        d = _load(results_dir, name)
        for r in d["rows"]:
            if r.get("step") != "scaling" or r.get("error") or (n_gpus_only and r["gpus"] == 1):
                continue
            steady = r.get("epochs_steady") or []
            epochs = "–" if not steady else (str(steady[0]) if len(steady) == 1
                                             else f"{steady[0]}–{steady[-1]}")
            out.append([f"`{name}`", d["device"].replace("NVIDIA ", "").replace(" 80GB HBM3", ""),
                        str(r["gpus"]), str(r["max_tokens"]),
                        r["variant"] + (f" (= {r['same_run_as']})" if r.get("same_run_as") else ""),
                        fmt(r.get("updates_per_epoch"), "d"), epochs,
                        fmt(r.get("wps_epoch1_wall"), ",.0f"),
                        fmt(r.get("wps_steady_wall"), ",.0f"),
                        fmt(r.get("scaling_steady"), ".2f", "×"),
                        fmt(r.get("ls_over_best_baseline_steady"), ".2f", "×"), _held(r)])
    return out


SCALING_HEAD = ["file", "GPU", "GPUs", "tokens per GPU", "variant", "updates/epoch",
                "steady epochs", "wps epoch 1", "wps steady", "scaling, steady",
                "ls_ / best fairseq, steady", "GiB per rank: peak reserved / device used"]
SCALING_ALIGN = ["---", "---", "---:", "---:", "---", "---:", "---", "---:", "---:", "---:",
                 "---:", "---"]


def multi_gpu_default(results_dir):
    names = ["multi_gpu_2xh200_fixed_batches", "multi_gpu_2xh200_8192_vs_fairseq",
             "multi_gpu_2xh200_16384_fixed_batches", "multi_gpu_4xh200_8192_vs_fairseq",
             "multi_gpu_4xh200_8192_fixed_batches", "multi_gpu_4xh200_8192_cost_matching",
             "multi_gpu_4xh200_8192_cost_matching_400k", "multi_gpu_4xh200_16384_fixed_batches"]
    return _block(results_dir, names, SCALING_HEAD,
                  _scaling_rows(results_dir, names, n_gpus_only=True), SCALING_ALIGN)


def multi_gpu_ab(results_dir):
    names = ["multi_gpu_4xh100_sharded_step", "multi_gpu_2xh100_sharded_step",
             "multi_gpu_4xh100_copy_engine_vs_nccl", "multi_gpu_2xh200_copy_engine",
             "multi_gpu_4xh200_copy_engine", "multi_gpu_2xh100_flag_barrier"]
    return _block(results_dir, names, SCALING_HEAD,
                  _scaling_rows(results_dir, names, n_gpus_only=True), SCALING_ALIGN)


def _gap_from(row, start):
    other = dict(map(tuple, row["loss_1_gpu_update_freq_n"]))
    gaps = [abs(loss - other[u]) for u, loss in row["loss_n_gpus"] if u in other and u >= start]
    return max(gaps) if gaps else None


def multi_gpu_correctness(results_dir):
    names = ["multi_gpu_2xh100_correctness", "multi_gpu_2xh200_copy_engine_correctness",
             "multi_gpu_4xh200_copy_engine_correctness",
             "multi_gpu_4xh100_sharded_step_correctness"]
    out = []
    for name in names:
        d = _load(results_dir, name)
        for r in d["rows"]:
            if r.get("step") != "correctness":
                continue
            backends = ", ".join(f"{b['ddp_backend']} {'trains' if b['trains'] else 'FAILED'}"
                                 for b in r.get("other_backends", [])) or "–"
            out.append([f"`{name}`", str(r["gpus"]), str(r["updates"]),
                        fmt(r.get("fp16_init_scale"), "g") if r.get("fp16_init_scale")
                        else "fairseq's (128)",
                        f"{fmt(r.get('largest_gap'), '.3f')} "
                        f"({fmt(r.get('largest_gap_update'), 'd')})",
                        fmt(_gap_from(r, 40), ".3f"),
                        "yes" if r.get("resumed_on_1_gpu") else "no", backends])
    return _block(results_dir, names, [
        "file", "GPUs", "updates", "initial loss scale", "largest loss gap (update)",
        "largest gap from update 40", "resumed on 1 GPU", "other DDP backends, 30 updates"],
        out, ["---", "---:", "---:", "---", "---", "---:", "---", "---"])


def shard_model(results_dir):
    names = ["shard_balance_200k_orders", "shard_balance_200k_matched"]
    rows = [r for r in _load(results_dir, names[0])["rows"]]
    rows += [r for r in _load(results_dir, names[1])["rows"]
             if r["order"] == "matched" and r.get("window") == 16]
    out = []
    for order in ("fairseq", "grouped", "per_rank", "matched"):
        cells = [order + (" (W = 16)" if order == "matched" else "")]
        for gpus in (2, 4):
            steady = [r for r in rows if r["order"] == order and r["gpus"] == gpus
                      and r["epoch"] > 1]

            def span(key, spec):
                lo, hi = min(r[key] for r in steady), max(r[key] for r in steady)
                a, b = format(lo, spec), format(hi, spec)
                return a if a == b else f"{a}–{b}"

            cells.append(f"{span('scaling', '.2f')}×, {span('straggler_share', '.1%')}, "
                         f"{sum(r['captures'] for r in steady)}")
        out.append(cells)
    return _block(results_dir, names, [
        "order", "2 GPUs: scaling, wait for the slowest rank, captures after epoch 1",
        "4 GPUs: the same"], out, ["---", "---", "---"])


def host_slack(results_dir):
    name = "multi_gpu_4xh100_host_slack"
    by_sleep = {}
    for r in _load(results_dir, name)["rows"]:
        by_sleep.setdefault(r["sleep_ms"], []).append(r)
    out = []
    for sleep, rs in sorted(by_sleep.items()):
        periods = [r["summary"]["period"] for r in rs]
        out.append([f"{sleep:g}", f"{min(periods):.1f}–{max(periods):.1f}",
                    fmt(max(r.get("wps_intervals") or 0 for r in rs), ",.0f")])
    return _block(results_dir, [name], [
        "host sleep added per update, ms", "period per update, ms (4 ranks)",
        "wps (fairseq's interval meters)"], out, ["---:", "---", "---:"])


TABLES = {"e2e-defaults": e2e_defaults, "e2e-learnable": e2e_learnable, "fp8-e2e": fp8_e2e,
          "step-profile": step_profile, "fp8-linear": fp8_linear,
          "multi-gpu-default": multi_gpu_default, "multi-gpu-ab": multi_gpu_ab,
          "multi-gpu-correctness": multi_gpu_correctness, "shard-model": shard_model,
          "host-slack": host_slack}


def table_names(doc):
    return sorted(m.group("name") for m in BLOCK.finditer(doc))


def render(doc, results_dir):
    """``doc`` with every generated block replaced by what its table makes of the files now."""
    def fill(m):
        name = m.group("name")
        if name not in TABLES:
            raise KeyError(f"<!-- table: {name} -->: no such table; one of {sorted(TABLES)}")
        return m.group(1) + TABLES[name](results_dir) + "\n" + m.group(4)

    return BLOCK.sub(fill, doc)


# ---- docs/results/README.md -------------------------------------------------------------------

INDEX_HEAD = """\
# Results

The rows behind the figures of [docs/PERFORMANCE.md](../PERFORMANCE.md),
[docs/QUALITY.md](../QUALITY.md) and [docs/DECODING.md](../DECODING.md). Every file follows one
schema (`bench/benchlib/results.py`; `python bench/results.py validate` checks them, and so does
tests/test_bench_base.py): `schema`, `script`, `what`, `device`, `commit`, `torch`, `command`,
`date`, `rows` (a list of objects), and the script's own keys. Where a header value was added
after the run, `header_source` says where it came from; `unknown` stands where nothing says.

This index is generated from the files: `python bench/results.py index --write`.
"""


def index_markdown(results_dir):
    files = sorted(f[:-5] for f in os.listdir(results_dir) if f.endswith(".json"))
    rows, removed = [], set()
    for name in files:
        d = _load(results_dir, name)
        script = d["script"]
        if script in REMOVED_SCRIPTS:
            removed.add(script)
        rows.append([f"[`{name}.json`]({name}.json)", d["what"], f"`{script}`", d["commit"],
                     d["date"], d["device"]])
    text = INDEX_HEAD + "\n" + _table(["file", "what", "script", "commit", "date", "device"],
                                      rows, ["---"] * 6) + "\n"
    if removed:
        text += ("\nScripts no longer in bench/ (they served one investigation; git keeps them): "
                 + "; ".join(f"`{s}`, last at commit {REMOVED_SCRIPTS[s]}" for s in sorted(removed))
                 + ".\n")
    return text
