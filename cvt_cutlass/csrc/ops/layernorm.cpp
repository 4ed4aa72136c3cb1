// LayerNorm on tokens: torch.ops.cvt_cutlass.layer_norm_tokens (Python side:
// cvt_cutlass/ops/layernorm.py), and the raw launch by kernel id (tests).
//
// x (B, L, C) with unit stride along C (rows and images may be strided); weight, bias (C,)
// contiguous; y (B, P + L, C) new and contiguous, in out_dtype (default: the weight's): the P
// prefix rows of every image (CvT's cls token; (P, C) contiguous in y's dtype), then LayerNorm(x)
// with fp32 statistics. x and y take the weight's dtype, or one of them fp32 (an fp32 residual
// stream: ops/layernorm.py).
#pragma once
#include "../plans.h"

namespace cvt {

constexpr const char* kLayerNormArgs =
    "(Tensor x, Tensor weight, Tensor bias, float eps, Tensor? prefix=None, ScalarType? out_dtype=None)";
using OptDtype = std::optional<at::ScalarType>;

inline cvt_norm_args norm_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                               const std::optional<at::Tensor>& prefix, const at::Tensor& y,
                               const std::optional<at::Tensor>& stats, double eps) {
  cvt_norm_args p{};
  const int64_t bsz = x.size(0), rows = x.size(1), pre = prefix ? prefix->size(0) : 0;
  p.images = bsz; p.rows = rows; p.c = x.size(2);
  p.x = x.data_ptr(); p.x_row_stride = x.stride(1); p.x_image_stride = bsz > 1 ? x.stride(0) : rows * x.stride(1);
  p.weight = w.data_ptr(); p.bias = b.data_ptr();
  p.prefix = prefix ? prefix->data_ptr() : nullptr; p.prefix_rows = pre;
  p.y = ptr_of(y); p.y_row_stride = y.stride(1); p.y_image_stride = bsz > 1 ? y.stride(0) : (pre + rows) * y.stride(1);
  p.stats = stats ? stats->data_ptr() : nullptr;
  p.eps = static_cast<float>(eps);
  p.device_id = x.device().index();
  return p;
}

inline std::string norm_what(const cvt_norm_args& p) {
  return "x [" + std::to_string(p.images) + ", " + std::to_string(p.rows) + ", " + std::to_string(p.c) +
         "] (row stride " + std::to_string(p.x_row_stride) + ", image stride " + std::to_string(p.x_image_stride) +
         ") with " + std::to_string(p.prefix_rows) + " prefix row(s)";
}

using NormPlan = ShapedPlan<cvt_norm_args>;  // the forward takes no workspace
inline PlanCache<NormPlan> g_norm_plans;
inline auto& g_norm_plans_registered = register_cache(g_norm_plans);

inline std::shared_ptr<const NormPlan> make_norm_plan(Key key, const at::Tensor& x, const at::Tensor& w,
                                                      const at::Tensor& b, double eps,
                                                      const std::optional<at::Tensor>& prefix, OptDtype out_dtype) {
  static auto planner = python_op<std::tuple<int64_t, int64_t>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                               double, const std::optional<at::Tensor>&, OptDtype)>(
      "cvt_cutlass_C::layer_norm_tokens_plan");
  auto plan = std::make_shared<NormPlan>();
  std::tie(plan->code, plan->source) = planner.call(x, w, b, eps, prefix, out_dtype);
  plan->out_sizes = {x.size(0), (prefix ? prefix->size(0) : 0) + x.size(1), x.size(2)};
  if (plan->code >= 0) {
    const Kernel& kern = kernel_of_family(plan->code, {CVT_FAMILY_LAYERNORM}, "a LayerNorm");
    plan->args = norm_args(x, w, b, prefix, meta_like(plan->out_sizes, x), std::nullopt, eps);
    for (const void** p : {&plan->args.x, &plan->args.weight, &plan->args.bias, &plan->args.prefix}) plan_pointer(*p);
    plan_pointer(plan->args.y);
    check_can_implement(kern.can_implement(plan->args), kern, [&] { return norm_what(plan->args); });
    TORCH_CHECK(kern.workspace_size(plan->args) == 0, "cvt_cutlass: LayerNorm kernels take no workspace");
    plan->kernel = &kern;
  }
  return g_norm_plans.insert(std::move(key), std::move(plan));
}

