// One Adam step (fairseq `adam` semantics) over any number of tensors in ONE kernel launch.
//
// Spec: ls_fairseq/ops/adam.py (adam_step_reference). Per element, fp32 math whatever the
// storage dtype:
//   g = g * grad_scale [* *grad_scale_t]       (the fp16 wrappers' loss-scale / clip factor)
//   m = b1 m + (1 - b1) g      v = b2 v + (1 - b2) g^2
//   p = p - wd * lr * p        p = p - step_size * m / (sqrt(v) + eps)
//   model_copy = (half/bf16) p                 (optional: fp32 master -> fp16 model, same launch)
//
// Work layout: each tensor ("segment") is cut into chunks of kChunk elements; block b handles
// chunk b of the concatenation (binary search over the per-segment chunk prefix sums), with
// 16-byte vector accesses where every pointer of the segment is suitably aligned and element-by-
// element code otherwise and for the tails. All offsets are int64: no tensor size limit, no
// element skipped, no access past a segment's end.
//
// Storage variants (templates): params P in {fp32, fp16, bf16}; grads G in {fp32, fp16, bf16};
// moments M in {fp32, fp16}; copy-out in {none, fp16, bf16} (runtime). fp16 moments may carry a
// per-tensor scale (fairseq's --fp16-adam-stats: stored = true / scale); the new scales need the
// new moments' max, so that variant runs a statistics pass first (multi_tensor_adam_moment_max),
// then the update.
//
// Non-finite gradients: an element whose scaled gradient is inf/NaN is left untouched (p, m, v and
// the copy keep their old values; scaled fp16 moments keep their true values, re-stored under the
// new scale) and `found_inf` is set to 1. fairseq's fp16 wrappers and its trainer never call the
// optimizer with such gradients (they skip the step / raise first); the flag makes a direct
// caller's problem visible instead of silently writing NaN into the state. A non-finite
// grad_scale_t skips the whole step (--ls-deferred-overflow-check's overflow signal).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <vector>

#include "check.h"
#include "device_utils.cuh"

