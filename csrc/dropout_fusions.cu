// Fused elementwise tails of the Transformer sublayers (ls_fairseq, issue 3).
//
//   bias_dropout_residual:  out = residual + dropout(x + bias)
//   bias_act_dropout:       out = dropout(act(x + bias)),  act = relu | gelu (exact erf, as fairseq)
//   relu_dropout_bwd:       the relu case's backward from `out` alone (see the kernel)
//
// Layout: x, residual, out are [rows, C] (any leading shape, contiguous); bias is [C].
// Storage float32/float16/bfloat16, math in float32.
//
// Dropout: Philox4x32-10 keyed by the seed of torch's CUDA generator.  Element (r, c) uses
// 32-bit word (c % 4) of the Philox block at counter {offset / 4, r * ceil(C / 4) + c / 4}, so the
// mask depends only on (seed, offset, r, c) and never on the launch configuration.  The forward
// writes (seed, offset) into a small int64[2] device tensor that the backward reads, so the
// backward regenerates the mask instead of storing it (0 bytes instead of >= 1 bit per element)
// and the scheme stays valid under CUDA graph capture (unpack reads the captured seed/offset).
// An element is kept when its word >= floor(p * 2^32); kept values are scaled by 1 / (1 - p).
//
// Threads: block (32, 8).  threadIdx.x walks column chunks of W elements (one 16-byte vector when
// C allows it, else 4 scalars with a bounds check), threadIdx.y and blockIdx.y stride over rows.
// The bias gradient is a per-thread column sum, reduced across the block in shared memory and
// written as per-block partials [gridDim.y, C]; a second kernel (the column-sum kernel of
// device_utils.cuh, which LayerNorm's weight/bias gradients use too) sums them in a fixed order
// (deterministic, no atomics).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

#include "check.h"
#include "launch_utils.h"
#include "device_utils.cuh"
#include "philox_dropout.cuh"

namespace {


constexpr int kLanes = 32;
constexpr int kRowThreads = 8;

using namespace lsf;  // helpers from device_utils.cuh / launch_utils.h

// ---------------------------------------------------------------- activations
enum Act : int { kRelu = 0, kGelu = 1 };

template <int ACT>
__device__ __forceinline__ float act_fwd(float h) {
  if constexpr (ACT == kRelu) {
    return h <= 0.f ? 0.f : h;  // NaN stays NaN, as torch.relu
  } else {
    return 0.5f * h * (1.f + erff(h * 0.70710678118654752f));
  }
}

template <int ACT>
__device__ __forceinline__ float act_grad(float h) {
  if constexpr (ACT == kRelu) {
    return h > 0.f ? 1.f : 0.f;
  } else {
    const float cdf = 0.5f * (1.f + erff(h * 0.70710678118654752f));
    const float pdf = 0.39894228040143268f * expf(-0.5f * h * h);
    return cdf + h * pdf;
  }
}

int act_code(const std::string& name) {
  if (name == "relu") return kRelu;
  if (name == "gelu") return kGelu;
  LSF_CHECK(false, "ls_fairseq bias_act_dropout: activation must be 'relu' or 'gelu', got '", name,
              "'");
  return -1;
}

// ---------------------------------------------------------------- launch helpers
// (the column sum of the partials is lsf::column_sum_kernel, device_utils.cuh, launched by
// lsf::sum_partials, launch_utils.h)

// Block-reduce the per-thread column sums acc[W] over threadIdx.y and write one partial row.
template <int W>
__device__ __forceinline__ void write_partial(const float (&acc)[W], float* __restrict__ partial,
                                              int64_t C) {
  __shared__ float smem[kRowThreads][W * kLanes];
#pragma unroll
  for (int i = 0; i < W; ++i) smem[threadIdx.y][i * kLanes + threadIdx.x] = acc[i];
  __syncthreads();
  const int tid = threadIdx.y * kLanes + threadIdx.x;
  for (int e = tid; e < W * kLanes; e += kLanes * kRowThreads) {
    const int i = e / kLanes, lane = e % kLanes;
    float s = 0.f;
#pragma unroll
    for (int y = 0; y < kRowThreads; ++y) s += smem[y][e];
    const int64_t col = (static_cast<int64_t>(blockIdx.x) * kLanes + lane) * W + i;
    if (col < C) partial[static_cast<int64_t>(blockIdx.y) * C + col] = s;
  }
}


// ================================================================ bias + dropout + residual
template <typename T, int VEC>
__global__ void __launch_bounds__(kLanes* kRowThreads)
    bdr_fwd_kernel(const T* __restrict__ x, const T* __restrict__ bias, const T* __restrict__ res,
                   T* __restrict__ out, int64_t rows, int64_t C, DropoutArgs drop,
                   at::PhiloxCudaState philox, int64_t* __restrict__ rng_out) {
  constexpr int W = Chunk<VEC>::W;
  uint64_t seed, offset;
  unpack_seed(philox, drop.enabled, seed, offset);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    rng_out[0] = static_cast<int64_t>(seed);
    rng_out[1] = static_cast<int64_t>(offset);
  }
  const int64_t units = (C + W - 1) / W;
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kLanes + threadIdx.x;
  if (unit >= units) return;
  const int64_t col0 = unit * W;
  float b[W];
  if (bias != nullptr) {
    load_chunk<T, VEC>(bias, col0, C, b);
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) b[i] = 0.f;
  }
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * kRowThreads + threadIdx.y; row < rows;
       row += static_cast<int64_t>(gridDim.y) * kRowThreads) {
    float xv[W], rv[W], o[W];
    load_chunk<T, VEC>(x + row * C, col0, C, xv);
    load_chunk<T, VEC>(res + row * C, col0, C, rv);
    bias_dropout_residual_values<W>(xv, b, rv, drop, seed, offset, row, col0, C, o);
    store_chunk<T, VEC>(out + row * C, col0, C, o);
  }
}

