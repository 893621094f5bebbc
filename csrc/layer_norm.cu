// LayerNorm over the last dimension (ls_fairseq, issue 3): y = (x - mean) * rstd * w + b.
//
// Storage float32/float16/bfloat16, math in float32, eps from the caller (fairseq: 1e-5).
//
// Statistics are one pass over the row with shifted sums: with K = x[row, 0],
//   mean = K + sum(x - K) / C,  var = sum((x - K)^2) / C - (sum(x - K) / C)^2,
// which keeps the mean-of-squares rewrite (both sums in one sweep and one reduction) but removes
// its cancellation when |mean| >> std: K is a sample of the row, so x - K is of the order of std.
//
// Backward: with xhat = (x - mean) * rstd and d = grad * w,
//   dx = rstd * (d - mean(d) - xhat * mean(d * xhat)),  dw = sum_rows grad * xhat,  db = sum_rows grad.
// With a residual gradient r (pre-LN blocks: x feeds both this LayerNorm and the residual branch),
// backward returns dx + r in the same pass, so autograd's separate add of the two is not needed.
// bias_dropout_residual_layer_norm_fwd fuses the pre-LN sublayer boundary: the sublayer output's
// bias + dropout + residual (as csrc/dropout_fusions.cu, same mask) and the next LayerNorm, in one
// pass (x is written once and not read back); its backward, with dropout, writes dx and y's
// gradient (dx through the mask) from one pass of the LayerNorm backward.
// Invertible mode (as DeepSpeed's normalize_invertible) rebuilds xhat = (y - b) / w from the
// output, so the caller may keep y instead of x; it needs a weight with no zero entries and its
// xhat carries the rounding of y (fp16: ~1e-3 relative).
//
// Kernels: rows of up to 256 vectors (one 16-byte vector per element group when C allows, else
// scalars) are held in registers by one warp per row; longer rows use one block per row with a
// second read of the row (from L1/L2).  dw/db are per-lane column sums in registers, reduced
// across the block in shared memory to per-block partials, then summed in a fixed order
// (deterministic, no atomics).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "check.h"
#include "device_utils.cuh"
#include "launch_utils.h"
#include "philox_dropout.cuh"

namespace {

using namespace lsf;  // helpers from launch_utils.h and device_utils.cuh (to_float, Pack)


constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 4;    // warp-per-row kernels
constexpr int kBlockThreads = 256;   // block-per-row kernels

template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&out)[VEC]) {
  const Pack<T, VEC> pk = *reinterpret_cast<const Pack<T, VEC>*>(p);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = to_float(pk.v[i]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&in)[VEC]) {
  Pack<T, VEC> pk;
#pragma unroll
  for (int i = 0; i < VEC; ++i) pk.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Pack<T, VEC>*>(p) = pk;
}

// Weight (or 1) and bias (or 0) of one vector.
template <typename T, int VEC>
__device__ __forceinline__ void load_wb(const T* __restrict__ w, const T* __restrict__ b, int64_t off,
                                        float (&wv)[VEC], float (&bv)[VEC]) {
  if (w != nullptr) {
    load_vec<T, VEC>(w + off, wv);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) wv[i] = 1.f;
  }
  if (b != nullptr) {
    load_vec<T, VEC>(b + off, bv);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) bv[i] = 0.f;
  }
}

__device__ __forceinline__ void warp_allreduce2(float& a, float& b) {
#pragma unroll
  for (int m = kWarp / 2; m > 0; m >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, m);
    b += __shfl_xor_sync(0xffffffffu, b, m);
  }
}

// Sum a and b over the block (every thread gets the totals); fixed order, reusable in a loop.
__device__ __forceinline__ void block_allreduce2(float& a, float& b) {
  __shared__ float sa[kBlockThreads / kWarp], sb[kBlockThreads / kWarp];
  warp_allreduce2(a, b);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  a = 0.f;
  b = 0.f;
#pragma unroll
  for (int i = 0; i < kBlockThreads / kWarp; ++i) {
    a += sa[i];
    b += sb[i];
  }
  __syncthreads();
}

// ---------------------------------------------------------------- forward
// LayerNorm of one row held by a warp in registers (v[k] = vector lane + 32 k of the row, shift =
// the row's first element): statistics, then y. Shared by the plain and the fused forward.
template <typename T, int VEC, int NV>
__device__ __forceinline__ void ln_warp_row(const float (&v)[NV][VEC], float shift, int lane,
                                            int nvec, int C, const T* __restrict__ w,
                                            const T* __restrict__ b, T* __restrict__ yr,
                                            float* __restrict__ mean_out,
                                            float* __restrict__ rstd_out, int64_t row, float eps) {
  float s1 = 0.f, s2 = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int j = lane + k * kWarp;
    if (j < nvec) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float d = v[k][i] - shift;
        s1 += d;
        s2 += d * d;
      }
    }
  }
  warp_allreduce2(s1, s2);
  const float inv_c = 1.f / static_cast<float>(C);
  const float mean_shifted = s1 * inv_c;
  const float var = fmaxf(s2 * inv_c - mean_shifted * mean_shifted, 0.f);
  const float rstd = rsqrtf(var + eps);
  if (lane == 0) {
    mean_out[row] = shift + mean_shifted;
    rstd_out[row] = rstd;
  }
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int j = lane + k * kWarp;
    if (j < nvec) {
      float wv[VEC], bv[VEC], o[VEC];
      load_wb<T, VEC>(w, b, static_cast<int64_t>(j) * VEC, wv, bv);
#pragma unroll
      for (int i = 0; i < VEC; ++i) o[i] = ((v[k][i] - shift) - mean_shifted) * rstd * wv[i] + bv[i];
      store_vec<T, VEC>(yr + j * VEC, o);
    }
  }
}

