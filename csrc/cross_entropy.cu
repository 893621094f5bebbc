// Label-smoothed cross-entropy straight from logits (fairseq's formula), forward and backward.
//
// Spec: ls_fairseq/ops/cross_entropy.py. Per row i with target t (rows whose target equals
// ignore_index contribute zero and get a zero gradient):
//   lse    = max + log(sum_j exp(x_j - max))            (one pass: online max / sum-exp / sum x)
//   nll    = lse - x_t            smooth = V * lse - sum_j x_j       eps_i = eps / (V - 1)
//   loss   = (1 - eps - eps_i) * nll + eps_i * smooth
//   dloss/dx_j = p_j - eps_i - (1 - eps - eps_i) [j == t]     dnll/dx_j = p_j - [j == t]
// Storage fp16/bf16/fp32, math fp32. Nothing of size [N, V] is allocated in fp32: the forward
// keeps only lse per row, the backward reads the logits once and writes the gradient once, in
// the logits dtype, optionally over the logits themselves (ls_cross_entropy_bwd_).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "check.h"
#include "device_utils.cuh"
#include "launch_utils.h"

namespace ls_fairseq_ce {

constexpr int kMaxThreads = 256;
constexpr int kUnroll = 4;  // vectors loaded before any is used: memory-level parallelism

using lsf::from_float;
using lsf::to_float;

// 16-byte vector of T.
template <typename T>
struct alignas(16) Vec {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

// Elements [0, head) of a row are read one by one until the address is 16-byte aligned, then
// [head, head + nvec * N) as vectors, then the tail one by one. Works for any V and row offset.
template <typename T>
__device__ __forceinline__ int64_t aligned_head(const T* p, int64_t V) {
  const int64_t mis = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) & 15);
  int64_t head = mis == 0 ? 0 : (16 - mis) / static_cast<int64_t>(sizeof(T));
  return head < V ? head : V;
}

struct RowStats {
  float m;    // running max
  float s;    // sum exp(x - m)
  float sx;   // sum x
  int64_t am; // index of the first maximum
};

__device__ __forceinline__ float safe_exp_diff(float a, float m) {
  // exp(a - m) with exp(-inf - (-inf)) := 0 (a thread that saw only -inf logits).
  return m == -INFINITY ? 0.f : __expf(a - m);
}

__device__ __forceinline__ void stats_merge(RowStats& a, const RowStats& b) {
  const float m = fmaxf(a.m, b.m);
  const float s = (a.s == 0.f ? 0.f : a.s * safe_exp_diff(a.m, m)) +
                  (b.s == 0.f ? 0.f : b.s * safe_exp_diff(b.m, m));
  int64_t am;
  if (b.m > a.m) am = b.am;
  else if (a.m > b.m) am = a.am;
  else am = (a.am < b.am) ? a.am : b.am;  // ties (and both -1): first index
  a.m = m;
  a.s = s;
  a.sx += b.sx;
  a.am = am;
}

__device__ __forceinline__ void stats_add(RowStats& st, float x, int64_t j) {
  if (x > st.m) {
    st.s = st.s == 0.f ? 0.f : st.s * __expf(st.m - x);
    st.m = x;
    st.am = j;
  }
  st.s += safe_exp_diff(x, st.m);
  st.sx += x;
}

template <typename T>
__device__ __forceinline__ void stats_add_vec(RowStats& st, const Vec<T>& v, int64_t j0) {
  constexpr int N = Vec<T>::N;
  float x[N];
#pragma unroll
  for (int k = 0; k < N; ++k) x[k] = to_float(v.v[k]);
  float vm = x[0];
  int64_t vi = j0;
#pragma unroll
  for (int k = 1; k < N; ++k) {
    if (x[k] > vm) { vm = x[k]; vi = j0 + k; }
  }
  if (vm > st.m) {
    st.s = st.s == 0.f ? 0.f : st.s * __expf(st.m - vm);
    st.m = vm;
    st.am = vi;
  }
  if (st.m != -INFINITY) {
#pragma unroll
    for (int k = 0; k < N; ++k) st.s += __expf(x[k] - st.m);
  }
#pragma unroll
  for (int k = 0; k < N; ++k) st.sx += x[k];
}

