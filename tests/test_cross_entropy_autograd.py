"""The autograd of the fused label-smoothed cross-entropy (``ls_fairseq::ls_cross_entropy_rows``,
ls_fairseq/ops/_cross_entropy_cuda.py), checked on the CPU: see
tests/cross_entropy_autograd_check.py, which runs in its own process (it defines the csrc ops'
schemas itself, over CPU stand-ins of the kernels, which must not meet the real extension's). On
the GPU the same autograd runs over the real kernels in tests/gpu/test_cross_entropy_cuda.py
(opcheck included)."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_cross_entropy_autograd_over_cpu_stand_ins():
    env = dict(os.environ, LS_FAIRSEQ_KERNELS="auto")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "cross_entropy_autograd_check.py")],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "all cross-entropy autograd checks passed" in proc.stdout
