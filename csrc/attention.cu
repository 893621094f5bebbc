// Attention core for ls_fairseq: scale + mask + softmax + dropout fused into one kernel between two
// batched cuBLAS GEMMs (the "softmax" backend of ls_fairseq/ops/_attention_cuda.py), and its backward
// (softmax-grad + dropout-grad fused into one kernel between the GEMMs of the backward).
//
// Ops (torch.ops.ls_fairseq.*):
//   attention_fwd(q, k, v, key_padding_mask?, causal, dropout_p, training) -> (out, probs, rng_state)
//   attention_bwd(grad_out, q, k, v, probs, rng_state, dropout_p) -> (grad_q, grad_k, grad_v)
// q [B, H, Tq, D], k [B, H, Tk, D], v [B, H, Tk, Dv] (any strides), key_padding_mask [B, Tk] bool
// (True = padding). With `causal`, query i sees keys j <= i + Tk - Tq (bottom-right alignment, so one
// incremental-decoding query sees all cached keys). q is scaled by D^-0.5 in its own dtype before the
// first GEMM (as fairseq does). Softmax statistics are fp32; a row whose keys are all masked gives
// zeros (never NaN). `probs` (softmax output, storage dtype) is kept for backward; the dropout mask is
// not stored: backward regenerates it from the Philox seed/offset in `rng_state` (int64 [2] on the
// device, written by the forward kernel so CUDA-graph capture works too).
//
// Row lengths: one warp per row holds the whole row in registers, N elements per lane
// (N in {1,2,4,8,16,32} -> rows up to 32, 64, ..., 1024 keys), 4-wide vector accesses when the row
// length allows; longer rows go to a block-per-row kernel that streams the row (any length).
#include <ATen/ATen.h>
#include <ATen/core/PhiloxRNGEngine.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <mutex>
#include <string>
#include <tuple>

#include "check.h"

namespace ls_fairseq_attention {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 4;     // rows per block in the warp-per-row kernels
constexpr int kLongThreads = 256;     // threads per row in the long-row kernels
constexpr int kMaxWarpRow = 32 * kWarp;  // longest row held in registers (1024 keys)

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Block-wide reduction for the long-row kernels (blockDim.x == kLongThreads).
template <bool IS_MAX>
__device__ __forceinline__ float block_reduce(float x, float* smem) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  x = IS_MAX ? warp_max(x) : warp_sum(x);
  __syncthreads();  // smem may still be read by a previous reduction
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  constexpr int kWarps = kLongThreads / kWarp;
  float r = lane < kWarps ? smem[lane] : (IS_MAX ? -INFINITY : 0.f);
  return IS_MAX ? warp_max(r) : warp_sum(r);
}

// Four uniforms in [0, 1) from one Philox4x32-10 block at (seed, subsequence, offset).
__device__ __forceinline__ float4 philox_uniform4(uint64_t seed, uint64_t subseq, uint64_t offset) {
  at::philox_engine engine(seed, subseq, offset);
  constexpr float kInv24 = 1.0f / 16777216.0f;  // 24 random bits -> [0, 1)
  float4 r;
  r.x = static_cast<float>(engine() >> 8) * kInv24;
  r.y = static_cast<float>(engine() >> 8) * kInv24;
  r.z = static_cast<float>(engine() >> 8) * kInv24;
  r.w = static_cast<float>(engine() >> 8) * kInv24;
  return r;
}

__device__ __forceinline__ float pick(const float4& r, int c) {
  return c == 0 ? r.x : (c == 1 ? r.y : (c == 2 ? r.z : r.w));
}

// Number of keys row `i` of Tq may see under the causal mask (bottom-right aligned).
__device__ __forceinline__ int causal_limit(bool causal, int i, int Tq, int Tk) {
  if (!causal) return Tk;
  const int lim = i + Tk - Tq + 1;
  return lim < Tk ? lim : Tk;
}

struct FwdArgs {
  int64_t rows;  // B * H * Tq
  int H, Tq, Tk;
  bool causal;
  float keep_prob;  // 1 - dropout_p
  bool dropout;
};

