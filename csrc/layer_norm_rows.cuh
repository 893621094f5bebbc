// LayerNorm's row code, shared by csrc/layer_norm.cu (LayerNorm) and
// csrc/bias_dropout_residual_layer_norm.cu (the fused pre-LN sublayer boundary, whose forward ends
// with the same warp-per-row LayerNorm and whose backward is the same register-path kernel with the
// dropout epilogue, DROP): the block shape constants, the weight/bias loads, the warp reduction, the
// forward row (statistics, then y), xhat, the backward rows kernel and their launch geometry, and
// the affine-parameter checks. The math is documented in csrc/layer_norm.cu. For .cu files only.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "check.h"
#include "device_utils.cuh"
#include "launch_utils.h"
#include "philox_dropout.cuh"

namespace lsf {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 4;    // warp-per-row kernels
constexpr int kBlockThreads = 256;   // block-per-row kernels

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

// ---------------------------------------------------------------- host side
// Vectors per lane for the warp kernels (1, 2, 4 or 8), or 0 for the block kernels.
inline int vectors_per_lane(int nvec) {
  const int need = (nvec + kWarp - 1) / kWarp;
  if (need <= 1) return 1;
  if (need <= 2) return 2;
  if (need <= 4) return 4;
  if (need <= 8) return 8;
  return 0;
}

// ln_bwd_rows_kernel's block for rows of nvec vectors: BT threads share a row, enough for one
// vector each (NV = 1) up to 256, then NV = 2; 256 / BT rows at once.
inline dim3 bwd_rows_block(int nvec, int& nv) {
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


inline void check_affine(const std::optional<at::Tensor>& t, const at::Tensor& x, int64_t C,
                         const char* what, const char* name) {
  if (!t.has_value()) return;
  LSF_CHECK(t->is_cuda() && t->device() == x.device(), name, ": ", what,
              " must be on the device of x");
  LSF_CHECK(t->numel() == C, name, ": ", what, " must have C = ", C, " elements, got shape ",
              t->sizes());
  LSF_CHECK(t->scalar_type() == x.scalar_type(), name, ": ", what, " dtype ", t->scalar_type(),
              " differs from x dtype ", x.scalar_type());
}

}  // namespace lsf