namespace ls_fairseq_adam {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 16384;  // elements per block: a multiple of every vector width
// Elements per vector access: 4 (16-byte fp32, 8-byte fp16 accesses) where every pointer of a
// segment allows it, else element by element.
constexpr int kCols = 9;           // int64 columns of the segment table

enum Col { kP = 0, kG, kM, kV, kOut, kNumel, kMScale, kVScale, kChunkBegin };
enum OutKind { kOutNone = 0, kOutHalf = 1, kOutBF16 = 2 };

using lsf::from_float;
using lsf::to_float;
using lsf::Pack;

struct Hyper {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay, step_size, grad_scale;
};

struct SegmentView {
  void* p;
  const void* g;
  void* m;
  void* v;
  void* out;
  int64_t numel;
  const float* m_scale_old;  // per-tensor scales of fp16 moments (nullptr: unscaled)
  const float* v_scale_old;
  const float* m_scale_new;
  const float* v_scale_new;
};

// Segment of chunk c: the last s with chunk_begin[s] <= c. Table rows are int64[kCols].
__device__ __forceinline__ int find_segment(const int64_t* table, int nseg, int64_t c) {
  int lo = 0, hi = nseg - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (table[mid * kCols + kChunkBegin] <= c) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Adam on one element held in registers; returns false (nothing to write) for a non-finite grad.
__device__ __forceinline__ bool adam_update(float g, float& p, float& m, float& v, const Hyper& h) {
  if (!isfinite(g)) return false;
  m = h.beta1 * m + h.one_minus_beta1 * g;
  v = h.beta2 * v + h.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) + h.eps;
  p = p + h.decay * p;           // decay = -weight_decay * lr (0 when no decay)
  p = p - h.step_size * (m / denom);
  return true;
}

__device__ __forceinline__ void store_out(void* out, int kind, int64_t i, float p) {
  if (kind == kOutHalf) static_cast<__half*>(out)[i] = __float2half_rn(p);
  else if (kind == kOutBF16) static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(p);
}

template <typename P, typename G, typename M, bool kStatsPass>
__device__ __forceinline__ void process_scalar(const SegmentView& s, int64_t i, const Hyper& h,
                                               float gscale, float ms_old, float vs_old,
                                               float ms_new, float vs_new, int out_kind,
                                               float& mmax, float& vmax, bool& bad) {
  float g = to_float(static_cast<const G*>(s.g)[i]) * gscale;
  float p = to_float(static_cast<P*>(s.p)[i]);
  float m = to_float(static_cast<M*>(s.m)[i]) * ms_old;
  float v = to_float(static_cast<M*>(s.v)[i]) * vs_old;
  // A skipped element keeps its moments' true values: with scaled fp16 moments they still count
  // towards the new scale and are re-stored under it (a no-op when the scales are 1).
  const bool ok = adam_update(g, p, m, v, h);
  if (!ok) bad = true;
  if (kStatsPass) {
    mmax = fmaxf(mmax, fabsf(m));
    vmax = fmaxf(vmax, v);
    return;
  }
  if (ok) {
    static_cast<P*>(s.p)[i] = from_float<P>(p);
    store_out(s.out, out_kind, i, p);
  }
  static_cast<M*>(s.m)[i] = from_float<M>(m / ms_new);
  static_cast<M*>(s.v)[i] = from_float<M>(v / vs_new);
}

// Elements [begin, begin + N * floor((end - begin) / N)) of one segment, N per thread and
// iteration; returns where the element-by-element tail starts.
template <int N, typename P, typename G, typename M, bool kStatsPass>
__device__ __forceinline__ int64_t process_vec(const SegmentView& s, int64_t begin, int64_t end,
                                               const Hyper& h, float gscale, float ms_old,
                                               float vs_old, float ms_new, float vs_new,
                                               int okind, float& mmax, float& vmax, bool& bad) {
  const int64_t nvec = (end - begin) / N;
  for (int64_t k = threadIdx.x; k < nvec; k += kThreads) {
    const int64_t i = begin + k * N;
    const Pack<G, N> gv = *reinterpret_cast<const Pack<G, N>*>(static_cast<const G*>(s.g) + i);
    Pack<P, N> pv = *reinterpret_cast<const Pack<P, N>*>(static_cast<P*>(s.p) + i);
    Pack<M, N> mv = *reinterpret_cast<const Pack<M, N>*>(static_cast<M*>(s.m) + i);
    Pack<M, N> vv = *reinterpret_cast<const Pack<M, N>*>(static_cast<M*>(s.v) + i);
    float pf[N];
    bool ok_all = true;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      float g = to_float(gv.v[e]) * gscale;
      float p = to_float(pv.v[e]);
      float m = to_float(mv.v[e]) * ms_old;
      float v = to_float(vv.v[e]) * vs_old;
      const bool ok = adam_update(g, p, m, v, h);
      ok_all = ok_all && ok;
      if (kStatsPass) {
        mmax = fmaxf(mmax, fabsf(m));  // skipped elements too (see process_scalar)
        vmax = fmaxf(vmax, v);
      } else {
        if (ok) pv.v[e] = from_float<P>(p);
        mv.v[e] = from_float<M>(m / ms_new);
        vv.v[e] = from_float<M>(v / vs_new);
      }
      pf[e] = ok ? p : to_float(pv.v[e]);
    }
    if (!ok_all) bad = true;
    if (!kStatsPass) {
      *reinterpret_cast<Pack<P, N>*>(static_cast<P*>(s.p) + i) = pv;
      *reinterpret_cast<Pack<M, N>*>(static_cast<M*>(s.m) + i) = mv;
      *reinterpret_cast<Pack<M, N>*>(static_cast<M*>(s.v) + i) = vv;
      if (okind == kOutHalf) {
        Pack<__half, N> o;
#pragma unroll
        for (int e = 0; e < N; ++e) o.v[e] = __float2half_rn(pf[e]);
        *reinterpret_cast<Pack<__half, N>*>(static_cast<__half*>(s.out) + i) = o;
      } else if (okind == kOutBF16) {
        Pack<__nv_bfloat16, N> o;
#pragma unroll
        for (int e = 0; e < N; ++e) o.v[e] = __float2bfloat16_rn(pf[e]);
        *reinterpret_cast<Pack<__nv_bfloat16, N>*>(static_cast<__nv_bfloat16*>(s.out) + i) = o;
      }
    }
  }
  return begin + nvec * N;
}

