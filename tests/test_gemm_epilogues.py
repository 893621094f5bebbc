"""CPU tests of the GEMM-epilogue ops' policy and reference paths (ls_fairseq/ops/gemm_epilogues.py,
linear.py, relu_dropout_linear.py). The CUDA ops themselves are tested on the GPU
(tests/gpu/test_gemm_epilogues_cuda.py)."""
import pytest
import torch
import torch.nn.functional as F

from ls_fairseq import ops
from ls_fairseq.ops import gemm_epilogues


def test_switch_parses_and_names_the_variable(monkeypatch):
    monkeypatch.delenv(gemm_epilogues.ENV_VAR, raising=False)
    assert gemm_epilogues.enabled()
    monkeypatch.setenv(gemm_epilogues.ENV_VAR, "OFF")
    assert not gemm_epilogues.enabled()
    monkeypatch.setenv(gemm_epilogues.ENV_VAR, "maybe")
    with pytest.raises(ValueError, match="LS_FAIRSEQ_GEMM_EPILOGUES='maybe' is not one of on, off"):
        gemm_epilogues.enabled()


@pytest.mark.parametrize("features,expected", [(8, 16), (128, 16), (136, 32), (1000, 128),
                                               (4096, 512)])
def test_mask_rows_are_whole_128_bit_groups(features, expected):
    assert gemm_epilogues.mask_bytes(features) == expected


def test_usable_only_for_aligned_half_precision(monkeypatch):
    monkeypatch.delenv(gemm_epilogues.ENV_VAR, raising=False)
    x = torch.randn(3, 64, dtype=torch.float16)
    w = torch.randn(32, 64, dtype=torch.float16)
    b = torch.randn(32, dtype=torch.float16)
    assert gemm_epilogues.usable(x, w, b)
    assert gemm_epilogues.usable(x.bfloat16(), w.bfloat16(), None)
    assert not gemm_epilogues.usable(x.float(), w.float(), b.float())
    assert not gemm_epilogues.usable(x, w, b.float())
    assert not gemm_epilogues.usable(x[:, :60], w[:, :60], b)  # 60 columns: not a multiple of 8
    assert not gemm_epilogues.usable(x, w[:30], b[:30])
    big = torch.randn(33, 64, dtype=torch.float16)
    assert not gemm_epilogues.usable(x, w, big.view(-1)[1:33])  # 2-byte offset: not 16-aligned
    monkeypatch.setenv(gemm_epilogues.ENV_VAR, "off")
    assert not gemm_epilogues.usable(x, w, b)


def test_cpu_paths_are_the_references():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 24, requires_grad=True)
    w = torch.randn(16, 24, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    assert torch.equal(ops.linear(x, w, b), F.linear(x, w, b))
    w2 = torch.randn(8, 24, requires_grad=True)
    b1 = torch.randn(24, requires_grad=True)
    torch.manual_seed(3)
    y = ops.relu_dropout_linear(x, b1, w2, 0.25, True)
    torch.manual_seed(3)
    ref = F.linear(F.dropout(F.relu(x + b1), 0.25, True), w2)
    assert torch.equal(y, ref)
    assert y.shape == (2, 5, 8)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, b1, w2), g)
    want = torch.autograd.grad(ref, (x, b1, w2), g)
    for a, r in zip(got, want):
        assert torch.equal(a, r)
