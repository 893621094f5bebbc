"""The memory sampler: what a process holds on its GPU beyond what fairseq logs.

fairseq's own figure is the peak *allocated* memory (``torch.cuda.max_memory_allocated``): it
resets the peak counter at every log interval and logs ``gb_free`` = total - peak since the last
reset, so a run's peak allocated is total - min(gb_free) (``logs.peak_allocated_gb``). What the
process holds is more: the allocator's cache, the CUDA graphs' private pool, the graphs
themselves, the CUDA context. This samples, where fairseq resets its peak counter (once per
update), every 10th time:

* peak reserved: ``torch.cuda.memory_reserved()`` (the allocator's whole footprint);
* peak device memory used: total - free from ``cudaMemGetInfo`` (also the context, the graphs,
  NCCL's buffers: what another process could not use);

and prints ``BENCH_MEMORY rank=R total=T reserved_max=X used_max=Y`` (bytes) at exit. A process
that never sampled (the parent of spawned ranks, a CPU run) prints nothing. No CUDA call happens
before fairseq's first reset.
"""
import atexit

from benchlib import probes

EVERY = 10


def install():
    import torch

    held = {"calls": 0, "rank": 0, "total": 0, "reserved": 0, "used": 0}
    reset = torch.cuda.reset_peak_memory_stats

    def reset_and_sample(*a, **k):
        held["calls"] += 1
        if held["calls"] % EVERY == 1:
            free, total = torch.cuda.mem_get_info()
            held["total"] = total
            held["reserved"] = max(held["reserved"], torch.cuda.memory_reserved())
            held["used"] = max(held["used"], total - free)
            held["rank"] = probes.rank()
        return reset(*a, **k)

    torch.cuda.reset_peak_memory_stats = reset_and_sample

    def report():
        if held["calls"]:
            probes.emit(f"BENCH_MEMORY rank={held['rank']} total={held['total']} "
                        f"reserved_max={held['reserved']} used_max={held['used']}")

    atexit.register(report)
