// The token-embedding conv: torch.ops.cvt_cutlass.conv2d_nhwc and its backward
// conv2d_nhwc_backward (Python side: cvt_cutlass/ops/conv2d.py), the C++ autograd formula joining
// them, and the raw launches by kernel id (conv2d, depthwise and conv-backward kernels; sweeps, tests).
//
// y = conv2d(x, w) + bias: x (N, H, W, C) packed NHWC, w (K, R, S, C), bias (K,), all in x's
// dtype; y (N, P, Q, K) new and contiguous: the next stage's tokens without a permute.
#pragma once
#include "../plans.h"

namespace cvt {

constexpr const char* kConv2dArgs = "(Tensor x, Tensor weight, Tensor? bias, int stride, int padding)";

inline int64_t conv_out(int64_t size, int64_t k, int64_t stride, int64_t pad) { return (size + 2 * pad - k) / stride + 1; }

// The ABI arguments of a conv on NHWC views x and y (image strides may exceed H*W*C when
// `cls_rows` rows stand in front of each image's spatial tokens).
inline cvt_conv_args conv_args(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                               const at::Tensor& y, int64_t r, int64_t s, int64_t pad, int64_t stride,
                               int64_t cls_rows) {
  cvt_conv_args p{};
  p.n = x.size(0); p.h = x.size(1); p.w = x.size(2); p.c = x.size(3);
  p.k = y.size(3); p.r = r; p.s = s; p.p = y.size(1); p.q = y.size(2);
  p.pad_h = pad; p.pad_w = pad; p.stride_h = stride; p.stride_w = stride;
  p.dilation_h = 1; p.dilation_w = 1;
  p.x = x.data_ptr(); p.x_image_stride = x.size(0) > 1 ? x.stride(0) : (cls_rows + p.h * p.w) * p.c;
  p.filter = w.data_ptr();
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.y = ptr_of(y); p.y_image_stride = y.size(0) > 1 ? y.stride(0) : (cls_rows + p.p * p.q) * p.k;
  p.cls_rows = cls_rows;
  p.device_id = x.device().index();
  return p;
}

inline std::string conv_what(const cvt_conv_args& p) {
  return "x [" + std::to_string(p.n) + ", " + std::to_string(p.h) + ", " + std::to_string(p.w) + ", " +
         std::to_string(p.c) + "] (image stride " + std::to_string(p.x_image_stride) + ") -> y [" +
         std::to_string(p.n) + ", " + std::to_string(p.p) + ", " + std::to_string(p.q) + ", " + std::to_string(p.k) +
         "] (image stride " + std::to_string(p.y_image_stride) + "), filter " + std::to_string(p.r) + "x" +
         std::to_string(p.s) + ", padding " + std::to_string(p.pad_h) + ", stride " + std::to_string(p.stride_h) +
         ", " + std::to_string(p.cls_rows) + " cls row(s)";
}

// A conv family's plan (conv2d_nhwc and dwconv_tokens share it).
struct ConvPlan : ShapedPlan<cvt_conv_args> {
  int64_t x_offset = 0, y_offset = 0;  // elements from the tensors' starts to the first spatial token
};

inline void conv_plan_kernel(ConvPlan& plan, const cvt_conv_args& args) {
  const Kernel& kern = kernel_of_family(plan.code, {CVT_FAMILY_CONV2D_FPROP, CVT_FAMILY_DWCONV2D}, "a conv");
  plan.args = args;
  plan_pointer(plan.args.x);
  plan_pointer(plan.args.filter);
  plan_pointer(plan.args.bias);
  plan_pointer(plan.args.y);
  check_can_implement(kern.can_implement(plan.args), kern, [&] { return conv_what(plan.args); });
  plan.workspace = kern.workspace_size(plan.args);
  plan.kernel = &kern;
}

// The hot path of a planned conv: outputs, pointers, launch. `out` is the new output tensor.
inline void conv_launch(const ConvPlan& plan, const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias, const at::Tensor& out, Op op, const OnDevice& on) {
  cvt_conv_args p = plan.args;
  p.x = static_cast<const char*>(x.data_ptr()) + plan.x_offset * x.element_size();
  p.filter = w.data_ptr();
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.y = static_cast<char*>(out.data_ptr()) + plan.y_offset * out.element_size();
  check_launch(launch(*plan.kernel, p, plan.workspace, on), *plan.kernel, [&] { return conv_what(p); });
  count_call(op, plan.source);
}

inline PlanCache<ConvPlan> g_conv2d_plans;
inline auto& g_conv2d_plans_registered = register_cache(g_conv2d_plans);

inline std::shared_ptr<const ConvPlan> make_conv2d_plan(Key key, const at::Tensor& x, const at::Tensor& w,
                                                        const std::optional<at::Tensor>& bias, int64_t stride,
                                                        int64_t pad) {
  static auto planner = python_op<std::tuple<int64_t, int64_t>(const at::Tensor&, const at::Tensor&,
                                                               const std::optional<at::Tensor>&, int64_t, int64_t)>(
      "cvt_cutlass_C::conv2d_nhwc_plan");
  auto plan = std::make_shared<ConvPlan>();
  std::tie(plan->code, plan->source) = planner.call(x, w, bias, stride, pad);
  if (plan->code == kPlanFallback) return g_conv2d_plans.insert(std::move(key), std::move(plan));
  const int64_t r = w.size(1), s = w.size(2);
  plan->out_sizes = {x.size(0), conv_out(x.size(1), r, stride, pad), conv_out(x.size(2), s, stride, pad), w.size(0)};
  if (plan->code >= 0) conv_plan_kernel(*plan, conv_args(x, w, bias, meta_like(plan->out_sizes, x), r, s, pad, stride, 0));
  return g_conv2d_plans.insert(std::move(key), std::move(plan));
}

inline at::Tensor conv2d_nhwc_cuda(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                                   int64_t stride, int64_t pad) {
  Key key(kConv2d);
  key.add(x); key.add(w); key.add(bias); key.add(stride); key.add(pad);
  auto plan = g_conv2d_plans.find(key);
  if (!plan) plan = make_conv2d_plan(std::move(key), x, w, bias, stride, pad);
  if (plan->code != kPlanFallback && aligned16(x) && aligned16(w) && aligned16(bias)) {
    const OnDevice on(x);
    at::Tensor out = on.empty(plan->out_sizes, x.scalar_type());
    if (plan->code >= 0) conv_launch(*plan, x, w, bias, out, kConv2d, on);
    return out;
  }
  static auto fallback = python_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                              int64_t, int64_t)>("cvt_cutlass_C::conv2d_nhwc_fallback");
  return fallback.call(x, w, bias, stride, pad);
}