// ---------------------------------------------------------------------------------------------
// Forward, one warp per row, N scores per lane in registers (Tk <= 32 * N), VEC-wide accesses.
// Lane `lane`, slot s = c * VEC + e holds key j = (c * 32 + lane) * VEC + e.
// Dropout: slot s uses component s % 4 of Philox subsequence (row * 32 + lane) * G + s / 4.
template <typename T, int N, int VEC>
__global__ void __launch_bounds__(kWarp* kWarpsPerBlock)
    attn_softmax_fwd_warp(const T* __restrict__ scores, T* __restrict__ probs, T* __restrict__ dropped,
                          const bool* __restrict__ kpm, FwdArgs a, at::PhiloxCudaState philox,
                          int64_t* __restrict__ rng_out) {
  static_assert(N % VEC == 0, "N must be a multiple of VEC");
  constexpr int G = (N + 3) / 4;
  const int lane = threadIdx.x;
  uint64_t seed = 0, offset = 0;
  if (a.dropout) {
    auto so = at::cuda::philox::unpack(philox);
    seed = std::get<0>(so);
    offset = std::get<1>(so);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    rng_out[0] = static_cast<int64_t>(seed);
    rng_out[1] = static_cast<int64_t>(offset);
  }
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.y;
  if (row >= a.rows) return;
  const int Tk = a.Tk;
  const int i = static_cast<int>(row % a.Tq);
  const int64_t b = row / (static_cast<int64_t>(a.H) * a.Tq);
  const int lim = causal_limit(a.causal, i, a.Tq, Tk);
  const bool* mrow = kpm ? kpm + b * Tk : nullptr;
  const T* src = scores + row * Tk;

  float x[N];
#pragma unroll
  for (int c = 0; c < N / VEC; ++c) {
    const int j0 = (c * kWarp + lane) * VEC;
    float vals[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) vals[e] = 0.f;
    if (j0 < Tk) {  // Tk % VEC == 0, so the whole pack is inside the row
      if (VEC == 1) {
        vals[0] = static_cast<float>(src[j0]);
      } else {
        const Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC>*>(src + j0);
#pragma unroll
        for (int e = 0; e < VEC; ++e) vals[e] = static_cast<float>(p.v[e]);
      }
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const int j = j0 + e;
      const bool ok = j < lim && !(mrow != nullptr && mrow[j]);
      x[c * VEC + e] = ok ? vals[e] : -INFINITY;
    }
  }
  float m = -INFINITY;
#pragma unroll
  for (int s = 0; s < N; ++s) m = fmaxf(m, x[s]);
  m = warp_max(m);
  float sum = 0.f;
  if (m != -INFINITY) {
#pragma unroll
    for (int s = 0; s < N; ++s) {
      x[s] = __expf(x[s] - m);  // masked: exp(-inf) = 0
      sum += x[s];
    }
  } else {
#pragma unroll
    for (int s = 0; s < N; ++s) x[s] = 0.f;  // every key masked: the row attends nowhere
  }
  sum = warp_sum(sum);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;

  float rnd[N];
  if (a.dropout) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float4 r = philox_uniform4(seed, (static_cast<uint64_t>(row) * kWarp + lane) * G + g, offset);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (g * 4 + e < N) rnd[g * 4 + e] = pick(r, e);
    }
  }
  const float drop_scale = a.dropout ? 1.f / a.keep_prob : 1.f;
  T* prow = probs + row * Tk;
  T* drow = a.dropout ? dropped + row * Tk : nullptr;
#pragma unroll
  for (int c = 0; c < N / VEC; ++c) {
    const int j0 = (c * kWarp + lane) * VEC;
    if (j0 >= Tk) continue;
    Pack<T, VEC> p, d;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const int s = c * VEC + e;
      p.v[e] = static_cast<T>(x[s] * inv);
      if (a.dropout) {
        // dropout applies to the rounded probability, as the reference does (probs.type_as(scores))
        d.v[e] = static_cast<T>(rnd[s] < a.keep_prob ? static_cast<float>(p.v[e]) * drop_scale : 0.f);
      }
    }
    *reinterpret_cast<Pack<T, VEC>*>(prow + j0) = p;
    if (a.dropout) *reinterpret_cast<Pack<T, VEC>*>(drow + j0) = d;
  }
}

