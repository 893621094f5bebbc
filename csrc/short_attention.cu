// Register-resident fused attention for short rows (the "short" backend of
// ls_fairseq/ops/_attention_cuda.py): one thread block per (batch, head) holds the whole problem
// (Tq, Tk <= 128 rows of D in {16, 32, 64, 128}) in shared memory; scores, probabilities and
// gradients stay in registers (mma.sync m16n8k16 fragments), so the forward and the backward are
// one launch each with one read of every input and one write of every output.
//
// Why: at WMT lengths (~30 tokens) attention is memory- and latency-bound and tiny per (batch,
// head). The general kernels (CUTLASS memory-efficient, FlashAttention) tile for long rows: 64- or
// 128-row tiles that are mostly padding, several launches and atomics in backward, and dropout
// drawn per element. The first version of this file kept the scores in shared memory
// (wmma through fp32 tiles); it was no faster end to end.
//
// Ops (torch.ops.ls_fairseq.*):
//   short_attention_fwd(q, k, v, key_padding_mask?, causal, dropout_p, training)
//       -> (out [B, H, Tq, D] as a view of [B, Tq, H, D] memory, lse [B, H, Tq] fp32, rng_state)
//   short_attention_bwd(grad_out, q, k, v, out, lse, key_padding_mask?, causal, rng_state,
//       dropout_p, grad_q!, grad_k!, grad_v!)    (writes the gradients into the given tensors)
// q [B, H, Tq, D], k/v [B, H, Tk, D]: any strides that are multiples of 8 elements, last dim
// contiguous, 16-byte aligned (the packed projection's views qualify). fp16/bf16, sm_80+.
//
// Math, as ls_fairseq.ops.attention_reference: scores q.k * D^-0.5 in fp32 (tensor cores, fp32
// accumulation), -inf at padded keys and (with `causal`) at keys j > i + Tk - Tq, softmax in fp32,
// a row with no visible key gives zeros. The dropped probabilities Z are rounded to the storage
// dtype before Z.V, as fairseq's bmm path does. lse (natural log-sum-exp of the row, +inf for an
// empty row) is kept for backward, which recomputes P = exp(S - lse) (FlashAttention's scheme).
// Backward: dV = Z^T dO, dZ = dO V^T, dP = dropout'(dZ), D_i = rowsum(dO * O),
// dS = P16 * (dP - D_i) rounded to the storage dtype (P16: P rounded, as fairseq keeps it),
// dQ = scale dS K, dK = scale dS^T Q.
//
// Dropout: element (b, h, i, j) is kept when word (j % 4) of the Philox block at counter
// {offset / 4, row * ceil(Tk / 4) + j / 4}, row = (b * H + h) * Tq + i, is >= floor(p * 2^32): the
// scheme of the elementwise kernels (device_utils.cuh), so the mask depends only on (seed, offset,
// b, h, i, j) and backward regenerates it. Each block draws every Philox block once into a bit
// mask in shared memory, then reads bits in whatever fragment layout it needs.
//
// Work split. Forward: warp w owns queries [16w, 16w + 16): S = Q K^T, softmax, dropout and
// O = Z V in registers. Backward: warp w owns keys [16w, 16w + 16) and walks the queries 16 at a
// time: S^T = K Q^T, dZ^T = V dO^T, dV += Z^T dO, dK += dS^T Q with no reduction across warps; dS^T
// goes to shared memory, and after one barrier the warps compute dQ = dS K, 16 queries each.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>

#include "check.h"
#include "device_utils.cuh"
#include "philox_dropout.cuh"

