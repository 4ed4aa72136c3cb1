// The depthwise conv projection: torch.ops.cvt_cutlass.dwconv_tokens (Python side:
// cvt_cutlass/ops/dwconv.py). The raw launch by kernel id is conv2d.cpp's (one conv ABI).
//
// x (B, cls_rows + H*W, C) tokens with packed rows; w (R, R, C) and bias (C,) in fp32 (BatchNorm
// folded); y (B, cls_rows + P*Q, C) new and contiguous, its first cls_rows rows of every image
// copied from x by the kernel (CvT's cls token: no split, no torch.cat). Its autograd formula,
// DwconvFn, saves x and the weight and calls dwconv_tokens_backward (no kernel yet: the op's
// PyTorch implementation, counted as a fallback).
//
// Training: torch.ops.cvt_cutlass.dwconv_bn_train (the conv + BatchNorm with batch statistics,
// running stats updated in place) and dwconv_bn_backward, joined by the C++ autograd formula
// DwconvBnFn (saves x, the weights and the per-channel mean / invstd: the conv is recomputed).
#pragma once
#include "conv2d.cpp"

namespace cvt {

constexpr const char* kDwconvArgs =
    "(Tensor x, Tensor weight, Tensor? bias, int height, int width, int stride, int cls_rows=0)";
// dwconv_tokens_backward(grad (B, cls + P*Q, C), x, weight, ...) -> (dx (B, cls + H*W, C) in x's
// dtype with grad's cls rows, dweight (R, R, C) and dbias (C,) (empty unless `bias`) in fp32).
constexpr const char* kDwconvBwdArgs =
    "(Tensor grad, Tensor x, Tensor weight, int height, int width, int stride, int cls_rows, bool bias)";

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

// ------------------------------------------------------------------------------------ autograd
using DwSig = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t, int64_t,
                         int64_t, int64_t);
using DwBwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                const at::Tensor&, int64_t, int64_t, int64_t, int64_t,
                                                                bool);

// Saves x and the weight; the gradients of the fp32 weight and bias come back in their dtypes.
struct DwconvFn : torch::autograd::Function<DwconvFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias, int64_t h, int64_t wd, int64_t stride, int64_t cls) {
    static auto op = public_op<DwSig>("cvt_cutlass::dwconv_tokens");
    at::AutoDispatchBelowADInplaceOrView below;
    at::Tensor y = op.call(x, w, bias, h, wd, stride, cls);
    ctx->saved_data["geom"] = std::vector<int64_t>{h, wd, stride, cls};
    ctx->saved_data["bias_dtype"] = static_cast<int64_t>(bias ? bias->scalar_type() : at::kFloat);
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->save_for_backward({x, w});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = public_op<DwBwdSig>("cvt_cutlass::dwconv_tokens_backward");
    if (!grads[0].defined()) return variable_list(7);
    const auto s = ctx->get_saved_variables();
    const auto geom = ctx->saved_data["geom"].toIntVector();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const bool need_bias = has_bias && ctx->needs_input_grad(2);
    auto [dx, dw, db] = bwd.call(grads[0].contiguous(), s[0], s[1], geom[0], geom[1], geom[2], geom[3], need_bias);
    variable_list out(7);
    if (ctx->needs_input_grad(0)) out[0] = dx;
    if (ctx->needs_input_grad(1)) out[1] = dw.to(s[1].scalar_type());
    if (need_bias) out[2] = db.to(static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toInt()));
    return out;
  }
};

inline at::Tensor dwconv_tokens_autograd(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                                         int64_t h, int64_t wd, int64_t stride, int64_t cls) {
  if (any_requires_grad({&x, &w}, {&bias})) return DwconvFn::apply(x, w, bias, h, wd, stride, cls);
  static auto op = public_op<DwSig>("cvt_cutlass::dwconv_tokens");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(x, w, bias, h, wd, stride, cls);
}

// ------------------------------------------------------------------------------------ training
// dwconv_bn_train(x, weight (3, 3, C) fp32, bn_weight?, bn_bias?, running_mean?!, running_var?!,
// momentum, eps, height, width, stride, cls_rows) -> (y, mean, invstd): y (B, cls + P*Q, C) in x's
// dtype, mean / invstd (C,) fp32 batch statistics; the running stats (fp32) updated in place with
// the factor `momentum` (the caller resolves momentum=None and counts num_batches_tracked).
constexpr const char* kDwBnTail = "float momentum, float eps, int height, int width, int stride, int cls_rows=0)";
inline std::string dwbn_args(bool mutable_stats) {
  return std::string("(Tensor x, Tensor weight, Tensor? bn_weight, Tensor? bn_bias, ") +
         (mutable_stats ? "Tensor(a!)? running_mean, Tensor(b!)? running_var, " : "Tensor? running_mean, Tensor? running_var, ") +
         kDwBnTail;
}
constexpr const char* kDwBnBwdArgs =
    "(Tensor grad, Tensor x, Tensor weight, Tensor? bn_weight, Tensor mean, Tensor invstd, int height, int width, "
    "int stride, int cls_rows=0)";

// The op family's public ops and their private planner / fallback ops (plans.h: OpSchema).
inline std::vector<OpSchema> dwconv_schemas() {
  // dwconv_tokens_backward has no kernel: no planner, its PyTorch implementation serves every
  // device; dwconv_bn_train's planner takes no running statistics
  return {{"dwconv_tokens", kDwconvArgs, "Tensor"},
          {"dwconv_tokens_backward", kDwconvBwdArgs, "(Tensor, Tensor, Tensor)", "", false},
          {"dwconv_bn_train", dwbn_args(true), "(Tensor, Tensor, Tensor)", "(int, int)", true, dwbn_args(false)},
          {"dwconv_bn_backward", kDwBnBwdArgs, "(Tensor, Tensor, Tensor, Tensor)"}};
}

using DwBnSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const OptT&,
                                                              const OptT&, const OptT&, const OptT&, double, double,
                                                              int64_t, int64_t, int64_t, int64_t);
using DwBnBwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptT&, const at::Tensor&, const at::Tensor&, int64_t,
    int64_t, int64_t, int64_t);

template <class T>
T* opt_ptr(const OptT& t) {
  return t ? static_cast<T*>(t->data_ptr()) : nullptr;
}

inline cvt_dwbn_args dwbn_args_of(const at::Tensor& x, const at::Tensor& w, const OptT& bnw, const OptT& bnb,
                                  const OptT& rm, const OptT& rv, int64_t h, int64_t wd, int64_t stride, int64_t cls,
                                  void* y, int64_t y_image_stride) {
  cvt_dwbn_args p{};
  p.n = x.size(0); p.h = h; p.w = wd; p.c = x.size(2);
  p.p = conv_out(h, 3, stride, 1); p.q = conv_out(wd, 3, stride, 1);
  p.stride = stride; p.cls_rows = cls;
  p.x = x.data_ptr(); p.x_image_stride = x.size(0) > 1 ? x.stride(0) : x.size(1) * x.size(2);
  p.weight = static_cast<const float*>(w.data_ptr());
  p.bn_weight = opt_ptr<const float>(bnw); p.bn_bias = opt_ptr<const float>(bnb);
  p.running_mean = opt_ptr<float>(rm); p.running_var = opt_ptr<float>(rv);
  p.y = y; p.y_image_stride = y_image_stride;
  p.device_id = x.device().index();
  return p;
}

inline std::string dwbn_what(int64_t n, int64_t h, int64_t w, int64_t c, int64_t stride, int64_t cls) {
  return "x [" + std::to_string(n) + ", " + std::to_string(cls) + " + " + std::to_string(h) + "*" + std::to_string(w) +
         ", " + std::to_string(c) + "] at stride " + std::to_string(stride);
}

using DwBnPlan = ShapedPlan<cvt_dwbn_args>;
inline PlanCache<DwBnPlan> g_dwbn_plans;
inline auto& g_dwbn_plans_registered = register_cache(g_dwbn_plans);