template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(kWarp* kWarpsPerBlock)
    ln_fwd_warp_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                       T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                       int64_t rows, int C, float eps) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (row >= rows) return;
  const int nvec = C / VEC;
  const T* xr = x + row * C;
  float v[NV][VEC];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int j = lane + k * kWarp;
    if (j < nvec) load_vec<T, VEC>(xr + j * VEC, v[k]);
  }
  ln_warp_row<T, VEC, NV>(v, to_float(xr[0]), lane, nvec, C, w, b, y + row * C, mean_out, rstd_out,
                          row, eps);
}

// Fused pre-LN sublayer boundary: x = residual + dropout(y + bias) (the bias_dropout_residual
// kernel's values and Philox mask: bias_dropout_residual_values), stored, then
// h = LayerNorm(x) of the stored (rounded) x, as the two kernels one after the other compute it,
// without reading x back. 16-byte vectors only (VEC = 8 fp16/bf16, 4 fp32: whole Philox words).
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(kWarp* kWarpsPerBlock)
    bdr_ln_fwd_warp_kernel(const T* __restrict__ y, const T* __restrict__ bias,
                           const T* __restrict__ res, T* __restrict__ x_out,
                           const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ h,
                           float* __restrict__ mean_out, float* __restrict__ rstd_out,
                           int64_t rows, int C, float eps, DropoutArgs drop,
                           at::PhiloxCudaState philox, int64_t* __restrict__ rng_out) {
  static_assert(VEC % 4 == 0, "whole Philox words per vector");
  uint64_t seed, offset;
  unpack_seed(philox, drop.enabled, seed, offset);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    rng_out[0] = static_cast<int64_t>(seed);
    rng_out[1] = static_cast<int64_t>(offset);
  }
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (row >= rows) return;
  const int nvec = C / VEC;
  float v[NV][VEC];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int j = lane + k * kWarp;
    if (j < nvec) {
      const int64_t off = row * C + static_cast<int64_t>(j) * VEC;
      float yv[VEC], rv[VEC], bv[VEC], o[VEC];
      load_vec<T, VEC>(y + off, yv);
      load_vec<T, VEC>(res + off, rv);
      if (bias != nullptr) {
        load_vec<T, VEC>(bias + static_cast<int64_t>(j) * VEC, bv);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) bv[i] = 0.f;
      }
      bias_dropout_residual_values<VEC>(yv, bv, rv, drop, seed, offset, row,
                                        static_cast<int64_t>(j) * VEC, C, o);
      store_vec<T, VEC>(x_out + off, o);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[k][i] = to_float(from_float<T>(o[i]));  // the stored x
    }
  }
  const float shift = __shfl_sync(0xffffffffu, v[0][0], 0);  // lane 0 holds column 0
  ln_warp_row<T, VEC, NV>(v, shift, lane, nvec, C, w, b, h + row * C, mean_out, rstd_out, row, eps);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kBlockThreads)
    ln_fwd_block_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                        T* __restrict__ y, float* __restrict__ mean_out,
                        float* __restrict__ rstd_out, int64_t rows, int C, float eps) {
  const int nvec = C / VEC;
  const float inv_c = 1.f / static_cast<float>(C);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * C;
    const float shift = to_float(xr[0]);
    float s1 = 0.f, s2 = 0.f;
    for (int j = threadIdx.x; j < nvec; j += kBlockThreads) {
      float v[VEC];
      load_vec<T, VEC>(xr + static_cast<int64_t>(j) * VEC, v);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float d = v[i] - shift;
        s1 += d;
        s2 += d * d;
      }
    }
    block_allreduce2(s1, s2);
    const float mean_shifted = s1 * inv_c;
    const float var = fmaxf(s2 * inv_c - mean_shifted * mean_shifted, 0.f);
    const float rstd = rsqrtf(var + eps);
    if (threadIdx.x == 0) {
      mean_out[row] = shift + mean_shifted;
      rstd_out[row] = rstd;
    }
    T* yr = y + row * C;
    for (int j = threadIdx.x; j < nvec; j += kBlockThreads) {
      float v[VEC], wv[VEC], bv[VEC];
      load_vec<T, VEC>(xr + static_cast<int64_t>(j) * VEC, v);
      load_wb<T, VEC>(w, b, static_cast<int64_t>(j) * VEC, wv, bv);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = ((v[i] - shift) - mean_shifted) * rstd * wv[i] + bv[i];
      store_vec<T, VEC>(yr + static_cast<int64_t>(j) * VEC, v);
    }
  }
}

// ---------------------------------------------------------------- backward
// xhat from the saved tensor: x (normal) or y (invertible).
__device__ __forceinline__ float make_xhat(float saved, float w, float b, float mean, float rstd,
                                           bool invertible) {
  return invertible ? (saved - b) / w : (saved - mean) * rstd;
}