// The loop the backward kernels share: for each row this thread covers, the upstream gradient
// chunk g (and, with AUX, the same chunk of `aux`: the saved input or output) is loaded, g is
// transformed in place by op(row, g, a) (dropout mask, activation derivative), written to grad_x
// and added to the thread's column sums, which become the block's row of bias-gradient partials
// (when `partial` is not null). All loads happen here, through __restrict__ pointers, so the
// compiler may issue the next row's loads before this row's store. Every thread reaches
// write_partial's barrier.
template <typename T, int VEC, bool AUX, typename Op>
__device__ __forceinline__ void backward_rows(const T* __restrict__ grad, const T* __restrict__ aux,
                                              T* __restrict__ grad_x, float* __restrict__ partial,
                                              int64_t rows, int64_t C, int64_t col0, bool active,
                                              Op op) {
  constexpr int W = Chunk<VEC>::W;
  float acc[W];
#pragma unroll
  for (int i = 0; i < W; ++i) acc[i] = 0.f;
  if (active) {
    for (int64_t row = static_cast<int64_t>(blockIdx.y) * kRowThreads + threadIdx.y; row < rows;
         row += static_cast<int64_t>(gridDim.y) * kRowThreads) {
      float g[W], a[W];
      load_chunk<T, VEC>(grad + row * C, col0, C, g);
      if constexpr (AUX) load_chunk<T, VEC>(aux + row * C, col0, C, a);
      op(row, g, a);
#pragma unroll
      for (int i = 0; i < W; ++i) acc[i] += g[i];
      store_chunk<T, VEC>(grad_x + row * C, col0, C, g);
    }
  }
  if (partial != nullptr) write_partial<W>(acc, partial, C);
}

// This thread's first column (and whether it has one): threadIdx.x walks chunks of W columns.
template <int W>
__device__ __forceinline__ bool chunk_start(int64_t C, int64_t& col0) {
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kLanes + threadIdx.x;
  col0 = unit * W;
  return unit < (C + W - 1) / W;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kLanes* kRowThreads)
    bdr_bwd_kernel(const T* __restrict__ grad, T* __restrict__ grad_x, float* __restrict__ partial,
                   int64_t rows, int64_t C, DropoutArgs drop, const int64_t* __restrict__ rng) {
  constexpr int W = Chunk<VEC>::W;
  int64_t col0;
  const bool active = chunk_start<W>(C, col0);
  const uint64_t seed = drop.enabled && active ? static_cast<uint64_t>(rng[0]) : 0;
  const uint64_t offset = drop.enabled && active ? static_cast<uint64_t>(rng[1]) : 0;
  backward_rows<T, VEC, false>(grad, nullptr, grad_x, partial, rows, C, col0, active,
                               [&](int64_t row, float(&g)[W], const float(&)[W]) {
    if (drop.enabled) {
      bool keep[W];
      keep_mask<W>(seed, offset, row, col0, C, drop.threshold, keep);
#pragma unroll
      for (int i = 0; i < W; ++i) g[i] = keep[i] ? g[i] * drop.scale : 0.f;
    }
  });
}

