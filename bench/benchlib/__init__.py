"""The benchmarks' common base: what every script in bench/ shares.

* ``env``: the paths, the call's commit, GPUs and torch version, and how a script starts
  fairseq-train / fairseq-generate with the probes below;
* ``probes``: code that runs *inside* fairseq's processes (real files, loaded through
  ``site/sitecustomize.py`` on the child's PYTHONPATH, or run as programs): the memory sampler,
  the interval and epoch clock stamps, the profiler window, the decoding probe, the GEMM rate,
  ls_adam's step shadow;
* ``logs``: fairseq-train logs read with ``ls_fairseq.cli.compare``'s parser (the one
  ``ls-fairseq-compare`` uses), plus the probes' lines;
* ``corpora``: the learnable synthetic corpus (``ls_fairseq.testing.learnable_corpus``, shared
  with the quickstart and the GPU tests) in single sentences or WMT-length lines, the Zipf-token
  corpus of older figures, the real-text corpus (``real_corpus``), and their binarisation;
* ``results``: the one results writer, its schema and validator (every file in docs/results);
* ``tables``: docs/PERFORMANCE.md's tables and docs/results/README.md, generated from the files;
* ``kernels``: the per-kernel micro-benchmarks behind ``bench/kernels.py``'s sub-commands;
* ``timing``, ``update_timeline``: CUDA-event timing; the per-update split of profiled timelines.

Invariant: importing ``benchlib`` or any of its modules but ``kernels.*`` and
``probes.profile_summary`` imports neither torch nor fairseq (``--help`` of every script stays
instant); they are imported inside the functions that need them.
"""