inline std::shared_ptr<const DwBnPlan> make_dwbn_plan(Key key, const at::Tensor& x, const at::Tensor& w,
                                                      const OptT& bnw, const OptT& bnb, const OptT& rm,
                                                      const OptT& rv, double momentum, double eps, int64_t h,
                                                      int64_t wd, int64_t stride, int64_t cls) {
  static auto planner = python_op<std::tuple<int64_t, int64_t>(const at::Tensor&, const at::Tensor&, const OptT&,
                                                               const OptT&, const OptT&, const OptT&, double, double,
                                                               int64_t, int64_t, int64_t, int64_t)>(
      "cvt_cutlass_C::dwconv_bn_train_plan");
  auto plan = std::make_shared<DwBnPlan>();
  std::tie(plan->code, plan->source) = planner.call(x, w, bnw, bnb, rm, rv, momentum, eps, h, wd, stride, cls);
  if (plan->code >= 0) {
    const Kernel& kern = kernel_of_family(plan->code, {CVT_FAMILY_DWCONV_BN}, "a depthwise conv + BatchNorm");
    const int64_t p = conv_out(h, 3, stride, 1), q = conv_out(wd, 3, stride, 1);
    plan->out_sizes = {x.size(0), cls + p * q, x.size(2)};
    cvt_dwbn_args& a = plan->args;
    a = dwbn_args_of(x, w, bnw, bnb, rm, rv, h, wd, stride, cls, kPlanPointer, (cls + p * q) * x.size(2));
    plan_pointer(a.x); plan_pointer(a.y); plan_pointer(a.weight); plan_pointer(a.bn_weight); plan_pointer(a.bn_bias);
    plan_pointer(a.running_mean); plan_pointer(a.running_var);
    a.mean = a.invstd = static_cast<float*>(kPlanPointer);
    check_can_implement(kern.can_implement(a), kern, [&] { return dwbn_what(a.n, h, wd, a.c, stride, cls); });
    plan->workspace = kern.workspace_size(a);
    plan->kernel = &kern;
  }
  return g_dwbn_plans.insert(std::move(key), std::move(plan));
}

// One projection's parameters: the conv weight, BatchNorm's weight / bias / running statistics,
// the running-stat factor and eps.
struct DwBnProj {
  at::Tensor w;
  OptT bnw, bnb, rm, rv;
  double momentum, eps;
};
using DwBnOut = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // y, mean, invstd

// A plan's arguments for one call: the operands' pointers and new outputs.
inline cvt_dwbn_args dwbn_call_args(const DwBnPlan& plan, const at::Tensor& x, const DwBnProj& pr,
                                    const OnDevice& on, DwBnOut& out) {
  auto& [y, mean, invstd] = out;
  y = on.empty(plan.out_sizes, x.scalar_type());
  mean = on.empty({x.size(2)}, at::kFloat);
  invstd = on.empty({x.size(2)}, at::kFloat);
  cvt_dwbn_args p = plan.args;
  p.x = x.data_ptr(); p.weight = static_cast<const float*>(pr.w.data_ptr());
  p.bn_weight = opt_ptr<const float>(pr.bnw); p.bn_bias = opt_ptr<const float>(pr.bnb);
  p.running_mean = opt_ptr<float>(pr.rm); p.running_var = opt_ptr<float>(pr.rv);
  p.y = y.data_ptr(); p.mean = mean.data_ptr<float>(); p.invstd = invstd.data_ptr<float>();
  p.momentum = static_cast<float>(pr.momentum); p.eps = static_cast<float>(pr.eps);
  return p;
}

