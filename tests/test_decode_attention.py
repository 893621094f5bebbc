"""``ops.decode_attention_reference`` (ls_fairseq/ops/decode_attention.py), the specification of the
decode-attention kernel, on the CPU; plus the public dispatch on CPU tensors and the binding's
``supports`` (ls_fairseq/ops/_decode_attention_cuda.py), which needs no GPU.

One decoding query per row ``r`` attends over keys/values ``k[rows[r, t], h, t]`` of a cache
``k, v`` [N, H, T, D]: the self-attention cache (N = R, any row table) or cross-attention
keys/values stored once per sentence (N = sentences, ``rows = r // beam`` as an expanded view).

Oracles, each independent of the reference's own gather (``gather_rows``) and of each other:

1. ``_loop_oracle``: an explicit float64 loop (numpy) over rows and heads that gathers
   ``k[rows[r, t], h, t]`` one position at a time, skips the masked positions, takes a softmax
   and gives zeros to rows with every key masked. For float16/bfloat16 inputs it rounds where the
   reference (fairseq's math) rounds: the scaled query, the scores, the probabilities and the
   output, to the input dtype.
2. ``torch.nn.functional.scaled_dot_product_attention`` in float64 with a boolean mask over keys
   gathered by a Python loop (fully masked rows: zeros, the reference's definition).
3. ``ops.attention_reference`` on keys/values gathered by a Python loop, in the same layout as the
   reference's gather: the same math on the same tensors, so bit for bit.

Tolerances (``|got - want| <= tol * (1 + |want|)``; inputs are randn, so scores q.k / sqrt(D)
are O(1) and outputs are convex combinations of O(1) values). Observed maxima over CASES are in
brackets; each tolerance is a bound argued from the arithmetic, not fitted to them:

* float64: 1e-12 [9e-16]. Both sides do O(T * D) float64 operations (unit roundoff 1.1e-16);
  even the worst-case bound T * D * 1.1e-16 * |score| stays below 1e-12 for T = 64, D = 64.
* float32 against the float64 oracles: 1e-5 [5e-7]. The reference rounds each score after a
  D-term float32 dot product, whose rounding errors (6e-8 relative each) add up like a random
  walk: ~sqrt(D) * 6e-8 * sum_i |q_i k_i| / sqrt(D) ~ 2e-6 for D = 64 with randn inputs (the
  worst case, D instead of sqrt(D), is not reached by random data); an error e in the scores
  moves the probabilities by ~e relative, and the float32 softmax and product add ~1e-7.
* float16 / bfloat16 against the rounding-emulating loop: 2e-3 / 1.6e-2 [4e-4 / 0], four units
  of the dtype's rounding (2^-11, 2^-8 relative; the GPU tests' ``eps``). Both compute the same
  rounded quantities; they may differ where the reference's float32-accumulated score or float32
  softmax falls on the other side of a rounding boundary than the float64 value does (the
  emulation rounds once, from float64), which moves a probability by one unit and the output by
  about one unit of its magnitude.
* float16 / bfloat16 against the unrounded SDPA oracle: 4e-3 / 3.2e-2 [1e-3 / 8e-3], eight
  units: the query, each score, each probability and the output carry one rounding each, and a
  score's rounding (|s| * 2^-11 or 2^-8, |s| up to ~4) moves its probability by that much
  relative.

These half-precision comparisons pin the indexing, masking and scaling, not every rounding point
(keeping the probabilities in float32 would move the output by less than a unit); oracle 3 is
what ties the rounding points to ``attention_reference``'s (fairseq's).
"""
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ls_fairseq import ops
from ls_fairseq.ops import _decode_attention_cuda as binding
from ls_fairseq.ops import _extension
from ls_fairseq.ops.decode_attention import (decode_attention, decode_attention_reference,
                                             gather_rows)

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
TOL_LOOP = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
TOL_SDPA = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}

# (R, beam, H, T, D): beam None = self-attention cache (N = R, a random row table);
# beam b = cross attention (N = ceil(R / b) sentences, rows = r // b, an expanded view)
CASES = [
    (1, None, 1, 1, 8),
    (1, None, 16, 64, 64),
    (7, None, 3, 5, 32),
    (13, None, 16, 17, 8),
    (13, None, 1, 64, 64),
    (7, 7, 3, 17, 64),   # one sentence of 7 hypotheses
    (13, 5, 16, 5, 32),  # 3 sentences, the last one short (13 = 5 + 5 + 3)
    (12, 4, 1, 64, 8),
    (1, 1, 3, 1, 32),
]
LAYOUTS = ["dense", "cache", "projection"]