// Forward for rows longer than kMaxWarpRow: one block per row, three streaming passes
// (max, sum, write). Thread t handles keys 4g..4g+3 for g = t, t + 256, ...;
// dropout for key j uses component j % 4 of Philox subsequence row * ceil(Tk / 4) + j / 4.
template <typename T>
__global__ void __launch_bounds__(kLongThreads)
    attn_softmax_fwd_long(const T* __restrict__ scores, T* __restrict__ probs, T* __restrict__ dropped,
                          const bool* __restrict__ kpm, FwdArgs a, at::PhiloxCudaState philox,
                          int64_t* __restrict__ rng_out) {
  __shared__ float smem[kWarp];
  uint64_t seed = 0, offset = 0;
  if (a.dropout) {
    auto so = at::cuda::philox::unpack(philox);
    seed = std::get<0>(so);
    offset = std::get<1>(so);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    rng_out[0] = static_cast<int64_t>(seed);
    rng_out[1] = static_cast<int64_t>(offset);
  }
  const int64_t row = blockIdx.x;
  const int Tk = a.Tk;
  const int i = static_cast<int>(row % a.Tq);
  const int64_t b = row / (static_cast<int64_t>(a.H) * a.Tq);
  const int lim = causal_limit(a.causal, i, a.Tq, Tk);
  const bool* mrow = kpm ? kpm + b * Tk : nullptr;
  const T* src = scores + row * Tk;
  const int groups = (Tk + 3) / 4;

  auto load = [&](int j) -> float {
    const bool ok = j < lim && !(mrow != nullptr && mrow[j]);
    return ok ? static_cast<float>(src[j]) : -INFINITY;
  };

  float m = -INFINITY;
  for (int g = threadIdx.x; g < groups; g += kLongThreads)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (4 * g + e < Tk) m = fmaxf(m, load(4 * g + e));
  m = block_reduce<true>(m, smem);
  float sum = 0.f;
  if (m != -INFINITY) {
    for (int g = threadIdx.x; g < groups; g += kLongThreads)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (4 * g + e < Tk) sum += __expf(load(4 * g + e) - m);
  }
  sum = block_reduce<false>(sum, smem);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  const float drop_scale = a.dropout ? 1.f / a.keep_prob : 1.f;
  T* prow = probs + row * Tk;
  T* drow = a.dropout ? dropped + row * Tk : nullptr;
  for (int g = threadIdx.x; g < groups; g += kLongThreads) {
    float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
    if (a.dropout) r = philox_uniform4(seed, static_cast<uint64_t>(row) * groups + g, offset);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = 4 * g + e;
      if (j >= Tk) break;
      const float p = m != -INFINITY ? __expf(load(j) - m) * inv : 0.f;
      const T pt = static_cast<T>(p);
      prow[j] = pt;
      if (a.dropout) drow[j] = static_cast<T>(pick(r, e) < a.keep_prob ? static_cast<float>(pt) * drop_scale : 0.f);
    }
  }
}

struct BwdArgs {
  int64_t rows;
  int Tk;
  float keep_prob;
  bool dropout;
};

