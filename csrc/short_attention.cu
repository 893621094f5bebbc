// Single-tile fused attention for short rows (the "short" backend of
// ls_fairseq/ops/_attention_cuda.py): one thread block per (batch, head) holds the whole problem
// (Tq, Tk <= 128 rows of D <= 128) in shared memory, so scores, softmax, dropout and both GEMMs of
// the forward (and the five of the backward) run without a round trip through global memory.
//
// Why: at WMT lengths (~30 tokens) attention is memory-bound and tiny per (batch, head); the
// general kernels (CUTLASS memory-efficient, FlashAttention) tile for long rows and spend most of
// their time on 64/128-row tiles that are mostly padding, several launches and atomics.
//
// Ops (torch.ops.ls_fairseq.*):
//   short_attention_fwd(q, k, v, key_padding_mask?, causal, dropout_p, training)
//       -> (out [B, H, Tq, D] as a view of [B, Tq, H, D] memory, lse [B, H, Tq] fp32, rng_state)
//   short_attention_bwd(grad_out, q, k, v, out, lse, key_padding_mask?, causal, rng_state,
//       dropout_p, grad_q!, grad_k!, grad_v!)    (writes the gradients into the given tensors)
// q [B, H, Tq, D], k/v [B, H, Tk, D]: any strides that are multiples of 8 elements, last dim
// contiguous, 16-byte aligned (the packed projection's views qualify). fp16/bf16, sm_80+.
//
// Math, as ls_fairseq.ops.attention_reference: scores q.k * D^-0.5 in fp32 (tensor-core GEMM with
// fp32 accumulation), -inf at padded keys and (with `causal`) at keys j > i + Tk - Tq, softmax in
// fp32, a row with no visible key gives zeros. The probabilities are rounded to the storage dtype
// before P.V, as fairseq's bmm path does. lse (log-sum-exp of the row, +inf for an empty row) is
// kept for backward, which recomputes the probabilities (FlashAttention's scheme).
//
// Dropout: element (b, h, i, j) is kept when word (j % 4) of the Philox block at counter
// {offset / 4, row * ceil(Tk / 4) + j / 4}, row = (b * H + h) * Tq + i, is >= floor(p * 2^32): the
// scheme of the elementwise kernels (device_utils.cuh), so the mask depends only on (seed, offset,
// b, h, i, j) and backward regenerates it.
//
// Shared memory per block (bytes, TQ/TK = Tq/Tk rounded up to 16): Q, K, V (and dO, O in backward)
// as storage dtype rows of D + 8; the scores as fp32 rows of TK + 4, overwritten in place (per row)
// by the dropped probabilities Z in the storage dtype (and, in backward, P beside them, later dS);
// one 16x20 fp32 scratch tile per warp through which output tiles are converted and written.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>

#include "check.h"
#include "device_utils.cuh"
#include "launch_utils.h"
#include "philox_dropout.cuh"

