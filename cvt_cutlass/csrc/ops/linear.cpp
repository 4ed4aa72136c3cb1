// The Linear ops: torch.ops.cvt_cutlass.linear and linear_gelu_aux (cvt_cutlass/ops/linear.py
// holds their Python side: planner, fallback, fake kernels, autograd), and the raw GEMM launch
// by kernel id that profile sweeps and tests use.
//
// y = epilogue(x W^T): x (..., K) with rows viewable as (M, K) (unit column stride), W (N, K) as
// nn.Linear stores it, bias (N,), residual (..., N); y (..., N) new and contiguous; aux (the
// pre-activation, linear_gelu_aux, or GELU's derivative at it, linear_gelu_dgelu) likewise.
#pragma once
#include "../plans.h"

namespace cvt {

constexpr const char* kLinearArgs =
    "(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None, str activation=\"none\")";
constexpr const char* kGeluAuxArgs = "(Tensor x, Tensor weight, Tensor bias)";

// What a Linear forward stores besides its output (linear_run's `aux`).
constexpr int kAuxNone = 0;   // nothing
constexpr int kAuxZ = 1;      // the pre-activation z in x's dtype (linear_gelu_aux)
constexpr int kAuxDgelu = 2;  // gelu'(z) in fp16 (linear_gelu_dgelu: fc1 of the mlp and layer ops)

// D = epilogue(A @ B^T) on (rows, cols) views: the ABI arguments with every size and stride set;
// the pointers are the caller's (a plan refills them per call).
inline cvt_gemm_args gemm_args(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& c, const at::Tensor& d,
                               const std::optional<at::Tensor>& aux) {
  cvt_gemm_args p{};
  p.m = a.size(0); p.n = b.size(0); p.k = a.size(1);
  p.a = a.data_ptr(); p.lda = a.stride(0);
  p.b = b.data_ptr(); p.ldb = b.stride(0);
  p.d = ptr_of(d); p.ldd = d.stride(0);
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.c = c ? c->data_ptr() : nullptr; p.ldc = c ? c->stride(0) : 0;
  p.aux = aux ? ptr_of(*aux) : nullptr; p.ldaux = aux ? aux->stride(0) : 0;
  p.device_id = a.device().index();
  p.sm_count = 0;  // the kernel library queries and caches it per device
  return p;
}

inline std::string gemm_what(const cvt_gemm_args& p) {
  return "M=" + std::to_string(p.m) + " N=" + std::to_string(p.n) + " K=" + std::to_string(p.k) +
         " (lda=" + std::to_string(p.lda) + ", ldd=" + std::to_string(p.ldd) + ")";
}

using LinearPlan = ShapedPlan<cvt_gemm_args>;  // out_sizes (..., N)
inline PlanCache<LinearPlan> g_linear_plans;
inline auto& g_linear_plans_registered = register_cache(g_linear_plans);

// (kernel, source) of the Python planner that serves the call: linear_gelu_aux's or
// linear_gelu_dgelu's (by `aux`), the row-scaled Linear's (row_scale given: `act` is where the
// scale applies), the rounded one's (an fp32 residual, the output in x's dtype) or linear's.
inline std::tuple<int64_t, int64_t> plan_linear_call(const at::Tensor& x, const at::Tensor& w, const OptT& bias,
                                                     const OptT& res, c10::string_view act, int aux,
                                                     const OptT& row_scale, bool rounded) {
  if (rounded) {
    static auto planner = python_op<std::tuple<int64_t, int64_t>(const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, const at::Tensor&)>(
        "cvt_cutlass_C::linear_rounded_plan");
    return planner.call(x, w, *bias, *res);  // (linear_rounded takes both)
  }
  if (row_scale) {
    static auto planner = python_op<std::tuple<int64_t, int64_t>(const at::Tensor&, const at::Tensor&, const OptT&,
                                                                 const OptT&, const at::Tensor&, c10::string_view)>(
        "cvt_cutlass_C::linear_row_scaled_plan");
    return planner.call(x, w, bias, res, *row_scale, act);
  }
  if (aux) {
    using PlanSig = std::tuple<int64_t, int64_t>(const at::Tensor&, const at::Tensor&, const at::Tensor&);
    static auto z_planner = python_op<PlanSig>("cvt_cutlass_C::linear_gelu_aux_plan");
    static auto dgelu_planner = python_op<PlanSig>("cvt_cutlass_C::linear_gelu_dgelu_plan");
    return (aux == kAuxDgelu ? dgelu_planner : z_planner).call(x, w, *bias);
  }
  static auto planner = python_op<std::tuple<int64_t, int64_t>(const at::Tensor&, const at::Tensor&, const OptT&,
                                                               const OptT&, c10::string_view)>(
      "cvt_cutlass_C::linear_plan");
  return planner.call(x, w, bias, res, act);
}

// One plan: the Python planner's choice, then the kernel library's verdict on this problem.
inline std::shared_ptr<const LinearPlan> make_linear_plan(Key key, const at::Tensor& x, const at::Tensor& w,
                                                          const std::optional<at::Tensor>& bias,
                                                          const std::optional<at::Tensor>& res, c10::string_view act,
                                                          int aux, const OptT& row_scale, bool rounded) {
  auto plan = std::make_shared<LinearPlan>();
  const std::tuple<int64_t, int64_t> choice = plan_linear_call(x, w, bias, res, act, aux, row_scale, rounded);
  std::tie(plan->code, plan->source) = choice;
  const int64_t n = w.size(0), k = w.size(1);
  plan->out_sizes = x.sizes().vec();
  plan->out_sizes.back() = n;
  if (plan->code >= 0) {
    const Kernel& kern = kernel_of_family(plan->code, {CVT_FAMILY_GEMM}, "a GEMM");
    const at::Tensor x2 = x.view({-1, k});  // the planner checked that the rows are a view
    const at::Tensor d = meta_like({x2.size(0), n}, x);
    std::optional<at::Tensor> r2;
    if (res) r2 = res->view({-1, n});
    plan->args = gemm_args(x2, w, bias, r2, d, aux ? std::optional<at::Tensor>(d) : std::nullopt);
    if (row_scale) plan->args.row_scale = static_cast<const float*>(kPlanPointer);
    for (const void** p : {&plan->args.a, &plan->args.b, &plan->args.bias, &plan->args.c}) plan_pointer(*p);
    plan_pointer(plan->args.d);
    plan_pointer(plan->args.aux);
    check_can_implement(kern.can_implement(plan->args), kern, [&] { return gemm_what(plan->args); });
    plan->workspace = kern.workspace_size(plan->args);
    plan->kernel = &kern;
  }
  return g_linear_plans.insert(std::move(key), std::move(plan));
}

// The hot path shared by the ops: plan lookup, alignment check, outputs, launch. aux: kAuxNone,
// kAuxZ or kAuxDgelu (what the second output is; undefined for kAuxNone). row_scale: the
// row-scaled epilogues' (M,) fp32 scale, `act` then where it applies ("branch" / "all");
// rounded: an fp32 residual's sum written in x's dtype (linear_rounded).
inline std::tuple<at::Tensor, at::Tensor> linear_run(const at::Tensor& x, const at::Tensor& w,
                                                     const std::optional<at::Tensor>& bias,
                                                     const std::optional<at::Tensor>& res, c10::string_view act,
                                                     int aux, const OptT& row_scale = std::nullopt,
                                                     bool rounded = false) {
  Key key(aux ? kLinearGeluAux : kLinear);
  key.add(x); key.add(w); key.add(bias); key.add(res); key.add(act); key.add(row_scale);
  key.add(int64_t(rounded) + 2 * int64_t(aux));
  auto plan = g_linear_plans.find(key);
  if (!plan) plan = make_linear_plan(std::move(key), x, w, bias, res, act, aux, row_scale, rounded);
  if (plan->code == kPlanFallback ||
      !(aligned16(x) && aligned16(w) && aligned16(bias) && aligned16(res) && aligned16(row_scale)))
    return {};  // the caller runs the Python fallback
  const OnDevice on(x);
  // an fp32 residual with 16-bit x: the kernel adds it in fp32 and writes fp32 (ops/linear.py),
  // or x's dtype where rounded
  at::Tensor out = on.empty(plan->out_sizes, res && !rounded ? res->scalar_type() : x.scalar_type());
  at::Tensor z = aux ? on.empty(plan->out_sizes, aux == kAuxDgelu ? at::kHalf : x.scalar_type()) : at::Tensor();
  if (plan->code == kPlanEmpty) return {out, z};
  cvt_gemm_args p = plan->args;
  p.a = x.data_ptr(); p.b = w.data_ptr(); p.d = out.data_ptr();
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.c = res ? res->data_ptr() : nullptr;
  p.aux = aux ? z.data_ptr() : nullptr;
  p.row_scale = row_scale ? row_scale->data_ptr<float>() : nullptr;
  check_launch(launch(*plan->kernel, p, plan->workspace, on), *plan->kernel, [&] { return gemm_what(p); });
  count_call(aux ? kLinearGeluAux : kLinear, plan->source);
  return {out, z};
}

inline at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& res, c10::string_view act) {
  auto [out, unused] = linear_run(x, w, bias, res, act, false);
  if (out.defined()) return out;
  static auto fallback = python_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                              const std::optional<at::Tensor>&, c10::string_view)>(
      "cvt_cutlass_C::linear_fallback");
  return fallback.call(x, w, bias, res, act);
}

