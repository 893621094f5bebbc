"""GPU tests of ``ls_fairseq.ops.fp8_linear`` (``--ls-fp8``): the ``torch._scaled_mm`` path
against the float32 reference (ops/fp8_linear.py), forward and backward. Both paths quantize with
the same ``quantize`` on the same device (the same float8 values and scales), so they differ only
in how the float32 sums are ordered, and where that lands on the other side of the final fp16/bf16
rounding.

Tolerance, relative to the reference's max: one ulp of the output dtype at that magnitude
(bf16 2^-7, fp16 2^-10) plus 1e-3 for the accumulation order. cuBLASLt sums FP8 products in the
tensor cores and promotes them to float32 in chunks (``use_fast_accum=False``). The float32
reference sums in another order. Over K <= 16384 terms of random signs that is far below 1e-3 of
the max. A wrong scale (not inverted), layout or operand is an O(1) error and fails.

Also: the fallback for other shapes, no host synchronisation and CUDA graph replay of one
forward and backward, opcheck, and an ls_ model with ``--ls-fp8`` eagerly and under the
criterion's CUDA graphs.

The quantize kernels (``csrc/fp8_quantize.cu``, binding ``ops/_fp8_quantize_cuda.py``) equal
``fp8_linear.quantize`` and ``transposed`` bit for bit: the float8 bytes, the inverse scale's
float32 bits and the transposed, zero-padded copy, over dtypes, both float8 formats, shapes
(0 and 1 rows, odd sizes, non-contiguous and misaligned inputs) and contents (large and tiny
amax, all zero, inf, NaN, exact float8 ties). fp8_linear gives the same bits with and without
them, and they replay in a CUDA graph.

Skipped without CUDA (the ``gpu`` marker) and, with a clear reason, on GPUs without FP8 tensor
cores (compute capability < 8.9; there the reference runs, checked on the CPU in
tests/test_extension_fallback.py).
"""
import pytest
import torch

from ls_fairseq.ops import fp8_linear as fp8

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (tests/conftest.py)

DTYPES = [torch.float16, torch.bfloat16]
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
ACCUMULATION = 1e-3
# (M, K, N): M free (one token row; 37: the weight gradient's contraction padded to 48),
# K and N multiples of 16, up to a large K
CASES = [(1, 32, 16), (37, 64, 48), (128, 512, 1024), (1000, 1024, 4096), (4096, 4096, 1024),
         (256, 16384, 256)]


@pytest.fixture(scope="module", autouse=True)
def fp8_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    capability = torch.cuda.get_device_capability()
    if capability < fp8.MIN_CAPABILITY:
        pytest.skip(f"FP8 matmuls (torch._scaled_mm) need compute capability >= 8.9; this GPU "
                    f"({torch.cuda.get_device_name()}) has {capability[0]}.{capability[1]}")


@pytest.fixture
def engine(monkeypatch):
    """The ``_scaled_mm`` calls made (forward: 1 per linear, backward: 2), and ``require``
    (a silent fallback to the reference fails)."""
    monkeypatch.setenv("LS_FAIRSEQ_KERNELS", "require")
    calls = []
    scaled_mm = fp8.matmul_scaled_mm

    def record(a8, *args, **kwargs):
        calls.append((tuple(a8.shape), a8.dtype))
        return scaled_mm(a8, *args, **kwargs)

    monkeypatch.setattr(fp8, "matmul_scaled_mm", record)
    return calls