// Backward, one warp per row: with P = probs, G = d(dropped), the dropout mask regenerated
// exactly as in the forward: dP = G * keep / (1 - p), dS = P * (dP - sum(P * dP)),
// written over G; Pd = P * keep / (1 - p) (the forward's dropped probabilities, for dV).
template <typename T, int N, int VEC>
__global__ void __launch_bounds__(kWarp* kWarpsPerBlock)
    attn_softmax_bwd_warp(T* __restrict__ grad, const T* __restrict__ probs, T* __restrict__ dropped,
                          BwdArgs a, const int64_t* __restrict__ rng) {
  constexpr int G = (N + 3) / 4;
  const int lane = threadIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.y;
  if (row >= a.rows) return;
  const int Tk = a.Tk;
  T* grow = grad + row * Tk;
  const T* prow = probs + row * Tk;
  float p[N], g[N];
#pragma unroll
  for (int c = 0; c < N / VEC; ++c) {
    const int j0 = (c * kWarp + lane) * VEC;
    if (j0 < Tk) {
      const Pack<T, VEC> pp = *reinterpret_cast<const Pack<T, VEC>*>(prow + j0);
      const Pack<T, VEC> gg = *reinterpret_cast<const Pack<T, VEC>*>(grow + j0);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        p[c * VEC + e] = static_cast<float>(pp.v[e]);
        g[c * VEC + e] = static_cast<float>(gg.v[e]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) p[c * VEC + e] = g[c * VEC + e] = 0.f;
    }
  }
  bool keep[N];
  const float drop_scale = a.dropout ? 1.f / a.keep_prob : 1.f;
  if (a.dropout) {
    const uint64_t seed = static_cast<uint64_t>(rng[0]), offset = static_cast<uint64_t>(rng[1]);
#pragma unroll
    for (int q = 0; q < G; ++q) {
      const float4 r = philox_uniform4(seed, (static_cast<uint64_t>(row) * kWarp + lane) * G + q, offset);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (q * 4 + e < N) keep[q * 4 + e] = pick(r, e) < a.keep_prob;
    }
#pragma unroll
    for (int s = 0; s < N; ++s) g[s] = keep[s] ? g[s] * drop_scale : 0.f;
  }
  float dot = 0.f;
#pragma unroll
  for (int s = 0; s < N; ++s) dot += p[s] * g[s];
  dot = warp_sum(dot);
  T* drow = a.dropout ? dropped + row * Tk : nullptr;
#pragma unroll
  for (int c = 0; c < N / VEC; ++c) {
    const int j0 = (c * kWarp + lane) * VEC;
    if (j0 >= Tk) continue;
    Pack<T, VEC> ds, pd;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const int s = c * VEC + e;
      ds.v[e] = static_cast<T>(p[s] * (g[s] - dot));
      if (a.dropout) pd.v[e] = static_cast<T>(keep[s] ? p[s] * drop_scale : 0.f);
    }
    *reinterpret_cast<Pack<T, VEC>*>(grow + j0) = ds;
    if (a.dropout) *reinterpret_cast<Pack<T, VEC>*>(drow + j0) = pd;
  }
}