// ------------------------------------------------------------------------------------ raw launch
// An NHWC image batch view: (N, H, W, C) with packed pixels; the image stride may exceed H*W*C.
inline void check_nhwc(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 4, std::string("cvt_cutlass: ") + what + " must be a 4-D NHWC view, got " + dims(t.sizes()));
  TORCH_CHECK(t.stride(3) == 1 && t.stride(2) == t.size(3) && t.stride(1) == t.size(2) * t.size(3),
              std::string("cvt_cutlass: ") + what + " must have packed (H, W, C) pixels, got strides " + dims(t.strides()));
}

// y = conv(x, w) + bias with a given kernel (profile sweeps, tests), every check on every call.
// Implicit-GEMM fprop: w (K, R, S, C), bias (K,), in x's dtype. Depthwise: w (R, S, C) and bias
// (C,) in fp32; ``cls_rows`` rows in front of each image of x are copied to the rows in front of
// the same image of y (both views start after them).
inline void conv2d_raw(int64_t id, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                       const at::Tensor& y, at::IntArrayRef padding, at::IntArrayRef stride, int64_t cls_rows) {
  const Kernel& k = kernel_of_family(id, {CVT_FAMILY_CONV2D_FPROP, CVT_FAMILY_DWCONV2D}, "a conv");
  const bool dw = k.family == CVT_FAMILY_DWCONV2D;
  TORCH_CHECK(padding.size() == 2 && stride.size() == 2 && padding[0] == padding[1] && stride[0] == stride[1],
              "cvt_cutlass: padding and stride must be two equal values");
  check_nhwc(x, "x");
  check_nhwc(y, "y");
  TORCH_CHECK(y.device() == x.device() && y.scalar_type() == x.scalar_type() && w.device() == x.device(),
              "cvt_cutlass: " + k.name + ": x, w and y must share a device, x and y a dtype");
  const auto wdt = dw ? at::kFloat : x.scalar_type();
  TORCH_CHECK(w.scalar_type() == wdt && w.is_contiguous(), "cvt_cutlass: " + k.name + ": the filter must be contiguous " +
              std::string(c10::toString(wdt)) + ", got " + std::string(c10::toString(w.scalar_type())));
  const int64_t kout = y.size(3);
  if (dw) {
    TORCH_CHECK(w.dim() == 3 && w.size(2) == x.size(3) && kout == x.size(3),
                "cvt_cutlass: depthwise filter must be (R, S, C) with C = x's and y's channels");
  } else {
    TORCH_CHECK(w.dim() == 4 && w.size(0) == kout && w.size(3) == x.size(3),
                "cvt_cutlass: conv filter must be (K, R, S, C) with K = y's and C = x's channels, got " + dims(w.sizes()));
  }
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == kout && bias->is_contiguous() && bias->device() == x.device() &&
                    bias->scalar_type() == wdt,
                "cvt_cutlass: bias must be a contiguous (K,) " + std::string(c10::toString(wdt)) + " vector on x's device");
  }
  TORCH_CHECK(y.size(0) == x.size(0), "cvt_cutlass: x and y batch sizes differ");
  TORCH_CHECK(cls_rows >= 0 && (cls_rows == 0 || dw), "cvt_cutlass: cls_rows is a depthwise-only option");
  TORCH_CHECK(x.storage_offset() >= cls_rows * x.size(3) && y.storage_offset() >= cls_rows * kout,
              "cvt_cutlass: the views must start after " + std::to_string(cls_rows) + " cls row(s) of their storage");
  const int64_t r = dw ? w.size(0) : w.size(1), s = dw ? w.size(1) : w.size(2);
  cvt_conv_args p = conv_args(x, w, bias, y, r, s, padding[0], stride[0], cls_rows);
  check_can_implement(k.can_implement(p), k, [&] { return conv_what(p); });
  check_launch(launch(k, p, k.workspace_size(p), OnDevice(x)), k, [&] { return conv_what(p); });
}

