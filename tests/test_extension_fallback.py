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
        fp8 = _binding("fp8_linear")
        torch.testing.assert_close(fp8.fp8_linear(x, E, None), fp8.fp8_linear_reference(x, E))
        qd, kd, rows = torch.randn(3, 2, 8), torch.randn(2, 2, 5, 8), torch.tensor([[0, 1, 1, 0, 1]] * 3)
        torch.testing.assert_close(ops.decode_attention(qd, kd, kd, rows, rows > 0),
                                   ops.decode_attention_reference(qd, kd, kd, rows, rows > 0),
                                   atol=0, rtol=0)
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
    with pytest.raises(RuntimeError, match="CPU tensor"):
        _binding("fp8_linear").fp8_linear(x, E)


# ---------------------------------------------------------------- the op convention on the CPU
# ls_fairseq/ops/README.md: the public ops/<op>.py dispatches (kernels when the binding's
# ``supports`` holds, else its reference); ops/_<op>_cuda.py binds the op, registers its fakes
# once the extension is loaded (_extension.when_loaded) and imports without the extension.
BINDINGS = ("_adam_cuda", "_attention_cuda", "_bias_act_dropout_cuda", "_bias_dropout_residual_cuda",
            "_bias_dropout_residual_layer_norm_cuda", "_cross_entropy_cuda", "_decode_attention_cuda",
            "_embedding_cuda", "_fp8_quantize_cuda", "_layer_norm_cuda", "_peer_barrier_cuda",
            "_peer_memory_cuda", "_shard_reduce_cuda")


def test_when_loaded_runs_each_callback_once_after_a_successful_load(monkeypatch):
    monkeypatch.setattr(_extension, "_pending", [])  # the bindings' own callbacks stay pending
    monkeypatch.setattr(_extension, "_build", lambda: None)  # a "successful" build
    calls = []
    _extension.when_loaded(lambda: calls.append("early"))
    assert calls == []  # nothing loaded yet
    assert _extension.load() is True
    assert calls == ["early"]
    _extension.when_loaded(lambda: calls.append("late"))  # loaded: runs at once
    assert calls == ["early", "late"]
    _extension._reset_for_tests()
    assert _extension.load() is True
    assert calls == ["early", "late"]  # never twice


def test_failed_load_runs_no_callback(monkeypatch):
    monkeypatch.setattr(_extension, "_pending", [])
    _fail_build(monkeypatch)
    calls = []
    _extension.when_loaded(lambda: calls.append(1))
    assert _extension.load() is False
    assert calls == [] and len(_extension._pending) == 1


def test_load_kernels(monkeypatch):
    for name in BINDINGS:  # imported (their registrations pending) before the stubbed load below
        _binding(name)
    monkeypatch.setattr(_extension, "_pending", [])
    _fail_build(monkeypatch)
    assert ops.load_kernels() is False
    _extension._reset_for_tests()
    monkeypatch.setattr(_extension, "_build", lambda: None)
    assert ops.load_kernels() is True


def _binding(name):
    """ls_fairseq.ops.<name>, the module (``ops.layer_norm`` is the function)."""
    import importlib

    return importlib.import_module(f"ls_fairseq.ops.{name}")


def test_bindings_import_without_the_extension():
    import glob
    import os

    here = os.path.dirname(ops.__file__)
    found = tuple(sorted(os.path.basename(f)[:-3] for f in glob.glob(os.path.join(here, "_*_cuda.py"))))
    assert found == BINDINGS == ops.BINDINGS  # every binding is listed (ops.load_kernels)
    for name in BINDINGS:
        _binding(name)  # no torch.ops.ls_fairseq needed at import
    assert not _extension.has_op("layer_norm_fwd")
    assert _binding("_bias_act_dropout_cuda").ACTIVATIONS == _binding("bias_act_dropout").KERNEL_ACTIVATIONS