// fc1 + GELU with its second output (kAuxZ or kAuxDgelu), or the op's Python fallback
// (cvt_cutlass_C::<op>_fallback) where no kernel serves the call.
using GeluPairSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&);
inline std::tuple<at::Tensor, at::Tensor> gelu_pair_run(const at::Tensor& x, const at::Tensor& w,
                                                        const at::Tensor& bias, int aux,
                                                        const c10::TypedOperatorHandle<GeluPairSig>& fallback) {
  auto out = linear_run(x, w, bias, std::nullopt, "gelu", aux);
  return std::get<0>(out).defined() ? out : fallback.call(x, w, bias);
}

inline std::tuple<at::Tensor, at::Tensor> linear_gelu_aux_cuda(const at::Tensor& x, const at::Tensor& w,
                                                               const at::Tensor& bias) {
  static auto fallback = python_op<GeluPairSig>("cvt_cutlass_C::linear_gelu_aux_fallback");
  return gelu_pair_run(x, w, bias, kAuxZ, fallback);
}

// linear_gelu_dgelu(x, W, bias) -> (gelu(z), gelu'(z) in fp16), z = x W^T + b: fc1 of the mlp and
// layer ops, whose backward multiplies fc2's input gradient by the saved derivative (the
// dgelu_saved_dbias dgrad) instead of computing it from z. A private op: no autograd.
inline std::tuple<at::Tensor, at::Tensor> linear_gelu_dgelu_cuda(const at::Tensor& x, const at::Tensor& w,
                                                                 const at::Tensor& bias) {
  static auto fallback = python_op<GeluPairSig>("cvt_cutlass_C::linear_gelu_dgelu_fallback");
  return gelu_pair_run(x, w, bias, kAuxDgelu, fallback);
}

// linear_row_scaled(x, W, bias, residual, row_scale (M,) fp32, scale) -> y: drop path folded into
// the epilogue, per token row s = mask / keep probability: scale "branch": y = (x W^T + b) * s +
// residual (a residual branch's drop path), "all": y = (x W^T + b + residual) * s (drop path
// after the residual add). A private op of the layer op's forward: no autograd (the layer op's
// backward applies the scales itself).
constexpr const char* kRowScaledArgs =
    "(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, Tensor row_scale, str scale)";
using RowScaledSig = at::Tensor(const at::Tensor&, const at::Tensor&, const OptT&, const OptT&, const at::Tensor&,
                                c10::string_view);

inline at::Tensor linear_row_scaled_cuda(const at::Tensor& x, const at::Tensor& w, const OptT& bias, const OptT& res,
                                         const at::Tensor& row_scale, c10::string_view scale) {
  auto [out, unused] = linear_run(x, w, bias, res, scale, false, row_scale);
  if (out.defined()) return out;
  static auto fallback = python_op<RowScaledSig>("cvt_cutlass_C::linear_row_scaled_fallback");
  return fallback.call(x, w, bias, res, row_scale, scale);
}