// ------------------------------------------------------------------------------------ backward
// conv2d_nhwc_backward(grad, x, weight, stride, padding, need_dx, need_dw, need_db) -> (dx, dw, db):
// grad (N, P, Q, K) packed, x (N, H, W, C), weight (K, R, S, C). dx by the dgrad kernel, dw by the
// wgrad kernel (GEMM-K split, fp32 partials summed in order) and db (K,) by a row-sum pass in the
// wgrad kernel's launch. What is not asked for comes back as an empty (0,) tensor. A part no kernel
// serves (the 4-channel stem's dx, fp32, CPU, ...) runs the PyTorch fallback for that part only
// (counted and logged; strict mode raises).
constexpr const char* kConv2dBwdArgs =
    "(Tensor grad, Tensor x, Tensor weight, int stride, int padding, bool need_dx, bool need_dw, bool need_db)";

// The op family's public ops and their private planner / fallback ops (plans.h: OpSchema).
inline std::vector<OpSchema> conv2d_schemas() {
  // the backward's planner: (dgrad kernel, its source, wgrad kernel, its source)
  return {{"conv2d_nhwc", kConv2dArgs, "Tensor"},
          {"conv2d_nhwc_backward", kConv2dBwdArgs, "(Tensor, Tensor, Tensor)", "(int, int, int, int)"}};
}

using ConvBwdPart = KernelPlan<cvt_convbwd_args>;
struct ConvBwdPlan {
  ConvBwdPart dgrad, wgrad;
};
inline PlanCache<ConvBwdPlan> g_conv2d_bwd_plans;
inline auto& g_conv2d_bwd_plans_registered = register_cache(g_conv2d_bwd_plans);

inline cvt_convbwd_args convbwd_args(const at::Tensor& g, const at::Tensor& x, const at::Tensor& w, int64_t stride,
                                     int64_t pad) {
  cvt_convbwd_args p{};
  p.n = x.size(0); p.h = x.size(1); p.w = x.size(2); p.c = x.size(3);
  p.k = w.size(0); p.r = w.size(1); p.s = w.size(2); p.p = g.size(1); p.q = g.size(2);
  p.pad_h = pad; p.pad_w = pad; p.stride_h = stride; p.stride_w = stride; p.dilation_h = 1; p.dilation_w = 1;
  p.device_id = x.device().index();
  return p;
}

inline std::string convbwd_what(const cvt_convbwd_args& p) {
  return "the conv backward of x [" + std::to_string(p.n) + ", " + std::to_string(p.h) + ", " + std::to_string(p.w) +
         ", " + std::to_string(p.c) + "] with filter [" + std::to_string(p.k) + ", " + std::to_string(p.r) + ", " +
         std::to_string(p.s) + ", " + std::to_string(p.c) + "], stride " + std::to_string(p.stride_h) +
         ", padding " + std::to_string(p.pad_h);
}

