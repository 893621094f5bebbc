// The pre-LN sublayer boundary in one kernel (ls_fairseq): x = residual + dropout(y + bias) and
// h = LayerNorm(x), the values of bias_dropout_residual_fwd (csrc/dropout_fusions.cu: same Philox
// mask, through bias_dropout_residual_values) followed by layer_norm_fwd (csrc/layer_norm.cu: the
// same warp-per-row LayerNorm, ln_warp_row) of the stored, rounded x, which is written once and
// not read back. Its backward, with dropout, writes dx and y's gradient (dx through the mask) and
// the bias sums from one pass of LayerNorm's register-path backward (ln_bwd_rows_kernel with DROP).
// Row code shared with LayerNorm: csrc/layer_norm_rows.cuh. Autograd:
// csrc/bias_dropout_residual_layer_norm_autograd.cpp.
//
// Storage float32/float16/bfloat16, math in float32; rows held by one warp in 16-byte vectors only
// (C % 8 == 0 and C <= 2048 for fp16/bf16, C % 4 == 0 and C <= 1024 for fp32, 16-byte aligned
// data): ls_fairseq/ops/bias_dropout_residual_layer_norm.py runs the unfused pair otherwise.
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
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "check.h"
#include "device_utils.cuh"
#include "launch_utils.h"
#include "layer_norm_rows.cuh"
#include "philox_dropout.cuh"

namespace {

using namespace lsf;  // helpers from launch_utils.h, device_utils.cuh and layer_norm_rows.cuh

// ---------------------------------------------------------------- forward
// Fused pre-LN sublayer boundary: x = residual + dropout(y + bias) (the bias_dropout_residual
// kernel's values and Philox mask: bias_dropout_residual_values), stored, then
// h = LayerNorm(x) of the stored (rounded) x, as the two kernels one after the other compute it,
// without reading x back. 16-byte vectors only (VEC = 8 fp16/bf16, 4 fp32: whole Philox words).
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(kWarp* kWarpsPerBlock)
    bdr_ln_fwd_warp_kernel(const T* __restrict__ y, const T* __restrict__ bias,
                           const T* __restrict__ res, T* __restrict__ x_out,
                           const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ h,
                           float* __restrict__ mean_out, float* __restrict__ rstd_out,
                           int64_t rows, int C, float eps, DropoutArgs drop,
                           at::PhiloxCudaState philox, int64_t* __restrict__ rng_out) {
  static_assert(VEC % 4 == 0, "whole Philox words per vector");
  uint64_t seed, offset;
  unpack_seed(philox, drop.enabled, seed, offset);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    rng_out[0] = static_cast<int64_t>(seed);
    rng_out[1] = static_cast<int64_t>(offset);
  }
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (row >= rows) return;
  const int nvec = C / VEC;
  float v[NV][VEC];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int j = lane + k * kWarp;
    if (j < nvec) {
      const int64_t off = row * C + static_cast<int64_t>(j) * VEC;
      float yv[VEC], rv[VEC], bv[VEC], o[VEC];
      load_vec<T, VEC>(y + off, yv);
      load_vec<T, VEC>(res + off, rv);
      if (bias != nullptr) {
        load_vec<T, VEC>(bias + static_cast<int64_t>(j) * VEC, bv);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) bv[i] = 0.f;
      }
      bias_dropout_residual_values<VEC>(yv, bv, rv, drop, seed, offset, row,
                                        static_cast<int64_t>(j) * VEC, C, o);
      store_vec<T, VEC>(x_out + off, o);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[k][i] = to_float(from_float<T>(o[i]));  // the stored x
    }
  }
  const float shift = __shfl_sync(0xffffffffu, v[0][0], 0);  // lane 0 holds column 0
  ln_warp_row<T, VEC, NV>(v, shift, lane, nvec, C, w, b, h + row * C, mean_out, rstd_out, row, eps);
}