def _inputs(m, k, n, dtype, bias=True, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(n, device="cuda", generator=g).to(dtype).requires_grad_() if bias else None
    grad_out = torch.randn(m, n, device="cuda", generator=g).to(dtype)
    return x, w, b, grad_out


def assert_matches(ours, ref, what):
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, what
    ours, ref = ours.detach(), ref.detach()
    tol = float(ref.float().abs().max()) * (ULP[ref.dtype] + ACCUMULATION)
    err = float((ours.float() - ref.float()).abs().max())
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


def _forward_backward(fn, x, w, b, grad_out):
    out = fn(x, w, b)
    grads = torch.autograd.grad(out, [t for t in (x, w, b) if t is not None], grad_out)
    return (out, *grads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_scaled_mm_matches_the_reference(engine, dtype, m, k, n, bias):
    x, w, b, grad_out = _inputs(m, k, n, dtype, bias)
    ours = _forward_backward(fp8.fp8_linear, x, w, b, grad_out)
    assert [d for _, d in engine] == [torch.float8_e4m3fn, torch.float8_e5m2,
                                      torch.float8_e5m2]  # forward, grad_x, grad_w
    engine.clear()
    ref = _forward_backward(fp8.fp8_linear_reference, x, w, b, grad_out)
    assert engine == []
    for name, a, r in zip(("out", "grad_x", "grad_w", "grad_b"), ours, ref):
        assert_matches(a, r, f"{name} {dtype} {(m, k, n)}")
    if bias:
        assert torch.equal(ours[3], ref[3])  # the same float32 row sum


def test_three_dimensional_input(engine):
    x, w, b, grad_out = _inputs(6 * 11, 256, 512, torch.bfloat16)
    x3 = x.detach().view(6, 11, 256).requires_grad_()
    out = fp8.fp8_linear(x3, w, b)
    assert out.shape == (6, 11, 512)
    out.backward(grad_out.view(6, 11, 512))
    ref = _forward_backward(fp8.fp8_linear_reference, x, w, b, grad_out)
    assert_matches(out.view(66, 512).detach(), ref[0].detach(), "out")
    assert_matches(x3.grad.view(66, 256), ref[1], "grad_x")


@pytest.mark.parametrize("k,n", [(40, 64), (64, 24), (13, 7)])
def test_other_shapes_take_the_reference(engine, k, n):
    """K or N not a multiple of 16: the reference, silently (as the other ops' shapes do), also
    under LS_FAIRSEQ_KERNELS=require."""
    x, w, b, grad_out = _inputs(33, k, n, torch.float16)
    ours = _forward_backward(fp8.fp8_linear, x, w, b, grad_out)
    ref = _forward_backward(fp8.fp8_linear_reference, x, w, b, grad_out)
    assert engine == []
    for a, r in zip(ours, ref):
        assert torch.equal(a, r)


def test_zero_and_non_finite_inputs(engine):
    x, w, b, grad_out = _inputs(64, 128, 64, torch.float16)
    out = fp8.fp8_linear(torch.zeros_like(x), w, b)
    assert torch.equal(out, b.detach().expand_as(out))
    gx, gw = torch.autograd.grad(fp8.fp8_linear(x, w), [x, w], torch.zeros_like(grad_out))
    assert not gx.any() and not gw.any()
    bad_x = x.detach().clone()
    bad_x[3, 5] = float("inf")
    assert not torch.isfinite(fp8.fp8_linear(bad_x, w, b)).all()
    bad_g = grad_out.clone()
    bad_g[7, 1] = float("nan")
    gx, gw = torch.autograd.grad(fp8.fp8_linear(x, w, b), [x, w], bad_g)
    assert not torch.isfinite(gx).all() and not torch.isfinite(gw).all()


def test_no_host_sync_and_cuda_graph_replay_matches_eager(engine):
    """One forward and backward: no synchronising call in eager mode (sync debug mode "error"),
    then captured in a CUDA graph. Replays on new inputs equal the eager results. Bitwise
    equality is expected; the check allows the usual tolerance in case cuBLASLt picks another
    algorithm under capture."""
    x, w, b, grad_out = _inputs(200, 512, 256, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _forward_backward(fp8.fp8_linear, x, w, b, grad_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside the graph (cuBLASLt handles, workspaces)
            _forward_backward(fp8.fp8_linear, x, w, b, grad_out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = _forward_backward(fp8.fp8_linear, x, w, b, grad_out)
    for seed in (1, 2):
        new = _inputs(200, 512, 256, torch.bfloat16, seed=seed)
        with torch.no_grad():
            for dst, src in zip((x, w, b, grad_out), new):
                dst.copy_(src)
        graph.replay()
        eager = _forward_backward(fp8.fp8_linear, x, w, b, grad_out)
        for name, a, r in zip(("out", "grad_x", "grad_w", "grad_b"), static, eager):
            assert_matches(a, r, f"replay {seed} {name}")


@pytest.mark.parametrize("scaled_mm", [True, False])
def test_opcheck(scaled_mm):
    """Schema, autograd registration and fake implementation. opcheck's AOT test sums every
    output, and float8 has no sum kernel, so AOTAutograd is checked by the next test."""
    x, w, b, _ = _inputs(20, 32, 16, torch.bfloat16)
    for bias in (b, None):
        torch.library.opcheck(fp8.fp8_linear_fwd, (x, w, bias, scaled_mm),
                              test_utils=("test_schema", "test_autograd_registration",
                                          "test_faketensor"))


def test_traces_under_aot_autograd(engine):
    """The ``_scaled_mm`` op and its Python backward under torch.compile (aot_eager), with the
    engine fixed (the dispatch itself reads the environment, outside any graph)."""
    x, w, b, grad_out = _inputs(48, 64, 32, torch.float16)

    def loss(x, w, b):
        return (fp8._apply(x, w, b, True).float() * grad_out.float()).sum()

    eager = loss(x, w, b)
    eager_grads = torch.autograd.grad(eager, [x, w, b])
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)(x, w, b)
    torch.testing.assert_close(compiled, eager)
    for got, ref in zip(torch.autograd.grad(compiled, [x, w, b]), eager_grads):
        assert torch.equal(got, ref)


def test_ls_model_trains_with_fp8(dictionary, extension, engine):
    """An ls_ model in fp16 with ``--ls-fp8`` (dims multiples of 16): every layer linear takes
    ``_scaled_mm`` in training, and the loss is within 2e-2 of the same model without fp8 (e4m3
    rounds each operand by up to 2^-4; the loss averages it out; tests/test_fp8_linear.py).
    Evaluation runs without fp8."""
    from fairseq_helpers import build_model, random_sample

    tiny = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64",
            "--decoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
            "--decoder-ffn-embed-dim", "128", "--encoder-attention-heads", "4",
            "--decoder-attention-heads", "4", "--dropout", "0", "--attention-dropout", "0",
            "--activation-dropout", "0", "--share-all-embeddings"]
    sample = random_sample(dictionary, 8, 21, 19, torch.Generator().manual_seed(0))
    net_input = {k: v.cuda() for k, v in sample["net_input"].items()}
    target = sample["target"].cuda()
    losses = {}
    for name, extra in (("plain", []), ("fp8", ["--ls-fp8"])):
        model = build_model("ls_transformer_wmt_en_de_big_t2t", dictionary, tiny + extra,
                            seed=3).cuda().half().train()
        engine.clear()
        out, _ = model(**net_input)
        lprobs = torch.log_softmax(out.float(), -1).view(-1, out.size(-1))
        loss = torch.nn.functional.nll_loss(lprobs, target.view(-1), ignore_index=dictionary.pad())
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        losses[name] = float(loss)
        assert len(engine) == (3 * (2 * 4 + 2 * 6) if extra else 0), name
        if extra:
            engine.clear()
            with torch.no_grad():
                model.eval()(**net_input)
            assert engine == []
    assert abs(losses["fp8"] - losses["plain"]) <= 2e-2 * losses["plain"], losses


def test_criterion_cuda_graphs_replay_fp8_steps_as_eager(dictionary, extension, engine):
    """The whole training step of an fp16 ls_ model with ``--ls-fp8`` under the criterion's
    CUDA graphs (``--ls-cuda-graphs``): replayed steps match eager steps with the tolerances
    of test_cuda_graphs_cuda.py (the same kernels on the same inputs)."""
    from fairseq_helpers import DummyTask, build_model
    from test_cuda_graphs_cuda import SHAPES, _assert_replays_match_eager

    from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (
        LSLabelSmoothedCrossEntropyCriterion,
    )

    extra = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64",
             "--encoder-ffn-embed-dim", "128", "--encoder-attention-heads", "4",
             "--decoder-attention-heads", "4", "--share-all-embeddings", "--dropout", "0",
             "--attention-dropout", "0", "--activation-dropout", "0", "--ls-fp8"]
    task = DummyTask(dictionary)
    kwargs = dict(sentence_avg=False, label_smoothing=0.1)
    eager = LSLabelSmoothedCrossEntropyCriterion(task, ls_no_cuda_graphs=True, **kwargs)
    graphed = LSLabelSmoothedCrossEntropyCriterion(task, ls_cuda_graphs=True, **kwargs)
    m1, m2 = (build_model("ls_transformer", dictionary, extra, seed=5).cuda().half().train()
              for _ in range(2))
    _assert_replays_match_eager(dictionary, eager, graphed, m1, m2, torch.float16,
                                [[shape] for shape in SHAPES], seed=100)
    assert graphed.graphs.stats["replayed"] >= 3
    assert engine  # the FP8 GEMMs ran (eagerly, and in the captures)


# ---------------------------------------------------------------- the quantize kernels

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
QUANT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (R, C): no rows, no columns, one row, odd sizes, tile edges (64), K/N multiples of 16, big
QUANT_SHAPES = [(0, 32), (5, 0), (1, 1), (1, 16), (1, 4096), (7, 5), (33, 48), (37, 64),
                (64, 64), (65, 130), (127, 1024), (1000, 1024), (4097, 16), (16, 4097)]
CONTENTS = ["normal", "large", "tiny", "below_floor", "zero", "inf", "nan", "ties"]
PADS = [0, 1, 5, 16]  # 0: no transposed copy; 16: the backward's; 5: R' not a multiple of 16


@pytest.fixture(scope="module")
def kernels(extension):
    assert extension.has_op("fp8_quantize") and extension.has_op("fp8_transpose")
    from ls_fairseq.ops import _fp8_quantize_cuda

    return _fp8_quantize_cuda


def _fp8_ties(dtype, fp8_dtype, device):
    """Every non-negative value of ``fp8_dtype``, the midpoints between neighbours and the
    input dtype's next values around those, times 2^k, led by fp8_max * 2^k: the amax makes
    the scale exactly 2^-k, so the scaled midpoints are exact ties of the cast."""
    k = 0 if dtype == torch.float16 else 3
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).double()
    grid = codes[torch.isfinite(codes) & (codes >= 0)].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    values = (torch.cat([grid, mid]) * 2.0 ** k).to(dtype)
    bits = values.view(torch.int16 if dtype != torch.float32 else torch.int32)
    positive = bits[values > 0]
    near = torch.cat([(positive - 1).view(dtype), (positive + 1).view(dtype)])
    top = torch.finfo(fp8_dtype).max * 2.0 ** k
    values = torch.cat([torch.tensor([top], dtype=dtype), values, near[near.double() <= top]])
    return values.to(device)


def _content(kind, rows, cols, dtype, fp8_dtype, device="cuda", seed=0):
    """A [rows, cols] tensor of ``dtype`` for one case of the quantization."""
    n = rows * cols
    g = torch.Generator(device=device).manual_seed(seed)
    v = torch.randn(n, generator=g, device=device)
    half = dtype == torch.float16
    if kind == "large":  # fp16: up to 6e4 (max 65504); else 3e38 (1/amax is subnormal)
        v = v.clamp(-2, 2) * 3e4 if half else v.clamp(-3, 3) * 1e38
    elif kind == "tiny":  # subnormal inputs
        v = v * (1e-6 if half else 1e-39)
    elif kind == "below_floor":  # amax under AMAX_FLOOR
        v = v * 1e-14
    elif kind == "zero":
        v = torch.where(v > 0, 0.0, -0.0)
    elif kind in ("inf", "nan") and n > 0:
        idx = torch.randint(n, (3,), generator=g, device=device)
        v[idx] = torch.tensor([float(kind), -float(kind), float(kind)], device=device)
    if kind == "ties":
        ties = _fp8_ties(dtype, fp8_dtype, device)
        sign = torch.where(v > 0, 1.0, -1.0).to(dtype)
        t = ties.repeat(-(-n // ties.numel()))[:n] * sign if n else ties[:0]
        if n:
            t[0] = ties[0]  # the amax element, positive
        return t.view(rows, cols)
    return v.to(dtype).view(rows, cols)


def _assert_same_quantization(ours, ref, what):
    t8, inv, t8_t = ours
    r8, r_inv, r_t = ref
    assert t8.dtype == r8.dtype and t8.shape == r8.shape and t8.is_contiguous(), what
    assert torch.equal(t8.view(torch.uint8), r8.view(torch.uint8)), what
    assert inv.dtype == torch.float32 and inv.dim() == 0, what
    if torch.isnan(r_inv):
        assert torch.isnan(inv), what
    else:
        assert inv.view(torch.int32).item() == r_inv.view(torch.int32).item(), (
            what, inv.item(), r_inv.item())
    if r_t is None:
        assert t8_t.numel() == 0, what
    else:
        assert t8_t.dtype == r_t.dtype and t8_t.shape == r_t.shape, what
        assert torch.equal(t8_t.view(torch.uint8), r_t.view(torch.uint8)), what


def _reference_quantization(t, fp8_dtype, pad):
    r8, r_inv = fp8.quantize(t, fp8_dtype)
    return r8, r_inv, (fp8.transposed(r8, pad) if pad else None)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("rows,cols", QUANT_SHAPES)
def test_quantize_kernel_is_the_reference_bit_for_bit(kernels, dtype, fp8_dtype, rows, cols):
    for kind in CONTENTS:
        t = _content(kind, rows, cols, dtype, fp8_dtype)
        for pad in PADS:
            ours = kernels.fp8_quantize_cuda(t, fp8_dtype, pad)
            _assert_same_quantization(ours, _reference_quantization(t, fp8_dtype, pad),
                                      (kind, pad))


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantize_kernel_takes_any_layout(kernels, dtype, fp8_dtype):
    """Non-contiguous input (a transposed view) and misaligned input (an offset of one
    element: the kernels' scalar loads)."""
    base = _content("normal", 1, 1 + 96 * 80, dtype, fp8_dtype).view(-1)
    for t in (base[:96 * 80].view(80, 96).t(), base[1:].view(96, 80), base[1:].view(80, 96),
              base[1:1 + 37 * 64].view(37, 64)):
        for pad in (0, 16):
            ours = kernels.fp8_quantize_cuda(t, fp8_dtype, pad)
            _assert_same_quantization(ours, _reference_quantization(t, fp8_dtype, pad),
                                      (tuple(t.shape), t.stride(), pad))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("rows,cols", QUANT_SHAPES)
def test_transpose_kernel_is_the_reference_bit_for_bit(kernels, fp8_dtype, rows, cols):
    t8, _ = fp8.quantize(_content("normal", rows, cols, torch.float32, fp8_dtype), fp8_dtype)
    for multiple in (1, 3, 16):
        ours = kernels.fp8_transpose_cuda(t8, multiple)
        ref = fp8.transposed(t8, multiple)
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, multiple
        assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8)), multiple
    if rows * cols > 1:  # misaligned (offset one byte) and non-contiguous float8 inputs
        flat = torch.cat([t8.view(torch.uint8).view(-1)[:1], t8.view(torch.uint8).view(-1)])
        for view in (flat[1:].view(rows, cols).view(fp8_dtype), t8.t()):
            ours = kernels.fp8_transpose_cuda(view, 16)
            assert torch.equal(ours.view(torch.uint8),
                               fp8.transposed(view, 16).view(torch.uint8))


def test_quantize_ops_reject_bad_inputs(kernels):
    t = torch.randn(4, 16, device="cuda")
    with pytest.raises(RuntimeError, match="2-D CUDA tensor"):
        kernels.fp8_quantize_cuda(t.view(-1), torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="float8_e4m3fn or float8_e5m2"):
        kernels.fp8_quantize_cuda(t, torch.float16)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        kernels.fp8_quantize_cuda(t.double(), torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="transpose_pad"):
        kernels.fp8_quantize_cuda(t, torch.float8_e4m3fn, -1)
    with pytest.raises(RuntimeError, match="1-byte dtype"):
        kernels.fp8_transpose_cuda(t, 16)
    with pytest.raises(RuntimeError, match="pad must be >= 1"):
        kernels.fp8_transpose_cuda(t.to(torch.float8_e4m3fn), 0)


def test_opcheck_quantize_ops(kernels):
    """Schema and fake implementation of both ops. The AOT tests sum float8 outputs (no such
    kernel), and the schema test compares float8 inputs with allclose (none either): those
    inputs are checked as uint8 bytes, which fp8_transpose takes as well."""
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    for rows, cols in ((37, 32), (0, 16), (1, 5)):
        for fp8_dtype in FP8_DTYPES:
            for pad in (0, 16):
                t = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
                torch.library.opcheck(torch.ops.ls_fairseq.fp8_quantize.default,
                                      (t, fp8_dtype, pad), test_utils=utils)
        t8 = torch.randn(rows, cols, device="cuda").to(torch.float8_e4m3fn)
        torch.library.opcheck(torch.ops.ls_fairseq.fp8_transpose.default,
                              (t8.view(torch.uint8), 16), test_utils=utils)
        torch.library.opcheck(torch.ops.ls_fairseq.fp8_transpose.default, (t8, 16),
                              test_utils=utils[1:])


@pytest.fixture
def kernel_calls(kernels, monkeypatch):
    """The quantize kernels' calls made through the binding."""
    calls = []
    quantize, transpose = kernels.fp8_quantize_cuda, kernels.fp8_transpose_cuda

    def record_quantize(t, fp8_dtype, transpose_pad=0):
        calls.append(("quantize", tuple(t.shape), fp8_dtype, transpose_pad))
        return quantize(t, fp8_dtype, transpose_pad)

    def record_transpose(t8, multiple=1):
        calls.append(("transpose", tuple(t8.shape), t8.dtype, multiple))
        return transpose(t8, multiple)

    monkeypatch.setattr(kernels, "fp8_quantize_cuda", record_quantize)
    monkeypatch.setattr(kernels, "fp8_transpose_cuda", record_transpose)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 32, 16), (37, 64, 48), (1000, 1024, 4096)])