namespace {

using namespace lsf;
namespace wmma = nvcuda::wmma;

constexpr int kTile = 16;        // wmma tile edge
constexpr int kMaxLen = 128;     // longest Tq / Tk (one Philox block of 4 keys per lane per row)
constexpr int kMaxDim = 128;     // largest head size
constexpr int kScratchLd = 20;   // fp32 row stride of a warp's scratch tile
constexpr int kVec = 8;          // elements per 16-byte access
constexpr int kWarp = 32;

using Acc = wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float>;

// Element strides of a [B, H, T, D] view (last dim contiguous).
struct View {
  int64_t b, h, t;
};

struct Shape {
  int H, Tq, Tk, D;
  int TQ, TK;     // Tq, Tk rounded up to 16
  int ldh;        // row stride (elements) of Q, K, V, dO in shared memory: D + 8
  int lds;        // row stride (floats) of the score rows: TK + 4
  int ldz;        // the same rows as storage-dtype elements: 2 * lds
};

__host__ __device__ inline int64_t align128(int64_t x) { return (x + 127) / 128 * 128; }

// Byte offsets of the shared-memory regions (host and device agree on one function).
struct Smem {
  int64_t q, k, v, dout, out, s, scratch, stats, total;
};

__host__ __device__ inline Smem smem_layout(const Shape& g, int warps, bool backward, int elem) {
  Smem m;
  int64_t at = 0;
  m.q = at;
  at = align128(at + int64_t(g.TQ) * g.ldh * elem);
  m.k = at;
  at = align128(at + int64_t(g.TK) * g.ldh * elem);
  m.v = at;
  at = align128(at + int64_t(g.TK) * g.ldh * elem);
  m.dout = at;
  if (backward) at = align128(at + int64_t(g.TQ) * g.ldh * elem);
  m.out = at;
  if (backward) at = align128(at + int64_t(g.TQ) * g.ldh * elem);
  m.s = at;
  at = align128(at + int64_t(g.TQ) * g.lds * 4);
  m.scratch = at;
  at = align128(at + int64_t(warps) * kTile * kScratchLd * 4);
  m.stats = at;  // backward: lse [TQ] and D_i = rowsum(dO * O) [TQ], fp32
  if (backward) at = align128(at + 2 * int64_t(g.TQ) * 4);
  m.total = at;
  return m;
}

inline Shape make_shape(int64_t H, int64_t Tq, int64_t Tk, int64_t D) {
  Shape g;
  g.H = static_cast<int>(H);
  g.Tq = static_cast<int>(Tq);
  g.Tk = static_cast<int>(Tk);
  g.D = static_cast<int>(D);
  g.TQ = static_cast<int>((Tq + kTile - 1) / kTile * kTile);
  g.TK = static_cast<int>((Tk + kTile - 1) / kTile * kTile);
  g.ldh = g.D + 8;
  g.lds = g.TK + 4;
  g.ldz = 2 * g.lds;
  return g;
}

// The phases are chains of dependent tile loads/MMAs: more warps per block hide their latency
// (measured on H100: 4 warps at 64 rows ran 1.5x slower than 8 at 80); tiny problems keep 4.
inline int warps_for(const Shape& g) { return (g.TQ > 32 || g.TK > 32) ? 8 : 4; }

// ---------------------------------------------------------------- device helpers
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// rows x D of a [B, H, T, D] view -> shared memory (row stride ldh), zero rows up to `padded`.
// cp.async: every thread issues all its 16-byte copies before anyone waits, so a block pays the
// global-memory latency once per matrix set, not once per row (call cp_async_wait, then sync).
template <typename T>
__device__ __forceinline__ void load_rows(T* dst, int ldh, const T* __restrict__ src, int rows,
                                          int padded, int D, int64_t row_stride) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  const int vecs = D / kVec;
  for (int idx = threadIdx.x; idx < padded * vecs; idx += blockDim.x) {
    const int r = idx / vecs, c = (idx - r * vecs) * kVec;
    const bool valid = r < rows;
    const T* from = valid ? src + r * row_stride + c : src;  // src-size 0: zero fill, no read
    const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst + r * ldh + c));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from),
                 "r"(valid ? 16 : 0));
  }
#endif
}

__device__ __forceinline__ void cp_async_wait() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::);
#endif
}

// acc = A[m0 rows] . B[n0 cols] over `ksteps` 16-wide steps. `a` points at the tile's (m0, 0)
// element, `b` at (0, n0); the layouts say how the shared-memory operand is stored.
template <typename T, typename LayoutA, typename LayoutB>
__device__ __forceinline__ void mma_tile(Acc& acc, const T* a, int lda, const T* b, int ldb, int ksteps) {
  constexpr bool a_row = std::is_same<LayoutA, wmma::row_major>::value;
  constexpr bool b_row = std::is_same<LayoutB, wmma::row_major>::value;
  wmma::fill_fragment(acc, 0.f);
  for (int kk = 0; kk < ksteps; ++kk) {
    wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, T, LayoutA> fa;
    wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, T, LayoutB> fb;
    wmma::load_matrix_sync(fa, a_row ? a + kk * kTile : a + int64_t(kk) * kTile * lda, lda);
    wmma::load_matrix_sync(fb, b_row ? b + int64_t(kk) * kTile * ldb : b + kk * kTile, ldb);
    wmma::mma_sync(acc, fa, fb, acc);
  }
}

