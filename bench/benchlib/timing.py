"""GPU time of a callable by CUDA events, shared by the micro-benchmarks."""
import torch


def cuda_event_ms(fn, iters: int, warmup: int = 3) -> float:
    """Mean GPU milliseconds per call of ``fn`` over ``iters`` calls queued back to back, after
    ``warmup`` calls (first-call setup, allocator growth) and a synchronisation."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
