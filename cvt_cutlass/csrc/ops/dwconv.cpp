// The depthwise conv projection: torch.ops.cvt_cutlass.dwconv_tokens (Python side:
// cvt_cutlass/ops/dwconv.py). The raw launch by kernel id is conv2d.cpp's (one conv ABI).
//
// x (B, cls_rows + H*W, C) tokens with packed rows; w (R, R, C) and bias (C,) in fp32 (BatchNorm
// folded); y (B, cls_rows + P*Q, C) new and contiguous, its first cls_rows rows of every image
// copied from x by the kernel (CvT's cls token: no split, no torch.cat).
#pragma once
#include "conv2d.cpp"

namespace cvt {

constexpr const char* kDwconvArgs =
    "(Tensor x, Tensor weight, Tensor? bias, int height, int width, int stride, int cls_rows=0)";

inline PlanCache<ConvPlan> g_dwconv_plans;
inline auto& g_dwconv_plans_registered = register_cache(g_dwconv_plans);

inline std::shared_ptr<const ConvPlan> make_dwconv_plan(Key key, const at::Tensor& x, const at::Tensor& w,
                                                        const std::optional<at::Tensor>& bias, int64_t height,
                                                        int64_t width, int64_t stride, int64_t cls) {
  static auto planner = python_op<std::tuple<int64_t, int64_t>(
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t, int64_t, int64_t, int64_t)>(
      "cvt_cutlass_C::dwconv_tokens_plan");
  auto plan = std::make_shared<ConvPlan>();
  std::tie(plan->code, plan->source) = planner.call(x, w, bias, height, width, stride, cls);
  if (plan->code == kPlanFallback) return g_dwconv_plans.insert(std::move(key), std::move(plan));
  const int64_t b = x.size(0), c = x.size(2), r = w.size(0), pad = r / 2;
  const int64_t p = conv_out(height, r, stride, pad), q = conv_out(width, r, stride, pad);
  plan->out_sizes = {b, cls + p * q, c};
  plan->x_offset = plan->y_offset = cls * c;
  if (plan->code >= 0) {
    // NHWC views of the spatial tokens (the planner checked that the rows are packed).
    const at::Tensor y = meta_like(plan->out_sizes, x);
    const at::Tensor xi = x.narrow(1, cls, height * width).view({b, height, width, c});
    const at::Tensor yi = y.narrow(1, cls, p * q).view({b, p, q, c});
    conv_plan_kernel(*plan, conv_args(xi, w, bias, yi, r, w.size(1), pad, stride, cls));
  }
  return g_dwconv_plans.insert(std::move(key), std::move(plan));
}

inline at::Tensor dwconv_tokens_cuda(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                                     int64_t height, int64_t width, int64_t stride, int64_t cls) {
  Key key(kDwconv);
  key.add(x); key.add(w); key.add(bias); key.add(height); key.add(width); key.add(stride); key.add(cls);
  auto plan = g_dwconv_plans.find(key);
  if (!plan) plan = make_dwconv_plan(std::move(key), x, w, bias, height, width, stride, cls);
  if (plan->code != kPlanFallback && aligned16(x) && aligned16(w) && aligned16(bias)) {
    const OnDevice on(x);
    at::Tensor out = on.empty(plan->out_sizes, x.scalar_type());
    if (plan->code >= 0) conv_launch(*plan, x, w, bias, out, kDwconv, on);
    return out;
  }
  static auto fallback = python_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                              int64_t, int64_t, int64_t, int64_t)>("cvt_cutlass_C::dwconv_tokens_fallback");
  return fallback.call(x, w, bias, height, width, stride, cls);
}

inline void register_dwconv(torch::Library& m) { define(m, std::string("dwconv_tokens") + kDwconvArgs + " -> Tensor"); }

inline void register_dwconv_private(torch::Library& m) {
  define(m, std::string("dwconv_tokens_autograd") + kDwconvArgs + " -> Tensor");
  define(m, std::string("dwconv_tokens_plan") + kDwconvArgs + " -> (int, int)");
  define(m, std::string("dwconv_tokens_fallback") + kDwconvArgs + " -> Tensor");
}

inline void register_dwconv_cuda(torch::Library& pub) { pub.impl("dwconv_tokens", &dwconv_tokens_cuda); }

inline void register_dwconv_raw(torch::Library& priv) { priv.impl("dwconv_tokens_autograd", &dwconv_tokens_cuda); }

}  // namespace cvt