inline Key dwbn_key(const at::Tensor& x, const DwBnProj& pr, int64_t h, int64_t wd, int64_t stride, int64_t cls) {
  Key key(kDwconvBnTrain);
  key.add(x); key.add(pr.w); key.add(pr.bnw); key.add(pr.bnb); key.add(pr.rm); key.add(pr.rv);
  key.add(h); key.add(wd); key.add(stride); key.add(cls);
  return key;
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> dwconv_bn_train_cuda(
    const at::Tensor& x, const at::Tensor& w, const OptT& bnw, const OptT& bnb, const OptT& rm, const OptT& rv,
    double momentum, double eps, int64_t h, int64_t wd, int64_t stride, int64_t cls) {
  const DwBnProj pr{w, bnw, bnb, rm, rv, momentum, eps};
  Key key = dwbn_key(x, pr, h, wd, stride, cls);
  auto plan = g_dwbn_plans.find(key);
  if (!plan) plan = make_dwbn_plan(std::move(key), x, w, bnw, bnb, rm, rv, momentum, eps, h, wd, stride, cls);
  TORCH_CHECK_VALUE(eps >= 0 && momentum >= 0 && momentum <= 1,
                    "cvt_cutlass.dwconv_bn_train: eps must be >= 0 and momentum in [0, 1]");
  if (plan->code >= 0 && aligned16(x) && aligned16(w)) {
    const OnDevice on(x);
    DwBnOut out;
    const cvt_dwbn_args p = dwbn_call_args(*plan, x, pr, on, out);
    check_launch(launch(*plan->kernel, p, plan->workspace, on), *plan->kernel,
                 [&] { return dwbn_what(p.n, h, wd, p.c, stride, cls); });
    count_call(kDwconvBnTrain, plan->source);
    return out;
  }
  static auto fallback = python_op<DwBnSig>("cvt_cutlass_C::dwconv_bn_train_fallback");
  return fallback.call(x, w, bnw, bnb, rm, rv, momentum, eps, h, wd, stride, cls);
}

// Two problems of one plan as one grouped launch (operators/dwconv/abi.h: next; the workspace of
// two), counted as two calls of the op.
template <class Plan, class Args, class What>
void launch_pair(const Plan& plan, Args a, const Args& b, const OnDevice& on, Op op, const What& what) {
  a.next = &b;
  check_launch(launch(*plan.kernel, a, 2 * plan.workspace, on), *plan.kernel, what);
  count_call(op, plan.source);
  count_call(op, plan.source);
}

// Two projections of one input (CvT's k and v) in one grouped launch of dwconv_bn_train's kernels
// (operators/dwconv/abi.h: next), the same results as two calls; two calls where the plan is not
// a kernel or the two differ in layout. The layer op's path, and a private op for tests.
inline std::array<DwBnOut, 2> dwconv_bn_train_pair_cuda(const at::Tensor& x, const DwBnProj& a, const DwBnProj& b,
                                                        int64_t h, int64_t wd, int64_t stride, int64_t cls) {
  Key key = dwbn_key(x, a, h, wd, stride, cls);
  const bool alike = key == dwbn_key(x, b, h, wd, stride, cls);
  auto plan = g_dwbn_plans.find(key);
  if (!plan) plan = make_dwbn_plan(std::move(key), x, a.w, a.bnw, a.bnb, a.rm, a.rv, a.momentum, a.eps, h, wd, stride, cls);
  const bool ok = a.eps >= 0 && b.eps >= 0 && a.momentum >= 0 && a.momentum <= 1 && b.momentum >= 0 && b.momentum <= 1;
  if (!(alike && ok && plan->code >= 0 && aligned16(x) && aligned16(a.w) && aligned16(b.w)))
    return {dwconv_bn_train_cuda(x, a.w, a.bnw, a.bnb, a.rm, a.rv, a.momentum, a.eps, h, wd, stride, cls),
            dwconv_bn_train_cuda(x, b.w, b.bnw, b.bnb, b.rm, b.rv, b.momentum, b.eps, h, wd, stride, cls)};
  const OnDevice on(x);
  std::array<DwBnOut, 2> out;
  launch_pair(*plan, dwbn_call_args(*plan, x, a, on, out[0]), dwbn_call_args(*plan, x, b, on, out[1]), on,
              kDwconvBnTrain, [&] { return "k / v pair of " + dwbn_what(x.size(0), h, wd, x.size(2), stride, cls); });
  return out;
}

// ------------------------------------------------------------------------------------ backward
// dwconv_bn_backward(grad (B, cls + P*Q, C), x, weight, bn_weight?, mean, invstd, ...) ->
// (dx (B, cls + H*W, C) in x's dtype with dx = grad on the cls rows, dweight (3, 3, C),
// dbn_weight (C,), dbn_bias (C,)), the last three fp32.
using DwBnBwdPlan = KernelPlan<cvt_dwbnbwd_args>;
inline PlanCache<DwBnBwdPlan> g_dwbn_bwd_plans;
inline auto& g_dwbn_bwd_plans_registered = register_cache(g_dwbn_bwd_plans);

inline cvt_dwbnbwd_args dwbn_bwd_args_of(const at::Tensor& g, const at::Tensor& x, const at::Tensor& w,
                                         const OptT& bnw, const at::Tensor& mean, const at::Tensor& invstd,
                                         int64_t h, int64_t wd, int64_t stride, int64_t cls) {
  cvt_dwbnbwd_args p{};
  p.n = x.size(0); p.h = h; p.w = wd; p.c = x.size(2);
  p.p = conv_out(h, 3, stride, 1); p.q = conv_out(wd, 3, stride, 1);
  p.stride = stride; p.cls_rows = cls;
  p.x = x.data_ptr(); p.x_image_stride = x.size(0) > 1 ? x.stride(0) : x.size(1) * x.size(2);
  p.dy = g.data_ptr(); p.dy_image_stride = g.size(0) > 1 ? g.stride(0) : g.size(1) * g.size(2);
  p.weight = static_cast<const float*>(w.data_ptr()); p.bn_weight = opt_ptr<const float>(bnw);
  p.mean = static_cast<const float*>(mean.data_ptr()); p.invstd = static_cast<const float*>(invstd.data_ptr());
  p.dx_image_stride = (cls + h * wd) * p.c;
  p.device_id = x.device().index();
  return p;
}

inline std::shared_ptr<const DwBnBwdPlan> make_dwbn_bwd_plan(Key key, const at::Tensor& g, const at::Tensor& x,
                                                             const at::Tensor& w, const OptT& bnw,
                                                             const at::Tensor& mean, const at::Tensor& invstd,
                                                             int64_t h, int64_t wd, int64_t stride, int64_t cls) {
  static auto planner = python_op<std::tuple<int64_t, int64_t>(const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, const OptT&, const at::Tensor&,
                                                               const at::Tensor&, int64_t, int64_t, int64_t, int64_t)>(
      "cvt_cutlass_C::dwconv_bn_backward_plan");
  auto plan = std::make_shared<DwBnBwdPlan>();
  std::tie(plan->code, plan->source) = planner.call(g, x, w, bnw, mean, invstd, h, wd, stride, cls);
  if (plan->code >= 0) {
    const Kernel& kern = kernel_of_family(plan->code, {CVT_FAMILY_DWCONV_BN_BWD}, "a depthwise conv + BatchNorm backward");
    cvt_dwbnbwd_args& a = plan->args;
    a = dwbn_bwd_args_of(g, x, w, bnw, mean, invstd, h, wd, stride, cls);
    plan_pointer(a.x); plan_pointer(a.dy); plan_pointer(a.weight); plan_pointer(a.bn_weight);
    plan_pointer(a.mean); plan_pointer(a.invstd);
    a.dx = kPlanPointer; a.dweight = a.dbn_weight = a.dbn_bias = static_cast<float*>(kPlanPointer);
    check_can_implement(kern.can_implement(a), kern, [&] { return dwbn_what(a.n, h, wd, a.c, stride, cls); });
    plan->workspace = kern.workspace_size(a);
    plan->kernel = &kern;
  }
  return g_dwbn_bwd_plans.insert(std::move(key), std::move(plan));
}

// One projection's backward operands: its output gradient, conv weight, BatchNorm weight and the
// forward's batch statistics.
struct DwBnBwdProj {
  at::Tensor g, w;
  OptT bnw;
  at::Tensor mean, invstd;
  bool aligned() const { return aligned16(g) && aligned16(w) && aligned16(mean) && aligned16(invstd); }
};
using DwBnBwdOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;  // dx, dweight, dbn_weight, dbn_bias

inline Key dwbn_bwd_key(const at::Tensor& x, const DwBnBwdProj& pr, int64_t h, int64_t wd, int64_t stride,
                        int64_t cls) {
  Key key(kDwconvBnBackward);
  key.add(pr.g); key.add(x); key.add(pr.w); key.add(pr.bnw); key.add(pr.mean); key.add(pr.invstd);
  key.add(h); key.add(wd); key.add(stride); key.add(cls);
  return key;
}

// A plan's arguments for one call: the operands' pointers and new outputs.
// (want_dx false: no dx of its own; a summing q / k / v launch writes the sum into q's.)
inline cvt_dwbnbwd_args dwbn_bwd_call_args(const DwBnBwdPlan& plan, const at::Tensor& x, const DwBnBwdProj& pr,
                                           int64_t rows, const OnDevice& on, DwBnBwdOut& out, bool want_dx = true) {
  auto& [dx, dw, dg, db] = out;
  const int64_t c = x.size(2);
  if (want_dx) dx = on.empty({x.size(0), rows, c}, x.scalar_type());
  dw = on.empty({3, 3, c}, at::kFloat);
  dg = on.empty({c}, at::kFloat);
  db = on.empty({c}, at::kFloat);
  cvt_dwbnbwd_args p = plan.args;
  p.x = x.data_ptr(); p.dy = pr.g.data_ptr(); p.weight = static_cast<const float*>(pr.w.data_ptr());
  p.bn_weight = opt_ptr<const float>(pr.bnw);
  p.mean = pr.mean.data_ptr<float>(); p.invstd = pr.invstd.data_ptr<float>();
  p.dx = want_dx ? dx.data_ptr() : nullptr; p.dweight = dw.data_ptr<float>(); p.dbn_weight = dg.data_ptr<float>();
  p.dbn_bias = db.data_ptr<float>();
  return p;
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dwconv_bn_backward_cuda(
    const at::Tensor& g, const at::Tensor& x, const at::Tensor& w, const OptT& bnw, const at::Tensor& mean,
    const at::Tensor& invstd, int64_t h, int64_t wd, int64_t stride, int64_t cls) {
  const DwBnBwdProj pr{g, w, bnw, mean, invstd};
  Key key = dwbn_bwd_key(x, pr, h, wd, stride, cls);
  auto plan = g_dwbn_bwd_plans.find(key);
  if (!plan) plan = make_dwbn_bwd_plan(std::move(key), g, x, w, bnw, mean, invstd, h, wd, stride, cls);
  if (plan->code >= 0 && aligned16(x) && pr.aligned()) {
    const OnDevice on(x);
    DwBnBwdOut out;
    const cvt_dwbnbwd_args p = dwbn_bwd_call_args(*plan, x, pr, cls + h * wd, on, out);
    check_launch(launch(*plan->kernel, p, plan->workspace, on), *plan->kernel,
                 [&] { return "backward of " + dwbn_what(p.n, h, wd, p.c, stride, cls); });
    count_call(kDwconvBnBackward, plan->source);
    return out;
  }
  static auto fallback = python_op<DwBnBwdSig>("cvt_cutlass_C::dwconv_bn_backward_fallback");
  return fallback.call(g, x, w, bnw, mean, invstd, h, wd, stride, cls);
}

// The backward of dwconv_bn_train_pair_cuda: two projections of one input in one grouped launch,
// the same results as two dwconv_bn_backward calls (which serve what the grouped launch does not).
inline std::array<DwBnBwdOut, 2> dwconv_bn_backward_pair_cuda(const at::Tensor& x, const DwBnBwdProj& a,
                                                              const DwBnBwdProj& b, int64_t h, int64_t wd,
                                                              int64_t stride, int64_t cls) {
  Key key = dwbn_bwd_key(x, a, h, wd, stride, cls);
  const bool alike = key == dwbn_bwd_key(x, b, h, wd, stride, cls);
  auto plan = g_dwbn_bwd_plans.find(key);
  if (!plan) plan = make_dwbn_bwd_plan(std::move(key), a.g, x, a.w, a.bnw, a.mean, a.invstd, h, wd, stride, cls);
  if (!(alike && plan->code >= 0 && aligned16(x) && a.aligned() && b.aligned()))
    return {dwconv_bn_backward_cuda(a.g, x, a.w, a.bnw, a.mean, a.invstd, h, wd, stride, cls),
            dwconv_bn_backward_cuda(b.g, x, b.w, b.bnw, b.mean, b.invstd, h, wd, stride, cls)};
  const OnDevice on(x);
  std::array<DwBnBwdOut, 2> out;
  launch_pair(*plan, dwbn_bwd_call_args(*plan, x, a, cls + h * wd, on, out[0]),
              dwbn_bwd_call_args(*plan, x, b, cls + h * wd, on, out[1]), on, kDwconvBnBackward,
              [&] { return "backward of the k / v pair of " + dwbn_what(x.size(0), h, wd, x.size(2), stride, cls); });
  return out;
}

// ------------------------------------------------------------------------------------ q, k and v
// A layer's three projections of one input (q at stride_q, the k / v pair at stride_kv) in one set
// of launches (operators/dwconv: DwBnFwdQkv / DwBnBwdQkv), the same results as the q call and the
// k / v pair (the library runs their kernels' shapes with their grids); those two calls where no
// such library serves the three (then the q call and the pair plan and count as they do alone).
struct DwBnQkvPlan {
  int64_t code = kPlanFallback;
  const Kernel* kernel = nullptr;
  size_t workspace = 0;
  bool sums = false;  // backward: the library can sum the three dx into one (cvt_dwbnbwd_args.sum_dx)
};
inline PlanCache<DwBnQkvPlan> g_dwbn_qkv_plans;
inline auto& g_dwbn_qkv_plans_registered = register_cache(g_dwbn_qkv_plans);

// q's plan key followed by the k / v pair's: what a q / k / v plan depends on.
inline Key qkv_key(const Key& q, const Key& kv) {
  Key key = q;
  key.v.append(kv.v.begin(), kv.v.end());
  return key;
}

// The library for the chain q -> k -> v of plan arguments (placeholders) a, and its workspace.
template <class Args>
std::shared_ptr<const DwBnQkvPlan> dwbn_qkv_plan(Key key, Op op, const at::Tensor& x, const at::Tensor& w, int64_t h,
                                                 int64_t wd, int64_t sq, int64_t skv, int64_t cls, Args a, Args k) {
  if (auto plan = g_dwbn_qkv_plans.find(key)) return plan;
  static auto planner = python_op<std::tuple<int64_t, int64_t>(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                                               int64_t, int64_t, int64_t, c10::string_view)>(
      "cvt_cutlass_C::dwconv_bn_qkv_plan");
  const bool bwd = op == kDwconvBnBackward;
  auto plan = std::make_shared<DwBnQkvPlan>();
  std::tie(plan->code, std::ignore) = planner.call(x, w, h, wd, sq, skv, cls, bwd ? "bwd" : "fwd");
  if (plan->code >= 0) {
    const Kernel& kern = kernel_of_family(plan->code, {bwd ? CVT_FAMILY_DWCONV_BN_BWD : CVT_FAMILY_DWCONV_BN},
                                          "a depthwise conv + BatchNorm of q, k and v");
    Args v = k;
    a.next = &k;
    k.next = &v;
    check_can_implement(kern.can_implement(a), kern,
                        [&] { return "q, k and v of " + dwbn_what(a.n, h, wd, a.c, sq, cls); });
    if constexpr (std::is_same_v<Args, cvt_dwbnbwd_args>) {
      Args summed = a;
      summed.sum_dx = 1;
      plan->sums = kern.can_implement(summed) == CVT_OK;
    }
    plan->workspace = kern.workspace_size(a);
    plan->kernel = &kern;
  }
  return g_dwbn_qkv_plans.insert(std::move(key), std::move(plan));
}

// The three launched as one chain (operators/dwconv/abi.h: next), counted as three calls.
template <class Args, class What>
void launch_qkv(const DwBnQkvPlan& plan, Args a, Args k, const Args& v, int64_t source_q, int64_t source_kv,
                const OnDevice& on, Op op, const What& what) {
  k.next = &v;
  a.next = &k;
  check_launch(launch(*plan.kernel, a, plan.workspace, on), *plan.kernel, what);
  count_call(op, source_q);
  count_call(op, source_kv);
  count_call(op, source_kv);
}

inline std::array<DwBnOut, 3> dwconv_bn_train_qkv_cuda(const at::Tensor& x, const DwBnProj& q, const DwBnProj& k,
                                                       const DwBnProj& v, int64_t h, int64_t wd, int64_t sq,
                                                       int64_t skv, int64_t cls) {
  Key kq = dwbn_key(x, q, h, wd, sq, cls), kk = dwbn_key(x, k, h, wd, skv, cls);
  const bool alike = kk == dwbn_key(x, v, h, wd, skv, cls);
  Key kqkv = qkv_key(kq, kk);
  auto pq = g_dwbn_plans.find(kq);
  if (!pq) pq = make_dwbn_plan(std::move(kq), x, q.w, q.bnw, q.bnb, q.rm, q.rv, q.momentum, q.eps, h, wd, sq, cls);
  auto pk = g_dwbn_plans.find(kk);
  if (!pk) pk = make_dwbn_plan(std::move(kk), x, k.w, k.bnw, k.bnb, k.rm, k.rv, k.momentum, k.eps, h, wd, skv, cls);
  const auto ok = [](const DwBnProj& p) { return p.eps >= 0 && p.momentum >= 0 && p.momentum <= 1 && aligned16(p.w); };
  std::shared_ptr<const DwBnQkvPlan> plan;
  if (alike && pq->code >= 0 && pk->code >= 0 && sq != skv)
    plan = dwbn_qkv_plan(std::move(kqkv), kDwconvBnTrain, x, q.w, h, wd, sq, skv, cls, pq->args, pk->args);
  if (!(plan && plan->code >= 0 && ok(q) && ok(k) && ok(v) && aligned16(x))) {
    DwBnOut oq = dwconv_bn_train_cuda(x, q.w, q.bnw, q.bnb, q.rm, q.rv, q.momentum, q.eps, h, wd, sq, cls);
    auto [ok_, ov] = dwconv_bn_train_pair_cuda(x, k, v, h, wd, skv, cls);
    return {oq, ok_, ov};
  }
  const OnDevice on(x);
  std::array<DwBnOut, 3> out;
  launch_qkv(*plan, dwbn_call_args(*pq, x, q, on, out[0]), dwbn_call_args(*pk, x, k, on, out[1]),
             dwbn_call_args(*pk, x, v, on, out[2]), pq->source, pk->source, on, kDwconvBnTrain,
             [&] { return "q, k and v of " + dwbn_what(x.size(0), h, wd, x.size(2), sq, cls); });
  return out;
}

// sum_dx: where the library serves the three and can sum, q's dx is the sum of the three
// projections' and k's and v's dx are undefined (otherwise the three dx, as without it).
inline std::array<DwBnBwdOut, 3> dwconv_bn_backward_qkv_cuda(const at::Tensor& x, const DwBnBwdProj& q,
                                                              const DwBnBwdProj& k, const DwBnBwdProj& v, int64_t h,
                                                              int64_t wd, int64_t sq, int64_t skv, int64_t cls,
                                                              bool sum_dx = false) {
  Key kq = dwbn_bwd_key(x, q, h, wd, sq, cls), kk = dwbn_bwd_key(x, k, h, wd, skv, cls);
  const bool alike = kk == dwbn_bwd_key(x, v, h, wd, skv, cls);
  Key kqkv = qkv_key(kq, kk);
  auto pq = g_dwbn_bwd_plans.find(kq);
  if (!pq) pq = make_dwbn_bwd_plan(std::move(kq), q.g, x, q.w, q.bnw, q.mean, q.invstd, h, wd, sq, cls);
  auto pk = g_dwbn_bwd_plans.find(kk);
  if (!pk) pk = make_dwbn_bwd_plan(std::move(kk), k.g, x, k.w, k.bnw, k.mean, k.invstd, h, wd, skv, cls);
  std::shared_ptr<const DwBnQkvPlan> plan;
  if (alike && pq->code >= 0 && pk->code >= 0 && sq != skv)
    plan = dwbn_qkv_plan(std::move(kqkv), kDwconvBnBackward, x, q.w, h, wd, sq, skv, cls, pq->args, pk->args);
  if (!(plan && plan->code >= 0 && aligned16(x) && q.aligned() && k.aligned() && v.aligned())) {
    DwBnBwdOut dq = dwconv_bn_backward_cuda(q.g, x, q.w, q.bnw, q.mean, q.invstd, h, wd, sq, cls);
    auto [dk, dv] = dwconv_bn_backward_pair_cuda(x, k, v, h, wd, skv, cls);
    return {dq, dk, dv};
  }
  const OnDevice on(x);
  const bool sums = sum_dx && plan->sums;
  std::array<DwBnBwdOut, 3> out;
  cvt_dwbnbwd_args aq = dwbn_bwd_call_args(*pq, x, q, cls + h * wd, on, out[0]);
  aq.sum_dx = sums ? 1 : 0;
  launch_qkv(*plan, aq, dwbn_bwd_call_args(*pk, x, k, cls + h * wd, on, out[1], !sums),
             dwbn_bwd_call_args(*pk, x, v, cls + h * wd, on, out[2], !sums), pq->source, pk->source, on,
             kDwconvBnBackward,
             [&] { return "backward of q, k and v of " + dwbn_what(x.size(0), h, wd, x.size(2), sq, cls); });
  return out;
}

// ------------------------------------------------------------------------------------ SyncBatchNorm parts
// The training kernels in parts (operators/dwconv/abi.h: phase), for a BatchNorm over several
// processes' batches (cvt_cutlass/ops/dwconv.py: sync_dwconv_bn all-reduces between them):
// dwconv_bn_stats -> (mean, m2) of this call's batch; dwconv_bn_apply -> y with given statistics;
// dwconv_bn_backward_sums -> (sum dy, sum dy * xhat); dwconv_bn_backward_apply -> (dx, dweight)
// from given sums over `count` (a device scalar) values per channel. Planned as dwconv_bn_train / dwconv_bn_backward
// (the same kernels), their fallbacks PyTorch's. No autograd of their own.
using SyncPair = std::tuple<at::Tensor, at::Tensor>;
using StatsSig = SyncPair(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, int64_t);
using ApplySig = at::Tensor(const at::Tensor&, const at::Tensor&, const OptT&, const OptT&, const at::Tensor&,
                            const at::Tensor&, int64_t, int64_t, int64_t, int64_t);
using SumsSig = SyncPair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, int64_t, int64_t, int64_t, int64_t);
using BwdApplySig = SyncPair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptT&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                             int64_t, int64_t, int64_t);
constexpr const char* kGeomArgs = "int height, int width, int stride, int cls_rows=0)";