// ---------------------------------------------------------------- host side
// (x, h, mean, rstd, rng): x = residual + dropout(y + bias), h = LayerNorm(x), with the Philox
// state rng that bias_dropout_residual_bwd regenerates the mask from. Rows held by one warp in
// 16-byte vectors only (C % 8 == 0 and C <= 2048 for fp16/bf16, C % 4 == 0 and C <= 1024 for fp32,
// 16-byte aligned data); ops/bias_dropout_residual_layer_norm.py composes the two ops otherwise.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bdr_layer_norm_fwd(
    const at::Tensor& y_in, const std::optional<at::Tensor>& bias_in, const at::Tensor& res_in,
    const std::optional<at::Tensor>& w_in, const std::optional<at::Tensor>& b_in, double p,
    bool train, double eps) {
  const char* name = "ls_fairseq bias_dropout_residual_layer_norm_fwd";
  LSF_CHECK(y_in.is_cuda(), name, ": expected a CUDA tensor");
  LSF_CHECK(y_in.dim() >= 1 && y_in.size(-1) > 0, name,
            ": expected y of shape [..., C] with C > 0, got ", y_in.sizes());
  LSF_CHECK(res_in.sizes() == y_in.sizes() && res_in.scalar_type() == y_in.scalar_type() &&
                res_in.device() == y_in.device(),
            name, ": residual must have the shape, dtype and device of y");
  const int64_t C64 = y_in.size(-1);
  const int64_t vec = 16 / static_cast<int64_t>(y_in.element_size());
  LSF_CHECK(C64 % vec == 0 && C64 / vec <= 8 * kWarp, name, ": hidden size ", C64,
            " must be a multiple of ", vec, " and at most ", 8 * kWarp * vec,
            " (use bias_dropout_residual then layer_norm)");
  const int C = static_cast<int>(C64);
  check_affine(bias_in, y_in, C, "bias", name);
  check_affine(w_in, y_in, C, "weight", name);
  check_affine(b_in, y_in, C, "LayerNorm bias", name);
  LSF_CHECK(eps >= 0.0, name, ": eps must be >= 0");
  c10::cuda::CUDAGuard guard(y_in.device());
  const auto y = y_in.contiguous();
  const auto res = res_in.contiguous();
  std::optional<at::Tensor> bias, w, b;
  if (bias_in.has_value()) bias = bias_in->contiguous();
  if (w_in.has_value()) w = w_in->contiguous();
  if (b_in.has_value()) b = b_in->contiguous();
  const int64_t rows = y.numel() / C;
  auto x = at::empty_like(y, at::MemoryFormat::Contiguous);
  auto h = at::empty_like(y, at::MemoryFormat::Contiguous);
  auto mean = at::empty({rows}, y.options().dtype(at::kFloat));
  auto rstd = at::empty({rows}, y.options().dtype(at::kFloat));
  const DropoutArgs drop = make_dropout("ls_fairseq dropout", p, train);
  auto rng = rows == 0 ? at::zeros({2}, y.options().dtype(at::kLong))
                       : at::empty({2}, y.options().dtype(at::kLong));
  if (rows == 0) return {x, h, mean, rstd, rng};
  at::PhiloxCudaState philox;
  if (drop.enabled) philox = next_philox(y);
  auto stream = c10::cuda::getCurrentCUDAStream();
  LSF_DISPATCH_FLOAT_TYPES(y.scalar_type(), name, [&] {
    constexpr int VEC = 16 / sizeof(T);
    const T* yp = reinterpret_cast<const T*>(y.data_ptr());
    const T* bp = bias ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr;
    const T* rp = reinterpret_cast<const T*>(res.data_ptr());
    const T* wp = w ? reinterpret_cast<const T*>(w->data_ptr()) : nullptr;
    const T* lbp = b ? reinterpret_cast<const T*>(b->data_ptr()) : nullptr;
    T* xp = reinterpret_cast<T*>(x.data_ptr());
    T* hp = reinterpret_cast<T*>(h.data_ptr());
    LSF_CHECK(use_vec<T>(C, {yp, bp, rp, wp, lbp, xp, hp}), name,
              ": inputs must be 16-byte aligned");
    float* mp = mean.data_ptr<float>();
    float* sp = rstd.data_ptr<float>();
    int64_t* rngp = rng.data_ptr<int64_t>();
    const float feps = static_cast<float>(eps);
    const unsigned grid = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
    const dim3 block(kWarp * kWarpsPerBlock);
    auto launch = [&](auto nv_tag) {
      constexpr int NV = decltype(nv_tag)::value;
      bdr_ln_fwd_warp_kernel<T, VEC, NV><<<grid, block, 0, stream>>>(
          yp, bp, rp, xp, wp, lbp, hp, mp, sp, rows, C, feps, drop, philox, rngp);
    };
    switch (vectors_per_lane(C / VEC)) {
      case 1: launch(std::integral_constant<int, 1>{}); break;
      case 2: launch(std::integral_constant<int, 2>{}); break;
      case 4: launch(std::integral_constant<int, 4>{}); break;
      default: launch(std::integral_constant<int, 8>{}); break;
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {x, h, mean, rstd, rng};
}

// Backward of bias_dropout_residual_layer_norm_fwd with dropout: from grad_h (and x's own gradient
// grad_x, the residual stream's), dx = LayerNorm's input gradient + grad_x, gy = dropout'(dx) and
// the bias gradient (y's), plus dw/dlb when asked for: one pass instead of layer_norm_bwd then
// bias_dropout_residual_bwd. Register path only (C / VEC <= 512 16-byte vectors: every C the
// fused forward takes). Returns (dx, gy, dw, dlb, dbias); unrequested gradients are empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bdr_layer_norm_bwd(
    const at::Tensor& grad_in, const at::Tensor& x_in, const std::optional<at::Tensor>& w_in,
    const std::optional<at::Tensor>& b_in, const at::Tensor& mean_in, const at::Tensor& rstd_in,
    const std::optional<at::Tensor>& grad_x_in, const at::Tensor& rng, double p, bool train,
    bool weight_grad, bool ln_bias_grad, bool bias_grad) {
  const char* name = "ls_fairseq bias_dropout_residual_layer_norm_bwd";
  LSF_CHECK(grad_in.is_cuda() && grad_in.sizes() == x_in.sizes() &&
                grad_in.scalar_type() == x_in.scalar_type() && grad_in.device() == x_in.device(),
            name, ": grad and x must be CUDA tensors of one shape and dtype");
  LSF_CHECK(grad_in.dim() >= 1 && grad_in.size(-1) > 0, name, ": expected [..., C] with C > 0");
  const int C = static_cast<int>(grad_in.size(-1));
  const int64_t rows = grad_in.numel() / C;
  const int64_t vec = 16 / static_cast<int64_t>(grad_in.element_size());
  LSF_CHECK(C % vec == 0 && C / vec <= 2 * kBlockThreads, name, ": hidden size ", C,
            " must be a multiple of ", vec, " and at most ", 2 * kBlockThreads * vec);
  check_affine(w_in, grad_in, C, "weight", name);
  check_affine(b_in, grad_in, C, "LayerNorm bias", name);
  LSF_CHECK(mean_in.numel() == rows && rstd_in.numel() == rows &&
                mean_in.scalar_type() == at::kFloat && rstd_in.scalar_type() == at::kFloat,
            name, ": mean and rstd must be float32 with one entry per row");
  LSF_CHECK(!weight_grad || w_in.has_value(), name, ": weight_grad needs a weight");
  LSF_CHECK(!ln_bias_grad || b_in.has_value(), name, ": ln_bias_grad needs a LayerNorm bias");
  LSF_CHECK(!grad_x_in.has_value() || (grad_x_in->sizes() == grad_in.sizes() &&
                                       grad_x_in->scalar_type() == grad_in.scalar_type() &&
                                       grad_x_in->device() == grad_in.device()),
            name, ": grad_x must have the shape, dtype and device of grad");
  const DropoutArgs drop = make_dropout("ls_fairseq dropout", p, train);
  LSF_CHECK(drop.enabled, name, ": only with dropout (without it, y's gradient is dx itself)");
  LSF_CHECK(rng.numel() == 2 && rng.scalar_type() == at::kLong && rng.device() == grad_in.device(),
            name, ": rng must be the int64[2] tensor returned by the forward");
  c10::cuda::CUDAGuard guard(grad_in.device());
  const auto grad = grad_in.contiguous();
  const auto x = x_in.contiguous();
  const auto mean = mean_in.contiguous();
  const auto rstd = rstd_in.contiguous();
  std::optional<at::Tensor> w, b;
  if (w_in.has_value()) w = w_in->contiguous();
  if (b_in.has_value()) b = b_in->contiguous();
  at::Tensor res;
  if (grad_x_in.has_value()) res = grad_x_in->contiguous();
  auto dx = at::empty_like(grad, at::MemoryFormat::Contiguous);
  auto gy = at::empty_like(grad, at::MemoryFormat::Contiguous);
  at::Tensor dw = at::empty({weight_grad ? C : 0}, grad.options());
  at::Tensor dlb = at::empty({ln_bias_grad ? C : 0}, grad.options());
  at::Tensor dbias = at::empty({bias_grad ? C : 0}, grad.options());
  if (rows == 0) {
    dw.zero_();
    dlb.zero_();
    dbias.zero_();
    return {dx, gy, dw, dlb, dbias};
  }
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int dev = grad.get_device();
  LSF_DISPATCH_FLOAT_TYPES(grad.scalar_type(), name, [&] {
    constexpr int VEC = 16 / sizeof(T);
    const T* gp = reinterpret_cast<const T*>(grad.data_ptr());
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    const T* wp = w ? reinterpret_cast<const T*>(w->data_ptr()) : nullptr;
    const T* bp = b ? reinterpret_cast<const T*>(b->data_ptr()) : nullptr;
    const T* resp = res.defined() ? reinterpret_cast<const T*>(res.data_ptr()) : nullptr;
    T* dxp = reinterpret_cast<T*>(dx.data_ptr());
    T* gyp = reinterpret_cast<T*>(gy.data_ptr());
    LSF_CHECK(use_vec<T>(C, {gp, xp, wp, bp, resp, dxp, gyp}), name,
              ": inputs must be 16-byte aligned");
    int nv = 1;
    const dim3 block = bwd_rows_block(C / VEC, nv);
    auto launch = [&](auto kernel) {
      const int64_t grid = bwd_rows_grid(kernel, rows, block, dev);
      auto partial = [&](bool need) {
        return need ? at::empty({grid, C}, grad.options().dtype(at::kFloat)) : at::Tensor();
      };
      const at::Tensor part_w = partial(weight_grad), part_b = partial(ln_bias_grad),
                       part_g = partial(bias_grad);
      auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
      kernel<<<static_cast<unsigned>(grid), block, 0, stream>>>(
          gp, xp, wp, bp, mean.data_ptr<float>(), rstd.data_ptr<float>(), resp, dxp, ptr(part_w),
          ptr(part_b), rows, C, false, gyp, ptr(part_g), drop, rng.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      sum_partials<T>({{part_w, dw}, {part_b, dlb}, {part_g, dbias}}, grid, C, stream);
    };
    if (nv == 1) {
      launch(ln_bwd_rows_kernel<T, VEC, 1, true>);
    } else {
      launch(ln_bwd_rows_kernel<T, VEC, 2, true>);
    }
  });
  return {dx, gy, dw, dlb, dbias};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ls_fairseq, m) {
  m.def("bias_dropout_residual_layer_norm_fwd(Tensor y, Tensor? bias, Tensor residual, "
        "Tensor? weight, Tensor? ln_bias, float p, bool train, float eps) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        {at::Tag::nondeterministic_seeded});
  m.def("bias_dropout_residual_layer_norm_bwd(Tensor grad, Tensor x, Tensor? weight, "
        "Tensor? ln_bias, Tensor mean, Tensor rstd, Tensor? grad_x, Tensor rng, float p, "
        "bool train, bool weight_grad, bool ln_bias_grad, bool bias_grad) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ls_fairseq, CUDA, m) {
  m.impl("bias_dropout_residual_layer_norm_fwd", &bdr_layer_norm_fwd);
  m.impl("bias_dropout_residual_layer_norm_bwd", &bdr_layer_norm_bwd);
}