// Plan one part: the library must be a conv-backward one of the right pass and accept the problem.
inline void plan_convbwd_part(ConvBwdPart& part, const cvt_convbwd_args& base, bool dgrad, bool db) {
  if (part.code < 0) return;
  const Kernel& kern = kernel_of_family(part.code, {CVT_FAMILY_CONV2D_BWD}, "a conv backward");
  TORCH_CHECK(kern.name.find(dgrad ? "_dgrad_" : "_wgrad_") != std::string::npos,
              "cvt_cutlass: " + kern.name + " is not a conv " + (dgrad ? "dgrad" : "wgrad") + " kernel");
  part.args = base;
  part.args.dy = kPlanPointer;
  if (dgrad) { part.args.filter = kPlanPointer; part.args.dx = kPlanPointer; }
  else { part.args.x = kPlanPointer; part.args.dw = kPlanPointer; part.args.db = db ? kPlanPointer : nullptr; }
  check_can_implement(kern.can_implement(part.args), kern, [&] { return convbwd_what(part.args); });
  part.workspace = kern.workspace_size(part.args);
  part.kernel = &kern;
}

inline std::shared_ptr<const ConvBwdPlan> make_conv2d_bwd_plan(Key key, const at::Tensor& g, const at::Tensor& x,
                                                               const at::Tensor& w, int64_t stride, int64_t pad,
                                                               bool nx, bool nw, bool nb) {
  static auto planner = python_op<std::tuple<int64_t, int64_t, int64_t, int64_t>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool, bool, bool)>(
      "cvt_cutlass_C::conv2d_nhwc_backward_plan");
  auto plan = std::make_shared<ConvBwdPlan>();
  std::tie(plan->dgrad.code, plan->dgrad.source, plan->wgrad.code, plan->wgrad.source) =
      planner.call(g, x, w, stride, pad, nx, nw, nb);
  const cvt_convbwd_args base = convbwd_args(g, x, w, stride, pad);
  plan_convbwd_part(plan->dgrad, base, true, false);
  plan_convbwd_part(plan->wgrad, base, false, nb);
  return g_conv2d_bwd_plans.insert(std::move(key), std::move(plan));
}

using Conv2dBwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                    const at::Tensor&, int64_t, int64_t, bool, bool,
                                                                    bool);

// The weight-gradient part of conv2d_nhwc_backward_cuda: (dw, db) written by the wgrad kernel, on
// the side stream where `side` takes the embedding group (its outputs allocated here, on the current
// stream; g and x held until the join).
inline std::pair<at::Tensor, at::Tensor> conv2d_wgrad_part(const ConvBwdPlan& plan, const at::Tensor& g,
                                                           const at::Tensor& x, const at::Tensor& w, bool nb,
                                                           SideStream& side, const OnDevice& on) {
  at::Tensor dw = on.empty(w.sizes(), x.scalar_type()), db = on.empty({nb ? w.size(0) : 0}, x.scalar_type());
  if (plan.wgrad.code == kPlanEmpty) {
    dw.zero_();
    db.zero_();
    return {dw, db};
  }
  auto wgrad = [&] {  // (OnDevice here: the stream current inside side.run)
    cvt_convbwd_args p = plan.wgrad.args;
    p.dy = g.data_ptr(); p.x = x.data_ptr(); p.dw = dw.data_ptr(); p.db = nb ? db.data_ptr() : nullptr;
    const Kernel& k = *plan.wgrad.kernel;
    check_launch(launch(k, p, plan.wgrad.workspace, OnDevice(x)), k, [&] { return convbwd_what(p); });
  };
  if (side.takes(kSideEmbed)) side.run(wgrad, {g, x});
  else wgrad();
  count_call(kConv2dBackward, plan.wgrad.source);
  return {dw, db};
}

