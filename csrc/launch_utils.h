// Host-side launch helpers shared by the elementwise kernels (dropout fusions, embedding,
// LayerNorm, the fused sublayer boundary): the one dtype dispatch (LSF_DISPATCH_FLOAT_TYPES:
// float/__half/__nv_bfloat16 as T, checks without std::ostream, see check.h), multiprocessor count,
// the 16-byte-vector test, the grid of the row/column kernels and the launch of the column-sum
// kernel (sum_partials). For .cu files only (it launches a kernel).
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "check.h"
#include "device_utils.cuh"

#define LSF_DISPATCH_FLOAT_TYPES(DTYPE, NAME, ...)                                              \
  [&] {                                                                                         \
    switch (DTYPE) {                                                                            \
      case at::ScalarType::Float: {                                                             \
        using T = float;                                                                        \
        return __VA_ARGS__();                                                                   \
      }                                                                                         \
      case at::ScalarType::Half: {                                                              \
        using T = __half;                                                                       \
        return __VA_ARGS__();                                                                   \
      }                                                                                         \
      case at::ScalarType::BFloat16: {                                                          \
        using T = __nv_bfloat16;                                                                \
        return __VA_ARGS__();                                                                   \
      }                                                                                         \
      default:                                                                                  \
        LSF_CHECK(false, NAME, ": unsupported dtype ", DTYPE,                                 \
                    " (expected float32, float16 or bfloat16)");                                \
    }                                                                                           \
  }()

namespace lsf {

// inline: this header is included by several translation units of one extension
inline int sm_count(int device) {
  static int cached[64] = {0};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (device >= 0 && device < 64) cached[device] = n;
  return n;
}

// Vector (16-byte) access is possible when the row length and every base pointer allow it.
template <typename T>
bool use_vec(int64_t C, std::initializer_list<const void*> ptrs) {
  constexpr int V = 16 / sizeof(T);
  if (C % V != 0) return false;
  for (const void* p : ptrs)
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// Grid of the (kLanes x kRowThreads)-thread row/column kernels: enough row groups to fill the
// GPU once, never more than there are rows.
template <int kLanes, int kRowThreads, typename Kernel>
dim3 grid_for(Kernel kernel, int64_t rows, int64_t units, int device) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel,
                                                               kLanes * kRowThreads, 0));
  const int64_t gx = (units + kLanes - 1) / kLanes;
  const int64_t resident = static_cast<int64_t>(std::max(per_sm, 1)) * sm_count(device);
  int64_t gy = std::max<int64_t>(1, resident / std::max<int64_t>(gx, 1));
  gy = std::min<int64_t>(gy, (rows + kRowThreads - 1) / kRowThreads);
  gy = std::max<int64_t>(1, std::min<int64_t>(gy, 65535));
  LSF_CHECK(gx <= 2147483647, "ls_fairseq: hidden size too large");
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy), 1);
}


// Each out [C] = the fixed-order column sum of its float32 partials [chunks, C]; pairs whose
// partials are undefined are skipped, the rest share one launch.
template <typename T>
void sum_partials(std::initializer_list<std::pair<at::Tensor, at::Tensor>> pairs, int64_t chunks,
                  int64_t C, cudaStream_t stream) {
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

}  // namespace lsf
