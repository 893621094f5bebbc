// LayerNorm over the last dimension: y = (x - mean) * rstd * w + b.
//
// Storage float32/float16/bfloat16, math in float32, eps from the caller (fairseq: 1e-5).
//
// Statistics are one pass over the row with shifted sums: with K = x[row, 0],
//   mean = K + sum(x - K) / C,  var = sum((x - K)^2) / C - (sum(x - K) / C)^2,
// which keeps the mean-of-squares rewrite (both sums in one sweep and one reduction) but removes
// its cancellation when |mean| >> std: K is a sample of the row, so x - K is of the order of std.
//
// Backward: with xhat = (x - mean) * rstd and d = grad * w,
//   dx = rstd * (d - mean(d) - xhat * mean(d * xhat)),  dw = sum_rows grad * xhat,  db = sum_rows grad.
// With a residual gradient r (pre-LN blocks: x feeds both this LayerNorm and the residual branch),
// backward returns dx + r in the same pass, so autograd's separate add of the two is not needed.
// The fused pre-LN sublayer boundary (bias + dropout + residual, then this LayerNorm) is
// csrc/bias_dropout_residual_layer_norm.cu; the row code both use is csrc/layer_norm_rows.cuh.
// Invertible mode (as DeepSpeed's normalize_invertible) rebuilds xhat = (y - b) / w from the
// output, so the caller may keep y instead of x; it needs a weight with no zero entries and its
// xhat carries the rounding of y (fp16: ~1e-3 relative).
//
// Kernels: rows of up to 256 vectors (one 16-byte vector per element group when C allows, else
// scalars) are held in registers by one warp per row; longer rows use one block per row with a
// second read of the row (from L1/L2).  dw/db are per-lane column sums in registers, reduced
// across the block in shared memory to per-block partials, then summed in a fixed order
// (deterministic, no atomics).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "check.h"
#include "device_utils.cuh"
#include "launch_utils.h"
#include "layer_norm_rows.cuh"
#include "philox_dropout.cuh"

namespace {

using namespace lsf;  // helpers from launch_utils.h, device_utils.cuh and layer_norm_rows.cuh

// Sum a and b over the block (every thread gets the totals); fixed order, reusable in a loop.
__device__ __forceinline__ void block_allreduce2(float& a, float& b) {
  __shared__ float sa[kBlockThreads / kWarp], sb[kBlockThreads / kWarp];
  warp_allreduce2(a, b);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  a = 0.f;
  b = 0.f;
#pragma unroll
  for (int i = 0; i < kBlockThreads / kWarp; ++i) {
    a += sa[i];
    b += sb[i];
  }
  __syncthreads();
}

// ---------------------------------------------------------------- forward
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(kWarp* kWarpsPerBlock)
    ln_fwd_warp_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                       T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                       int64_t rows, int C, float eps) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (row >= rows) return;
  const int nvec = C / VEC;
  const T* xr = x + row * C;
  float v[NV][VEC];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int j = lane + k * kWarp;
    if (j < nvec) load_vec<T, VEC>(xr + j * VEC, v[k]);
  }
  ln_warp_row<T, VEC, NV>(v, to_float(xr[0]), lane, nvec, C, w, b, y + row * C, mean_out, rstd_out,
                          row, eps);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kBlockThreads)
    ln_fwd_block_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                        T* __restrict__ y, float* __restrict__ mean_out,
                        float* __restrict__ rstd_out, int64_t rows, int C, float eps) {
  const int nvec = C / VEC;
  const float inv_c = 1.f / static_cast<float>(C);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * C;
    const float shift = to_float(xr[0]);
    float s1 = 0.f, s2 = 0.f;
    for (int j = threadIdx.x; j < nvec; j += kBlockThreads) {
      float v[VEC];
      load_vec<T, VEC>(xr + static_cast<int64_t>(j) * VEC, v);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float d = v[i] - shift;
        s1 += d;
        s2 += d * d;
      }
    }
    block_allreduce2(s1, s2);
    const float mean_shifted = s1 * inv_c;
    const float var = fmaxf(s2 * inv_c - mean_shifted * mean_shifted, 0.f);
    const float rstd = rsqrtf(var + eps);
    if (threadIdx.x == 0) {
      mean_out[row] = shift + mean_shifted;
      rstd_out[row] = rstd;
    }
    T* yr = y + row * C;
    for (int j = threadIdx.x; j < nvec; j += kBlockThreads) {
      float v[VEC], wv[VEC], bv[VEC];
      load_vec<T, VEC>(xr + static_cast<int64_t>(j) * VEC, v);
      load_wb<T, VEC>(w, b, static_cast<int64_t>(j) * VEC, wv, bv);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = ((v[i] - shift) - mean_shifted) * rstd * wv[i] + bv[i];
      store_vec<T, VEC>(yr + static_cast<int64_t>(j) * VEC, v);
    }
  }
}