__device__ __forceinline__ RowStats warp_merge(RowStats st) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    RowStats o;
    o.m = __shfl_xor_sync(0xffffffffu, st.m, off);
    o.s = __shfl_xor_sync(0xffffffffu, st.s, off);
    o.sx = __shfl_xor_sync(0xffffffffu, st.sx, off);
    o.am = __shfl_xor_sync(0xffffffffu, st.am, off);
    stats_merge(st, o);
  }
  return st;
}

template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
ce_fwd_kernel(const T* __restrict__ logits, const int64_t* __restrict__ target, int64_t N,
              int64_t V, float smooth_coef /*eps_i*/, float nll_coef /*1-eps-eps_i*/,
              int64_t ignore_index, float* __restrict__ loss_rows, float* __restrict__ nll_rows,
              float* __restrict__ lse_rows, int64_t* __restrict__ argmax_rows) {
  using VecT = Vec<T>;
  constexpr int VN = VecT::N;
  __shared__ RowStats shared[kMaxThreads / 32];
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  const int64_t t = target[row];
  if (t == ignore_index) {
    if (tid == 0) {
      loss_rows[row] = 0.f;
      nll_rows[row] = 0.f;
      lse_rows[row] = 0.f;
      if (argmax_rows != nullptr) argmax_rows[row] = -1;
    }
    return;
  }
  const T* x = logits + row * V;
  const int64_t head = aligned_head(x, V);
  const int64_t nvec = (V - head) / VN;
  const int64_t tail_begin = head + nvec * VN;
  RowStats st{-INFINITY, 0.f, 0.f, -1};
  for (int64_t j = tid; j < head; j += nthreads) stats_add(st, to_float(x[j]), j);
  const VecT* xv = reinterpret_cast<const VecT*>(x + head);
  for (int64_t base = tid; base < nvec; base += static_cast<int64_t>(nthreads) * kUnroll) {
    VecT buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * nthreads;
      if (i < nvec) buf[u] = xv[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * nthreads;
      if (i < nvec) stats_add_vec(st, buf[u], head + i * VN);
    }
  }
  for (int64_t j = tail_begin + tid; j < V; j += nthreads) stats_add(st, to_float(x[j]), j);

  st = warp_merge(st);
  const int warp = tid >> 5, lane = tid & 31;
  if (lane == 0) shared[warp] = st;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = (nthreads + 31) >> 5;
    st = lane < nwarps ? shared[lane] : RowStats{-INFINITY, 0.f, 0.f, -1};
    st = warp_merge(st);
    if (lane == 0) {
      float nll, loss, lse;
      if (t < 0 || t >= V) {
        // A target outside [0, V) that is not ignore_index: fairseq's gather would raise a
        // device-side assert; we poison the row's loss with NaN instead (visible, no crash).
        lse = NAN;
        nll = NAN;
        loss = NAN;
      } else {
        lse = st.m + logf(st.s);
        nll = lse - to_float(x[t]);
        const float smooth = static_cast<float>(V) * lse - st.sx;
        loss = nll_coef * nll + smooth_coef * smooth;
      }
      loss_rows[row] = loss;
      nll_rows[row] = nll;
      lse_rows[row] = lse;
      if (argmax_rows != nullptr) argmax_rows[row] = st.am;
    }
  }
}