// Register path of the backward: block (BT, 256 / BT); threadIdx.y picks one of R = 256 / BT rows
// processed at once, BT threads share a row and each holds NV vectors of it (column j*VEC with
// j = threadIdx.x + k * BT).  dw/db are per-thread column sums over the rows of the block, reduced
// over threadIdx.y at the end and written as one partial row per block.
//
// DROP (the fused sublayer boundary's backward, bias_dropout_residual_layer_norm_bwd): dx is also
// the gradient of x = residual + dropout(y + bias), so the same pass writes y's gradient
// gy = dropout mask * scale * dx (of the stored, rounded dx, as bias_dropout_residual_bwd reads it;
// mask regenerated from `rng`) and sums it into bias-gradient partials (part_g).
template <typename T, int VEC, int NV, bool DROP = false>
__global__ void __launch_bounds__(kBlockThreads)
    ln_bwd_rows_kernel(const T* __restrict__ grad, const T* __restrict__ saved,
                       const T* __restrict__ w, const T* __restrict__ b,
                       const float* __restrict__ mean, const float* __restrict__ rstd,
                       const T* __restrict__ res, T* __restrict__ dx, float* __restrict__ part_w,
                       float* __restrict__ part_b, int64_t rows, int C, bool invertible,
                       T* __restrict__ gy, float* __restrict__ part_g, DropoutArgs drop,
                       const int64_t* __restrict__ rng) {
  __shared__ float red[kBlockThreads / kWarp][2];
  __shared__ float colsum[kBlockThreads * VEC];
  const int BT = blockDim.x, R = blockDim.y;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int tid = ty * BT + tx;
  const int warp_in_row = tx / kWarp, warps_per_row = BT / kWarp;
  const int nvec = C / VEC;
  const float inv_c = 1.f / static_cast<float>(C);
  float acc_w[NV][VEC], acc_b[NV][VEC], acc_g[NV][VEC];
#pragma unroll
  for (int k = 0; k < NV; ++k)
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc_w[k][i] = acc_b[k][i] = acc_g[k][i] = 0.f;
  uint64_t seed = 0, offset = 0;
  if constexpr (DROP) {
    seed = static_cast<uint64_t>(rng[0]);
    offset = static_cast<uint64_t>(rng[1]);
  }

  // Uniform trip count over the block (the loop body has barriers).
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * R; base < rows;
       base += static_cast<int64_t>(gridDim.x) * R) {
    const int64_t row = base + ty;
    const bool active = row < rows;
    const float rs = active ? rstd[row] : 0.f;
    const float mu = (active && !invertible) ? mean[row] : 0.f;
    // Every load of the row and its dropout mask come before the row reduction, so their
    // latency overlaps the reduction.
    float d[NV][VEC], xh[NV][VEC], r[NV][VEC];
    bool keep[NV][VEC];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int j = tx + k * BT;
#pragma unroll
      for (int i = 0; i < VEC; ++i) r[k][i] = 0.f;
      if (active && j < nvec) {
        load_vec<T, VEC>(grad + row * C + j * VEC, d[k]);
        load_vec<T, VEC>(saved + row * C + j * VEC, xh[k]);
        if (res != nullptr) load_vec<T, VEC>(res + row * C + j * VEC, r[k]);
        if constexpr (DROP) {
          static_assert(VEC % 4 == 0, "whole Philox words per vector");
          keep_mask<VEC>(seed, offset, row, static_cast<int64_t>(j) * VEC, C, drop.threshold,
                         keep[k]);
        }
      }
    }
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int j = tx + k * BT;
      if (active && j < nvec) {
        float wv[VEC], bv[VEC];
        load_wb<T, VEC>(w, b, static_cast<int64_t>(j) * VEC, wv, bv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float g = d[k][i];
          const float xhat = make_xhat(xh[k][i], wv[i], bv[i], mu, rs, invertible);
          acc_w[k][i] += g * xhat;
          acc_b[k][i] += g;
          const float dd = g * wv[i];
          s1 += dd;
          s2 += dd * xhat;
          d[k][i] = dd;
          xh[k][i] = xhat;
        }
      }
    }
    warp_allreduce2(s1, s2);
    if (warps_per_row > 1) {  // uniform over the block
      if ((tx % kWarp) == 0) {
        red[ty * warps_per_row + warp_in_row][0] = s1;
        red[ty * warps_per_row + warp_in_row][1] = s2;
      }
      __syncthreads();
      s1 = 0.f;
      s2 = 0.f;
      for (int q = 0; q < warps_per_row; ++q) {
        s1 += red[ty * warps_per_row + q][0];
        s2 += red[ty * warps_per_row + q][1];
      }
      __syncthreads();
    }
    s1 *= inv_c;
    s2 *= inv_c;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int j = tx + k * BT;
      if (active && j < nvec) {
        float o[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) o[i] = rs * (d[k][i] - s1 - xh[k][i] * s2) + r[k][i];
        store_vec<T, VEC>(dx + row * C + j * VEC, o);
        if constexpr (DROP) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            o[i] = keep[k][i] ? to_float(from_float<T>(o[i])) * drop.scale : 0.f;
            acc_g[k][i] += o[i];
          }
          store_vec<T, VEC>(gy + row * C + j * VEC, o);
        }
      }
    }
  }

  // Column partials of dw, db and (DROP) the bias gradient: each array present is reduced over
  // the block's rows (conditions uniform over the block: barriers inside).
#pragma unroll
  for (int which = 0; which < 3; ++which) {
    float* part = which == 0 ? part_w : which == 1 ? part_b : part_g;
    if (part == nullptr) continue;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        colsum[(ty * VEC + i) * BT + tx] =
            which == 0 ? acc_w[k][i] : which == 1 ? acc_b[k][i] : acc_g[k][i];
      __syncthreads();
      // BT * VEC sums over R rows; flat e = i * BT + t  ->  column (t + k * BT) * VEC + i.
      for (int e = tid; e < BT * VEC; e += BT * R) {
        const int i = e / BT, t = e % BT;
        const int j = t + k * BT;
        float s = 0.f;
        for (int q = 0; q < R; ++q) s += colsum[(q * VEC + i) * BT + t];
        if (j < nvec) part[static_cast<int64_t>(blockIdx.x) * C + static_cast<int64_t>(j) * VEC + i] = s;
      }
      __syncthreads();
    }
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kBlockThreads)
    ln_bwd_block_kernel(const T* __restrict__ grad, const T* __restrict__ saved,
                        const T* __restrict__ w, const T* __restrict__ b,
                        const float* __restrict__ mean, const float* __restrict__ rstd,
                        const T* __restrict__ res, T* __restrict__ dx, int64_t rows, int C,
                        bool invertible) {
  const int nvec = C / VEC;
  const float inv_c = 1.f / static_cast<float>(C);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float rs = rstd[row];
    const float mu = invertible ? 0.f : mean[row];
    float s1 = 0.f, s2 = 0.f;
    for (int j = threadIdx.x; j < nvec; j += kBlockThreads) {
      const int64_t off = static_cast<int64_t>(j) * VEC;
      float g[VEC], sv[VEC], wv[VEC], bv[VEC];
      load_vec<T, VEC>(grad + row * C + off, g);
      load_vec<T, VEC>(saved + row * C + off, sv);
      load_wb<T, VEC>(w, b, off, wv, bv);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float dd = g[i] * wv[i];
        s1 += dd;
        s2 += dd * make_xhat(sv[i], wv[i], bv[i], mu, rs, invertible);
      }
    }
    block_allreduce2(s1, s2);
    s1 *= inv_c;
    s2 *= inv_c;
    for (int j = threadIdx.x; j < nvec; j += kBlockThreads) {
      const int64_t off = static_cast<int64_t>(j) * VEC;
      float g[VEC], sv[VEC], wv[VEC], bv[VEC], r[VEC];
      load_vec<T, VEC>(grad + row * C + off, g);
      load_vec<T, VEC>(saved + row * C + off, sv);
      load_wb<T, VEC>(w, b, off, wv, bv);
      if (res != nullptr) {
        load_vec<T, VEC>(res + row * C + off, r);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) r[i] = 0.f;
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        g[i] = rs * (g[i] * wv[i] - s1 - make_xhat(sv[i], wv[i], bv[i], mu, rs, invertible) * s2) +
               r[i];
      store_vec<T, VEC>(dx + row * C + off, g);
    }
  }
}