namespace {

using namespace lsf;

constexpr int kMaxLen = 128;  // longest Tq / Tk; longer rows use the efficient backend
constexpr int kWarp = 32;
constexpr int kVec = 8;  // elements per 16-byte access
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Element strides of a [B, H, T, D] view (last dim contiguous).
struct View {
  int64_t b, h, t;
};

struct Problem {
  int H, Tq, Tk;
  int TQ, TK;  // Tq, Tk rounded up to 16
};

__host__ __device__ constexpr int round16(int x) { return (x + 15) / 16 * 16; }

// Shared memory (bytes). Rows of D + 8 elements (and dS^T rows of TQ + 8): ldmatrix reads 8 rows
// of 16 bytes, which this padding spreads over all 32 banks.
__host__ __device__ inline int64_t fwd_smem_bytes(int TQ, int TK, int D, int KT, bool dropout, int elem) {
  return int64_t(TQ + 2 * TK) * (D + 8) * elem + (dropout ? int64_t(TQ) * (KT / 32) * 4 : 0);
}

struct BwdSmem {
  int64_t q, dout, k, v, shared, lse, di, keep, total;  // byte offsets
};

// `shared` holds O (for D_i) until the dS^T rows overwrite it.
__host__ __device__ inline BwdSmem bwd_smem(int TQ, int TK, int D, int KT, bool dropout, int elem) {
  const int64_t rows_q = int64_t(TQ) * (D + 8) * elem, rows_k = int64_t(TK) * (D + 8) * elem;
  const int64_t ds = int64_t(TK) * (TQ + 8) * elem;
  BwdSmem m;
  m.q = 0;
  m.dout = m.q + rows_q;
  m.k = m.dout + rows_q;
  m.v = m.k + rows_k;
  m.shared = m.v + rows_k;
  m.lse = m.shared + (ds > rows_q ? ds : rows_q);
  m.di = m.lse + int64_t(TQ) * 4;
  m.keep = m.di + int64_t(TQ) * 4;
  m.total = m.keep + (dropout ? int64_t(TQ) * (KT / 32) * 4 : 0);
  return m;
}

// ---------------------------------------------------------------- PTX wrappers
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

// c += a . b for one 16x8x16 tile (fp32 accumulation).
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same<T, __half>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two fp32 values as one register of two storage-dtype elements (lo in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same<T, __half>::value) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Fragment loads (lane l addresses row l % 8 of the 8x8 matrix l / 8). Shared-memory matrices
// are row-major with row stride `ld` elements; `p` points at the tile's first element.
//   A (16x16) stored as is:                         regs = rows 0-7|8-15 x cols 0-7, then cols 8-15
template <typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* p, int ld, int lane) {
  const int m = lane / 8, r = lane % 8;
  ldsm_x4(a, p + (r + 8 * (m % 2)) * ld + 8 * (m / 2));
}
//   A (16x16) stored transposed (p at A^T's tile: rows = A's columns)
template <typename T>
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const T* p, int ld, int lane) {
  const int m = lane / 8, r = lane % 8;
  ldsm_x4_trans(a, p + (r + 8 * (m / 2)) * ld + 8 * (m % 2));
}
//   B (16 x 8) of two neighbouring n-tiles, stored as B^T (rows = n, e.g. K rows for Q K^T):
//   b[0], b[1] = n-tile 0 (k 0-7, 8-15), b[2], b[3] = n-tile 1
template <typename T>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const T* p, int ld, int lane) {
  const int m = lane / 8, r = lane % 8;
  ldsm_x4(b, p + (r + 8 * (m / 2)) * ld + 8 * (m % 2));
}
//   the same, stored as B (rows = k, e.g. V rows for Z V)
template <typename T>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const T* p, int ld, int lane) {
  const int m = lane / 8, r = lane % 8;
  ldsm_x4_trans(b, p + (r + 8 * (m % 2)) * ld + 8 * (m / 2));
}

// The C fragments of two neighbouring n-tiles (a 16 x 16 block) as the A fragment of the next
// product, rounded to the storage dtype (FlashAttention's register reuse).
template <typename T>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack2<T>(c0[0], c0[1]);
  a[1] = pack2<T>(c0[2], c0[3]);
  a[2] = pack2<T>(c1[0], c1[1]);
  a[3] = pack2<T>(c1[2], c1[3]);
}

// acc (16 x D) += a . B, where `b` points at 16 rows of a row-major [k, D] shared-memory matrix.
template <typename T, int D>
__device__ __forceinline__ void mma_rows(float (&acc)[D / 8][4], const uint32_t (&a)[4], const T* b,
                                         int lane) {
#pragma unroll
  for (int n = 0; n < D / 8; n += 2) {
    uint32_t bb[4];
    load_b_kn(bb, b + 8 * n, D + 8, lane);
    mma<T>(acc[n], a, bb[0], bb[1]);
    mma<T>(acc[n + 1], a, bb[2], bb[3]);
  }
}

// rows x D of a [B, H, T, D] view -> shared memory (row stride D + 8), zero rows up to `padded`.
// cp.async: every thread issues all its 16-byte copies before anyone waits, so a block pays the
// global-memory latency once per matrix set (call cp_async_wait, then a barrier).
template <typename T, int D>
__device__ __forceinline__ void load_rows(T* dst, const T* __restrict__ src, int rows, int padded,
                                          int64_t row_stride) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int vecs = D / kVec;
  for (int idx = threadIdx.x; idx < padded * vecs; idx += blockDim.x) {
    const int r = idx / vecs, c = (idx % vecs) * kVec;
    const bool valid = r < rows;
    const T* from = valid ? src + r * row_stride + c : src;  // src-size 0: zero fill, no read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst + r * (D + 8) + c)),
                 "l"(from), "r"(valid ? 16 : 0)
                 : "memory");
  }
