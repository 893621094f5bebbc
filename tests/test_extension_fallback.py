"""The kernel policy of ``ls_fairseq/ops/_extension.py`` (``LS_FAIRSEQ_KERNELS``), on CPU.

* ``off``: never builds, always the PyTorch path;
* ``auto``: CPU tensors take the PyTorch path silently; a failed build (no GPU, no nvcc, missing
  sources, compile error) falls back with ONE warning that says why;
* ``require``: the same situations raise, naming the reason, so a benchmark cannot silently
  measure the fallback.

The build itself is never run here: the tests fake a CUDA tensor (an object whose ``is_cuda`` is
True) or stub ``_build``, and reset the process-wide build state around each test.
"""
import types
import warnings

import pytest
import torch

from ls_fairseq import ops
from ls_fairseq.ops import _extension

FAKE_CUDA = types.SimpleNamespace(is_cuda=True)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    monkeypatch.delenv(_extension.ENV_VAR, raising=False)
    _extension._reset_for_tests()
    yield
    _extension._reset_for_tests()


def _fail_build(monkeypatch, message="nvcc exploded"):
    calls = []

    def build():
        calls.append(1)
        raise RuntimeError(message)

    monkeypatch.setattr(_extension, "_build", build)
    return calls


def test_mode_values(monkeypatch):
    assert _extension.mode() == "auto"
    for value, expected in (("off", "off"), (" REQUIRE ", "require"), ("", "auto")):
        monkeypatch.setenv(_extension.ENV_VAR, value)
        assert _extension.mode() == expected
    monkeypatch.setenv(_extension.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="LS_FAIRSEQ_KERNELS"):
        _extension.mode()


def test_off_never_builds(monkeypatch):
    calls = _fail_build(monkeypatch)
    monkeypatch.setenv(_extension.ENV_VAR, "off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _extension.use_kernels(FAKE_CUDA) is False
    assert calls == []
    assert not _extension.has_op("layer_norm_fwd")


def test_auto_cpu_tensors_are_silent(monkeypatch):
    calls = _fail_build(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _extension.use_kernels(torch.ones(2)) is False
    assert calls == []  # no build attempted for CPU inputs


def test_auto_failed_build_warns_once_with_reason(monkeypatch):
    calls = _fail_build(monkeypatch, "nvcc exploded at line 7")
    with pytest.warns(RuntimeWarning) as record:
        assert _extension.use_kernels(FAKE_CUDA) is False
        assert _extension.use_kernels(FAKE_CUDA) is False
        assert _extension.use_kernels(FAKE_CUDA, None) is False
    messages = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "nvcc exploded at line 7" in messages[0]
    assert "LS_FAIRSEQ_KERNELS=require" in messages[0]
    assert len(calls) == 1  # the build is tried once per process
    assert "nvcc exploded at line 7" in _extension.failure_reason()
    assert not _extension.has_op("layer_norm_fwd")


def test_auto_without_gpu_names_the_reason(monkeypatch):
    # The real _build: on a machine without a visible GPU its first check fails.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="no CUDA device is visible"):
        assert _extension.use_kernels(FAKE_CUDA) is False


def test_require_raises_with_reason(monkeypatch):
    _fail_build(monkeypatch, "undefined symbol foo")
    monkeypatch.setenv(_extension.ENV_VAR, "require")
    with pytest.raises(RuntimeError, match="require.*undefined symbol foo"):
        _extension.use_kernels(FAKE_CUDA)
    # still raising on the next call (the failure is remembered, not forgotten)
    with pytest.raises(RuntimeError, match="undefined symbol foo"):
        _extension.use_kernels(FAKE_CUDA)


def test_require_rejects_cpu_tensors(monkeypatch):
    monkeypatch.setenv(_extension.ENV_VAR, "require")
    with pytest.raises(RuntimeError, match="CPU tensor"):
        _extension.use_kernels(torch.ones(2))


def test_missing_sources_message(monkeypatch):
    monkeypatch.setattr(_extension, "source_files", lambda directory: [])
    with pytest.raises(FileNotFoundError, match="no CUDA sources found.*pip install"):
        _extension.csrc_dir()
    # through the real build: reported as the failure reason (GPU check passed by a stub)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME or "/usr/local/cuda")
    monkeypatch.setenv(_extension.ENV_VAR, "require")
    with pytest.raises(RuntimeError, match="no CUDA sources found"):
        _extension.use_kernels(FAKE_CUDA)


def test_sources_are_found_in_the_repository():
    directory = _extension.csrc_dir()
    names = {f.rsplit("/", 1)[-1] for f in _extension.source_files(directory)}
    assert {"embedding.cu", "layer_norm.cu", "dropout_fusions.cu"} <= names


def _op_inputs():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8)
    w, b = torch.randn(8), torch.randn(8)
    tokens = torch.tensor([[4, 5, 1], [6, 1, 1]])
    positions = torch.tensor([[2, 3, 1], [2, 1, 1]])
    E, P = torch.randn(10, 8), torch.randn(6, 8)
    return x, w, b, tokens, positions, E, P


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_ops_take_the_reference_path_on_cpu(monkeypatch, mode):
    monkeypatch.setenv(_extension.ENV_VAR, mode)
    calls = _fail_build(monkeypatch)
    x, w, b, tokens, positions, E, P = _op_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(ops.layer_norm(x, w, b, 1e-5), ops.layer_norm_reference(x, w, b, 1e-5))
        torch.testing.assert_close(
            ops.bias_dropout_residual(x, b, x, 0.0, True),
            ops.bias_dropout_residual_reference(x, b, x, 0.0, True),
        )
        torch.testing.assert_close(
            ops.bias_act_dropout(x, b, "gelu", 0.0, True),
            ops.bias_act_dropout_reference(x, b, "gelu", 0.0, True),
        )
        torch.testing.assert_close(
            ops.transformer_embedding(tokens, positions, E, P, 2.0, 1, 0.0, True, True),
            ops.transformer_embedding_reference(tokens, positions, E, P, 2.0, 1, 0.0, True, True),
        )
    assert calls == []


def test_ops_raise_on_cpu_under_require(monkeypatch):
    monkeypatch.setenv(_extension.ENV_VAR, "require")
    x, w, b, tokens, positions, E, P = _op_inputs()
    with pytest.raises(RuntimeError, match="CPU tensor"):
        ops.layer_norm(x, w, b, 1e-5)
    with pytest.raises(RuntimeError, match="CPU tensor"):
        ops.bias_dropout_residual(x, b, x, 0.1, True)
    with pytest.raises(RuntimeError, match="CPU tensor"):
        ops.bias_act_dropout(x, b, "relu", 0.1, True)
    with pytest.raises(RuntimeError, match="CPU tensor"):
        ops.transformer_embedding(tokens, positions, E, P, 2.0, 1, 0.1, True, True)
