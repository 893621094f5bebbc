// Transformer input embedding (ls_fairseq, issue 3):
//   out[n] = dropout(scale * E[tok[n]] + P[pos[n]]), and 0 where zero_pad and tok[n] == padding_idx.
//
// Same semantics as ls_fairseq/ops/embedding.py (fairseq's forward_embedding): the lookup itself
// does not zero padding rows (the tables' padding rows are zero by construction); gradients skip
// the padding row of each table (nn.Embedding's padding_idx); the positional table gets a gradient
// only when asked (learned positions), never a sinusoidal buffer.
//
// Storage float32/float16/bfloat16 for the tables and the output, math in float32.
// Dropout: Philox4x32-10 keyed by torch's CUDA generator, word (c % 4) of the block at counter
// {offset / 4, n * ceil(C / 4) + c / 4}; (seed, offset) are written to an int64[2] device tensor by
// the forward and the backward regenerates the mask from it (nothing per element is stored).
//
// Backward:
//   * default: float atomics into a float32 accumulator [V, C] (the table gradient itself for
//     float32 tables), cast to the table dtype at the end;
//   * deterministic (LS_FAIRSEQ_DETERMINISTIC=1 or torch.use_deterministic_algorithms): the indices
//     are sorted (stable), and one block per run of equal indices sums its rows in a fixed order
//     in float32 and writes the table row once (no atomics, no float32 [V, C] buffer).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <mutex>
#include <vector>

#include "check.h"
#include "launch_utils.h"
#include "device_utils.cuh"
#include "philox_dropout.cuh"

