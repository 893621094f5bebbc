// Host-side launch helpers shared by the elementwise kernels (dropout fusions, embedding,
// LayerNorm): dtype dispatch (checks without std::ostream, see check.h), multiprocessor count,
// the 16-byte-vector test and the grid of the row/column kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "check.h"

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

}  // namespace lsf