def test_supports_predicates():
    f32, f16 = torch.float32, torch.float16
    ln = _binding("_layer_norm_cuda")
    assert ln.supports(torch.ones(3, 8)) and ln.supports(torch.ones(0, 8, dtype=torch.bfloat16))
    assert not ln.supports(torch.ones(3, 8, dtype=torch.float64))
    assert not ln.supports(torch.ones(())) and not ln.supports(torch.ones(3, 0))
    bdr = _binding("_bias_dropout_residual_cuda")
    x = torch.ones(3, 8)
    assert bdr.supports(x, None, x) and bdr.supports(x, torch.ones(8), x)
    assert not bdr.supports(x, torch.ones(7), x) and not bdr.supports(x, None, x[:2])
    assert not bdr.supports(x, None, x.half())
    bad = _binding("_bias_act_dropout_cuda")
    assert bad.supports(x, None, "relu") and bad.supports(x, torch.ones(8), "gelu")
    assert not bad.supports(x, None, "tanh") and not bad.supports(x.double(), None, "relu")
    fused = _binding("_bias_dropout_residual_layer_norm_cuda")
    for dtype, c, ok in ((f16, 2048, True), (f16, 2056, False), (f16, 1002, False),
                         (f32, 1024, True), (f32, 1028, False), (f32, 6, False),
                         (torch.float64, 8, False)):
        y = torch.zeros(3, c, dtype=dtype)
        assert fused.supports(y, torch.zeros(c, dtype=dtype), y.clone(), None, None) is ok, (dtype, c)
    y = torch.zeros(3, 64, dtype=f16)
    assert not fused.supports(y, torch.zeros(64, dtype=f32), y.clone(), None, None)
    assert not fused.supports(y, None, y.clone(), torch.zeros(32, dtype=f16), None)
    assert not fused.supports(torch.zeros(3 * 64 + 1, dtype=f16)[1:].view(3, 64), None, y, None,
                              None)  # 2-byte offset
    emb = _binding("_embedding_cuda")
    tokens, E, P = torch.zeros(2, 3, dtype=torch.long), torch.ones(10, 8), torch.ones(6, 8)
    assert emb.supports(tokens, tokens, E, P) and emb.supports(tokens.int(), None, E, None)
    assert not emb.supports(tokens, None, E, P) and not emb.supports(tokens.float(), None, E, None)
    assert not emb.supports(tokens, tokens, E.double(), P)
    ce = _binding("_cross_entropy_cuda")
    assert ce.supports(torch.ones(2, 5, dtype=torch.bfloat16)) and not ce.supports(torch.ones(2, 5).double())
    sr = _binding("_shard_reduce_cuda")
    y = torch.ones(40, dtype=f16)
    assert sr.supports(y, [y, y]) and sr.supports(y, []) and sr.supports(y.float(), [y.float()] * 15)
    assert not sr.supports(y, [y.float()]) and not sr.supports(y, [y[:20]])
    assert not sr.supports(y, [y] * 16) and not sr.supports(y.double(), [y.double()])
    assert not sr.supports(y[::2], [y[::2]])
    attn = _binding("_attention_cuda")
    q = torch.ones(1, 2, 3, 4)
    assert attn.supports(q, q, q) and not attn.supports(q, q.half(), q)
    assert not attn.supports(q.double(), q.double(), q.double())


def _recorder(monkeypatch, module, name, reference, calls):
    """Replace a binding's kernel entry by its reference, recording the call."""
    def run(*args, **kwargs):
        calls.append(name)
        return reference(*args, **kwargs)

    monkeypatch.setattr(_binding(module), name, run)


