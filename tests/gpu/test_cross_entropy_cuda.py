"""GPU tests of the fused label-smoothed cross-entropy (csrc/cross_entropy.cu,
ls_fairseq/ops/_cross_entropy_cuda.py) and of the chunked output projection + CE
(ls_fairseq/ops/fused_output_cross_entropy.py) on the GPU; ``torch.library.opcheck`` of every
op: the csrc ops and the custom ops that carry the autograd (``ls_cross_entropy_rows``,
``fused_output_cross_entropy_fwd``).

Compared with: the op's PyTorch reference, fairseq's ``label_smoothed_nll_loss`` (per token and
summed) and fairseq's ``label_smoothed_cross_entropy`` criterion on the same model output,
forward and backward, fp16/bf16/fp32 logits, vocabularies from 2 to 40003 (odd and even), rows
that start at any address (misaligned views), padding rows, -inf logits, more than 2^31 logits.

Tolerance (one rule): the truth is fairseq's formula in float64 on the same logits; the CUDA
result must be within ``2 * e_ref + eps * max|truth|`` of it, where ``e_ref`` is the error of
fairseq's own path (log_softmax in fp32, gradient rounded to the logits dtype) and ``eps`` one
rounding unit of the result's dtype (fp32 1e-5 for fp32 results, fp16 2e-3, bf16 1.6e-2) to
absorb another summation order. Dropping the smoothing term, a wrong row, a missed tail element
or a wrong padding mask is off by O(max|truth|) and fails.
"""
import pytest
import torch
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

from ls_fairseq.ops import _extension
from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy_reference

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
EPS = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}
SHAPES = [(1, 2), (3, 5), (37, 127), (256, 1000), (64, 32000), (33, 40003), (300, 32768),
          (17, 40000)]
PAD = 1


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert _extension.load(), f"CUDA extension failed to build: {_extension.failure_reason()}"
    assert _extension.has_op("ls_cross_entropy_fwd") and _extension.has_op("ls_cross_entropy_bwd")


def _cuda():
    from ls_fairseq.ops import _cross_entropy_cuda

    return _cross_entropy_cuda


def _check(name, got, truth, base, dtype):
    """|got - truth| <= 2 |base - truth| + eps * max|truth| (see module docstring)."""
    got, truth, base = got.double(), truth.double(), base.double()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    e_ref = (base - truth).abs().max().item()
    err = (got - truth).abs().max().item()
    bound = 2 * e_ref + EPS[dtype] * truth.abs().max().item() + 1e-12
    assert err <= bound, f"{name}: error {err:.3e} > bound {bound:.3e} (fairseq path {e_ref:.3e})"