// grad_j = (gl + gn) * exp(x_j - lse) - gl * eps_i - [j == t] * (gl * (1 - eps - eps_i) + gn)
// `out` may alias `logits` (each element is read and written by the same thread).
template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
ce_bwd_kernel(const float* grad_loss, int64_t gl_stride, const float* grad_nll, int64_t gn_stride,
              const T* logits, const int64_t* __restrict__ target,
              const float* __restrict__ lse_rows, int64_t V, float smooth_coef, float nll_coef,
              int64_t ignore_index, T* out, bool vectorize) {
  using VecT = Vec<T>;
  constexpr int VN = VecT::N;
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  const int64_t t = target[row];
  const T* x = logits + row * V;
  T* y = out + row * V;
  const bool pad = (t == ignore_index);
  float a = 0.f, b = 0.f, c = 0.f, lse = 0.f;
  if (!pad) {
    const float gl = grad_loss != nullptr ? grad_loss[row * gl_stride] : 0.f;
    const float gn = grad_nll != nullptr ? grad_nll[row * gn_stride] : 0.f;
    a = gl + gn;                     // coefficient of p_j
    b = -gl * smooth_coef;           // added to every j
    c = -(gl * nll_coef + gn);       // added at j == t
    lse = lse_rows[row];
  }
  const T zero = from_float<T>(0.f);
  auto grad_of = [&](float xj, int64_t j) -> float {
    float g = __fmaf_rn(a, __expf(xj - lse), b);  // explicit fma: same rounding on every path
    if (j == t) g += c;
    return g;
  };
  if (!vectorize) {
    for (int64_t j = tid; j < V; j += nthreads) y[j] = pad ? zero : from_float<T>(grad_of(to_float(x[j]), j));
    return;
  }
  const int64_t head = aligned_head(x, V);  // same alignment for y (checked on the host side)
  const int64_t nvec = (V - head) / VN;
  const int64_t tail_begin = head + nvec * VN;
  for (int64_t j = tid; j < head; j += nthreads) y[j] = pad ? zero : from_float<T>(grad_of(to_float(x[j]), j));
  const VecT* xv = reinterpret_cast<const VecT*>(x + head);
  VecT* yv = reinterpret_cast<VecT*>(y + head);
  if (pad) {
    VecT z;
#pragma unroll
    for (int k = 0; k < VN; ++k) z.v[k] = zero;
    for (int64_t i = tid; i < nvec; i += nthreads) yv[i] = z;
  } else {
    for (int64_t base = tid; base < nvec; base += static_cast<int64_t>(nthreads) * kUnroll) {
      VecT buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + static_cast<int64_t>(u) * nthreads;
        if (i < nvec) buf[u] = xv[i];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + static_cast<int64_t>(u) * nthreads;
        if (i < nvec) {
          const int64_t j0 = head + i * VN;
          VecT r;
#pragma unroll
          for (int k = 0; k < VN; ++k) r.v[k] = from_float<T>(grad_of(to_float(buf[u].v[k]), j0 + k));
          yv[i] = r;
        }
      }
    }
  }
  for (int64_t j = tail_begin + tid; j < V; j += nthreads) y[j] = pad ? zero : from_float<T>(grad_of(to_float(x[j]), j));
}

int threads_for(int64_t V, int64_t elem_size) {
  const int64_t nvec = (V * elem_size + 15) / 16;
  int threads = 32;
  while (threads < kMaxThreads && threads * 4 < nvec) threads *= 2;
  return threads;
}