// linear_rounded(x, W, bias, residual) -> y = x W^T + b + residual with an fp32 residual and 16-bit x:
// the sum in fp32, rounded once to x's dtype (a stage's last sum of an fp32 residual stream, where
// the next embedding reads it in 16 bits as HF's autocast rounds it). A private op of the layer
// op's forward: no autograd (the layer op's backward takes the 16-bit gradient as it comes).
constexpr const char* kRoundedArgs = "(Tensor x, Tensor weight, Tensor bias, Tensor residual)";
using RoundedSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);

inline at::Tensor linear_rounded_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                                      const at::Tensor& res) {
  auto [out, unused] = linear_run(x, w, bias, res, "none", false, std::nullopt, true);
  if (out.defined()) return out;
  static auto fallback = python_op<RoundedSig>("cvt_cutlass_C::linear_rounded_fallback");
  return fallback.call(x, w, bias, res);
}

// ------------------------------------------------------------------------------------ backward
// linear_dgrad(grad, W, gelu_input=None, gelu_grad=None) -> (dx, db): dx (..., K) = grad (..., N) . W
// with W (N, K) read in place; with the saved pre-activation Z (..., K) of the GELU that produced
// this layer's input, dx *= gelu'(Z), or with its saved derivative gelu'(Z) (fp16, as
// linear_gelu_dgelu stores it) dx *= gelu_grad, and db (K,) = dx summed over rows, in the GEMM's
// epilogue (db is (0,) without either). linear_wgrad(grad, x, bias) -> (dW, db): dW (N, K) =
// grad^T . x, db (N,) the rows of grad summed in the same GEMM (or (0,) when bias is false).
constexpr const char* kDgradArgs = "(Tensor grad, Tensor weight, Tensor? gelu_input=None, Tensor? gelu_grad=None)";
constexpr const char* kWgradArgs = "(Tensor grad, Tensor x, bool bias)";

inline PlanCache<LinearPlan> g_dgrad_plans;
inline auto& g_dgrad_plans_registered = register_cache(g_dgrad_plans);

// z0 / dg: the saved pre-activation / its GELU derivative, whichever the call has (at most one).
inline std::shared_ptr<const LinearPlan> make_dgrad_plan(Key key, const at::Tensor& g, const at::Tensor& w,
                                                         const OptT& z0, const OptT& dg) {
  static auto planner = python_op<std::tuple<int64_t, int64_t>(const at::Tensor&, const at::Tensor&, const OptT&,
                                                               const OptT&)>("cvt_cutlass_C::linear_dgrad_plan");
  auto plan = std::make_shared<LinearPlan>();
  std::tie(plan->code, plan->source) = planner.call(g, w, z0, dg);
  const OptT& z = z0 ? z0 : dg;
  const int64_t n = w.size(0), k = w.size(1);
  plan->out_sizes = g.sizes().vec();
  plan->out_sizes.back() = k;
  if (plan->code >= 0) {
    const Kernel& kern = kernel_of_family(plan->code, {CVT_FAMILY_GEMM}, "a GEMM");
    const at::Tensor g2 = g.view({-1, n});  // the planner checked that the rows are a view
    cvt_gemm_args& p = plan->args;
    p.m = g2.size(0); p.n = k; p.k = n;
    p.a = kPlanPointer; p.lda = g2.stride(0);
    p.b = kPlanPointer; p.ldb = w.stride(0);
    p.d = kPlanPointer; p.ldd = k;
    if (z) { p.c = kPlanPointer; p.ldc = z->view({-1, k}).stride(0); p.aux = kPlanPointer; }
    p.device_id = g.device().index();
    check_can_implement(kern.can_implement(p), kern, [&] { return gemm_what(p); });
    plan->workspace = kern.workspace_size(p);
    plan->kernel = &kern;
  }
  return g_dgrad_plans.insert(std::move(key), std::move(plan));
}

// z0 / dg: the saved pre-activation / its GELU derivative (at most one); db_to: where fc1's bias
// gradient goes (plans.h: given), or a new tensor
inline std::tuple<at::Tensor, at::Tensor> linear_dgrad_into(const at::Tensor& g, const at::Tensor& w, const OptT& z0,
                                                            const OptT& dg, const OptT& db_to) {
  Key key(kLinearDgrad);
  key.add(g); key.add(w); key.add(z0); key.add(dg);
  key.add(int64_t(at::globalContext().deterministicAlgorithms()));  // the planner's answer depends on it
  auto plan = g_dgrad_plans.find(key);
  if (!plan) plan = make_dgrad_plan(std::move(key), g, w, z0, dg);
  const OptT& z = z0 ? z0 : dg;
  if (plan->code == kPlanFallback || !(aligned16(g) && aligned16(w) && aligned16(z))) {
    static auto fallback = python_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                        const OptT&, const OptT&)>(
        "cvt_cutlass_C::linear_dgrad_fallback");
    auto [dx, db] = fallback.call(g, w, z0, dg);
    return {dx, z ? given(db_to, db) : db};
  }
  const OnDevice on(g);
  at::Tensor dx = on.empty(plan->out_sizes, g.scalar_type());
  at::Tensor db = z && db_to ? *db_to : on.empty({z ? w.size(1) : 0}, g.scalar_type());
  if (plan->code == kPlanEmpty) return {dx, db.zero_()};
  cvt_gemm_args p = plan->args;
  p.a = g.data_ptr(); p.b = w.data_ptr(); p.d = dx.data_ptr();
  if (z) { p.c = z->data_ptr(); p.aux = db.data_ptr(); }
  check_launch(launch(*plan->kernel, p, plan->workspace, on), *plan->kernel, [&] { return gemm_what(p); });
  count_call(kLinearDgrad, plan->source);
  return {dx, db};
}

inline std::tuple<at::Tensor, at::Tensor> linear_dgrad_cuda(const at::Tensor& g, const at::Tensor& w, const OptT& z,
                                                            const OptT& dg) {
  return linear_dgrad_into(g, w, z, dg, std::nullopt);
}

using WgradPlan = KernelPlan<cvt_wgrad_args>;
inline PlanCache<WgradPlan> g_wgrad_plans;
inline auto& g_wgrad_plans_registered = register_cache(g_wgrad_plans);