inline std::vector<OpSchema> dwbn_sync_schemas() {
  const std::string vecs = "Tensor mean, Tensor invstd, ";
  return {{"dwconv_bn_stats", std::string("(Tensor x, Tensor weight, ") + kGeomArgs, "(Tensor, Tensor)", ""},
          {"dwconv_bn_apply", "(Tensor x, Tensor weight, Tensor? bn_weight, Tensor? bn_bias, " + vecs + kGeomArgs,
           "Tensor", ""},
          {"dwconv_bn_backward_sums", "(Tensor grad, Tensor x, Tensor weight, " + vecs + kGeomArgs,
           "(Tensor, Tensor)", ""},
          {"dwconv_bn_backward_apply", "(Tensor grad, Tensor x, Tensor weight, Tensor? bn_weight, " + vecs +
           "Tensor sum_dy, Tensor sum_dy_xhat, Tensor count, " + kGeomArgs, "(Tensor, Tensor)", ""}};
}

// The forward parts' plan: dwconv_bn_train's for the same x, weight and geometry.
inline std::shared_ptr<const DwBnPlan> dwbn_part_plan(Op op, const at::Tensor& x, const at::Tensor& w, int64_t h,
                                                      int64_t wd, int64_t stride, int64_t cls) {
  Key key(op);
  key.add(x); key.add(w); key.add(h); key.add(wd); key.add(stride); key.add(cls);
  auto plan = g_dwbn_plans.find(key);
  const OptT none;
  return plan ? plan : make_dwbn_plan(std::move(key), x, w, none, none, none, none, 0.0, 0.0, h, wd, stride, cls);
}