inline at::Tensor layer_norm_tokens_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps,
                                         const std::optional<at::Tensor>& prefix, OptDtype out_dtype) {
  const at::ScalarType out_type = out_dtype ? *out_dtype : w.scalar_type();
  Key key(kLayerNorm);
  key.add(x); key.add(w); key.add(b); key.add(prefix); key.add(static_cast<int64_t>(out_type));
  auto plan = g_norm_plans.find(key);
  if (!plan) plan = make_norm_plan(std::move(key), x, w, b, eps, prefix, out_dtype);
  TORCH_CHECK_VALUE(eps > 0, "cvt_cutlass.layer_norm_tokens: eps must be > 0, got " + std::to_string(eps));
  if (plan->code != kPlanFallback && aligned16(x) && aligned16(w) && aligned16(b) && aligned16(prefix)) {
    const OnDevice on(x);
    at::Tensor out = on.empty(plan->out_sizes, out_type);
    if (plan->code == kPlanEmpty) {  // nothing to normalise: at most the prefix rows
      if (prefix && out.numel()) out.copy_(prefix->unsqueeze(0).expand({x.size(0), -1, -1}));
      return out;
    }
    cvt_norm_args p = plan->args;
    p.x = x.data_ptr(); p.weight = w.data_ptr(); p.bias = b.data_ptr();
    p.prefix = prefix ? prefix->data_ptr() : nullptr;
    p.y = out.data_ptr();
    p.eps = static_cast<float>(eps);
    check_launch(launch(*plan->kernel, p, 0, on), *plan->kernel, [&] { return norm_what(p); });
    count_call(kLayerNorm, plan->source);
    return out;
  }
  static auto fallback = python_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                              const std::optional<at::Tensor>&, OptDtype)>(
      "cvt_cutlass_C::layer_norm_tokens_fallback");
  return fallback.call(x, w, b, eps, prefix, out_dtype);
}

// y = [prefix; LayerNorm(x)] with a given kernel (tests), every check on every call; stats, if
// given, a contiguous float (B, L, 2) that receives (mean, rstd) per row.
inline void layer_norm_raw(int64_t id, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                           const std::optional<at::Tensor>& prefix, const at::Tensor& y,
                           const std::optional<at::Tensor>& stats, double eps) {
  const Kernel& k = kernel_of_family(id, {CVT_FAMILY_LAYERNORM}, "a LayerNorm");
  TORCH_CHECK(x.dim() == 3 && y.dim() == 3 && x.stride(2) == 1 && y.stride(2) == 1,
              "cvt_cutlass: x and y must be (B, L, C) with unit stride along C, got x " + dims(x.sizes()) + ", y " +
                  dims(y.sizes()));
  const int64_t bsz = x.size(0), rows = x.size(1), c = x.size(2), pre = prefix ? prefix->size(0) : 0;
  TORCH_CHECK(y.size(0) == bsz && y.size(1) == pre + rows && y.size(2) == c,
              "cvt_cutlass: y must be (B, P + L, C) = [" + std::to_string(bsz) + ", " + std::to_string(pre + rows) +
                  ", " + std::to_string(c) + "], got " + dims(y.sizes()));
  for (const at::Tensor* t : {&w, &b, &y})
    TORCH_CHECK(t->device() == x.device() && t->scalar_type() == x.scalar_type(),
                "cvt_cutlass: " + k.name + ": weight, bias, prefix and y must share x's device and dtype");
  TORCH_CHECK(w.dim() == 1 && b.dim() == 1 && w.size(0) == c && b.size(0) == c && w.is_contiguous() && b.is_contiguous(),
              "cvt_cutlass: weight and bias must be contiguous (C,) vectors");
  if (prefix)
    TORCH_CHECK(prefix->dim() == 2 && prefix->size(1) == c && prefix->is_contiguous() &&
                    prefix->device() == x.device() && prefix->scalar_type() == x.scalar_type(),
                "cvt_cutlass: prefix must be a contiguous (P, C) tensor like x");
  if (stats)
    TORCH_CHECK(stats->dim() == 3 && stats->size(0) == bsz && stats->size(1) == rows && stats->size(2) == 2 &&
                    stats->is_contiguous() && stats->scalar_type() == at::kFloat && stats->device() == x.device(),
                "cvt_cutlass: stats must be a contiguous float (B, L, 2) tensor on x's device");
  cvt_norm_args p = norm_args(x, w, b, prefix, y, stats, eps);
  check_can_implement(k.can_implement(p), k, [&] { return norm_what(p); });
  check_launch(launch(k, p, 0, OnDevice(x)), k, [&] { return norm_what(p); });
}

