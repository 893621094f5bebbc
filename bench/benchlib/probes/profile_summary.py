"""Profile a window of fairseq training updates and say where the GPU time goes.

A probe (``BENCH_PROFILE_AT``: bench/e2e.py ``--profile``, bench/multi_gpu.py ``--profile``):
wraps ``fairseq.trainer.Trainer.train_step`` in each training process, runs ``torch.profiler``
over ``steps`` updates starting at update ``at``, and prints/writes a summary: wall time per
update, GPU busy time split into GEMM, attention, other kernels and memory copies, and idle GPU
time (launch gaps, host synchronisation), plus the top kernels. Then, over the next ``PY_STEPS`` updates, a Python-level profile of the whole
training loop (cProfile: which fairseq/ls_fairseq functions take the host's time between the
GPU's work) and the call sites of every host synchronisation (torch's sync debug mode).
With ``BENCH_PROFILE_TIMELINE=1`` each process also writes its window's GPU activities (start,
duration, stream, name) beside its summary, as ``<summary>.timeline.json.gz``.
torch is imported by the functions that use it: bench/multi_gpu.py reads this module's
constants and table helpers without it.
"""
import cProfile
import collections
import contextlib
import gzip
import json
import os
import pstats
import re
import time
import traceback
import warnings

PY_STEPS = 20
GEMM = re.compile(r"gemm|cutlass|xmma|cublas|sm90_|hgmma|matmul|ampere_|s1688|s16816", re.I)
_ANNOTATION = re.compile(r"^(forward|backward|optimizer|clip-grads|train_step-\d+|ProfilerStep|"
                         r"Optimizer\.|aten::|autograd::|## )")
ATTN = re.compile(r"flash|fmha|attention|sdpa|attn", re.I)


def _union_length(intervals):
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


NCCL = re.compile(r"nccl", re.I)
UPDATE = "bench_update_"  # record_function range around each profiled update


def summarize(prof, wall_s, steps):
    import torch

    kernels, marks = [], {}
    for evt in prof.events():
        # the GPU-side span of an update's range (its kernels, first start to last end)
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.name.startswith(UPDATE):
            k = int(evt.name[len(UPDATE):])
            start = evt.time_range.start
            marks[k] = min(start, marks.get(k, start))
            continue
        # GPU-side copies of record_function ranges ("forward", "optimizer", ...) are not kernels
        if evt.device_type == torch.autograd.DeviceType.CUDA and not getattr(
                evt, "is_user_annotation", False) and not _ANNOTATION.match(evt.name):
            start = evt.time_range.start
            kernels.append((start, start + evt.time_range.elapsed_us(), evt.name))
    busy_us = _union_length([(s, e) for s, e, _ in kernels])
    cats = {"gemm": 0.0, "attention": 0.0, "memcpy/memset": 0.0, "other": 0.0}
    per_name = {}
    for s, e, name in kernels:
        d = e - s
        per_name[name] = per_name.get(name, 0.0) + d
        if _is_copy(name):
            cats["memcpy/memset"] += d
        elif ATTN.search(name):  # before GEMM: "fmha_cutlass..." matches both
            cats["attention"] += d
        elif GEMM.search(name):
            cats["gemm"] += d
        else:
            cats["other"] += d
    wall_us = wall_s * 1e6
    out = {
        "steps": steps,
        "wall_ms_per_step": wall_us / steps / 1e3,
        "gpu_busy_ms_per_step": busy_us / steps / 1e3,
        "gpu_idle_ms_per_step": max(wall_us - busy_us, 0) / steps / 1e3,
        "kernel_launches_per_step": len(kernels) / steps,
        "ms_per_step_by_category": {k: v / steps / 1e3 for k, v in cats.items()},
        "top_kernels_ms_per_step": sorted(((n[:90], v / steps / 1e3) for n, v in per_name.items()),
                                          key=lambda x: -x[1])[:80],
    }
    out.update(per_update(kernels, marks, wall_us))
    out.update(idle_gaps(kernels, steps))
    out.update(host_summary(prof, steps))
    return out


def _is_copy(name):
    return "memcpy" in name.lower() or "memset" in name.lower()