inline at::Tensor conv2d_dgrad_part(const ConvBwdPlan& plan, const at::Tensor& g, const at::Tensor& x,
                                    const at::Tensor& w, const OnDevice& on) {
  at::Tensor dx = on.empty(x.sizes(), x.scalar_type());
  if (plan.dgrad.code == kPlanEmpty) return dx.zero_();
  cvt_convbwd_args p = plan.dgrad.args;
  p.dy = g.data_ptr(); p.filter = w.data_ptr(); p.dx = dx.data_ptr();
  const Kernel& k = *plan.dgrad.kernel;
  check_launch(launch(k, p, plan.dgrad.workspace, on), k, [&] { return convbwd_what(p); });
  count_call(kConv2dBackward, plan.dgrad.source);
  return dx;
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_nhwc_backward_cuda(const at::Tensor& g,
                                                                                const at::Tensor& x,
                                                                                const at::Tensor& w, int64_t stride,
                                                                                int64_t pad, bool nx, bool nw,
                                                                                bool nb) {
  Key key(kConv2dBackward);
  key.add(g); key.add(x); key.add(w); key.add(stride); key.add(pad);
  key.add(int64_t(nx) | int64_t(nw) << 1 | int64_t(nb) << 2);
  auto plan = g_conv2d_bwd_plans.find(key);
  if (!plan) plan = make_conv2d_bwd_plan(std::move(key), g, x, w, stride, pad, nx, nw, nb);
  const bool ok = aligned16(g) && aligned16(x) && aligned16(w);
  // The parts a kernel serves on this call; the rest go to the fallback together.
  const bool kx = nx && ok && plan->dgrad.code != kPlanFallback;
  const bool kw = (nw || nb) && ok && plan->wgrad.code != kPlanFallback;
  std::tuple<at::Tensor, at::Tensor, at::Tensor> out;
  if ((nx && !kx) || ((nw || nb) && !kw)) {
    static auto fallback = python_op<Conv2dBwdSig>("cvt_cutlass_C::conv2d_nhwc_backward_fallback");
    out = fallback.call(g, x, w, stride, pad, nx && !kx, nw && !kw, nb && !kw);
  }
  if (!kx && !kw) return out;
  const OnDevice on(x);
  auto empty = [&] { return on.empty({0}, x.scalar_type()); };
  // Where both parts run kernels, the weight gradient goes on the side stream beside the dgrad (the
  // input gradient the previous stage's backward waits for), joined before the op returns: none of
  // the side stream's memory leaves the op.
  SideStream side(x, kx && kw && plan->dgrad.code != kPlanEmpty && plan->wgrad.code != kPlanEmpty);
  if (kw) {
    auto [dw, db] = conv2d_wgrad_part(*plan, g, x, w, nb, side, on);
    std::get<1>(out) = nw ? dw : empty();
    std::get<2>(out) = db;
  }
  if (kx) std::get<0>(out) = conv2d_dgrad_part(*plan, g, x, w, on);
  side.join();
  for (at::Tensor* t : {&std::get<0>(out), &std::get<1>(out), &std::get<2>(out)})
    if (!t->defined()) *t = empty();
  return out;
}

// dx / dw (+ db) of a conv with a given dgrad or wgrad kernel (profile sweeps, tests), every check
// on every call: dy (N, P, Q, K), x (N, H, W, C) and w (K, R, S, C) packed in one dtype; a dgrad
// kernel writes dx (like x), a wgrad kernel dw (like w) and db ((K,)) when given; splits 0 = auto.
inline void conv2d_bwd_raw(int64_t id, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                           const std::optional<at::Tensor>& dx, const std::optional<at::Tensor>& dw,
                           const std::optional<at::Tensor>& db, int64_t padding, int64_t stride, int64_t splits) {
  const Kernel& k = kernel_of_family(id, {CVT_FAMILY_CONV2D_BWD}, "a conv backward");
  const bool dgrad = k.name.find("_dgrad_") != std::string::npos;
  TORCH_CHECK(dy.dim() == 4 && x.dim() == 4 && w.dim() == 4 && dy.is_contiguous() && x.is_contiguous() &&
                  w.is_contiguous(),
              "cvt_cutlass: dy, x and w must be contiguous 4-D NHWC / KRSC tensors");
  TORCH_CHECK(w.size(3) == x.size(3) && dy.size(0) == x.size(0) && dy.size(3) == w.size(0),
              "cvt_cutlass: dy " + dims(dy.sizes()) + ", x " + dims(x.sizes()) + " and w " + dims(w.sizes()) +
                  " do not describe one conv");
  TORCH_CHECK(stride >= 1 && padding >= 0 && dy.size(1) == conv_out(x.size(1), w.size(1), stride, padding) &&
                  dy.size(2) == conv_out(x.size(2), w.size(2), stride, padding),
              "cvt_cutlass: dy " + dims(dy.sizes()) + " is not the output of x " + dims(x.sizes()) +
                  " under stride " + std::to_string(stride) + ", padding " + std::to_string(padding));
  TORCH_CHECK(splits >= 0 && splits <= 512, "cvt_cutlass: splits must be in [0, 512]");
  auto like = [&](const std::optional<at::Tensor>& t, const at::Tensor& ref, const char* what) {
    TORCH_CHECK(t && t->sizes() == ref.sizes() && t->is_contiguous() && t->scalar_type() == dy.scalar_type() &&
                    t->device() == dy.device(),
                std::string("cvt_cutlass: ") + k.name + " needs " + what + " like " + dims(ref.sizes()));
  };
  for (const at::Tensor* t : {&x, &w})
    TORCH_CHECK(t->scalar_type() == dy.scalar_type() && t->device() == dy.device(),
                "cvt_cutlass: dy, x and w must share a dtype and a device");
  cvt_convbwd_args p = convbwd_args(dy, x, w, stride, padding);
  p.dy = dy.data_ptr();
  if (dgrad) {
    like(dx, x, "dx");
    p.filter = w.data_ptr(); p.dx = dx->data_ptr();
  } else {
    like(dw, w, "dw");
    if (db) like(db, at::empty({w.size(0)}, dy.options().device(at::kMeta)), "db");
    p.x = x.data_ptr(); p.dw = dw->data_ptr(); p.db = db ? db->data_ptr() : nullptr;
    p.splits = static_cast<int>(splits);
  }
  check_can_implement(k.can_implement(p), k, [&] { return convbwd_what(p); });
  check_launch(launch(k, p, k.workspace_size(p), OnDevice(dy)), k, [&] { return convbwd_what(p); });
}

// ------------------------------------------------------------------------------------ autograd
using Conv2dSig = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                             int64_t);