@pytest.mark.parametrize("needs", ["x and weight", "x", "weight"])
def test_fp8_linear_is_unchanged_by_the_kernels(engine, kernel_calls, monkeypatch, dtype, m, k,
                                                n, needs):
    """The _scaled_mm path with the quantize kernels and with the reference quantization gives
    the same outputs and gradients, bit for bit (the same float8 operands and scales into the
    same GEMMs)."""
    x, w, b, grad_out = _inputs(m, k, n, dtype)
    x.requires_grad_("x" in needs.split())
    w.requires_grad_("weight" in needs)

    def run():
        out = fp8.fp8_linear(x, w, b)
        inputs = [t for t in (x, w, b) if t.requires_grad]
        return (out, *torch.autograd.grad(out, inputs, grad_out))

    ours = run()
    need_x, need_w = x.requires_grad, w.requires_grad
    assert kernel_calls == (
        [("quantize", (m, k), fp8.E4M3, 0), ("quantize", (n, k), fp8.E4M3, 0),
         ("quantize", (m, n), fp8.E5M2, fp8.ALIGN if need_w else 0)]
        + ([("transpose", (n, k), fp8.E4M3, 1)] if need_x else [])
        + ([("transpose", (m, k), fp8.E4M3, fp8.ALIGN)] if need_w else [])), kernel_calls
    kernel_calls.clear()
    monkeypatch.setattr(fp8, "_kernels_take", lambda t, op: False)
    ref = run()
    assert kernel_calls == []
    assert len(engine) == 2 * (1 + need_x + need_w)  # both runs on _scaled_mm
    for a, r in zip(ours, ref):
        assert a.dtype == r.dtype and torch.equal(a, r)


