// Dropout arguments shared by the kernels that draw a Philox mask (dropout fusions, embedding,
// short attention): the keep threshold and scale of a probability p, the generator state of one
// launch, its unpacking on the device (valid under CUDA graph capture), and the values of
// residual + dropout(x + bias). The mask itself is lsf::keep_mask in device_utils.cuh.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>

#include <cmath>
#include <cstdint>
#include <mutex>

#include "check.h"
#include "device_utils.cuh"

namespace lsf {

struct DropoutArgs {
  bool enabled;
  uint32_t threshold;  // keep when the Philox word >= threshold
  float scale;         // 1 / (1 - p), 0 when p == 1
};

// `what` names the op in the error message.
inline DropoutArgs make_dropout(const char* what, double p, bool train) {
  LSF_CHECK(p >= 0.0 && p <= 1.0, what, ": dropout p must be in [0, 1], got ", p);
  DropoutArgs d{train && p > 0.0, 0u, 1.f};
  if (d.enabled) {
    const double t = std::floor(p * 4294967296.0);
    d.threshold = t >= 4294967295.0 ? 4294967295u : static_cast<uint32_t>(t);
    d.scale = p < 1.0 ? static_cast<float>(1.0 / (1.0 - p)) : 0.f;
  }
  return d;
}

// Generator state for one launch. Each (row, column-group) subsequence draws one Philox block of
// 4 words per launch.
inline at::PhiloxCudaState next_philox(const at::Tensor& like) {
  auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(like.get_device()));
  std::lock_guard<std::mutex> lock(gen->mutex_);
  return gen->philox_cuda_state(4);
}

__device__ __forceinline__ void unpack_seed(const at::PhiloxCudaState& st, bool enabled,
                                            uint64_t& seed, uint64_t& offset) {
  seed = 0;
  offset = 0;
  if (enabled) {
    auto so = at::cuda::philox::unpack(st);
    seed = std::get<0>(so);
    offset = std::get<1>(so);
  }
}

// o = residual + dropout(x + bias) for the W columns starting at col0 (a multiple of 4) of `row`:
// the values of bias_dropout_residual_fwd, which the fused LayerNorm boundary reproduces bit for
// bit by calling this too.
template <int W>
__device__ __forceinline__ void bias_dropout_residual_values(const float (&x)[W],
                                                             const float (&bias)[W],
                                                             const float (&res)[W],
                                                             const DropoutArgs& drop,
                                                             uint64_t seed, uint64_t offset,
                                                             int64_t row, int64_t col0, int64_t C,
                                                             float (&o)[W]) {
  if (drop.enabled) {
    bool keep[W];
    keep_mask<W>(seed, offset, row, col0, C, drop.threshold, keep);
#pragma unroll
    for (int i = 0; i < W; ++i) o[i] = res[i] + (keep[i] ? (x[i] + bias[i]) * drop.scale : 0.f);
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) o[i] = res[i] + (x[i] + bias[i]);
  }
}

}  // namespace lsf