// Saves x and weight only (db comes from the gradient); dx is computed only when x requires grad
// (the image of the stem usually does not), dw and db when asked for.
struct Conv2dFn : torch::autograd::Function<Conv2dFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias, int64_t stride, int64_t pad) {
    static auto op = public_op<Conv2dSig>("cvt_cutlass::conv2d_nhwc");
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["pad"] = pad;
    ctx->saved_data["bias"] = bias.has_value();
    ctx->save_for_backward({x, w});
    return op.call(x, w, bias, stride, pad);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = public_op<Conv2dBwdSig>("cvt_cutlass::conv2d_nhwc_backward");
    const auto s = ctx->get_saved_variables();
    const bool nx = ctx->needs_input_grad(0), nw = ctx->needs_input_grad(1);
    const bool nb = ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2);
    at::Tensor g = grads[0].is_contiguous() ? grads[0] : grads[0].contiguous();  // expanded grads: copied once
    at::Tensor dx, dw, db;
    if (nx || nw || nb)
      std::tie(dx, dw, db) = bwd.call(g, s[0], s[1], ctx->saved_data["stride"].toInt(),
                                      ctx->saved_data["pad"].toInt(), nx, nw, nb);
    return {nx ? dx : at::Tensor(), nw ? dw : at::Tensor(), nb ? db : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

inline at::Tensor conv2d_nhwc_autograd(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                                       int64_t stride, int64_t pad) {
  if (any_requires_grad({&x, &w}, {&bias})) return Conv2dFn::apply(x, w, bias, stride, pad);
  static auto op = public_op<Conv2dSig>("cvt_cutlass::conv2d_nhwc");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(x, w, bias, stride, pad);
}

inline void register_conv2d(torch::Library& pub) {
  define_public(pub, conv2d_schemas());
  impl_op(pub, "conv2d_nhwc", &conv2d_nhwc_cuda, &conv2d_nhwc_autograd);
  impl_op(pub, "conv2d_nhwc_backward", &conv2d_nhwc_backward_cuda);
}

inline void register_conv2d_private(torch::Library& priv) {
  define_private(priv, conv2d_schemas());
  define_raw(priv, "conv2d(int kernel, Tensor x, Tensor w, Tensor? bias, Tensor(y!) y, int[] padding, int[] stride, "
             "int cls_rows) -> ()", &conv2d_raw);
  define_raw(priv, "conv2d_bwd(int kernel, Tensor dy, Tensor x, Tensor w, Tensor(a!)? dx, Tensor(b!)? dw, "
             "Tensor(c!)? db, int padding, int stride, int splits=0) -> ()", &conv2d_bwd_raw);
}

}  // namespace cvt
