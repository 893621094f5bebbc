"""Helpers shared by the tests (tests/), the benchmarks (bench/) and the diagnostics (scripts/),
importable wherever the package is:

* ``fairseq_helpers``: fairseq and ls_ models and criteria built from fairseq's own option
  parser, random batches, error measures, FP16Optimizer runs, multi-process workers (needs
  fairseq);
* ``kernel_oracle``: the GPU tests' oracles: the Philox4x32-10 dropout mask the kernels draw,
  attention under a given keep mask, closeness checks against float64 truths (torch only).

Not part of the plugin: importing ``ls_fairseq`` does not import this package.
"""