// dw/db partials for the block path: grid (ceil(C/32), chunks), block (32, 8).
template <typename T>
__global__ void __launch_bounds__(256)
    ln_dwdb_kernel(const T* __restrict__ grad, const T* __restrict__ saved,
                   const T* __restrict__ w, const T* __restrict__ b,
                   const float* __restrict__ mean, const float* __restrict__ rstd,
                   float* __restrict__ part_w, float* __restrict__ part_b, int64_t rows, int C,
                   bool invertible) {
  __shared__ float sw[8][kWarp + 1], sb[8][kWarp + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kWarp + threadIdx.x;
  float aw = 0.f, ab = 0.f;
  if (c < C) {
    const float wc = w != nullptr ? to_float(w[c]) : 1.f;
    const float bc = b != nullptr ? to_float(b[c]) : 0.f;
    for (int64_t row = static_cast<int64_t>(blockIdx.y) * 8 + threadIdx.y; row < rows;
         row += static_cast<int64_t>(gridDim.y) * 8) {
      const float g = to_float(grad[row * C + c]);
      const float xhat = make_xhat(to_float(saved[row * C + c]), wc, bc,
                                   invertible ? 0.f : mean[row], rstd[row], invertible);
      aw += g * xhat;
      ab += g;
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float tw = 0.f, tb = 0.f;
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      tw += sw[q][threadIdx.x];
      tb += sb[q][threadIdx.x];
    }
    part_w[static_cast<int64_t>(blockIdx.y) * C + c] = tw;
    part_b[static_cast<int64_t>(blockIdx.y) * C + c] = tb;
  }
}

// Up to three [chunks, C] float32 partial arrays and their [C] outputs, summed by one launch.
struct ColumnSums {
  const float* part[3];
  void* out[3];
};

// Sum of per-block column partials: out[a] [C] (T) = the column sums of part[a] [chunks, C]
// (float), the array a picked by blockIdx.y. Block (32, 32): threadIdx.x picks the column,
// threadIdx.y a strided subset of the chunks; the 32 subtotals are added in a fixed order
// (deterministic).
template <typename T>
__global__ void __launch_bounds__(1024)
    column_sum_kernel(ColumnSums sums, int64_t chunks, int64_t C) {
  __shared__ float sub[32][33];
  const float* __restrict__ partial = sums.part[blockIdx.y];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.f;
  if (c < C) {
#pragma unroll 4
    for (int64_t k = threadIdx.y; k < chunks; k += 32) s += partial[k * C + c];
  }
  sub[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float t = 0.f;
#pragma unroll
    for (int q = 0; q < 32; ++q) t += sub[q][threadIdx.x];
    reinterpret_cast<T*>(sums.out[blockIdx.y])[c] = from_float<T>(t);
  }
}

// ---------------------------------------------------------------- host side



// Vectors per lane for the warp kernels (1, 2, 4 or 8), or 0 for the block kernels.
int vectors_per_lane(int nvec) {
  const int need = (nvec + kWarp - 1) / kWarp;
  if (need <= 1) return 1;
  if (need <= 2) return 2;
  if (need <= 4) return 4;
  if (need <= 8) return 8;
  return 0;
}

// ln_bwd_rows_kernel's block for rows of nvec vectors: BT threads share a row, enough for one
// vector each (NV = 1) up to 256, then NV = 2; 256 / BT rows at once.
dim3 bwd_rows_block(int nvec, int& nv) {
  nv = nvec <= kBlockThreads ? 1 : 2;
  int bt = kWarp;
  while (bt * nv < nvec && bt < kBlockThreads) bt *= 2;
  return dim3(bt, kBlockThreads / bt);
}

// Its grid: at most 4 resident blocks (32 warps) per SM, enough loads in flight for full
// bandwidth while keeping the column partials (one row per block) small.
template <typename Kernel>
int64_t bwd_rows_grid(Kernel kernel, int64_t rows, const dim3& block, int dev) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlockThreads, 0));
  const int64_t resident = static_cast<int64_t>(std::min(std::max(per_sm, 1), 4)) * sm_count(dev);
  return std::max<int64_t>(1, std::min<int64_t>((rows + block.y - 1) / block.y, resident));
}

