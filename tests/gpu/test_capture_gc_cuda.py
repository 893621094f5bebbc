"""A cycle holding a ``torch.cuda.MemPool`` that the cyclic collector frees during a CUDA graph
capture aborts the process (torch 2.11: ``captures_underway.empty() INTERNAL ASSERT FAILED`` in
``MemPool::~MemPool``). ``ls_fairseq.cuda_capture.collector_paused`` holds the collector off for
the length of our captures; ``tests/test_cuda_capture.py`` checks that both capture sites use it.

Each case runs in its own process (an abort cannot be caught in-process): a pool with a freed
block becomes garbage in a reference cycle, a capture starts, and the captured function allocates
enough Python objects that the collector would run. Unguarded (``capture_begin`` as it is), the
process must abort: that is the hazard, and the reason for the guard (if a torch release stops
aborting, this case fails and says so). Through the decoder's capture site (``generator._capture``,
guarded), the capture succeeds, the cycle is still alive at its end (so the guard, not luck, kept
the collector off), the replay computes the right values, and the pool goes at the next
collection.
"""
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent("""
    import gc, sys, weakref
    import torch
    from ls_fairseq.generation.generator import _capture

    class Holder:
        pass

    def pool_in_a_cycle():
        h = Holder()
        h.me, h.pool = h, torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(h.pool):
            block = torch.empty(1 << 20, device="cuda")
        del block  # the pool now has a cached block its destructor empties
        return weakref.ref(h)

    x = torch.arange(4096, device="cuda", dtype=torch.float32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph, seen = torch.cuda.CUDAGraph(), {}

    def fn():
        seen["y"] = x * 2
        kept = [Holder() for _ in range(5000)]  # past the threshold: the collector would run
        seen["alive"] = ref() is not None

    gc.set_threshold(100, 10, 10)
    gc.collect()
    gc.disable()  # the cycle becomes garbage just before the capture
    ref = pool_in_a_cycle()
    gc.enable()
    with torch.cuda.stream(stream):
        if sys.argv[1] == "guarded":
            error = _capture(graph, None, fn)
            assert error is None, error
        else:
            graph.capture_begin(capture_error_mode="thread_local")
            fn()
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    assert seen["alive"], "the cycle was collected before the capture ended"
    gc.collect()
    assert ref() is None, "the cycle outlived a collection after the capture"
    seen["y"].zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(seen["y"], x * 2)
    print("capture, collection after it and replay: ok")
""")


def _run(mode):
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                          timeout=180)


def test_unguarded_capture_aborts_when_the_collector_frees_a_pool(extension):
    proc = _run("unguarded")
    assert proc.returncode != 0, "torch no longer aborts here: collector_paused may be unneeded"
    assert "captures_underway" in proc.stderr, proc.stderr[-3000:]


def test_guarded_capture_site_survives(extension):
    proc = _run("guarded")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ok" in proc.stdout