// ---------------------------------------------------------------- backward
template <typename T, int VEC>
__global__ void __launch_bounds__(kBlockThreads)
    ln_bwd_block_kernel(const T* __restrict__ grad, const T* __restrict__ saved,
                        const T* __restrict__ w, const T* __restrict__ b,
                        const float* __restrict__ mean, const float* __restrict__ rstd,
                        const T* __restrict__ res, T* __restrict__ dx, int64_t rows, int C,
                        bool invertible) {
  const int nvec = C / VEC;
  const float inv_c = 1.f / static_cast<float>(C);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float rs = rstd[row];
    const float mu = invertible ? 0.f : mean[row];
    float s1 = 0.f, s2 = 0.f;
    for (int j = threadIdx.x; j < nvec; j += kBlockThreads) {
      const int64_t off = static_cast<int64_t>(j) * VEC;
      float g[VEC], sv[VEC], wv[VEC], bv[VEC];
      load_vec<T, VEC>(grad + row * C + off, g);
      load_vec<T, VEC>(saved + row * C + off, sv);
      load_wb<T, VEC>(w, b, off, wv, bv);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float dd = g[i] * wv[i];
        s1 += dd;
        s2 += dd * make_xhat(sv[i], wv[i], bv[i], mu, rs, invertible);
      }
    }
    block_allreduce2(s1, s2);
    s1 *= inv_c;
    s2 *= inv_c;
    for (int j = threadIdx.x; j < nvec; j += kBlockThreads) {
      const int64_t off = static_cast<int64_t>(j) * VEC;
      float g[VEC], sv[VEC], wv[VEC], bv[VEC], r[VEC];
      load_vec<T, VEC>(grad + row * C + off, g);
      load_vec<T, VEC>(saved + row * C + off, sv);
      load_wb<T, VEC>(w, b, off, wv, bv);
      if (res != nullptr) {
        load_vec<T, VEC>(res + row * C + off, r);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) r[i] = 0.f;
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        g[i] = rs * (g[i] * wv[i] - s1 - make_xhat(sv[i], wv[i], bv[i], mu, rs, invertible) * s2) +
               r[i];
      store_vec<T, VEC>(dx + row * C + off, g);
    }
  }
}