// One 16x16 output tile through the warp's scratch into global rows (m0 + r < rows only):
// dst + (m0 + r) * row_stride + n0 + c. Each lane writes 8 consecutive elements (16 bytes).
template <typename T>
__device__ __forceinline__ void store_tile(const Acc& acc, float* scratch, T* __restrict__ dst,
                                           int64_t row_stride, int m0, int rows, int n0,
                                           float mul = 1.f) {
  wmma::store_matrix_sync(scratch, acc, kScratchLd, wmma::mem_row_major);
  __syncwarp();
  const int lane = threadIdx.x % kWarp, r = lane / 2, c = (lane % 2) * kVec;
  if (m0 + r < rows) {
    Pack<T, kVec> pk;
#pragma unroll
    for (int e = 0; e < kVec; ++e) pk.v[e] = from_float<T>(scratch[r * kScratchLd + c + e] * mul);
    *reinterpret_cast<Pack<T, kVec>*>(dst + (m0 + r) * row_stride + n0 + c) = pk;
  }
  __syncwarp();  // the scratch tile is reused by the warp's next tile
}

// Keys j0..j0+3 that are real (in range, not padding): the same for every query row, so each
// lane reads them once.
__device__ __forceinline__ void real_keys(const Shape& g, const bool* __restrict__ kpm_row, int j0,
                                          bool (&real)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e)
    real[e] = j0 + e < g.Tk && !(kpm_row != nullptr && kpm_row[j0 + e]);
}

// Key j is visible from query i.
__device__ __forceinline__ bool visible(const Shape& g, bool real, bool causal, int i, int j) {
  return real && !(causal && j > i + g.Tk - g.Tq);
}

// ---------------------------------------------------------------- forward
template <typename T>
__global__ void __launch_bounds__(256) short_attention_fwd_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, View sq, View sk,
    View sv, const bool* __restrict__ kpm, T* __restrict__ out, float* __restrict__ lse_out, Shape g,
    bool causal, float scale, DropoutArgs drop, at::PhiloxCudaState philox,
    int64_t* __restrict__ rng_out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // the host refuses such devices; bf16 tensor cores need sm_80
