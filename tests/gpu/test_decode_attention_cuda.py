"""GPU tests of the decode-attention kernel (csrc/decode_attention.cu, op
``torch.ops.ls_fairseq.decode_attention``, binding ls_fairseq/ops/_decode_attention_cuda.py):
one decoding query per row over keys/values ``k[rows[r, t], h, t]`` (ls_fairseq/ops/
decode_attention.py). The reference itself is checked against independent oracles on the CPU
(tests/test_decode_attention.py).

Inputs are laid out as decoding lays them out:

* "self": a self-attention cache, k/v views of a buffer [L, 2, R, H, C, D] (C > T: unused
  capacity), N = R, a random row table (a beam search that reordered its hypotheses);
* "cross": cross-attention keys/values stored once per sentence, k/v views of a projection
  [N, S, 2L, H, D] transposed to [N, H, S, D], ``rows = r // beam`` as an expanded view;

q a view of a packed projection [R, 3, H, D]; masks random (~25% of the keys) with row 0 fully
attended, row 1 fully masked (its output must be exactly zero) and row 2 seeing position 0 only
(its output must be exactly that value: probability 1 and one nonzero term).

Tolerance (as tests/gpu/test_attention_cuda.py, ``kernel_oracle.within_reference``):
``|kernel - truth| <= 2 |reference - truth| + eps * max(max|truth|, 1)``, where ``truth`` is
the float64 math and ``reference`` is ``decode_attention_reference`` run on the GPU in the same
dtype, eps one unit of the dtype's rounding (fp16 2e-3, bf16 1.6e-2). The kernel rounds at the
same points as the reference (the scaled query, each score and each probability rounded to the
dtype, softmax statistics and the products accumulated in fp32, the output rounded once); only
the summation order differs (its own dot products and a split over position groups vs cuBLAS'
order), so it must be about as close to the truth as the reference is: a factor 2, plus one unit
where both are nearly exact. A wrong row, position, head, scale or mask is O(1) and fails.
"""
import pytest
import torch

from kernel_oracle import within_reference
from ls_fairseq.ops.attention import attention_reference
from ls_fairseq.ops.decode_attention import (decode_attention, decode_attention_reference,
                                             gather_rows)

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = [torch.float16, torch.bfloat16]
EPS = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
HEAD_DIMS = [32, 64, 128]
LENGTHS = [1, 7, 16, 64, 201, 1025]
ROWS = [1, 5, 640]
HEADS = [1, 16]
#: largest R * H * T * D of the grid (the float64 truth and the reference's gathered copies stay
#: small); the full decoding grid at T = 1025 is test_large_grid's
BUDGET = 2 ** 27
GRID = [(r, h, t, d) for r in ROWS for h in HEADS for t in LENGTHS for d in HEAD_DIMS
        if r * h * t * d <= BUDGET]


@pytest.fixture(scope="module", autouse=True)
def _kernels(extension):
    assert extension.has_op("decode_attention"), "decode_attention op not registered"


def _binding():
    from ls_fairseq.ops import _decode_attention_cuda

    return _decode_attention_cuda


def _kernel(*args):
    return _binding().decode_attention_cuda(*args)


def _mask(r_n, t, gen):
    mask = torch.rand(r_n, t, generator=gen, device=DEV) < 0.25
    mask[0] = False  # every key attended
    if r_n > 1:
        mask[1] = True  # no key: zeros
    if r_n > 2:
        mask[2] = True
        mask[2, 0] = False  # position 0 only
    return mask