#endif
}

__device__ __forceinline__ void cp_async_wait() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Dropout keep bits of query rows [0, rows) x KT keys into keep[i * KT / 32 + j / 32] (bit j % 32),
// one Philox block (4 keys) per thread and step; rows >= Tq and keys >= Tk get 0. Thread t of
// `nthreads` (a multiple of 32); every thread of a warp runs every step (shuffles).
template <int KT>
__device__ __forceinline__ void keep_bits(uint32_t* keep, int row0, int rows, int t, int nthreads,
                                          int64_t philox_row0, int Tq, int Tk, uint64_t seed,
                                          uint64_t offset, uint32_t threshold) {
  constexpr int G = KT / 4;  // Philox blocks per row, a multiple of 8 (one 32-bit word = 8 blocks)
  const int n = rows * G;
  for (int base = 0; base < n; base += nthreads) {
    const int idx = base + t, i = row0 + idx / G, g = idx % G;
    uint32_t nib = 0;
    if (idx < n && i < Tq && 4 * g < Tk) {
      bool keep4[4];
      keep_mask<4>(seed, offset, philox_row0 + i, 4 * g, Tk, threshold, keep4);
#pragma unroll
      for (int e = 0; e < 4; ++e) nib |= uint32_t(keep4[e] && 4 * g + e < Tk) << e;
    }
    // idx % 8 == t % 8: the 8 lanes t & ~7 .. t | 7 hold the 8 blocks of one word
    uint32_t word = nib << (4 * (t % 8));
    word |= __shfl_xor_sync(0xffffffffu, word, 1);
    word |= __shfl_xor_sync(0xffffffffu, word, 2);
    word |= __shfl_xor_sync(0xffffffffu, word, 4);
    if (idx < n && t % 8 == 0) keep[i * (KT / 32) + g / 8] = word;
  }
}

// A warp's 16 x D fp32 tile (C fragments acc[D / 8]) * mul -> its rows of a shared-memory stage
// (row stride D + 8), then rows row0 + r < rows of it -> global memory (16-byte stores).
template <typename T, int D>
__device__ __forceinline__ void store_tile(const float (&acc)[D / 8][4], float mul, T* stage,
                                           T* __restrict__ dst, int64_t row_stride, int row0,
                                           int rows, int lane) {
  constexpr int LD = D + 8;
  const int r = lane / 4, c = 2 * (lane % 4);
  __syncwarp();  // every lane is done reading what the stage held
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    *reinterpret_cast<uint32_t*>(stage + r * LD + 8 * n + c) = pack2<T>(acc[n][0] * mul, acc[n][1] * mul);
    *reinterpret_cast<uint32_t*>(stage + (r + 8) * LD + 8 * n + c) = pack2<T>(acc[n][2] * mul, acc[n][3] * mul);
  }
  __syncwarp();
  constexpr int vecs = D / kVec;
#pragma unroll
  for (int idx = lane; idx < 16 * vecs; idx += kWarp) {
    const int rr = idx / vecs, cc = (idx % vecs) * kVec;
    if (row0 + rr < rows)
      *reinterpret_cast<uint4*>(dst + (row0 + rr) * row_stride + cc) =
          *reinterpret_cast<const uint4*>(stage + rr * LD + cc);
  }
}

// Keys j (0 <= j < KT) that exist and are not padding, as KT / 32 bit words.
template <int KT>
__device__ __forceinline__ void visible_keys(const bool* __restrict__ kpm_row, int Tk, int lane,
                                             uint32_t (&vis)[KT / 32]) {
#pragma unroll
  for (int w = 0; w < KT / 32; ++w) {
    const int j = 32 * w + lane;
    vis[w] = __ballot_sync(0xffffffffu, j < Tk && !(kpm_row != nullptr && kpm_row[j]));
  }
}

// ---------------------------------------------------------------- forward
template <typename T, int D, int KT>
__global__ void __launch_bounds__(256) short_attention_fwd_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, View sq, View sk,
    View sv, const bool* __restrict__ kpm, T* __restrict__ out, float* __restrict__ lse_out,
    Problem g, bool causal, float scale, DropoutArgs drop, at::PhiloxCudaState philox,
    int64_t* __restrict__ rng_out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // the host refuses such devices; bf16 tensor cores need sm_80