inline cvt_dwbn_args dwbn_part_args(const DwBnPlan& plan, const at::Tensor& x, const at::Tensor& w, int phase) {
  cvt_dwbn_args p = plan.args;
  p.x = x.data_ptr(); p.weight = static_cast<const float*>(w.data_ptr());
  p.bn_weight = p.bn_bias = nullptr; p.running_mean = p.running_var = nullptr;
  p.y = nullptr; p.mean = p.invstd = p.m2 = nullptr;
  p.phase = phase;
  return p;
}

// Whether the kernels serve a part's other operands: fp32 (C,) vectors (and optional ones)
// contiguous and aligned on x's device, and two values per channel at least (the plans are
// dwconv_bn_train's, which need them); else the part's fallback runs (and checks, and raises).
inline bool part_operands_ok(const at::Tensor& x, int64_t h, int64_t wd, int64_t stride,
                             std::initializer_list<const at::Tensor*> ts, std::initializer_list<const OptT*> opts) {
  const auto ok = [&](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == x.size(2) && t.is_contiguous() &&
           t.device() == x.device() && aligned16(t);
  };
  for (const at::Tensor* t : ts)
    if (!ok(*t)) return false;
  for (const OptT* t : opts)
    if (*t && !ok(**t)) return false;
  return x.dim() == 3 && x.size(0) * conv_out(h, 3, stride, 1) * conv_out(wd, 3, stride, 1) >= 2;
}

inline SyncPair dwconv_bn_stats_cuda(const at::Tensor& x, const at::Tensor& w, int64_t h, int64_t wd, int64_t stride,
                                     int64_t cls) {
  const auto plan = part_operands_ok(x, h, wd, stride, {}, {}) ? dwbn_part_plan(kDwconvBnStats, x, w, h, wd, stride, cls)
                                                                  : nullptr;
  if (plan && plan->code >= 0 && aligned16(x) && aligned16(w)) {
    const OnDevice on(x);
    at::Tensor mean = on.empty({x.size(2)}, at::kFloat), m2 = on.empty({x.size(2)}, at::kFloat);
    cvt_dwbn_args p = dwbn_part_args(*plan, x, w, CVT_DWBN_STATS);
    p.mean = mean.data_ptr<float>(); p.m2 = m2.data_ptr<float>();
    check_launch(launch(*plan->kernel, p, plan->workspace, on), *plan->kernel,
                 [&] { return "statistics of " + dwbn_what(p.n, h, wd, p.c, stride, cls); });
    count_call(kDwconvBnStats, plan->source);
    return {mean, m2};
  }
  static auto fallback = python_op<StatsSig>("cvt_cutlass_C::dwconv_bn_stats_fallback");
  return fallback.call(x, w, h, wd, stride, cls);
}

