"""The C++ autograd of LayerNorm (layer_norm_fwd and layer_norm_residual), the fused sublayer
boundary (bias+dropout+residual+LayerNorm), bias+dropout+residual and bias+activation+dropout
(csrc/*_autograd.cpp), checked on the CPU: see tests/autograd_cpp_check.py, which runs in its own
process (it defines the ops' schemas itself, which must not meet the real extension's). On the GPU the same autograd runs over the real kernels
in tests/gpu/test_layer_norm_cuda.py, test_bias_dropout_residual_layer_norm_cuda.py,
test_bias_dropout_residual_cuda.py and test_bias_act_dropout_cuda.py (opcheck included)."""
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="no C++ compiler")
def test_cpp_autograd_matches_pytorch(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(HERE, "autograd_cpp_check.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "all C++ autograd checks passed" in proc.stdout