inline std::string wgrad_what(const cvt_wgrad_args& p) {
  return "dW (" + std::to_string(p.n) + ", " + std::to_string(p.k) + ") over " + std::to_string(p.m) + " rows";
}

// The plan of a weight gradient of g (B, L, N) and x. With `scaled` (a row scale) or `wide` (fp32
// rows rounded to x's dtype), the kernel's row pass writes the dY its GEMM reads; g is then a
// tensor of that copy's dtype and layout (the planner's view of what the GEMM reads).
inline std::shared_ptr<const WgradPlan> make_wgrad_plan(Key key, const at::Tensor& g, const at::Tensor& x, bool bias,
                                                        bool scaled, bool wide) {
  static auto planner = python_op<std::tuple<int64_t, int64_t>(const at::Tensor&, const at::Tensor&, bool)>(
      "cvt_cutlass_C::linear_wgrad_plan");
  auto plan = std::make_shared<WgradPlan>();
  std::tie(plan->code, plan->source) = planner.call(g, x, bias);
  if (plan->code >= 0) {
    const Kernel& kern = kernel_of_family(plan->code, {CVT_FAMILY_WGRAD}, "a weight-gradient");
    const int64_t n = g.size(-1), k = x.size(-1);
    const at::Tensor g2 = g.view({-1, n}), x2 = x.view({-1, k});
    cvt_wgrad_args& p = plan->args;
    p.m = g2.size(0); p.n = n; p.k = k;
    p.dy = kPlanPointer; p.ldy = g2.stride(0);
    p.x = kPlanPointer; p.ldx = x2.stride(0);
    p.dw = kPlanPointer; p.db = bias ? kPlanPointer : nullptr;
    p.row_scale = scaled ? static_cast<const float*>(kPlanPointer) : nullptr;
    p.dy_scaled = scaled || wide ? kPlanPointer : nullptr;
    p.dy_fp32 = wide ? 1 : 0;
    p.device_id = g.device().index();
    check_can_implement(kern.can_implement(p), kern, [&] { return wgrad_what(p); });
    plan->workspace = kern.workspace_size(p);
    plan->kernel = &kern;
  }
  return g_wgrad_plans.insert(std::move(key), std::move(plan));
}

// A per-row scale the kernels take (the GEMM epilogues', the wgrad row-sum pass's): a packed
// (rows,) float32 vector on `device`.
inline bool row_scale_ok(const at::Tensor& rs, int64_t rows, const at::Device& device) {
  return rs.scalar_type() == at::kFloat && rs.dim() == 1 && rs.numel() == rows && rs.is_contiguous() &&
         rs.device() == device;
}

// Whether the wgrad kernels' row pass can write g's (B, L, N) copy for the GEMM: g contiguous with
// columns, rs (where given) row_scale_ok, one per row of g.
inline bool kernel_row_copy(const at::Tensor& g, const OptT& rs) {
  return g.dim() == 3 && g.size(2) > 0 && g.is_contiguous() &&
         (!rs || row_scale_ok(*rs, g.size(0) * g.size(1), g.device()));
}

// (dW, db, the dY they are of, in x's dtype): g's, or with rs g's rows scaled by rs first. With
// `wide_ok` g may be fp32 with x 16-bit (an fp32 residual stream's gradient, the layer op's: rounded
// once, after the scale); otherwise a g of another dtype than x's reaches the planner, which
// refuses it as the op's other paths do. Where g is scaled or rounded, the kernel's row pass
// writes the copy (see kernel_row_copy), which the caller's later GEMMs read. dw_to / db_to: where
// the gradients go (plans.h: given), or new tensors.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_wgrad_scaled_into(const at::Tensor& g0,
                                                                               const at::Tensor& x, bool bias,
                                                                               const OptT& rs, const OptT& dw_to,
                                                                               const OptT& db_to,
                                                                               bool wide_ok = false) {
  const at::ScalarType dt = x.scalar_type();
  const bool wide = wide_ok && g0.scalar_type() == at::kFloat && (dt == at::kHalf || dt == at::kBFloat16);
  const bool in_kernel = (rs || wide) && (wide || g0.scalar_type() == dt) && kernel_row_copy(g0, rs);
  const at::Tensor g = (rs || wide) && !in_kernel ? branch_grad(g0, rs, wide ? dt : g0.scalar_type()) : g0;
  const OnDevice on(g);
  const at::Tensor gs = in_kernel ? on.empty(g.sizes(), dt) : g;  // what the GEMM reads
  Key key(kLinearWgrad);
  key.add(g); key.add(x); key.add(int64_t(bias) + 2 * int64_t(in_kernel && rs) + 4 * int64_t(in_kernel && wide));
  auto plan = g_wgrad_plans.find(key);
  if (!plan) plan = make_wgrad_plan(std::move(key), gs, x, bias, in_kernel && rs, in_kernel && wide);
  if (plan->code == kPlanFallback || !(aligned16(g) && aligned16(x))) {
    static auto fallback = python_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, bool)>(
        "cvt_cutlass_C::linear_wgrad_fallback");
    const at::Tensor gf = in_kernel ? branch_grad(g, rs, dt) : g;
    auto [dw, db] = fallback.call(gf, x, bias);
    return {given(dw_to, dw), bias ? given(db_to, db) : db, gf};
  }
  at::Tensor dw = dw_to ? *dw_to : on.empty({g.size(-1), x.size(-1)}, dt);
  at::Tensor db = bias && db_to ? *db_to : on.empty({bias ? g.size(-1) : 0}, dt);
  if (plan->code == kPlanEmpty) return {dw.zero_(), db.zero_(), in_kernel ? branch_grad(g, rs, dt) : g};
  cvt_wgrad_args p = plan->args;
  p.dy = g.data_ptr(); p.x = x.data_ptr(); p.dw = dw.data_ptr(); p.db = bias ? db.data_ptr() : nullptr;
  p.row_scale = in_kernel && rs ? rs->data_ptr<float>() : nullptr;
  p.dy_scaled = in_kernel ? gs.data_ptr() : nullptr;
  check_launch(launch(*plan->kernel, p, plan->workspace, on), *plan->kernel, [&] { return wgrad_what(p); });
  count_call(kLinearWgrad, plan->source);
  return {dw, db, gs};
}