inline at::Tensor dwconv_bn_apply_cuda(const at::Tensor& x, const at::Tensor& w, const OptT& bnw, const OptT& bnb,
                                       const at::Tensor& mean, const at::Tensor& invstd, int64_t h, int64_t wd,
                                       int64_t stride, int64_t cls) {
  const auto plan = part_operands_ok(x, h, wd, stride, {&mean, &invstd}, {&bnw, &bnb})
                        ? dwbn_part_plan(kDwconvBnApply, x, w, h, wd, stride, cls) : nullptr;
  if (plan && plan->code >= 0 && aligned16(x) && aligned16(w)) {
    const OnDevice on(x);
    at::Tensor y = on.empty(plan->out_sizes, x.scalar_type());
    cvt_dwbn_args p = dwbn_part_args(*plan, x, w, CVT_DWBN_APPLY);
    p.bn_weight = opt_ptr<const float>(bnw); p.bn_bias = opt_ptr<const float>(bnb);
    p.mean = const_cast<float*>(mean.data_ptr<float>()); p.invstd = const_cast<float*>(invstd.data_ptr<float>());
    p.y = y.data_ptr();
    check_launch(launch(*plan->kernel, p, plan->workspace, on), *plan->kernel,
                 [&] { return "normalization of " + dwbn_what(p.n, h, wd, p.c, stride, cls); });
    count_call(kDwconvBnApply, plan->source);
    return y;
  }
  static auto fallback = python_op<ApplySig>("cvt_cutlass_C::dwconv_bn_apply_fallback");
  return fallback.call(x, w, bnw, bnb, mean, invstd, h, wd, stride, cls);
}

// The backward parts' plan: dwconv_bn_backward's for the same operands.
inline std::shared_ptr<const DwBnBwdPlan> dwbn_bwd_part_plan(Op op, const at::Tensor& g, const at::Tensor& x,
                                                             const at::Tensor& w, const at::Tensor& mean,
                                                             const at::Tensor& invstd, int64_t h, int64_t wd,
                                                             int64_t stride, int64_t cls) {
  Key key(op);
  key.add(g); key.add(x); key.add(w); key.add(mean); key.add(invstd);
  key.add(h); key.add(wd); key.add(stride); key.add(cls);
  auto plan = g_dwbn_bwd_plans.find(key);
  return plan ? plan : make_dwbn_bwd_plan(std::move(key), g, x, w, OptT(), mean, invstd, h, wd, stride, cls);
}

inline cvt_dwbnbwd_args dwbn_bwd_part_args(const DwBnBwdPlan& plan, const at::Tensor& g, const at::Tensor& x,
                                           const at::Tensor& w, const at::Tensor& mean, const at::Tensor& invstd,
                                           int phase) {
  cvt_dwbnbwd_args p = plan.args;
  p.x = x.data_ptr(); p.dy = g.data_ptr(); p.weight = static_cast<const float*>(w.data_ptr());
  p.bn_weight = nullptr;
  p.mean = mean.data_ptr<float>(); p.invstd = invstd.data_ptr<float>();
  p.dx = nullptr; p.dweight = p.dbn_weight = p.dbn_bias = nullptr;
  p.phase = phase;
  return p;
}

inline SyncPair dwconv_bn_backward_sums_cuda(const at::Tensor& g, const at::Tensor& x, const at::Tensor& w,
                                             const at::Tensor& mean, const at::Tensor& invstd, int64_t h, int64_t wd,
                                             int64_t stride, int64_t cls) {
  const auto plan = part_operands_ok(x, h, wd, stride, {&mean, &invstd}, {})
                        ? dwbn_bwd_part_plan(kDwconvBnBackwardSums, g, x, w, mean, invstd, h, wd, stride, cls) : nullptr;
  if (plan && plan->code >= 0 && aligned16(x) && aligned16(g) && aligned16(w)) {
    const OnDevice on(x);
    at::Tensor sum_dy = on.empty({x.size(2)}, at::kFloat), sum_dy_xhat = on.empty({x.size(2)}, at::kFloat);
    cvt_dwbnbwd_args p = dwbn_bwd_part_args(*plan, g, x, w, mean, invstd, CVT_DWBN_STATS);
    p.dbn_bias = sum_dy.data_ptr<float>(); p.dbn_weight = sum_dy_xhat.data_ptr<float>();
    check_launch(launch(*plan->kernel, p, plan->workspace, on), *plan->kernel,
                 [&] { return "backward sums of " + dwbn_what(p.n, h, wd, p.c, stride, cls); });
    count_call(kDwconvBnBackwardSums, plan->source);
    return {sum_dy, sum_dy_xhat};
  }
  static auto fallback = python_op<SumsSig>("cvt_cutlass_C::dwconv_bn_backward_sums_fallback");
  return fallback.call(g, x, w, mean, invstd, h, wd, stride, cls);
}

inline SyncPair dwconv_bn_backward_apply_cuda(const at::Tensor& g, const at::Tensor& x, const at::Tensor& w,
                                              const OptT& bnw, const at::Tensor& mean, const at::Tensor& invstd,
                                              const at::Tensor& sum_dy, const at::Tensor& sum_dy_xhat,
                                              const at::Tensor& count, int64_t h, int64_t wd, int64_t stride,
                                              int64_t cls) {
  const bool count_ok = count.numel() == 1 && count.scalar_type() == at::kFloat && count.device() == x.device();
  const auto plan = count_ok && part_operands_ok(x, h, wd, stride, {&mean, &invstd, &sum_dy, &sum_dy_xhat}, {&bnw})
                        ? dwbn_bwd_part_plan(kDwconvBnBackwardApply, g, x, w, mean, invstd, h, wd, stride, cls)
                        : nullptr;
  if (plan && plan->code >= 0 && aligned16(x) && aligned16(g) && aligned16(w)) {
    const OnDevice on(x);
    at::Tensor dx = on.empty({x.size(0), cls + h * wd, x.size(2)}, x.scalar_type());
    at::Tensor dw = on.empty({3, 3, x.size(2)}, at::kFloat);
    cvt_dwbnbwd_args p = dwbn_bwd_part_args(*plan, g, x, w, mean, invstd, CVT_DWBN_APPLY);
    p.bn_weight = opt_ptr<const float>(bnw);
    p.sum_dy = sum_dy.data_ptr<float>(); p.sum_dy_xhat = sum_dy_xhat.data_ptr<float>();
    p.count = count.data_ptr<float>();
    p.dx = dx.data_ptr(); p.dweight = dw.data_ptr<float>();
    check_launch(launch(*plan->kernel, p, plan->workspace, on), *plan->kernel,
                 [&] { return "backward of " + dwbn_what(p.n, h, wd, p.c, stride, cls) + " with given sums"; });
    count_call(kDwconvBnBackwardApply, plan->source);
    return {dx, dw};
  }
  static auto fallback = python_op<BwdApplySig>("cvt_cutlass_C::dwconv_bn_backward_apply_fallback");
  return fallback.call(g, x, w, bnw, mean, invstd, sum_dy, sum_dy_xhat, count, h, wd, stride, cls);
}

