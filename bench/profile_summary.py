"""Profile a window of fairseq training updates and say where the GPU time goes.

Used by bench/e2e.py (``--profile-at N``): wraps ``fairseq.trainer.Trainer.train_step`` in the
benchmark process only, runs ``torch.profiler`` over ``steps`` updates starting at update ``at``,
and prints/writes a summary: wall time per update, GPU busy time split into GEMM, attention,
other kernels and memory copies, and idle GPU time (launch gaps, host synchronisation), plus the
top kernels.
"""
import json
import re
import time

import torch

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


def summarize(prof, wall_s, steps):
    kernels = []
    for evt in prof.events():
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
        if "memcpy" in name.lower() or "memset" in name.lower():
            cats["memcpy/memset"] += d
        elif GEMM.search(name):
            cats["gemm"] += d
        elif ATTN.search(name):
            cats["attention"] += d
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
                                          key=lambda x: -x[1])[:15],
    }
    out.update(host_summary(prof, steps))
    return out


# fairseq's own record_function ranges in Trainer.train_step / task.train_step
HOST_RANGES = ("forward", "backward", "reduce-grads", "multiply-grads", "clip-grads", "optimizer")
# host time spent waiting for the GPU (synchronising calls)
WAITS = re.compile(r"cudaStreamSynchronize|cudaDeviceSynchronize|cudaMemcpy|cudaEventSynchronize|"
                   r"_local_scalar_dense")


def host_summary(prof, steps):
    """Host (CPU) time per update inside fairseq's phases, time blocked on the GPU, and the ops
    with the most self CPU time."""
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


def install(at, steps, out_path=None):
    from fairseq import trainer as trainer_mod

    original = trainer_mod.Trainer.train_step
    state = {"calls": 0, "prof": None, "t0": None}

    def train_step(self, samples, raise_oom=False):
        state["calls"] += 1
        n = state["calls"]
        if n == at:
            torch.cuda.synchronize()
            state["prof"] = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        result = original(self, samples, raise_oom)
        if n == at + steps - 1 and state["prof"] is not None:
            torch.cuda.synchronize()
            wall = time.perf_counter() - state["t0"]
            state["prof"].__exit__(None, None, None)
            summary = summarize(state["prof"], wall, steps)
            print("BENCH_PROFILE " + json.dumps(summary), flush=True)
            if out_path:
                with open(out_path, "w") as f:
                    json.dump(summary, f, indent=1)
            state["prof"] = None
        return result

    trainer_mod.Trainer.train_step = train_step
