"""The benchmarks' probes in every process of a fairseq run (bench/benchlib/env.py: train_env).

Python imports ``sitecustomize`` at start-up from PYTHONPATH, so the probes run in fairseq-train
and in each process it spawns for --distributed-world-size N (a wrapper script would run in the
parent only). This folder holds nothing else: whatever else it held would shadow modules of the
same name in the child. ``benchlib`` is loaded from its own folder by file location (bench/ itself
is not put on the child's path, so the scripts there shadow nothing either).
"""
import importlib.util
import os
import sys

if any(k.startswith("BENCH_") for k in os.environ):
    _here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/benchlib
    if "benchlib" not in sys.modules:
        _spec = importlib.util.spec_from_file_location(
            "benchlib", os.path.join(_here, "__init__.py"), submodule_search_locations=[_here])
        sys.modules["benchlib"] = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(sys.modules["benchlib"])
    from benchlib import probes

    probes.install_from_env()
