// cast_params(Tensor[] tensors, ScalarType dtype, int[] groups=[]) -> Tensor[]: many parameters of
// one dtype cast to another with one multi-tensor copy into one buffer (contiguous tensors; else
// two kernels: concatenate, convert) instead of one kernel per tensor; the results are views of
// that buffer. groups (default: one per tensor) splits the tensors, in order,
// into consecutive groups, one result each: a group of one tensor is its view in its shape, a
// larger group one 1-D view of its tensors' concatenation (a CvT layer's 16 weights, which the
// layer op takes as one buffer: csrc/ops/layer.cpp). The training forward casts a stage's
// parameters with it once per step (cvt_cutlass/params.py, Caster); the loop over the tensors runs
// here, not in Python.
// depthwise_rsc_params(Tensor[] weights) -> Tensor[]: depthwise conv weights (C, 1, 3, 3) of one
// shape and dtype in the depthwise kernels' (3, 3, C) layout, fp32 (fp64 stays fp64), likewise
// stacked in one buffer each way.
//
// The op is CompositeImplicitAutograd: two autograd nodes, whatever the number of tensors.
// FlatCastFn converts into one fresh buffer (its backward: the buffer's gradient
// converted back and split into the tensors' shapes); SplitViewsFn returns the views (its
// backward: the views' gradients concatenated, a missing one zeros). Under torch.compile the op
// decomposes into those aten ops, so functionalization sees the views as views (an opaque op may
// not return outputs that alias each other).
#pragma once
#include <algorithm>

#include "../plans.h"

namespace cvt {

constexpr const char* kCastArgs = "(Tensor[] tensors, ScalarType dtype, int[] groups=[])";

// The tensors' shapes as one flat list: rank, then the sizes, per tensor.
inline std::vector<int64_t> shapes_of(at::TensorList ts) {
  std::vector<int64_t> v;
  for (const at::Tensor& t : ts) {
    v.push_back(t.dim());
    for (int64_t s : t.sizes()) v.push_back(s);
  }
  return v;
}

// t in `dtype`: t itself when it is already (no aten::to call that would return its input).
inline at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

// The element counts of the tensors in a shapes_of list.
inline std::vector<int64_t> numels_of(at::IntArrayRef shapes) {
  std::vector<int64_t> n;
  for (size_t k = 0; k < shapes.size(); k += 1 + shapes[k])
    n.push_back(c10::multiply_integers(shapes.slice(k + 1, static_cast<size_t>(shapes[k]))));
  return n;
}

// tensors -> one fresh 1-D buffer of `dtype` holding them in order.
struct FlatCastFn : torch::autograd::Function<FlatCastFn> {
  static at::Tensor forward(AutogradContext* ctx, at::TensorList ts, at::ScalarType dtype,
                            const std::vector<int64_t>& shapes) {  // shapes_of(ts)
    ctx->saved_data["src"] = static_cast<int64_t>(ts[0].scalar_type());
    ctx->saved_data["shapes"] = shapes;
    ctx->saved_data["n"] = static_cast<int64_t>(ts.size());
    ctx->set_materialize_grads(false);  // no gradient came: none goes back (not zeros)
    at::AutoDispatchBelowADInplaceOrView below;
    if (std::all_of(ts.begin(), ts.end(), [](const at::Tensor& t) { return t.is_contiguous(); })) {
      // one pass: each tensor converted straight into its place (a multi-tensor copy, a few
      // launches), not concatenated in its own dtype first and converted after
      int64_t total = 0;
      for (int64_t n : numels_of(shapes)) total += n;
      at::Tensor out = at::empty({total}, ts[0].options().dtype(dtype));
      at::_foreach_copy_(views_of(out, shapes), ts);
      return out;
    }
    std::vector<at::Tensor> flat;
    flat.reserve(ts.size());
    for (const at::Tensor& t : ts) flat.push_back(t.reshape({-1}));
    return as_dtype(at::cat(flat), dtype);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto shapes = ctx->saved_data["shapes"].toIntVector();
    const auto src = static_cast<at::ScalarType>(ctx->saved_data["src"].toInt());
    if (!grads[0].defined()) return variable_list(ctx->saved_data["n"].toInt() + 2);
    variable_list out = views_of(as_dtype(grads[0], src), shapes);
    out.emplace_back();  // dtype
    out.emplace_back();  // shapes
    return out;
  }
};

// A 1-D buffer -> its views shaped by `shapes`.
struct SplitViewsFn : torch::autograd::Function<SplitViewsFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& flat, std::vector<int64_t> shapes) {
    ctx->saved_data["shapes"] = shapes;
    ctx->set_materialize_grads(false);  // a gradient that never came is zeros, made here once
    return views_of(flat, shapes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto shapes = ctx->saved_data["shapes"].toIntVector();
    at::Tensor like;
    for (const at::Tensor& g : grads)
      if (g.defined()) like = g;
    if (!like.defined()) return {at::Tensor(), at::Tensor()};
    const std::vector<int64_t> numels = numels_of(shapes);
    std::vector<at::Tensor> flat(grads.size());
    for (size_t i = 0; i < grads.size(); ++i)
      flat[i] = grads[i].defined() ? grads[i].reshape({-1}) : at::zeros({numels[i]}, like.options());
    return {at::cat(flat), at::Tensor()};
  }
};