// ------------------------------------------------------------------------------------ backward
// layer_norm_tokens_backward(grad, x, weight, eps, residual_grad=None, grad2=None, grad3=None) ->
// (dx, dweight, dbias): grad and x (B, L, C) with unit stride along C (grad may be a view that
// skips prefix rows), dx (B, L, C) contiguous; residual_grad, a contiguous (B, L, C) gradient of x
// from another branch (a residual connection), is added to dx in the kernel (fp32, one rounding);
// dx takes x's dtype, dweight / dbias the weight's (x fp32 with a 16-bit weight, or grad fp32 with
// 16-bit x: an fp32 residual stream, ops/layernorm.py);
// grad2 / grad3, contiguous (B, L, C) further gradients of the output (it feeds several ops), are
// summed with grad in fp32 as the kernel loads them.
constexpr const char* kLayerNormBwdArgs =
    "(Tensor grad, Tensor x, Tensor weight, float eps, Tensor? residual_grad=None, Tensor? grad2=None, "
    "Tensor? grad3=None)";

// The op family's public ops and their private planner / fallback ops (plans.h: OpSchema).
inline std::vector<OpSchema> layernorm_schemas() {
  return {{"layer_norm_tokens", kLayerNormArgs, "Tensor"},
          {"layer_norm_tokens_backward", kLayerNormBwdArgs, "(Tensor, Tensor, Tensor)"}};
}

using NormBwdPlan = KernelPlan<cvt_normbwd_args>;
inline PlanCache<NormBwdPlan> g_norm_bwd_plans;
inline auto& g_norm_bwd_plans_registered = register_cache(g_norm_bwd_plans);

inline int64_t image_stride(const at::Tensor& t) { return t.size(0) > 1 ? t.stride(0) : t.size(1) * t.stride(1); }

using NormBwdPlanSig = std::tuple<int64_t, int64_t>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                                    const OptT&, const OptT&, const OptT&);
inline std::shared_ptr<const NormBwdPlan> make_norm_bwd_plan(Key key, const at::Tensor& g, const at::Tensor& x,
                                                             const at::Tensor& w, double eps, const OptT& res,
                                                             const OptT& g2, const OptT& g3) {
  static auto planner = python_op<NormBwdPlanSig>("cvt_cutlass_C::layer_norm_tokens_backward_plan");
  auto plan = std::make_shared<NormBwdPlan>();
  std::tie(plan->code, plan->source) = planner.call(g, x, w, eps, res, g2, g3);
  if (plan->code >= 0) {
    const Kernel& kern = kernel_of_family(plan->code, {CVT_FAMILY_LAYERNORM_BWD}, "a LayerNorm backward");
    cvt_normbwd_args& p = plan->args;
    p.images = x.size(0); p.rows = x.size(1); p.c = x.size(2);
    p.x = kPlanPointer; p.x_row_stride = x.stride(1); p.x_image_stride = image_stride(x);
    p.dy = kPlanPointer; p.dy_row_stride = g.stride(1); p.dy_image_stride = image_stride(g);
    p.weight = kPlanPointer; p.dx = kPlanPointer; p.dweight = kPlanPointer; p.dbias = kPlanPointer;
    p.dres = res ? kPlanPointer : nullptr;
    p.dres_scale = nullptr;
    p.dx_branch = nullptr;
    p.dx_branch_scale = nullptr;
    p.dy_more[0] = g2 ? kPlanPointer : nullptr;
    p.dy_more[1] = g3 ? kPlanPointer : nullptr;
    p.eps = static_cast<float>(eps);
    p.device_id = x.device().index();
    check_can_implement(kern.can_implement(p), kern, [&] { return "LayerNorm backward of x " + dims(x.sizes()); });
    plan->workspace = kern.workspace_size(p);
    plan->kernel = &kern;
  }
  return g_norm_bwd_plans.insert(std::move(key), std::move(plan));
}