template <typename T>
__global__ void __launch_bounds__(kLongThreads)
    attn_softmax_bwd_long(T* __restrict__ grad, const T* __restrict__ probs, T* __restrict__ dropped,
                          BwdArgs a, const int64_t* __restrict__ rng) {
  __shared__ float smem[kWarp];
  const int64_t row = blockIdx.x;
  const int Tk = a.Tk;
  const int groups = (Tk + 3) / 4;
  T* grow = grad + row * Tk;
  const T* prow = probs + row * Tk;
  uint64_t seed = 0, offset = 0;
  if (a.dropout) {
    seed = static_cast<uint64_t>(rng[0]);
    offset = static_cast<uint64_t>(rng[1]);
  }
  const float drop_scale = a.dropout ? 1.f / a.keep_prob : 1.f;
  float dot = 0.f;
  for (int g = threadIdx.x; g < groups; g += kLongThreads) {
    float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
    if (a.dropout) r = philox_uniform4(seed, static_cast<uint64_t>(row) * groups + g, offset);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = 4 * g + e;
      if (j >= Tk) break;
      float gj = static_cast<float>(grow[j]);
      if (a.dropout) gj = pick(r, e) < a.keep_prob ? gj * drop_scale : 0.f;
      dot += static_cast<float>(prow[j]) * gj;
    }
  }
  dot = block_reduce<false>(dot, smem);
  for (int g = threadIdx.x; g < groups; g += kLongThreads) {
    float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
    if (a.dropout) r = philox_uniform4(seed, static_cast<uint64_t>(row) * groups + g, offset);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = 4 * g + e;
      if (j >= Tk) break;
      const float pj = static_cast<float>(prow[j]);
      float gj = static_cast<float>(grow[j]);
      bool kept = true;
      if (a.dropout) {
        kept = pick(r, e) < a.keep_prob;
        gj = kept ? gj * drop_scale : 0.f;
        dropped[row * Tk + j] = static_cast<T>(kept ? pj * drop_scale : 0.f);
      }
      grow[j] = static_cast<T>(pj * (gj - dot));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers: pick the row-length bucket N (Tk <= 32 N) and the vector width.

template <typename T, int N, int VEC>
void launch_fwd_n(const T* s, T* p, T* d, const bool* kpm, const FwdArgs& a, const at::PhiloxCudaState& ph,
                  int64_t* rng, cudaStream_t stream) {
  const dim3 block(kWarp, kWarpsPerBlock);
  const int64_t blocks = (a.rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  attn_softmax_fwd_warp<T, N, VEC><<<static_cast<unsigned>(blocks), block, 0, stream>>>(s, p, d, kpm, a, ph, rng);
}

template <typename T, int N>
void launch_fwd_vec(const T* s, T* p, T* d, const bool* kpm, const FwdArgs& a, const at::PhiloxCudaState& ph,
                    int64_t* rng, cudaStream_t stream) {
  if constexpr (N >= 4) {
    if (a.Tk % 4 == 0) return launch_fwd_n<T, N, 4>(s, p, d, kpm, a, ph, rng, stream);
  }
  launch_fwd_n<T, N, 1>(s, p, d, kpm, a, ph, rng, stream);
}

template <typename T>
void launch_fwd(const T* s, T* p, T* d, const bool* kpm, const FwdArgs& a, const at::PhiloxCudaState& ph,
                int64_t* rng, cudaStream_t stream) {
  const int Tk = a.Tk;
  if (Tk <= 32) return launch_fwd_vec<T, 1>(s, p, d, kpm, a, ph, rng, stream);
  if (Tk <= 64) return launch_fwd_vec<T, 2>(s, p, d, kpm, a, ph, rng, stream);
  if (Tk <= 128) return launch_fwd_vec<T, 4>(s, p, d, kpm, a, ph, rng, stream);
  if (Tk <= 256) return launch_fwd_vec<T, 8>(s, p, d, kpm, a, ph, rng, stream);
  if (Tk <= 512) return launch_fwd_vec<T, 16>(s, p, d, kpm, a, ph, rng, stream);
  if (Tk <= kMaxWarpRow) return launch_fwd_vec<T, 32>(s, p, d, kpm, a, ph, rng, stream);
  attn_softmax_fwd_long<T><<<static_cast<unsigned>(a.rows), kLongThreads, 0, stream>>>(s, p, d, kpm, a, ph, rng);
}

template <typename T, int N, int VEC>
void launch_bwd_n(T* g, const T* p, T* d, const BwdArgs& a, const int64_t* rng, cudaStream_t stream) {
  const dim3 block(kWarp, kWarpsPerBlock);
  const int64_t blocks = (a.rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  attn_softmax_bwd_warp<T, N, VEC><<<static_cast<unsigned>(blocks), block, 0, stream>>>(g, p, d, a, rng);
}

template <typename T, int N>
void launch_bwd_vec(T* g, const T* p, T* d, const BwdArgs& a, const int64_t* rng, cudaStream_t stream) {
  if constexpr (N >= 4) {
    if (a.Tk % 4 == 0) return launch_bwd_n<T, N, 4>(g, p, d, a, rng, stream);
  }
  launch_bwd_n<T, N, 1>(g, p, d, a, rng, stream);
}

template <typename T>
void launch_bwd(T* g, const T* p, T* d, const BwdArgs& a, const int64_t* rng, cudaStream_t stream) {
  const int Tk = a.Tk;
  if (Tk <= 32) return launch_bwd_vec<T, 1>(g, p, d, a, rng, stream);
  if (Tk <= 64) return launch_bwd_vec<T, 2>(g, p, d, a, rng, stream);
  if (Tk <= 128) return launch_bwd_vec<T, 4>(g, p, d, a, rng, stream);
  if (Tk <= 256) return launch_bwd_vec<T, 8>(g, p, d, a, rng, stream);
  if (Tk <= 512) return launch_bwd_vec<T, 16>(g, p, d, a, rng, stream);
  if (Tk <= kMaxWarpRow) return launch_bwd_vec<T, 32>(g, p, d, a, rng, stream);
  attn_softmax_bwd_long<T><<<static_cast<unsigned>(a.rows), kLongThreads, 0, stream>>>(g, p, d, a, rng);
}

// ---------------------------------------------------------------------------------------------
// Host ops.

#define LS_ATTN_DISPATCH(TYPE, NAME, ...)                         \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                  \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)     \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// Error messages are assembled from std::string / std::to_string only, never streamed through
// c10::str (std::ostream): in the JIT build on the GPU machine a TORCH_CHECK that streamed an integer
// crashed inside this library (a std::ostream locale facet mismatch) instead of raising.
std::string dims(at::IntArrayRef s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  LSF_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "ls_fairseq attention: q, k, v must be CUDA tensors");
  LSF_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              std::string("ls_fairseq attention: q, k, v must be 4-D [B, H, T, D], got ") + dims(q.sizes()) +
                  ", " + dims(k.sizes()) + ", " + dims(v.sizes()));
  const auto dt = q.scalar_type();
  LSF_CHECK(dt == at::kHalf || dt == at::kBFloat16 || dt == at::kFloat,
              std::string("ls_fairseq attention: dtype must be float16, bfloat16 or float32, got ") +
                  c10::toString(dt));
  LSF_CHECK(k.scalar_type() == dt && v.scalar_type() == dt, "ls_fairseq attention: q, k, v dtypes differ");
  LSF_CHECK(k.device() == q.device() && v.device() == q.device(), "ls_fairseq attention: q, k, v devices differ");
  LSF_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == q.size(1) && v.size(1) == q.size(1),
              std::string("ls_fairseq attention: batch/head sizes differ: q ") + dims(q.sizes()) + ", k " +
                  dims(k.sizes()) + ", v " + dims(v.sizes()));
  LSF_CHECK(k.size(3) == q.size(3), std::string("ls_fairseq attention: q and k head dims differ: ") +
                                          std::to_string(q.size(3)) + " vs " + std::to_string(k.size(3)));
  LSF_CHECK(k.size(2) == v.size(2), std::string("ls_fairseq attention: k and v lengths differ: ") +
                                          std::to_string(k.size(2)) + " vs " + std::to_string(v.size(2)));
  LSF_CHECK(q.size(2) <= INT32_MAX && k.size(2) <= INT32_MAX, "ls_fairseq attention: sequence too long");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v,
                                                             const std::optional<at::Tensor>& key_padding_mask,
                                                             bool causal, double dropout_p, bool training) {
  check_inputs(q, k, v);
  LSF_CHECK(dropout_p >= 0.0 && dropout_p < 1.0,
              std::string("ls_fairseq attention: dropout_p must be in [0, 1), got ") + std::to_string(dropout_p));
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3), Tk = k.size(2);
  at::Tensor kpm;
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    kpm = *key_padding_mask;
    LSF_CHECK(kpm.scalar_type() == at::kBool,
                std::string("ls_fairseq attention: key_padding_mask must be bool, got ") +
                    c10::toString(kpm.scalar_type()));
    LSF_CHECK(kpm.dim() == 2 && kpm.size(0) == B && kpm.size(1) == Tk,
                std::string("ls_fairseq attention: key_padding_mask must be [B, Tk] = [") + std::to_string(B) +
                    ", " + std::to_string(Tk) + "], got " + dims(kpm.sizes()));
    LSF_CHECK(kpm.device() == q.device(), "ls_fairseq attention: key_padding_mask is on another device");
    kpm = kpm.contiguous();
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  at::Tensor scores = at::matmul(q * scale, k.transpose(-2, -1)).contiguous();  // [B, H, Tq, Tk]
  const bool dropout = training && dropout_p > 0.0;
  at::Tensor probs = at::empty_like(scores, at::MemoryFormat::Contiguous);
  at::Tensor dropped = dropout ? at::empty_like(probs) : probs;
  const int64_t rows = B * H * Tq;
  // the forward kernel writes the Philox seed/offset here (zeros without dropout)
  at::Tensor rng = (rows > 0 && Tk > 0) ? at::empty({2}, q.options().dtype(at::kLong))
                                        : at::zeros({2}, q.options().dtype(at::kLong));
  if (rows > 0 && Tk > 0) {
    FwdArgs a{rows, static_cast<int>(H), static_cast<int>(Tq), static_cast<int>(Tk), causal,
              static_cast<float>(1.0 - dropout_p), dropout};
    at::PhiloxCudaState philox;
    if (dropout) {
      auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt,
                                                                      at::cuda::detail::getDefaultCUDAGenerator());
      std::lock_guard<std::mutex> lock(gen->mutex_);
      philox = gen->philox_cuda_state(4);  // each Philox subsequence is used once, at this offset
    }
    const bool* kp = kpm.defined() ? kpm.data_ptr<bool>() : nullptr;
    auto stream = c10::cuda::getCurrentCUDAStream();
    LS_ATTN_DISPATCH(scores.scalar_type(), "ls_fairseq_attention_fwd", [&] {
      launch_fwd<scalar_t>(scores.data_ptr<scalar_t>(), probs.data_ptr<scalar_t>(),
                           dropout ? dropped.data_ptr<scalar_t>() : nullptr, kp, a, philox, rng.data_ptr<int64_t>(),
                           stream);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  at::Tensor out = at::matmul(dropped, v);
  return {out, probs, rng};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd(const at::Tensor& grad_out, const at::Tensor& q,
                                                             const at::Tensor& k, const at::Tensor& v,
                                                             const at::Tensor& probs, const at::Tensor& rng,
                                                             double dropout_p) {
  check_inputs(q, k, v);
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3), Tk = k.size(2);
  LSF_CHECK(grad_out.dim() == 4 && grad_out.size(0) == B && grad_out.size(1) == H && grad_out.size(2) == Tq &&
                  grad_out.size(3) == v.size(3),
              std::string("ls_fairseq attention_bwd: grad_out has shape ") + dims(grad_out.sizes()));
  LSF_CHECK(grad_out.scalar_type() == q.scalar_type(), "ls_fairseq attention_bwd: grad_out dtype differs from q");
  LSF_CHECK(probs.is_contiguous() && probs.scalar_type() == q.scalar_type() && probs.dim() == 4 &&
                  probs.size(0) == B && probs.size(1) == H && probs.size(2) == Tq && probs.size(3) == Tk,
              "ls_fairseq attention_bwd: probs must be the contiguous [B, H, Tq, Tk] saved by attention_fwd");
  LSF_CHECK(rng.scalar_type() == at::kLong && rng.numel() == 2 && rng.is_cuda() && rng.is_contiguous(),
              "ls_fairseq attention_bwd: rng_state must be the int64 [2] CUDA tensor saved by attention_fwd");
  LSF_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "ls_fairseq attention_bwd: dropout_p must be in [0, 1)");
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  at::Tensor grad = at::matmul(grad_out, v.transpose(-2, -1)).contiguous();  // d(dropped), then d(scores)
  const bool dropout = dropout_p > 0.0;
  at::Tensor dropped = dropout ? at::empty_like(probs) : probs;
  const int64_t rows = B * H * Tq;
  if (rows > 0 && Tk > 0) {
    BwdArgs a{rows, static_cast<int>(Tk), static_cast<float>(1.0 - dropout_p), dropout};
    auto stream = c10::cuda::getCurrentCUDAStream();
    LS_ATTN_DISPATCH(grad.scalar_type(), "ls_fairseq_attention_bwd", [&] {
      launch_bwd<scalar_t>(grad.data_ptr<scalar_t>(), probs.data_ptr<scalar_t>(),
                           dropout ? dropped.data_ptr<scalar_t>() : nullptr, a, rng.data_ptr<int64_t>(), stream);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  at::Tensor grad_v = at::matmul(dropped.transpose(-2, -1), grad_out);
  at::Tensor grad_q = at::matmul(grad, k).mul_(scale);
  at::Tensor grad_k = at::matmul(grad.transpose(-2, -1), q).mul_(scale);
  return {grad_q, grad_k, grad_v};
}

}  // namespace ls_fairseq_attention

TORCH_LIBRARY_FRAGMENT(ls_fairseq, m) {
  m.def(
      "attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, bool causal, float dropout_p, "
      "bool training) -> (Tensor, Tensor, Tensor)");
  m.def(
      "attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor probs, Tensor rng_state, "
      "float dropout_p) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ls_fairseq, CUDA, m) {
  m.impl("attention_fwd", &ls_fairseq_attention::attention_fwd);
  m.impl("attention_bwd", &ls_fairseq_attention::attention_bwd);
}