def test_public_ops_dispatch_on_supports(monkeypatch):
    """With the kernels 'available' (use_kernels/has_op stubbed), each public op calls its
    binding for inputs the binding supports and its reference for the others."""
    monkeypatch.setattr(_extension, "use_kernels", lambda *tensors: True)
    monkeypatch.setattr(_extension, "has_op", lambda name: True)
    calls = []
    rec = lambda module, name, ref: _recorder(monkeypatch, module, name, ref, calls)  # noqa: E731
    rec("_layer_norm_cuda", "layer_norm_cuda", lambda x, w, b, eps, invertible=False: ops.layer_norm_reference(x, w, b, eps))
    rec("_layer_norm_cuda", "layer_norm_residual_cuda", ops.layer_norm_residual_reference)
    rec("_bias_dropout_residual_cuda", "bias_dropout_residual_cuda", ops.bias_dropout_residual_reference)
    rec("_bias_act_dropout_cuda", "bias_act_dropout_cuda", ops.bias_act_dropout_reference)
    rec("_bias_dropout_residual_layer_norm_cuda", "bias_dropout_residual_layer_norm_cuda",
        ops.bias_dropout_residual_layer_norm_reference)
    rec("_embedding_cuda", "transformer_embedding_cuda", ops.transformer_embedding_reference)
    rec("_cross_entropy_cuda", "label_smoothed_cross_entropy_cuda",
        ops.label_smoothed_cross_entropy_reference)
    rec("_cross_entropy_cuda", "label_smoothed_cross_entropy_rows_cuda",
        lambda lg, t, e, i, compute_argmax=False, inplace_backward=False:
        ops.label_smoothed_cross_entropy_rows_reference(lg, t, e, i, compute_argmax))
    rec("_attention_cuda", "attention_cuda", lambda *a: ops.attention_reference(*a)[0])
    rec("_attention_cuda", "attention_cuda_packed",
        lambda qkv, *a: ops.attention_reference(*qkv.permute(2, 0, 3, 1, 4).unbind(0), *a)[0])
    rec("_adam_cuda", "adam_step_cuda", ops.adam_step_reference)
    rec("_decode_attention_cuda", "decode_attention_cuda", ops.decode_attention_reference)
    rec("_shard_reduce_cuda", "shard_reduce_cuda", ops.shard_reduce_reference)

    def expect(fn, *args, kernel):
        calls.clear()
        fn(*args)
        assert calls == ([kernel] if kernel else []), (fn.__name__, calls)

    x, w, b, tokens, positions, E, P = _op_inputs()
    x64 = x.double()
    expect(ops.layer_norm, x, w, b, kernel="layer_norm_cuda")
    expect(ops.layer_norm, x64, w.double(), b.double(), kernel=None)
    expect(ops.layer_norm_residual, x, w, b, kernel="layer_norm_residual_cuda")
    expect(ops.layer_norm_residual, x64, None, None, kernel=None)
    expect(ops.bias_dropout_residual, x, b, x, 0.1, True, kernel="bias_dropout_residual_cuda")
    expect(ops.bias_dropout_residual, x, b.double(), x, 0.1, True, kernel=None)
    expect(ops.bias_act_dropout, x, b, "gelu", 0.1, True, kernel="bias_act_dropout_cuda")
    expect(ops.bias_act_dropout, x, b, "gelu_accurate", 0.1, True, kernel=None)
    expect(ops.bias_act_dropout, x64, None, "relu", 0.1, True, kernel=None)
    # the fused boundary, or (fp32 C = 6: not a multiple of its 4-wide vectors) the pair
    expect(ops.bias_dropout_residual_layer_norm, x, b, x, w, b, 0.1, True,
           kernel="bias_dropout_residual_layer_norm_cuda")
    calls.clear()
    ops.bias_dropout_residual_layer_norm(x[..., :6], b[:6], x[..., :6], w[:6], b[:6], 0.1, True)
    assert calls == ["bias_dropout_residual_cuda", "layer_norm_residual_cuda"], calls
    expect(ops.transformer_embedding, tokens, positions, E, P, 2.0, 1, 0.1, True, True,
           kernel="transformer_embedding_cuda")
    expect(ops.transformer_embedding, tokens, positions, E.double(), P.double(), 2.0, 1, 0.1,
           True, True, kernel=None)
    logits, target = torch.randn(5, 11), torch.tensor([1, 2, 3, 1, 4])
    expect(ops.label_smoothed_cross_entropy, logits, target, 0.1, 1,
           kernel="label_smoothed_cross_entropy_cuda")
    expect(ops.label_smoothed_cross_entropy, logits.double(), target, 0.1, 1, kernel=None)
    expect(ops.label_smoothed_cross_entropy_rows, logits, target, 0.1, 1,
           kernel="label_smoothed_cross_entropy_rows_cuda")
    expect(ops.label_smoothed_cross_entropy_rows, logits.double(), target, 0.1, 1, kernel=None)
    q = torch.randn(2, 3, 5, 4)
    expect(ops.attention, q, q, q, kernel="attention_cuda")
    expect(ops.attention, q, q, q, None, False, 0.0, False, True, kernel=None)  # need_weights
    expect(ops.attention, q.double(), q.double(), q.double(), kernel=None)
    qkv = torch.randn(2, 5, 3, 3, 4)
    expect(ops.attention_packed, qkv, kernel="attention_cuda_packed")
    expect(ops.attention_packed, qkv.double(), kernel=None)
    qd, kd = torch.randn(5, 3, 32).half(), torch.randn(2, 3, 7, 32).half()
    rows = torch.randint(0, 2, (5, 7))
    expect(ops.decode_attention, qd, kd, kd, rows, kernel="decode_attention_cuda")
    expect(ops.decode_attention, qd, kd, kd, rows, rows > 0, kernel="decode_attention_cuda")
    expect(ops.decode_attention, qd.float(), kd.float(), kd.float(), rows, kernel=None)
    expect(ops.decode_attention, qd, kd, kd, rows.int(), kernel=None)
    expect(ops.decode_attention, qd[..., :16], kd[..., :16], kd[..., :16], rows, kernel=None)
    expect(ops.shard_reduce_, x.clone(), [x, x], 1 / 3, kernel="shard_reduce_cuda")
    expect(ops.shard_reduce_, x.clone(), [x] * 16, 1 / 17, kernel=None)  # beyond 15 parts
    expect(ops.shard_reduce_, x64.clone(), [x64], 0.5, kernel=None)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.0, step=1)
    expect(lambda: ops.adam_step([x.clone()], [x], [x * 0], [x * 0], **hyper), kernel="adam_step_cuda")
    # the kernel entry points the optimizer and bench use go to the binding
    calls.clear()
    _binding("adam").adam_step_cuda([x.clone()], [x], [x * 0], [x * 0], **hyper)
    _binding("layer_norm").layer_norm_cuda(x, w, b)
    _binding("cross_entropy").label_smoothed_cross_entropy_rows_cuda(logits, target, 0.1, 1)
    _binding("attention").attention_cuda(q, q, q)
    _binding("attention").attention_cuda_packed(qkv)
    assert calls == ["adam_step_cuda", "layer_norm_cuda", "label_smoothed_cross_entropy_rows_cuda",
                     "attention_cuda", "attention_cuda_packed"], calls