#else
  constexpr int LD = D + 8, NT = KT / 8, KW = KT / 32;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + g.TQ * LD;
  T* sV = sK + g.TK * LD;
  uint32_t* sKeep = reinterpret_cast<uint32_t*>(sV + g.TK * LD);

  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t bh = blockIdx.x, b = bh / g.H;
  const int h = static_cast<int>(bh - b * g.H);
  uint64_t seed, offset;
  unpack_seed(philox, drop.enabled, seed, offset);
  if (bh == 0 && threadIdx.x == 0) {
    rng_out[0] = static_cast<int64_t>(seed);
    rng_out[1] = static_cast<int64_t>(offset);
  }

  load_rows<T, D>(sQ, q + b * sq.b + h * sq.h, g.Tq, g.TQ, sq.t);
  load_rows<T, D>(sK, k + b * sk.b + h * sk.h, g.Tk, g.TK, sk.t);
  load_rows<T, D>(sV, v + b * sv.b + h * sv.h, g.Tk, g.TK, sv.t);
  // while the copies fly: which keys exist, and this warp's rows of the dropout mask
  uint32_t vis[KW];
  visible_keys<KT>(kpm != nullptr ? kpm + b * g.Tk : nullptr, g.Tk, lane, vis);
  const int r0 = 16 * warp;
  if (drop.enabled)
    keep_bits<KT>(sKeep, r0, 16, lane, kWarp, bh * g.Tq, g.Tq, g.Tk, seed, offset, drop.threshold);
  cp_async_wait();
  __syncthreads();

  // causal: query i sees key j <= i + shift; this warp's last query sees up to `last`
  const int shift = g.Tk - g.Tq;
  const int last = causal ? min(g.Tk - 1, r0 + 15 + shift) : g.Tk - 1;

  // S = Q K^T (16 rows x KT keys; tiles past the last visible key stay 0 and are masked below)
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) load_a(qa[ks], sQ + r0 * LD + 16 * ks, LD, lane);
  float s[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
  for (int n = 0; n < NT; n += 2) {
    if (8 * n > last) continue;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t kb[4];
      load_b_nk(kb, sK + 8 * n * LD + 16 * ks, LD, lane);
      mma<T>(s[n], qa[ks], kb[0], kb[1]);
      mma<T>(s[n + 1], qa[ks], kb[2], kb[3]);
    }
  }

  // softmax in log2 units; this lane holds rows ra and ra + 8, columns 8n + 2 (lane % 4) + {0, 1}
  const int ra = r0 + lane / 4, c0 = 2 * (lane % 4);
  const float scale2 = scale * kLog2e;
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = ra + 8 * (e / 2), j = 8 * n + c0 + (e % 2);
      const bool ok = ((vis[j / 32] >> (j % 32)) & 1u) && !(causal && j > i + shift);
      s[n][e] = ok ? s[n][e] * scale2 : -INFINITY;
      mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
    }
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int hb = 0; hb < 2; ++hb) {
    mx[hb] = fmaxf(mx[hb], __shfl_xor_sync(0xffffffffu, mx[hb], 1));
    mx[hb] = fmaxf(mx[hb], __shfl_xor_sync(0xffffffffu, mx[hb], 2));
  }
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float m = mx[e / 2];
      s[n][e] = m == -INFINITY ? 0.f : exp2f(s[n][e] - m);
      sum[e / 2] += s[n][e];
    }
  }
  float mul[2];
#pragma unroll
  for (int hb = 0; hb < 2; ++hb) {
    sum[hb] += __shfl_xor_sync(0xffffffffu, sum[hb], 1);
    sum[hb] += __shfl_xor_sync(0xffffffffu, sum[hb], 2);
    const bool empty = mx[hb] == -INFINITY;  // a row that sees no key: zeros, lse +inf
    mul[hb] = empty ? 0.f : drop.scale / sum[hb];
    const int i = ra + 8 * hb;
    if (lane % 4 == 0 && i < g.Tq)
      lse_out[bh * g.Tq + i] = empty ? INFINITY : (mx[hb] + log2f(sum[hb])) * kLn2;
  }
  // Z = dropout(P), then O = Z V with Z's C fragments reused as A fragments
  uint32_t kw[2][KW];
  if (drop.enabled) {
#pragma unroll
    for (int hb = 0; hb < 2; ++hb)
#pragma unroll
      for (int w = 0; w < KW; ++w) kw[hb][w] = sKeep[(ra + 8 * hb) * KW + w];
  }
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < KT / 16; ++kk) {
    if (16 * kk > last) continue;
    float z[2][4];
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = 16 * kk + 8 * t + c0 + (e % 2);
        const bool kept = !drop.enabled || ((kw[e / 2][j / 32] >> (j % 32)) & 1u);
        z[t][e] = kept ? s[2 * kk + t][e] * mul[e / 2] : 0.f;
      }
    uint32_t za[4];
    c_to_a<T>(za, z[0], z[1]);
    mma_rows<T, D>(o, za, sV + 16 * kk * LD, lane);
  }
  // out [B, Tq, H, D], staged through this warp's own Q rows
  store_tile<T, D>(o, 1.f, sQ + r0 * LD, out + (b * g.Tq * g.H + h) * D, int64_t(g.H) * D, r0, g.Tq, lane);
