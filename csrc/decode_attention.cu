// One decoding step's attention over keys/values addressed through a row table
// (ls_fairseq/ops/decode_attention.py):
//
//   decode_attention(q [R, H, D], k [N, H, T, D], v [N, H, T, D], rows [R, T] int64,
//                    key_padding_mask [R, T] bool or None) -> out [R, H, D]
//   out[r, h] = softmax_t(q[r, h] * D^-0.5 . k[rows[r, t], h, t]) @ v[rows[r, t], h, t]
//
// Beam search then never moves a cache's keys/values (the table is reordered instead), and
// cross-attention keys/values are stored once per sentence (rows[r, t] = r / beam).
//
// Rounding as the PyTorch reference (attention_reference on the gathered keys/values, fairseq's
// math): q scaled in its dtype, each score rounded to the dtype, softmax in fp32, probabilities
// rounded to the dtype, products accumulated in fp32. A row whose keys are all masked gets zeros.
//
// One block of 128 threads per (row, head). D / 8 lanes hold one position's D values as 16-byte
// vectors, so a group of lanes reads one key (one 128-byte line for D = 64) and 128 / (D / 8)
// positions are in flight per block. Masked positions are not read at all: a fixed-capacity
// cache costs its filled positions only, and the launch has the same shape at every step (CUDA
// graphs). Scores live in shared memory (T floats; T <= kMaxKeys).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "check.h"
#include "device_utils.cuh"

namespace ls_fairseq_decode_attention {

constexpr int kThreads = 128;
constexpr int kVec = 8;          // 16-bit values per 16-byte vector
constexpr int kMaxKeys = 8192;   // shared memory: kMaxKeys floats of scores

struct Args {
  int64_t q_r, q_h;             // q strides (elements); the last dim is contiguous
  int64_t k_n, k_h, k_t;
  int64_t v_n, v_h, v_t;
  int64_t rows_r, rows_t;
  int64_t mask_r, mask_t;
  int64_t N;
  int H, T;
  float scale;
};

template <int D>
__device__ __forceinline__ float group_sum(float x) {
  // the D / kVec lanes of one position are consecutive lanes of a warp
#pragma unroll
  for (int off = D / kVec / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

template <bool kMax>
__device__ __forceinline__ float block_reduce(float x, float* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, off);
    x = kMax ? fmaxf(x, y) : x + y;
  }
  const int warp = threadIdx.x / 32;
  __syncthreads();  // scratch may still be read from a previous reduction
  if (threadIdx.x % 32 == 0) scratch[warp] = x;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) r = kMax ? fmaxf(r, scratch[w]) : r + scratch[w];
  return r;
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
decode_attention_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        const int64_t* __restrict__ rows, const bool* __restrict__ mask,
                        T* __restrict__ out, Args a) {
  constexpr int kLanes = D / kVec;
  constexpr int kGroups = kThreads / kLanes;
  extern __shared__ float scores[];  // [T]
  __shared__ float partial[kGroups][D];
  __shared__ float scratch[kThreads / 32];

  const int64_t r = blockIdx.x / a.H;
  const int h = blockIdx.x % a.H;
  const int lane = threadIdx.x % kLanes;
  const int group = threadIdx.x / kLanes;

  float qv[kVec];
  lsf::load_vec<T, kVec>(q + r * a.q_r + h * a.q_h + lane * kVec, qv);
#pragma unroll
  for (int i = 0; i < kVec; ++i) qv[i] = lsf::to_float(lsf::from_float<T>(qv[i] * a.scale));

  // scores, one position per group; every thread runs the same trip count (shuffles)
  for (int base = 0; base < a.T; base += kGroups) {
    const int t = base + group;
    const bool valid = t < a.T;
    const bool masked = !valid || (mask != nullptr && mask[r * a.mask_r + t * a.mask_t]);
    float dot = 0.f;
    if (!masked) {
      const int64_t n = rows[r * a.rows_r + t * a.rows_t];
      CUDA_KERNEL_ASSERT(n >= 0 && n < a.N);
      float kv[kVec];
      lsf::load_vec<T, kVec>(k + n * a.k_n + h * a.k_h + t * a.k_t + lane * kVec, kv);
#pragma unroll
      for (int i = 0; i < kVec; ++i) dot += qv[i] * kv[i];
    }
    dot = group_sum<D>(dot);
    if (valid && lane == 0) {
      scores[t] = masked ? -INFINITY : lsf::to_float(lsf::from_float<T>(dot));
    }
  }
  __syncthreads();

  float m = -INFINITY;
  for (int t = threadIdx.x; t < a.T; t += kThreads) m = fmaxf(m, scores[t]);
  m = block_reduce<true>(m, scratch);
  T* o = out + (r * a.H + h) * D;
  if (m == -INFINITY) {  // every key masked (or none): attends nowhere
    for (int d = threadIdx.x; d < D; d += kThreads) o[d] = lsf::from_float<T>(0.f);
    return;
  }
  float sum = 0.f;
  for (int t = threadIdx.x; t < a.T; t += kThreads) {
    const float e = expf(scores[t] - m);  // exp(-inf) = 0 for masked positions
    scores[t] = e;
    sum += e;
  }
  sum = block_reduce<false>(sum, scratch);
  for (int t = threadIdx.x; t < a.T; t += kThreads) {
    scores[t] = lsf::to_float(lsf::from_float<T>(scores[t] / sum));
  }
  __syncthreads();

  float acc[kVec] = {};
  for (int t = group; t < a.T; t += kGroups) {  // no shuffles here: groups may diverge
    const float p = scores[t];
    if (p == 0.f) continue;  // masked, or a probability that rounds to zero
    const int64_t n = rows[r * a.rows_r + t * a.rows_t];
    CUDA_KERNEL_ASSERT(n >= 0 && n < a.N);
    float vv[kVec];
    lsf::load_vec<T, kVec>(v + n * a.v_n + h * a.v_h + t * a.v_t + lane * kVec, vv);
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] += p * vv[i];
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) partial[group][lane * kVec + i] = acc[i];
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float s = 0.f;
#pragma unroll 4
    for (int g = 0; g < kGroups; ++g) s += partial[g][d];
    o[d] = lsf::from_float<T>(s);
  }
}