// ================================================================ bias + activation + dropout
template <typename T, int VEC, int ACT>
__global__ void __launch_bounds__(kLanes* kRowThreads)
    bad_fwd_kernel(const T* __restrict__ x, const T* __restrict__ bias, T* __restrict__ out,
                   int64_t rows, int64_t C, DropoutArgs drop, at::PhiloxCudaState philox,
                   int64_t* __restrict__ rng_out) {
  constexpr int W = Chunk<VEC>::W;
  uint64_t seed, offset;
  unpack_seed(philox, drop.enabled, seed, offset);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    rng_out[0] = static_cast<int64_t>(seed);
    rng_out[1] = static_cast<int64_t>(offset);
  }
  const int64_t units = (C + W - 1) / W;
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kLanes + threadIdx.x;
  if (unit >= units) return;
  const int64_t col0 = unit * W;
  float b[W];
  if (bias != nullptr) {
    load_chunk<T, VEC>(bias, col0, C, b);
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) b[i] = 0.f;
  }
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * kRowThreads + threadIdx.y; row < rows;
       row += static_cast<int64_t>(gridDim.y) * kRowThreads) {
    float v[W];
    load_chunk<T, VEC>(x + row * C, col0, C, v);
#pragma unroll
    for (int i = 0; i < W; ++i) v[i] = act_fwd<ACT>(v[i] + b[i]);
    if (drop.enabled) {
      bool keep[W];
      keep_mask<W>(seed, offset, row, col0, C, drop.threshold, keep);
#pragma unroll
      for (int i = 0; i < W; ++i) v[i] = keep[i] ? v[i] * drop.scale : 0.f;
    }
    store_chunk<T, VEC>(out + row * C, col0, C, v);
  }
}

template <typename T, int VEC, int ACT>
__global__ void __launch_bounds__(kLanes* kRowThreads)
    bad_bwd_kernel(const T* __restrict__ grad, const T* __restrict__ x, const T* __restrict__ bias,
                   T* __restrict__ grad_x, float* __restrict__ partial, int64_t rows, int64_t C,
                   DropoutArgs drop, const int64_t* __restrict__ rng) {
  constexpr int W = Chunk<VEC>::W;
  int64_t col0;
  const bool active = chunk_start<W>(C, col0);
  const uint64_t seed = drop.enabled && active ? static_cast<uint64_t>(rng[0]) : 0;
  const uint64_t offset = drop.enabled && active ? static_cast<uint64_t>(rng[1]) : 0;
  float b[W];
  if (bias != nullptr && active) {
    load_chunk<T, VEC>(bias, col0, C, b);
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) b[i] = 0.f;
  }
  backward_rows<T, VEC, true>(grad, x, grad_x, partial, rows, C, col0, active,
                              [&](int64_t row, float(&g)[W], const float(&h)[W]) {
    if (drop.enabled) {
      bool keep[W];
      keep_mask<W>(seed, offset, row, col0, C, drop.threshold, keep);
#pragma unroll
      for (int i = 0; i < W; ++i) g[i] = keep[i] ? g[i] * drop.scale : 0.f;
    }
#pragma unroll
    for (int i = 0; i < W; ++i) g[i] *= act_grad<ACT>(h[i] + b[i]);
  });
}