inline std::tuple<at::Tensor, at::Tensor> linear_wgrad_into(const at::Tensor& g, const at::Tensor& x, bool bias,
                                                            const OptT& dw_to, const OptT& db_to) {
  auto [dw, db, unused] = linear_wgrad_scaled_into(g, x, bias, std::nullopt, dw_to, db_to);
  return {dw, db};
}

inline std::tuple<at::Tensor, at::Tensor> linear_wgrad_cuda(const at::Tensor& g, const at::Tensor& x, bool bias) {
  return linear_wgrad_into(g, x, bias, std::nullopt, std::nullopt);
}

// mlp(x, W1, b1, W2, b2, residual=None) -> (y, hidden, dgelu): fc1 + GELU (hidden = gelu(z), z its
// pre-activation, dgelu = gelu'(z) in fp16) then fc2 (+ residual), two forward kernels; hidden and
// dgelu are what the fused backward (fc2's dgrad multiplies by dgelu and reduces fc1's dbias in its
// epilogue) reads.
constexpr const char* kMlpArgs =
    "(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2, Tensor? residual=None)";

// The op family's public ops and their private planner / fallback ops (plans.h: OpSchema).
inline std::vector<OpSchema> linear_schemas() {
  // mlp plans through its two Linear planners: no planner of its own
  return {{"linear", kLinearArgs, "Tensor"},
          {"linear_gelu_aux", kGeluAuxArgs, "(Tensor, Tensor)"},
          {"mlp", kMlpArgs, "(Tensor, Tensor, Tensor)", ""},
          {"linear_dgrad", kDgradArgs, "(Tensor, Tensor)"},
          {"linear_wgrad", kWgradArgs, "(Tensor, Tensor)"}};
}

// mlp, and with row_scale (the layer op's drop path after fc2's residual add) fc2 as the row-scaled
// Linear with scale "all" (its own fallback where no kernel serves it); `rounded` (no row_scale):
// fc2 as linear_rounded (the fallback's fp32 sum rounded likewise).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> mlp_run(const at::Tensor& x, const at::Tensor& w1,
                                                              const at::Tensor& b1, const at::Tensor& w2,
                                                              const at::Tensor& b2, const OptT& res,
                                                              const OptT& row_scale, bool rounded = false) {
  static auto fallback = python_op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const std::optional<at::Tensor>&)>("cvt_cutlass_C::mlp_fallback");
  static auto scaled_fallback = python_op<RowScaledSig>("cvt_cutlass_C::linear_row_scaled_fallback");
  TORCH_CHECK(!(rounded && row_scale), "cvt_cutlass.mlp: a rounded output takes no row scale");
  auto [hidden, z] = linear_run(x, w1, b1, std::nullopt, "gelu", kAuxDgelu);
  if (!row_scale) {
    auto falls_back = [&] {
      auto [y, h, zz] = fallback.call(x, w1, b1, w2, b2, res);
      return std::make_tuple(rounded ? y.to(x.scalar_type()) : y, h, zz);
    };
    if (!hidden.defined()) return falls_back();
    auto [y, unused] = linear_run(hidden, w2, b2, res, "none", false, std::nullopt, rounded);
    if (!y.defined()) return falls_back();
    count_call(kMlp, 0);
    return {y, hidden, z};
  }
  const bool fc1_ran = hidden.defined();  // with a row scale each half falls back on its own
  if (!fc1_ran) std::tie(hidden, z) = linear_gelu_dgelu_cuda(x, w1, b1);
  at::Tensor y = std::get<0>(linear_run(hidden, w2, b2, res, "all", false, row_scale));
  const bool fc2_ran = y.defined();
  if (!fc2_ran) y = scaled_fallback.call(hidden, w2, b2, res, *row_scale, "all");
  if (fc1_ran && fc2_ran) count_call(kMlp, 0);
  return {y, hidden, z};
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> mlp_cuda(const at::Tensor& x, const at::Tensor& w1,
                                                               const at::Tensor& b1, const at::Tensor& w2,
                                                               const at::Tensor& b2,
                                                               const std::optional<at::Tensor>& res) {
  return mlp_run(x, w1, b1, w2, b2, res, std::nullopt);
}

// ------------------------------------------------------------------------------------ autograd
using LinearSig = at::Tensor(const at::Tensor&, const at::Tensor&, const OptT&, const OptT&, c10::string_view);
using MlpSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, const at::Tensor&, const OptT&);
using DgradSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const OptT&, const OptT&);
using WgradSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, bool);

inline at::Tensor dgrad_call(const at::Tensor& g, const at::Tensor& w, const OptT& z = std::nullopt) {
  static auto op = public_op<DgradSig>("cvt_cutlass::linear_dgrad");
  return std::get<0>(op.call(g, w, z, std::nullopt));
}

// dx, dW, db of a Linear from the gradient of its pre-activation g, each only if asked for: dx by
// the dgrad GEMM, dW and db by one wgrad GEMM (db from g's rows in the same kernel).
inline std::array<at::Tensor, 3> linear_grads(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& w,
                                              bool need_x, bool need_w, bool need_b) {
  static auto wgrad = public_op<WgradSig>("cvt_cutlass::linear_wgrad");
  const at::Tensor g = kernel_rows(grad, w.sym_size(0));
  std::array<at::Tensor, 3> out;
  if (need_x) out[0] = dgrad_call(g, w);
  if (need_w || need_b) {
    auto [dw, db] = wgrad.call(g, x, need_b);
    if (need_w) out[1] = dw;
    if (need_b) out[2] = db;
  }
  return out;
}