bool aligned(const at::Tensor& t, std::initializer_list<int> dims) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0 || t.stride(-1) != 1) return false;
  for (int d : dims) {
    if (t.stride(d) % kVec != 0) return false;
  }
  return true;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& rows, const c10::optional<at::Tensor>& key_padding_mask) {
  const char* name = "ls_fairseq decode_attention";
  LSF_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes(), name,
            ": needs q [R, H, D] and k, v [N, H, T, D] of one shape; got q ", q.sizes(), ", k ",
            k.sizes(), ", v ", v.sizes());
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), N = k.size(0), T = k.size(2);
  LSF_CHECK(k.size(1) == H && k.size(3) == D, name, ": k/v ", k.sizes(), " do not have q's ", H,
            " heads of ", D);
  LSF_CHECK(q.is_cuda() && k.device() == q.device() && v.device() == q.device() &&
                rows.device() == q.device(),
            name, ": q, k, v and rows must be on one CUDA device");
  LSF_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16),
            name, ": q, k, v must be float16 or bfloat16 of one dtype, got ", q.scalar_type(), ", ",
            k.scalar_type(), ", ", v.scalar_type());
  LSF_CHECK(D == 32 || D == 64 || D == 128, name, ": head size ", D, " (the kernel takes 32, 64, 128)");
  LSF_CHECK(T <= kMaxKeys, name, ": ", T, " key positions (the kernel takes at most ", kMaxKeys, ")");
  LSF_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2 && rows.size(0) == R &&
                rows.size(1) == T,
            name, ": rows must be int64 [R, T] = [", R, ", ", T, "], got ", rows.scalar_type(), " ",
            rows.sizes());
  LSF_CHECK(aligned(q, {0, 1}) && aligned(k, {0, 1, 2}) && aligned(v, {0, 1, 2}), name,
            ": q, k, v need a contiguous last dim, 16-byte aligned data and strides that are "
            "multiples of 8 elements");
  const bool* mask_ptr = nullptr;
  int64_t mask_r = 0, mask_t = 0;
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    const at::Tensor& m = *key_padding_mask;
    LSF_CHECK(m.scalar_type() == at::kBool && m.dim() == 2 && m.size(0) == R && m.size(1) == T &&
                  m.device() == q.device(),
              name, ": key_padding_mask must be bool [R, T] = [", R, ", ", T, "] on q's device, got ",
              m.scalar_type(), " ", m.sizes());
    mask_ptr = m.data_ptr<bool>();
    mask_r = m.stride(0);
    mask_t = m.stride(1);
  }
  at::Tensor out = at::empty({R, H, D}, q.options());
  if (R == 0 || H == 0) return out;
  c10::cuda::CUDAGuard guard(q.device());
  Args a{q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
         v.stride(2), rows.stride(0), rows.stride(1), mask_r, mask_t, N, static_cast<int>(H),
         static_cast<int>(T), static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)))};
  const size_t smem = static_cast<size_t>(std::max<int64_t>(T, 1)) * sizeof(float);
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto launch = [&](auto type_tag, auto dim_tag) {
    using T_ = decltype(type_tag);
    constexpr int kD = decltype(dim_tag)::value;
    decode_attention_kernel<T_, kD><<<static_cast<unsigned>(R * H), kThreads, smem, stream>>>(
        reinterpret_cast<const T_*>(q.data_ptr()), reinterpret_cast<const T_*>(k.data_ptr()),
        reinterpret_cast<const T_*>(v.data_ptr()), rows.data_ptr<int64_t>(), mask_ptr,
        reinterpret_cast<T_*>(out.data_ptr()), a);
  };
  auto by_dim = [&](auto type_tag) {
    if (D == 32) launch(type_tag, std::integral_constant<int, 32>{});
    else if (D == 64) launch(type_tag, std::integral_constant<int, 64>{});
    else launch(type_tag, std::integral_constant<int, 128>{});
  };
  if (q.scalar_type() == at::kHalf) by_dim(__half{});
  else by_dim(__nv_bfloat16{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace ls_fairseq_decode_attention

TORCH_LIBRARY_FRAGMENT(ls_fairseq, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor rows, Tensor? key_padding_mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(ls_fairseq, CUDA, m) {
  m.impl("decode_attention", &ls_fairseq_decode_attention::decode_attention);
}
