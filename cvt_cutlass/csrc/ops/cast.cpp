// cast_params(Tensor[] tensors, ScalarType dtype) -> Tensor[]: many parameters of one dtype cast
// to another with two kernels (concatenate, convert) instead of one per tensor; the results are
// views of one buffer. Its backward casts the gradients back the same way (a missing gradient is
// zeros). The training forward casts a stage's parameters with it once per step
// (cvt_cutlass/params.py, Caster); the loop over the tensors runs here, not in Python.
#pragma once
#include "../plans.h"

namespace cvt {

constexpr const char* kCastArgs = "(Tensor[] tensors, ScalarType dtype)";

// The tensors flattened into one buffer of `dtype`, returned as views shaped like them.
inline std::vector<at::Tensor> flat_cast(at::TensorList ts, at::ScalarType dtype) {
  if (ts.empty()) return {};
  std::vector<at::Tensor> flat;
  std::vector<int64_t> sizes;
  flat.reserve(ts.size());
  sizes.reserve(ts.size());
  for (const at::Tensor& t : ts) {
    flat.push_back(t.reshape({-1}));
    sizes.push_back(t.numel());
  }
  const at::Tensor buf = at::cat(flat).to(dtype);
  std::vector<at::Tensor> out = buf.split_with_sizes(sizes);
  for (size_t i = 0; i < out.size(); ++i) out[i] = out[i].view(ts[i].sizes());
  return out;
}

inline std::vector<at::Tensor> cast_params_any(at::TensorList ts, at::ScalarType dtype) {
  for (const at::Tensor& t : ts)
    TORCH_CHECK_VALUE(t.scalar_type() == ts[0].scalar_type() && t.device() == ts[0].device(),
                      "cvt_cutlass.cast_params: every tensor must share the first one's dtype and device");
  return flat_cast(ts, dtype);
}

using CastSig = std::vector<at::Tensor>(at::TensorList, at::ScalarType);

struct CastFn : torch::autograd::Function<CastFn> {
  static variable_list forward(AutogradContext* ctx, at::TensorList ts, at::ScalarType dtype) {
    static auto op = public_op<CastSig>("cvt_cutlass::cast_params");
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->saved_data["src"] = static_cast<int64_t>(ts.empty() ? at::kFloat : ts[0].scalar_type());
    ctx->saved_data["shapes"] = shapes_of(ts);
    ctx->set_materialize_grads(false);  // a gradient that never came is zeros, made here once
    return op.call(ts, dtype);
  }

  // The tensors' shapes as one flat list: rank, then the sizes, per tensor.
  static std::vector<int64_t> shapes_of(at::TensorList ts) {
    std::vector<int64_t> v;
    for (const at::Tensor& t : ts) {
      v.push_back(t.dim());
      for (int64_t s : t.sizes()) v.push_back(s);
    }
    return v;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = public_op<CastSig>("cvt_cutlass::cast_params");
    const auto shapes = ctx->saved_data["shapes"].toIntVector();
    const auto src = static_cast<at::ScalarType>(ctx->saved_data["src"].toInt());
    at::Tensor like;
    for (const at::Tensor& g : grads)
      if (g.defined()) like = g;
    variable_list out(grads.size() + 1);  // per input of apply: each tensor, then dtype
    if (!like.defined()) return out;
    std::vector<at::Tensor> gs(grads.size());
    size_t k = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      const int64_t rank = shapes[k];
      at::IntArrayRef sizes(shapes.data() + k + 1, static_cast<size_t>(rank));
      k += 1 + rank;
      gs[i] = grads[i].defined() ? grads[i] : at::zeros(sizes, like.options());
    }
    auto back = op.call(gs, src);
    for (size_t i = 0; i < back.size(); ++i) out[i] = std::move(back[i]);
    return out;
  }
};

inline std::vector<at::Tensor> cast_params_autograd(at::TensorList ts, at::ScalarType dtype) {
  bool grad = false;
  for (const at::Tensor& t : ts) grad = grad || t.requires_grad();
  if (grad && at::GradMode::is_enabled()) return CastFn::apply(ts, dtype);
  static auto op = public_op<CastSig>("cvt_cutlass::cast_params");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(ts, dtype);
}

inline void register_cast(torch::Library& pub) {
  define_public(pub, {{"cast_params", kCastArgs, "Tensor[]", "", false}});
  pub.impl("cast_params", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &cast_params_any));
  pub.impl("cast_params", torch::dispatch(c10::DispatchKey::Autograd, &cast_params_autograd));
}

inline void register_cast_private(torch::Library&) {}

}  // namespace cvt