// t (B, L, C) times per-row scales rs (B * L,): computed in rs's precision (fp32, fp64 for fp64 t),
// rounded once to dtype, contiguous (one launch): drop path's backward where no kernel pass applies
// it (here and in linear.cpp).
inline at::Tensor scaled_rows(const at::Tensor& t, const at::Tensor& rs, at::ScalarType dtype) {
  at::Tensor out = at::empty(t.sizes(), t.options().dtype(dtype));
  return at::mul_out(out, t, rs.view({t.size(0), t.size(1), 1}));
}
// res with its rows so scaled and kept in its dtype, or res as it is without a scale: what the
// kernel adds when given both, for the PyTorch paths.
inline OptT scaled_residual(const OptT& res, const OptT& scale) {
  return scale ? OptT(scaled_rows(*res, *scale, res->scalar_type())) : res;
}
// dx again in dtype, its rows multiplied by scale's factors first where given (one rounding; dx
// itself where neither changes it): a branch's 16-bit gradient, or the dY a weight gradient's GEMM
// reads where no kernel pass writes it (linear.cpp)
inline at::Tensor branch_grad(const at::Tensor& dx, const OptT& scale, at::ScalarType dtype) {
  return scale ? scaled_rows(dx, *scale, dtype) : dx.to(dtype);
}

// dw_to / db_to: where the weight and bias gradients go (plans.h: given), or new tensors;
// res_scale: a contiguous fp32 factor per row of res (B * L,) that res is multiplied by first;
// branch, when given, receives dx again in the weight's dtype, its rows multiplied by
// branch_scale's (B * L,) fp32 factors first where given (one rounding)
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_tokens_backward_into(
    const at::Tensor& g, const at::Tensor& x, const at::Tensor& w, double eps, const OptT& res, const OptT& g2,
    const OptT& g3, const OptT& dw_to, const OptT& db_to, const OptT& res_scale = std::nullopt,
    at::Tensor* branch = nullptr, const OptT& branch_scale = std::nullopt) {
  Key key(kLayerNormBackward);
  key.add(g); key.add(x); key.add(w); key.add(res); key.add(g2); key.add(g3);
  auto plan = g_norm_bwd_plans.find(key);
  if (!plan) plan = make_norm_bwd_plan(std::move(key), g, x, w, eps, res, g2, g3);
  TORCH_CHECK_VALUE(eps > 0, "cvt_cutlass.layer_norm_tokens_backward: eps must be > 0, got " + std::to_string(eps));
  TORCH_CHECK_VALUE(!res_scale || (res && res_scale->scalar_type() == at::kFloat && res_scale->is_contiguous() &&
                                   res_scale->numel() == x.size(0) * x.size(1) &&
                                   res_scale->device() == x.device()),
                    "cvt_cutlass.layer_norm_tokens_backward: res_scale must be a contiguous float (B * L,) tensor "
                    "on x's device beside a residual gradient");
  TORCH_CHECK_VALUE(!branch_scale || (branch && branch_scale->scalar_type() == at::kFloat &&
                                      branch_scale->is_contiguous() && branch_scale->device() == x.device() &&
                                      branch_scale->numel() == x.size(0) * x.size(1)),
                    "cvt_cutlass.layer_norm_tokens_backward: branch_scale must be a contiguous float (B * L,) "
                    "tensor on x's device beside a branch output");
  if (plan->code == kPlanFallback ||
      !(aligned16(g) && aligned16(x) && aligned16(w) && aligned16(res) && aligned16(g2) && aligned16(g3))) {
    static auto fallback = python_op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const at::Tensor&, double, const OptT&, const OptT&, const OptT&)>(
        "cvt_cutlass_C::layer_norm_tokens_backward_fallback");
    auto [dx, dw, db] = fallback.call(g, x, w, eps, scaled_residual(res, res_scale), g2, g3);
    if (branch) *branch = branch_grad(dx, branch_scale, w.scalar_type());
    return {dx, given(dw_to, dw), given(db_to, db)};
  }
  const OnDevice on(x);
  at::Tensor dx = on.empty(x.sizes(), x.scalar_type());
  at::Tensor dw = dw_to ? *dw_to : on.empty({x.size(2)}, w.scalar_type());
  at::Tensor db = db_to ? *db_to : on.empty({x.size(2)}, w.scalar_type());
  if (branch) *branch = on.empty(x.sizes(), w.scalar_type());
  if (plan->code == kPlanEmpty) return {dx, dw.zero_(), db.zero_()};
  cvt_normbwd_args p = plan->args;
  p.x = x.data_ptr(); p.dy = g.data_ptr(); p.weight = w.data_ptr();
  p.dx = dx.data_ptr(); p.dweight = dw.data_ptr(); p.dbias = db.data_ptr();
  p.dres = res ? res->data_ptr() : nullptr;
  p.dres_scale = res_scale ? res_scale->data_ptr<float>() : nullptr;
  p.dx_branch = branch ? branch->data_ptr() : nullptr;
  p.dx_branch_scale = branch_scale ? branch_scale->data_ptr<float>() : nullptr;
  p.dy_more[0] = g2 ? g2->data_ptr() : nullptr;
  p.dy_more[1] = g3 ? g3->data_ptr() : nullptr;
  p.eps = static_cast<float>(eps);  // per call, as the forward: eps is not part of the plan key
  check_launch(launch(*plan->kernel, p, plan->workspace, on), *plan->kernel,
               [&] { return "LayerNorm backward of x " + dims(x.sizes()); });
  count_call(kLayerNormBackward, plan->source);
  return {dx, dw, db};
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_tokens_backward_cuda(
    const at::Tensor& g, const at::Tensor& x, const at::Tensor& w, double eps, const OptT& res, const OptT& g2,
    const OptT& g3) {
  return layer_norm_tokens_backward_into(g, x, w, eps, res, g2, g3, std::nullopt, std::nullopt);
}

