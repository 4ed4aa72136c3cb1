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

using AttnPlan = KernelPlan<cvt_attn_args>;
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

// ------------------------------------------------------------------------------------ backward
// attention_backward(grad, q, k, v, out, lse, scale, grad_lse=None) -> (dq, dk, dv): the forward's
// q, k, v, its out (packed (B, Lq, H, D)) and lse ((B, H, Lq) padded rows, as the forward returns
// it), grad (B, Lq, H, D) with unit stride along D; grad_lse, when lse itself was used, (B, H, Lq)
// float. dq (B, Lq, H, D), dk and dv (B, Lkv, H, D) new and contiguous.
constexpr const char* kAttentionBwdArgs =
    "(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, Tensor? grad_lse=None)";

// The op family's public ops and their private planner / fallback ops (plans.h: OpSchema).
inline std::vector<OpSchema> attention_schemas() {
  return {{"attention", kAttentionArgs, "(Tensor, Tensor)"},
          {"attention_backward", kAttentionBwdArgs, "(Tensor, Tensor, Tensor)"}};
}

inline void set_bhd(int64_t& sb, int64_t& sm, int64_t& sh, const at::Tensor& t) {
  sb = t.stride(0); sm = t.stride(1); sh = t.stride(2);
}

inline cvt_attnbwd_args attnbwd_args(const at::Tensor& g, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
                                     const std::optional<at::Tensor>& glse, const at::Tensor& dq,
                                     const at::Tensor& dk, const at::Tensor& dv, double scale) {
  cvt_attnbwd_args p{};
  p.batch = q.size(0); p.heads = q.size(2); p.lq = q.size(1); p.lkv = k.size(1); p.head_dim = q.size(3);
  p.q = ptr_of(q); set_bhd(p.q_stride_b, p.q_stride_m, p.q_stride_h, q);
  p.k = ptr_of(k); set_bhd(p.k_stride_b, p.k_stride_m, p.k_stride_h, k);
  p.v = ptr_of(v); set_bhd(p.v_stride_b, p.v_stride_m, p.v_stride_h, v);
  p.o = ptr_of(o); set_bhd(p.o_stride_b, p.o_stride_m, p.o_stride_h, o);
  p.dout = ptr_of(g); set_bhd(p.do_stride_b, p.do_stride_m, p.do_stride_h, g);
  p.lse = static_cast<const float*>(ptr_of(lse)); p.lse_stride_bh = lse.stride(1);
  if (glse) { p.dlse = static_cast<const float*>(ptr_of(*glse)); p.dlse_stride_bh = glse->stride(1); }
  p.dq = ptr_of(dq); set_bhd(p.dq_stride_b, p.dq_stride_m, p.dq_stride_h, dq);
  p.dk = ptr_of(dk); set_bhd(p.dk_stride_b, p.dk_stride_m, p.dk_stride_h, dk);
  p.dv = ptr_of(dv); set_bhd(p.dv_stride_b, p.dv_stride_m, p.dv_stride_h, dv);
  p.scale = static_cast<float>(scale);
  p.device_id = q.device().index();
  return p;
}

inline std::string attnbwd_what(const cvt_attnbwd_args& p) {
  return "attention backward B=" + std::to_string(p.batch) + " H=" + std::to_string(p.heads) + " Lq=" +
         std::to_string(p.lq) + " Lkv=" + std::to_string(p.lkv) + " D=" + std::to_string(p.head_dim) +
         (p.dlse ? " with an lse gradient" : "");
}

using AttnBwdPlan = KernelPlan<cvt_attnbwd_args>;
inline PlanCache<AttnBwdPlan> g_attn_bwd_plans;
inline auto& g_attn_bwd_plans_registered = register_cache(g_attn_bwd_plans);

using AttentionBwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    double, const std::optional<at::Tensor>&);

