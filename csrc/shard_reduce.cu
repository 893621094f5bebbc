// The reduction step of the copy-engine all-reduce (ls_fairseq/graphs/peer_all_reduce.py):
// out = (out + parts[0] + ... + parts[k-1]) * scale, accumulated in float32 in that order and
// rounded once into out's dtype. One launch, one read of every input and one write: the
// gradients themselves travel between the GPUs by copy engines, so this is the only SM work of
// the all-reduce. Reference: ls_fairseq/ops/shard_reduce.py (shard_reduce_reference).
#include <torch/library.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "launch_utils.h"

namespace {

constexpr int kMaxParts = 15;  // 16 GPUs; peer_all_reduce.py steps aside beyond

template <typename T>
struct Parts {
  const T* p[kMaxParts];
};

template <typename T, int VEC>
__global__ void shard_reduce_kernel(T* __restrict__ out, Parts<T> parts, int k, float scale,
                                    int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * VEC;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; i < n;
       i += stride) {
    float acc[VEC];
    if (VEC > 1 && i + VEC <= n) {
      lsf::load_vec<T, VEC>(out + i, acc);
      for (int j = 0; j < k; ++j) {
        float v[VEC];
        lsf::load_vec<T, VEC>(parts.p[j] + i, v);
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] += v[e];
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] *= scale;
      lsf::store_vec<T, VEC>(out + i, acc);
    } else {
      for (int e = 0; e < VEC && i + e < n; ++e) {
        float a = lsf::to_float(out[i + e]);
        for (int j = 0; j < k; ++j) a += lsf::to_float(parts.p[j][i + e]);
        out[i + e] = lsf::from_float<T>(a * scale);
      }
    }
  }
}

void shard_reduce_(at::Tensor out, at::TensorList parts, double scale) {
  LSF_CHECK(out.is_cuda() && out.is_contiguous(), "shard_reduce_: out must be a contiguous CUDA "
            "tensor");
  const int k = static_cast<int>(parts.size());
  LSF_CHECK(k <= kMaxParts, "shard_reduce_: at most ", kMaxParts, " parts, got ", k);
  for (const auto& p : parts) {
    LSF_CHECK(p.is_cuda() && p.is_contiguous() && p.scalar_type() == out.scalar_type() &&
                  p.numel() == out.numel(),
              "shard_reduce_: every part must be a contiguous CUDA tensor of out's dtype (",
              out.scalar_type(), ") and size (", out.numel(), ")");
  }
  const int64_t n = out.numel();
  if (n == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(out.device().index());
  LSF_DISPATCH_FLOAT_TYPES(out.scalar_type(), "shard_reduce_", [&] {
    constexpr int V = 16 / sizeof(T);
    Parts<T> ps{};
    bool vec = reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
    for (int j = 0; j < k; ++j) {
      ps.p[j] = static_cast<const T*>(parts[j].data_ptr());
      vec = vec && reinterpret_cast<uintptr_t>(parts[j].data_ptr()) % 16 == 0;
    }
    const int threads = 256;
    const int per_thread = vec ? V : 1;
    const int64_t want = (n + static_cast<int64_t>(threads) * per_thread - 1) /
                         (static_cast<int64_t>(threads) * per_thread);
    // a few waves at most: the copy engines and the backward share the GPU with this kernel
    const int blocks = static_cast<int>(std::max<int64_t>(
        1, std::min<int64_t>(want, 4 * static_cast<int64_t>(lsf::sm_count(out.device().index())))));
    if (vec) {
      shard_reduce_kernel<T, V><<<blocks, threads, 0, stream>>>(
          static_cast<T*>(out.data_ptr()), ps, k, static_cast<float>(scale), n);
    } else {
      shard_reduce_kernel<T, 1><<<blocks, threads, 0, stream>>>(
          static_cast<T*>(out.data_ptr()), ps, k, static_cast<float>(scale), n);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ls_fairseq, m) {
  m.def("shard_reduce_(Tensor(a!) out, Tensor[] parts, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(ls_fairseq, CUDA, m) { m.impl("shard_reduce_", &shard_reduce_); }