template <typename P, typename G, typename M, bool kStatsPass>
__global__ void __launch_bounds__(kThreads)
multi_tensor_adam_kernel(const int64_t* __restrict__ table, int nseg, Hyper h,
                         const float* __restrict__ grad_scale_t, int out_kind,
                         int* __restrict__ found_inf, float* __restrict__ moment_max) {
  __shared__ int seg_shared;
  __shared__ float red[2][kThreads / 32];
  const int64_t chunk = blockIdx.x;
  if (threadIdx.x == 0) seg_shared = find_segment(table, nseg, chunk);
  __syncthreads();
  const int seg = seg_shared;
  const int64_t* row = table + static_cast<int64_t>(seg) * kCols;
  SegmentView s;
  s.p = reinterpret_cast<void*>(row[kP]);
  s.g = reinterpret_cast<const void*>(row[kG]);
  s.m = reinterpret_cast<void*>(row[kM]);
  s.v = reinterpret_cast<void*>(row[kV]);
  s.out = reinterpret_cast<void*>(row[kOut]);
  s.numel = row[kNumel];
  const float* mscale = reinterpret_cast<const float*>(row[kMScale]);  // [old, new] pairs
  const float* vscale = reinterpret_cast<const float*>(row[kVScale]);
  const float ms_old = mscale ? mscale[0] : 1.f, vs_old = vscale ? vscale[0] : 1.f;
  const float ms_new = mscale && !kStatsPass ? mscale[1] : 1.f;
  const float vs_new = vscale && !kStatsPass ? vscale[1] : 1.f;
  const int okind = s.out ? out_kind : kOutNone;
  const float gscale = h.grad_scale * (grad_scale_t ? *grad_scale_t : 1.f);
  if (!isfinite(gscale) && !mscale && !vscale) {
    // Every scaled grad is inf/NaN (a skipped update: --ls-deferred-overflow-check sets a NaN
    // scale on overflow), so nothing would be written: skip the reads too.
    if (threadIdx.x == 0) *found_inf = 1;
    return;
  }

  const int64_t begin = (chunk - row[kChunkBegin]) * kChunk;
  const int64_t end = min(begin + kChunk, s.numel);
  float mmax = 0.f, vmax = 0.f;
  bool bad = false;

  // Vector path when every pointer is aligned to its vector width (the chunk start is a
  // multiple of it, so alignment at element 0 carries over).
  auto aligned_to = [&](int n) {
    return (reinterpret_cast<uintptr_t>(s.p) % (sizeof(P) * n) == 0) &&
           (reinterpret_cast<uintptr_t>(s.g) % (sizeof(G) * n) == 0) &&
           (reinterpret_cast<uintptr_t>(s.m) % (sizeof(M) * n) == 0) &&
           (reinterpret_cast<uintptr_t>(s.v) % (sizeof(M) * n) == 0) &&
           (okind == kOutNone || reinterpret_cast<uintptr_t>(s.out) % (2 * n) == 0);
  };
  // (8-wide accesses were measured slower on H100: more registers, fewer resident blocks.)
  int64_t scalar_begin = begin;
  if (aligned_to(4)) {
    scalar_begin = process_vec<4, P, G, M, kStatsPass>(s, begin, end, h, gscale, ms_old, vs_old,
                                                       ms_new, vs_new, okind, mmax, vmax, bad);
  }
  for (int64_t i = scalar_begin + threadIdx.x; i < end; i += kThreads) {
    process_scalar<P, G, M, kStatsPass>(s, i, h, gscale, ms_old, vs_old, ms_new, vs_new,
                                        okind, mmax, vmax, bad);
  }
  if (bad) *found_inf = 1;  // benign race: every writer stores 1
  if (kStatsPass) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      mmax = fmaxf(mmax, __shfl_xor_sync(0xffffffffu, mmax, off));
      vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, off));
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { red[0][warp] = mmax; red[1][warp] = vmax; }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kThreads / 32; ++w) {
        mmax = fmaxf(mmax, red[0][w]);
        vmax = fmaxf(vmax, red[1][w]);
      }
      // Non-negative floats order like their int bit patterns.
      // moment_max is [nseg, 2]: (max |m|, max v) of each tensor after this step.
      atomicMax(reinterpret_cast<int*>(moment_max + 2 * seg), __float_as_int(mmax));
      atomicMax(reinterpret_cast<int*>(moment_max + 2 * seg + 1), __float_as_int(vmax));
    }
  }
}