def per_update(kernels, marks, wall_us):
    """Each update's GPU period (from its first kernel to the next update's first kernel) split
    into NCCL kernels (on N GPUs: the transfer, plus waiting for the slower rank; under the
    copy-engine all-reduce only its barriers, so mostly the wait), compute (the other kernels),
    copies (memcpy/memset: the copy-engine all-reduce's pushes into peer memory, concurrent with
    compute) and idle time (no kernel and no copy). Needs the GPU-side spans of the
    ``bench_update_<k>`` ranges."""
    if len(marks) < 2:
        return {}
    ks = sorted(marks)
    starts = [marks[k] for k in ks]
    first = min(s for s, _, _ in kernels)
    ends = starts[1:] + [first + wall_us]  # the window ends at its closing synchronize
    rows = []
    for s0, s1 in zip(starts, ends):
        inside = [(s, e, n) for s, e, n in kernels if s0 <= s < s1]
        nccl = _union_length([(s, e) for s, e, n in inside if NCCL.search(n)])
        copy = _union_length([(s, e) for s, e, n in inside if _is_copy(n)])
        compute = _union_length([(s, e) for s, e, n in inside
                                 if not NCCL.search(n) and not _is_copy(n)])
        busy = _union_length([(s, e) for s, e, _ in inside])
        rows.append({"ms": (s1 - s0) / 1e3, "compute_ms": compute / 1e3, "nccl_ms": nccl / 1e3,
                     "copy_ms": copy / 1e3, "idle_ms": max(s1 - s0 - busy, 0) / 1e3})
    med = lambda key: sorted(r[key] for r in rows)[len(rows) // 2]
    return {"per_update": rows,
            "median_ms_per_update": {k: med(k) for k in ("ms", "compute_ms", "nccl_ms", "copy_ms",
                                                         "idle_ms")}}


def _short_kernel(name):
    return re.sub(r"^void |<.*$|\(.*$", "", name)[:48]


def idle_gaps(kernels, steps, min_us=20.0):
    """The GPU's idle intervals of at least ``min_us`` inside the window, grouped by the kernels
    around them (last to finish before, first to start after): where the stream waits for the host
    (a synchronisation, the data loader, Python between launches)."""
    spans = sorted(kernels)
    groups, end, before = {}, None, None
    for s, e, name in spans:
        if end is not None and s - end >= min_us:
            key = f"{_short_kernel(before)} -> {_short_kernel(name)}"
            total, count, longest = groups.get(key, (0.0, 0, 0.0))
            groups[key] = (total + s - end, count + 1, max(longest, s - end))
        if end is None or e >= end:
            end, before = e, name
    top = sorted(groups.items(), key=lambda kv: -kv[1][0])[:12]
    return {"idle_gaps_ms_per_step": sum(v[0] for v in groups.values()) / steps / 1e3,
            "idle_gaps_top": [[k, round(t / steps / 1e3, 3), n, round(m / 1e3, 3)]
                              for k, (t, n, m) in top]}


# fairseq's own record_function ranges in Trainer.train_step / task.train_step
HOST_RANGES = ("forward", "backward", "reduce-grads", "multiply-grads", "clip-grads", "optimizer")
# host time spent waiting for the GPU (synchronising calls)
WAITS = re.compile(r"cudaStreamSynchronize|cudaDeviceSynchronize|cudaMemcpy|cudaEventSynchronize|"
                   r"_local_scalar_dense")


def host_summary(prof, steps):
    """Host (CPU) time per update inside fairseq's phases, time blocked on the GPU, and the ops
    with the most self CPU time."""
    import torch

    ranges = {name: 0.0 for name in HOST_RANGES}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CPU and evt.name in ranges:
            ranges[evt.name] += evt.time_range.elapsed_us()
    averages = prof.key_averages()
    waits = sum(e.self_cpu_time_total for e in averages if WAITS.search(e.key))
    top = sorted((e for e in averages if e.self_cpu_time_total > 0),
                 key=lambda e: -e.self_cpu_time_total)[:15]
    return {
        "host_ms_per_step_by_phase": {k: v / steps / 1e3 for k, v in ranges.items()},
        "host_wait_ms_per_step": waits / steps / 1e3,
        "top_host_ops_ms_per_step": [(e.key[:70], e.self_cpu_time_total / steps / 1e3,
                                      e.count / steps) for e in top],
    }


_PY_FILES = re.compile(r"fairseq|ls_fairseq|torch/utils/data|threading|queue")


def python_summary(prof, steps, syncs):
    """ms per update of the functions of fairseq / ls_fairseq / the data loader (cumulative and
    self time), and the host synchronisations per update by call site."""
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        if _PY_FILES.search(path):
            rows.append((f"{_short(path)}:{line}({func})", cumtime, tottime, ncalls))
    top_cum = sorted(rows, key=lambda r: -r[1])[:40]
    top_self = sorted(rows, key=lambda r: -r[2])[:25]
    per = lambda r: [r[0], round(r[1] / steps * 1e3, 3), round(r[2] / steps * 1e3, 3), r[3] / steps]
    return {"py_steps": steps,
            "py_top_cumulative_ms_per_step": [per(r) for r in top_cum],
            "py_top_self_ms_per_step": [per(r) for r in top_self],
            "host_syncs_per_step_by_site": [[k, v / steps] for k, v in syncs.most_common(20)]}


def _short(path):
    return re.sub(r".*/(fairseq_cli|fairseq|ls_fairseq|torch)/", r"\1/", path)


def _sync_site():
    """The innermost frames outside torch of the current stack (where a synchronising call
    came from)."""
    frames = [f for f in traceback.extract_stack()[:-3]
              if "/torch/" not in f.filename and "warnings" not in f.filename]
    return " <- ".join(f"{_short(f.filename)}:{f.lineno}({f.name})" for f in reversed(frames[-3:]))


def write_timeline(prof, path):
    """The window's GPU activities, one row each: start and duration (us, from the first),
    stream and name (kernels shortened): enough to place every rank's copies, barriers and last
    backward kernels against each other offline."""
    import torch

    rows = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        rows.append([e.start_ns() / 1e3, e.duration_ns() / 1e3, e.device_resource_id(),
                     _short_kernel(e.name())])
    t0 = min((r[0] for r in rows), default=0.0)
    for r in rows:
        r[0] = round(r[0] - t0, 2)
    rows.sort()
    with gzip.open(path, "wt") as f:
        json.dump({"columns": ["start_us", "dur_us", "stream", "name"], "rows": rows}, f)


def _rank():
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def install(at, steps, out_path=None):
    """Wrap Trainer.train_step in this process. ``out_path`` may hold ``{rank}``: each process of
    a distributed run then writes its own summary."""
    import torch

    from fairseq import trainer as trainer_mod

    original = trainer_mod.Trainer.train_step
    if getattr(original, "_bench_profiled", False):  # installed already in this process
        return
    state = {"calls": 0, "prof": None, "t0": None, "tokens": 0, "py": None,
             "syncs": collections.Counter()}
    py_at = at + steps + 2  # a few updates after the torch.profiler window

    def train_step(self, samples, raise_oom=False):
        state["calls"] += 1
        n = state["calls"]
        if n == at:
            torch.cuda.synchronize()
            state["prof"] = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        if state["prof"] is not None:
            state["tokens"] += sum(
                int(x.get("ntokens", 0)) for x in samples if isinstance(x, dict))
        # in the profiled window, the range's GPU-side span marks the update's kernels
        span = (torch.profiler.record_function(f"{UPDATE}{n - at}") if state["prof"] is not None
                else contextlib.nullcontext())
        with span:
            result = original(self, samples, raise_oom)
        if n == at + steps - 1 and state["prof"] is not None:
            torch.cuda.synchronize()
            wall = time.perf_counter() - state["t0"]
            state["prof"].__exit__(None, None, None)
            state["summary"] = summarize(state["prof"], wall, steps)
            if out_path and os.environ.get("BENCH_PROFILE_TIMELINE"):
                write_timeline(state["prof"], out_path.format(rank=_rank() or 0)
                               + ".timeline.json.gz")
            # batches differ: GPU time per token compares windows and runs
            tokens = state["tokens"] / steps
            state["summary"]["target_tokens_per_step"] = tokens
            if tokens:
                state["summary"]["gpu_busy_ms_per_1k_tokens"] = (
                    state["summary"]["gpu_busy_ms_per_step"] / tokens * 1e3)
                state["summary"]["wall_ms_per_1k_tokens"] = (
                    state["summary"]["wall_ms_per_step"] / tokens * 1e3)
            state["prof"] = None
        if n == py_at - 1:  # start after this update: the window is whole updates
            state["py"] = cProfile.Profile()
            torch.cuda.set_sync_debug_mode("warn")
            state["py"].enable()
        if n == py_at + PY_STEPS - 1 and state["py"] is not None:
            state["py"].disable()
            torch.cuda.set_sync_debug_mode("default")
            summary = dict(state.get("summary") or {})
            summary.update(python_summary(state["py"], PY_STEPS, state["syncs"]))
            state["py"] = None
            rank = _rank()
            if rank is not None:  # one process per GPU (fairseq's distributed training)
                summary["rank"] = rank
            print("BENCH_PROFILE " + json.dumps(summary), flush=True)
            if out_path:
                with open(out_path.format(rank=rank or 0), "w") as f:
                    json.dump(summary, f, indent=1)
        return result

    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if state["py"] is not None and "synchronizing" in str(message):
            state["syncs"][_sync_site()] += 1
            return
        return shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    warnings.filterwarnings("always", message=".*synchroniz.*")

    train_step._bench_profiled = True
    trainer_mod.Trainer.train_step = train_step


def install_from_env():
    """install() as BENCH_PROFILE_AT / _STEPS / _OUT ask (bench/e2e.py sets them), if set."""
    import os

    if os.environ.get("BENCH_PROFILE_AT"):
        install(int(os.environ["BENCH_PROFILE_AT"]), int(os.environ.get("BENCH_PROFILE_STEPS", "5")),
                os.environ.get("BENCH_PROFILE_OUT"))