#else
  extern __shared__ __align__(128) unsigned char smem[];
  const int warps = blockDim.x / kWarp, warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const Smem L = smem_layout(g, warps, false, sizeof(T));
  T* sQ = reinterpret_cast<T*>(smem + L.q);
  T* sK = reinterpret_cast<T*>(smem + L.k);
  T* sV = reinterpret_cast<T*>(smem + L.v);
  float* sS = reinterpret_cast<float*>(smem + L.s);
  T* sZ = reinterpret_cast<T*>(smem + L.s);  // Z overwrites the score rows in place
  float* scratch = reinterpret_cast<float*>(smem + L.scratch) + warp * kTile * kScratchLd;

  const int64_t bh = blockIdx.x, b = bh / g.H;
  const int h = static_cast<int>(bh - b * g.H);
  uint64_t seed, offset;
  unpack_seed(philox, drop.enabled, seed, offset);
  if (bh == 0 && threadIdx.x == 0) {
    rng_out[0] = static_cast<int64_t>(seed);
    rng_out[1] = static_cast<int64_t>(offset);
  }

  load_rows(sQ, g.ldh, q + b * sq.b + h * sq.h, g.Tq, g.TQ, g.D, sq.t);
  load_rows(sK, g.ldh, k + b * sk.b + h * sk.h, g.Tk, g.TK, g.D, sk.t);
  load_rows(sV, g.ldh, v + b * sv.b + h * sv.h, g.Tk, g.TK, g.D, sv.t);
  cp_async_wait();
  __syncthreads();

  // S = Q K^T
  const int tk16 = g.TK / kTile, d16 = g.D / kTile;
  for (int t = warp; t < (g.TQ / kTile) * tk16; t += warps) {
    const int m0 = (t / tk16) * kTile, n0 = (t % tk16) * kTile;
    Acc acc;
    mma_tile<T, wmma::row_major, wmma::col_major>(acc, sQ + m0 * g.ldh, g.ldh, sK + n0 * g.ldh, g.ldh, d16);
    wmma::store_matrix_sync(sS + m0 * g.lds + n0, acc, g.lds, wmma::mem_row_major);
  }
  __syncthreads();

  // softmax + dropout, one warp per row; lane l owns keys 4l..4l+3
  const int j0 = 4 * lane;
  bool real[4];
  real_keys(g, kpm != nullptr ? kpm + b * g.Tk : nullptr, j0, real);
  for (int i = warp; i < g.TQ; i += warps) {
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    if (j0 < g.TK) {
      const float4 x = *reinterpret_cast<const float4*>(sS + i * g.lds + j0);
      s[0] = x.x, s[1] = x.y, s[2] = x.z, s[3] = x.w;
    }
    __syncwarp();  // every lane has read its scores before any lane overwrites the row
    float z[4] = {0.f, 0.f, 0.f, 0.f};
    if (i < g.Tq) {
      float m = -INFINITY;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[e] = visible(g, real[e], causal, i, j0 + e) ? s[e] * scale : -INFINITY;
        m = fmaxf(m, s[e]);
      }
      m = warp_max(m);
      float lse = INFINITY;  // a row that sees no key: probabilities 0, lse +inf
      if (m != -INFINITY) {
        float sum = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[e] = expf(s[e] - m);
          sum += s[e];
        }
        sum = warp_sum(sum);
        const float inv = 1.f / sum;
        lse = m + logf(sum);
        bool keep[4] = {true, true, true, true};
        if (drop.enabled && j0 < g.Tk)
          keep_mask<4>(seed, offset, bh * g.Tq + i, j0, g.Tk, drop.threshold, keep);
#pragma unroll
        for (int e = 0; e < 4; ++e) z[e] = keep[e] ? s[e] * inv * drop.scale : 0.f;
      }
      if (lane == 0) lse_out[bh * g.Tq + i] = lse;
    }
    if (j0 < g.TK) {
      Pack<T, 4> pk;
#pragma unroll
      for (int e = 0; e < 4; ++e) pk.v[e] = from_float<T>(z[e]);
      *reinterpret_cast<Pack<T, 4>*>(sZ + i * g.ldz + j0) = pk;
    }
  }
  __syncthreads();

  // O = Z V, written as [B, Tq, H, D]
  T* out_bh = out + (b * g.Tq * g.H + h) * g.D;
  for (int t = warp; t < (g.TQ / kTile) * d16; t += warps) {
    const int m0 = (t / d16) * kTile, n0 = (t % d16) * kTile;
    Acc acc;
    mma_tile<T, wmma::row_major, wmma::row_major>(acc, sZ + m0 * g.ldz, g.ldz, sV + n0, g.ldh, tk16);
    store_tile(acc, scratch, out_bh, int64_t(g.H) * g.D, m0, g.Tq, n0);
  }
#endif
}