inline std::shared_ptr<const AttnBwdPlan> make_attn_bwd_plan(Key key, const at::Tensor& g, const at::Tensor& q,
                                                             const at::Tensor& k, const at::Tensor& v,
                                                             const at::Tensor& o, const at::Tensor& lse, double scale,
                                                             const std::optional<at::Tensor>& glse) {
  static auto planner = python_op<std::tuple<int64_t, int64_t>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      double, const std::optional<at::Tensor>&)>("cvt_cutlass_C::attention_backward_plan");
  auto plan = std::make_shared<AttnBwdPlan>();
  std::tie(plan->code, plan->source) = planner.call(g, q, k, v, o, lse, scale, glse);
  if (plan->code >= 0) {
    const Kernel& kern = kernel_of_family(plan->code, {CVT_FAMILY_ATTENTION_BWD}, "an attention backward");
    const at::Tensor dq = meta_like(q.sizes(), q), dkv = meta_like(k.sizes(), k);
    plan->args = attnbwd_args(g, q, k, v, o, lse, glse, dq, dkv, dkv, scale);
    plan->args.deterministic = at::globalContext().deterministicAlgorithms();  // in the key too
    check_can_implement(kern.can_implement(plan->args), kern, [&] { return attnbwd_what(plan->args); });
    plan->workspace = kern.workspace_size(plan->args);
    plan->kernel = &kern;
  }
  return g_attn_bwd_plans.insert(std::move(key), std::move(plan));
}

// lse as the kernels read it: float (B, H, Lq) with unit stride along Lq and rows a multiple of 8
// floats apart, B-stride H rows; the forward returns it so, another layout (e.g. a traced graph's
// contiguous copy) is copied once into it (B*H*Lq floats).
inline at::Tensor kernel_lse(const at::Tensor& lse) {
  if (lse.dim() != 3 || lse.scalar_type() != at::kFloat || !lse.is_cuda()) return lse;  // the planner raises
  if (lse.stride(2) == 1 && lse.stride(1) % 8 == 0 && lse.stride(0) == lse.size(1) * lse.stride(1)) return lse;
  at::Tensor out = new_lse(lse.permute({0, 2, 1}), nullptr);  // (B, Lq, H) sizes -> (B, H, Lq) padded
  return out.copy_(lse);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
    const at::Tensor& lse_in, double scale, const std::optional<at::Tensor>& glse_in) {
  const at::Tensor lse = kernel_lse(lse_in);
  std::optional<at::Tensor> glse = glse_in;
  if (glse && glse->dim() == 3 && !(glse->stride(2) == 1 && glse->stride(0) == glse->size(1) * glse->stride(1)))
    glse = glse->contiguous();
  Key key(kAttentionBackward);
  for (const at::Tensor* t : {&g, &q, &k, &v, &o, &lse}) key.add(*t);
  key.add(glse);
  key.add(int64_t(at::globalContext().deterministicAlgorithms()));  // the planner's answer depends on it
  auto plan = g_attn_bwd_plans.find(key);
  if (!plan) plan = make_attn_bwd_plan(std::move(key), g, q, k, v, o, lse, scale, glse);
  TORCH_CHECK_VALUE(scale > 0 && std::isfinite(scale),
                    "cvt_cutlass.attention_backward: scale must be a positive number, got " + std::to_string(scale));
  const bool ok = aligned16(g) && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(o) && aligned16(lse);
  if (plan->code == kPlanFallback || !ok) {
    static auto fallback = python_op<AttentionBwdSig>("cvt_cutlass_C::attention_backward_fallback");
    return fallback.call(g, q, k, v, o, lse, scale, glse);
  }
  const OnDevice on(q);
  at::Tensor dq = on.empty(q.sizes(), q.scalar_type());
  at::Tensor dk = on.empty(k.sizes(), k.scalar_type()), dv = on.empty(v.sizes(), v.scalar_type());
  if (plan->code == kPlanEmpty) return {dq.zero_(), dk.zero_(), dv.zero_()};
  cvt_attnbwd_args p = plan->args;
  p.q = q.data_ptr(); p.k = k.data_ptr(); p.v = v.data_ptr(); p.o = o.data_ptr(); p.dout = g.data_ptr();
  p.lse = static_cast<const float*>(lse.data_ptr());
  p.dlse = glse ? static_cast<const float*>(glse->data_ptr()) : nullptr;
  p.dq = dq.data_ptr(); p.dk = dk.data_ptr(); p.dv = dv.data_ptr();
  p.scale = static_cast<float>(scale);
  check_launch(launch(*plan->kernel, p, plan->workspace, on), *plan->kernel, [&] { return attnbwd_what(p); });
  count_call(kAttentionBackward, plan->source);
  return {dq, dk, dv};
}