def test_quantize_kernels_no_host_sync_and_cuda_graph_replay(kernels):
    """No synchronising call (sync debug mode "error"); captured once, the replays on new
    contents (NaN, all zero, ties) give the reference's bits."""
    rows, cols = 300, 256
    t = _content("normal", rows, cols, torch.bfloat16, torch.float8_e5m2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernels.fp8_quantize_cuda(t, torch.float8_e5m2, fp8.ALIGN)
        kernels.fp8_transpose_cuda(t.to(torch.float8_e4m3fn), fp8.ALIGN)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernels.fp8_quantize_cuda(t, torch.float8_e5m2, fp8.ALIGN)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = kernels.fp8_quantize_cuda(t, torch.float8_e5m2, fp8.ALIGN)
        static_t = kernels.fp8_transpose_cuda(static[0], fp8.ALIGN)
    for seed, kind in enumerate(("nan", "zero", "ties", "normal")):
        with torch.no_grad():
            t.copy_(_content(kind, rows, cols, torch.bfloat16, torch.float8_e5m2, seed=seed))
        graph.replay()
        ref = _reference_quantization(t, torch.float8_e5m2, fp8.ALIGN)
        _assert_same_quantization(static, ref, kind)
        assert torch.equal(static_t.view(torch.uint8), ref[2].view(torch.uint8)), kind