// ------------------------------------------------------------------------------------ autograd
// Saves x, the conv weight, bn_weight and the batch mean / invstd (no conv output: the backward
// recomputes it); the gradients of the fp32 weights come back in each parameter's dtype.
struct DwconvBnFn : torch::autograd::Function<DwconvBnFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const OptT& bnw,
                               const OptT& bnb, const OptT& rm, const OptT& rv, double momentum, double eps,
                               int64_t h, int64_t wd, int64_t stride, int64_t cls) {
    static auto op = public_op<DwBnSig>("cvt_cutlass::dwconv_bn_train");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, mean, invstd] = op.call(x, w, bnw, bnb, rm, rv, momentum, eps, h, wd, stride, cls);
    ctx->saved_data["geom"] = std::vector<int64_t>{h, wd, stride, cls};
    ctx->saved_data["bnb_dtype"] = static_cast<int64_t>(bnb ? bnb->scalar_type() : at::kFloat);
    ctx->saved_data["has_bnb"] = bnb.has_value() && bnb->defined();
    ctx->save_for_backward({x, w, bnw ? *bnw : at::Tensor(), mean, invstd});
    ctx->mark_non_differentiable({mean, invstd});
    ctx->set_materialize_grads(false);  // no zero-filled gradients for the statistics
    return {y, mean, invstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = public_op<DwBnBwdSig>("cvt_cutlass::dwconv_bn_backward");
    if (!grads[0].defined()) return variable_list(12);
    const auto s = ctx->get_saved_variables();
    const auto geom = ctx->saved_data["geom"].toIntVector();
    const at::Tensor g = grads[0].contiguous();  // the kernels read packed rows; a no-op for autograd's usual grad
    const OptT bnw = if_defined(s[2]);
    auto [dx, dw, dg, db] = bwd.call(g, s[0], s[1], bnw, s[3], s[4], geom[0], geom[1], geom[2], geom[3]);
    const auto bnb_dtype = static_cast<at::ScalarType>(ctx->saved_data["bnb_dtype"].toInt());
    // needs_input_grad counts the tensor inputs that are present: x, weight, then bn_weight / bn_bias if given
    const bool has_bnb = ctx->saved_data["has_bnb"].toBool();
    const size_t bnb_edge = bnw ? 3 : 2;
    variable_list out(12);
    if (ctx->needs_input_grad(0)) out[0] = dx;
    if (ctx->needs_input_grad(1)) out[1] = dw.to(s[1].scalar_type());
    if (bnw && ctx->needs_input_grad(2)) out[2] = dg.to(bnw->scalar_type());
    if (has_bnb && ctx->needs_input_grad(bnb_edge)) out[3] = db.to(bnb_dtype);
    return out;
  }
};

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> dwconv_bn_train_autograd(
    const at::Tensor& x, const at::Tensor& w, const OptT& bnw, const OptT& bnb, const OptT& rm, const OptT& rv,
    double momentum, double eps, int64_t h, int64_t wd, int64_t stride, int64_t cls) {
  if (any_requires_grad({&x, &w}, {&bnw, &bnb})) {
    auto out = DwconvBnFn::apply(x, w, bnw, bnb, rm, rv, momentum, eps, h, wd, stride, cls);
    return {out[0], out[1], out[2]};
  }
  static auto op = public_op<DwBnSig>("cvt_cutlass::dwconv_bn_train");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(x, w, bnw, bnb, rm, rv, momentum, eps, h, wd, stride, cls);
}

// ------------------------------------------------------------------------------------ raw launches
// A given kernel on given outputs, every check on every call (tests, the profile sweep).
inline void check_dwbn_tensors(const Kernel& k, const at::Tensor& x, const at::Tensor& w, const OptT& bnw,
                               int64_t h, int64_t wd, int64_t cls) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(1) == cls + h * wd,
              "cvt_cutlass: " + k.name + ": x must be packed tokens (B, cls_rows + H*W, C), got " + dims(x.sizes()));
  const int64_t c = x.size(2);
  TORCH_CHECK(w.dim() == 3 && w.size(0) == 3 && w.size(1) == 3 && w.size(2) == c && w.is_contiguous() &&
                  w.scalar_type() == at::kFloat && w.device() == x.device(),
              "cvt_cutlass: " + k.name + ": weight must be a contiguous float (3, 3, C) tensor on x's device");
  if (bnw)
    TORCH_CHECK(bnw->dim() == 1 && bnw->size(0) == c && bnw->is_contiguous() && bnw->scalar_type() == at::kFloat &&
                    bnw->device() == x.device(),
                "cvt_cutlass: " + k.name + ": BatchNorm parameters and statistics must be contiguous float (C,)");
}

inline void check_vec(const Kernel& k, const OptT& t, const at::Tensor& x) {
  if (t)
    TORCH_CHECK(t->dim() == 1 && t->size(0) == x.size(2) && t->is_contiguous() && t->scalar_type() == at::kFloat &&
                    t->device() == x.device(),
                "cvt_cutlass: " + k.name + ": BatchNorm parameters and statistics must be contiguous float (C,)");
}

inline void dwconv_bn_raw(int64_t id, const at::Tensor& x, const at::Tensor& w, const OptT& bnw, const OptT& bnb,
                          const OptT& rm, const OptT& rv, const at::Tensor& y, const at::Tensor& mean,
                          const at::Tensor& invstd, double momentum, double eps, int64_t h, int64_t wd,
                          int64_t stride, int64_t cls) {
  const Kernel& k = kernel_of_family(id, {CVT_FAMILY_DWCONV_BN}, "a depthwise conv + BatchNorm");
  check_dwbn_tensors(k, x, w, bnw, h, wd, cls);
  for (const OptT* t : {&bnb, &rm, &rv}) check_vec(k, *t, x);
  check_vec(k, mean, x); check_vec(k, invstd, x);
  const int64_t p = conv_out(h, 3, stride, 1), q = conv_out(wd, 3, stride, 1);
  TORCH_CHECK(y.dim() == 3 && y.size(0) == x.size(0) && y.size(1) == cls + p * q && y.size(2) == x.size(2) &&
                  y.is_contiguous() && y.scalar_type() == x.scalar_type() && y.device() == x.device(),
              "cvt_cutlass: " + k.name + ": y must be a contiguous (B, cls_rows + P*Q, C) tensor like x, got " +
                  dims(y.sizes()));
  cvt_dwbn_args a = dwbn_args_of(x, w, bnw, bnb, rm, rv, h, wd, stride, cls, y.data_ptr(), y.size(1) * y.size(2));
  a.mean = mean.data_ptr<float>(); a.invstd = invstd.data_ptr<float>();
  a.momentum = static_cast<float>(momentum); a.eps = static_cast<float>(eps);
  const OnDevice on(x);
  check_can_implement(k.can_implement(a), k, [&] { return dwbn_what(a.n, h, wd, a.c, stride, cls); });
  check_launch(launch(k, a, k.workspace_size(a), on), k, [&] { return dwbn_what(a.n, h, wd, a.c, stride, cls); });
}

inline void dwconv_bn_bwd_raw(int64_t id, const at::Tensor& g, const at::Tensor& x, const at::Tensor& w,
                              const OptT& bnw, const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor& dx,
                              const at::Tensor& dw, const OptT& dg, const OptT& db, int64_t h, int64_t wd,
                              int64_t stride, int64_t cls) {
  const Kernel& k = kernel_of_family(id, {CVT_FAMILY_DWCONV_BN_BWD}, "a depthwise conv + BatchNorm backward");
  check_dwbn_tensors(k, x, w, bnw, h, wd, cls);
  for (const OptT* t : {&dg, &db}) check_vec(k, *t, x);
  check_vec(k, mean, x); check_vec(k, invstd, x);
  const int64_t p = conv_out(h, 3, stride, 1), q = conv_out(wd, 3, stride, 1);
  TORCH_CHECK(g.dim() == 3 && g.size(0) == x.size(0) && g.size(1) == cls + p * q && g.size(2) == x.size(2) &&
                  g.is_contiguous() && g.scalar_type() == x.scalar_type() && g.device() == x.device(),
              "cvt_cutlass: " + k.name + ": grad must be a contiguous (B, cls_rows + P*Q, C) tensor like x, got " +
                  dims(g.sizes()));
  TORCH_CHECK(dx.sizes() == x.sizes() && dx.is_contiguous() && dx.scalar_type() == x.scalar_type() &&
                  dx.device() == x.device(), "cvt_cutlass: " + k.name + ": dx must be a contiguous tensor like x");
  TORCH_CHECK(dw.sizes() == w.sizes() && dw.is_contiguous() && dw.scalar_type() == at::kFloat && dw.device() == x.device(),
              "cvt_cutlass: " + k.name + ": dweight must be a contiguous float (3, 3, C) tensor");
  cvt_dwbnbwd_args a = dwbn_bwd_args_of(g, x, w, bnw, mean, invstd, h, wd, stride, cls);
  a.dx = dx.data_ptr(); a.dweight = dw.data_ptr<float>();
  a.dbn_weight = opt_ptr<float>(dg); a.dbn_bias = opt_ptr<float>(db);
  const OnDevice on(x);
  check_can_implement(k.can_implement(a), k, [&] { return dwbn_what(a.n, h, wd, a.c, stride, cls); });
  check_launch(launch(k, a, k.workspace_size(a), on), k, [&] { return dwbn_what(a.n, h, wd, a.c, stride, cls); });
}