// linear: saves x, W and bias (with GELU the pre-activation is recomputed: linear_gelu_aux keeps
// it instead, mlp GELU's derivative at it); the residual's gradient is the output gradient itself.
struct LinearFn : torch::autograd::Function<LinearFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const OptT& bias,
                            const OptT& res, c10::string_view act) {
    static auto op = public_op<LinearSig>("cvt_cutlass::linear");
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->saved_data["gelu"] = act == "gelu";
    ctx->saved_data["bias"] = bias.has_value();
    ctx->saved_data["res"] = res.has_value();
    ctx->save_for_backward({x, w, bias ? *bias : at::Tensor()});
    return op.call(x, w, bias, res, act);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = public_op<LinearSig>("cvt_cutlass::linear");
    const auto s = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["bias"].toBool(), has_res = ctx->saved_data["res"].toBool();
    // an fp32 residual stream's gradient: fp32 to the residual, in x's dtype to the GEMMs
    at::Tensor g = grads[0].scalar_type() == s[0].scalar_type() ? grads[0] : grads[0].to(s[0].scalar_type());
    if (ctx->saved_data["gelu"].toBool())
      g = at::gelu_backward(g, op.call(s[0], s[1], has_bias ? OptT(s[2]) : std::nullopt, std::nullopt, "none"));
    // input edges: x 0, W 1, then bias and residual when given
    const bool nb = has_bias && ctx->needs_input_grad(2), nr = has_res && ctx->needs_input_grad(2 + has_bias);
    auto [dx, dw, db] = linear_grads(g, s[0], s[1], ctx->needs_input_grad(0), ctx->needs_input_grad(1), nb);
    return {dx, dw, db, nr ? grads[0] : at::Tensor(), at::Tensor()};
  }
};

// linear_gelu_aux: (gelu(z), z) with z = x W^T + b kept for the backward; both outputs differentiable.
struct GeluAuxFn : torch::autograd::Function<GeluAuxFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
    static auto op = public_op<GeluPairSig>("cvt_cutlass::linear_gelu_aux");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, z] = op.call(x, w, b);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x, w, z});
    return {y, z};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    at::Tensor g;
    if (grads[0].defined()) g = at::gelu_backward(grads[0], s[2]);
    if (grads[1].defined()) g = g.defined() ? g + grads[1] : grads[1];
    if (!g.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    auto [dx, dw, db] = linear_grads(g, s[0], s[1], ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                     ctx->needs_input_grad(2));
    return {dx, dw, db};
  }
};

// mlp: fc2(gelu(fc1(x))) (+ residual). Backward, the fused chain: fc2's wgrad (dW2, db2), fc2's
// dgrad multiplied by the kept GELU derivative and reducing fc1's db in its epilogue, fc1's wgrad
// (dW1) and dgrad (dx). hidden and dgelu are outputs kept for the backward, not differentiable.
struct MlpFn : torch::autograd::Function<MlpFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1,
                               const at::Tensor& w2, const at::Tensor& b2, const OptT& res) {
    static auto op = public_op<MlpSig>("cvt_cutlass::mlp");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, hidden, z] = op.call(x, w1, b1, w2, b2, res);
    ctx->mark_non_differentiable({hidden, z});
    ctx->set_materialize_grads(false);
    ctx->saved_data["res"] = res.has_value();
    ctx->save_for_backward({x, w1, w2, hidden, z});
    return {y, hidden, z};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto dgrad = public_op<DgradSig>("cvt_cutlass::linear_dgrad");
    static auto wgrad = public_op<WgradSig>("cvt_cutlass::linear_wgrad");
    const auto s = ctx->get_saved_variables();  // x, w1, w2, hidden, dgelu
    variable_list out(6);
    if (!grads[0].defined()) return out;
    auto need = [&](int i) { return ctx->needs_input_grad(i); };  // x, w1, b1, w2, b2, residual
    // an fp32 residual stream's gradient: in x's dtype to the GEMMs, fp32 to the residual
    const at::Tensor g16 = grads[0].scalar_type() == s[0].scalar_type() ? grads[0] : grads[0].to(s[0].scalar_type());
    const at::Tensor g = kernel_rows(g16, s[2].sym_size(0));
    if (need(3) || need(4)) {
      auto [dw2, db2] = wgrad.call(g, s[3], need(4));
      if (need(3)) out[3] = dw2;
      if (need(4)) out[4] = db2;
    }
    if (need(0) || need(1) || need(2)) {
      auto [dz, db1] = dgrad.call(g, s[2], std::nullopt, s[4]);  // GELU' and fc1's dbias in the epilogue
      if (need(1)) out[1] = std::get<0>(wgrad.call(dz, s[0], false));
      if (need(0)) out[0] = dgrad_call(dz, s[1]);
      if (need(2)) out[2] = db1;
    }
    if (ctx->saved_data["res"].toBool() && need(5)) out[5] = grads[0];
    return out;
  }
};

inline at::Tensor linear_autograd(const at::Tensor& x, const at::Tensor& w, const OptT& bias, const OptT& res,
                                  c10::string_view act) {
  if (any_requires_grad({&x, &w}, {&bias, &res})) return LinearFn::apply(x, w, bias, res, act);
  static auto op = public_op<LinearSig>("cvt_cutlass::linear");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(x, w, bias, res, act);
}

inline std::tuple<at::Tensor, at::Tensor> linear_gelu_aux_autograd(const at::Tensor& x, const at::Tensor& w,
                                                                   const at::Tensor& b) {
  if (any_requires_grad({&x, &w, &b})) {
    auto out = GeluAuxFn::apply(x, w, b);
    return {out[0], out[1]};
  }
  static auto op = public_op<GeluPairSig>("cvt_cutlass::linear_gelu_aux");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(x, w, b);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> mlp_autograd(const at::Tensor& x, const at::Tensor& w1,
                                                                   const at::Tensor& b1, const at::Tensor& w2,
                                                                   const at::Tensor& b2, const OptT& res) {
  if (any_requires_grad({&x, &w1, &b1, &w2, &b2}, {&res})) {
    auto out = MlpFn::apply(x, w1, b1, w2, b2, res);
    return {out[0], out[1], out[2]};
  }
  static auto op = public_op<MlpSig>("cvt_cutlass::mlp");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(x, w1, b1, w2, b2, res);
}

// ------------------------------------------------------------------------------------ raw launch
inline void check_rows(const at::Tensor& t, const std::string& what, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols,
              "cvt_cutlass: " + what + " must be (" + std::to_string(rows) + ", " + std::to_string(cols) + "), got " +
                  dims(t.sizes()));
  TORCH_CHECK(t.stride(1) == 1 || cols == 1, "cvt_cutlass: " + what + " rows must be contiguous");
}

