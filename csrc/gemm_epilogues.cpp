// GEMMs whose cuBLASLt epilogue does the work of a separate bandwidth-bound pass (issue 6).
//
//   linear_wgrad_bgrad(grad [N, out], x [N, in]) -> (grad_weight [out, in], grad_bias [out])
//       Weight gradient of y = x W^T + b, with the bias gradient (grad's column sum) reduced by
//       the same GEMM (CUBLASLT_EPILOGUE_BGRADB) instead of a second pass over grad.
//   relu_dropout_dgrad(grad [N, out], weight [out, F], mask, scale) -> (grad_x [N, F], grad_bias [F])
//       Input gradient of y = dropout(relu(x + b)) W^T: scale * (grad W) where the mask bit is set,
//       0 elsewhere, and its column sum (CUBLASLT_EPILOGUE_DRELU_BGRAD, alpha = scale). `mask` is
//       relu_dropout_mask_fwd's bit-mask (csrc/dropout_fusions.cu). Replaces a GEMM followed by an
//       elementwise pass that read the GEMM's output and the saved activation again.
//   relu_bias_gemm_aux(x [N, in], weight [F, in], bias [F]) -> (relu(x W^T + b), mask)
//       cuBLASLt's own ReLU bit-mask (CUBLASLT_EPILOGUE_RELU_AUX_BIAS); the tests check that
//       relu_dropout_mask_fwd writes the same layout.
//   linear_bgrad / relu_dropout_linear: the forward ops whose C++ autograd
//       (gemm_epilogues_autograd.cpp) calls the two backward GEMMs above.
//
// Layout: a row-major [N, C] tensor is a column-major C x N matrix for cuBLASLt, so every GEMM
// below is written in that view. ReLU bit-mask: column-major with a leading dimension of
// ceil(F / 128) * 128 bits (cuBLASLt requires a multiple of 128), i.e. [N, ceil(F / 128) * 16]
// bytes, bit f % 8 of byte f / 8 for feature f. fp16/bf16 storage, fp32 accumulation and scaling.
// When cuBLASLt offers no algorithm for a case, the backward ops compute the same result with
// aten ops (one warning per process); they never fail for that reason.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cublasLt.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "check.h"

namespace {

using at::Tensor;

#define LSF_CUBLASLT(call)                                                                       \
  do {                                                                                           \
    const cublasStatus_t status_ = (call);                                                       \
    LSF_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "ls_fairseq cuBLASLt: " #call " returned status ", \
              static_cast<int>(status_));                                                        \
  } while (0)

// Largest workspace an algorithm may ask for (cuBLASLt's recommendation for Hopper is 32 MiB); the
// op allocates what the chosen algorithm needs from torch's caching allocator.
constexpr uint64_t kMaxWorkspaceBytes = 32ull << 20;

constexpr int64_t kMaskBits = 128;  // cuBLASLt: the bit-mask leading dimension is a multiple of 128

int64_t mask_ld_bits(int64_t features) { return (features + kMaskBits - 1) / kMaskBits * kMaskBits; }

