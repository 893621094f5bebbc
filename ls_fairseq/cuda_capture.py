"""What every CUDA graph capture of the package runs inside (the training step's graphs,
``graphs/replay.py``, and the decoder's, ``generation/generator.py``).

Python's cyclic garbage collector is held off for the length of a capture. A cycle it frees may
hold a ``torch.cuda.MemPool`` (the memory of another, dropped graph engine). The pool's destructor
empties its cache, which torch forbids while any capture is underway: ``captures_underway.empty()
INTERNAL ASSERT FAILED`` in ``synchronize_and_free_events``, and the process aborts. Captures run
model code that allocates Python objects, so the collector can start inside one at any time.
``torch.cuda.graph()`` runs ``gc.collect()`` before its capture but leaves the collector on; we do
not use it (it also empties the allocator's cache at every capture). What the collector would have
freed during the capture is freed at its next run, after the capture.
"""
import contextlib
import gc


@contextlib.contextmanager
def collector_paused():
    """Automatic cyclic garbage collection off inside the block, as it was after (also on error).
    Reference counting still frees what it frees; only cycles wait."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