// The backward with a given kernel into given outputs (profile sweeps, tests), every check on every call.
inline void attention_backward_raw(int64_t id, const at::Tensor& g, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
                                   const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv, double scale) {
  const Kernel& kern = kernel_of_family(id, {CVT_FAMILY_ATTENTION_BWD}, "an attention backward");
  for (const at::Tensor* t : {&g, &q, &k, &v, &o, &dq, &dk, &dv}) {
    TORCH_CHECK(t->dim() == 4 && t->stride(3) == 1, "cvt_cutlass: attention backward tensors must be (B, L, H, D) "
                                                     "with unit stride along D");
    TORCH_CHECK(t->device() == q.device() && t->scalar_type() == q.scalar_type(),
                "cvt_cutlass: attention backward tensors must share q's device and dtype");
    TORCH_CHECK(aligned16(*t), "cvt_cutlass: kernel " + kern.name + ": every tensor must start 16-byte aligned");
  }
  TORCH_CHECK(g.sizes() == q.sizes() && o.sizes() == q.sizes() && dq.sizes() == q.sizes() && k.sizes() == v.sizes() &&
                  dk.sizes() == k.sizes() && dv.sizes() == k.sizes() && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2) && k.size(3) == q.size(3),
              "cvt_cutlass: q/grad/out/dq " + dims(q.sizes()) + " and k/v/dk/dv " + dims(k.sizes()) + " do not match");
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(2) && lse.size(2) == q.size(1) &&
                  lse.stride(2) == 1 && lse.stride(0) == q.size(2) * lse.stride(1) && lse.scalar_type() == at::kFloat &&
                  lse.device() == q.device(),
              "cvt_cutlass: lse must be a float (B, H, Lq) view with packed padded rows");
  cvt_attnbwd_args p = attnbwd_args(g, q, k, v, o, lse, std::nullopt, dq, dk, dv, scale);
  p.deterministic = at::globalContext().deterministicAlgorithms();  // as the planned path asks
  check_can_implement(kern.can_implement(p), kern, [&] { return attnbwd_what(p); });
  check_launch(launch(kern, p, kern.workspace_size(p), OnDevice(q)), kern, [&] { return attnbwd_what(p); });
}

// ------------------------------------------------------------------------------------ autograd
using AttentionSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        double);

// Saves q, k, v and the outputs (out, lse): the backward kernels recompute the probabilities from
// lse. A gradient reaching lse itself (rare) is folded into the kernels' rowsum(dout * out) term.
struct AttentionFn : torch::autograd::Function<AttentionFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               double scale) {
    static auto op = public_op<AttentionSig>("cvt_cutlass::attention");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [o, lse] = op.call(q, k, v, scale);
    ctx->saved_data["scale"] = scale;
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({q, k, v, o, lse});
    return {o, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto bwd = public_op<AttentionBwdSig>("cvt_cutlass::attention_backward");
    const auto s = ctx->get_saved_variables();
    at::Tensor g = grads[0];
    const at::Tensor& gl = grads[1];
    if (!g.defined() && !gl.defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    if (!g.defined()) g = at::zeros_like(s[3]);
    else if (g.sym_stride(3) != 1) g = g.contiguous();  // an expanded / transposed grad: copied once
    std::optional<at::Tensor> glse;
    if (gl.defined()) glse = gl.contiguous();
    auto [dq, dk, dv] = bwd.call(g, s[0], s[1], s[2], s[3], s[4], ctx->saved_data["scale"].toDouble(), glse);
    return {ctx->needs_input_grad(0) ? dq : at::Tensor(), ctx->needs_input_grad(1) ? dk : at::Tensor(),
            ctx->needs_input_grad(2) ? dv : at::Tensor(), at::Tensor()};
  }
};

inline std::tuple<at::Tensor, at::Tensor> attention_autograd(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, double scale) {
  if (any_requires_grad({&q, &k, &v})) {
    auto out = AttentionFn::apply(q, k, v, scale);
    return {out[0], out[1]};
  }
  static auto op = public_op<AttentionSig>("cvt_cutlass::attention");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(q, k, v, scale);
}

inline void register_attention(torch::Library& pub) {
  define_public(pub, attention_schemas());
  impl_op(pub, "attention", &attention_cuda, &attention_autograd);
  impl_op(pub, "attention_backward", &attention_backward_cuda);
}

inline void register_attention_private(torch::Library& priv) {
  define_private(priv, attention_schemas());
  define_raw(priv, "attention(int kernel, Tensor q, Tensor k, Tensor v, Tensor(o!) o, Tensor(l!) lse, float scale) -> ()",
             &attention_raw);
  define_raw(priv, "attention_backward(int kernel, Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
             "Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, float scale) -> ()", &attention_backward_raw);
}

}  // namespace cvt