def test_fp8_linear_dispatch(monkeypatch):
    """fp8_linear has no binding: its GPU path is torch._scaled_mm (ops/fp8_linear.py), so it
    never builds the extension. With an FP8 GPU stubbed, it takes that path exactly where its
    ``supports`` holds (K and N multiples of 16, the kernels' dtypes), and the reference under
    ``off``. A GPU without FP8 matmuls warns once (``auto``) or raises (``require``)."""
    fp8 = _binding("fp8_linear")
    build_calls = _fail_build(monkeypatch)
    real_fp8_device = fp8.fp8_device
    monkeypatch.setattr(fp8, "fp8_device", lambda t: True)
    engine = []

    def scaled_mm(*args, **kwargs):
        engine.append("scaled_mm")
        return fp8.matmul_reference(*args, **kwargs)

    monkeypatch.setattr(fp8, "matmul_scaled_mm", scaled_mm)

    def expect(x, w, kernel):
        engine.clear()
        fp8.fp8_linear(x, w)
        assert engine == (["scaled_mm"] if kernel else []), (x.shape, w.shape, x.dtype)

    x, w = torch.randn(3, 5, 32), torch.randn(16, 32)
    assert fp8.supports(x.view(15, 32), w, torch.zeros(16))
    expect(x, w, kernel=True)
    expect(x[:, :1], w, kernel=True)  # M is free (the backward pads it)
    expect(x[..., :24], w[:, :24], kernel=False)  # K not a multiple of 16
    expect(x, w[:12], kernel=False)  # N
    expect(x.double(), w.double(), kernel=False)
    expect(x[:, :0], w, kernel=False)  # no rows
    monkeypatch.setenv(_extension.ENV_VAR, "off")
    expect(x, w, kernel=False)
    monkeypatch.setenv(_extension.ENV_VAR, "require")
    expect(x, w, kernel=True)
    assert build_calls == []

    # a GPU without FP8 tensor cores (capability 8.0), as a stand-in tensor: decided up front
    monkeypatch.setattr(fp8, "fp8_device", real_fp8_device)
    monkeypatch.setenv(_extension.ENV_VAR, "auto")
    old_gpu = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    monkeypatch.setattr(fp8, "_capability", lambda index: (8, 0))
    monkeypatch.setattr(fp8, "_warned_no_fp8_gpu", False)
    with pytest.warns(RuntimeWarning, match="capability 8.0.*reference") as record:
        assert fp8._use_scaled_mm(old_gpu, w, None) is False
        assert fp8._use_scaled_mm(old_gpu, w, None) is False
    assert len(record) == 1
    monkeypatch.setenv(_extension.ENV_VAR, "require")
    with pytest.raises(RuntimeError, match="require.*capability 8.0"):
        fp8._use_scaled_mm(old_gpu, w, None)