#endif
}

// ---------------------------------------------------------------- backward
template <typename T, int D, int KT>
__global__ void __launch_bounds__(256) short_attention_bwd_kernel(
    const T* __restrict__ dout, const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, const T* __restrict__ o, View sdo, View sq, View sk, View sv, View so,
    const float* __restrict__ lse, const bool* __restrict__ kpm, T* __restrict__ dq,
    T* __restrict__ dk, T* __restrict__ dv, View sdq, View sdk, View sdv, Problem g, bool causal,
    float scale, DropoutArgs drop, const int64_t* __restrict__ rng) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  constexpr int LD = D + 8, KW = KT / 32;
  const int LDS = g.TQ + 8;  // dS^T row stride
  extern __shared__ __align__(128) unsigned char smem[];
  const BwdSmem L = bwd_smem(g.TQ, g.TK, D, KT, drop.enabled, sizeof(T));
  T* sQ = reinterpret_cast<T*>(smem + L.q);
  T* sdO = reinterpret_cast<T*>(smem + L.dout);
  T* sK = reinterpret_cast<T*>(smem + L.k);
  T* sV = reinterpret_cast<T*>(smem + L.v);
  T* sO = reinterpret_cast<T*>(smem + L.shared);
  T* sdST = reinterpret_cast<T*>(smem + L.shared);  // after D_i: dS^T [TK][TQ + 8]
  float* sLse = reinterpret_cast<float*>(smem + L.lse);
  float* sDi = reinterpret_cast<float*>(smem + L.di);
  uint32_t* sKeep = reinterpret_cast<uint32_t*>(smem + L.keep);

  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  const int64_t bh = blockIdx.x, b = bh / g.H;
  const int h = static_cast<int>(bh - b * g.H);
  const uint64_t seed = drop.enabled ? static_cast<uint64_t>(rng[0]) : 0;
  const uint64_t offset = drop.enabled ? static_cast<uint64_t>(rng[1]) : 0;

  load_rows<T, D>(sQ, q + b * sq.b + h * sq.h, g.Tq, g.TQ, sq.t);
  load_rows<T, D>(sdO, dout + b * sdo.b + h * sdo.h, g.Tq, g.TQ, sdo.t);
  load_rows<T, D>(sK, k + b * sk.b + h * sk.h, g.Tk, g.TK, sk.t);
  load_rows<T, D>(sV, v + b * sv.b + h * sv.h, g.Tk, g.TK, sv.t);
  load_rows<T, D>(sO, o + b * so.b + h * so.h, g.Tq, g.TQ, so.t);
  // lse in log2 units; rows past Tq get +inf (P = 0 there)
  for (int i = threadIdx.x; i < g.TQ; i += blockDim.x)
    sLse[i] = i < g.Tq ? lse[bh * g.Tq + i] * kLog2e : INFINITY;
  if (drop.enabled)
    keep_bits<KT>(sKeep, 0, g.TQ, threadIdx.x, blockDim.x, bh * g.Tq, g.Tq, g.Tk, seed, offset,
                  drop.threshold);
  cp_async_wait();
  __syncthreads();

  // D_i = rowsum(dO * O), then the O rows are free for dS^T
  for (int i = threadIdx.x; i < g.TQ; i += blockDim.x) {
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < D; c += kVec) {
      const Pack<T, kVec> a = *reinterpret_cast<const Pack<T, kVec>*>(sdO + i * LD + c);
      const Pack<T, kVec> x = *reinterpret_cast<const Pack<T, kVec>*>(sO + i * LD + c);
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc += to_float(a.v[e]) * to_float(x.v[e]);
    }
    sDi[i] = acc;  // rows past Tq: zero rows
  }
  __syncthreads();

  // phase 1: this warp's keys j0 .. j0 + 15 against every query, 16 at a time
  const int j0 = 16 * warp, c0 = 2 * (lane % 4), shift = g.Tk - g.Tq;
  const float scale2 = scale * kLog2e;
  bool key_ok[2];