// D = epilogue(A @ B^T) with a given kernel (profile sweeps, tests): every check on every call.
inline void gemm_raw(int64_t id, const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& c, const at::Tensor& d, const std::optional<at::Tensor>& aux,
                     const std::optional<at::Tensor>& row_scale) {
  const Kernel& k = kernel_of_family(id, {CVT_FAMILY_GEMM}, "a GEMM");
  const int64_t m = a.size(0), kk = a.size(1), n = b.size(0);
  check_rows(a, "A", m, kk);
  check_rows(b, "B (weight)", n, kk);
  check_rows(d, "D (output)", m, n);
  if (c) check_rows(*c, "C (residual)", m, n);
  if (aux) check_rows(*aux, "aux", m, n);
  std::vector<at::Tensor> all = {b, d};
  if (c) all.push_back(*c);
  // the forward that saves GELU's derivative stores it in fp16 whatever A's dtype
  const bool saves_dgelu = k.name.find("_bias_gelu_dgelu_") != std::string::npos;
  if (aux && saves_dgelu) {
    TORCH_CHECK(aux->device() == a.device() && aux->scalar_type() == at::kHalf,
                "cvt_cutlass: " + k.name + " stores GELU's derivative (aux) as float16 on A's device");
  } else if (aux) {
    all.push_back(*aux);
  }
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
                "cvt_cutlass: bias must be a contiguous (N,) vector");
    all.push_back(*bias);
  }
  for (const at::Tensor& t : all)
    TORCH_CHECK(t.device() == a.device() && t.scalar_type() == a.scalar_type(),
                "cvt_cutlass: " + k.name + ": all operands must share A's device and dtype");
  const bool scaled = k.name.find("_bias_scale_residual_") != std::string::npos ||
                      k.name.find("_bias_residual_scale_") != std::string::npos;  // the row-scaled epilogues
  TORCH_CHECK(scaled == row_scale.has_value(), "cvt_cutlass: kernel " + k.name +
                                                  (scaled ? " takes a row_scale" : " takes no row_scale"));
  if (row_scale)
    TORCH_CHECK(row_scale_ok(*row_scale, m, a.device()),
                "cvt_cutlass: row_scale must be a contiguous (M,) float32 vector on A's device");
  cvt_gemm_args p = gemm_args(a, b, bias, c, d, aux);
  p.row_scale = row_scale ? row_scale->data_ptr<float>() : nullptr;
  // TMA and cp.async read 16-byte vectors: every operand must start 16-byte aligned.
  for (const void* ptr : {p.a, p.b, static_cast<const void*>(p.d), p.bias, p.c, static_cast<const void*>(p.aux),
                          static_cast<const void*>(p.row_scale)})
    TORCH_CHECK(aligned16(ptr), "cvt_cutlass: kernel " + k.name + ": every operand must start 16-byte aligned");
  check_can_implement(k.can_implement(p), k, [&] { return gemm_what(p); });
  check_launch(launch(k, p, k.workspace_size(p), OnDevice(a)), k, [&] { return gemm_what(p); });
}

inline void check_same(const Kernel& k, const at::Tensor& ref, std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts)
    TORCH_CHECK(t->device() == ref.device() && t->scalar_type() == ref.scalar_type(),
                "cvt_cutlass: " + k.name + ": all operands must share the first operand's device and dtype");
}

// An optional (n,) output such as db: contiguous, on the first operand's device, of its dtype.
inline void check_vector(const Kernel& k, const at::Tensor& ref, const std::optional<at::Tensor>& t,
                         const std::string& what, int64_t n) {
  if (!t) return;
  TORCH_CHECK(t->dim() == 1 && t->size(0) == n && t->is_contiguous(),
              "cvt_cutlass: " + what + " must be a contiguous (" + std::to_string(n) + ",) vector");
  check_same(k, ref, {&*t});
}

// dX = G . W (G (M, N), W (N, K) read in place) with a given dgrad kernel (profile sweeps, tests);
// a dgelu / dgelu_dbias kernel takes the pre-activation Z (M, K), a dgelu_saved_dbias one GELU's
// derivative at it (M, K) in fp16; the *_dbias ones write db (K,). Every check, every call.
inline void dgrad_raw(int64_t id, const at::Tensor& g, const at::Tensor& w, const std::optional<at::Tensor>& z,
                      const at::Tensor& dx, const std::optional<at::Tensor>& db) {
  const Kernel& k = kernel_of_family(id, {CVT_FAMILY_GEMM}, "a GEMM");
  TORCH_CHECK(k.name.find("_dgrad_") != std::string::npos, "cvt_cutlass: " + k.name + " is not a dgrad kernel");
  const bool dgelu = k.name.find("_dgelu_") != std::string::npos, dbias = k.name.find("_dbias_") != std::string::npos;
  const bool saved = k.name.find("_dgelu_saved_") != std::string::npos;
  TORCH_CHECK(dgelu == bool(z) && dbias == bool(db),
              "cvt_cutlass: " + k.name + (saved ? " needs GELU's saved derivative (float16) and db"
                                          : dbias ? " needs gelu_input and db"
                                          : dgelu ? " needs gelu_input and no db" : " takes no gelu_input and db"));
  const int64_t m = g.size(0), n = w.size(0), kk = w.size(1);
  check_rows(g, "grad", m, n);
  check_rows(w, "weight", n, kk);
  check_rows(dx, "dx", m, kk);
  check_same(k, g, {&w, &dx});
  if (z) {
    check_rows(*z, "gelu_input", m, kk);
    if (saved) {
      TORCH_CHECK(z->device() == g.device() && z->scalar_type() == at::kHalf,
                  "cvt_cutlass: " + k.name + " reads GELU's derivative as float16 on grad's device");
    } else {
      check_same(k, g, {&*z});
    }
  }
  check_vector(k, g, db, "db", kk);
  cvt_gemm_args p{};
  p.m = m; p.n = kk; p.k = n;
  p.a = g.data_ptr(); p.lda = g.stride(0);
  p.b = w.data_ptr(); p.ldb = w.stride(0);
  p.d = dx.data_ptr(); p.ldd = dx.stride(0);
  if (z) { p.c = z->data_ptr(); p.ldc = z->stride(0); }
  if (db) p.aux = db->data_ptr();
  p.device_id = g.device().index();
  for (const void* ptr : {p.a, p.b, static_cast<const void*>(p.d), p.c})
    TORCH_CHECK(aligned16(ptr), "cvt_cutlass: kernel " + k.name + ": every operand must start 16-byte aligned");
  check_can_implement(k.can_implement(p), k, [&] { return gemm_what(p); });
  check_launch(launch(k, p, k.workspace_size(p), OnDevice(g)), k, [&] { return gemm_what(p); });
}

