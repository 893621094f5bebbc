// Device helpers shared by the kernels (dropout fusions, embedding, LayerNorm and the fused
// sublayer boundary, ...): fp32 <-> storage dtype conversion, 16-byte vector loads/stores (with
// scalar tails, or whole vectors of one row), the Philox4x32-10 dropout mask, which depends only on
// (seed, offset, row, column) so backward regenerates it exactly, and the one column-sum kernel that
// turns per-block float32 partials into a bias/weight gradient in a fixed order (its host launcher
// is sum_partials in launch_utils.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace lsf {

// ---------------------------------------------------------------- dtype helpers
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Columns handled by one thread: one 16-byte vector, or 4 scalars (one Philox block).
template <int VEC>
struct Chunk {
  static constexpr int W = VEC >= 4 ? VEC : 4;
};

// Load W elements starting at column col0 of row p (p already points at the row start).
template <typename T, int VEC>
__device__ __forceinline__ void load_chunk(const T* __restrict__ p, int64_t col0, int64_t C,
                                           float (&out)[Chunk<VEC>::W]) {
  constexpr int W = Chunk<VEC>::W;
  if constexpr (VEC == W) {
    const Pack<T, VEC> pk = *reinterpret_cast<const Pack<T, VEC>*>(p + col0);
#pragma unroll
    for (int i = 0; i < W; ++i) out[i] = to_float(pk.v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) out[i] = (col0 + i < C) ? to_float(p[col0 + i]) : 0.f;
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_chunk(T* __restrict__ p, int64_t col0, int64_t C,
                                            const float (&in)[Chunk<VEC>::W]) {
  constexpr int W = Chunk<VEC>::W;
  if constexpr (VEC == W) {
    Pack<T, VEC> pk;
#pragma unroll
    for (int i = 0; i < W; ++i) pk.v[i] = from_float<T>(in[i]);
    *reinterpret_cast<Pack<T, VEC>*>(p + col0) = pk;
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i)
      if (col0 + i < C) p[col0 + i] = from_float<T>(in[i]);
  }
}

// ---------------------------------------------------------------- Philox4x32-10
__device__ __forceinline__ uint4 philox4x32_10(uint64_t seed, uint64_t subsequence,
                                               uint64_t counter) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = static_cast<uint32_t>(subsequence), c3 = static_cast<uint32_t>(subsequence >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
    const uint32_t lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return make_uint4(c0, c1, c2, c3);
}

// keep[i] for the W columns starting at col0 (a multiple of 4) of row `row`.
template <int W>
__device__ __forceinline__ void keep_mask(uint64_t seed, uint64_t offset, int64_t row,
                                          int64_t col0, int64_t C, uint32_t threshold,
                                          bool (&keep)[W]) {
  const uint64_t group0 =
      static_cast<uint64_t>(row) * static_cast<uint64_t>((C + 3) / 4) + static_cast<uint64_t>(col0 / 4);
#pragma unroll
  for (int q = 0; q < W / 4; ++q) {
    const uint4 r = philox4x32_10(seed, group0 + q, offset / 4);
    keep[4 * q + 0] = r.x >= threshold;
    keep[4 * q + 1] = r.y >= threshold;
    keep[4 * q + 2] = r.z >= threshold;
    keep[4 * q + 3] = r.w >= threshold;
  }
}

// ---------------------------------------------------------------- whole 16-byte vectors of a row
// VEC values at p (16-byte aligned when VEC * sizeof(T) == 16), as float.
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

// ---------------------------------------------------------------- column sums of partials
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

}  // namespace lsf