// (C, 1, 3, 3) weights -> one fresh 1-D buffer holding each one's (3, 3, C) transpose, in fp32
// (fp64 as it is); the backward transposes the gradients back into the weights' dtype.
struct RscStackFn : torch::autograd::Function<RscStackFn> {
  static at::Tensor forward(AutogradContext* ctx, at::TensorList ws) {
    const int64_t c = ws[0].size(0);
    ctx->saved_data["src"] = static_cast<int64_t>(ws[0].scalar_type());
    ctx->saved_data["c"] = c;
    ctx->saved_data["n"] = static_cast<int64_t>(ws.size());
    ctx->set_materialize_grads(false);
    std::vector<at::Tensor> t;
    t.reserve(ws.size());
    for (const at::Tensor& w : ws) t.push_back(w.view({c, 9}).t());
    at::AutoDispatchBelowADInplaceOrView below;
    const auto wide = at::promote_types(ws[0].scalar_type(), at::kFloat);
    return as_dtype(at::stack(t), wide).view({-1});  // (n, 9, C) contiguous
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t c = ctx->saved_data["c"].toInt(), n = ctx->saved_data["n"].toInt();
    if (!grads[0].defined()) return variable_list(n);
    const auto src = static_cast<at::ScalarType>(ctx->saved_data["src"].toInt());
    // (n, C, 9): transposed and converted by one copy into a contiguous buffer, so that each
    // weight's gradient has the weight's strides and AccumulateGrad takes it without a clone
    const at::Tensor back =
        at::empty({n, c, 9}, grads[0].options().dtype(src)).copy_(grads[0].view({n, 9, c}).transpose(1, 2));
    variable_list out;
    for (int64_t i = 0; i < n; ++i) out.push_back(back[i].view({c, 1, 3, 3}));
    return out;
  }
};

inline std::vector<at::Tensor> depthwise_rsc_params(at::TensorList ws) {
  if (ws.empty()) return {};
  for (const at::Tensor& w : ws)
    TORCH_CHECK_VALUE(w.dim() == 4 && w.sizes() == ws[0].sizes() && w.size(1) == 1 && w.size(2) == 3 &&
                          w.size(3) == 3 && w.is_contiguous() && w.scalar_type() == ws[0].scalar_type() &&
                          w.device() == ws[0].device(),
                      "cvt_cutlass.depthwise_rsc_params: contiguous (C, 1, 3, 3) weights of one shape, dtype and "
                      "device expected, got " + dims(w.sizes()));
  const int64_t c = ws[0].size(0);
  std::vector<int64_t> shapes;
  for (size_t i = 0; i < ws.size(); ++i) shapes.insert(shapes.end(), {3, 3, 3, c});
  return SplitViewsFn::apply(RscStackFn::apply(ws), shapes);
}

// The results' shapes (shapes_of's form) of cast_params' groups of `ts` (groups not empty).
inline std::vector<int64_t> group_shapes(at::TensorList ts, at::IntArrayRef groups) {
  int64_t total = 0;
  for (int64_t g : groups) {
    TORCH_CHECK_VALUE(g > 0, "cvt_cutlass.cast_params: groups must be positive, got " + dims(groups));
    total += g;
  }
  TORCH_CHECK_VALUE(total == static_cast<int64_t>(ts.size()),
                    "cvt_cutlass.cast_params: groups " + dims(groups) + " do not add up to the " +
                        std::to_string(ts.size()) + " tensors");
  std::vector<int64_t> v;
  size_t i = 0;
  for (int64_t g : groups) {
    if (g == 1) {
      v.push_back(ts[i].dim());
      for (int64_t s : ts[i].sizes()) v.push_back(s);
    } else {
      int64_t n = 0;
      for (int64_t k = 0; k < g; ++k) n += ts[i + k].numel();
      v.insert(v.end(), {1, n});
    }
    i += static_cast<size_t>(g);
  }
  return v;
}

inline std::vector<at::Tensor> cast_params(at::TensorList ts, at::ScalarType dtype, at::IntArrayRef groups) {
  if (ts.empty()) {
    TORCH_CHECK_VALUE(groups.empty(), "cvt_cutlass.cast_params: groups " + dims(groups) + " for no tensors");
    return {};
  }
  for (const at::Tensor& t : ts)
    TORCH_CHECK_VALUE(t.scalar_type() == ts[0].scalar_type() && t.device() == ts[0].device(),
                      "cvt_cutlass.cast_params: every tensor must share the first one's dtype and device");
  const std::vector<int64_t> shapes = shapes_of(ts);
  const std::vector<int64_t> out_shapes = groups.empty() ? shapes : group_shapes(ts, groups);  // checked first
  return SplitViewsFn::apply(FlatCastFn::apply(ts, dtype, shapes), out_shapes);
}

inline void register_cast(torch::Library& pub) {
  define_public(pub, {{"cast_params", kCastArgs, "Tensor[]", "", false},
                      {"depthwise_rsc_params", "(Tensor[] weights)", "Tensor[]", "", false}});
  pub.impl("cast_params", torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd, &cast_params));
  pub.impl("depthwise_rsc_params", torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd, &depthwise_rsc_params));
}

inline void register_cast_private(torch::Library&) {}

}  // namespace cvt
