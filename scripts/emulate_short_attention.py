"""Lane-level CPU emulation of csrc/short_attention.cu, for editing the kernel without a GPU.

It runs the kernel's two kernels line by line in numpy, one warp at a time: ldmatrix (plain and
.trans) and mma.sync m16n8k16 are emulated from the PTX fragment layouts, every shared-memory
region is a separate array (an index past a region raises instead of reading its neighbour),
outputs start as NaN (an element never written fails), and the dS^T rows are poisoned before
phase 2 reads them. The results are compared with a float64 attention under the same Philox
dropout mask (ls_fairseq/testing/kernel_oracle.py), forward and backward, over odd lengths, cross
and causal shapes, padding, empty rows and head sizes 16/32/64.

What it checks: the kernel's index math (which lane holds which element, the dropout bit layout,
the dS^T transposition, masking, log2-unit softmax and lse). What it cannot check: the CUDA code
itself (this is a transliteration, kept in step by hand) or the hardware; the GPU tests
(tests/gpu/test_short_attention_cuda.py) do that. Exits 1 when an error exceeds 1e-2 relative to
the output's scale (fp16 rounding gives ~1e-3; a wrong index gives O(1)).

    python scripts/emulate_short_attention.py      # ~10 s
"""
import math
import sys

import numpy as np
import torch

from ls_fairseq.testing.kernel_oracle import philox4x32_10, philox_keep

T = np.arange(32)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def r16(x):
    return (x + 15) // 16 * 16


