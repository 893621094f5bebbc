"""Builds (or loads from its cache) the ls_ CUDA extension and prints one line: ``extension ok``
or ``extension FAILED: <why>``. Run by ``env.build_extension`` in a subprocess before any timed
run, so that no JIT build counts in a run's time and the benchmark's process holds no CUDA
context."""
from ls_fairseq.ops import _extension

if __name__ == "__main__":
    print("extension",
          "ok" if _extension.load() else "FAILED: " + _extension.failure_reason()[-2000:])