namespace {


constexpr int kLanes = 32;
constexpr int kRowThreads = 8;
constexpr int kSegThreads = 128;

using namespace lsf;  // helpers from device_utils.cuh / launch_utils.h

// Everything the kernels need to know about one row n: its token, position and padding.
struct Lookup {
  const int64_t* __restrict__ tokens;
  const int64_t* __restrict__ positions;  // nullptr without a positional table
  int64_t vocab;                          // rows of the token table
  int64_t npos;                           // rows of the positional table
  int64_t pad_value;                      // padding_idx as given (compared with tokens)
  bool zero_pad;
};

struct RowInfo {
  int64_t tok, pos;
  bool padded;
};

__device__ __forceinline__ RowInfo row_info(const Lookup& lk, int64_t n) {
  RowInfo r;
  r.tok = lk.tokens[n];
  CUDA_KERNEL_ASSERT(r.tok >= 0 && r.tok < lk.vocab && "ls_fairseq embedding: token id out of range");
  r.pos = 0;
  if (lk.positions != nullptr) {
    r.pos = lk.positions[n];
    CUDA_KERNEL_ASSERT(r.pos >= 0 && r.pos < lk.npos && "ls_fairseq embedding: position out of range");
  }
  r.padded = lk.zero_pad && r.tok == lk.pad_value;
  return r;
}

// ---------------------------------------------------------------- forward
template <typename T, int VEC>
__global__ void __launch_bounds__(kLanes* kRowThreads)
    embedding_fwd_kernel(Lookup lk, const T* __restrict__ E, const T* __restrict__ P,
                         T* __restrict__ out, int64_t rows, int64_t C, float scale,
                         DropoutArgs drop, at::PhiloxCudaState philox,
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
  for (int64_t n = static_cast<int64_t>(blockIdx.y) * kRowThreads + threadIdx.y; n < rows;
       n += static_cast<int64_t>(gridDim.y) * kRowThreads) {
    const RowInfo ri = row_info(lk, n);
    float v[W];
    if (ri.padded) {
#pragma unroll
      for (int i = 0; i < W; ++i) v[i] = 0.f;
    } else {
      load_chunk<T, VEC>(E + ri.tok * C, col0, C, v);
#pragma unroll
      for (int i = 0; i < W; ++i) v[i] *= scale;
      if (P != nullptr) {
        float pv[W];
        load_chunk<T, VEC>(P + ri.pos * C, col0, C, pv);
#pragma unroll
        for (int i = 0; i < W; ++i) v[i] += pv[i];
      }
      if (drop.enabled) {
        bool keep[W];
        keep_mask<W>(seed, offset, n, col0, C, drop.threshold, keep);
#pragma unroll
        for (int i = 0; i < W; ++i) v[i] = keep[i] ? v[i] * drop.scale : 0.f;
      }
    }
    store_chunk<T, VEC>(out + n * C, col0, C, v);
  }
}

// Upstream gradient of row n, times the dropout mask and scale (0 for zeroed padding rows).
template <typename T, int VEC>
__device__ __forceinline__ void row_grad(const T* __restrict__ grad, int64_t n, int64_t col0,
                                         int64_t C, const DropoutArgs& drop, uint64_t seed,
                                         uint64_t offset, float (&g)[Chunk<VEC>::W]) {
  constexpr int W = Chunk<VEC>::W;
  load_chunk<T, VEC>(grad + n * C, col0, C, g);
  if (drop.enabled) {
    bool keep[W];
    keep_mask<W>(seed, offset, n, col0, C, drop.threshold, keep);
#pragma unroll
    for (int i = 0; i < W; ++i) g[i] = keep[i] ? g[i] * drop.scale : 0.f;
  }
}

// ---------------------------------------------------------------- backward, atomics
template <typename T, int VEC>
__global__ void __launch_bounds__(kLanes* kRowThreads)
    embedding_bwd_atomic_kernel(Lookup lk, const T* __restrict__ grad, float* __restrict__ gE,
                                float* __restrict__ gP, int64_t rows, int64_t C, float scale,
                                int64_t tok_skip, int64_t pos_skip, DropoutArgs drop,
                                const int64_t* __restrict__ rng) {
  constexpr int W = Chunk<VEC>::W;
  const int64_t units = (C + W - 1) / W;
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kLanes + threadIdx.x;
  if (unit >= units) return;
  const int64_t col0 = unit * W;
  const uint64_t seed = drop.enabled ? static_cast<uint64_t>(rng[0]) : 0;
  const uint64_t offset = drop.enabled ? static_cast<uint64_t>(rng[1]) : 0;
  for (int64_t n = static_cast<int64_t>(blockIdx.y) * kRowThreads + threadIdx.y; n < rows;
       n += static_cast<int64_t>(gridDim.y) * kRowThreads) {
    const RowInfo ri = row_info(lk, n);
    if (ri.padded) continue;
    const bool to_e = gE != nullptr && ri.tok != tok_skip;
    const bool to_p = gP != nullptr && ri.pos != pos_skip;
    if (!to_e && !to_p) continue;
    float g[W];
    row_grad<T, VEC>(grad, n, col0, C, drop, seed, offset, g);
#pragma unroll
    for (int i = 0; i < W; ++i) {
      if (col0 + i < C) {
        if (to_e) atomicAdd(gE + ri.tok * C + col0 + i, g[i] * scale);
        if (to_p) atomicAdd(gP + ri.pos * C + col0 + i, g[i]);
      }
    }
  }
}

// ---------------------------------------------------------------- backward, deterministic
// One block per position i of the sorted index list; the block that starts a run of equal
// indices sums the run's rows (in sorted = stable original order) and writes the table row.
template <typename T, int VEC>
__global__ void __launch_bounds__(kSegThreads)
    embedding_bwd_sorted_kernel(Lookup lk, const T* __restrict__ grad,
                                const int64_t* __restrict__ sorted, const int64_t* __restrict__ perm,
                                T* __restrict__ table_grad, int64_t table_rows, int64_t rows,
                                int64_t C, float factor, int64_t skip, DropoutArgs drop,
                                const int64_t* __restrict__ rng) {
  constexpr int W = Chunk<VEC>::W;
  const int64_t i0 = blockIdx.x;
  const int64_t idx = sorted[i0];
  if ((i0 > 0 && sorted[i0 - 1] == idx) || idx == skip) return;
  CUDA_KERNEL_ASSERT(idx >= 0 && idx < table_rows && "ls_fairseq embedding: index out of range");
  int64_t end = i0 + 1;
  while (end < rows && sorted[end] == idx) ++end;
  const uint64_t seed = drop.enabled ? static_cast<uint64_t>(rng[0]) : 0;
  const uint64_t offset = drop.enabled ? static_cast<uint64_t>(rng[1]) : 0;
  const int64_t units = (C + W - 1) / W;
  for (int64_t unit = threadIdx.x; unit < units; unit += kSegThreads) {
    const int64_t col0 = unit * W;
    float acc[W];
#pragma unroll
    for (int i = 0; i < W; ++i) acc[i] = 0.f;
    for (int64_t j = i0; j < end; ++j) {
      const int64_t n = perm[j];
      if (lk.zero_pad && lk.tokens[n] == lk.pad_value) continue;
      float g[W];
      row_grad<T, VEC>(grad, n, col0, C, drop, seed, offset, g);
#pragma unroll
      for (int i = 0; i < W; ++i) acc[i] += g[i];
    }
#pragma unroll
    for (int i = 0; i < W; ++i) acc[i] *= factor;
    store_chunk<T, VEC>(table_grad + idx * C, col0, C, acc);
  }
}

// fp32 accumulator -> table dtype. kVec: 4 elements per step (one 16-byte load, one 8-byte
// store; both buffers suitably aligned), then the n % 4 tail element by element. The scalar
// version ran at ~40% of the copy bandwidth (0.18 ms for a 32k x 1024 table on the H100).
template <typename T, bool kVec>
__global__ void cast_kernel(const float* __restrict__ in, T* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail = 0;
  if constexpr (kVec) {
    const int64_t n4 = n / 4;
    for (int64_t i = first; i < n4; i += stride) {
      const float4 v = reinterpret_cast<const float4*>(in)[i];
      Pack<T, 4> pk;
      pk.v[0] = from_float<T>(v.x);
      pk.v[1] = from_float<T>(v.y);
      pk.v[2] = from_float<T>(v.z);
      pk.v[3] = from_float<T>(v.w);
      reinterpret_cast<Pack<T, 4>*>(out)[i] = pk;
    }
    tail = n4 * 4;
  }
  for (int64_t i = tail + first; i < n; i += stride) out[i] = from_float<T>(in[i]);
}

// ---------------------------------------------------------------- host side




int64_t normalize_pad(int64_t padding_idx, int64_t rows) {
  return padding_idx < 0 ? padding_idx + rows : padding_idx;
}

struct Inputs {
  at::Tensor tokens, positions, E, P;
  int64_t rows, C;
};

Inputs check_inputs(const at::Tensor& tokens, const std::optional<at::Tensor>& positions,
                    const at::Tensor& token_weight, const std::optional<at::Tensor>& pos_weight,
                    const char* name) {
  LSF_CHECK(token_weight.is_cuda() && token_weight.dim() == 2 && token_weight.size(1) > 0, name,
              ": token_weight must be a CUDA tensor [V, C] with C > 0, got ", token_weight.sizes());
  LSF_CHECK(tokens.device() == token_weight.device() && tokens.scalar_type() == at::kLong, name,
              ": tokens must be int64 on the device of token_weight");
  Inputs in;
  in.C = token_weight.size(1);
  in.rows = tokens.numel();
  in.tokens = tokens.contiguous();
  in.E = token_weight.contiguous();
  if (pos_weight.has_value()) {
    LSF_CHECK(positions.has_value(), name, ": positions are required with pos_weight");
    LSF_CHECK(pos_weight->dim() == 2 && pos_weight->size(1) == in.C &&
                    pos_weight->device() == token_weight.device() &&
                    pos_weight->scalar_type() == token_weight.scalar_type(),
                name, ": pos_weight must be [P, C] with the dtype and device of token_weight, got ",
                pos_weight->sizes(), " ", pos_weight->scalar_type());
    LSF_CHECK(positions->sizes() == tokens.sizes() && positions->scalar_type() == at::kLong &&
                    positions->device() == tokens.device(),
                name, ": positions must be int64 with the shape of tokens");
    in.positions = positions->contiguous();
    in.P = pos_weight->contiguous();
  }
  return in;
}

Lookup make_lookup(const Inputs& in, int64_t padding_idx, bool zero_pad) {
  Lookup lk;
  lk.tokens = in.tokens.data_ptr<int64_t>();
  lk.positions = in.P.defined() ? in.positions.data_ptr<int64_t>() : nullptr;
  lk.vocab = in.E.size(0);
  lk.npos = in.P.defined() ? in.P.size(0) : 0;
  lk.pad_value = padding_idx;
  lk.zero_pad = zero_pad;
  return lk;
}

std::vector<int64_t> out_shape(const at::Tensor& tokens, int64_t C) {
  std::vector<int64_t> shape(tokens.sizes().begin(), tokens.sizes().end());
  shape.push_back(C);
  return shape;
}

std::tuple<at::Tensor, at::Tensor> embedding_fwd(const at::Tensor& tokens,
                                                 const std::optional<at::Tensor>& positions,
                                                 const at::Tensor& token_weight,
                                                 const std::optional<at::Tensor>& pos_weight,
                                                 double scale, int64_t padding_idx, double p,
                                                 bool train, bool zero_pad) {
  const char* name = "ls_fairseq embedding_fwd";
  const Inputs in = check_inputs(tokens, positions, token_weight, pos_weight, name);
  c10::cuda::CUDAGuard guard(token_weight.device());
  auto out = at::empty(out_shape(tokens, in.C), in.E.options());
  const DropoutArgs drop = make_dropout("ls_fairseq embedding", p, train);
  auto rng = in.rows == 0 ? at::zeros({2}, in.E.options().dtype(at::kLong))
                          : at::empty({2}, in.E.options().dtype(at::kLong));
  if (in.rows == 0) return {out, rng};
  at::PhiloxCudaState philox;
  if (drop.enabled) philox = next_philox(token_weight);
  const Lookup lk = make_lookup(in, padding_idx, zero_pad);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int dev = token_weight.get_device();
  LSF_DISPATCH_FLOAT_TYPES(in.E.scalar_type(), name, [&] {
    const T* ep = reinterpret_cast<const T*>(in.E.data_ptr());
    const T* pp = in.P.defined() ? reinterpret_cast<const T*>(in.P.data_ptr()) : nullptr;
    T* op = reinterpret_cast<T*>(out.data_ptr());
    auto launch = [&](auto kernel, int W) {
      const dim3 grid = grid_for<kLanes, kRowThreads>(kernel, in.rows, (in.C + W - 1) / W, dev);
      kernel<<<grid, dim3(kLanes, kRowThreads), 0, stream>>>(lk, ep, pp, op, in.rows, in.C,
                                                             static_cast<float>(scale), drop, philox,
                                                             rng.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    constexpr int V = 16 / sizeof(T);
    if (use_vec<T>(in.C, {ep, pp, op})) {
      launch(embedding_fwd_kernel<T, V>, Chunk<V>::W);
    } else {
      launch(embedding_fwd_kernel<T, 1>, Chunk<1>::W);
    }
  });
  return {out, rng};
}

std::tuple<at::Tensor, at::Tensor> embedding_bwd(
    const at::Tensor& grad_in, const at::Tensor& tokens, const std::optional<at::Tensor>& positions,
    const at::Tensor& token_weight, const std::optional<at::Tensor>& pos_weight,
    const at::Tensor& rng, double scale, int64_t padding_idx, double p, bool train, bool zero_pad,
    bool token_grad, bool pos_grad, bool deterministic) {
  const char* name = "ls_fairseq embedding_bwd";
  const Inputs in = check_inputs(tokens, positions, token_weight, pos_weight, name);
  LSF_CHECK(!pos_grad || in.P.defined(), name, ": pos_grad needs pos_weight");
  LSF_CHECK(grad_in.numel() == in.rows * in.C && grad_in.scalar_type() == in.E.scalar_type() &&
                  grad_in.device() == in.E.device(),
              name, ": grad must have the shape of the output and the dtype of token_weight");
  const DropoutArgs drop = make_dropout("ls_fairseq embedding", p, train);
  LSF_CHECK(!drop.enabled || (rng.numel() == 2 && rng.scalar_type() == at::kLong &&
                                rng.device() == in.E.device()),
              name, ": rng must be the int64[2] tensor returned by the forward");
  c10::cuda::CUDAGuard guard(token_weight.device());
  const auto grad = grad_in.contiguous();
  const int64_t V = in.E.size(0);
  const int64_t NP = in.P.defined() ? in.P.size(0) : 0;
  const int64_t tok_skip = normalize_pad(padding_idx, V);
  const int64_t pos_skip = in.P.defined() ? normalize_pad(padding_idx, NP) : -1;
  const Lookup lk = make_lookup(in, padding_idx, zero_pad);
  const bool is_float = in.E.scalar_type() == at::kFloat;
  // Zero-filled where rows may stay untouched (sorted path, float32 atomics, no tokens); the
  // float32-accumulator path overwrites every element with the cast.
  const bool prefill = deterministic || is_float || in.rows == 0;
  auto table = [&](bool needed, int64_t n) {
    if (!needed) return at::empty({0}, in.E.options());
    return prefill ? at::zeros({n, in.C}, in.E.options()) : at::empty({n, in.C}, in.E.options());
  };
  at::Tensor gE = table(token_grad, V);
  at::Tensor gP = table(pos_grad, NP);
  if (in.rows == 0 || (!token_grad && !pos_grad)) return {gE, gP};
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int dev = token_weight.get_device();
  const int64_t* rp = drop.enabled ? rng.data_ptr<int64_t>() : nullptr;
  LSF_DISPATCH_FLOAT_TYPES(in.E.scalar_type(), name, [&] {
    const T* gp = reinterpret_cast<const T*>(grad.data_ptr());
    constexpr int VV = 16 / sizeof(T);
    if (deterministic) {
      auto run_table = [&](const at::Tensor& index, at::Tensor& table_grad, float factor,
                           int64_t skip) {
        const auto sorted = at::sort(index.reshape({-1}), /*stable=*/true, 0, false);
        const auto& keys = std::get<0>(sorted);
        const auto& perm = std::get<1>(sorted);
        T* tg = reinterpret_cast<T*>(table_grad.data_ptr());
        auto launch = [&](auto kernel) {
          kernel<<<static_cast<unsigned>(in.rows), kSegThreads, 0, stream>>>(
              lk, gp, keys.data_ptr<int64_t>(), perm.data_ptr<int64_t>(), tg, table_grad.size(0),
              in.rows, in.C,
              factor, skip, drop, rp);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        };
        if (use_vec<T>(in.C, {gp, tg})) {
          launch(embedding_bwd_sorted_kernel<T, VV>);
        } else {
          launch(embedding_bwd_sorted_kernel<T, 1>);
        }
      };
      LSF_CHECK(in.rows <= 2147483647, name, ": too many tokens for the deterministic backward");
      if (token_grad) run_table(in.tokens, gE, static_cast<float>(scale), tok_skip);
      if (pos_grad) run_table(in.positions, gP, 1.f, pos_skip);
    } else {
      // float32 accumulators: the gradients themselves for float32 tables.
      at::Tensor aE, aP;
      if (token_grad) aE = is_float ? gE : at::zeros({V, in.C}, in.E.options().dtype(at::kFloat));
      if (pos_grad) aP = is_float ? gP : at::zeros({NP, in.C}, in.E.options().dtype(at::kFloat));
      auto launch = [&](auto kernel, int W) {
        const dim3 grid = grid_for<kLanes, kRowThreads>(kernel, in.rows, (in.C + W - 1) / W, dev);
        kernel<<<grid, dim3(kLanes, kRowThreads), 0, stream>>>(
            lk, gp, token_grad ? aE.data_ptr<float>() : nullptr,
            pos_grad ? aP.data_ptr<float>() : nullptr, in.rows, in.C, static_cast<float>(scale),
            tok_skip, pos_skip, drop, rp);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (use_vec<T>(in.C, {gp})) {
        launch(embedding_bwd_atomic_kernel<T, VV>, Chunk<VV>::W);
      } else {
        launch(embedding_bwd_atomic_kernel<T, 1>, Chunk<1>::W);
      }
      if (!is_float) {
        auto cast = [&](const at::Tensor& acc, at::Tensor& outt) {
          const int64_t n = acc.numel();
          if (n == 0) return;
          const float* src = acc.data_ptr<float>();
          T* dst = reinterpret_cast<T*>(outt.data_ptr());
          const bool vec = reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                           reinterpret_cast<uintptr_t>(dst) % sizeof(Pack<T, 4>) == 0;
          const int64_t steps = vec ? std::max<int64_t>(n / 4, 1) : n;
          const unsigned blocks = static_cast<unsigned>(
              std::min<int64_t>((steps + 255) / 256, static_cast<int64_t>(sm_count(dev)) * 16));
          if (vec) {
            cast_kernel<T, true><<<blocks, 256, 0, stream>>>(src, dst, n);
          } else {
            cast_kernel<T, false><<<blocks, 256, 0, stream>>>(src, dst, n);
          }
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        };
        if (token_grad) cast(aE, gE);
        if (pos_grad) cast(aP, gP);
      }
    }
  });
  return {gE, gP};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ls_fairseq, m) {
  m.def("embedding_fwd(Tensor tokens, Tensor? positions, Tensor token_weight, Tensor? pos_weight, "
        "float scale, int padding_idx, float p, bool train, bool zero_pad) -> (Tensor, Tensor)",
        {at::Tag::nondeterministic_seeded});
  m.def("embedding_bwd(Tensor grad, Tensor tokens, Tensor? positions, Tensor token_weight, "
        "Tensor? pos_weight, Tensor rng, float scale, int padding_idx, float p, bool train, "
        "bool zero_pad, bool token_grad, bool pos_grad, bool deterministic) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ls_fairseq, CUDA, m) {
  m.impl("embedding_fwd", &embedding_fwd);
  m.impl("embedding_bwd", &embedding_bwd);
}