// dw/db partials for the block path: grid (ceil(C/32), chunks), block (32, 8).
template <typename T>
__global__ void __launch_bounds__(256)
    ln_dwdb_kernel(const T* __restrict__ grad, const T* __restrict__ saved,
                   const T* __restrict__ w, const T* __restrict__ b,
                   const float* __restrict__ mean, const float* __restrict__ rstd,
                   float* __restrict__ part_w, float* __restrict__ part_b, int64_t rows, int C,
                   bool invertible) {
  __shared__ float sw[8][kWarp + 1], sb[8][kWarp + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kWarp + threadIdx.x;
  float aw = 0.f, ab = 0.f;
  if (c < C) {
    const float wc = w != nullptr ? to_float(w[c]) : 1.f;
    const float bc = b != nullptr ? to_float(b[c]) : 0.f;
    for (int64_t row = static_cast<int64_t>(blockIdx.y) * 8 + threadIdx.y; row < rows;
         row += static_cast<int64_t>(gridDim.y) * 8) {
      const float g = to_float(grad[row * C + c]);
      const float xhat = make_xhat(to_float(saved[row * C + c]), wc, bc,
                                   invertible ? 0.f : mean[row], rstd[row], invertible);
      aw += g * xhat;
      ab += g;
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float tw = 0.f, tb = 0.f;
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      tw += sw[q][threadIdx.x];
      tb += sb[q][threadIdx.x];
    }
    part_w[static_cast<int64_t>(blockIdx.y) * C + c] = tw;
    part_b[static_cast<int64_t>(blockIdx.y) * C + c] = tb;
  }
}

// ---------------------------------------------------------------- host side
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const at::Tensor& x_in,
                                                               const std::optional<at::Tensor>& w_in,
                                                               const std::optional<at::Tensor>& b_in,
                                                               double eps, bool invertible) {
  const char* name = "ls_fairseq layer_norm_fwd";
  LSF_CHECK(x_in.is_cuda(), name, ": expected a CUDA tensor");
  LSF_CHECK(x_in.dim() >= 1 && x_in.size(-1) > 0, name,
              ": expected x of shape [..., C] with C > 0, got ", x_in.sizes());
  const int64_t C64 = x_in.size(-1);
  LSF_CHECK(C64 <= (1 << 30), name, ": hidden size ", C64, " too large");
  const int C = static_cast<int>(C64);
  check_affine(w_in, x_in, C, "weight", name);
  check_affine(b_in, x_in, C, "bias", name);
  LSF_CHECK(eps >= 0.0, name, ": eps must be >= 0");
  c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous();
  const int64_t rows = x.numel() / C;
  std::optional<at::Tensor> w, b;
  if (w_in.has_value()) w = w_in->contiguous();
  if (b_in.has_value()) b = b_in->contiguous();
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto mean = at::empty({rows}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows == 0) return {y, mean, rstd};
  auto stream = c10::cuda::getCurrentCUDAStream();
  LSF_DISPATCH_FLOAT_TYPES(x.scalar_type(), name, [&] {
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    const T* wp = w ? reinterpret_cast<const T*>(w->data_ptr()) : nullptr;
    const T* bp = b ? reinterpret_cast<const T*>(b->data_ptr()) : nullptr;
    T* yp = reinterpret_cast<T*>(y.data_ptr());
    float* mp = mean.data_ptr<float>();
    float* rp = rstd.data_ptr<float>();
    const float feps = static_cast<float>(eps);
    auto run = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const int nv = vectors_per_lane(C / VEC);
      const unsigned warp_grid = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
      const dim3 wblock(kWarp * kWarpsPerBlock);
      switch (nv) {
        case 1: ln_fwd_warp_kernel<T, VEC, 1><<<warp_grid, wblock, 0, stream>>>(xp, wp, bp, yp, mp, rp, rows, C, feps); break;
        case 2: ln_fwd_warp_kernel<T, VEC, 2><<<warp_grid, wblock, 0, stream>>>(xp, wp, bp, yp, mp, rp, rows, C, feps); break;
        case 4: ln_fwd_warp_kernel<T, VEC, 4><<<warp_grid, wblock, 0, stream>>>(xp, wp, bp, yp, mp, rp, rows, C, feps); break;
        case 8: ln_fwd_warp_kernel<T, VEC, 8><<<warp_grid, wblock, 0, stream>>>(xp, wp, bp, yp, mp, rp, rows, C, feps); break;
        default: {
          const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, 1 << 20));
          ln_fwd_block_kernel<T, VEC><<<grid, kBlockThreads, 0, stream>>>(xp, wp, bp, yp, mp, rp, rows, C, feps);
        }
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    constexpr int V = 16 / sizeof(T);
    if (use_vec<T>(C, {xp, wp, bp, yp})) {
      run(std::integral_constant<int, V>{});
    } else {
      run(std::integral_constant<int, 1>{});
    }
  });
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(
    const at::Tensor& grad_in, const at::Tensor& saved_in, const std::optional<at::Tensor>& w_in,
    const std::optional<at::Tensor>& b_in, const std::optional<at::Tensor>& mean_in,
    const at::Tensor& rstd_in, bool invertible, bool weight_grad, bool bias_grad,
    const std::optional<at::Tensor>& residual_grad_in) {
  const char* name = "ls_fairseq layer_norm_bwd";
  LSF_CHECK(grad_in.is_cuda(), name, ": expected a CUDA tensor");
  LSF_CHECK(grad_in.sizes() == saved_in.sizes() && grad_in.scalar_type() == saved_in.scalar_type() &&
                  grad_in.device() == saved_in.device(),
              name, ": the saved input/output must have the shape, dtype and device of grad");
  LSF_CHECK(grad_in.dim() >= 1 && grad_in.size(-1) > 0, name, ": expected [..., C] with C > 0");
  const int C = static_cast<int>(grad_in.size(-1));
  const int64_t rows = grad_in.numel() / C;
  check_affine(w_in, grad_in, C, "weight", name);
  check_affine(b_in, grad_in, C, "bias", name);
  LSF_CHECK(invertible || mean_in.has_value(), name, ": mean is required unless invertible");
  LSF_CHECK(rstd_in.numel() == rows && rstd_in.scalar_type() == at::kFloat, name,
              ": rstd must be float32 with one entry per row");
  LSF_CHECK(invertible || (mean_in->numel() == rows && mean_in->scalar_type() == at::kFloat), name,
              ": mean must be float32 with one entry per row");
  LSF_CHECK(!weight_grad || w_in.has_value(), name, ": weight_grad needs a weight");
  LSF_CHECK(!bias_grad || b_in.has_value(), name, ": bias_grad needs a bias");
  LSF_CHECK(!residual_grad_in.has_value() ||
                (residual_grad_in->sizes() == grad_in.sizes() &&
                 residual_grad_in->scalar_type() == grad_in.scalar_type() &&
                 residual_grad_in->device() == grad_in.device()),
            name, ": residual_grad must have the shape, dtype and device of grad");
  c10::cuda::CUDAGuard guard(grad_in.device());
  const auto grad = grad_in.contiguous();
  const auto saved = saved_in.contiguous();
  const auto rstd = rstd_in.contiguous();
  at::Tensor mean;
  if (!invertible) mean = mean_in->contiguous();
  std::optional<at::Tensor> w, b;
  if (w_in.has_value()) w = w_in->contiguous();
  if (b_in.has_value()) b = b_in->contiguous();
  at::Tensor res;
  if (residual_grad_in.has_value()) res = residual_grad_in->contiguous();
  auto dx = at::empty_like(grad, at::MemoryFormat::Contiguous);
  const bool need_wb = weight_grad || bias_grad;
  at::Tensor dw = at::empty({weight_grad ? C : 0}, grad.options());
  at::Tensor db = at::empty({bias_grad ? C : 0}, grad.options());
  if (rows == 0) {
    if (weight_grad) dw.zero_();
    if (bias_grad) db.zero_();
    return {dx, dw, db};
  }
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int dev = grad.get_device();
  LSF_DISPATCH_FLOAT_TYPES(grad.scalar_type(), name, [&] {
    const T* gp = reinterpret_cast<const T*>(grad.data_ptr());
    const T* sp = reinterpret_cast<const T*>(saved.data_ptr());
    const T* wp = w ? reinterpret_cast<const T*>(w->data_ptr()) : nullptr;
    const T* bp = b ? reinterpret_cast<const T*>(b->data_ptr()) : nullptr;
    const float* mp = invertible ? nullptr : mean.data_ptr<float>();
    const float* rp = rstd.data_ptr<float>();
    const T* resp = res.defined() ? reinterpret_cast<const T*>(res.data_ptr()) : nullptr;
    T* dxp = reinterpret_cast<T*>(dx.data_ptr());
    at::Tensor part_w, part_b;
    int64_t chunks = 0;
    auto finish = [&]() {
      sum_partials<T>({{weight_grad ? part_w : at::Tensor(), dw},
                       {bias_grad ? part_b : at::Tensor(), db}}, chunks, C, stream);
    };
    auto run = [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const int nvec = C / VEC;
      if (nvec <= 2 * kBlockThreads) {
        int nv = 1;
        const dim3 block = bwd_rows_block(nvec, nv);
        auto launch = [&](auto kernel) {
          const int64_t grid = bwd_rows_grid(kernel, rows, block, dev);
          chunks = grid;
          if (need_wb) {
            part_w = at::empty({grid, C}, grad.options().dtype(at::kFloat));
            part_b = at::empty({grid, C}, grad.options().dtype(at::kFloat));
          }
          kernel<<<static_cast<unsigned>(grid), block, 0, stream>>>(
              gp, sp, wp, bp, mp, rp, resp, dxp, need_wb ? part_w.data_ptr<float>() : nullptr,
              need_wb ? part_b.data_ptr<float>() : nullptr, rows, C, invertible, nullptr, nullptr,
              DropoutArgs{false, 0u, 1.f}, nullptr);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        };
        if (nv == 1) {
          launch(ln_bwd_rows_kernel<T, VEC, 1>);
        } else {
          launch(ln_bwd_rows_kernel<T, VEC, 2>);
        }
      } else {
        const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, 1 << 20));
        ln_bwd_block_kernel<T, VEC><<<grid, kBlockThreads, 0, stream>>>(
            gp, sp, wp, bp, mp, rp, resp, dxp, rows, C, invertible);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (need_wb) {
          const int64_t gx = (C + kWarp - 1) / kWarp;
          const int64_t target = static_cast<int64_t>(sm_count(dev)) * 8;
          chunks = std::max<int64_t>(1, std::min<int64_t>({(rows + 7) / 8, target / gx + 1, 65535}));
          part_w = at::empty({chunks, C}, grad.options().dtype(at::kFloat));
          part_b = at::empty({chunks, C}, grad.options().dtype(at::kFloat));
          ln_dwdb_kernel<T><<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(chunks)),
                              dim3(kWarp, 8), 0, stream>>>(gp, sp, wp, bp, mp, rp,
                                                           part_w.data_ptr<float>(),
                                                           part_b.data_ptr<float>(), rows, C,
                                                           invertible);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      }
      finish();
    };
    constexpr int V = 16 / sizeof(T);
    if (use_vec<T>(C, {gp, sp, wp, bp, resp, dxp})) {
      run(std::integral_constant<int, V>{});
    } else {
      run(std::integral_constant<int, 1>{});
    }
  });
  return {dx, dw, db};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ls_fairseq, m) {
  m.def("layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps, bool invertible=False) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("layer_norm_bwd(Tensor grad, Tensor saved, Tensor? weight, Tensor? bias, Tensor? mean, "
        "Tensor rstd, bool invertible, bool weight_grad, bool bias_grad, Tensor? residual_grad=None) "
        "-> (Tensor, Tensor, Tensor)");
  // (LayerNorm(x), x) for pre-LN blocks: the second output is a view of x whose gradient is added
  // inside layer_norm_bwd. No kernel of its own: CompositeImplicitAutograd over layer_norm_fwd in
  // csrc/layer_norm_autograd.cpp (so no fake either: it decomposes).
  m.def("layer_norm_residual(Tensor(a) x, Tensor? weight, Tensor? bias, float eps) "
        "-> (Tensor, Tensor(a))");
}

TORCH_LIBRARY_IMPL(ls_fairseq, CUDA, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd);
  m.impl("layer_norm_bwd", &layer_norm_bwd);
}
