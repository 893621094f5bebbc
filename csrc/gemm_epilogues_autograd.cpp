// Autograd of ls_fairseq::linear_bgrad and relu_dropout_linear (csrc/gemm_epilogues.cpp), in C++
// for the eager step's host time (see layer_norm_autograd.cpp).
//
// linear_bgrad: y = x W^T + b. Backward: grad_x = grad W (aten), and the weight and bias gradients
// from one GEMM (linear_wgrad_bgrad) instead of aten's GEMM plus a column sum.
//
// relu_dropout_linear: h = dropout(relu(x + b)), y = h W^T (the FFN's middle: fc1's bias and
// activation, fc2 without its bias). Saves h (fc2's weight gradient needs it anyway), W and the
// bit-mask of h > 0; the fc1 output x is freed after the forward. Backward: grad_W = grad^T h
// (aten), and grad_x with fc1's bias gradient from one GEMM (relu_dropout_dgrad).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using Pair = std::tuple<Tensor, Tensor>;

struct LinearBgradFunction : public torch::autograd::Function<LinearBgradFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const Tensor& bias) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("ls_fairseq::linear_bgrad", "")
                         .typed<Tensor(const Tensor&, const Tensor&, const Tensor&)>();
    Tensor y;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      y = op.call(x, weight, bias);
    }
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x, weight});
    ctx->saved_data["bias_shape"] = bias.sizes().vec();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto wgrad = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("ls_fairseq::linear_wgrad_bgrad", "")
                            .typed<Pair(const Tensor&, const Tensor&)>();
    const Tensor& grad = grads[0];
    if (!grad.defined()) return {Tensor(), Tensor(), Tensor()};
    const auto saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    const Tensor& weight = saved[1];
    Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0)) gx = at::matmul(grad, weight);
    if (ctx->needs_input_grad(1) || ctx->needs_input_grad(2)) {
      std::tie(gw, gb) = wgrad.call(grad, x);
      gb = gb.view(ctx->saved_data["bias_shape"].toIntVector());
    }
    return {gx, ctx->needs_input_grad(1) ? gw : Tensor(), ctx->needs_input_grad(2) ? gb : Tensor()};
  }
};

Tensor linear_bgrad_autograd(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  return LinearBgradFunction::apply(x, weight, bias);
}

struct ReluDropoutLinearFunction : public torch::autograd::Function<ReluDropoutLinearFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x,
                               const std::optional<Tensor>& bias, const Tensor& weight, double p,
                               bool train) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("ls_fairseq::relu_dropout_linear", "")
                         .typed<std::tuple<Tensor, Tensor, Tensor>(
                             const Tensor&, const std::optional<Tensor>&, const Tensor&, double,
                             bool)>();
    Tensor y, h, mask;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(y, h, mask) = op.call(x, bias, weight, p, train);
    }
    ctx->mark_non_differentiable({h, mask});
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({h, weight, mask});
    const bool has_bias = bias.has_value() && bias->defined();
    ctx->saved_data["b_slot"] = has_bias ? int64_t(1) : int64_t(-1);
    ctx->saved_data["w_slot"] = has_bias ? int64_t(2) : int64_t(1);
    ctx->saved_data["bias_shape"] = has_bias ? bias->sizes().vec() : std::vector<int64_t>{};
    // the scale of a kept element, as csrc/philox_dropout.cuh's make_dropout computes it
    ctx->saved_data["scale"] = !(train && p > 0.0) ? 1.0
                               : p < 1.0         ? static_cast<double>(static_cast<float>(1.0 / (1.0 - p)))
                                                 : 0.0;
    return {y, h, mask};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto dgrad = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("ls_fairseq::relu_dropout_dgrad", "")
                            .typed<Pair(const Tensor&, const Tensor&, const Tensor&, double)>();
    const Tensor& grad = grads[0];
    const int64_t b_slot = ctx->saved_data["b_slot"].toInt();
    const bool need_x = ctx->needs_input_grad(0);
    const bool need_b = b_slot >= 0 && ctx->needs_input_grad(b_slot);
    const bool need_w = ctx->needs_input_grad(ctx->saved_data["w_slot"].toInt());
    if (!grad.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const auto saved = ctx->get_saved_variables();
    const Tensor& h = saved[0];
    const Tensor& weight = saved[1];
    const Tensor& mask = saved[2];
    Tensor gx, gb, gw;
    if (need_w) {
      gw = at::mm(grad.reshape({-1, grad.size(-1)}).t(), h.reshape({-1, h.size(-1)}));
    }
    if (need_x || need_b) {
      std::tie(gx, gb) = dgrad.call(grad, weight, mask, ctx->saved_data["scale"].toDouble());
      if (need_b) gb = gb.view(ctx->saved_data["bias_shape"].toIntVector());
    }
    // one entry per forward argument (an absent bias too); needs_input_grad counts present ones
    return {need_x ? gx : Tensor(), need_b ? gb : Tensor(), need_w ? gw : Tensor(), Tensor(),
            Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> relu_dropout_linear_autograd(const Tensor& x,
                                                                const std::optional<Tensor>& bias,
                                                                const Tensor& weight, double p,
                                                                bool train) {
  auto out = ReluDropoutLinearFunction::apply(x, bias, weight, p, train);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(ls_fairseq, Autograd, m) {
  m.impl("linear_bgrad", &linear_bgrad_autograd);
  m.impl("relu_dropout_linear", &relu_dropout_linear_autograd);
}
