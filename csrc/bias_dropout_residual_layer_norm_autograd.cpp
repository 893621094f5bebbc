// Autograd of ls_fairseq::bias_dropout_residual_layer_norm_fwd
// (csrc/bias_dropout_residual_layer_norm.cu), in C++: see csrc/layer_norm_autograd.cpp for why.
//
// (x, h) = (residual + dropout(y + bias), LayerNorm(x)). Backward, with the gradients of both
// outputs: dx = LayerNorm's input gradient of grad_h plus grad_x (the residual stream's), y's
// gradient is dx through the dropout mask (regenerated from the saved Philox state) and the
// residual's is dx itself. With dropout, one pass computes all of them
// (bias_dropout_residual_layer_norm_bwd: the values of layer_norm_bwd then
// bias_dropout_residual_bwd, the bias gradient summed in another order); without it, or when only
// x's gradient arrives, the unfused kernels run.
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

// layer_norm_bwd (csrc/layer_norm.cu), the backward this op runs without dropout
using BwdSig = std::tuple<Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const std::optional<Tensor>&, const std::optional<Tensor>&,
    const std::optional<Tensor>&, const Tensor&, bool, bool, bool, const std::optional<Tensor>&);

std::optional<Tensor> present(const Tensor& t) {
  return t.defined() ? std::optional<Tensor>(t) : std::nullopt;
}

using BdrLnSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const std::optional<Tensor>&, const Tensor&, const std::optional<Tensor>&,
    const std::optional<Tensor>&, double, bool, double);

struct BiasDropoutResidualLayerNormFunction
    : public torch::autograd::Function<BiasDropoutResidualLayerNormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& y,
                               const std::optional<Tensor>& bias, const Tensor& residual,
                               const std::optional<Tensor>& weight,
                               const std::optional<Tensor>& ln_bias, double p, bool train,
                               double eps) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("ls_fairseq::bias_dropout_residual_layer_norm_fwd", "")
                         .typed<BdrLnSig>();
    Tensor x, h, mean, rstd, rng;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(x, h, mean, rstd, rng) = op.call(y, bias, residual, weight, ln_bias, p, train, eps);
    }
    ctx->mark_non_differentiable({mean, rstd, rng});
    ctx->set_materialize_grads(false);
    const Tensor w = weight.value_or(Tensor()), lb = ln_bias.value_or(Tensor());
    ctx->save_for_backward({x, w, lb, mean, rstd, rng});
    // gradient slots are numbered over the tensor arguments that are present
    int64_t slot = 1;
    const bool has_bias = bias.has_value() && bias->defined();
    ctx->saved_data["bias_slot"] = has_bias ? slot++ : int64_t(-1);
    ctx->saved_data["res_slot"] = slot++;
    ctx->saved_data["w_slot"] = w.defined() ? slot++ : int64_t(-1);
    ctx->saved_data["lb_slot"] = lb.defined() ? slot++ : int64_t(-1);
    ctx->saved_data["bias_shape"] = has_bias ? bias->sizes().vec() : std::vector<int64_t>{};
    ctx->saved_data["p"] = p;
    ctx->saved_data["train"] = train;
    return {x, h, mean, rstd, rng};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto ln_bwd = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("ls_fairseq::layer_norm_bwd", "")
                             .typed<BwdSig>();
    static auto fused_bwd =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("ls_fairseq::bias_dropout_residual_layer_norm_bwd", "")
            .typed<std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
                const Tensor&, const Tensor&, const std::optional<Tensor>&,
                const std::optional<Tensor>&, const Tensor&, const Tensor&,
                const std::optional<Tensor>&, const Tensor&, double, bool, bool, bool, bool)>();
    static auto bdr_bwd = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("ls_fairseq::bias_dropout_residual_bwd", "")
                              .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&,
                                                                double, bool, bool)>();
    const Tensor& grad_x = grads[0];
    const Tensor& grad_h = grads[1];
    variable_list none(8);
    if (!grad_x.defined() && !grad_h.defined()) return none;
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1], &lb = saved[2];
    auto needs = [&](const char* key) {
      const int64_t s = ctx->saved_data[key].toInt();
      return s >= 0 && ctx->needs_input_grad(s);
    };
    const bool need_y = ctx->needs_input_grad(0), need_bias = needs("bias_slot");
    const bool need_res = needs("res_slot"), need_w = needs("w_slot"), need_lb = needs("lb_slot");
    const double p = ctx->saved_data["p"].toDouble();
    const bool train = ctx->saved_data["train"].toBool();
    const bool dropout = train && p > 0;
    Tensor dx = grad_x, dw, dlb, gy, gbias;
    if (grad_h.defined() && dropout && (need_y || need_bias)) {
      // one pass: LayerNorm's backward also writes y's gradient and its bias sums
      std::tie(dx, gy, dw, dlb, gbias) =
          fused_bwd.call(grad_h, x, present(w), present(lb), saved[3], saved[4], present(grad_x),
                         saved[5], p, train, need_w, need_lb, need_bias);
    } else {
      if (grad_h.defined()) {
        std::tie(dx, dw, dlb) = ln_bwd.call(grad_h, x, present(w), present(lb), present(saved[3]),
                                            saved[4], false, need_w, need_lb, present(grad_x));
      }
      if (dropout && (need_y || need_bias)) {
        std::tie(gy, gbias) = bdr_bwd.call(dx, saved[5], p, train, need_bias);
      } else {  // no dropout: d/dy is the identity
        gy = dx;
        if (need_bias) gbias = dx.reshape({-1, dx.size(-1)}).sum(0);
      }
    }
    if (need_bias) gbias = gbias.view(ctx->saved_data["bias_shape"].toIntVector());
    return {need_y ? gy : Tensor(),
            need_bias ? gbias : Tensor(),
            need_res ? dx : Tensor(),
            need_w && grad_h.defined() ? dw.view_as(w) : Tensor(),
            need_lb && grad_h.defined() ? dlb.view_as(lb) : Tensor(),
            Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bdr_layer_norm_fwd_autograd(
    const Tensor& y, const std::optional<Tensor>& bias, const Tensor& residual,
    const std::optional<Tensor>& weight, const std::optional<Tensor>& ln_bias, double p,
    bool train, double eps) {
  auto out = BiasDropoutResidualLayerNormFunction::apply(y, bias, residual, weight, ln_bias, p,
                                                         train, eps);
  return {out[0], out[1], out[2], out[3], out[4]};
}

}  // namespace

TORCH_LIBRARY_IMPL(ls_fairseq, Autograd, m) {
  m.impl("bias_dropout_residual_layer_norm_fwd", &bdr_layer_norm_fwd_autograd);
}