struct Descriptors {  // owns cuBLASLt's descriptors for one call
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

struct Epilogue {
  cublasLtEpilogue_t kind = CUBLASLT_EPILOGUE_DEFAULT;
  void* bias = nullptr;  // bias (forward) or bias gradient (BGRAD epilogues)
  void* aux = nullptr;   // ReLU bit-mask (written by RELU_AUX, read by DRELU)
  int64_t aux_ld = 0;    // in bits
};

// D (m x n, column-major, ld m) = alpha * op(A) (m x k) * op(B) (k x n), then the epilogue.
// A is stored k x m when trans_a (else m x k) with leading dimension lda; B likewise.
// Returns false, launching nothing, when cuBLASLt has no algorithm for the case.
bool lt_matmul(const Tensor& like, int64_t m, int64_t n, int64_t k, float alpha, const void* a,
               bool trans_a, int64_t lda, const void* b, bool trans_b, int64_t ldb, void* d,
               const Epilogue& ep) {
  const cudaDataType_t type = like.scalar_type() == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
  Descriptors h;
  LSF_CUBLASLT(cublasLtMatmulDescCreate(&h.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  LSF_CUBLASLT(cublasLtMatmulDescSetAttribute(h.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  LSF_CUBLASLT(cublasLtMatmulDescSetAttribute(h.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const uint32_t kind = static_cast<uint32_t>(ep.kind);
  LSF_CUBLASLT(cublasLtMatmulDescSetAttribute(h.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &kind, sizeof(kind)));
  if (ep.bias != nullptr) {
    LSF_CUBLASLT(cublasLtMatmulDescSetAttribute(h.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ep.bias,
                                                sizeof(ep.bias)));
  }
  if (ep.aux != nullptr) {
    LSF_CUBLASLT(cublasLtMatmulDescSetAttribute(h.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                &ep.aux, sizeof(ep.aux)));
    LSF_CUBLASLT(cublasLtMatmulDescSetAttribute(h.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                &ep.aux_ld, sizeof(ep.aux_ld)));
  }
  LSF_CUBLASLT(cublasLtMatrixLayoutCreate(&h.a, type, trans_a ? k : m, trans_a ? m : k, lda));
  LSF_CUBLASLT(cublasLtMatrixLayoutCreate(&h.b, type, trans_b ? n : k, trans_b ? k : n, ldb));
  LSF_CUBLASLT(cublasLtMatrixLayoutCreate(&h.d, type, m, n, m));
  LSF_CUBLASLT(cublasLtMatmulPreferenceCreate(&h.pref));
  const uint64_t max_ws = kMaxWorkspaceBytes;
  LSF_CUBLASLT(cublasLtMatmulPreferenceSetAttribute(
      h.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws)));

  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t result = {};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, h.op, h.a, h.b, h.d, h.d,
                                                               h.pref, 1, &result, &found);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0) return false;
  Tensor workspace;
  void* ws = nullptr;
  if (result.workspaceSize > 0) {
    workspace = at::empty({static_cast<int64_t>(result.workspaceSize)}, like.options().dtype(at::kByte));
    ws = workspace.data_ptr();
  }
  const float beta = 0.f;
  LSF_CUBLASLT(cublasLtMatmul(handle, h.op, &alpha, a, h.a, b, h.b, &beta, d, h.d, d, h.d,
                              &result.algo, ws, result.workspaceSize,
                              c10::cuda::getCurrentCUDAStream()));
  return true;
}

void warn_fallback(const char* what) {
  // one std::string argument: TORCH_WARN passes it through without std::ostream (see check.h)
  TORCH_WARN_ONCE(lsf::message("ls_fairseq: cuBLASLt has no algorithm for ", what,
                               " at this shape; computing it with separate aten ops (same math, "
                               "slower)"));
}

void check_matrix_input(const Tensor& t, const Tensor& like, const char* name, const char* what) {
  LSF_CHECK(t.is_cuda() && t.device() == like.device(), name, ": ", what,
            " must be on the CUDA device of the other inputs");
  LSF_CHECK(t.scalar_type() == like.scalar_type(), name, ": ", what, " dtype ", t.scalar_type(),
            " differs from ", like.scalar_type());
}

void check_half(const Tensor& t, const char* name) {
  LSF_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, name,
            ": expected float16 or bfloat16 (fp32 runs the aten path), got ", t.scalar_type());
}

// t [..., C] -> contiguous [rows, C]
Tensor rows_of(const Tensor& t, int64_t C) { return t.reshape({-1, C}).contiguous(); }

// ------------------------------------------------------------------ weight + bias gradient
std::tuple<Tensor, Tensor> linear_wgrad_bgrad(const Tensor& grad_in, const Tensor& x_in) {
  const char* name = "ls_fairseq linear_wgrad_bgrad";
  check_half(grad_in, name);
  check_matrix_input(x_in, grad_in, name, "x");
  LSF_CHECK(grad_in.dim() >= 1 && x_in.dim() >= 1, name, ": expected [..., out] and [..., in]");
  const int64_t out_f = grad_in.size(-1), in_f = x_in.size(-1);
  LSF_CHECK(out_f > 0 && in_f > 0 && grad_in.numel() / out_f == x_in.numel() / in_f, name,
            ": grad ", grad_in.sizes(), " and x ", x_in.sizes(), " must have the same rows");
  c10::cuda::CUDAGuard guard(grad_in.device());
  const Tensor grad = rows_of(grad_in, out_f), x = rows_of(x_in, in_f);
  const int64_t rows = grad.size(0);
  if (rows == 0) {
    return {at::zeros({out_f, in_f}, grad.options()), at::zeros({out_f}, grad.options())};
  }
  Tensor gw = at::empty({out_f, in_f}, grad.options());
  Tensor gb = at::empty({out_f}, grad.options());
  // gw^T (in x out, column-major) = x^T (in x rows) * grad (rows x out); the bias gradient is the
  // sum of B = grad over the GEMM's k dimension (rows).
  Epilogue ep;
  ep.kind = CUBLASLT_EPILOGUE_BGRADB;
  ep.bias = gb.data_ptr();
  if (!lt_matmul(grad, in_f, out_f, rows, 1.f, x.data_ptr(), false, in_f, grad.data_ptr(), true,
                 out_f, gw.data_ptr(), ep)) {
    warn_fallback("the weight gradient with its bias gradient");
    return {at::mm(grad.t(), x), grad.sum(0)};
  }
  return {gw, gb};
}

// ------------------------------------------------------------------ relu + dropout input gradient
Tensor unpack_mask(const Tensor& mask, int64_t features) {  // [rows, ld / 8] bytes -> [rows, F] bool
  const auto shifts = at::arange(8, mask.options());
  return mask.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and(1)
      .reshape({mask.size(0), -1}).narrow(1, 0, features).to(at::kBool);
}

std::tuple<Tensor, Tensor> relu_dropout_dgrad(const Tensor& grad_in, const Tensor& weight_in,
                                              const Tensor& mask_in, double scale) {
  const char* name = "ls_fairseq relu_dropout_dgrad";
  check_half(grad_in, name);
  check_matrix_input(weight_in, grad_in, name, "weight");
  LSF_CHECK(weight_in.dim() == 2 && grad_in.dim() >= 1 && grad_in.size(-1) == weight_in.size(0),
            name, ": expected grad [..., out] and weight [out, F], got ", grad_in.sizes(), " and ",
            weight_in.sizes());
  const int64_t out_f = weight_in.size(0), features = weight_in.size(1);
  LSF_CHECK(out_f > 0 && features > 0, name, ": empty weight ", weight_in.sizes());
  c10::cuda::CUDAGuard guard(grad_in.device());
  const Tensor grad = rows_of(grad_in, out_f), weight = weight_in.contiguous();
  const int64_t rows = grad.size(0);
  const int64_t ld_bits = mask_ld_bits(features);
  LSF_CHECK(mask_in.is_cuda() && mask_in.device() == grad_in.device() &&
                mask_in.scalar_type() == at::kByte && mask_in.dim() == 2 &&
                mask_in.size(0) == rows && mask_in.size(1) == ld_bits / 8,
            name, ": mask must be relu_dropout_mask_fwd's uint8 [", rows, ", ", ld_bits / 8,
            "], got ", mask_in.scalar_type(), " ", mask_in.sizes());
  const Tensor mask = mask_in.contiguous();
  auto out_shape = grad_in.sizes().vec();
  out_shape.back() = features;
  if (rows == 0) {
    return {at::zeros(out_shape, grad.options()), at::zeros({features}, grad.options())};
  }
  Tensor gx = at::empty({rows, features}, grad.options());
  Tensor gb = at::empty({features}, grad.options());
  // gx^T (F x rows, column-major) = W^T (F x out) * grad^T (out x rows), masked and scaled; the
  // bias gradient is its sum over the rows (columns of D).
  Epilogue ep;
  ep.kind = CUBLASLT_EPILOGUE_DRELU_BGRAD;
  ep.bias = gb.data_ptr();
  ep.aux = mask.data_ptr();
  ep.aux_ld = ld_bits;
  if (!lt_matmul(grad, features, rows, out_f, static_cast<float>(scale), weight.data_ptr(), false,
                 features, grad.data_ptr(), false, out_f, gx.data_ptr(), ep)) {
    warn_fallback("the relu/dropout input gradient with its bias gradient");
    const Tensor full = at::mm(grad, weight).to(at::kFloat).mul_(scale);
    gx = full.masked_fill(unpack_mask(mask, features).logical_not(), 0.0);
    gb = gx.sum(0).to(grad.scalar_type());
    gx = gx.to(grad.scalar_type());
  }
  return {gx.view(out_shape), gb};
}

// ------------------------------------------------------------------ cuBLASLt's own bit-mask (tests)
std::tuple<Tensor, Tensor> relu_bias_gemm_aux(const Tensor& x_in, const Tensor& weight_in,
                                              const Tensor& bias_in) {
  const char* name = "ls_fairseq relu_bias_gemm_aux";
  check_half(x_in, name);
  check_matrix_input(weight_in, x_in, name, "weight");
  check_matrix_input(bias_in, x_in, name, "bias");
  LSF_CHECK(weight_in.dim() == 2 && x_in.dim() == 2 && x_in.size(1) == weight_in.size(1) &&
                bias_in.numel() == weight_in.size(0),
            name, ": expected x [N, in], weight [F, in], bias [F]");
  c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous(), weight = weight_in.contiguous(), bias = bias_in.contiguous();
  const int64_t rows = x.size(0), in_f = x.size(1), features = weight.size(0);
  const int64_t ld_bits = mask_ld_bits(features);
  Tensor y = at::empty({rows, features}, x.options());
  Tensor mask = at::zeros({rows, ld_bits / 8}, x.options().dtype(at::kByte));
  if (rows == 0) return {y, mask};
  Epilogue ep;
  ep.kind = CUBLASLT_EPILOGUE_RELU_AUX_BIAS;
  ep.bias = bias.data_ptr();
  ep.aux = mask.data_ptr();
  ep.aux_ld = ld_bits;
  // y^T (F x rows) = W (F x in, stored in x F) * x^T (in x rows)
  LSF_CHECK(lt_matmul(x, features, rows, in_f, 1.f, weight.data_ptr(), true, in_f, x.data_ptr(),
                      false, in_f, y.data_ptr(), ep),
            name, ": cuBLASLt has no RELU_AUX_BIAS algorithm for this shape");
  return {y, mask};
}

// ------------------------------------------------------------------ forward ops (autograd in C++)
Tensor linear_bgrad(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  return at::linear(x, weight, bias);
}

std::tuple<Tensor, Tensor, Tensor> relu_dropout_linear(const Tensor& x,
                                                       const std::optional<Tensor>& bias,
                                                       const Tensor& weight, double p, bool train) {
  static auto mask_fwd =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("ls_fairseq::relu_dropout_mask_fwd", "")
          .typed<std::tuple<Tensor, Tensor>(const Tensor&, const std::optional<Tensor>&, double,
                                            bool)>();
  auto [h, mask] = mask_fwd.call(x, bias, p, train);
  return {at::linear(h, weight), h, mask};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ls_fairseq, m) {
  m.def("linear_wgrad_bgrad(Tensor grad, Tensor x) -> (Tensor, Tensor)");
  m.def("relu_dropout_dgrad(Tensor grad, Tensor weight, Tensor mask, float scale) "
        "-> (Tensor, Tensor)");
  m.def("relu_bias_gemm_aux(Tensor x, Tensor weight, Tensor bias) -> (Tensor, Tensor)");
  m.def("linear_bgrad(Tensor x, Tensor weight, Tensor bias) -> Tensor");
  m.def("relu_dropout_linear(Tensor x, Tensor? bias, Tensor weight, float p, bool train) "
        "-> (Tensor, Tensor, Tensor)",
        {at::Tag::nondeterministic_seeded});
}

TORCH_LIBRARY_IMPL(ls_fairseq, CUDA, m) {
  m.impl("linear_wgrad_bgrad", &linear_wgrad_bgrad);
  m.impl("relu_dropout_dgrad", &relu_dropout_dgrad);
  m.impl("relu_bias_gemm_aux", &relu_bias_gemm_aux);
  m.impl("linear_bgrad", &linear_bgrad);
  m.impl("relu_dropout_linear", &relu_dropout_linear);
}
