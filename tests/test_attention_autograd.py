"""The autograd of the attention ops (ls_fairseq/ops/_attention_cuda.py: torch.library
registrations on ``attention_fwd`` and ``short_attention_fwd``, and the Python ops
``short_attention_packed_fwd``, ``efficient_attention_fwd``, ``efficient_attention_packed_fwd``),
checked on the CPU over stand-in kernels: see tests/attention_autograd_check.py, which runs in its
own process (it defines the csrc ops' schemas and CPU kernels for aten's CUDA-only attention,
which must not meet the real extension). On the GPU the same autograd runs over the real kernels
in tests/gpu/test_attention_cuda.py and test_short_attention_cuda.py (opcheck included)."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_attention_autograd_matches_reference():
    proc = subprocess.run([sys.executable, os.path.join(HERE, "attention_autograd_check.py")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "all attention autograd checks passed" in proc.stdout