// Each out [C] = the fixed-order column sum of its float32 partials [chunks, C]; pairs whose
// partials are undefined are skipped, the rest share one launch.
template <typename T>
void sum_partials(std::initializer_list<std::pair<at::Tensor, at::Tensor>> pairs, int64_t chunks,
                  int C, cudaStream_t stream) {
  ColumnSums sums{};
  unsigned n = 0;
  for (const auto& [part, out] : pairs) {
    if (!part.defined()) continue;
    sums.part[n] = part.data_ptr<float>();
    sums.out[n] = out.data_ptr();
    ++n;
  }
  if (n == 0) return;
  column_sum_kernel<T><<<dim3(static_cast<unsigned>((C + 31) / 32), n), dim3(32, 32), 0, stream>>>(
      sums, chunks, C);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_affine(const std::optional<at::Tensor>& t, const at::Tensor& x, int64_t C,
                  const char* what, const char* name) {
  if (!t.has_value()) return;
  LSF_CHECK(t->is_cuda() && t->device() == x.device(), name, ": ", what,
              " must be on the device of x");
  LSF_CHECK(t->numel() == C, name, ": ", what, " must have C = ", C, " elements, got shape ",
              t->sizes());
  LSF_CHECK(t->scalar_type() == x.scalar_type(), name, ": ", what, " dtype ", t->scalar_type(),
              " differs from x dtype ", x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const at::Tensor& x_in,
                                                               const std::optional<at::Tensor>& w_in,
                                                               const std::optional<at::Tensor>& b_in,
                                                               double eps, bool invertible) {
  const char* name = "ls_fairseq layer_norm_fwd";
  LSF_CHECK(x_in.is_cuda(), name, ": expected a CUDA tensor");
  LSF_CHECK(x_in.dim() >= 1 && x_in.size(-1) > 0, name,
              ": expected x of shape [..., C] with C > 0, got ", x_in.sizes());
  const int64_t C64 = x_in.size(-1);
  LSF_CHECK(C64 <= (1 << 30), name, ": hidden size ", C64, " too large");
  const int C = static_cast<int>(C64);
  check_affine(w_in, x_in, C, "weight", name);
  check_affine(b_in, x_in, C, "bias", name);
  LSF_CHECK(eps >= 0.0, name, ": eps must be >= 0");
  c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous();
  const int64_t rows = x.numel() / C;
  std::optional<at::Tensor> w, b;
  if (w_in.has_value()) w = w_in->contiguous();
  if (b_in.has_value()) b = b_in->contiguous();
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto mean = at::empty({rows}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows == 0) return {y, mean, rstd};
  auto stream = c10::cuda::getCurrentCUDAStream();
  LSF_DISPATCH_FLOAT_TYPES(x.scalar_type(), name, [&] {
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    const T* wp = w ? reinterpret_cast<const T*>(w->data_ptr()) : nullptr;
    const T* bp = b ? reinterpret_cast<const T*>(b->data_ptr()) : nullptr;
    T* yp = reinterpret_cast<T*>(y.data_ptr());
    float* mp = mean.data_ptr<float>();
    float* rp = rstd.data_ptr<float>();
    const float feps = static_cast<float>(eps);
    auto run = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const int nv = vectors_per_lane(C / VEC);
      const unsigned warp_grid = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
      const dim3 wblock(kWarp * kWarpsPerBlock);
      switch (nv) {
        case 1: ln_fwd_warp_kernel<T, VEC, 1><<<warp_grid, wblock, 0, stream>>>(xp, wp, bp, yp, mp, rp, rows, C, feps); break;
        case 2: ln_fwd_warp_kernel<T, VEC, 2><<<warp_grid, wblock, 0, stream>>>(xp, wp, bp, yp, mp, rp, rows, C, feps); break;
        case 4: ln_fwd_warp_kernel<T, VEC, 4><<<warp_grid, wblock, 0, stream>>>(xp, wp, bp, yp, mp, rp, rows, C, feps); break;
        case 8: ln_fwd_warp_kernel<T, VEC, 8><<<warp_grid, wblock, 0, stream>>>(xp, wp, bp, yp, mp, rp, rows, C, feps); break;
        default: {
          const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, 1 << 20));
          ln_fwd_block_kernel<T, VEC><<<grid, kBlockThreads, 0, stream>>>(xp, wp, bp, yp, mp, rp, rows, C, feps);
        }
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    constexpr int V = 16 / sizeof(T);
    if (use_vec<T>(C, {xp, wp, bp, yp})) {
      run(std::integral_constant<int, V>{});
    } else {
      run(std::integral_constant<int, 1>{});
    }
  });
  return {y, mean, rstd};
}

// (x, h, mean, rstd, rng): x = residual + dropout(y + bias), h = LayerNorm(x), with the Philox
// state rng that bias_dropout_residual_bwd regenerates the mask from. Rows held by one warp in
// 16-byte vectors only (C % 8 == 0 and C <= 2048 for fp16/bf16, C % 4 == 0 and C <= 1024 for fp32,
// 16-byte aligned data); ops/bias_dropout_residual_layer_norm.py composes the two ops otherwise.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bdr_layer_norm_fwd(
    const at::Tensor& y_in, const std::optional<at::Tensor>& bias_in, const at::Tensor& res_in,
    const std::optional<at::Tensor>& w_in, const std::optional<at::Tensor>& b_in, double p,
    bool train, double eps) {
  const char* name = "ls_fairseq bias_dropout_residual_layer_norm_fwd";
  LSF_CHECK(y_in.is_cuda(), name, ": expected a CUDA tensor");
  LSF_CHECK(y_in.dim() >= 1 && y_in.size(-1) > 0, name,
            ": expected y of shape [..., C] with C > 0, got ", y_in.sizes());
  LSF_CHECK(res_in.sizes() == y_in.sizes() && res_in.scalar_type() == y_in.scalar_type() &&
                res_in.device() == y_in.device(),
            name, ": residual must have the shape, dtype and device of y");
  const int64_t C64 = y_in.size(-1);
  const int64_t vec = 16 / static_cast<int64_t>(y_in.element_size());
  LSF_CHECK(C64 % vec == 0 && C64 / vec <= 8 * kWarp, name, ": hidden size ", C64,
            " must be a multiple of ", vec, " and at most ", 8 * kWarp * vec,
            " (use bias_dropout_residual then layer_norm)");
  const int C = static_cast<int>(C64);
  check_affine(bias_in, y_in, C, "bias", name);
  check_affine(w_in, y_in, C, "weight", name);
  check_affine(b_in, y_in, C, "LayerNorm bias", name);
  LSF_CHECK(eps >= 0.0, name, ": eps must be >= 0");
  c10::cuda::CUDAGuard guard(y_in.device());
  const auto y = y_in.contiguous();
  const auto res = res_in.contiguous();
  std::optional<at::Tensor> bias, w, b;
  if (bias_in.has_value()) bias = bias_in->contiguous();
  if (w_in.has_value()) w = w_in->contiguous();
  if (b_in.has_value()) b = b_in->contiguous();
  const int64_t rows = y.numel() / C;
  auto x = at::empty_like(y, at::MemoryFormat::Contiguous);
  auto h = at::empty_like(y, at::MemoryFormat::Contiguous);
  auto mean = at::empty({rows}, y.options().dtype(at::kFloat));
  auto rstd = at::empty({rows}, y.options().dtype(at::kFloat));
  const DropoutArgs drop = make_dropout("ls_fairseq dropout", p, train);
  auto rng = rows == 0 ? at::zeros({2}, y.options().dtype(at::kLong))
                       : at::empty({2}, y.options().dtype(at::kLong));
  if (rows == 0) return {x, h, mean, rstd, rng};
  at::PhiloxCudaState philox;
  if (drop.enabled) philox = next_philox(y);
  auto stream = c10::cuda::getCurrentCUDAStream();
  LSF_DISPATCH_FLOAT_TYPES(y.scalar_type(), name, [&] {
    constexpr int VEC = 16 / sizeof(T);
    const T* yp = reinterpret_cast<const T*>(y.data_ptr());
    const T* bp = bias ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr;
    const T* rp = reinterpret_cast<const T*>(res.data_ptr());
    const T* wp = w ? reinterpret_cast<const T*>(w->data_ptr()) : nullptr;
    const T* lbp = b ? reinterpret_cast<const T*>(b->data_ptr()) : nullptr;
    T* xp = reinterpret_cast<T*>(x.data_ptr());
    T* hp = reinterpret_cast<T*>(h.data_ptr());
    LSF_CHECK(use_vec<T>(C, {yp, bp, rp, wp, lbp, xp, hp}), name,
              ": inputs must be 16-byte aligned");
    float* mp = mean.data_ptr<float>();
    float* sp = rstd.data_ptr<float>();
    int64_t* rngp = rng.data_ptr<int64_t>();
    const float feps = static_cast<float>(eps);
    const unsigned grid = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
    const dim3 block(kWarp * kWarpsPerBlock);
    auto launch = [&](auto nv_tag) {
      constexpr int NV = decltype(nv_tag)::value;
      bdr_ln_fwd_warp_kernel<T, VEC, NV><<<grid, block, 0, stream>>>(
          yp, bp, rp, xp, wp, lbp, hp, mp, sp, rows, C, feps, drop, philox, rngp);
    };
    switch (vectors_per_lane(C / VEC)) {
      case 1: launch(std::integral_constant<int, 1>{}); break;
      case 2: launch(std::integral_constant<int, 2>{}); break;
      case 4: launch(std::integral_constant<int, 4>{}); break;
      default: launch(std::integral_constant<int, 8>{}); break;
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {x, h, mean, rstd, rng};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(
    const at::Tensor& grad_in, const at::Tensor& saved_in, const std::optional<at::Tensor>& w_in,
    const std::optional<at::Tensor>& b_in, const std::optional<at::Tensor>& mean_in,
    const at::Tensor& rstd_in, bool invertible, bool weight_grad, bool bias_grad,
    const std::optional<at::Tensor>& residual_grad_in) {
  const char* name = "ls_fairseq layer_norm_bwd";
  LSF_CHECK(grad_in.is_cuda(), name, ": expected a CUDA tensor");
  LSF_CHECK(grad_in.sizes() == saved_in.sizes() && grad_in.scalar_type() == saved_in.scalar_type() &&
                  grad_in.device() == saved_in.device(),
              name, ": the saved input/output must have the shape, dtype and device of grad");
  LSF_CHECK(grad_in.dim() >= 1 && grad_in.size(-1) > 0, name, ": expected [..., C] with C > 0");
  const int C = static_cast<int>(grad_in.size(-1));
  const int64_t rows = grad_in.numel() / C;
  check_affine(w_in, grad_in, C, "weight", name);
  check_affine(b_in, grad_in, C, "bias", name);
  LSF_CHECK(invertible || mean_in.has_value(), name, ": mean is required unless invertible");
  LSF_CHECK(rstd_in.numel() == rows && rstd_in.scalar_type() == at::kFloat, name,
              ": rstd must be float32 with one entry per row");
  LSF_CHECK(invertible || (mean_in->numel() == rows && mean_in->scalar_type() == at::kFloat), name,
              ": mean must be float32 with one entry per row");
  LSF_CHECK(!weight_grad || w_in.has_value(), name, ": weight_grad needs a weight");
  LSF_CHECK(!bias_grad || b_in.has_value(), name, ": bias_grad needs a bias");
  LSF_CHECK(!residual_grad_in.has_value() ||
                (residual_grad_in->sizes() == grad_in.sizes() &&
                 residual_grad_in->scalar_type() == grad_in.scalar_type() &&
                 residual_grad_in->device() == grad_in.device()),
            name, ": residual_grad must have the shape, dtype and device of grad");
  c10::cuda::CUDAGuard guard(grad_in.device());
  const auto grad = grad_in.contiguous();
  const auto saved = saved_in.contiguous();
  const auto rstd = rstd_in.contiguous();
  at::Tensor mean;
  if (!invertible) mean = mean_in->contiguous();
  std::optional<at::Tensor> w, b;
  if (w_in.has_value()) w = w_in->contiguous();
  if (b_in.has_value()) b = b_in->contiguous();
  at::Tensor res;
  if (residual_grad_in.has_value()) res = residual_grad_in->contiguous();
  auto dx = at::empty_like(grad, at::MemoryFormat::Contiguous);
  const bool need_wb = weight_grad || bias_grad;
  at::Tensor dw = at::empty({weight_grad ? C : 0}, grad.options());
  at::Tensor db = at::empty({bias_grad ? C : 0}, grad.options());
  if (rows == 0) {
    if (weight_grad) dw.zero_();
    if (bias_grad) db.zero_();
    return {dx, dw, db};
  }
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int dev = grad.get_device();
  LSF_DISPATCH_FLOAT_TYPES(grad.scalar_type(), name, [&] {
    const T* gp = reinterpret_cast<const T*>(grad.data_ptr());
    const T* sp = reinterpret_cast<const T*>(saved.data_ptr());
    const T* wp = w ? reinterpret_cast<const T*>(w->data_ptr()) : nullptr;
    const T* bp = b ? reinterpret_cast<const T*>(b->data_ptr()) : nullptr;
    const float* mp = invertible ? nullptr : mean.data_ptr<float>();
    const float* rp = rstd.data_ptr<float>();
    const T* resp = res.defined() ? reinterpret_cast<const T*>(res.data_ptr()) : nullptr;
    T* dxp = reinterpret_cast<T*>(dx.data_ptr());
    at::Tensor part_w, part_b;
    int64_t chunks = 0;
    auto finish = [&]() {
      sum_partials<T>({{weight_grad ? part_w : at::Tensor(), dw},
                       {bias_grad ? part_b : at::Tensor(), db}}, chunks, C, stream);
    };
    auto run = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const int nvec = C / VEC;
      if (nvec <= 2 * kBlockThreads) {
        int nv = 1;
        const dim3 block = bwd_rows_block(nvec, nv);
        auto launch = [&](auto kernel) {
          const int64_t grid = bwd_rows_grid(kernel, rows, block, dev);
          chunks = grid;
          if (need_wb) {
            part_w = at::empty({grid, C}, grad.options().dtype(at::kFloat));
            part_b = at::empty({grid, C}, grad.options().dtype(at::kFloat));
          }
          kernel<<<static_cast<unsigned>(grid), block, 0, stream>>>(
              gp, sp, wp, bp, mp, rp, resp, dxp, need_wb ? part_w.data_ptr<float>() : nullptr,
              need_wb ? part_b.data_ptr<float>() : nullptr, rows, C, invertible, nullptr, nullptr,
              DropoutArgs{false, 0u, 1.f}, nullptr);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        };
        if (nv == 1) {
          launch(ln_bwd_rows_kernel<T, VEC, 1>);
        } else {
          launch(ln_bwd_rows_kernel<T, VEC, 2>);
        }
      } else {
        const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, 1 << 20));
        ln_bwd_block_kernel<T, VEC><<<grid, kBlockThreads, 0, stream>>>(
            gp, sp, wp, bp, mp, rp, resp, dxp, rows, C, invertible);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (need_wb) {
          const int64_t gx = (C + kWarp - 1) / kWarp;
          const int64_t target = static_cast<int64_t>(sm_count(dev)) * 8;
          chunks = std::max<int64_t>(1, std::min<int64_t>({(rows + 7) / 8, target / gx + 1, 65535}));
          part_w = at::empty({chunks, C}, grad.options().dtype(at::kFloat));
          part_b = at::empty({chunks, C}, grad.options().dtype(at::kFloat));
          ln_dwdb_kernel<T><<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(chunks)),
                              dim3(kWarp, 8), 0, stream>>>(gp, sp, wp, bp, mp, rp,
                                                           part_w.data_ptr<float>(),
                                                           part_b.data_ptr<float>(), rows, C,
                                                           invertible);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      }
      finish();
    };
    constexpr int V = 16 / sizeof(T);
    if (use_vec<T>(C, {gp, sp, wp, bp, resp, dxp})) {
      run(std::integral_constant<int, V>{});
    } else {
      run(std::integral_constant<int, 1>{});
    }
  });
  return {dx, dw, db};
}

// Backward of bias_dropout_residual_layer_norm_fwd with dropout: from grad_h (and x's own gradient
// grad_x, the residual stream's), dx = LayerNorm's input gradient + grad_x, gy = dropout'(dx) and
// the bias gradient (y's), plus dw/dlb when asked for: one pass instead of layer_norm_bwd then
// bias_dropout_residual_bwd. Register path only (C / VEC <= 512 16-byte vectors: every C the
// fused forward takes). Returns (dx, gy, dw, dlb, dbias); unrequested gradients are empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bdr_layer_norm_bwd(
    const at::Tensor& grad_in, const at::Tensor& x_in, const std::optional<at::Tensor>& w_in,
    const std::optional<at::Tensor>& b_in, const at::Tensor& mean_in, const at::Tensor& rstd_in,
    const std::optional<at::Tensor>& grad_x_in, const at::Tensor& rng, double p, bool train,
    bool weight_grad, bool ln_bias_grad, bool bias_grad) {
  const char* name = "ls_fairseq bias_dropout_residual_layer_norm_bwd";
  LSF_CHECK(grad_in.is_cuda() && grad_in.sizes() == x_in.sizes() &&
                grad_in.scalar_type() == x_in.scalar_type() && grad_in.device() == x_in.device(),
            name, ": grad and x must be CUDA tensors of one shape and dtype");
  LSF_CHECK(grad_in.dim() >= 1 && grad_in.size(-1) > 0, name, ": expected [..., C] with C > 0");
  const int C = static_cast<int>(grad_in.size(-1));
  const int64_t rows = grad_in.numel() / C;
  const int64_t vec = 16 / static_cast<int64_t>(grad_in.element_size());
  LSF_CHECK(C % vec == 0 && C / vec <= 2 * kBlockThreads, name, ": hidden size ", C,
            " must be a multiple of ", vec, " and at most ", 2 * kBlockThreads * vec);
  check_affine(w_in, grad_in, C, "weight", name);
  check_affine(b_in, grad_in, C, "LayerNorm bias", name);
  LSF_CHECK(mean_in.numel() == rows && rstd_in.numel() == rows &&
                mean_in.scalar_type() == at::kFloat && rstd_in.scalar_type() == at::kFloat,
            name, ": mean and rstd must be float32 with one entry per row");
  LSF_CHECK(!weight_grad || w_in.has_value(), name, ": weight_grad needs a weight");
  LSF_CHECK(!ln_bias_grad || b_in.has_value(), name, ": ln_bias_grad needs a LayerNorm bias");
  LSF_CHECK(!grad_x_in.has_value() || (grad_x_in->sizes() == grad_in.sizes() &&
                                       grad_x_in->scalar_type() == grad_in.scalar_type() &&
                                       grad_x_in->device() == grad_in.device()),
            name, ": grad_x must have the shape, dtype and device of grad");
  const DropoutArgs drop = make_dropout("ls_fairseq dropout", p, train);
  LSF_CHECK(drop.enabled, name, ": only with dropout (without it, y's gradient is dx itself)");
  LSF_CHECK(rng.numel() == 2 && rng.scalar_type() == at::kLong && rng.device() == grad_in.device(),
            name, ": rng must be the int64[2] tensor returned by the forward");
  c10::cuda::CUDAGuard guard(grad_in.device());
  const auto grad = grad_in.contiguous();
  const auto x = x_in.contiguous();
  const auto mean = mean_in.contiguous();
  const auto rstd = rstd_in.contiguous();
  std::optional<at::Tensor> w, b;
  if (w_in.has_value()) w = w_in->contiguous();
  if (b_in.has_value()) b = b_in->contiguous();
  at::Tensor res;
  if (grad_x_in.has_value()) res = grad_x_in->contiguous();
  auto dx = at::empty_like(grad, at::MemoryFormat::Contiguous);
  auto gy = at::empty_like(grad, at::MemoryFormat::Contiguous);
  at::Tensor dw = at::empty({weight_grad ? C : 0}, grad.options());
  at::Tensor dlb = at::empty({ln_bias_grad ? C : 0}, grad.options());
  at::Tensor dbias = at::empty({bias_grad ? C : 0}, grad.options());
  if (rows == 0) {
    dw.zero_();
    dlb.zero_();
    dbias.zero_();
    return {dx, gy, dw, dlb, dbias};
  }
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int dev = grad.get_device();
  LSF_DISPATCH_FLOAT_TYPES(grad.scalar_type(), name, [&] {
    constexpr int VEC = 16 / sizeof(T);
    const T* gp = reinterpret_cast<const T*>(grad.data_ptr());
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    const T* wp = w ? reinterpret_cast<const T*>(w->data_ptr()) : nullptr;
    const T* bp = b ? reinterpret_cast<const T*>(b->data_ptr()) : nullptr;
    const T* resp = res.defined() ? reinterpret_cast<const T*>(res.data_ptr()) : nullptr;
    T* dxp = reinterpret_cast<T*>(dx.data_ptr());
    T* gyp = reinterpret_cast<T*>(gy.data_ptr());
    LSF_CHECK(use_vec<T>(C, {gp, xp, wp, bp, resp, dxp, gyp}), name,
              ": inputs must be 16-byte aligned");
    int nv = 1;
    const dim3 block = bwd_rows_block(C / VEC, nv);
    auto launch = [&](auto kernel) {
      const int64_t grid = bwd_rows_grid(kernel, rows, block, dev);
      auto partial = [&](bool need) {
        return need ? at::empty({grid, C}, grad.options().dtype(at::kFloat)) : at::Tensor();
      };
      const at::Tensor part_w = partial(weight_grad), part_b = partial(ln_bias_grad),
                       part_g = partial(bias_grad);
      auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
      kernel<<<static_cast<unsigned>(grid), block, 0, stream>>>(
          gp, xp, wp, bp, mean.data_ptr<float>(), rstd.data_ptr<float>(), resp, dxp, ptr(part_w),
          ptr(part_b), rows, C, false, gyp, ptr(part_g), drop, rng.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      sum_partials<T>({{part_w, dw}, {part_b, dlb}, {part_g, dbias}}, grid, C, stream);
    };
    if (nv == 1) {
      launch(ln_bwd_rows_kernel<T, VEC, 1, true>);
    } else {
      launch(ln_bwd_rows_kernel<T, VEC, 2, true>);
    }
  });
  return {dx, gy, dw, dlb, dbias};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ls_fairseq, m) {
  m.def("layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps, bool invertible=False) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("layer_norm_bwd(Tensor grad, Tensor saved, Tensor? weight, Tensor? bias, Tensor? mean, "
        "Tensor rstd, bool invertible, bool weight_grad, bool bias_grad, Tensor? residual_grad=None) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("bias_dropout_residual_layer_norm_fwd(Tensor y, Tensor? bias, Tensor residual, "
        "Tensor? weight, Tensor? ln_bias, float p, bool train, float eps) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        {at::Tag::nondeterministic_seeded});
  m.def("bias_dropout_residual_layer_norm_bwd(Tensor grad, Tensor x, Tensor? weight, "
        "Tensor? ln_bias, Tensor mean, Tensor rstd, Tensor? grad_x, Tensor rng, float p, "
        "bool train, bool weight_grad, bool ln_bias_grad, bool bias_grad) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ls_fairseq, CUDA, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd);
  m.impl("layer_norm_bwd", &layer_norm_bwd);
  m.impl("bias_dropout_residual_layer_norm_fwd", &bdr_layer_norm_fwd);
  m.impl("bias_dropout_residual_layer_norm_bwd", &bdr_layer_norm_bwd);
}
