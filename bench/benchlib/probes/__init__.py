"""Probes: measurements taken inside fairseq's own processes, switched on by environment
variables (``install_from_env``; ``env.train_env`` sets them, ``site/sitecustomize.py`` calls
this in every process of the run):

* ``BENCH_CUDNN_SDPA=0``: cuDNN's attention backend off (the ``baseline_nocudnn`` variant);
* ``BENCH_MEMORY=1``: the memory sampler (``memory``): peak reserved and device memory used per
  process, one ``BENCH_MEMORY`` line each at exit;
* ``BENCH_STAMPS=1``: the host clock at each reset of fairseq's interval and epoch meters
  (``stamps``): ``BENCH_INTERVAL_END`` / ``BENCH_EPOCH_END`` lines;
* ``BENCH_PROFILE_AT=U`` (with ``BENCH_PROFILE_STEPS``, ``BENCH_PROFILE_OUT``,
  ``BENCH_PROFILE_TIMELINE``): a profiler window from update U (``profile_summary``).

The other modules here run as programs (``env.probe_cmd``): ``generate_probe`` (fairseq-generate
recording the decoding dtype and peak memory), ``gemm_rate`` (the GPU's fp16 matmul rate),
``adam_shadow`` (fairseq-train with every ls_adam step checked against fairseq's Adam),
``build_extension`` and ``gpu_names`` (in a subprocess: the benchmark's process holds no CUDA
context).
"""
import os


def rank():
    """This process's rank in fairseq's distributed run (0 outside one)."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def emit(line):
    """One write per line: ranks writing to one stream do not split each other's lines."""
    import sys

    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


def install_from_env():
    if os.environ.get("BENCH_CUDNN_SDPA") == "0":
        import torch

        torch.backends.cuda.enable_cudnn_sdp(False)
    if os.environ.get("BENCH_MEMORY") == "1":
        from benchlib.probes import memory

        memory.install()
    if os.environ.get("BENCH_STAMPS") == "1":
        from benchlib.probes import stamps

        stamps.install()
    if os.environ.get("BENCH_PROFILE_AT"):
        from benchlib.probes import profile_summary

        profile_summary.install_from_env()