def _case_id(case):
    r, beam, h, t, d = case
    return f"R{r}-{'self' if beam is None else f'beam{beam}'}-H{h}-T{t}-D{d}"


def _problem(case, dtype, layout, masked, seed, rows_dtype=torch.int64):
    """q [R, H, D], k, v [N, H, T, D] in ``layout``, rows [R, T], key_padding_mask [R, T] or None.

    * "dense": contiguous k/v;
    * "cache": k/v views of a self-attention cache buffer [L, 2, N, H, C, D] (layer 1 of 2,
      capacity C = T + 3): non-contiguous in n (and t stride D, h stride C * D);
    * "projection": k/v views of a cross-attention projection [N, S, 2L, H, D] (layer 1 of 2:
      slots 2 and 3) transposed to [N, H, S, D]; q a view of a [R, H, 3, D] buffer.
    """
    r_n, beam, h, t, d = case
    g = torch.Generator().manual_seed(seed)
    n = r_n if beam is None else -(-r_n // beam)
    # buffers converted before they are viewed (.to would make a non-dense view contiguous)
    if layout == "dense":
        k = torch.randn(n, h, t, d, generator=g).to(dtype)
        v = torch.randn(n, h, t, d, generator=g).to(dtype)
        q = torch.randn(r_n, h, d, generator=g).to(dtype)
    elif layout == "cache":
        buf = torch.randn(2, 2, n, h, t + 3, d, generator=g).to(dtype)
        k, v = buf[1, 0, :, :, :t], buf[1, 1, :, :, :t]
        q = torch.randn(r_n, h, d, generator=g).to(dtype)
    else:
        buf = torch.randn(n, t, 4, h, d, generator=g).to(dtype)
        k, v = buf[:, :, 2].transpose(1, 2), buf[:, :, 3].transpose(1, 2)
        q = torch.randn(r_n, h, 3, d, generator=g).to(dtype)[:, :, 1]
    if beam is None:
        if seed % 3 == 0:  # identity table as an expanded (stride 0) view: the unreordered cache
            rows = torch.arange(r_n, dtype=rows_dtype)[:, None].expand(r_n, t)
        else:  # a reordered cache: every position may sit in any row
            rows = torch.randint(0, n, (r_n, t), generator=g).to(rows_dtype)
    else:
        rows = (torch.arange(r_n) // beam).to(rows_dtype)[:, None].expand(r_n, t)
    mask = None
    if masked:
        m = torch.rand(t, r_n, generator=g) < 0.3
        m[:, 0] = False  # row 0: every key attended
        if r_n > 1:
            m[:, 1] = True  # row 1: every key masked -> zeros
        if r_n > 2:
            m[:, 2] = True
            m[0, 2] = False  # row 2: only position 0
        mask = m.t()  # a non-contiguous [R, T] view
    return q, k, v, rows, mask


def _round(a, dtype):
    if dtype in (torch.float16, torch.bfloat16):
        return torch.from_numpy(a).to(dtype).double().numpy()
    return a


def _loop_oracle(q, k, v, rows, mask):
    """float64 out [R, H, D], one row, head and position at a time (see the module docstring)."""
    dtype = q.dtype
    r_n, h_n, d = q.shape
    t_n = k.size(2)
    qn, kn, vn = (x.double().numpy() for x in (q, k, v))
    table = rows.tolist()
    hidden = mask.tolist() if mask is not None else [[False] * t_n for _ in range(r_n)]
    scale = d ** -0.5
    out = np.zeros((r_n, h_n, d))
    for r in range(r_n):
        seen = [t for t in range(t_n) if not hidden[r][t]]
        if not seen:
            continue  # every key masked: attends nowhere, zeros
        for h in range(h_n):
            qs = _round(qn[r, h] * scale, dtype)
            keys = np.stack([kn[table[r][t], h, t] for t in seen])
            values = np.stack([vn[table[r][t], h, t] for t in seen])
            scores = _round(keys @ qs, dtype)
            e = np.exp(scores - scores.max())
            p = _round(e / e.sum(), dtype)
            out[r, h] = _round(p @ values, dtype)
    return torch.from_numpy(out)


def _gather_loop(x, rows):
    """x [N, H, T, D] -> [R, H, T, D], ``out[r, :, t] = x[rows[r, t], :, t]``, by a Python loop
    (stacked as [R, T, H, D] and permuted: the layout of ``gather_rows``' result)."""
    table = rows.tolist()
    per_row = [torch.stack([x[table[r][t], :, t] for t in range(x.size(2))]) for r in range(len(table))]
    return torch.stack(per_row).permute(0, 2, 1, 3)


def _sdpa_oracle(q, k, v, rows, mask):
    """float64 out [R, H, D] by PyTorch's SDPA over loop-gathered keys/values; zeros for rows
    with every key masked."""
    k64, v64 = _gather_loop(k.double(), rows), _gather_loop(v.double(), rows)
    attend = None if mask is None else ~mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.double()[:, :, None], k64, v64, attn_mask=attend)[:, :, 0]
    if mask is not None:
        out = out.masked_fill(mask.all(1)[:, None, None], 0.0)
    return out


def _assert_close(got, want, tol, what):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    got = got.double()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = (got - want).abs()
    bad = err > tol * (1 + want.abs())
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} off, max err "
                           f"{err.max().item():.3g} (tol {tol:g})")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reference_matches_oracles(case, dtype, masked, layout):
    index = CASES.index(case) * 7 + LAYOUTS.index(layout) * 2 + masked
    rows_dtype = torch.int32 if index % 2 else torch.int64
    q, k, v, rows, mask = _problem(case, dtype, layout, masked, seed=index, rows_dtype=rows_dtype)
    if layout != "dense":
        dense_strides = torch.empty(k.shape).stride()
        assert k.stride() != dense_strides and v.stride() != dense_strides
    out = decode_attention_reference(q, k, v, rows, mask)
    assert out.shape == q.shape and out.dtype == dtype
    what = f"{_case_id(case)} {dtype} {layout} mask={masked} rows {rows.dtype}"

    _assert_close(out, _loop_oracle(q, k, v, rows, mask), TOL_LOOP[dtype], what + " vs loop")
    _assert_close(out, _sdpa_oracle(q, k, v, rows, mask), TOL_SDPA[dtype], what + " vs SDPA")

    # the same math as attention_reference on the gathered keys/values: bit for bit
    same, _ = ops.attention_reference(q[:, :, None], _gather_loop(k, rows), _gather_loop(v, rows),
                                      mask)
    assert torch.equal(out, same[:, :, 0]), what

    if mask is not None:
        fully = mask.all(1)
        assert torch.equal(out[fully], torch.zeros_like(out[fully]))  # exactly zero, never NaN
        assert fully.any() == (q.size(0) > 1)

    # the public entry on CPU tensors is the reference, exactly
    assert torch.equal(decode_attention(q, k, v, rows, mask), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_rows_dtype_and_views_do_not_matter(dtype):
    """int32 vs int64 rows, an expanded table vs its dense copy, strided vs contiguous k/v and
    q: the same result (fp32 bit for bit only where the tensors are the same; contiguous copies
    may take another matmul path, so those compare with the float32 tolerance)."""
    case = (13, 5, 3, 17, 32)
    q, k, v, rows, mask = _problem(case, dtype, "projection", True, seed=11)
    assert rows.stride() == (1, 0)
    out = decode_attention_reference(q, k, v, rows, mask)
    assert torch.equal(decode_attention_reference(q, k, v, rows.int(), mask), out)
    assert torch.equal(decode_attention_reference(q, k, v, rows.contiguous(), mask), out)
    assert torch.equal(decode_attention_reference(q, k, v, rows, mask.contiguous()), out)
    dense = decode_attention_reference(q.contiguous(), k.contiguous(), v.contiguous(), rows, mask)
    _assert_close(dense, out.double(), TOL_LOOP[dtype], "contiguous copies")


def test_gather_rows_matches_a_loop():
    for case, layout in ((CASES[3], "cache"), (CASES[6], "projection"), (CASES[0], "dense")):
        _, k, _, rows, _ = _problem(case, torch.float32, layout, False, seed=4)
        for table in (rows, rows.int()):
            got = gather_rows(k, table)
            assert got.shape == (rows.size(0), k.size(1), k.size(2), k.size(3))
            assert torch.equal(got, _gather_loop(k, rows))


def test_only_the_pointed_rows_are_read():
    """NaN in every cache slot the table does not point to (other rows at a position, other
    positions of the cross keys/values' sentences) leaves the output finite and unchanged."""
    q, k, v, rows, mask = _problem((7, None, 3, 5, 32), torch.float32, "dense", True, seed=1)
    out = decode_attention_reference(q, k, v, rows, mask)
    used = torch.zeros(k.size(0), k.size(2), dtype=torch.bool)
    used[rows.long(), torch.arange(k.size(2))[None, :].expand_as(rows)] = True
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k.permute(0, 2, 1, 3)[~used] = float("nan")
    poisoned_v.permute(0, 2, 1, 3)[~used] = float("nan")
    assert torch.isnan(poisoned_k).any()
    assert torch.equal(decode_attention_reference(q, poisoned_k, poisoned_v, rows, mask), out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_rows_are_zero(dtype):
    for r_n, t in ((1, 1), (1, 9), (4, 3)):
        q = torch.randn(r_n, 2, 8).to(dtype)
        k, v = torch.randn(2, 2, t, 8).to(dtype), torch.randn(2, 2, t, 8).to(dtype)
        rows = torch.randint(0, 2, (r_n, t))
        out = decode_attention_reference(q, k, v, rows, torch.ones(r_n, t, dtype=torch.bool))
        assert torch.equal(out, torch.zeros_like(q))
        # one key seen: its value, exactly where the probability 1 is exact
        only = torch.ones(r_n, t, dtype=torch.bool)
        only[:, -1] = False
        out = decode_attention_reference(q, k, v, rows, only)
        want = v[rows[:, -1], :, -1]
        assert torch.equal(out, want)


def test_single_position_without_mask_is_its_value():
    q, k, v, rows, _ = _problem((13, 5, 16, 1, 32), torch.float32, "projection", False, seed=2)
    assert torch.equal(decode_attention_reference(q, k, v, rows), v[rows[:, 0].long(), :, 0])


def test_bad_inputs_raise_value_errors():
    q = torch.randn(3, 2, 8)
    k = torch.randn(2, 2, 5, 8)
    rows = torch.zeros(3, 5, dtype=torch.long)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    shapes = r"q \[R, H, D\] and k, v \[N, H, T, D\]"
    bad = [
        ((q[0], k, k, rows, None), shapes),
        ((q, k[0], k[0], rows, None), shapes),
        ((q, k, k[:, :, :4], rows, None), shapes),  # v's shape differs from k's
        ((q, k[:, :1], k[:, :1], rows, None), r"k/v \(2, 1, 5, 8\) do not have q's 2 heads of 8"),
        ((q, k[..., :4], k[..., :4], rows, None), r"k/v .* do not have q's 2 heads of 8"),
        ((q, k, k, rows[:, :4], None), r"rows \[R, T\] = \(3, 5\)"),
        ((q, k, k, rows[:2], None), r"rows \[R, T\] = \(3, 5\)"),
        ((q, k, k, rows.float(), None), r"rows .* int32 or int64, got \(3, 5\) torch.float32"),
        ((q, k, k, rows.short(), None), r"rows .* torch.int16"),
        ((q, k, k, rows, mask[:, :4]), r"key_padding_mask \[R, T\] = \(3, 5\) bool, got \(3, 4\)"),
        ((q, k, k, rows, mask.to(torch.uint8)), r"key_padding_mask .* torch.uint8"),
        ((q, k, k, rows, mask[0]), r"key_padding_mask"),
    ]
    for args, message in bad:
        for fn in (decode_attention_reference, decode_attention):
            with pytest.raises(ValueError, match=message):
                fn(*args)


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_dispatch_on_cpu_is_the_reference_without_building(monkeypatch, mode):
    monkeypatch.setenv(_extension.ENV_VAR, mode)
    built = []
    monkeypatch.setattr(_extension, "_build", lambda: built.append(1))
    q, k, v, rows, mask = _problem((7, None, 3, 5, 32), torch.float16, "cache", True, seed=5)
    assert binding.supports(q.contiguous(), k.contiguous(), v.contiguous(), rows, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for args in ((q, k, v, rows, mask), (q.contiguous(), k.contiguous(), v.contiguous(), rows,
                                             mask), (q.float(), k.float(), v.float(), rows, None)):
            assert torch.equal(ops.decode_attention(*args), decode_attention_reference(*args))
    assert built == []


# ------------------------------------------------------------------------------ supports()
def _well_formed(dtype=torch.float16, d=32, t=7, r=5, h=3, n=2):
    return (torch.randn(r, h, d).to(dtype), torch.randn(n, h, t, d).to(dtype),
            torch.randn(n, h, t, d).to(dtype), torch.randint(0, n, (r, t)),
            torch.rand(r, t) < 0.3)


def test_supports_true_cases():
    """fp16/bf16, head sizes 32/64/128, up to MAX_KEYS positions, int64 rows (any strides,
    expanded too), with or without a mask, k/v as views of the decoding buffers."""
    for dtype in (torch.float16, torch.bfloat16):
        for d in binding.HEAD_DIMS:
            q, k, v, rows, mask = _well_formed(dtype, d)
            assert binding.supports(q, k, v, rows, mask), (dtype, d)
            assert binding.supports(q, k, v, rows, None) and binding.supports(q, k, v, rows)
            assert binding.supports(q, k, v, rows[:, :1].expand(5, 7), mask.t().contiguous().t())
    for layout in ("cache", "projection"):
        for case in ((7, None, 3, 5, 32), (13, 5, 16, 17, 64), (12, 4, 1, 64, 128)):
            q, k, v, rows, mask = _problem(case, torch.float16, layout, True, seed=3)
            assert binding.supports(q, k, v, rows, mask), (layout, case)
    q, k, v, rows, mask = _well_formed(t=binding.MAX_KEYS, r=1, h=1, n=1, d=32)
    assert binding.supports(q, k, v, rows, mask)


def test_supports_false_cases():
    q, k, v, rows, mask = _well_formed()
    assert binding.supports(q, k, v, rows, mask)
    f32 = [x.float() for x in (q, k, v)]
    assert not binding.supports(*f32, rows, mask)  # float32: the reference runs
    assert not binding.supports(*(x.double() for x in (q, k, v)), rows, mask)
    assert not binding.supports(q, k.bfloat16(), v, rows, mask)  # mixed dtypes
    assert not binding.supports(q, k, v.bfloat16(), rows, mask)
    assert not binding.supports(*_well_formed(d=48)[:4], None)  # head size 48
    assert not binding.supports(*_well_formed(d=16)[:4], None)
    assert not binding.supports(*_well_formed(d=256)[:4], None)
    big = _well_formed(t=binding.MAX_KEYS + 1, r=1, h=1, n=1)
    assert not binding.supports(*big)  # T > MAX_KEYS
    assert not binding.supports(q, k, v, rows.int(), mask)  # int32 rows
    # a last dim that is not contiguous
    qt = torch.randn(5, 3, 64, dtype=torch.float16)[..., ::2]
    assert qt.shape == q.shape and qt.stride(-1) == 2
    assert not binding.supports(qt, k, v, rows, mask)
    kt = torch.randn(2, 3, 32, 7, dtype=torch.float16).transpose(2, 3)
    assert kt.shape == k.shape and kt.stride(-1) == 7
    assert not binding.supports(q, kt, v, rows, mask)
    assert not binding.supports(q, k, kt, rows, mask)
    # strides that are not multiples of 8 elements (16 bytes)
    k36 = torch.randn(2, 3, 7, 36, dtype=torch.float16)[..., :32]
    assert not binding.supports(q, k36, v, rows, mask)
    q36 = torch.randn(5, 3, 36, dtype=torch.float16)[..., :32]
    assert not binding.supports(q36, k, v, rows, mask)
    # data not 16-byte aligned (an offset of one element)
    flat = torch.randn(1 + k.numel(), dtype=torch.float16)
    k_off = flat[1:].view(k.shape)
    assert k_off.data_ptr() % 16 != 0
    assert not binding.supports(q, k, k_off, rows, mask)
    assert not binding.supports(q, k_off, v, rows, mask)
    q_off = torch.randn(1 + q.numel(), dtype=torch.float16)[1:].view(q.shape)
    assert not binding.supports(q_off, k, v, rows, mask)
    # wrong ranks
    assert not binding.supports(q[:, None], k, v, rows, mask)
    assert not binding.supports(q, k[0], v[0], rows, mask)
    assert not binding.supports(q, k, v[:, :, :3], rows, mask)
    # devices that differ (meta stands in for another device: no data is read)
    meta = torch.empty(rows.shape, dtype=rows.dtype, device="meta")
    assert not binding.supports(q, k, v, meta, mask)
    assert not binding.supports(q, k, v, rows, mask.to("meta"))
    assert not binding.supports(q, k.to("meta"), v, rows, mask)