// Backward of out = dropout(relu(x + bias)) from `out` alone: an element passes the gradient
// exactly when it was kept and relu was active, i.e. when out > 0 (x and bias are fp16/bf16/fp32
// values, so a positive x + bias never rounds to a zero `out`), as torch's relu backward tests
// its result (NaN passes). So nothing but `out` is kept for the backward: `out` is also the
// input fc2 saves, while x (the fc1 output) is freed after the forward, and no mask is regenerated.
template <typename T, int VEC>
__global__ void __launch_bounds__(kLanes* kRowThreads)
    rd_bwd_kernel(const T* __restrict__ grad, const T* __restrict__ out, T* __restrict__ grad_x,
                  float* __restrict__ partial, int64_t rows, int64_t C, float scale) {
  constexpr int W = Chunk<VEC>::W;
  int64_t col0;
  const bool active = chunk_start<W>(C, col0);
  backward_rows<T, VEC, true>(grad, out, grad_x, partial, rows, C, col0, active,
                              [&](int64_t, float(&g)[W], const float(&o)[W]) {
#pragma unroll
    for (int i = 0; i < W; ++i) g[i] = o[i] <= 0.f ? 0.f : g[i] * scale;
  });
}

// ================================================================ host side
struct Geometry {
  int64_t C;
  int64_t rows;
};

Geometry geometry(const at::Tensor& x, const char* name) {
  LSF_CHECK(x.is_cuda(), name, ": expected a CUDA tensor");
  LSF_CHECK(x.dim() >= 1 && x.size(-1) > 0, name, ": expected a tensor [..., C] with C > 0, got shape ",
              x.sizes());
  const int64_t C = x.size(-1);
  return {C, x.numel() / C};
}

void check_bias(const std::optional<at::Tensor>& bias, const at::Tensor& x, int64_t C,
                const char* name) {
  if (!bias.has_value()) return;
  LSF_CHECK(bias->is_cuda() && bias->device() == x.device(), name,
              ": bias must be on the same CUDA device as x");
  LSF_CHECK(bias->numel() == C, name, ": bias must have C = ", C, " elements, got shape ",
              bias->sizes());
  LSF_CHECK(bias->scalar_type() == x.scalar_type(), name, ": bias dtype ", bias->scalar_type(),
              " differs from x dtype ", x.scalar_type());
}


at::Tensor finish_bias_grad(const at::Tensor& partial, int64_t C, const at::Tensor& like,
                            cudaStream_t stream) {
  auto out = at::empty({C}, like.options());
  LSF_DISPATCH_FLOAT_TYPES(like.scalar_type(), "ls_fairseq bias grad", [&] {
    sum_partials<T>({{partial, out}}, partial.size(0), C, stream);
  });
  return out;
}

// The shared shape of the three backward ops: grad_x like grad, and with `bias_grad` the bias
// gradient, summed in a fixed order from the per-block column partials the kernel writes.
// `run(grid, partial)` launches the kernel (partial is null without bias_grad).
template <typename Kernel, typename Run>
std::tuple<at::Tensor, at::Tensor> run_backward(Kernel kernel, int W, const Geometry& g,
                                                const at::Tensor& grad, const at::Tensor& grad_x,
                                                bool bias_grad, Run run) {
  const dim3 grid = grid_for<kLanes, kRowThreads>(kernel, g.rows, (g.C + W - 1) / W,
                                                  grad.get_device());
  at::Tensor partial;
  if (bias_grad) {
    partial = at::empty({static_cast<int64_t>(grid.y), g.C}, grad.options().dtype(at::kFloat));
  }
  run(grid, bias_grad ? partial.data_ptr<float>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!bias_grad) return {grad_x, at::empty({0}, grad.options())};
  return {grad_x, finish_bias_grad(partial, g.C, grad, c10::cuda::getCurrentCUDAStream())};
}

// What the backward ops return for zero rows.
std::tuple<at::Tensor, at::Tensor> empty_backward(const Geometry& g, const at::Tensor& grad,
                                                  bool bias_grad) {
  return {at::empty_like(grad, at::MemoryFormat::Contiguous),
          bias_grad ? at::zeros({g.C}, grad.options()) : at::empty({0}, grad.options())};
}

