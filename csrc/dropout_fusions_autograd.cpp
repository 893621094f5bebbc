// Autograd of ls_fairseq::bias_dropout_residual_fwd and bias_act_dropout_fwd
// (csrc/dropout_fusions.cu), in C++: see layer_norm_autograd.cpp for why.
//
// bias_dropout_residual: out = residual + dropout(x + bias). Backward regenerates the dropout mask
// from the saved Philox state (nothing per element is saved); without dropout d/dx is the identity
// and the bias gradient a column sum. The residual's gradient is the incoming gradient itself.
//
// bias_act_dropout: out = dropout(act(x + bias)). relu saves only `out` (an element passes the
// gradient exactly where out > 0), so the fc1 output x is freed after the forward; gelu saves x,
// bias and the Philox state and recomputes (csrc/dropout_fusions.cu).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using Pair = std::tuple<Tensor, Tensor>;

std::optional<Tensor> present(const Tensor& t) {
  return t.defined() ? std::optional<Tensor>(t) : std::nullopt;
}

// What both backwards read: the dropout arguments, and the bias's gradient slot (numbered over the
// tensor arguments that are present; x is slot 0, the bias, if any, slot 1) and shape.
void save_dropout_args(AutogradContext* ctx, const std::optional<Tensor>& bias, double p,
                       bool train) {
  const bool has_bias = bias.has_value() && bias->defined();
  ctx->saved_data["p"] = p;
  ctx->saved_data["train"] = train;
  ctx->saved_data["b_slot"] = has_bias ? int64_t(1) : int64_t(-1);
  ctx->saved_data["bias_shape"] = has_bias ? bias->sizes().vec() : std::vector<int64_t>{};
}

// ------------------------------------------------------------------ bias + dropout + residual
struct BiasDropoutResidualFunction
    : public torch::autograd::Function<BiasDropoutResidualFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x,
                               const std::optional<Tensor>& bias, const Tensor& residual, double p,
                               bool train) {
    static auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("ls_fairseq::bias_dropout_residual_fwd", "")
            .typed<Pair(const Tensor&, const std::optional<Tensor>&, const Tensor&, double, bool)>();
    Tensor out, rng;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(out, rng) = op.call(x, bias, residual, p, train);
    }
    ctx->mark_non_differentiable({rng});
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({rng});
    save_dropout_args(ctx, bias, p, train);
    ctx->saved_data["r_slot"] = bias.has_value() && bias->defined() ? int64_t(2) : int64_t(1);
    return {out, rng};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("ls_fairseq::bias_dropout_residual_bwd", "")
                         .typed<Pair(const Tensor&, const Tensor&, double, bool, bool)>();
    const Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const int64_t b_slot = ctx->saved_data["b_slot"].toInt();
    const bool need_x = ctx->needs_input_grad(0);
    const bool need_b = b_slot >= 0 && ctx->needs_input_grad(b_slot);
    const bool need_r = ctx->needs_input_grad(ctx->saved_data["r_slot"].toInt());
    const double p = ctx->saved_data["p"].toDouble();
    const bool train = ctx->saved_data["train"].toBool();
    Tensor grad_x, grad_bias;
    if (need_x || need_b) {
      if (train && p > 0) {
        std::tie(grad_x, grad_bias) = op.call(grad_out, ctx->get_saved_variables()[0], p, train, need_b);
      } else {  // no dropout: d/dx is the identity, no copy needed
        grad_x = grad_out;
        if (need_b) grad_bias = grad_out.reshape({-1, grad_out.size(-1)}).sum(0);
      }
      if (need_b) grad_bias = grad_bias.view(ctx->saved_data["bias_shape"].toIntVector());
    }
    return {need_x ? grad_x : Tensor(), need_b ? grad_bias : Tensor(),
            need_r ? grad_out : Tensor(), Tensor(), Tensor()};
  }
};

Pair bias_dropout_residual_fwd_autograd(const Tensor& x, const std::optional<Tensor>& bias,
                                        const Tensor& residual, double p, bool train) {
  auto out = BiasDropoutResidualFunction::apply(x, bias, residual, p, train);
  return {out[0], out[1]};
}

// ------------------------------------------------------------------ bias + activation + dropout
struct BiasActDropoutFunction : public torch::autograd::Function<BiasActDropoutFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x,
                               const std::optional<Tensor>& bias, c10::string_view activation,
                               double p, bool train) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("ls_fairseq::bias_act_dropout_fwd", "")
                         .typed<Pair(const Tensor&, const std::optional<Tensor>&, c10::string_view,
                                     double, bool)>();
    Tensor out, rng;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(out, rng) = op.call(x, bias, activation, p, train);
    }
    ctx->mark_non_differentiable({rng});
    ctx->set_materialize_grads(false);
    if (activation == "relu") {
      ctx->save_for_backward({out});
    } else {
      ctx->save_for_backward({x, bias.value_or(Tensor()), rng});
    }
    ctx->saved_data["activation"] = std::string(activation);
    save_dropout_args(ctx, bias, p, train);
    return {out, rng};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto relu_bwd = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("ls_fairseq::relu_dropout_bwd", "")
                               .typed<Pair(const Tensor&, const Tensor&, double, bool, bool)>();
    static auto act_bwd =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("ls_fairseq::bias_act_dropout_bwd", "")
            .typed<Pair(const Tensor&, const Tensor&, const std::optional<Tensor>&, const Tensor&,
                        c10::string_view, double, bool, bool)>();
    const Tensor& grad_out = grads[0];
    const int64_t b_slot = ctx->saved_data["b_slot"].toInt();
    const bool need_x = ctx->needs_input_grad(0);
    const bool need_b = b_slot >= 0 && ctx->needs_input_grad(b_slot);
    if (!grad_out.defined() || !(need_x || need_b)) {
      return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    }
    const std::string& activation = ctx->saved_data["activation"].toStringRef();
    const double p = ctx->saved_data["p"].toDouble();
    const bool train = ctx->saved_data["train"].toBool();
    const auto saved = ctx->get_saved_variables();
    Tensor grad_x, grad_bias;
    if (activation == "relu") {
      std::tie(grad_x, grad_bias) = relu_bwd.call(grad_out, saved[0], p, train, need_b);
    } else {
      std::tie(grad_x, grad_bias) = act_bwd.call(grad_out, saved[0], present(saved[1]), saved[2],
                                                 activation, p, train, need_b);
    }
    return {need_x ? grad_x : Tensor(),
            need_b ? grad_bias.view(ctx->saved_data["bias_shape"].toIntVector()) : Tensor(),
            Tensor(), Tensor(), Tensor()};
  }
};

Pair bias_act_dropout_fwd_autograd(const Tensor& x, const std::optional<Tensor>& bias,
                                   c10::string_view activation, double p, bool train) {
  auto out = BiasActDropoutFunction::apply(x, bias, activation, p, train);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(ls_fairseq, Autograd, m) {
  m.impl("bias_dropout_residual_fwd", &bias_dropout_residual_fwd_autograd);
  m.impl("bias_act_dropout_fwd", &bias_act_dropout_fwd_autograd);
}