def _problem(r_n, h, t, d, dtype, layout, seed, capacity_extra=3):
    """q [R, H, D], k, v [N, H, T, D], rows [R, T] int64, key_padding_mask [R, T] (see the module
    docstring)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEV, dtype=dtype)

    q = randn(r_n, 3, h, d)[:, 0]
    if layout == "self":
        n = r_n
        buf = randn(2, 2, n, h, t + capacity_extra, d)  # layer 1 of 2, unused capacity past t
        k, v = buf[1, 0, :, :, :t], buf[1, 1, :, :, :t]
        rows = torch.randint(0, n, (r_n, t), generator=gen, device=DEV)
    else:
        beam = 5 if r_n % 5 == 0 else 1
        n = r_n // beam
        buf = randn(n, t, 4, h, d)  # [N, S, 2L, H, D]: layer 1's keys and values at 2 and 3
        k, v = buf[:, :, 2].transpose(1, 2), buf[:, :, 3].transpose(1, 2)
        rows = (torch.arange(r_n, device=DEV) // beam)[:, None].expand(r_n, t)
    return q, k, v, rows, _mask(r_n, t, gen)


def _truth(q, k, v, rows, mask):
    """float64 out [R, H, D], in chunks of rows (the gathered float64 keys/values stay small)."""
    out = torch.empty(q.shape, dtype=torch.float64, device=DEV)
    step = max(1, 2 ** 24 // max(1, q.size(1) * k.size(2) * q.size(2)))
    for s in range(0, q.size(0), step):
        part = slice(s, s + step)
        kg = gather_rows(k, rows[part]).double()
        vg = gather_rows(v, rows[part]).double()
        m = None if mask is None else mask[part]
        out[part] = attention_reference(q[part].double()[:, :, None], kg, vg, m)[0][:, :, 0]
    return out


def _check_case(name, q, k, v, rows, mask, dtype):
    assert _binding().supports(q, k, v, rows, mask), name
    out = _kernel(q, k, v, rows, mask)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous(), name
    base = decode_attention_reference(q, k, v, rows, mask)
    within_reference(name, out, _truth(q, k, v, rows, mask), base, EPS[dtype])
    # the public entry takes the kernel here
    assert torch.equal(decode_attention(q, k, v, rows, mask), out), name
    return out


@pytest.mark.parametrize("layout", ["self", "cross"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("r_n,h,t,d", GRID, ids=[f"R{r}-H{h}-T{t}-D{d}" for r, h, t, d in GRID])
def test_kernel_matches_float64_and_reference(r_n, h, t, d, dtype, layout):
    q, k, v, rows, mask = _problem(r_n, h, t, d, dtype, layout, seed=r_n * 7 + h * 3 + t + d)
    name = f"{layout} R={r_n} H={h} T={t} D={d} {dtype}"
    out = _check_case(name + " mask", q, k, v, rows, mask, dtype)
    if r_n > 1:
        assert torch.equal(out[1], torch.zeros_like(out[1])), name + ": fully masked row"
    if r_n > 2:
        assert torch.equal(out[2], v[rows[2, 0], :, 0]), name + ": only position 0 seen"
    _check_case(name + " no mask", q, k, v, rows, None, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_grid(dtype):
    """The decoding grid at its largest (640 rows = 128 sentences x beam 5, 16 heads, 1025 source
    positions): every block runs; the truth is checked on a subset of rows (each row's math is
    independent of the others)."""
    q, k, v, rows, mask = _problem(640, 16, 1025, 64, dtype, "cross", seed=3)
    out = _kernel(q, k, v, rows, mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    pick = torch.cat([torch.arange(0, 40), torch.arange(300, 310), torch.arange(620, 640)]).to(DEV)
    sub = (q[pick], k, v, rows[pick], mask[pick])
    within_reference(f"large grid {dtype}", out[pick], _truth(*sub),
                     decode_attention_reference(*sub), EPS[dtype])
    assert torch.equal(_kernel(*sub), out[pick])  # a row's result does not depend on the grid


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reading_through_the_table_equals_moved_keys(dtype):
    """The kernel over a reordered cache (rows a random table) gives bit for bit what it gives over
    the keys/values moved into place (fairseq's reorder) with the identity table: same values,
    same order of operations."""
    for t, d in ((7, 32), (201, 64), (64, 128)):
        q, k, v, rows, mask = _problem(13, 4, t, d, dtype, "self", seed=t)
        moved_k, moved_v = gather_rows(k, rows), gather_rows(v, rows)
        identity = torch.arange(13, device=DEV)[:, None].expand(13, t)
        for m in (mask, None):
            assert torch.equal(_kernel(q, k, v, rows, m), _kernel(q, moved_k, moved_v, identity, m))


@pytest.mark.parametrize("layout", ["self", "cross"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masked_positions_are_never_read(dtype, layout):
    """NaN in every key/value slot that no unmasked position points to (and in the cache's unused
    capacity) does not reach the output: the kernel reads only unmasked positions. The reference
    would propagate it (a masked probability 0 times a NaN value is NaN), so the comparison is
    with the reference run on a copy whose unread slots are zero."""
    for t, d in ((16, 64), (201, 128), (1025, 32)):
        q, k, v, rows, mask = _problem(40, 3, t, d, dtype, layout, seed=t + d)
        n = k.size(0)
        if layout == "cross":  # the source's padding (left, as fairseq's), one mask per sentence
            gen = torch.Generator(device=DEV).manual_seed(t)
            lengths = torch.randint(1, t + 1, (n,), generator=gen, device=DEV)
            lengths[0] = t
            padded = torch.arange(t, device=DEV)[None, :] < (t - lengths)[:, None]
            mask = padded[rows[:, 0]]
        positions = torch.arange(t, device=DEV)[None, :].expand_as(rows)
        read = torch.zeros(n, t, dtype=torch.bool, device=DEV)
        read[rows[~mask], positions[~mask]] = True
        assert (~read).any()
        clean = _kernel(q, k, v, rows, mask)
        if layout == "self":
            buf = k._base if k._base is not None else k
            capacity = buf[..., t:, :]  # [L, 2, N, H, C - T, D]: never part of k/v
            capacity.fill_(float("nan"))
        zeroed_k, zeroed_v = k.clone(), v.clone()
        for x, fill in ((k, float("nan")), (v, float("nan")), (zeroed_k, 0.0), (zeroed_v, 0.0)):
            x.transpose(1, 2)[~read] = fill  # [N, H, T, D] -> [N, T, H, D] to index (n, t)
        assert torch.isnan(k).any() and torch.isnan(v).any()
        out = _kernel(q, k, v, rows, mask)
        assert torch.isfinite(out).all(), f"{layout} T={t}: NaN leaked"
        assert torch.equal(out, clean)
        within_reference(f"{layout} T={t} D={d} poisoned", out,
                         _truth(q, zeroed_k, zeroed_v, rows, mask),
                         decode_attention_reference(q, zeroed_k, zeroed_v, rows, mask), EPS[dtype])


def test_cuda_graph_replay_matches_eager():
    """One capture of a self- and a cross-attention call (through the public entry, as a captured
    decoder step makes them); replays with new queries, keys/values, tables and masks written in
    place give the eager results bit for bit."""
    dtype = torch.float16
    shapes = dict(r_n=40, h=4, t=64, d=64)
    ins = {layout: _problem(**shapes, dtype=dtype, layout=layout, seed=i)
           for i, layout in enumerate(("self", "cross"))}

    def step():
        return [decode_attention(*ins[layout]) for layout in ("self", "cross")]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up outside the graph
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    replayed = []
    for i in range(3):
        for j, layout in enumerate(("self", "cross")):
            fresh = _problem(**shapes, dtype=dtype, layout=layout, seed=100 + 10 * i + j)
            q, k, v, rows, mask = ins[layout]
            q.copy_(fresh[0])
            k.copy_(fresh[1])
            v.copy_(fresh[2])
            if layout == "self":  # the cross table is an expanded view: it stays
                rows.copy_(fresh[3])
            mask.copy_(fresh[4])
            mask[3 + i] = True  # another row fully masked at each replay
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for got, want in zip(outs, eager):
            assert torch.equal(got, want), f"replay {i}"
            assert torch.equal(got[3 + i], torch.zeros_like(got[3 + i]))
        replayed.append([o.clone() for o in outs])
    assert not torch.equal(replayed[0][0], replayed[1][0])


def test_deterministic_and_edge_sizes():
    q, k, v, rows, mask = _problem(5, 2, 33, 64, torch.float16, "self", seed=9)
    assert torch.equal(_kernel(q, k, v, rows, mask), _kernel(q, k, v, rows, mask))
    # no positions: zeros, as the reference; no rows: an empty result
    q0 = q.contiguous()
    k0 = torch.empty(5, 2, 0, 64, device=DEV, dtype=torch.float16)
    r0 = torch.empty(5, 0, dtype=torch.long, device=DEV)
    for m in (None, torch.empty(5, 0, dtype=torch.bool, device=DEV)):
        out = _kernel(q0, k0, k0, r0, m)
        assert torch.equal(out, torch.zeros_like(q0))
        assert torch.equal(out, decode_attention_reference(q0, k0, k0, r0, m))
    out = _kernel(q0[:0], k, v, rows[:0], mask[:0])
    assert out.shape == (0, 2, 64)
    # the most positions the kernel takes (its scores fill the shared memory)
    big = _binding().MAX_KEYS
    q, k, v, rows, mask = _problem(3, 2, big, 32, torch.bfloat16, "cross", seed=4)
    _check_case("MAX_KEYS", q, k, v, rows, mask, torch.bfloat16)


def test_unsupported_inputs_fall_back_to_the_reference():
    """Where ``supports`` is False the public entry runs the reference (same result, bit for
    bit): float32, a head size the kernel is not built for, int32 rows, unaligned or
    non-contiguous data, more than MAX_KEYS positions."""
    b = _binding()
    q, k, v, rows, mask = _problem(7, 3, 17, 64, torch.float16, "self", seed=1)
    assert b.supports(q, k, v, rows, mask)
    flat = torch.empty(1 + v.numel(), device=DEV, dtype=v.dtype)[1:].view(v.shape)
    flat.copy_(v)
    q48, k48, v48, rows48, mask48 = _problem(7, 3, 17, 48, torch.float16, "self", seed=2)
    big = _problem(2, 1, b.MAX_KEYS + 1, 32, torch.float16, "cross", seed=3)
    cases = {
        "float32": (q.float(), k.float(), v.float(), rows, mask),
        "head size 48": (q48, k48, v48, rows48, mask48),
        "int32 rows": (q, k, v, rows.int(), mask),
        "unaligned v": (q, k, flat, rows, mask),
        "strided last dim": (q, k, torch.stack([v, v], -1)[..., 0], rows, mask),
        "T > MAX_KEYS": big,
    }
    for what, args in cases.items():
        assert not b.supports(*args), what
        assert torch.equal(decode_attention(*args), decode_attention_reference(*args)), what


def test_kernel_input_checks():
    """A call outside ``supports`` gets the kernel's own error (never a silent fallback)."""
    q, k, v, rows, mask = _problem(5, 2, 9, 32, torch.float16, "self", seed=5)
    q, k, v, rows, mask = (x.contiguous() for x in (q, k, v, rows, mask))
    unaligned = torch.empty(1 + k.numel(), device=DEV, dtype=k.dtype)[1:].view(k.shape)
    bad = [
        ("float16 or bfloat16", (q.float(), k.float(), v.float(), rows, mask)),
        ("float16 or bfloat16", (q, k.bfloat16(), v, rows, mask)),
        ("head size 48", (q[..., :24].repeat(1, 1, 2), k[..., :24].repeat(1, 1, 1, 2),
                          v[..., :24].repeat(1, 1, 1, 2), rows, mask)),
        ("rows must be int64", (q, k, v, rows.int(), mask)),
        ("rows must be int64", (q, k, v, rows[:, :4], mask)),
        ("key_padding_mask must be bool", (q, k, v, rows, mask.to(torch.uint8))),
        ("key_padding_mask must be bool", (q, k, v, rows, mask[:, :4])),
        ("key_padding_mask must be bool", (q, k, v, rows, mask.cpu())),
        ("do not have q's 2 heads", (q, k[:, :1], v[:, :1], rows, mask)),
        ("one CUDA device", (q, k, v, rows.cpu(), mask)),
        ("16-byte aligned", (q, unaligned, v, rows, mask)),
        ("one shape", (q, k, v[:, :, :3], rows, mask)),
    ]
    for message, args in bad:
        with pytest.raises(RuntimeError, match=message):
            torch.ops.ls_fairseq.decode_attention(*args)
    over = _problem(1, 1, _binding().MAX_KEYS + 1, 32, torch.float16, "cross", seed=6)
    with pytest.raises(RuntimeError, match="key positions"):
        torch.ops.ls_fairseq.decode_attention(*over)


def test_opcheck():
    """Schema, fake (meta) shape, and tracing of the op (inference only: nothing requires grad)."""
    from ls_fairseq import ops

    assert ops.load_kernels()
    op = torch.ops.ls_fairseq.decode_attention.default
    for dtype in DTYPES:
        q, k, v, rows, mask = _problem(5, 2, 9, 32, dtype, "self", seed=7)
        q, k, v, rows, mask = (x.contiguous() for x in (q, k, v, rows, mask))
        torch.library.opcheck(op, (q, k, v, rows, mask))
        torch.library.opcheck(op, (q, k, v, rows, None))
