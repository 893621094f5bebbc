"""Where a benchmark runs: paths, commit, GPUs, torch; how it starts fairseq's tools with probes.

A run's header (``results.header``) names the device, the commit, the torch version and the
command. The device copy of the tree has no .git, so the caller names the commit in
``LS_BENCH_COMMIT``; without it the commit comes from git and says so.

fairseq-train is started as ``python -m fairseq_cli.train`` with ``site/`` on its PYTHONPATH
(``train_env``): the ``sitecustomize`` there installs the probes that the ``BENCH_*`` variables
ask for, in the trainer's process and in every process fairseq spawns (one per GPU).
"""
import importlib.metadata
import os
import re
import subprocess
import sys

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH_DIR)
USER_DIR = os.path.join(ROOT, "ls_fairseq")
SITE_DIR = os.path.join(BENCH_DIR, "benchlib", "site")
PROBES_DIR = os.path.join(BENCH_DIR, "benchlib", "probes")


def commit():
    """LS_BENCH_COMMIT, else git's short HEAD with a note (the device's tree may be stale)."""
    if os.environ.get("LS_BENCH_COMMIT"):
        return os.environ["LS_BENCH_COMMIT"]
    try:
        git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        git = ""
    return (git or "unknown") + (" (from git, not LS_BENCH_COMMIT: on the device the tree's git "
                                 "state may be stale)")


def torch_version():
    """The installed torch's version, without importing it."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def visible_gpus(n):
    """The first n GPUs of this process's CUDA_VISIBLE_DEVICES (0..n-1 when it is unset): the
    ones a run of n GPUs takes, so two benchmarks can run side by side on one host."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is None:
        return [str(i) for i in range(n)]
    return [d.strip() for d in given.split(",") if d.strip()][:n]


def gpu_names():
    """The GPUs' names from nvidia-smi, else from torch in a subprocess (this process holds no
    CUDA context while the runs measure memory), else ["cpu"]."""
    for cmd in (["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                probe_cmd("gpu_names")):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        names = [line.strip() for line in out.splitlines() if line.strip()]
        if names:
            return names
    return ["cpu"]


def with_path(env, *dirs):
    """``env`` with ``dirs`` in front of its PYTHONPATH."""
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(list(dirs) + ([env["PYTHONPATH"]] if env.get(
        "PYTHONPATH") else []))
    return env


def train_env(base=None, **probes):
    """The environment of a fairseq-train run with probes: ``site/`` on PYTHONPATH and the
    ``BENCH_*`` switches given (``probes.install_from_env`` lists them)."""
    env = with_path(os.environ if base is None else base, SITE_DIR)
    env.update({k: str(v) for k, v in probes.items()}, PYTHONUNBUFFERED="1")
    return env


def fairseq_cmd(tool, *args):
    """``python -m fairseq_cli.<tool> args...``."""
    return [sys.executable, "-m", f"fairseq_cli.{tool}", *map(str, args)]


def probe_cmd(name, *args):
    """``python bench/benchlib/probes/<name>.py args...``: a probe that runs as a program."""
    return [sys.executable, os.path.join(PROBES_DIR, f"{name}.py"), *map(str, args)]


def gemm_tflops():
    """Measured fp16 TFLOP/s of an 8192^3 matmul on this GPU, or None (no GPU, error). In a
    subprocess: the benchmark's own process must not hold a CUDA context while fairseq-train
    measures the largest batch that fits."""
    proc = subprocess.run(probe_cmd("gemm_rate"), capture_output=True, text=True)
    found = re.findall(r"BENCH_GEMM_TFLOPS ([0-9.]+)", proc.stdout)
    return float(found[-1]) if found else None


def build_extension():
    """The ls_ CUDA extension built before any timed run (a JIT build inside the first ls_ run
    would count in its time, and runs started together would build it side by side), in a
    subprocess: this process holds no CUDA context. Prints one line; returns whether it built."""
    import time

    t0 = time.time()
    # this checkout's ls_fairseq, the one the runs load with --user-dir
    out = subprocess.run(probe_cmd("build_extension"), capture_output=True, text=True,
                         env=with_path(os.environ, ROOT))
    line = (out.stdout.strip().splitlines() or [out.stderr.strip()[-2000:]])[-1]
    print(line, f"{time.time() - t0:.0f}s", flush=True)
    return line == "extension ok"