#pragma unroll
  for (int hb = 0; hb < 2; ++hb) {
    const int j = j0 + lane / 4 + 8 * hb;
    key_ok[hb] = j < g.Tk && !(kpm != nullptr && kpm[b * g.Tk + j]);
  }
  float dva[D / 8][4], dka[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dva[n][e] = dka[n][e] = 0.f;
  for (int i0 = 0; i0 < g.TQ; i0 += 16) {
    if (causal && j0 > i0 + 15 + shift) {  // no query of this chunk sees these keys: dS^T = 0
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int hb = 0; hb < 2; ++hb)
          *reinterpret_cast<uint32_t*>(sdST + (j0 + lane / 4 + 8 * hb) * LDS + i0 + 8 * t + c0) = 0u;
      continue;
    }
    // S^T = K Q^T and dZ^T = V dO^T: rows = keys, columns = queries i0 + 8t + c0 + {0, 1}
    float st[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    float dzt[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t ka[4], va[4], qb[4], ob[4];
      load_a(ka, sK + j0 * LD + 16 * ks, LD, lane);
      load_b_nk(qb, sQ + i0 * LD + 16 * ks, LD, lane);
      mma<T>(st[0], ka, qb[0], qb[1]);
      mma<T>(st[1], ka, qb[2], qb[3]);
      load_a(va, sV + j0 * LD + 16 * ks, LD, lane);
      load_b_nk(ob, sdO + i0 * LD + 16 * ks, LD, lane);
      mma<T>(dzt[0], va, ob[0], ob[1]);
      mma<T>(dzt[1], va, ob[2], ob[3]);
    }
    float z[2][4], ds[2][4];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = i0 + 8 * t + c0 + (e % 2), j = j0 + lane / 4 + 8 * (e / 2);
        const bool ok = key_ok[e / 2] && !(causal && j > i + shift);
        const float p = ok ? exp2f(st[t][e] * scale2 - sLse[i]) : 0.f;
        const bool kept = !drop.enabled || ((sKeep[i * KW + j / 32] >> (j % 32)) & 1u);
        z[t][e] = kept ? p * drop.scale : 0.f;
        const float dp = kept ? dzt[t][e] * drop.scale : 0.f;
        // unscaled, as fairseq rounds it: folding D^-0.5 in first would push small fp16
        // gradients into subnormals; dQ/dK take the scale in fp32 at their store
        ds[t][e] = to_float(from_float<T>(p)) * (dp - sDi[i]);
      }
    }
    uint32_t za[4], dsa[4];
    c_to_a<T>(za, z[0], z[1]);
    c_to_a<T>(dsa, ds[0], ds[1]);
    // dS^T rows j0 + lane / 4 (+ 8), the same rounded values as dsa
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int hb = 0; hb < 2; ++hb)
        *reinterpret_cast<uint32_t*>(sdST + (j0 + lane / 4 + 8 * hb) * LDS + i0 + 8 * t + c0) = dsa[2 * t + hb];
    // dV += Z^T dO, dK += dS^T Q over these 16 queries
    mma_rows<T, D>(dva, za, sdO + i0 * LD, lane);
    mma_rows<T, D>(dka, dsa, sQ + i0 * LD, lane);
  }
  // dV, dK rows j0 .. j0 + 15, staged through this warp's own V rows (no other warp reads them)
  store_tile<T, D>(dva, 1.f, sV + j0 * LD, dv + b * sdv.b + h * sdv.h, sdv.t, j0, g.Tk, lane);
  store_tile<T, D>(dka, scale, sV + j0 * LD, dk + b * sdk.b + h * sdk.h, sdk.t, j0, g.Tk, lane);
  __syncthreads();  // every dS^T column written; Q no longer read

  // phase 2: dQ = scale dS K, 16 queries per warp and step, staged through the Q rows
  for (int m0 = 16 * warp; m0 < g.TQ; m0 += 16 * warps) {
    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) {
      if (16 * kk >= g.Tk) continue;
      uint32_t a[4];
      load_a_trans(a, sdST + 16 * kk * LDS + m0, LDS, lane);
      mma_rows<T, D>(acc, a, sK + 16 * kk * LD, lane);
    }
    store_tile<T, D>(acc, scale, sQ + m0 * LD, dq + b * sdq.b + h * sdq.h, sdq.t, m0, g.Tq, lane);
  }
#endif
}

// ---------------------------------------------------------------- host
constexpr const char* kFwd = "ls_fairseq short_attention_fwd";
constexpr const char* kBwd = "ls_fairseq short_attention_bwd";

View view_of(const at::Tensor& x) { return View{x.stride(0), x.stride(1), x.stride(2)}; }