#define LS_ADAM_P_G_M(P_, G_, M_)                                                    \
  if (pt == at::k##P_ && gt == at::k##G_ && mt == at::k##M_) {                       \
    using PT = typename CudaType<at::k##P_>::type;                                   \
    using GT = typename CudaType<at::k##G_>::type;                                   \
    using MT = typename CudaType<at::k##M_>::type;                                   \
    if (stats_pass)                                                                  \
      multi_tensor_adam_kernel<PT, GT, MT, true><<<grid, kThreads, 0, stream>>>(     \
          table_ptr, nseg, h, gs_ptr, out_kind, found_ptr, max_ptr);                 \
    else                                                                             \
      multi_tensor_adam_kernel<PT, GT, MT, false><<<grid, kThreads, 0, stream>>>(    \
          table_ptr, nseg, h, gs_ptr, out_kind, found_ptr, max_ptr);                 \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                  \
    return;                                                                          \
  }

template <at::ScalarType S> struct CudaType;
template <> struct CudaType<at::kFloat> { using type = float; };
template <> struct CudaType<at::kHalf> { using type = __half; };
template <> struct CudaType<at::kBFloat16> { using type = __nv_bfloat16; };

void launch(int64_t grid_chunks, const int64_t* table_ptr, int nseg, const Hyper& h,
            const float* gs_ptr, int out_kind, int* found_ptr, float* max_ptr,
            at::ScalarType pt, at::ScalarType gt, at::ScalarType mt, bool stats_pass,
            cudaStream_t stream) {
  LSF_CHECK(grid_chunks <= static_cast<int64_t>(INT32_MAX),
              "multi_tensor_adam: too many chunks for one launch");
  const dim3 grid(static_cast<unsigned>(grid_chunks));
  LS_ADAM_P_G_M(Float, Float, Float)
  LS_ADAM_P_G_M(Float, Float, Half)
  LS_ADAM_P_G_M(Float, Half, Float)
  LS_ADAM_P_G_M(Float, Half, Half)
  LS_ADAM_P_G_M(Float, BFloat16, Float)
  LS_ADAM_P_G_M(Float, BFloat16, Half)
  LS_ADAM_P_G_M(Half, Half, Float)
  LS_ADAM_P_G_M(Half, Half, Half)
  LS_ADAM_P_G_M(BFloat16, BFloat16, Float)
  LS_ADAM_P_G_M(BFloat16, BFloat16, Half)
  LS_ADAM_P_G_M(Half, Float, Float)
  LS_ADAM_P_G_M(BFloat16, Float, Float)
  LSF_CHECK(false, "multi_tensor_adam: unsupported dtype combination params=", pt,
              " grads=", gt, " moments=", mt,
              " (supported: fp32 params with fp32/fp16/bf16 grads; fp16/bf16 params with grads "
              "of the same dtype or fp32; moments fp32 or fp16)");
}

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Builds the segment table on the host (pinned), copies it to the device and launches.
void run(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
         at::TensorList exp_avg_sqs, at::TensorList model_copies,
         const c10::optional<at::Tensor>& grad_scale_t, const c10::optional<at::Tensor>& m_scales,
         const c10::optional<at::Tensor>& v_scales, const at::Tensor& found_inf,
         const c10::optional<at::Tensor>& moment_max, double lr, double beta1, double beta2,
         double eps, double weight_decay, double step_size, double grad_scale, bool stats_pass) {
  const size_t n = params.size();
  LSF_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "multi_tensor_adam: params, grads, exp_avgs, exp_avg_sqs must have equal lengths (",
              n, ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), ")");
  LSF_CHECK(model_copies.empty() || model_copies.size() == n,
              "multi_tensor_adam: model_copies must be empty or one per param");
  LSF_CHECK(found_inf.is_cuda() && found_inf.scalar_type() == at::kInt && found_inf.numel() >= 1,
              "multi_tensor_adam: found_inf must be a CUDA int32 tensor");
  if (n == 0) return;
  const at::Device device = params[0].device();
  LSF_CHECK(device.is_cuda(), "multi_tensor_adam: params must be CUDA tensors");
  LSF_CHECK(found_inf.device() == device, "multi_tensor_adam: found_inf on the wrong device");
  const at::ScalarType pt = params[0].scalar_type(), gt = grads[0].scalar_type(),
                       mt = exp_avgs[0].scalar_type();
  const at::ScalarType ot = model_copies.empty() ? at::kFloat : model_copies[0].scalar_type();
  LSF_CHECK(is_float_type(pt) && is_float_type(gt) && (mt == at::kFloat || mt == at::kHalf),
              "multi_tensor_adam: unsupported dtypes");
  LSF_CHECK(model_copies.empty() || ot == at::kHalf || ot == at::kBFloat16,
              "multi_tensor_adam: model_copies must be float16 or bfloat16");
  const bool scaled = m_scales.has_value() && m_scales->defined();
  LSF_CHECK(scaled == (v_scales.has_value() && v_scales->defined()),
              "multi_tensor_adam: pass both m_scales and v_scales or neither");
  if (scaled) {
    for (const auto* sc : {&*m_scales, &*v_scales}) {
      LSF_CHECK(sc->device() == device && sc->scalar_type() == at::kFloat && sc->is_contiguous() &&
                      sc->dim() == 2 && sc->size(0) == static_cast<int64_t>(n) && sc->size(1) == 2,
                  "multi_tensor_adam: moment scales must be contiguous float32 [n, 2] (old, new) "
                  "on the params' device");
    }
  }
  const float* gs_ptr = nullptr;
  if (grad_scale_t.has_value() && grad_scale_t->defined()) {
    LSF_CHECK(grad_scale_t->device() == device && grad_scale_t->scalar_type() == at::kFloat &&
                    grad_scale_t->numel() == 1,
                "multi_tensor_adam: grad_scale_t must be a one-element float32 tensor on the "
                "params' device");
    gs_ptr = grad_scale_t->data_ptr<float>();
  }
  float* max_ptr = nullptr;
  if (stats_pass) {
    LSF_CHECK(moment_max.has_value() && moment_max->defined() && moment_max->device() == device &&
                    moment_max->scalar_type() == at::kFloat && moment_max->is_contiguous() &&
                    moment_max->numel() == 2 * static_cast<int64_t>(n),
                "multi_tensor_adam_moment_max: moment_max must be contiguous float32 [n, 2]");
    max_ptr = moment_max->data_ptr<float>();
  }

  at::Tensor host = at::empty({static_cast<int64_t>(n), kCols},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* t = host.data_ptr<int64_t>();
  int64_t chunks = 0;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    const at::Tensor& m = exp_avgs[i];
    const at::Tensor& v = exp_avg_sqs[i];
    const int64_t numel = p.numel();
    LSF_CHECK(p.device() == device && g.device() == device && m.device() == device &&
                    v.device() == device,
                "multi_tensor_adam: tensor ", i, " is not on ", device);
    LSF_CHECK(g.numel() == numel && m.numel() == numel && v.numel() == numel,
                "multi_tensor_adam: tensor ", i, " sizes differ (param ", numel, ", grad ",
                g.numel(), ", exp_avg ", m.numel(), ", exp_avg_sq ", v.numel(), ")");
    LSF_CHECK(p.is_contiguous() && g.is_contiguous() && m.is_contiguous() && v.is_contiguous(),
                "multi_tensor_adam: tensor ", i, " is not contiguous");
    LSF_CHECK(p.scalar_type() == pt && g.scalar_type() == gt && m.scalar_type() == mt &&
                    v.scalar_type() == mt,
                "multi_tensor_adam: tensor ", i, " has dtypes differing from tensor 0 (call once "
                "per dtype combination)");
    void* out = nullptr;
    if (!model_copies.empty()) {
      const at::Tensor& o = model_copies[i];
      LSF_CHECK(o.device() == device && o.numel() == numel && o.is_contiguous() &&
                      o.scalar_type() == ot,
                  "multi_tensor_adam: model copy ", i, " must be a contiguous ", ot,
                  " tensor of ", numel, " elements on ", device);
      out = o.data_ptr();
    }
    t[i * kCols + kP] = reinterpret_cast<int64_t>(p.data_ptr());
    t[i * kCols + kG] = reinterpret_cast<int64_t>(g.data_ptr());
    t[i * kCols + kM] = reinterpret_cast<int64_t>(m.data_ptr());
    t[i * kCols + kV] = reinterpret_cast<int64_t>(v.data_ptr());
    t[i * kCols + kOut] = reinterpret_cast<int64_t>(out);
    t[i * kCols + kNumel] = numel;
    t[i * kCols + kMScale] =
        scaled ? reinterpret_cast<int64_t>(m_scales->data_ptr<float>() + 2 * i) : 0;
    t[i * kCols + kVScale] =
        scaled ? reinterpret_cast<int64_t>(v_scales->data_ptr<float>() + 2 * i) : 0;
    t[i * kCols + kChunkBegin] = chunks;
    chunks += (numel + kChunk - 1) / kChunk;
  }
  if (chunks == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  // Pinned source + non_blocking: the host allocator keeps `host` alive until the copy is done.
  at::Tensor table = host.to(device, /*non_blocking=*/true);
  const int out_kind = model_copies.empty() ? kOutNone : (ot == at::kHalf ? kOutHalf : kOutBF16);
  Hyper h;
  h.beta1 = static_cast<float>(beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.decay = static_cast<float>(-weight_decay * lr);
  h.step_size = static_cast<float>(step_size);
  h.grad_scale = static_cast<float>(grad_scale);
  launch(chunks, table.data_ptr<int64_t>(), static_cast<int>(n), h, gs_ptr, out_kind,
         found_inf.data_ptr<int>(), max_ptr, pt, gt, mt, stats_pass,
         c10::cuda::getCurrentCUDAStream());
}

void multi_tensor_adam(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                       at::TensorList exp_avg_sqs, at::TensorList model_copies,
                       const c10::optional<at::Tensor>& grad_scale_t,
                       const c10::optional<at::Tensor>& m_scales,
                       const c10::optional<at::Tensor>& v_scales, const at::Tensor& found_inf,
                       double lr, double beta1, double beta2, double eps, double weight_decay,
                       double step_size, double grad_scale) {
  run(params, grads, exp_avgs, exp_avg_sqs, model_copies, grad_scale_t, m_scales, v_scales,
      found_inf, c10::nullopt, lr, beta1, beta2, eps, weight_decay, step_size, grad_scale, false);
}

void multi_tensor_adam_moment_max(at::TensorList params, at::TensorList grads,
                                  at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                  const c10::optional<at::Tensor>& grad_scale_t,
                                  const at::Tensor& m_scales, const at::Tensor& v_scales,
                                  const at::Tensor& found_inf, const at::Tensor& moment_max,
                                  double beta1, double beta2, double grad_scale) {
  run(params, grads, exp_avgs, exp_avg_sqs, {}, grad_scale_t, m_scales, v_scales, found_inf,
      moment_max, 0.0, beta1, beta2, 1.0, 0.0, 0.0, grad_scale, true);
}

}  // namespace ls_fairseq_adam

TORCH_LIBRARY_FRAGMENT(ls_fairseq, m) {
  m.def(
      "multi_tensor_adam(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] model_copies, Tensor? grad_scale_t, "
      "Tensor? m_scales, Tensor? v_scales, Tensor(e!) found_inf, float lr, float beta1, "
      "float beta2, float eps, float weight_decay, float step_size, float grad_scale) -> ()");
  m.def(
      "multi_tensor_adam_moment_max(Tensor[] params, Tensor[] grads, Tensor[] exp_avgs, "
      "Tensor[] exp_avg_sqs, Tensor? grad_scale_t, Tensor m_scales, Tensor v_scales, "
      "Tensor(a!) found_inf, Tensor(b!) moment_max, float beta1, float beta2, "
      "float grad_scale) -> ()");
}

TORCH_LIBRARY_IMPL(ls_fairseq, CUDA, m) {
  m.impl("multi_tensor_adam", &ls_fairseq_adam::multi_tensor_adam);
  m.impl("multi_tensor_adam_moment_max", &ls_fairseq_adam::multi_tensor_adam_moment_max);
}