FAKES_CHECK = r'''
import glob, os, re, sys
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

lib = torch.library.Library("ls_fairseq", "FRAGMENT")
names = []
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.cu"))):
    for m in re.finditer(r'm\.def\(((?:\s*"[^"]*")+)', open(path).read()):
        schema = "".join(re.findall(r'"([^"]*)"', m.group(1)))
        lib.define(schema)
        names.append(schema.split("(")[0])

import ls_fairseq.ops as ops  # noqa: E402  (the public modules import no binding yet)
from ls_fairseq.ops import _extension  # noqa: E402
for b in %(bindings)r:
    __import__("ls_fairseq.ops." + b)  # imported before the "load": registration deferred
_extension._loaded = True  # the schemas above stand for the extension
_extension._run_pending()
assert not _extension._pending

o = torch.ops.ls_fairseq
calls = {}
with FakeTensorMode():
    x, w, b, g = torch.empty(6, 8), torch.empty(8), torch.empty(8), torch.empty(6, 8)
    y, mean, rstd = o.layer_norm_fwd(x, w, b, 1e-5, False)
    calls["layer_norm_fwd"] = (y.shape, mean.shape, rstd.shape, rstd.dtype) == ((6, 8), (6,), (6,), torch.float32)
    dx, dw, db = o.layer_norm_bwd(g, x, w, b, mean, rstd, False, True, False, None)
    calls["layer_norm_bwd"] = (dx.shape, dw.shape, db.shape) == ((6, 8), (8,), (0,))
    xo, h, mean, rstd, rng = o.bias_dropout_residual_layer_norm_fwd(x, b, x, w, b, 0.1, True, 1e-5)
    calls["bias_dropout_residual_layer_norm_fwd"] = (xo.shape, h.shape, mean.shape, rng.shape, rng.dtype) == ((6, 8), (6, 8), (6,), (2,), torch.int64)
    r = o.bias_dropout_residual_layer_norm_bwd(g, xo, w, b, mean, rstd, g, rng, 0.1, True, True, False, True)
    calls["bias_dropout_residual_layer_norm_bwd"] = [t.shape for t in r] == [(6, 8), (6, 8), (8,), (0,), (8,)]
    out, rng = o.bias_dropout_residual_fwd(x, b, x, 0.1, True)
    calls["bias_dropout_residual_fwd"] = (out.shape, rng.shape, rng.dtype) == ((6, 8), (2,), torch.int64)
    gx, gb = o.bias_dropout_residual_bwd(g, rng, 0.1, True, True)
    calls["bias_dropout_residual_bwd"] = (gx.shape, gb.shape) == ((6, 8), (8,))
    out, rng = o.bias_act_dropout_fwd(x, b, "gelu", 0.1, True)
    calls["bias_act_dropout_fwd"] = (out.shape, rng.shape) == ((6, 8), (2,))
    gx, gb = o.bias_act_dropout_bwd(g, x, b, rng, "gelu", 0.1, True, False)
    calls["bias_act_dropout_bwd"] = (gx.shape, gb.shape) == ((6, 8), (0,))
    gx, gb = o.relu_dropout_bwd(g, out, 0.1, True, True)
    calls["relu_dropout_bwd"] = (gx.shape, gb.shape) == ((6, 8), (8,))
    tokens = torch.empty(2, 3, dtype=torch.long)
    E, P = torch.empty(10, 8), torch.empty(6, 8)
    out, rng = o.embedding_fwd(tokens, tokens, E, P, 2.0, 1, 0.1, True, True)
    calls["embedding_fwd"] = (out.shape, rng.shape) == ((2, 3, 8), (2,))
    ge, gp = o.embedding_bwd(out, tokens, tokens, E, P, rng, 2.0, 1, 0.1, True, True, True, False, False)
    calls["embedding_bwd"] = (ge.shape, gp.shape) == ((10, 8), (0,))
    logits, target = torch.empty(5, 11, dtype=torch.float16), torch.empty(5, dtype=torch.long)
    loss, nll, lse, am = o.ls_cross_entropy_fwd(logits, target, 0.1, 1, True)
    calls["ls_cross_entropy_fwd"] = (loss.shape, loss.dtype, lse.shape, am.shape, am.dtype) == ((5,), torch.float32, (5,), (5,), torch.long)
    one = torch.empty(1)
    gl = o.ls_cross_entropy_bwd(one, None, logits, target, lse, 0.1, 1)
    calls["ls_cross_entropy_bwd"] = (gl.shape, gl.dtype) == ((5, 11), torch.float16)
    calls["ls_cross_entropy_bwd_"] = o.ls_cross_entropy_bwd_(one, None, logits, target, lse, 0.1, 1) is None
    q, k = torch.empty(2, 3, 5, 16, dtype=torch.float16), torch.empty(2, 3, 9, 16, dtype=torch.float16)
    kpm = torch.empty(2, 9, dtype=torch.bool)
    out, probs, rng = o.attention_fwd(q, k, k, kpm, True, 0.0, False)
    calls["attention_fwd"] = (out.shape, probs.shape, rng.shape) == ((2, 3, 5, 16), (2, 3, 5, 9), (2,))
    dq, dk, dv = o.attention_bwd(out, q, k, k, probs, rng, 0.0)
    calls["attention_bwd"] = (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)
    out, lse, rng = o.short_attention_fwd(q, k, k, kpm, True, 0.0, False)
    calls["short_attention_fwd"] = (out.shape, lse.shape, lse.dtype) == ((2, 3, 5, 16), (2, 3, 5), torch.float32)
    calls["short_attention_bwd"] = o.short_attention_bwd(out, q, k, k, out, lse, kpm, True, rng, 0.0, torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)) is None
    qkv = torch.empty(2, 9, 3, 3, 16, dtype=torch.float16)
    out, lse, rng = o.short_attention_packed_fwd(qkv, kpm, True, 0.0)
    calls["short_attention_packed_fwd"] = (out.shape, lse.shape, lse.dtype) == ((2, 3, 9, 16), (2, 3, 9), torch.float32)
    out, lse, seed, offset = o.efficient_attention_fwd(q, k, k, None, 2, 0.0, True)
    calls["efficient_attention_fwd"] = (out.shape, lse.shape, seed.device.type) == ((2, 3, 5, 16), (2, 3, 32), "cpu")
    out, lse, seed, offset = o.efficient_attention_packed_fwd(qkv, None, 0, 0.0, False)
    calls["efficient_attention_packed_fwd"] = (out.shape, lse.shape, offset.device.type) == ((2, 3, 9, 16), (2, 3, 0), "cpu")
    r = o.ls_cross_entropy_rows(logits, target, 0.1, 1, True, True)
    calls["ls_cross_entropy_rows"] = [t.shape for t in r] == [(5,), (5,), (5,), (5,)]
    t = torch.empty(37, 32, dtype=torch.bfloat16)
    t8, inv, t8t = o.fp8_quantize(t, torch.float8_e5m2, 16)
    calls["fp8_quantize"] = (t8.shape, t8.dtype, inv.shape, inv.dtype, t8t.shape, t8t.dtype) == ((37, 32), torch.float8_e5m2, (), torch.float32, (32, 48), torch.float8_e5m2)
    tt = o.fp8_transpose(t8, 16)
    calls["fp8_transpose"] = (tt.shape, tt.dtype) == ((32, 48), torch.float8_e5m2)
    qd, kd = torch.empty(5, 3, 32, dtype=torch.float16), torch.empty(2, 3, 7, 32, dtype=torch.float16)
    rows, kpm = torch.empty(5, 7, dtype=torch.long), torch.empty(5, 7, dtype=torch.bool)
    out = o.decode_attention(qd.transpose(0, 1).contiguous().transpose(0, 1), kd, kd, rows, kpm)
    out2 = o.decode_attention(qd, kd, kd, rows, None)
    calls["decode_attention"] = (out.shape, out.dtype, out.stride(), out2.shape) == ((5, 3, 32), torch.float16, (96, 32, 1), (5, 3, 32))
    p, found = torch.empty(7), torch.empty(1, dtype=torch.int32)
    calls["multi_tensor_adam"] = o.multi_tensor_adam([p], [p], [p], [p], [], None, None, None, found, 1e-3, 0.9, 0.98, 1e-8, 0.0, 1e-3, 1.0) is None
    sc = torch.empty(1, 2)
    calls["multi_tensor_adam_moment_max"] = o.multi_tensor_adam_moment_max([p], [p], [p.half()], [p.half()], None, sc, sc, found, sc, 0.9, 0.98, 1.0) is None
    calls["shard_reduce_"] = o.shard_reduce_(x, [x, x], 1 / 3) is None
    fl = torch.empty(3, dtype=torch.long)
    calls["peer_barrier_"] = o.peer_barrier_(fl, [fl, fl], 1, 5) is None
    gpu = torch.empty(100, device="cuda:1")
    calls["peer_export"] = tuple(o.peer_export(gpu).shape) == (80,)
    seg = o.peer_import(torch.empty(80, dtype=torch.uint8), 1, 4096)
    calls["peer_import"] = (seg.shape, seg.dtype, seg.device) == ((4096,), torch.uint8, torch.device("cuda", 1))
bad = {n: ok for n, ok in calls.items() if ok is not True}
assert not bad, bad
# CompositeImplicitAutograd ops decompose into the ops above (checked under FakeTensorMode by
# tests/autograd_cpp_check.py, which builds their C++); a fake of theirs would fail to register
composite = %(composite)r
assert composite <= set(names), composite
for n in composite:
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("ls_fairseq::" + n, "Meta"), n
missing = sorted(set(names) - set(calls) - composite)
assert not missing, "ops defined in csrc/ without a checked fake: %%s" %% missing
for name in ("embedding_fwd", "attention_fwd", "short_attention_fwd", "short_attention_packed_fwd",
             "efficient_attention_fwd", "efficient_attention_packed_fwd", "ls_cross_entropy_rows"):
    assert torch._C._dispatch_has_kernel_for_dispatch_key("ls_fairseq::" + name, "Autograd"), name
print("fakes ok", len(calls))
'''


