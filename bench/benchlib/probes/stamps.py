"""Host-clock stamps at fairseq's interval and epoch boundaries.

fairseq reads an interval's wps before its gnorm. Without a per-update host sync
(--ls-deferred-overflow-check) the GPU work still queued then is waited for while the gnorm is
read, after the wps: that wait is in no interval's time. fairseq resets the interval meters
(``train_inner``) after the interval's whole log, waits included, and the epoch meters
(``train``) right after logging the epoch: a stamp at each reset splits the run without gaps.
Lines: ``BENCH_INTERVAL_END rank=R T`` and ``BENCH_EPOCH_END rank=R T`` (``time.perf_counter``).
fairseq.logging.metrics is patched as it is imported.
"""
import importlib.abc
import importlib.util
import sys
import time

from benchlib import probes

_KIND = {"train_inner": "BENCH_INTERVAL_END", "train": "BENCH_EPOCH_END"}


def patch(metrics):
    reset = metrics.reset_meters

    def reset_meters(name):
        if name in _KIND:
            probes.emit(f"{_KIND[name]} rank={probes.rank()} {time.perf_counter()!r}")
        return reset(name)

    metrics.reset_meters = reset_meters


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "fairseq.logging.metrics":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install():
    if "fairseq.logging.metrics" in sys.modules:
        patch(sys.modules["fairseq.logging.metrics"])
    else:
        sys.meta_path.insert(0, _PatchOnImport())
