// Autograd of ls_fairseq::layer_norm_fwd and ls_fairseq::layer_norm_residual (csrc/layer_norm.cu),
// in C++ (the fused sublayer boundary's is csrc/bias_dropout_residual_layer_norm_autograd.cpp).
//
// Why C++: a Python autograd registration (torch.library.register_autograd) costs ~50 us of host
// time per call more than a C++ one on the H100 machine's host, and an eager training step of
// transformer big calls the fused elementwise ops ~74 times (measured on an H100).
// The eager step is host-bound, so that time is the step's.
//
// layer_norm_fwd: layer_norm_bwd gives (dx, dw, db); the weight and bias gradients are computed
// only when asked for; `invertible` saves the output y instead of the input x.
//
// layer_norm_residual(x, w, b, eps) -> (LayerNorm(x), x), for pre-LN blocks whose residual branch
// also reads x. The second output is x itself: autograd::Function returns an input as a view of it
// whose grad_fn is this node, so both gradients of x arrive in one backward and the residual's is
// added inside layer_norm_bwd (its residual_grad) instead of by the engine's separate add.
// Registered as CompositeImplicitAutograd, not Autograd: no backend kernel returns an alias of its
// input, inference mode (which skips the Autograd key) runs the same code, and FakeTensorMode /
// AOTAutograd decompose it into layer_norm_fwd/layer_norm_bwd, whose fakes exist.
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

using FwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const std::optional<Tensor>&,
                                                  const std::optional<Tensor>&, double, bool);
using BwdSig = std::tuple<Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const std::optional<Tensor>&, const std::optional<Tensor>&,
    const std::optional<Tensor>&, const Tensor&, bool, bool, bool, const std::optional<Tensor>&);

std::optional<Tensor> present(const Tensor& t) {
  return t.defined() ? std::optional<Tensor>(t) : std::nullopt;
}

struct LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x,
                               const std::optional<Tensor>& weight,
                               const std::optional<Tensor>& bias, double eps, bool invertible) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("ls_fairseq::layer_norm_fwd", "")
                         .typed<FwdSig>();
    Tensor y, mean, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(y, mean, rstd) = op.call(x, weight, bias, eps, invertible);
    }
    ctx->mark_non_differentiable({mean, rstd});
    ctx->set_materialize_grads(false);  // mean/rstd never carry a gradient: no zero tensors
    const Tensor w = weight.value_or(Tensor()), b = bias.value_or(Tensor());
    ctx->save_for_backward({invertible ? y : x, w, b, invertible ? Tensor() : mean, rstd});
    // autograd numbers the gradient slots over the tensor arguments that are present
    ctx->saved_data["w_slot"] = w.defined() ? int64_t(1) : int64_t(-1);
    ctx->saved_data["b_slot"] = b.defined() ? int64_t(w.defined() ? 2 : 1) : int64_t(-1);
    ctx->saved_data["invertible"] = invertible;
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("ls_fairseq::layer_norm_bwd", "")
                         .typed<BwdSig>();
    const Tensor& grad_y = grads[0];
    if (!grad_y.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const auto saved = ctx->get_saved_variables();
    const Tensor &w = saved[1], &b = saved[2];
    const int64_t w_slot = ctx->saved_data["w_slot"].toInt();
    const int64_t b_slot = ctx->saved_data["b_slot"].toInt();
    const bool need_x = ctx->needs_input_grad(0);
    const bool need_w = w_slot >= 0 && ctx->needs_input_grad(w_slot);
    const bool need_b = b_slot >= 0 && ctx->needs_input_grad(b_slot);
    auto [dx, dw, db] = op.call(grad_y, saved[0], present(w), present(b), present(saved[3]),
                                saved[4], ctx->saved_data["invertible"].toBool(), need_w, need_b,
                                std::nullopt);
    return {need_x ? dx : Tensor(), need_w ? dw.view_as(w) : Tensor(),
            need_b ? db.view_as(b) : Tensor(), Tensor(), Tensor()};
  }
};

struct LayerNormResidualFunction : public torch::autograd::Function<LayerNormResidualFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x,
                               const std::optional<Tensor>& weight,
                               const std::optional<Tensor>& bias, double eps) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("ls_fairseq::layer_norm_fwd", "")
                         .typed<FwdSig>();
    Tensor y, mean, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;  // not layer_norm_fwd's own autograd
      std::tie(y, mean, rstd) = op.call(x, weight, bias, eps, false);
    }
    ctx->set_materialize_grads(false);  // either output may go unused: no zero tensors
    const Tensor w = weight.value_or(Tensor()), b = bias.value_or(Tensor());
    ctx->save_for_backward({x, w, b, mean, rstd});
    ctx->saved_data["w_slot"] = w.defined() ? int64_t(1) : int64_t(-1);
    ctx->saved_data["b_slot"] = b.defined() ? int64_t(w.defined() ? 2 : 1) : int64_t(-1);
    return {y, x};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("ls_fairseq::layer_norm_bwd", "")
                         .typed<BwdSig>();
    const Tensor &grad_y = grads[0], &grad_residual = grads[1];
    const bool need_x = ctx->needs_input_grad(0);
    if (!grad_y.defined()) return {need_x ? grad_residual : Tensor(), Tensor(), Tensor(), Tensor()};
    const auto saved = ctx->get_saved_variables();
    const Tensor &w = saved[1], &b = saved[2];
    const int64_t w_slot = ctx->saved_data["w_slot"].toInt();
    const int64_t b_slot = ctx->saved_data["b_slot"].toInt();
    const bool need_w = w_slot >= 0 && ctx->needs_input_grad(w_slot);
    const bool need_b = b_slot >= 0 && ctx->needs_input_grad(b_slot);
    auto [dx, dw, db] = op.call(grad_y, saved[0], present(w), present(b), saved[3], saved[4],
                                false, need_w, need_b,
                                need_x ? present(grad_residual) : std::nullopt);
    return {need_x ? dx : Tensor(), need_w ? dw.view_as(w) : Tensor(),
            need_b ? db.view_as(b) : Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> layer_norm_fwd_autograd(const Tensor& x,
                                                           const std::optional<Tensor>& weight,
                                                           const std::optional<Tensor>& bias,
                                                           double eps, bool invertible) {
  auto out = LayerNormFunction::apply(x, weight, bias, eps, invertible);
  return {out[0], out[1], out[2]};
}

std::tuple<Tensor, Tensor> layer_norm_residual(const Tensor& x,
                                               const std::optional<Tensor>& weight,
                                               const std::optional<Tensor>& bias, double eps) {
  auto out = LayerNormResidualFunction::apply(x, weight, bias, eps);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(ls_fairseq, Autograd, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_autograd);
}

TORCH_LIBRARY_IMPL(ls_fairseq, CompositeImplicitAutograd, m) {
  m.impl("layer_norm_residual", &layer_norm_residual);
}