void check_view(const char* op, const char* name, const at::Tensor& x, const at::Tensor& like,
                int64_t rows) {
  LSF_CHECK(x.is_cuda() && x.device() == like.device(), op, ": ", name, " must be a CUDA tensor on ",
            like.device(), ", got ", x.device());
  LSF_CHECK(x.scalar_type() == like.scalar_type(), op, ": ", name, " must be ", like.scalar_type(),
            ", got ", x.scalar_type());
  LSF_CHECK(x.dim() == 4 && x.size(0) == like.size(0) && x.size(1) == like.size(1) &&
                x.size(2) == rows && x.size(3) == like.size(3),
            op, ": ", name, " must be [B, H, ", rows, ", D] = [", like.size(0), ", ", like.size(1),
            ", ", rows, ", ", like.size(3), "], got ", x.sizes());
  const bool aligned = x.stride(3) == 1 && x.stride(0) % kVec == 0 && x.stride(1) % kVec == 0 &&
                       x.stride(2) % kVec == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  LSF_CHECK(aligned, op, ": ", name, " must have a contiguous last dim, strides that are multiples of ",
            kVec, " elements and a 16-byte aligned start (strides ", x.strides(), ")");
}

// KT: the compiled key bucket (32, 64 or 128) that holds Tk.
int key_bucket(int Tk) { return Tk <= 32 ? 32 : Tk <= 64 ? 64 : 128; }

Problem check_problem(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& kpm) {
  LSF_CHECK(q.is_cuda() && q.dim() == 4, op, ": q must be a 4-D CUDA tensor [B, H, Tq, D], got ",
            q.sizes());
  LSF_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, op,
            ": dtype must be float16 or bfloat16, got ", q.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3), Tk = k.dim() == 4 ? k.size(2) : -1;
  LSF_CHECK(D == 16 || D == 32 || D == 64 || D == 128, op,
            ": head dim D must be 16, 32, 64 or 128 (other sizes use the efficient backend), got ", D);
  LSF_CHECK(Tq >= 1 && Tq <= kMaxLen && Tk >= 1 && Tk <= kMaxLen, op,
            ": query and key lengths must be in [1, ", kMaxLen, "] (longer rows use the efficient "
            "backend), got Tq=", Tq, ", Tk=", Tk);
  LSF_CHECK(B * H <= 2147483647LL, op, ": B * H must be < 2^31, got ", B * H);
  check_view(op, "q", q, q, Tq);
  check_view(op, "k", k, q, Tk);
  check_view(op, "v", v, q, Tk);
  if (kpm.has_value()) {
    const at::Tensor& m = *kpm;
    LSF_CHECK(m.scalar_type() == at::kBool && m.dim() == 2 && m.size(0) == B && m.size(1) == Tk &&
                  m.is_contiguous() && m.device() == q.device(),
              op, ": key_padding_mask must be a contiguous bool [B, Tk] = [", B, ", ", Tk,
              "] tensor on the device of q, got ", m.sizes(), " ", m.scalar_type());
  }
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.get_device()));
  LSF_CHECK(major >= 8, op, ": needs compute capability 8.0 or newer (bf16/fp16 tensor cores), got ",
            major, ".x");
  Problem g;
  g.H = static_cast<int>(H);
  g.Tq = static_cast<int>(Tq);
  g.Tk = static_cast<int>(Tk);
  g.TQ = round16(g.Tq);
  g.TK = round16(g.Tk);
  return g;
}

