// Fused attention: torch.ops.cvt_cutlass.attention (Python side: cvt_cutlass/ops/attention.py),
// and the raw launch by kernel id (profile sweeps, tests).
//
// q (B, Lq, H, D), k and v (B, Lkv, H, D) with unit stride along D (other strides free: the
// projections' (B, L, H*D) rows viewed per head); o (B, Lq, H, D) new and packed; lse (B, H, Lq)
// float32 whose (batch, head) rows are padded to a multiple of 32 (strides (H*Lp, Lp, 1)).
#pragma once
#include "../plans.h"

namespace cvt {

constexpr const char* kAttentionArgs = "(Tensor q, Tensor k, Tensor v, float scale)";
constexpr int64_t kLseAlign = 32;

inline cvt_attn_args attn_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
                               const at::Tensor& lse, double scale) {
  cvt_attn_args p{};
  p.batch = q.size(0); p.heads = q.size(2); p.lq = q.size(1); p.lkv = k.size(1); p.head_dim = q.size(3);
  p.q = q.data_ptr(); p.q_stride_b = q.stride(0); p.q_stride_m = q.stride(1); p.q_stride_h = q.stride(2);
  p.k = k.data_ptr(); p.k_stride_b = k.stride(0); p.k_stride_m = k.stride(1); p.k_stride_h = k.stride(2);
  p.v = v.data_ptr(); p.v_stride_b = v.stride(0); p.v_stride_m = v.stride(1); p.v_stride_h = v.stride(2);
  p.o = ptr_of(o);
  p.lse = static_cast<float*>(ptr_of(lse)); p.lse_stride_bh = lse.stride(1);
  p.scale = static_cast<float>(scale);
  p.device_id = q.device().index();
  return p;
}

inline std::string attn_what(const cvt_attn_args& p) {
  return "B=" + std::to_string(p.batch) + " H=" + std::to_string(p.heads) + " Lq=" + std::to_string(p.lq) +
         " Lkv=" + std::to_string(p.lkv) + " D=" + std::to_string(p.head_dim) + " (q strides " +
         std::to_string(p.q_stride_b) + ", " + std::to_string(p.q_stride_m) + ", " + std::to_string(p.q_stride_h) +
         "; k strides " + std::to_string(p.k_stride_b) + ", " + std::to_string(p.k_stride_m) + ", " +
         std::to_string(p.k_stride_h) + ")";
}

inline at::Tensor new_lse(const at::Tensor& q, const OnDevice* on = nullptr) {
  const int64_t b = q.size(0), lq = q.size(1), h = q.size(2), lp = (lq + kLseAlign - 1) / kLseAlign * kLseAlign;
  if (on) return on->empty_strided({b, h, lq}, {h * lp, lp, 1}, at::kFloat);
  return at::empty_strided({b, h, lq}, {h * lp, lp, 1}, q.options().dtype(at::kFloat));
}

struct AttnPlan {
  int64_t code = kPlanFallback;
  int64_t source = 0;
  const Kernel* kernel = nullptr;
  cvt_attn_args args{};
  size_t workspace = 0;
};
inline PlanCache<AttnPlan> g_attn_plans;
inline auto& g_attn_plans_registered = register_cache(g_attn_plans);

inline std::shared_ptr<const AttnPlan> make_attn_plan(Key key, const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v, double scale) {
  static auto planner = python_op<std::tuple<int64_t, int64_t>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                               double)>("cvt_cutlass_C::attention_plan");
  auto plan = std::make_shared<AttnPlan>();
  std::tie(plan->code, plan->source) = planner.call(q, k, v, scale);
  if (plan->code >= 0) {
    const Kernel& kern = kernel_of_family(plan->code, {CVT_FAMILY_ATTENTION}, "an attention");
    const at::Tensor o = meta_like(q.sizes(), q), lse = new_lse(o);
    plan->args = attn_args(q, k, v, o, lse, scale);
    for (const void** p : {&plan->args.q, &plan->args.k, &plan->args.v}) plan_pointer(*p);
    plan_pointer(plan->args.o);
    plan_pointer(plan->args.lse);
    check_can_implement(kern.can_implement(plan->args), kern, [&] { return attn_what(plan->args); });
    plan->workspace = kern.workspace_size(plan->args);
    plan->kernel = &kern;
  }
  return g_attn_plans.insert(std::move(key), std::move(plan));
}