// ---------------------------------------------------------------- backward
// With Z = dropout(P) and O = Z V:  dV = Z^T dO,  dZ = dO V^T,  dP = dropout'(dZ),
// dS = P * (dP - D_i) with D_i = sum_j Z_ij dZ_ij = rowsum(dO * O),  dQ = scale dS K,
// dK = scale dS^T Q. Every matrix is loaded once (cp.async); O only for D_i.
template <typename T>
__global__ void __launch_bounds__(256) short_attention_bwd_kernel(
    const T* __restrict__ dout, const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, const T* __restrict__ o, View sdo, View sq, View sk, View sv, View so,
    const float* __restrict__ lse, const bool* __restrict__ kpm, T* __restrict__ dq,
    T* __restrict__ dk, T* __restrict__ dv, View sdq, View sdk, View sdv, Shape g, bool causal,
    float scale, DropoutArgs drop, const int64_t* __restrict__ rng) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  extern __shared__ __align__(128) unsigned char smem[];
  const int warps = blockDim.x / kWarp, warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const Smem L = smem_layout(g, warps, true, sizeof(T));
  T* sQ = reinterpret_cast<T*>(smem + L.q);
  T* sK = reinterpret_cast<T*>(smem + L.k);
  T* sV = reinterpret_cast<T*>(smem + L.v);
  T* sdO = reinterpret_cast<T*>(smem + L.dout);
  T* sO = reinterpret_cast<T*>(smem + L.out);
  float* sS = reinterpret_cast<float*>(smem + L.s);
  T* sZ = reinterpret_cast<T*>(smem + L.s);  // row i: Z at [0, TK), P then dS at [TK, 2 TK)
  T* sP = sZ + g.TK;
  float* scratch = reinterpret_cast<float*>(smem + L.scratch) + warp * kTile * kScratchLd;
  float* sLse = reinterpret_cast<float*>(smem + L.stats);
  float* sDi = sLse + g.TQ;

  const int64_t bh = blockIdx.x, b = bh / g.H;
  const int h = static_cast<int>(bh - b * g.H);
  const uint64_t seed = drop.enabled ? static_cast<uint64_t>(rng[0]) : 0;
  const uint64_t offset = drop.enabled ? static_cast<uint64_t>(rng[1]) : 0;

  load_rows(sQ, g.ldh, q + b * sq.b + h * sq.h, g.Tq, g.TQ, g.D, sq.t);
  load_rows(sK, g.ldh, k + b * sk.b + h * sk.h, g.Tk, g.TK, g.D, sk.t);
  load_rows(sV, g.ldh, v + b * sv.b + h * sv.h, g.Tk, g.TK, g.D, sv.t);
  load_rows(sdO, g.ldh, dout + b * sdo.b + h * sdo.h, g.Tq, g.TQ, g.D, sdo.t);
  load_rows(sO, g.ldh, o + b * so.b + h * so.h, g.Tq, g.TQ, g.D, so.t);
  for (int i = threadIdx.x; i < g.Tq; i += blockDim.x) sLse[i] = lse[bh * g.Tq + i];
  cp_async_wait();
  __syncthreads();

  // D_i = rowsum(dO * O), one warp per row; S = Q K^T
  for (int i = warp; i < g.Tq; i += warps) {
    float acc = 0.f;
    for (int d = lane; d < g.D; d += kWarp) acc += to_float(sdO[i * g.ldh + d]) * to_float(sO[i * g.ldh + d]);
    acc = warp_sum(acc);
    if (lane == 0) sDi[i] = acc;
  }
  const int tq16 = g.TQ / kTile, tk16 = g.TK / kTile, d16 = g.D / kTile;
  for (int t = warp; t < tq16 * tk16; t += warps) {
    const int m0 = (t / tk16) * kTile, n0 = (t % tk16) * kTile;
    Acc acc;
    mma_tile<T, wmma::row_major, wmma::col_major>(acc, sQ + m0 * g.ldh, g.ldh, sK + n0 * g.ldh, g.ldh, d16);
    wmma::store_matrix_sync(sS + m0 * g.lds + n0, acc, g.lds, wmma::mem_row_major);
  }
  __syncthreads();

  // P = exp(scale S - lse) (0 where hidden), Z = dropout(P), both in place of the score row
  const int j0 = 4 * lane;
  bool real[4];
  real_keys(g, kpm != nullptr ? kpm + b * g.Tk : nullptr, j0, real);
  for (int i = warp; i < g.TQ; i += warps) {
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    if (j0 < g.TK) {
      const float4 x = *reinterpret_cast<const float4*>(sS + i * g.lds + j0);
      s[0] = x.x, s[1] = x.y, s[2] = x.z, s[3] = x.w;
    }
    __syncwarp();
    float p[4] = {0.f, 0.f, 0.f, 0.f}, z[4] = {0.f, 0.f, 0.f, 0.f};
    if (i < g.Tq && j0 < g.TK) {
      const float row_lse = sLse[i];
#pragma unroll
      for (int e = 0; e < 4; ++e) p[e] = visible(g, real[e], causal, i, j0 + e) ? expf(s[e] * scale - row_lse) : 0.f;
      bool keep[4] = {true, true, true, true};
      if (drop.enabled && j0 < g.Tk)
        keep_mask<4>(seed, offset, bh * g.Tq + i, j0, g.Tk, drop.threshold, keep);
#pragma unroll
      for (int e = 0; e < 4; ++e) z[e] = keep[e] ? p[e] * drop.scale : 0.f;
    }
    if (j0 < g.TK) {
      Pack<T, 4> pz, pp;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        pz.v[e] = from_float<T>(z[e]);
        pp.v[e] = from_float<T>(p[e]);
      }
      *reinterpret_cast<Pack<T, 4>*>(sZ + i * g.ldz + j0) = pz;
      *reinterpret_cast<Pack<T, 4>*>(sP + i * g.ldz + j0) = pp;
    }
  }
  __syncthreads();

  // dV = Z^T dO (tiles [0, nv)); dZ = dO V^T -> dS in place of P (tiles [nv, nv + ns))
  const int nv = tk16 * d16, ns = tq16 * tk16;
  T* dv_bh = dv + b * sdv.b + h * sdv.h;
  for (int t = warp; t < nv + ns; t += warps) {
    Acc acc;
    if (t < nv) {
      const int m0 = (t / d16) * kTile, n0 = (t % d16) * kTile;
      mma_tile<T, wmma::col_major, wmma::row_major>(acc, sZ + m0, g.ldz, sdO + n0, g.ldh, tq16);
      store_tile(acc, scratch, dv_bh, sdv.t, m0, g.Tk, n0);
      continue;
    }
    const int u = t - nv, m0 = (u / tk16) * kTile, n0 = (u % tk16) * kTile;
    mma_tile<T, wmma::row_major, wmma::col_major>(acc, sdO + m0 * g.ldh, g.ldh, sV + n0 * g.ldh, g.ldh, d16);
    wmma::store_matrix_sync(scratch, acc, kScratchLd, wmma::mem_row_major);
    __syncwarp();
    const int r = lane / 2, c = (lane % 2) * kVec, i = m0 + r, j = n0 + c;
    Pack<T, kVec>* cell = reinterpret_cast<Pack<T, kVec>*>(sP + i * g.ldz + j);
    Pack<T, kVec> ds;
    if (i < g.Tq) {
      const Pack<T, kVec> pk = *cell;
      bool keep[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) keep[e] = true;
      if (drop.enabled && j < g.Tk) keep_mask<kVec>(seed, offset, bh * g.Tq + i, j, g.Tk, drop.threshold, keep);
      const float di = sDi[i];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float dp = keep[e] ? scratch[r * kScratchLd + c + e] * drop.scale : 0.f;
        // unscaled, as fairseq rounds it: folding D^-0.5 in first would push small fp16
        // gradients into subnormals; dQ/dK take the scale in fp32 at their store
        ds.v[e] = from_float<T>(j + e < g.Tk ? to_float(pk.v[e]) * (dp - di) : 0.f);
      }
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) ds.v[e] = from_float<T>(0.f);
    }
    *cell = ds;
    __syncwarp();
  }
  __syncthreads();

  // dQ = dS K (tiles [0, nq)), dK = dS^T Q (tiles [nq, nq + nk))
  const int nq = tq16 * d16, nk = tk16 * d16;
  T* dq_bh = dq + b * sdq.b + h * sdq.h;
  T* dk_bh = dk + b * sdk.b + h * sdk.h;
  for (int t = warp; t < nq + nk; t += warps) {
    Acc acc;
    if (t < nq) {
      const int m0 = (t / d16) * kTile, n0 = (t % d16) * kTile;
      mma_tile<T, wmma::row_major, wmma::row_major>(acc, sP + m0 * g.ldz, g.ldz, sK + n0, g.ldh, tk16);
      store_tile(acc, scratch, dq_bh, sdq.t, m0, g.Tq, n0, scale);
    } else {
      const int u = t - nq, m0 = (u / d16) * kTile, n0 = (u % d16) * kTile;
      mma_tile<T, wmma::col_major, wmma::row_major>(acc, sP + m0, g.ldz, sQ + n0, g.ldh, tq16);
      store_tile(acc, scratch, dk_bh, sdk.t, m0, g.Tk, n0, scale);
    }
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

Shape check_problem(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& kpm) {
  LSF_CHECK(q.is_cuda() && q.dim() == 4, op, ": q must be a 4-D CUDA tensor [B, H, Tq, D], got ",
            q.sizes());
  LSF_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, op,
            ": dtype must be float16 or bfloat16, got ", q.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3), Tk = k.dim() == 4 ? k.size(2) : -1;
  LSF_CHECK(D % kTile == 0 && D > 0 && D <= kMaxDim, op, ": head dim D must be a multiple of ", kTile,
            " in [16, ", kMaxDim, "], got ", D);
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
  return make_shape(H, Tq, Tk, D);
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

#define LSF_DISPATCH_HALF_TYPES(DTYPE, ...)            \
  [&] {                                                \
    if ((DTYPE) == at::kHalf) {                        \
      using T = __half;                                \
      return __VA_ARGS__();                            \
    }                                                  \
    using T = __nv_bfloat16;                           \
    return __VA_ARGS__();                              \
  }()

std::tuple<at::Tensor, at::Tensor, at::Tensor> short_attention_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, bool causal, double dropout_p, bool training) {
  const Shape g = check_problem(kFwd, q, k, v, key_padding_mask);
  const DropoutArgs drop = make_dropout(kFwd, dropout_p, training);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0);
  auto out = at::empty({B, g.Tq, g.H, g.D}, q.options());
  auto lse = at::empty({B, g.H, g.Tq}, q.options().dtype(at::kFloat));
  auto rng = at::empty({2}, q.options().dtype(at::kLong));
  at::PhiloxCudaState philox;
  if (drop.enabled) philox = next_philox(q);
  const int warps = warps_for(g);
  const int64_t bytes = smem_layout(g, warps, false, q.element_size()).total;
  const bool* kp = key_padding_mask.has_value() ? key_padding_mask->data_ptr<bool>() : nullptr;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(g.D)));
  auto stream = c10::cuda::getCurrentCUDAStream();
  LSF_DISPATCH_HALF_TYPES(q.scalar_type(), [&] {
    auto kernel = short_attention_fwd_kernel<T>;
    set_smem(kFwd, kernel, bytes, q.get_device());
    kernel<<<static_cast<unsigned>(B * g.H), warps * kWarp, bytes, stream>>>(
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
  const Shape g = check_problem(kBwd, q, k, v, key_padding_mask);
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
  const int warps = warps_for(g);
  const int64_t bytes = smem_layout(g, warps, true, q.element_size()).total;
  const bool* kp = key_padding_mask.has_value() ? key_padding_mask->data_ptr<bool>() : nullptr;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(g.D)));
  const int64_t* rp = drop.enabled ? rng_state.data_ptr<int64_t>() : nullptr;
  auto stream = c10::cuda::getCurrentCUDAStream();
  LSF_DISPATCH_HALF_TYPES(q.scalar_type(), [&] {
    auto kernel = short_attention_bwd_kernel<T>;
    set_smem(kBwd, kernel, bytes, q.get_device());
    kernel<<<static_cast<unsigned>(B * g.H), warps * kWarp, bytes, stream>>>(
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
