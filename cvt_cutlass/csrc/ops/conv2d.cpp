// The token-embedding conv: torch.ops.cvt_cutlass.conv2d_nhwc (Python side: cvt_cutlass/ops/conv2d.py),
// and the raw conv launch by kernel id (conv2d and depthwise kernels; profile sweeps, tests).
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
struct ConvPlan {
  int64_t code = kPlanFallback;
  int64_t source = 0;
  const Kernel* kernel = nullptr;
  cvt_conv_args args{};
  size_t workspace = 0;
  std::vector<int64_t> out_sizes;
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

inline void register_conv2d(torch::Library& m) { define(m, std::string("conv2d_nhwc") + kConv2dArgs + " -> Tensor"); }

inline void register_conv2d_private(torch::Library& m) {
  define(m, std::string("conv2d_nhwc_autograd") + kConv2dArgs + " -> Tensor");
  define(m, std::string("conv2d_nhwc_plan") + kConv2dArgs + " -> (int, int)");
  define(m, std::string("conv2d_nhwc_fallback") + kConv2dArgs + " -> Tensor");
  m.def("conv2d(int kernel, Tensor x, Tensor w, Tensor? bias, Tensor(y!) y, int[] padding, int[] stride, "
        "int cls_rows) -> ()");
}

inline void register_conv2d_cuda(torch::Library& pub) {
  pub.impl("conv2d_nhwc", &conv2d_nhwc_cuda);
}

inline void register_conv2d_raw(torch::Library& priv) {
  priv.impl("conv2d_nhwc_autograd", &conv2d_nhwc_cuda);
  priv.impl("conv2d", &conv2d_raw);
}

}  // namespace cvt