inline std::tuple<at::Tensor, at::Tensor> attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                         double scale) {
  Key key(kAttention);
  key.add(q); key.add(k); key.add(v);
  auto plan = g_attn_plans.find(key);
  if (!plan) plan = make_attn_plan(std::move(key), q, k, v, scale);
  TORCH_CHECK_VALUE(scale > 0 && std::isfinite(scale),
                    "cvt_cutlass.attention: scale must be a positive number, got " + std::to_string(scale));
  if (plan->code != kPlanFallback && aligned16(q) && aligned16(k) && aligned16(v)) {
    const OnDevice on(q);
    at::Tensor o = on.empty(q.sizes(), q.scalar_type()), lse = new_lse(q, &on);
    if (plan->code == kPlanEmpty) return {o, lse};
    cvt_attn_args p = plan->args;
    p.q = q.data_ptr(); p.k = k.data_ptr(); p.v = v.data_ptr(); p.o = o.data_ptr();
    p.lse = static_cast<float*>(lse.data_ptr());
    p.scale = static_cast<float>(scale);
    check_launch(launch(*plan->kernel, p, plan->workspace, on), *plan->kernel, [&] { return attn_what(p); });
    count_call(kAttention, plan->source);
    return {o, lse};
  }
  static auto fallback = python_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                      const at::Tensor&, double)>(
      "cvt_cutlass_C::attention_fallback");
  return fallback.call(q, k, v, scale);
}

// o, lse = attention(q, k, v) with a given kernel (profile sweeps, tests), every check on every call.
inline void attention_raw(int64_t id, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& o, const at::Tensor& lse, double scale) {
  const Kernel& kern = kernel_of_family(id, {CVT_FAMILY_ATTENTION}, "an attention");
  for (const at::Tensor* t : {&q, &k, &v, &o}) {
    TORCH_CHECK(t->dim() == 4 && t->stride(3) == 1, "cvt_cutlass: q, k, v, o must be (B, L, H, D) with unit stride along D");
    TORCH_CHECK(t->device() == q.device() && t->scalar_type() == q.scalar_type(),
                "cvt_cutlass: q, k, v, o must share a device and dtype");
  }
  const int64_t b = q.size(0), lq = q.size(1), h = q.size(2), d = q.size(3), lkv = k.size(1);
  TORCH_CHECK(k.size(0) == b && v.size(0) == b && k.size(2) == h && v.size(2) == h && k.size(3) == d &&
                  v.size(3) == d && v.size(1) == lkv,
              "cvt_cutlass: q " + dims(q.sizes()) + ", k " + dims(k.sizes()) + ", v " + dims(v.sizes()) + " do not match");
  TORCH_CHECK(o.sizes() == q.sizes() && o.is_contiguous(), "cvt_cutlass: o must be a contiguous " + dims(q.sizes()));
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == b && lse.size(1) == h && lse.size(2) == lq && lse.stride(2) == 1 &&
                  lse.stride(0) == h * lse.stride(1) && lse.scalar_type() == at::kFloat && lse.device() == q.device(),
              "cvt_cutlass: lse must be a float (B, H, Lq) view with packed padded rows");
  for (const at::Tensor* t : {&q, &k, &v, &o})
    TORCH_CHECK(aligned16(*t), "cvt_cutlass: kernel " + kern.name + ": q, k, v and o must start 16-byte aligned");
  cvt_attn_args p = attn_args(q, k, v, o, lse, scale);
  check_can_implement(kern.can_implement(p), kern, [&] { return attn_what(p); });
  check_launch(launch(kern, p, kern.workspace_size(p), OnDevice(q)), kern, [&] { return attn_what(p); });
}

inline void register_attention(torch::Library& m) {
  define(m, std::string("attention") + kAttentionArgs + " -> (Tensor, Tensor)");
}

inline void register_attention_private(torch::Library& m) {
  define(m, std::string("attention_autograd") + kAttentionArgs + " -> (Tensor, Tensor)");
  define(m, std::string("attention_plan") + kAttentionArgs + " -> (int, int)");
  define(m, std::string("attention_fallback") + kAttentionArgs + " -> (Tensor, Tensor)");
  m.def("attention(int kernel, Tensor q, Tensor k, Tensor v, Tensor(o!) o, Tensor(l!) lse, float scale) -> ()");
}

inline void register_attention_cuda(torch::Library& pub) {
  pub.impl("attention", &attention_cuda);
}

inline void register_attention_raw(torch::Library& priv) {
  priv.impl("attention_autograd", &attention_cuda);
  priv.impl("attention", &attention_raw);
}

}  // namespace cvt