// ------------------------------------------------------------------------------------ autograd
using LayerNormSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                const std::optional<at::Tensor>&, OptDtype);
using LayerNormBwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                       const at::Tensor&, double, const OptT&,
                                                                       const OptT&, const OptT&);

// Saves x and weight (the backward recomputes the row statistics in registers); the prefix rows
// (cls) are copied, so their gradient is the output gradient's prefix rows summed over images.
struct LayerNormFn : torch::autograd::Function<LayerNormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                            double eps, const std::optional<at::Tensor>& prefix, OptDtype out_dtype) {
    static auto op = public_op<LayerNormSig>("cvt_cutlass::layer_norm_tokens");
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["pre"] = prefix ? prefix->sym_size(0) : c10::SymInt(0);
    ctx->save_for_backward({x, w});
    return op.call(x, w, b, eps, prefix, out_dtype);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = public_op<LayerNormBwdSig>("cvt_cutlass::layer_norm_tokens_backward");
    const auto saved = ctx->get_saved_variables();
    const c10::SymInt pre = ctx->saved_data["pre"].toSymInt();
    const at::Tensor& grad = grads[0];
    const bool has_prefix = pre != 0;
    at::Tensor g = has_prefix ? grad.slice_symint(1, pre) : grad;
    if (g.sym_stride(2) != 1) g = g.contiguous();  // an expanded / transposed grad: copied once
    const bool nx = ctx->needs_input_grad(0), nw = ctx->needs_input_grad(1), nb = ctx->needs_input_grad(2);
    at::Tensor dx, dw, db, dp;
    if (nx || nw || nb)
      std::tie(dx, dw, db) = bwd.call(g, saved[0], saved[1], ctx->saved_data["eps"].toDouble(), std::nullopt, std::nullopt, std::nullopt);
    if (has_prefix && ctx->needs_input_grad(3)) dp = grad.slice_symint(1, 0, pre).sum(0);
    return {nx ? dx : at::Tensor(), nw ? dw : at::Tensor(), nb ? db : at::Tensor(), at::Tensor(), dp, at::Tensor()};
  }
};

inline at::Tensor layer_norm_tokens_autograd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                                             double eps, const std::optional<at::Tensor>& prefix, OptDtype out_dtype) {
  if (any_requires_grad({&x, &w, &b}, {&prefix})) return LayerNormFn::apply(x, w, b, eps, prefix, out_dtype);
  static auto op = public_op<LayerNormSig>("cvt_cutlass::layer_norm_tokens");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(x, w, b, eps, prefix, out_dtype);
}

inline void register_layernorm(torch::Library& pub) {
  define_public(pub, layernorm_schemas());
  impl_op(pub, "layer_norm_tokens", &layer_norm_tokens_cuda, &layer_norm_tokens_autograd);
  impl_op(pub, "layer_norm_tokens_backward", &layer_norm_tokens_backward_cuda);
}

inline void register_layernorm_private(torch::Library& priv) {
  define_private(priv, layernorm_schemas());
  define_raw(priv, "layer_norm(int kernel, Tensor x, Tensor w, Tensor b, Tensor? prefix, Tensor(y!) y, "
             "Tensor(s!)? stats, float eps) -> ()", &layer_norm_raw);
}

}  // namespace cvt