std::tuple<at::Tensor, at::Tensor> bias_dropout_residual_fwd(const at::Tensor& x_in,
                                                             const std::optional<at::Tensor>& bias_in,
                                                             const at::Tensor& residual_in,
                                                             double p, bool train) {
  const char* name = "ls_fairseq bias_dropout_residual_fwd";
  const auto g = geometry(x_in, name);
  check_bias(bias_in, x_in, g.C, name);
  LSF_CHECK(residual_in.sizes() == x_in.sizes(), name, ": residual shape ", residual_in.sizes(),
              " differs from x shape ", x_in.sizes());
  LSF_CHECK(residual_in.scalar_type() == x_in.scalar_type() && residual_in.device() == x_in.device(),
              name, ": residual must have the dtype and device of x");
  c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous();
  const auto res = residual_in.contiguous();
  std::optional<at::Tensor> bias;
  if (bias_in.has_value()) bias = bias_in->contiguous();
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const DropoutArgs drop = make_dropout("ls_fairseq dropout", p, train);
  // Written by the kernel (seed, offset; zeros without dropout).
  auto rng = g.rows == 0 ? at::zeros({2}, x.options().dtype(at::kLong))
                         : at::empty({2}, x.options().dtype(at::kLong));
  if (g.rows == 0) return {out, rng};
  at::PhiloxCudaState philox;
  if (drop.enabled) philox = next_philox(x);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int dev = x.get_device();
  LSF_DISPATCH_FLOAT_TYPES(x.scalar_type(), name, [&] {
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    const T* rp = reinterpret_cast<const T*>(res.data_ptr());
    const T* bp = bias ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr;
    T* op = reinterpret_cast<T*>(out.data_ptr());
    auto launch = [&](auto kernel, int W) {
      const dim3 grid = grid_for<kLanes, kRowThreads>(kernel, g.rows, (g.C + W - 1) / W, dev);
      kernel<<<grid, dim3(kLanes, kRowThreads), 0, stream>>>(xp, bp, rp, op, g.rows, g.C, drop,
                                                             philox, rng.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    constexpr int V = 16 / sizeof(T);
    if (use_vec<T>(g.C, {xp, rp, bp, op})) {
      launch(bdr_fwd_kernel<T, V>, Chunk<V>::W);
    } else {
      launch(bdr_fwd_kernel<T, 1>, Chunk<1>::W);
    }
  });
  return {out, rng};
}

std::tuple<at::Tensor, at::Tensor> bias_dropout_residual_bwd(const at::Tensor& grad_in,
                                                             const at::Tensor& rng, double p,
                                                             bool train, bool bias_grad) {
  const char* name = "ls_fairseq bias_dropout_residual_bwd";
  const auto g = geometry(grad_in, name);
  c10::cuda::CUDAGuard guard(grad_in.device());
  const DropoutArgs drop = make_dropout("ls_fairseq dropout", p, train);
  LSF_CHECK(!drop.enabled || (rng.numel() == 2 && rng.scalar_type() == at::kLong &&
                                rng.device() == grad_in.device()),
              name, ": rng must be the int64[2] tensor returned by the forward");
  const auto grad = grad_in.contiguous();
  if (g.rows == 0) return empty_backward(g, grad, bias_grad);
  auto grad_x = at::empty_like(grad, at::MemoryFormat::Contiguous);
  auto stream = c10::cuda::getCurrentCUDAStream();
  std::tuple<at::Tensor, at::Tensor> result;
  LSF_DISPATCH_FLOAT_TYPES(grad.scalar_type(), name, [&] {
    const T* gp = reinterpret_cast<const T*>(grad.data_ptr());
    T* gxp = reinterpret_cast<T*>(grad_x.data_ptr());
    const int64_t* rp = drop.enabled ? rng.data_ptr<int64_t>() : nullptr;
    auto launch = [&](auto kernel, int W) {
      result = run_backward(kernel, W, g, grad, grad_x, bias_grad, [&](dim3 grid, float* partial) {
        kernel<<<grid, dim3(kLanes, kRowThreads), 0, stream>>>(gp, gxp, partial, g.rows, g.C,
                                                               drop, rp);
      });
    };
    constexpr int V = 16 / sizeof(T);
    if (use_vec<T>(g.C, {gp, gxp})) {
      launch(bdr_bwd_kernel<T, V>, Chunk<V>::W);
    } else {
      launch(bdr_bwd_kernel<T, 1>, Chunk<1>::W);
    }
  });
  return result;
}

std::tuple<at::Tensor, at::Tensor> bias_act_dropout_fwd(const at::Tensor& x_in,
                                                        const std::optional<at::Tensor>& bias_in,
                                                        c10::string_view activation, double p,
                                                        bool train) {
  const char* name = "ls_fairseq bias_act_dropout_fwd";
  const auto g = geometry(x_in, name);
  check_bias(bias_in, x_in, g.C, name);
  const int act = act_code(std::string(activation));
  c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous();
  std::optional<at::Tensor> bias;
  if (bias_in.has_value()) bias = bias_in->contiguous();
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const DropoutArgs drop = make_dropout("ls_fairseq dropout", p, train);
  // Written by the kernel (seed, offset; zeros without dropout).
  auto rng = g.rows == 0 ? at::zeros({2}, x.options().dtype(at::kLong))
                         : at::empty({2}, x.options().dtype(at::kLong));
  if (g.rows == 0) return {out, rng};
  at::PhiloxCudaState philox;
  if (drop.enabled) philox = next_philox(x);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int dev = x.get_device();
  LSF_DISPATCH_FLOAT_TYPES(x.scalar_type(), name, [&] {
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    const T* bp = bias ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr;
    T* op = reinterpret_cast<T*>(out.data_ptr());
    auto launch = [&](auto kernel, int W) {
      const dim3 grid = grid_for<kLanes, kRowThreads>(kernel, g.rows, (g.C + W - 1) / W, dev);
      kernel<<<grid, dim3(kLanes, kRowThreads), 0, stream>>>(xp, bp, op, g.rows, g.C, drop, philox,
                                                             rng.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    constexpr int V = 16 / sizeof(T);
    const bool vec = use_vec<T>(g.C, {xp, bp, op});
    if (act == kRelu) {
      if (vec) launch(bad_fwd_kernel<T, V, kRelu>, Chunk<V>::W);
      else launch(bad_fwd_kernel<T, 1, kRelu>, Chunk<1>::W);
    } else {
      if (vec) launch(bad_fwd_kernel<T, V, kGelu>, Chunk<V>::W);
      else launch(bad_fwd_kernel<T, 1, kGelu>, Chunk<1>::W);
    }
  });
  return {out, rng};
}

std::tuple<at::Tensor, at::Tensor> bias_act_dropout_bwd(const at::Tensor& grad_in,
                                                        const at::Tensor& x_in,
                                                        const std::optional<at::Tensor>& bias_in,
                                                        const at::Tensor& rng,
                                                        c10::string_view activation, double p,
                                                        bool train, bool bias_grad) {
  const char* name = "ls_fairseq bias_act_dropout_bwd";
  const auto g = geometry(grad_in, name);
  LSF_CHECK(x_in.sizes() == grad_in.sizes() && x_in.scalar_type() == grad_in.scalar_type() &&
                  x_in.device() == grad_in.device(),
              name, ": x must have the shape, dtype and device of grad");
  check_bias(bias_in, x_in, g.C, name);
  const int act = act_code(std::string(activation));
  c10::cuda::CUDAGuard guard(grad_in.device());
  const DropoutArgs drop = make_dropout("ls_fairseq dropout", p, train);
  LSF_CHECK(!drop.enabled || (rng.numel() == 2 && rng.scalar_type() == at::kLong &&
                                rng.device() == grad_in.device()),
              name, ": rng must be the int64[2] tensor returned by the forward");
  const auto grad = grad_in.contiguous();
  if (g.rows == 0) return empty_backward(g, grad, bias_grad);
  const auto x = x_in.contiguous();
  std::optional<at::Tensor> bias;
  if (bias_in.has_value()) bias = bias_in->contiguous();
  auto grad_x = at::empty_like(grad, at::MemoryFormat::Contiguous);
  auto stream = c10::cuda::getCurrentCUDAStream();
  std::tuple<at::Tensor, at::Tensor> result;
  LSF_DISPATCH_FLOAT_TYPES(grad.scalar_type(), name, [&] {
    const T* gp = reinterpret_cast<const T*>(grad.data_ptr());
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    const T* bp = bias ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr;
    T* gxp = reinterpret_cast<T*>(grad_x.data_ptr());
    const int64_t* rp = drop.enabled ? rng.data_ptr<int64_t>() : nullptr;
    auto launch = [&](auto kernel, int W) {
      result = run_backward(kernel, W, g, grad, grad_x, bias_grad, [&](dim3 grid, float* partial) {
        kernel<<<grid, dim3(kLanes, kRowThreads), 0, stream>>>(gp, xp, bp, gxp, partial, g.rows,
                                                               g.C, drop, rp);
      });
    };
    constexpr int V = 16 / sizeof(T);
    const bool vec = use_vec<T>(g.C, {gp, xp, bp, gxp});
    if (act == kRelu) {
      if (vec) launch(bad_bwd_kernel<T, V, kRelu>, Chunk<V>::W);
      else launch(bad_bwd_kernel<T, 1, kRelu>, Chunk<1>::W);
    } else {
      if (vec) launch(bad_bwd_kernel<T, V, kGelu>, Chunk<V>::W);
      else launch(bad_bwd_kernel<T, 1, kGelu>, Chunk<1>::W);
    }
  });
  return result;
}

std::tuple<at::Tensor, at::Tensor> relu_dropout_bwd(const at::Tensor& grad_in,
                                                    const at::Tensor& out_in, double p, bool train,
                                                    bool bias_grad) {
  const char* name = "ls_fairseq relu_dropout_bwd";
  const auto g = geometry(grad_in, name);
  LSF_CHECK(out_in.sizes() == grad_in.sizes() && out_in.scalar_type() == grad_in.scalar_type() &&
                out_in.device() == grad_in.device(),
            name, ": out must have the shape, dtype and device of grad");
  c10::cuda::CUDAGuard guard(grad_in.device());
  const DropoutArgs drop = make_dropout("ls_fairseq dropout", p, train);
  const auto grad = grad_in.contiguous();
  if (g.rows == 0) return empty_backward(g, grad, bias_grad);
  const auto out = out_in.contiguous();
  auto grad_x = at::empty_like(grad, at::MemoryFormat::Contiguous);
  auto stream = c10::cuda::getCurrentCUDAStream();
  std::tuple<at::Tensor, at::Tensor> result;
  LSF_DISPATCH_FLOAT_TYPES(grad.scalar_type(), name, [&] {
    const T* gp = reinterpret_cast<const T*>(grad.data_ptr());
    const T* op = reinterpret_cast<const T*>(out.data_ptr());
    T* gxp = reinterpret_cast<T*>(grad_x.data_ptr());
    auto launch = [&](auto kernel, int W) {
      result = run_backward(kernel, W, g, grad, grad_x, bias_grad, [&](dim3 grid, float* partial) {
        kernel<<<grid, dim3(kLanes, kRowThreads), 0, stream>>>(gp, op, gxp, partial, g.rows, g.C,
                                                               drop.scale);
      });
    };
    constexpr int V = 16 / sizeof(T);
    if (use_vec<T>(g.C, {gp, op, gxp})) {
      launch(rd_bwd_kernel<T, V>, Chunk<V>::W);
    } else {
      launch(rd_bwd_kernel<T, 1>, Chunk<1>::W);
    }
  });
  return result;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ls_fairseq, m) {
  m.def("bias_dropout_residual_fwd(Tensor x, Tensor? bias, Tensor residual, float p, bool train) "
        "-> (Tensor, Tensor)",
        {at::Tag::nondeterministic_seeded});
  m.def("bias_dropout_residual_bwd(Tensor grad, Tensor rng, float p, bool train, bool bias_grad) "
        "-> (Tensor, Tensor)");
  m.def("bias_act_dropout_fwd(Tensor x, Tensor? bias, str activation, float p, bool train) "
        "-> (Tensor, Tensor)",
        {at::Tag::nondeterministic_seeded});
  m.def("bias_act_dropout_bwd(Tensor grad, Tensor x, Tensor? bias, Tensor rng, str activation, "
        "float p, bool train, bool bias_grad) -> (Tensor, Tensor)");
  m.def("relu_dropout_bwd(Tensor grad, Tensor out, float p, bool train, bool bias_grad) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ls_fairseq, CUDA, m) {
  m.impl("bias_dropout_residual_fwd", &bias_dropout_residual_fwd);
  m.impl("bias_dropout_residual_bwd", &bias_dropout_residual_bwd);
  m.impl("bias_act_dropout_fwd", &bias_act_dropout_fwd);
  m.impl("bias_act_dropout_bwd", &bias_act_dropout_bwd);
  m.impl("relu_dropout_bwd", &relu_dropout_bwd);
}