// dW = G^T . X (and db = G summed over rows when given) with a given wgrad kernel; with row_scale
// (fp32 (M,)) G's rows scaled first, and with G fp32 (x 16-bit) G rounded to x's dtype first, the
// scaled / rounded G written to g_scaled ((M, N) contiguous, x's dtype).
inline void wgrad_raw(int64_t id, const at::Tensor& g, const at::Tensor& x, const at::Tensor& dw,
                      const std::optional<at::Tensor>& db, const OptT& row_scale, const OptT& g_scaled) {
  const Kernel& k = kernel_of_family(id, {CVT_FAMILY_WGRAD}, "a weight-gradient");
  const int64_t m = g.size(0), n = g.size(1), kk = x.size(1);
  check_rows(g, "grad", m, n);
  check_rows(x, "x", m, kk);
  check_rows(dw, "dW", n, kk);
  TORCH_CHECK(dw.is_contiguous(), "cvt_cutlass: dW must be contiguous");
  const bool wide = g.scalar_type() == at::kFloat && (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16);
  TORCH_CHECK(g.device() == x.device(), "cvt_cutlass: " + k.name + ": grad and x must share a device");
  check_same(k, x, {&dw});
  if (!wide) check_same(k, g, {&x});
  check_vector(k, x, db, "db", n);
  cvt_wgrad_args p{};
  p.m = m; p.n = n; p.k = kk;
  p.dy = g.data_ptr(); p.ldy = g.stride(0);
  p.x = x.data_ptr(); p.ldx = x.stride(0);
  p.dw = dw.data_ptr(); p.db = db ? db->data_ptr() : nullptr;
  TORCH_CHECK(row_scale.has_value() == g_scaled.has_value() || (wide && g_scaled),
              "cvt_cutlass: row_scale and g_scaled come together");
  TORCH_CHECK(!wide || g_scaled, "cvt_cutlass: a float32 grad needs g_scaled (its rounded copy)");
  if (row_scale) {
    TORCH_CHECK(row_scale_ok(*row_scale, m, g.device()),
                "cvt_cutlass: row_scale must be a contiguous float32 (M,) tensor on grad's device");
    p.row_scale = row_scale->data_ptr<float>();
  }
  if (g_scaled) {
    check_rows(*g_scaled, "g_scaled", m, n);
    TORCH_CHECK(g_scaled->is_contiguous() && g_scaled->scalar_type() == x.scalar_type() &&
                    g_scaled->device() == g.device(),
                "cvt_cutlass: g_scaled must be contiguous, in x's dtype, on its device");
    for (const at::Tensor* t : {&g, &x, &dw}) at::assert_no_overlap(*g_scaled, *t);
    if (db) at::assert_no_overlap(*g_scaled, *db);
    p.dy_scaled = g_scaled->data_ptr();
  }
  p.dy_fp32 = wide ? 1 : 0;
  p.device_id = g.device().index();
  check_can_implement(k.can_implement(p), k, [&] { return wgrad_what(p); });
  check_launch(launch(k, p, k.workspace_size(p), OnDevice(g)), k, [&] { return wgrad_what(p); });
}

inline void register_linear(torch::Library& pub) {
  define_public(pub, linear_schemas());
  impl_op(pub, "linear", &linear_cuda, &linear_autograd);
  impl_op(pub, "linear_gelu_aux", &linear_gelu_aux_cuda, &linear_gelu_aux_autograd);
  impl_op(pub, "mlp", &mlp_cuda, &mlp_autograd);
  impl_op(pub, "linear_dgrad", &linear_dgrad_cuda);
  impl_op(pub, "linear_wgrad", &linear_wgrad_cuda);
}

inline void register_linear_private(torch::Library& priv) {
  define_private(priv, linear_schemas());
  for (const char* suffix : {"", "_fallback"})
    define(priv, std::string("linear_row_scaled") + suffix + kRowScaledArgs + " -> Tensor");
  define(priv, std::string("linear_row_scaled_plan") + kRowScaledArgs + " -> (int, int)");
  priv.impl("linear_row_scaled", torch::dispatch(c10::DispatchKey::CUDA, &linear_row_scaled_cuda));
  for (const char* suffix : {"", "_fallback"})
    define(priv, std::string("linear_rounded") + suffix + kRoundedArgs + " -> Tensor");
  define(priv, std::string("linear_rounded_plan") + kRoundedArgs + " -> (int, int)");
  priv.impl("linear_rounded", torch::dispatch(c10::DispatchKey::CUDA, &linear_rounded_cuda));
  for (const char* suffix : {"", "_fallback"})
    define(priv, std::string("linear_gelu_dgelu") + suffix + kGeluAuxArgs + " -> (Tensor, Tensor)");
  define(priv, std::string("linear_gelu_dgelu_plan") + kGeluAuxArgs + " -> (int, int)");
  priv.impl("linear_gelu_dgelu", torch::dispatch(c10::DispatchKey::CUDA, &linear_gelu_dgelu_cuda));
  define_raw(priv, "gemm(int kernel, Tensor a, Tensor b, Tensor? bias, Tensor? c, Tensor(d!) d, Tensor(e!)? aux, "
             "Tensor? row_scale=None) -> ()", &gemm_raw);
  define_raw(priv, "dgrad(int kernel, Tensor g, Tensor w, Tensor? z, Tensor(d!) dx, Tensor(b!)? db) -> ()", &dgrad_raw);
  define_raw(priv, "wgrad(int kernel, Tensor g, Tensor x, Tensor(w!) dw, Tensor(b!)? db, Tensor? row_scale=None, "
             "Tensor(s!)? g_scaled=None) -> ()", &wgrad_raw);
}

}  // namespace cvt