def _inputs(n, v, dtype, seed, pad_frac=0.25, scale=3.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = (torch.randn(n, v, generator=g, device=DEV) * scale).to(dtype)
    target = torch.randint(0, v, (n,), generator=g, device=DEV)
    if v > PAD:
        target[torch.rand(n, generator=g, device=DEV) < pad_frac] = PAD
    return logits, target


def _fairseq(logits, target, eps, wl=1.0, wn=0.0, truth=False, reduce=True):
    """fairseq's path (log_softmax in fp32, or fp64 for the truth): loss, nll, grad."""
    x = logits.detach().double() if truth else logits.detach().clone()
    x.requires_grad_()
    lprobs = torch.log_softmax(x.double() if truth else x.float(), dim=-1)
    loss, nll = label_smoothed_nll_loss(lprobs, target, eps, ignore_index=PAD, reduce=reduce)
    if reduce:
        (wl * loss + wn * nll).backward()
    return loss.detach(), nll.detach(), (x.grad if reduce else None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,v", SHAPES)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_forward_backward_vs_fairseq(n, v, dtype, eps):
    logits, target = _inputs(n, v, dtype, seed=n * 7 + v)
    wl, wn = 2.5, 0.7  # upstream gradients of loss and nll (nll is usually unused: check both)
    x = logits.clone().requires_grad_()
    loss_rows, nll_rows, argmax = _cuda().label_smoothed_cross_entropy_rows_cuda(
        x, target, eps, PAD, compute_argmax=True)
    loss, nll = loss_rows.sum(), nll_rows.sum()
    (wl * loss + wn * nll).backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == dtype

    t_loss, t_nll, t_grad = _fairseq(logits, target, eps, wl, wn, truth=True)
    b_loss, b_nll, b_grad = _fairseq(logits, target, eps, wl, wn)
    _check("loss", loss, t_loss, b_loss, torch.float32)
    _check("nll", nll, t_nll, b_nll, torch.float32)
    _check("grad", x.grad, t_grad, b_grad.to(dtype), dtype)

    # per token: fairseq's reduce=False rows (padding rows exactly zero)
    t_rows, t_nrows, _ = _fairseq(logits, target, eps, truth=True, reduce=False)
    b_rows, b_nrows, _ = _fairseq(logits, target, eps, reduce=False)
    _check("loss rows", loss_rows, t_rows.view(-1), b_rows.view(-1), torch.float32)
    _check("nll rows", nll_rows, t_nrows.view(-1), b_nrows.view(-1), torch.float32)
    pad = target.eq(PAD)
    assert (loss_rows[pad] == 0).all() and (nll_rows[pad] == 0).all()
    assert (x.grad[pad] == 0).all()
    assert torch.equal(argmax[~pad], logits.argmax(-1)[~pad])  # first maximum, as torch
    assert (argmax[pad] == -1).all()

    # the public op (sums) and its reference
    ref = label_smoothed_cross_entropy_reference(logits, target, eps, PAD)
    got = _cuda().label_smoothed_cross_entropy_cuda(logits, target, eps, PAD)
    _check("op loss", got[0], t_loss, ref[0], torch.float32)
    _check("op nll", got[1], t_nll, ref[1], torch.float32)


def _peaked(n, v, dtype, seed):
    """Logits shaped like a trained decoder's: a confident target (up to +10), end-of-sentence
    slightly likely everywhere, 8% end-of-sentence and 12% padding targets."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(n, v, generator=g, device=DEV) * 2.0 - 2.0
    target = torch.randint(4, v, (n,), generator=g, device=DEV)
    target[torch.rand(n, generator=g, device=DEV) < 0.08] = 2
    target[torch.rand(n, generator=g, device=DEV) < 0.12] = PAD
    x[torch.arange(n, device=DEV), target] += torch.rand(n, generator=g, device=DEV) * 10
    x[:, 2] += 1.0
    return x.to(dtype), target


def _aggregate_errors(g, g64, gfs, target, smoothing, feats):
    """What the elementwise check cannot see, for gradient ``g`` against float64 truth ``g64``,
    each bounded by fairseq's own error (``gfs``, 2x) or by a fraction of the smoothing term:
    {name: (error, bound)}."""
    n = g.shape[0]
    keep = target.ne(PAD)
    off_target = torch.ones_like(g, dtype=torch.bool)
    off_target[torch.arange(n, device=DEV), target] = False
    off_target &= keep[:, None]
    bias = lambda x: (x - g64)[off_target].mean().abs().item()  # noqa: E731
    rows = lambda x: (x.sum(1) - g64.sum(1))[keep].abs().max().item()  # noqa: E731
    cols = lambda x: (x[:, :4].sum(0) - g64[:, :4].sum(0)).abs().max().item()  # noqa: E731
    w64 = g64.t() @ feats
    emb = lambda x: ((x.t() @ feats - w64).norm() / w64.norm()).item()  # noqa: E731
    return {"mean signed error": (bias(g), max(2 * bias(gfs), 0.02 * smoothing)),
            "row sums": (rows(g), 2 * rows(gfs) + 1e-6),
            "special columns": (cols(g), 2 * cols(gfs) + 1e-3 * smoothing * n),
            "embedding gradient": (emb(g), 2 * emb(gfs) + 1e-7)}


def _bias_case(dtype, v, n=2048, scale=128.0, eps=0.1):
    logits, target = _peaked(n, v, dtype, seed=v)
    _, _, g64 = _fairseq(logits, target, eps, wl=scale, truth=True)
    _, _, gfs = _fairseq(logits, target, eps, wl=scale)
    feats = torch.randn(n, 512, device=DEV, dtype=torch.float64)
    return logits, target, g64, gfs.to(dtype).double(), scale * eps / (v - 1), feats


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("v", [27280, 32000, 40003])
def test_gradient_has_no_bias_where_the_elementwise_check_is_blind(dtype, v):
    """The smoothing part of each gradient element is tiny (loss scale x eps / (V - 1), ~4e-4 at
    fairseq's initial scale 128), far under the elementwise tolerance above, yet summed over V
    columns and every token it moves whole rows of the output embedding. So, at real vocabulary
    sizes and fp16/bf16: the mean signed error of the non-target elements (under 2% of the
    smoothing term, or 2x fairseq's), each row's gradient sum (zero in exact arithmetic), the
    column sums of the special symbols (bos, pad, eos, unk) and the gradient of the output
    embedding (grad^T @ features) must be as close to float64 truth as fairseq's own path is."""
    logits, target, g64, gfs, smoothing, feats = _bias_case(dtype, v)
    x = logits.clone().requires_grad_()
    (_cuda().label_smoothed_cross_entropy_rows_cuda(x, target, 0.1, PAD)[0].sum() * 128.0
     ).backward()
    errors = _aggregate_errors(x.grad.double(), g64, gfs, target, smoothing, feats)
    assert all(err <= bound for err, bound in errors.values()), errors


@pytest.mark.parametrize("mutant", ["smoothing 5% high", "smoothing missing in half the vectors"])
def test_the_aggregate_checks_catch_plausible_kernel_bugs(mutant):
    """The checks above can fail: gradients with a plausible kernel bug (eps / (V - 1) off by 5%;
    the smoothing term missing from every other 16-byte vector of a row), rounded to fp16 as a
    kernel would write them, are rejected."""
    dtype, v = torch.float16, 32000
    logits, target, g64, gfs, smoothing, feats = _bias_case(dtype, v)
    keep = target.ne(PAD)[:, None]
    bad = g64.clone()
    if mutant == "smoothing 5% high":
        bad -= 0.05 * smoothing * keep
        bad[torch.arange(len(target), device=DEV), target] += 0.05 * smoothing * v * keep[:, 0]
    else:
        cols = (torch.arange(v, device=DEV) // 8) % 2 == 1
        bad += smoothing * cols * keep
    errors = _aggregate_errors(bad.to(dtype).double(), g64, gfs, target, smoothing, feats)
    assert any(err > bound for err, bound in errors.values()), errors


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [1, 3, 5])
@pytest.mark.parametrize("v", [7, 1001, 32001, 32000])
def test_misaligned_rows_and_inplace(dtype, offset, v):
    """Logits starting at an address that is not 16-byte aligned (a view with a storage offset):
    the row loop's scalar head / vector body / scalar tail, forward, out-of-place backward (input
    and output alignments differ: element path) and in-place backward. Guard elements around the
    view must not change (no write out of bounds)."""
    n = 29
    logits, target = _inputs(n, v, dtype, seed=v + offset)
    guard = 7.0
    buf = torch.full((n * v + offset + 8,), guard, dtype=dtype, device=DEV)
    view = buf[offset:offset + n * v].view(n, v)
    view.copy_(logits)
    ops = torch.ops.ls_fairseq
    loss_rows, nll_rows, lse, _ = ops.ls_cross_entropy_fwd(view, target, 0.1, PAD, False)
    g = torch.full((1,), 2.0, device=DEV)
    grad_out = ops.ls_cross_entropy_bwd(g, None, view, target, lse, 0.1, PAD)
    ops.ls_cross_entropy_bwd_(g, None, view, target, lse, 0.1, PAD)
    assert (buf[:offset] == guard).all() and (buf[offset + n * v:] == guard).all()
    t_loss, _, t_grad = _fairseq(logits, target, 0.1, wl=2.0, truth=True)
    b_loss, _, b_grad = _fairseq(logits, target, 0.1, wl=2.0)
    _check("loss", loss_rows.sum(), t_loss, b_loss, torch.float32)
    _check("grad", grad_out, t_grad, b_grad.to(dtype), dtype)
    assert torch.equal(view, grad_out)  # same kernel math either way


def test_inplace_backward_overwrites_logits_and_bumps_version():
    n, v = 64, 1000
    logits, target = _inputs(n, v, torch.float16, seed=1)
    w = torch.nn.Parameter(torch.ones(v, device=DEV, dtype=torch.float16))
    x = logits * w  # non-leaf logits
    version = x._version
    rows = _cuda().label_smoothed_cross_entropy_rows_cuda(x, target, 0.1, PAD,
                                                          inplace_backward=True)
    rows[0].sum().backward()
    assert x._version > version
    _, _, b_grad = _fairseq(logits, target, 0.1)
    # x now holds d loss / d x; d loss / d w = sum_rows(grad * logits)
    _check("grad", x.detach(), _fairseq(logits, target, 0.1, truth=True)[2], b_grad.half(),
           torch.float16)

    # a leaf is never overwritten (its .grad would alias its data)
    leaf = logits.clone().requires_grad_()
    before = leaf.detach().clone()
    _cuda().label_smoothed_cross_entropy_rows_cuda(leaf, target, 0.1, PAD,
                                                   inplace_backward=True)[0].sum().backward()
    assert torch.equal(leaf.detach(), before)
    assert leaf.grad.data_ptr() != leaf.data_ptr()


def test_inplace_backward_fails_loudly_if_logits_are_needed_elsewhere():
    n, v = 16, 300
    logits, target = _inputs(n, v, torch.float32, seed=2)
    w = torch.nn.Parameter(torch.ones((), device=DEV))
    x = logits * w
    other = (x * x).sum()  # saves x for its backward; created before the CE node
    rows = _cuda().label_smoothed_cross_entropy_rows_cuda(x, target, 0.1, PAD,
                                                          inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (rows[0].sum() + other).backward()


def test_inplace_backward_saves_memory():
    n, v = 4096, 32000
    logits, target = _inputs(n, v, torch.float16, seed=3)
    peaks = []
    for inplace in (False, True):
        w = torch.ones((), device=DEV, dtype=torch.float16, requires_grad=True)
        x = logits * w
        rows = _cuda().label_smoothed_cross_entropy_rows_cuda(x, target, 0.1, PAD,
                                                              inplace_backward=inplace)
        loss = rows[0].sum()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - start)
        del x, rows, loss, w
    logits_bytes = n * v * 2
    assert peaks[0] >= logits_bytes  # out of place: a new [N, V] fp16 gradient
    assert peaks[1] <= peaks[0] - logits_bytes // 2  # in place: none


def test_special_values_and_empty():
    v = 50
    # -inf logits (masked vocabulary entries) and eps=0: finite nll and gradient like fairseq
    logits, target = _inputs(8, v, torch.float32, seed=4, pad_frac=0.0)
    logits[:, 10:20] = float("-inf")
    target = target.clamp(20, v - 1)
    x = logits.clone().requires_grad_()
    loss, nll = _cuda().label_smoothed_cross_entropy_cuda(x, target, 0.0, PAD)
    nll.backward()
    t_loss, t_nll, _ = _fairseq(logits, target, 0.0, wl=0.0, wn=1.0, truth=True)
    _, b_nll, b_grad = _fairseq(logits, target, 0.0, wl=0.0, wn=1.0)
    _check("nll", nll, t_nll, b_nll, torch.float32)
    assert torch.isfinite(x.grad).all()
    _check("grad", x.grad, b_grad.double(), b_grad, torch.float32)
    # every row ignored -> zeros; N == 0 -> zeros
    logits, _ = _inputs(5, v, torch.float16, seed=5)
    x = logits.clone().requires_grad_()
    loss, nll = _cuda().label_smoothed_cross_entropy_cuda(
        x, torch.full((5,), PAD, device=DEV), 0.1, PAD)
    loss.backward()
    assert loss.item() == 0 and nll.item() == 0 and (x.grad == 0).all()
    empty = torch.empty(0, v, device=DEV, requires_grad=True)
    loss, nll = _cuda().label_smoothed_cross_entropy_cuda(
        empty, torch.empty(0, dtype=torch.long, device=DEV), 0.1, PAD)
    loss.backward()
    assert loss.item() == 0 and empty.grad.shape == (0, v)
    # ignore_index=None (fairseq allows it): every row counts
    logits, target = _inputs(9, v, torch.float32, seed=6)
    loss, nll = _cuda().label_smoothed_cross_entropy_cuda(logits, target, 0.1, None)
    lprobs = torch.log_softmax(logits.double(), -1)
    t_loss, t_nll = label_smoothed_nll_loss(lprobs, target, 0.1, ignore_index=None)
    assert abs(loss.item() - t_loss.item()) <= 1e-5 * abs(t_loss.item())
    # a target outside [0, V) that is not ignore_index: NaN (visible), no crash
    bad = target.clone()
    bad[3] = v + 7
    loss, _ = _cuda().label_smoothed_cross_entropy_cuda(logits, bad, 0.1, PAD)
    assert torch.isnan(loss)


def test_more_than_2_to_31_logits():
    """int64 indexing: rows beyond element 2^31 are read and written where they are."""
    v = 40503
    n = (2**31) // v + 64
    need = n * v * 2 + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip("not enough GPU memory")
    logits = torch.empty(n, v, dtype=torch.float16, device=DEV).normal_(0, 3)
    target = torch.randint(0, v, (n,), device=DEV)
    rows_to_check = torch.tensor([0, 1, n // 2, n - 65, n - 2, n - 1], device=DEV)
    sub = logits[rows_to_check].clone()
    w = torch.ones((), device=DEV, dtype=torch.float16, requires_grad=True)
    x = logits * w
    del logits
    loss_rows, nll_rows, argmax = _cuda().label_smoothed_cross_entropy_rows_cuda(
        x, target, 0.1, PAD, compute_argmax=True, inplace_backward=True)
    loss_rows.sum().backward()
    t = target[rows_to_check]
    for i in range(len(rows_to_check)):
        t_loss, _, t_grad = _fairseq(sub[i:i + 1], t[i:i + 1], 0.1, truth=True)
        b_loss, _, b_grad = _fairseq(sub[i:i + 1], t[i:i + 1], 0.1)
        _check("row loss", loss_rows[rows_to_check[i]], t_loss, b_loss, torch.float32)
        _check("row grad", x.detach()[rows_to_check[i]], t_grad[0], b_grad[0].half(),
               torch.float16)
    del x


def test_opcheck():
    _cuda()  # the binding registers the ops' fakes
    logits, target = _inputs(11, 37, torch.float16, seed=8)
    ops = torch.ops.ls_fairseq
    utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(ops.ls_cross_entropy_fwd, (logits, target, 0.1, PAD, True),
                          test_utils=utils)
    _, _, lse, _ = ops.ls_cross_entropy_fwd(logits, target, 0.1, PAD, False)
    g = torch.ones(1, device=DEV)
    torch.library.opcheck(ops.ls_cross_entropy_bwd, (g, None, logits, target, lse, 0.1, PAD),
                          test_utils=utils)
    torch.library.opcheck(ops.ls_cross_entropy_bwd_,
                          (g, None, logits.clone(), target, lse, 0.1, PAD), test_utils=utils)


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_rows_op(dtype):
    """The custom op that carries the autograd (``ls_cross_entropy_rows``): schema, autograd
    registration, fake, AOT autograd (over the kernels), with and without argmax, padding or
    ``ignore_index=None``, the in-place flag on or off (opcheck's inputs are leaves, so its
    backward runs out of place: the leaf rule)."""
    rows = _cuda().ls_cross_entropy_rows
    logits, target = _inputs(11, 37, dtype, seed=9)
    for argmax, inplace, ignore in ((True, False, PAD), (False, True, PAD),
                                    (True, True, _cuda()._NO_IGNORE)):
        torch.library.opcheck(rows, (logits.clone().requires_grad_(), target, 0.1, ignore,
                                     argmax, inplace))
        torch.library.opcheck(rows, (logits, target, 0.1, ignore, argmax, inplace))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True)])
def test_opcheck_fused_output_op(dtype, grads):
    """``fused_output_cross_entropy_fwd`` over the CE kernels: schema, autograd registration,
    fake, AOT autograd; chunks that do not divide the tokens, accuracy on."""
    from ls_fairseq.ops.fused_output_cross_entropy import fused_output_cross_entropy_fwd

    g = torch.Generator(device=DEV).manual_seed(10)
    hidden = torch.randn(13, 16, generator=g, device=DEV).to(dtype)
    weight = (torch.randn(37, 16, generator=g, device=DEV) / 4).to(dtype)
    target = torch.randint(0, 37, (13,), generator=g, device=DEV)
    target[::4] = PAD
    torch.library.opcheck(
        fused_output_cross_entropy_fwd,
        (hidden.requires_grad_(grads[0]), weight.requires_grad_(grads[1]), target, 0.1, PAD, 5,
         True, *grads))


# ---- fused output projection + CE on the GPU -------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,d,v,chunk", [(300, 64, 1001, 64), (513, 128, 8000, None),
                                         (64, 32, 37, 1)])
def test_fused_output_ce_vs_fairseq(dtype, n, d, v, chunk):
    from ls_fairseq.ops.fused_output_cross_entropy import fused_output_cross_entropy

    g = torch.Generator(device=DEV).manual_seed(n + v)
    hidden = torch.randn(n, d, generator=g, device=DEV)
    weight = torch.randn(v, d, generator=g, device=DEV) / d**0.5
    target = torch.randint(0, v, (n,), generator=g, device=DEV)
    target[torch.rand(n, generator=g, device=DEV) < 0.2] = PAD

    def unfused(h, w, hp):  # fairseq's path: logits in `hp` precision, log_softmax in fp32/64
        h = h.to(hp).requires_grad_()
        w = w.to(hp).requires_grad_()
        logits = h @ w.t()
        lp = torch.log_softmax(logits.double() if hp == torch.float64 else logits.float(), -1)
        loss, nll = label_smoothed_nll_loss(lp, target, 0.1, ignore_index=PAD)
        (3.0 * loss).backward()
        return loss.detach(), h.grad, w.grad, logits.detach()

    t_loss, t_gh, t_gw, t_logits = unfused(hidden, weight, torch.float64)
    b_loss, b_gh, b_gw, b_logits = unfused(hidden, weight, dtype)
    h = hidden.to(dtype).requires_grad_()
    w = weight.to(dtype).requires_grad_()
    loss, nll, n_correct = fused_output_cross_entropy(h, w, target, 0.1, PAD, chunk_size=chunk,
                                                      compute_accuracy=True)
    (3.0 * loss).backward()
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    _check("loss", loss, t_loss, b_loss, torch.float32)
    _check("grad hidden", h.grad, t_gh, b_gh, dtype)
    _check("grad weight", w.grad, t_gw, b_gw, dtype)
    mask = target.ne(PAD)
    expected = (b_logits.argmax(-1).eq(target) & mask).sum().item()
    assert abs(n_correct.item() - expected) <= max(1, n // 100)  # chunked GEMM rounding ties


def test_fused_output_ce_memory():
    """Peak memory of forward+backward: chunked << unfused (fp16, 8k tokens x 32k vocab)."""
    from ls_fairseq.ops.fused_output_cross_entropy import fused_output_cross_entropy

    n, d, v = 8192, 512, 32000
    hidden = torch.randn(n, d, device=DEV, dtype=torch.float16)
    weight = (torch.randn(v, d, device=DEV) / d**0.5).half()
    target = torch.randint(0, v, (n,), device=DEV)
    peaks = {}
    for name in ("unfused", "fused"):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        if name == "unfused":
            lp = torch.log_softmax((h @ w.t()).float(), -1)
            loss, _ = label_smoothed_nll_loss(lp, target, 0.1, ignore_index=PAD)
            del lp
        else:
            loss, _, _ = fused_output_cross_entropy(h, w, target, 0.1, PAD, chunk_size=1024)
        loss.backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - start
        del h, w, loss
    assert peaks["fused"] < peaks["unfused"] / 4, peaks


# ---- the criterion on the GPU vs fairseq's criterion -----------------------------------------

class _StubDecoder(torch.nn.Module):
    def __init__(self, emb):
        super().__init__()
        self.output_projection = torch.nn.Linear(emb.weight.size(1), emb.weight.size(0),
                                                 bias=False)
        self.output_projection.weight = emb.weight  # shared, as with --share-*-embeddings


class _StubModel(torch.nn.Module):
    """Embedding -> tanh(linear) -> shared output projection; fairseq's model interface."""

    def __init__(self, v, d):
        super().__init__()
        self.emb = torch.nn.Embedding(v, d)
        self.mid = torch.nn.Linear(d, d)
        self.decoder = _StubDecoder(self.emb)

    def forward(self, src_tokens, features_only=False):
        x = torch.tanh(self.mid(self.emb(src_tokens)))
        if features_only:
            return x, {"attn": None}
        return self.decoder.output_projection(x), {"attn": None}

    def get_targets(self, sample, net_output):
        return sample["target"]

    def get_normalized_probs(self, net_output, log_probs, sample=None):
        from fairseq import utils

        return utils.log_softmax(net_output[0], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fused_output", [False, True])
@pytest.mark.parametrize("ignore_prefix_size", [0, 1])
def test_criterion_vs_fairseq_criterion(dtype, fused_output, ignore_prefix_size):
    """The criterion's own (eager) forward and backward: CUDA graphs, on by default for an
    ls_transformer, are turned off (``ls_no_cuda_graphs``; they would step aside for this stub
    model anyway, which is not known to be capturable)."""
    from fairseq.criterions.label_smoothed_cross_entropy import (
        LabelSmoothedCrossEntropyCriterion,
    )

    from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (
        LSLabelSmoothedCrossEntropyCriterion,
    )

    class Task:
        class D:
            def pad(self):
                return PAD
        target_dictionary = D()

    v, d, bsz, tlen = 5003, 64, 12, 33
    torch.manual_seed(0)
    model = _StubModel(v, d).to(DEV, dtype)
    tokens = torch.randint(2, v, (bsz, tlen), device=DEV)
    target = torch.randint(2, v, (bsz, tlen), device=DEV)
    target[:, -5:] = PAD
    sample = {"net_input": {"src_tokens": tokens}, "target": target,
              "ntokens": int(target.ne(PAD).sum())}
    kwargs = dict(sentence_avg=False, label_smoothing=0.1, ignore_prefix_size=ignore_prefix_size,
                  report_accuracy=True)
    ref = LabelSmoothedCrossEntropyCriterion(Task(), **kwargs)
    ls = LSLabelSmoothedCrossEntropyCriterion(Task(), **kwargs, ls_fused_output_ce=fused_output,
                                              ls_fused_output_ce_chunk=100,
                                              ls_no_cuda_graphs=True)

    def run(crit, model_dtype):
        m = model if model_dtype == dtype else _copy_as(model, model_dtype)
        m.zero_grad()
        loss, size, log = crit(m, sample)
        (loss * 4.0).backward()
        return loss.detach(), log, {k: p.grad.clone() for k, p in m.named_parameters()}

    t_loss, t_log, t_grads = run(ref, torch.float64)
    b_loss, b_log, b_grads = run(ref, dtype)
    loss, log, grads = run(ls, dtype)
    _check("loss", loss, t_loss, b_loss, torch.float32)
    _check("nll", log["nll_loss"], t_log["nll_loss"], b_log["nll_loss"], torch.float32)
    for key in ("ntokens", "nsentences", "sample_size", "total"):
        assert log[key] == b_log[key], key
    if fused_output:  # logits from chunked GEMMs: rounding may flip an argmax tie
        assert abs(log["n_correct"] - b_log["n_correct"]) <= 2
    else:
        assert log["n_correct"] == b_log["n_correct"]
    for key in grads:
        _check(f"grad {key}", grads[key], t_grads[key], b_grads[key], dtype)


def _copy_as(model, dtype):
    import copy

    return copy.deepcopy(model).to(dtype)