def f16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def ldsm(smem, addr, trans):
    out = np.zeros((32, 4, 2), np.float32)
    for m in range(4):
        if not trans:
            src = addr[8 * m + T // 4]
            out[:, m, 0] = smem[src + 2 * (T % 4)]
            out[:, m, 1] = smem[src + 2 * (T % 4) + 1]
        else:
            out[:, m, 0] = smem[addr[8 * m + 2 * (T % 4)] + T // 4]
            out[:, m, 1] = smem[addr[8 * m + 2 * (T % 4) + 1] + T // 4]
    return out


def load_a(smem, p, ld):
    m, r = T // 8, T % 8
    return ldsm(smem, p + (r + 8 * (m % 2)) * ld + 8 * (m // 2), False)


def load_a_trans(smem, p, ld):
    m, r = T // 8, T % 8
    return ldsm(smem, p + (r + 8 * (m // 2)) * ld + 8 * (m % 2), True)


def load_b_nk(smem, p, ld):
    m, r = T // 8, T % 8
    return ldsm(smem, p + (r + 8 * (m // 2)) * ld + 8 * (m % 2), False)


def load_b_kn(smem, p, ld):
    m, r = T // 8, T % 8
    return ldsm(smem, p + (r + 8 * (m % 2)) * ld + 8 * (m // 2), True)


def mma(c, a, b0, b1):
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    r, q = T // 4, 2 * (T % 4)
    for x in range(2):
        A[r, q + x] = a[:, 0, x]
        A[r + 8, q + x] = a[:, 1, x]
        A[r, q + 8 + x] = a[:, 2, x]
        A[r + 8, q + 8 + x] = a[:, 3, x]
        B[q + x, r] = b0[:, x]
        B[q + 8 + x, r] = b1[:, x]
    C = A @ B
    c[:, 0] += C[r, q]
    c[:, 1] += C[r, q + 1]
    c[:, 2] += C[r + 8, q]
    c[:, 3] += C[r + 8, q + 1]


def pack2(lo, hi):
    return np.stack([f16(lo), f16(hi)], -1)


def load_rows(dst, src, rows, padded, D):
    LD = D + 8
    for r in range(padded):
        dst[r * LD:r * LD + D] = src[r] if r < rows else 0.0


def keep_bits(keep, KT, row0, rows, nthreads, philox_row0, Tq, Tk, seed, offset, thr):
    G = KT // 4
    n = rows * G
    per_row = (Tk + 3) // 4
    for base in range(0, n, nthreads):
        words = {}
        for t in range(nthreads):
            idx = base + t
            i, g = row0 + idx // G, idx % G
            nib = 0
            if idx < n and i < Tq and 4 * g < Tk:
                sub = (philox_row0 + i) * per_row + g
                ctr = offset // 4
                w = philox4x32_10(*[torch.tensor([v], dtype=torch.int64) for v in (
                    ctr & 0xFFFFFFFF, ctr >> 32, sub & 0xFFFFFFFF, sub >> 32, seed & 0xFFFFFFFF,
                    seed >> 32)])
                bits = [int(x.item()) >= thr for x in w]
                nib = sum(int(b) << e for e, b in enumerate(bits))
                if 4 * g + 4 > Tk:
                    nib &= (1 << (Tk - 4 * g)) - 1
            key = t // 8
            words[key] = words.get(key, 0) | (nib << (4 * (t % 8)))
        for t in range(0, nthreads, 8):
            idx = base + t
            if idx < n:
                i, g = row0 + idx // G, idx % G
                keep[i * (KT // 32) + g // 8] = words[t // 8]


def store_tile(acc, mul, stage, stage0, D, dst, row0, rows):
    LD = D + 8
    r, c = T // 4, 2 * (T % 4)
    for n in range(D // 8):
        v = pack2(acc[n][:, 0] * mul, acc[n][:, 1] * mul)
        stage[stage0 + r * LD + 8 * n + c] = v[:, 0]
        stage[stage0 + r * LD + 8 * n + c + 1] = v[:, 1]
        v = pack2(acc[n][:, 2] * mul, acc[n][:, 3] * mul)
        stage[stage0 + (r + 8) * LD + 8 * n + c] = v[:, 0]
        stage[stage0 + (r + 8) * LD + 8 * n + c + 1] = v[:, 1]
    for rr in range(16):
        if row0 + rr < rows:
            dst[row0 + rr] = stage[stage0 + rr * LD:stage0 + rr * LD + D]


def kt_of(Tk):
    return 32 if Tk <= 32 else 64 if Tk <= 64 else 128


def fwd(q, k, v, kpm, causal, drop, bh):
    """One (b, h): q [Tq, D], k/v [Tk, D], kpm [Tk] bool or None. drop = (scale, thr, seed, off)
    or None. Returns out [Tq, D], lse [Tq]."""
    Tq, D = q.shape
    Tk = k.shape[0]
    KT, TQ, TK, LD = kt_of(Tk), r16(Tq), r16(Tk), D + 8
    NT, KW = KT // 8, KT // 32
    sQ, sK, sV = np.zeros(TQ * LD, np.float32), np.zeros(TK * LD, np.float32), np.zeros(TK * LD, np.float32)
    sKeep = np.zeros(TQ * KW, np.int64)
    load_rows(sQ, q, Tq, TQ, D)
    load_rows(sK, k, Tk, TK, D)
    load_rows(sV, v, Tk, TK, D)
    out = np.full((Tq, D), np.nan, np.float32)
    lse = np.full(Tq, np.nan)
    scale = 1 / math.sqrt(D)
    dscale = drop[0] if drop else 1.0
    for warp in range(TQ // 16):
        vis = []
        for w in range(KW):
            j = 32 * w + T
            ok = (j < Tk) & ~(kpm[np.minimum(j, Tk - 1)] if kpm is not None else False)
            vis.append(sum(int(o) << e for e, o in enumerate(ok)))
        r0 = 16 * warp
        if drop:
            keep_bits(sKeep, KT, r0, 16, 32, bh * Tq, Tq, Tk, drop[2], drop[3], drop[1])
        shift = Tk - Tq
        last = min(Tk - 1, r0 + 15 + shift) if causal else Tk - 1
        qa = [load_a(sQ, r0 * LD + 16 * ks, LD) for ks in range(D // 16)]
        s = [np.zeros((32, 4)) for _ in range(NT)]
        for n in range(0, NT, 2):
            if 8 * n > last:
                continue
            for ks in range(D // 16):
                kb = load_b_nk(sK, 8 * n * LD + 16 * ks, LD)
                mma(s[n], qa[ks], kb[:, 0], kb[:, 1])
                mma(s[n + 1], qa[ks], kb[:, 2], kb[:, 3])
        ra, c0 = r0 + T // 4, 2 * (T % 4)
        scale2 = scale * LOG2E
        mx = [np.full(32, -np.inf), np.full(32, -np.inf)]
        for n in range(NT):
            for e in range(4):
                i, j = ra + 8 * (e // 2), 8 * n + c0 + (e % 2)
                ok = np.array([(vis[jj // 32] >> (jj % 32)) & 1 for jj in j]).astype(bool) & ~(causal & (j > i + shift))
                s[n][:, e] = np.where(ok, s[n][:, e] * scale2, -np.inf)
                mx[e // 2] = np.maximum(mx[e // 2], s[n][:, e])
        for hb in range(2):
            m = mx[hb]
            m = np.maximum(m, m[T ^ 1])
            m = np.maximum(m, m[T ^ 2])
            mx[hb] = m
        sm = [np.zeros(32), np.zeros(32)]
        for n in range(NT):
            for e in range(4):
                m = mx[e // 2]
                with np.errstate(invalid="ignore"):
                    s[n][:, e] = np.where(m == -np.inf, 0.0, np.exp2(s[n][:, e] - m))
                sm[e // 2] = sm[e // 2] + s[n][:, e]
        mul = [None, None]
        for hb in range(2):
            x = sm[hb]
            x = x + x[T ^ 1]
            x = x + x[T ^ 2]
            sm[hb] = x
            empty = mx[hb] == -np.inf
            with np.errstate(divide="ignore"):
                mul[hb] = np.where(empty, 0.0, dscale / sm[hb])
                val = np.where(empty, np.inf, (mx[hb] + np.log2(np.maximum(sm[hb], 1e-300))) * LN2)
            i = ra + 8 * hb
            for lane in range(0, 32, 4):
                if i[lane] < Tq:
                    lse[i[lane]] = val[lane]
        kw = None
        if drop:
            kw = [[sKeep[(ra + 8 * hb) * KW + w] for w in range(KW)] for hb in range(2)]
        o = [np.zeros((32, 4)) for _ in range(D // 8)]
        for kk in range(KT // 16):
            if 16 * kk > last:
                continue
            z = [np.zeros((32, 4)), np.zeros((32, 4))]
            for t in range(2):
                for e in range(4):
                    j = 16 * kk + 8 * t + c0 + (e % 2)
                    if drop:
                        kept = np.array([(kw[e // 2][j[lane] // 32][lane] >> (j[lane] % 32)) & 1
                                         for lane in range(32)]).astype(bool)
                    else:
                        kept = np.ones(32, bool)
                    z[t][:, e] = np.where(kept, s[2 * kk + t][:, e] * mul[e // 2], 0.0)
            za = np.stack([pack2(z[0][:, 0], z[0][:, 1]), pack2(z[0][:, 2], z[0][:, 3]),
                           pack2(z[1][:, 0], z[1][:, 1]), pack2(z[1][:, 2], z[1][:, 3])], 1)
            for n in range(0, D // 8, 2):
                vb = load_b_kn(sV, 16 * kk * LD + 8 * n, LD)
                mma(o[n], za, vb[:, 0], vb[:, 1])
                mma(o[n + 1], za, vb[:, 2], vb[:, 3])
        store_tile(o, 1.0, sQ, r0 * LD, D, out, r0, Tq)
    return out, lse


def bwd(dout, q, k, v, o, lse, kpm, causal, drop, bh):
    Tq, D = q.shape
    Tk = k.shape[0]
    KT, TQ, TK, LD = kt_of(Tk), r16(Tq), r16(Tk), D + 8
    KW, LDS = KT // 32, TQ + 8
    sQ, sdO = np.zeros(TQ * LD, np.float32), np.zeros(TQ * LD, np.float32)
    sK, sV = np.zeros(TK * LD, np.float32), np.zeros(TK * LD, np.float32)
    shared = np.zeros(max(TQ * LD, TK * LDS), np.float32)
    sKeep = np.zeros(TQ * KW, np.int64)
    load_rows(sQ, q, Tq, TQ, D)
    load_rows(sdO, dout, Tq, TQ, D)
    load_rows(sK, k, Tk, TK, D)
    load_rows(sV, v, Tk, TK, D)
    load_rows(shared, o, Tq, TQ, D)
    sLse = np.array([lse[i] * LOG2E if i < Tq else np.inf for i in range(TQ)])
    nthreads = (TK // 16) * 32
    if drop:
        keep_bits(sKeep, KT, 0, TQ, nthreads, bh * Tq, Tq, Tk, drop[2], drop[3], drop[1])
    sDi = np.zeros(TQ)
    for i in range(TQ):
        sDi[i] = float(np.dot(sdO[i * LD:i * LD + D].astype(np.float64), shared[i * LD:i * LD + D]))
    shared[:] = np.nan  # dS^T overwrites O: every read below must have been written
    sdST = shared
    dq = np.full((Tq, D), np.nan, np.float32)
    dk = np.full((Tk, D), np.nan, np.float32)
    dv = np.full((Tk, D), np.nan, np.float32)
    scale = 1 / math.sqrt(D)
    dscale = drop[0] if drop else 1.0
    shift = Tk - Tq
    scale2 = scale * LOG2E
    c0 = 2 * (T % 4)
    for warp in range(TK // 16):
        j0 = 16 * warp
        key_ok = []
        for hb in range(2):
            j = j0 + T // 4 + 8 * hb
            key_ok.append((j < Tk) & ~(kpm[np.minimum(j, Tk - 1)] if kpm is not None else False))
        dva = [np.zeros((32, 4)) for _ in range(D // 8)]
        dka = [np.zeros((32, 4)) for _ in range(D // 8)]
        for i0 in range(0, TQ, 16):
            if causal and j0 > i0 + 15 + shift:
                for t in range(2):
                    for hb in range(2):
                        base = (j0 + T // 4 + 8 * hb) * LDS + i0 + 8 * t + c0
                        sdST[base] = 0.0
                        sdST[base + 1] = 0.0
                continue
            st = [np.zeros((32, 4)), np.zeros((32, 4))]
            dzt = [np.zeros((32, 4)), np.zeros((32, 4))]
            for ks in range(D // 16):
                ka = load_a(sK, j0 * LD + 16 * ks, LD)
                qb = load_b_nk(sQ, i0 * LD + 16 * ks, LD)
                mma(st[0], ka, qb[:, 0], qb[:, 1])
                mma(st[1], ka, qb[:, 2], qb[:, 3])
                va = load_a(sV, j0 * LD + 16 * ks, LD)
                ob = load_b_nk(sdO, i0 * LD + 16 * ks, LD)
                mma(dzt[0], va, ob[:, 0], ob[:, 1])
                mma(dzt[1], va, ob[:, 2], ob[:, 3])
            z = [np.zeros((32, 4)), np.zeros((32, 4))]
            ds = [np.zeros((32, 4)), np.zeros((32, 4))]
            for t in range(2):
                for e in range(4):
                    i = i0 + 8 * t + c0 + (e % 2)
                    j = j0 + T // 4 + 8 * (e // 2)
                    ok = key_ok[e // 2] & ~(causal & (j > i + shift))
                    with np.errstate(invalid="ignore", over="ignore"):
                        p = np.where(ok, np.exp2(st[t][:, e] * scale2 - sLse[i]), 0.0)
                    if drop:
                        kept = np.array([(sKeep[i[l] * KW + j[l] // 32] >> (j[l] % 32)) & 1 for l in range(32)]).astype(bool)
                    else:
                        kept = np.ones(32, bool)
                    z[t][:, e] = np.where(kept, p * dscale, 0.0)
                    dp = np.where(kept, dzt[t][:, e] * dscale, 0.0)
                    ds[t][:, e] = f16(p) * (dp - sDi[i])
            za = np.stack([pack2(z[0][:, 0], z[0][:, 1]), pack2(z[0][:, 2], z[0][:, 3]),
                           pack2(z[1][:, 0], z[1][:, 1]), pack2(z[1][:, 2], z[1][:, 3])], 1)
            dsa = np.stack([pack2(ds[0][:, 0], ds[0][:, 1]), pack2(ds[0][:, 2], ds[0][:, 3]),
                            pack2(ds[1][:, 0], ds[1][:, 1]), pack2(ds[1][:, 2], ds[1][:, 3])], 1)
            for t in range(2):
                for hb in range(2):
                    base = (j0 + T // 4 + 8 * hb) * LDS + i0 + 8 * t + c0
                    sdST[base] = dsa[:, 2 * t + hb, 0]
                    sdST[base + 1] = dsa[:, 2 * t + hb, 1]
            for n in range(0, D // 8, 2):
                ob = load_b_kn(sdO, i0 * LD + 8 * n, LD)
                mma(dva[n], za, ob[:, 0], ob[:, 1])
                mma(dva[n + 1], za, ob[:, 2], ob[:, 3])
                qb = load_b_kn(sQ, i0 * LD + 8 * n, LD)
                mma(dka[n], dsa, qb[:, 0], qb[:, 1])
                mma(dka[n + 1], dsa, qb[:, 2], qb[:, 3])
        store_tile(dva, 1.0, sV, j0 * LD, D, dv, j0, Tk)
        store_tile(dka, scale, sV, j0 * LD, D, dk, j0, Tk)
    nwarps = TK // 16
    for warp in range(nwarps):
        for m0 in range(16 * warp, TQ, 16 * nwarps):
            acc = [np.zeros((32, 4)) for _ in range(D // 8)]
            for kk in range(KT // 16):
                if 16 * kk >= Tk:
                    continue
                a = load_a_trans(sdST, 16 * kk * LDS + m0, LDS)
                assert not np.isnan(a).any(), "phase 2 read an unwritten dS^T element"
                for n in range(0, D // 8, 2):
                    kb = load_b_kn(sK, 16 * kk * LD + 8 * n, LD)
                    mma(acc[n], a, kb[:, 0], kb[:, 1])
                    mma(acc[n + 1], a, kb[:, 2], kb[:, 3])
            store_tile(acc, scale, sQ, m0 * LD, D, dq, m0, Tq)
    return dq, dk, dv


def reference(q, k, v, kpm, causal, keep, p, dout):
    """float64 attention with the given keep mask; returns out, dq, dk, dv."""
    q, k, v = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    Tq, Tk = q.shape[0], k.shape[0]
    s = q @ k.T / math.sqrt(q.shape[1])
    hidden = torch.zeros(Tq, Tk, dtype=torch.bool)
    if kpm is not None:
        hidden |= torch.tensor(kpm)[None, :]
    if causal:
        hidden |= torch.arange(Tk)[None, :] > torch.arange(Tq)[:, None] + (Tk - Tq)
    s = s.masked_fill(hidden, -1e30)
    pr = torch.softmax(s, -1) * (~hidden.all(-1, keepdim=True))
    if keep is not None:
        pr = pr * torch.tensor(keep) / (1 - p)
    out = pr @ v
    out.backward(torch.tensor(dout, dtype=torch.float64))
    return out.detach().numpy(), q.grad.numpy(), k.grad.numpy(), v.grad.numpy()


def keep_mask(bh, Tq, Tk, seed, offset, p):
    """The rows of (b, h) = bh of the kernels' keep mask (kernel_oracle's rebuild), and the
    threshold the kernel compares with."""
    keep = philox_keep(torch.tensor([seed, offset]), (bh + 1) * Tq, Tk, p, device="cpu")[bh * Tq:]
    return keep.numpy(), min(math.floor(p * 2**32), 2**32 - 1)


def case(Tq, Tk, D, causal, p, pad, seed):
    rng = np.random.default_rng(seed)
    q, k, v, dout = (f16(rng.standard_normal(s)) for s in ((Tq, D), (Tk, D), (Tk, D), (Tq, D)))
    kpm = None
    if pad:
        n = int(rng.integers(1, Tk + 1)) if pad == "random" else 0
        kpm = np.arange(Tk) >= n
    bh = int(rng.integers(0, 50))
    drop = None
    keep = None
    if p > 0:
        pseed, poff = int(rng.integers(0, 2**40)), int(rng.integers(0, 2**20)) * 4
        keep, thr = keep_mask(bh, Tq, Tk, pseed, poff, p)
        drop = (1.0 / (1.0 - p), thr, pseed, poff)
    out, lse = fwd(q, k, v, kpm, causal, drop, bh)
    o16 = f16(out)
    dq, dk, dv = bwd(dout, q, k, v, o16, lse, kpm, causal, drop, bh)
    ro, rdq, rdk, rdv = reference(q, k, v, kpm, causal, keep, p, dout)
    errs = {}
    for name, a, b in (("out", out, ro), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert np.isfinite(a).all(), (name, "non-finite / unwritten")
        errs[name] = np.abs(a - b).max() / max(np.abs(b).max(), 1.0)
    return errs


if __name__ == "__main__":
    cases = [
        (5, 5, 16, False, 0.0, None), (17, 17, 64, True, 0.0, "random"), (30, 30, 64, False, 0.1, "random"),
        (33, 20, 32, False, 0.2, "random"), (20, 40, 64, True, 0.1, "random"), (40, 17, 16, True, 0.1, None),
        (64, 64, 64, True, 0.1, "random"), (1, 9, 64, False, 0.0, "random"), (47, 90, 32, False, 0.3, "random"),
        (100, 100, 16, True, 0.1, "random"), (12, 12, 64, False, 0.1, "empty"), (128, 128, 32, False, 0.1, "random"),
    ]
    worst = 0
    for i, (tq, tk, d, causal, p, pad) in enumerate(cases):
        e = case(tq, tk, d, causal, p, pad, seed=i)
        worst = max(worst, max(e.values()))
        print(f"Tq={tq} Tk={tk} D={d} causal={causal} p={p} pad={pad}: " +
              " ".join(f"{k}={v:.2e}" for k, v in e.items()), flush=True)
    print(f"worst relative error {worst:.2e} (limit 1e-2)")
    sys.exit(0 if worst <= 1e-2 else 1)