def _composite_ops(directory):
    """Names of the ops csrc/*.cpp registers as CompositeImplicitAutograd (no fake: they
    decompose)."""
    import glob
    import os
    import re

    names = set()
    for path in glob.glob(os.path.join(directory, "*.cpp")):
        text = open(path).read()
        for block in re.finditer(
                r"TORCH_LIBRARY_IMPL\(ls_fairseq, CompositeImplicitAutograd, m\) \{(.*?)\n\}",
                text, re.S):
            names.update(re.findall(r'm\.impl\("([^"]+)"', block.group(1)))
    return names


def test_bindings_register_every_ops_fake_once_loaded(tmp_path):
    """In a fresh process: the schemas of every op in csrc/ (no kernels), the bindings imported
    first, then the 'load': every op's fake (meta) implementation is registered and gives the
    shapes the kernels return, except the CompositeImplicitAutograd ops', which must have none;
    the ops with a Python autograd have it registered."""
    import os
    import subprocess
    import sys

    composite = _composite_ops(_extension.csrc_dir())
    # a new one needs its fake checked through its decomposition, as autograd_cpp_check does
    assert composite == {"layer_norm_residual"}, composite
    script = tmp_path / "fakes_check.py"
    script.write_text(FAKES_CHECK % {"bindings": BINDINGS, "composite": composite})
    # the child imports the same ls_fairseq as this process (not another installed copy)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(_extension.__file__)))
    env = dict(os.environ, LS_FAIRSEQ_KERNELS="auto",
               PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(script), _extension.csrc_dir()], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0 and "fakes ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