// Opt the kernel into `bytes` of dynamic shared memory (above the 48 KB default) if the device has it.
template <typename K>
void set_smem(const char* op, K kernel, int64_t bytes, int device) {
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  LSF_CHECK(bytes <= optin, op, ": needs ", bytes, " bytes of shared memory per block, the device has ",
            optin, " (shorter rows or a smaller head dim fit)");
  if (bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

template <typename T>
const T* cptr(const at::Tensor& x) {
  return reinterpret_cast<const T*>(x.data_ptr());
}
template <typename T>
T* mptr(const at::Tensor& x) {
  return reinterpret_cast<T*>(x.data_ptr());
}

// Calls f.template operator()<T, D, KT>() for the tensor's dtype, head dim and key bucket.
template <typename F>
void dispatch(at::ScalarType dtype, int D, int KT, F&& f) {
  auto by_kt = [&](auto t, auto d) {
    using T = decltype(t);
    constexpr int Dc = decltype(d)::value;
    if (KT == 32) f.template operator()<T, Dc, 32>();
    else if (KT == 64) f.template operator()<T, Dc, 64>();
    else f.template operator()<T, Dc, 128>();
  };
  auto by_d = [&](auto t) {
    if (D == 16) by_kt(t, std::integral_constant<int, 16>());
    else if (D == 32) by_kt(t, std::integral_constant<int, 32>());
    else if (D == 64) by_kt(t, std::integral_constant<int, 64>());
    else by_kt(t, std::integral_constant<int, 128>());
  };
  if (dtype == at::kHalf) by_d(__half());
  else by_d(__nv_bfloat16());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> short_attention_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, bool causal, double dropout_p, bool training) {
  const Problem g = check_problem(kFwd, q, k, v, key_padding_mask);
  const DropoutArgs drop = make_dropout(kFwd, dropout_p, training);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0);
  const int D = static_cast<int>(q.size(3)), KT = key_bucket(g.Tk);
  auto out = at::empty({B, g.Tq, g.H, D}, q.options());
  auto lse = at::empty({B, g.H, g.Tq}, q.options().dtype(at::kFloat));
  auto rng = at::empty({2}, q.options().dtype(at::kLong));
  at::PhiloxCudaState philox;
  if (drop.enabled) philox = next_philox(q);
  const int64_t bytes = fwd_smem_bytes(g.TQ, g.TK, D, KT, drop.enabled, q.element_size());
  const bool* kp = key_padding_mask.has_value() ? key_padding_mask->data_ptr<bool>() : nullptr;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch(q.scalar_type(), D, KT, [&]<typename T, int Dc, int KTc>() {
    auto kernel = short_attention_fwd_kernel<T, Dc, KTc>;
    set_smem(kFwd, kernel, bytes, q.get_device());
    kernel<<<static_cast<unsigned>(B * g.H), (g.TQ / 16) * kWarp, bytes, stream>>>(
        cptr<T>(q), cptr<T>(k), cptr<T>(v), view_of(q), view_of(k), view_of(v), kp, mptr<T>(out),
        lse.data_ptr<float>(), g, causal, scale, drop, philox, rng.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out.transpose(1, 2), lse, rng};
}

void short_attention_bwd(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                         const std::optional<at::Tensor>& key_padding_mask, bool causal,
                         const at::Tensor& rng_state, double dropout_p, const at::Tensor& grad_q,
                         const at::Tensor& grad_k, const at::Tensor& grad_v) {
  const Problem g = check_problem(kBwd, q, k, v, key_padding_mask);
  const DropoutArgs drop = make_dropout(kBwd, dropout_p, true);
  check_view(kBwd, "grad_out", grad_out, q, g.Tq);
  check_view(kBwd, "out", out, q, g.Tq);
  check_view(kBwd, "grad_q", grad_q, q, g.Tq);
  check_view(kBwd, "grad_k", grad_k, q, g.Tk);
  check_view(kBwd, "grad_v", grad_v, q, g.Tk);
  const int64_t B = q.size(0);
  LSF_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 3 &&
                lse.size(0) == B && lse.size(1) == g.H && lse.size(2) == g.Tq && lse.device() == q.device(),
            kBwd, ": lse must be the contiguous float32 [B, H, Tq] tensor saved by short_attention_fwd, got ",
            lse.sizes(), " ", lse.scalar_type());
  LSF_CHECK(!drop.enabled || (rng_state.numel() == 2 && rng_state.scalar_type() == at::kLong &&
                              rng_state.device() == q.device()),
            kBwd, ": rng_state must be the int64 [2] tensor saved by short_attention_fwd");
  const c10::cuda::CUDAGuard guard(q.device());
  const int D = static_cast<int>(q.size(3)), KT = key_bucket(g.Tk);
  const int64_t bytes = bwd_smem(g.TQ, g.TK, D, KT, drop.enabled, q.element_size()).total;
  const bool* kp = key_padding_mask.has_value() ? key_padding_mask->data_ptr<bool>() : nullptr;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const int64_t* rp = drop.enabled ? rng_state.data_ptr<int64_t>() : nullptr;
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch(q.scalar_type(), D, KT, [&]<typename T, int Dc, int KTc>() {
    auto kernel = short_attention_bwd_kernel<T, Dc, KTc>;
    set_smem(kBwd, kernel, bytes, q.get_device());
    kernel<<<static_cast<unsigned>(B * g.H), (g.TK / 16) * kWarp, bytes, stream>>>(
        cptr<T>(grad_out), cptr<T>(q), cptr<T>(k), cptr<T>(v), cptr<T>(out), view_of(grad_out),
        view_of(q), view_of(k), view_of(v), view_of(out), lse.data_ptr<float>(), kp, mptr<T>(grad_q),
        mptr<T>(grad_k), mptr<T>(grad_v), view_of(grad_q), view_of(grad_k), view_of(grad_v), g, causal,
        scale, drop, rp);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ls_fairseq, m) {
  m.def(
      "short_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, bool causal, "
      "float dropout_p, bool training) -> (Tensor, Tensor, Tensor)");
  m.def(
      "short_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? key_padding_mask, bool causal, Tensor rng_state, float dropout_p, Tensor(a!) grad_q, "
      "Tensor(b!) grad_k, Tensor(c!) grad_v) -> ()");
}

TORCH_LIBRARY_IMPL(ls_fairseq, CUDA, m) {
  m.impl("short_attention_fwd", &short_attention_fwd);
  m.impl("short_attention_bwd", &short_attention_bwd);
}