void check_common(const at::Tensor& logits, const at::Tensor& target) {
  LSF_CHECK(logits.is_cuda(), "ls_cross_entropy: logits must be a CUDA tensor");
  LSF_CHECK(logits.dim() == 2, "ls_cross_entropy: logits must be [N, V], got ", logits.sizes());
  LSF_CHECK(logits.is_contiguous(), "ls_cross_entropy: logits must be contiguous");
  LSF_CHECK(logits.scalar_type() == at::kHalf || logits.scalar_type() == at::kBFloat16 ||
                  logits.scalar_type() == at::kFloat,
              "ls_cross_entropy: logits must be float16, bfloat16 or float32, got ",
              logits.scalar_type());
  LSF_CHECK(target.device() == logits.device(), "ls_cross_entropy: target on ", target.device(),
              " but logits on ", logits.device());
  LSF_CHECK(target.scalar_type() == at::kLong, "ls_cross_entropy: target must be int64");
  LSF_CHECK(target.dim() == 1 && target.size(0) == logits.size(0) && target.is_contiguous(),
              "ls_cross_entropy: target must be a contiguous [N] tensor matching logits [N, V]");
  LSF_CHECK(logits.size(1) >= 2, "ls_cross_entropy: needs V >= 2 (label smoothing divides by V - 1)");
  LSF_CHECK(logits.size(0) <= static_cast<int64_t>(INT32_MAX),
              "ls_cross_entropy: more than 2^31-1 rows");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ce_fwd(
    const at::Tensor& logits, const at::Tensor& target, double epsilon, int64_t ignore_index,
    bool compute_argmax) {
  check_common(logits, target);
  const c10::cuda::OptionalCUDAGuard guard(logits.device());
  const int64_t N = logits.size(0), V = logits.size(1);
  auto fopts = logits.options().dtype(at::kFloat);
  at::Tensor loss_rows = at::empty({N}, fopts);
  at::Tensor nll_rows = at::empty({N}, fopts);
  at::Tensor lse = at::empty({N}, fopts);
  at::Tensor argmax = at::empty({compute_argmax ? N : 0}, logits.options().dtype(at::kLong));
  if (N == 0) return {loss_rows, nll_rows, lse, argmax};
  const double eps_i = epsilon / static_cast<double>(V - 1);
  const float smooth_coef = static_cast<float>(eps_i);
  const float nll_coef = static_cast<float>(1.0 - epsilon - eps_i);
  auto stream = c10::cuda::getCurrentCUDAStream();
  LSF_DISPATCH_FLOAT_TYPES(logits.scalar_type(), "ls_cross_entropy_fwd", [&] {
    const int threads = threads_for(V, sizeof(T));
    ce_fwd_kernel<T><<<static_cast<unsigned>(N), threads, 0, stream>>>(
        reinterpret_cast<const T*>(logits.data_ptr()), target.data_ptr<int64_t>(), N, V,
        smooth_coef, nll_coef, ignore_index, loss_rows.data_ptr<float>(),
        nll_rows.data_ptr<float>(), lse.data_ptr<float>(),
        compute_argmax ? argmax.data_ptr<int64_t>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {loss_rows, nll_rows, lse, argmax};
}

const float* grad_ptr(const c10::optional<at::Tensor>& g, int64_t N, int64_t* stride,
                      const at::Tensor& logits, const char* what) {
  *stride = 0;
  if (!g.has_value() || !g->defined()) return nullptr;
  LSF_CHECK(g->scalar_type() == at::kFloat, "ls_cross_entropy_bwd: ", what, " must be float32");
  LSF_CHECK(g->device() == logits.device(), "ls_cross_entropy_bwd: ", what, " on wrong device");
  if (g->numel() == 1) return g->data_ptr<float>();
  LSF_CHECK(g->dim() == 1 && g->size(0) == N, "ls_cross_entropy_bwd: ", what,
              " must have one element or N elements, got ", g->sizes());
  *stride = g->stride(0);
  return g->data_ptr<float>();
}

void ce_bwd_launch(const c10::optional<at::Tensor>& grad_loss,
                   const c10::optional<at::Tensor>& grad_nll, const at::Tensor& logits,
                   const at::Tensor& target, const at::Tensor& lse, double epsilon,
                   int64_t ignore_index, at::Tensor& out) {
  check_common(logits, target);
  const int64_t N = logits.size(0), V = logits.size(1);
  LSF_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 1 && lse.size(0) == N &&
                  lse.is_contiguous() && lse.device() == logits.device(),
              "ls_cross_entropy_bwd: lse must be a contiguous float32 [N] tensor on the logits' device");
  LSF_CHECK(out.sizes() == logits.sizes() && out.scalar_type() == logits.scalar_type() &&
                  out.is_contiguous(),
              "ls_cross_entropy_bwd: bad output tensor");
  if (N == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(logits.device());
  int64_t gl_stride, gn_stride;
  const float* gl = grad_ptr(grad_loss, N, &gl_stride, logits, "grad_loss");
  const float* gn = grad_ptr(grad_nll, N, &gn_stride, logits, "grad_nll");
  const double eps_i = epsilon / static_cast<double>(V - 1);
  const float smooth_coef = static_cast<float>(eps_i);
  const float nll_coef = static_cast<float>(1.0 - epsilon - eps_i);
  const bool vectorize = ((reinterpret_cast<uintptr_t>(logits.data_ptr()) ^
                           reinterpret_cast<uintptr_t>(out.data_ptr())) & 15) == 0;
  auto stream = c10::cuda::getCurrentCUDAStream();
  LSF_DISPATCH_FLOAT_TYPES(logits.scalar_type(), "ls_cross_entropy_bwd", [&] {
    const int threads = threads_for(V, sizeof(T));
    ce_bwd_kernel<T><<<static_cast<unsigned>(N), threads, 0, stream>>>(
        gl, gl_stride, gn, gn_stride, reinterpret_cast<const T*>(logits.data_ptr()),
        target.data_ptr<int64_t>(), lse.data_ptr<float>(), V, smooth_coef, nll_coef,
        ignore_index, reinterpret_cast<T*>(out.data_ptr()), vectorize);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor ce_bwd(const c10::optional<at::Tensor>& grad_loss,
                  const c10::optional<at::Tensor>& grad_nll, const at::Tensor& logits,
                  const at::Tensor& target, const at::Tensor& lse, double epsilon,
                  int64_t ignore_index) {
  at::Tensor out = at::empty_like(logits, at::MemoryFormat::Contiguous);
  ce_bwd_launch(grad_loss, grad_nll, logits, target, lse, epsilon, ignore_index, out);
  return out;
}

void ce_bwd_inplace(const c10::optional<at::Tensor>& grad_loss,
                    const c10::optional<at::Tensor>& grad_nll, const at::Tensor& logits,
                    const at::Tensor& target, const at::Tensor& lse, double epsilon,
                    int64_t ignore_index) {
  at::Tensor out = logits;  // same storage: each element is read, then written, by one thread
  ce_bwd_launch(grad_loss, grad_nll, logits, target, lse, epsilon, ignore_index, out);
}

}  // namespace ls_fairseq_ce

TORCH_LIBRARY_FRAGMENT(ls_fairseq, m) {
  m.def(
      "ls_cross_entropy_fwd(Tensor logits, Tensor target, float epsilon, int ignore_index, "
      "bool compute_argmax) -> (Tensor loss_rows, Tensor nll_rows, Tensor lse, Tensor argmax)");
  m.def(
      "ls_cross_entropy_bwd(Tensor? grad_loss, Tensor? grad_nll, Tensor logits, Tensor target, "
      "Tensor lse, float epsilon, int ignore_index) -> Tensor");
  m.def(
      "ls_cross_entropy_bwd_(Tensor? grad_loss, Tensor? grad_nll, Tensor(a!) logits, "
      "Tensor target, Tensor lse, float epsilon, int ignore_index) -> ()");
}

TORCH_LIBRARY_IMPL(ls_fairseq, CUDA, m) {
  m.impl("ls_cross_entropy_fwd", &ls_fairseq_ce::ce_fwd);
  m.impl("ls_cross_entropy_bwd", &ls_fairseq_ce::ce_bwd);
  m.impl("ls_cross_entropy_bwd_", &ls_fairseq_ce::ce_bwd_inplace);
}
