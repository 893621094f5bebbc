// Autograd of ls_fairseq::layer_norm_fwd (csrc/layer_norm.cu), in C++ (the fused sublayer
// boundary's is csrc/bias_dropout_residual_layer_norm_autograd.cpp).
//
// Why C++: a Python autograd registration (torch.library.register_autograd) costs ~50 us of host
// time per call more than a C++ one on the H100 machine's host, and an eager training step of
// transformer big calls the fused elementwise ops ~74 times (measured on an H100).
// The eager step is host-bound, so that time is the step's.
//
// Same formulas as before: layer_norm_bwd gives (dx, dw, db); the weight and bias gradients are
// computed only when asked for; `invertible` saves the output y instead of the input x.
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

std::tuple<Tensor, Tensor, Tensor> layer_norm_fwd_autograd(const Tensor& x,
                                                           const std::optional<Tensor>& weight,
                                                           const std::optional<Tensor>& bias,
                                                           double eps, bool invertible) {
  auto out = LayerNormFunction::apply(x, weight, bias, eps, invertible);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(ls_fairseq, Autograd, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_autograd);
}