// ------------------------------------------------------------------------------------ grouped pair
// Private ops over the k / v pair paths (tests check them against two single calls).
using T6 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
inline T6 dwconv_bn_train_pair_op(const at::Tensor& x, const at::Tensor& w1, const OptT& bnw1, const OptT& bnb1,
                                  const OptT& rm1, const OptT& rv1, double mom1, double eps1, const at::Tensor& w2,
                                  const OptT& bnw2, const OptT& bnb2, const OptT& rm2, const OptT& rv2, double mom2,
                                  double eps2, int64_t h, int64_t wd, int64_t stride, int64_t cls) {
  auto [a, b] = dwconv_bn_train_pair_cuda(x, {w1, bnw1, bnb1, rm1, rv1, mom1, eps1},
                                          {w2, bnw2, bnb2, rm2, rv2, mom2, eps2}, h, wd, stride, cls);
  return std::tuple_cat(a, b);
}

using T8 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
inline T8 dwconv_bn_backward_pair_op(const at::Tensor& x, const at::Tensor& g1, const at::Tensor& w1, const OptT& bnw1,
                                     const at::Tensor& mean1, const at::Tensor& invstd1, const at::Tensor& g2,
                                     const at::Tensor& w2, const OptT& bnw2, const at::Tensor& mean2,
                                     const at::Tensor& invstd2, int64_t h, int64_t wd, int64_t stride, int64_t cls) {
  auto [a, b] = dwconv_bn_backward_pair_cuda(x, {g1, w1, bnw1, mean1, invstd1}, {g2, w2, bnw2, mean2, invstd2}, h, wd,
                                             stride, cls);
  return std::tuple_cat(a, b);
}

// The q, k and v paths over lists (q, k, v each): x, weights, bn_weights, bn_biases, running
// statistics (mean, var per projection), momentum, eps -> (y, mean, invstd) per projection.
using OptList = c10::List<std::optional<at::Tensor>>;
inline std::vector<at::Tensor> dwconv_bn_train_qkv_op(const at::Tensor& x, at::TensorList w, const OptList& bnw,
                                                      const OptList& bnb, at::TensorList running,
                                                      at::ArrayRef<double> mom, at::ArrayRef<double> eps, int64_t h,
                                                      int64_t wd, int64_t sq, int64_t skv, int64_t cls) {
  TORCH_CHECK_VALUE(w.size() == 3 && bnw.size() == 3 && bnb.size() == 3 && running.size() == 6 && mom.size() == 3 &&
                    eps.size() == 3, "dwconv_bn_train_qkv: three projections");
  const auto proj = [&](int i) {
    return DwBnProj{w[i], bnw.get(i), bnb.get(i), running[2 * i], running[2 * i + 1], mom[i], eps[i]};
  };
  std::vector<at::Tensor> out;
  for (const auto& [y, mean, invstd] : dwconv_bn_train_qkv_cuda(x, proj(0), proj(1), proj(2), h, wd, sq, skv, cls))
    out.insert(out.end(), {y, mean, invstd});
  return out;
}

// grads, weights, bn_weights, means, invstds (q, k, v each) -> (dx, dweight, dbn_weight, dbn_bias) per
// projection; with sum_dx, where the library sums: q's dx the three's sum, k's and v's None.
inline std::vector<OptT> dwconv_bn_backward_qkv_op(const at::Tensor& x, at::TensorList g, at::TensorList w,
                                                         const OptList& bnw, at::TensorList mean,
                                                         at::TensorList invstd, int64_t h, int64_t wd, int64_t sq,
                                                         int64_t skv, int64_t cls, bool sum_dx) {
  TORCH_CHECK_VALUE(g.size() == 3 && w.size() == 3 && bnw.size() == 3 && mean.size() == 3 && invstd.size() == 3,
                    "dwconv_bn_backward_qkv: three projections");
  const auto proj = [&](int i) { return DwBnBwdProj{g[i], w[i], bnw.get(i), mean[i], invstd[i]}; };
  std::vector<OptT> out;
  for (const auto& [dx, dw, dg, db] :
       dwconv_bn_backward_qkv_cuda(x, proj(0), proj(1), proj(2), h, wd, sq, skv, cls, sum_dx))
    out.insert(out.end(), {if_defined(dx), dw, dg, db});
  return out;
}

inline void register_dwconv(torch::Library& pub) {
  define_public(pub, dwconv_schemas());
  define_public(pub, dwbn_sync_schemas());
  impl_op(pub, "dwconv_tokens", &dwconv_tokens_cuda, &dwconv_tokens_autograd);
  impl_op(pub, "dwconv_bn_train", &dwconv_bn_train_cuda, &dwconv_bn_train_autograd);
  impl_op(pub, "dwconv_bn_backward", &dwconv_bn_backward_cuda);
  impl_op(pub, "dwconv_bn_stats", &dwconv_bn_stats_cuda);
  impl_op(pub, "dwconv_bn_apply", &dwconv_bn_apply_cuda);
  impl_op(pub, "dwconv_bn_backward_sums", &dwconv_bn_backward_sums_cuda);
  impl_op(pub, "dwconv_bn_backward_apply", &dwconv_bn_backward_apply_cuda);
}

inline void register_dwconv_private(torch::Library& priv) {
  define_private(priv, dwconv_schemas());
  define_private(priv, dwbn_sync_schemas());
  define_raw(priv, "dwconv_bn(int kernel, Tensor x, Tensor weight, Tensor? bn_weight, Tensor? bn_bias, "
             "Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor(y!) y, Tensor(m!) mean, Tensor(s!) invstd, "
             "float momentum, float eps, int height, int width, int stride, int cls_rows) -> ()", &dwconv_bn_raw);
  define_raw(priv, "dwconv_bn_bwd(int kernel, Tensor grad, Tensor x, Tensor weight, Tensor? bn_weight, Tensor mean, "
             "Tensor invstd, Tensor(a!) dx, Tensor(b!) dweight, Tensor(c!)? dbn_weight, Tensor(d!)? dbn_bias, "
             "int height, int width, int stride, int cls_rows) -> ()", &dwconv_bn_bwd_raw);
  define_raw(priv, "dwconv_bn_train_pair(Tensor x, Tensor w1, Tensor? bn_weight1, Tensor? bn_bias1, "
             "Tensor(a!)? running_mean1, Tensor(b!)? running_var1, float momentum1, float eps1, Tensor w2, "
             "Tensor? bn_weight2, Tensor? bn_bias2, Tensor(c!)? running_mean2, Tensor(d!)? running_var2, "
             "float momentum2, float eps2, int height, int width, int stride, int cls_rows) -> "
             "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", &dwconv_bn_train_pair_op);
  define_raw(priv, "dwconv_bn_backward_pair(Tensor x, Tensor grad1, Tensor w1, Tensor? bn_weight1, Tensor mean1, "
             "Tensor invstd1, Tensor grad2, Tensor w2, Tensor? bn_weight2, Tensor mean2, Tensor invstd2, int height, "
             "int width, int stride, int cls_rows) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
             &dwconv_bn_backward_pair_op);
  define(priv, "dwconv_bn_qkv_plan(Tensor x, Tensor weight, int height, int width, int stride_q, int stride_kv, "
               "int cls_rows, str pass_) -> (int, int)");
  define_raw(priv, "dwconv_bn_train_qkv(Tensor x, Tensor[] weights, Tensor?[] bn_weights, Tensor?[] bn_biases, "
             "Tensor(a!)[] running, float[] momentum, float[] eps, int height, int width, int stride_q, int stride_kv, "
             "int cls_rows) -> Tensor[]", &dwconv_bn_train_qkv_op);
  define_raw(priv, "dwconv_bn_backward_qkv(Tensor x, Tensor[] grads, Tensor[] weights, Tensor?[] bn_weights, "
             "Tensor[] means, Tensor[] invstds, int height, int width, int stride_q, int stride_kv, int cls_rows, "
             "bool sum_dx=False) -> Tensor?[]", &dwconv_bn_backward_qkv_op);
}

}  // namespace cvt
