// A CvT layer as one op: torch.ops.cvt_cutlass.cvt_layer (inference), cvt_layer_train and
// cvt_layer_backward, joined by one autograd node per layer (cvt_cutlass/ops/layer.py holds the
// Python side: the weight lists, fake kernels, drop-path masks).
//
// The layer (HF's CvtLayer on tokens x (B, cls + H*W, C)):
//   h  = LayerNorm(x)
//   q, k, v = Linear(BatchNorm(dwconv3x3(h)))        the depthwise projections, stride s_q / s_kv
//   o  = attention(q, k, v) with scale C^-1/2        heads of C / heads channels
//   t1 = x + drop(o Wo^T + bo)                       the residual and drop path in the GEMM's epilogue
//   y  = t1 + fc2(gelu(fc1(LayerNorm(t1))))          fc1's bias + GELU and fc2's residual in epilogues
//   out = drop(y)                                    HF applies its second drop path after the residual
//                                                    (in fc2's epilogue too)
// Every step is one of the family ops' hot paths called from here (no dispatcher, no autograd
// node, no Python per op on CUDA): each finds its plan by its own key, a miss plans through its
// Python planner once, and what no kernel serves runs that op's counted fallback. The backward's
// kernels defer their finishing column sums (the weight and bias gradients' partial sums) to one
// launch at its end. On other devices the same body calls the public ops through the dispatcher
// (their PyTorch references).
//
// weights (Tensor[]), in the compute dtype unless said: ln1 w, b; Wq, bq, Wk, bk, Wv, bv; Wo, bo;
// ln2 w, b; W1, b1, W2, b2 (16; or those 16 as one 1-D buffer, their concatenation in that order,
// as cast_params' groups give them: viewed here, its gradient one buffer too), then per
// projection q, k, v: training, the depthwise weight
// (3, 3, C) and BatchNorm's weight and bias (fp32, or fp64 for references); inference, the
// weight and bias with BatchNorm folded in (fp32). running: the projections' running mean / var
// (updated in place, fp32) or empty. scalars: ln1 eps, ln2 eps, BatchNorm eps q / k / v, the
// running-stat factors q / k / v. geom: H, W, cls rows, heads,
// stride q, stride kv, and optionally "rounded" (1: on an fp32 residual stream, the output in the
// weights' 16-bit dtype, fc2's fp32 sum rounded once, as HF's autocast rounds a stage's output
// where the next embedding reads it; its gradient then comes in that dtype too; no drop path
// after the residual; 0 or absent: the output in x's dtype). cvt_layer is the inference forward (BatchNorm folded) -> out;
// cvt_layer_train the training forward (BatchNorm on batch statistics) -> (out, then the tensors
// its backward reads: a fixed tuple, as torch.compile's functionalization of an op that updates
// the running statistics in place takes no list result).
// drop_attn, drop_out: drop path's scale per token row, mask / keep probability, (B * L,) fp32
// (fp64 for fp64 x),
// of the attention branch (t1 = x + (o Wo^T + bo) * s, the out-projection's epilogue) and of the
// layer's output (out = (fc2 + t1) * s, fc2's epilogue), or None; the backward scales the
// gradients by the same rows (fp32 math, one rounding) in the out-projection's and fc2's weight-
// gradient row-sum passes, which write the scaled gradient the later calls read.
#pragma once
#include <cmath>

#include "../plans.h"
#include "../side_stream.h"

namespace cvt {

constexpr const char* kLayerArgs =
    "(Tensor x, Tensor[] weights, Tensor? drop_attn, Tensor? drop_out, float[] scalars, int[] geom)";
constexpr const char* kLayerTrainArgs =
    "(Tensor x, Tensor[] weights, Tensor(a!)[] running, Tensor? drop_attn, Tensor? drop_out, float[] scalars, "
    "int[] geom)";
constexpr const char* kLayerBwdArgs =
    "(Tensor grad, Tensor x, Tensor[] weights, Tensor[] saved, Tensor? drop_attn, Tensor? drop_out, float[] scalars, "
    "int[] geom)";

// weights
enum LayerWeight : int { kLn1W, kLn1B, kWq, kBq, kWo = 8, kBo, kLn2W, kLn2B, kW1, kB1, kW2, kB2, kProj };
// scalars
enum LayerScalar : int { kLn1Eps, kLn2Eps, kBnEps, kMomentum = 5, kLayerScalars = 8 };
// geom
enum LayerGeom : int { kGeomH, kGeomW, kGeomCls, kGeomHeads, kGeomStrideQ, kGeomStrideKv, kGeomRounded, kLayerGeom };
// what the training forward returns for its backward
enum LayerSaved : int { kSavedH, kSavedY, kSavedMean = 4, kSavedInvstd = 7, kSavedQ = 10, kSavedO = 13, kSavedLse,
                        kSavedT1, kSavedH2, kSavedHidden, kSavedDgelu, kLayerSaved };

inline int64_t proj_stride(at::IntArrayRef geom, int i) { return geom[i == 0 ? kGeomStrideQ : kGeomStrideKv]; }
inline bool rounded_out(at::IntArrayRef geom) { return geom.size() > kGeomRounded && geom[kGeomRounded] != 0; }

// Where a call writes a weight's and a bias's gradients: views of the layer's one gradient buffer
// (the weights came as one buffer), or new tensors (none given).
struct GradTo {
  OptT w, b;
};

// ------------------------------------------------------------------------------------ calls
// CUDA: the ops' hot paths directly; a backward's finishing column sums deferred to its end
// (plans.h: DeferredSums) and flushed by flush_sums.
struct DirectCalls {
  static constexpr bool kDefersSums = true;
  static constexpr bool kSideStream = true;  // the weight gradients beside the critical path (side_stream.h)
  static void flush_sums(const at::Tensor& like) {
    if (t_deferred_sums) t_deferred_sums->flush(OnDevice(like).stream());
  }
  static at::Tensor ln(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps) {
    return layer_norm_tokens_cuda(x, w, b, eps, std::nullopt, std::nullopt);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> ln_bwd(const at::Tensor& g, const at::Tensor& x,
                                                               const at::Tensor& w, double eps, const OptT& res,
                                                               const OptT& res_scale, const OptT& g2, const OptT& g3,
                                                               const GradTo& to, at::Tensor* branch = nullptr,
                                                               const OptT& branch_scale = std::nullopt) {
    return layer_norm_tokens_backward_into(g, x, w, eps, res, g2, g3, to.w, to.b, res_scale, branch, branch_scale);
  }
  static at::Tensor dw(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::IntArrayRef g, int i) {
    return dwconv_tokens_cuda(x, w, b, g[kGeomH], g[kGeomW], proj_stride(g, i), g[kGeomCls]);
  }
  // q, k and v of one input in one set of launches (the k / v pair shares a shape)
  static std::array<DwBnOut, 3> dwbn_qkv(const at::Tensor& x, const DwBnProj& q, const DwBnProj& k, const DwBnProj& v,
                                         at::IntArrayRef g) {
    return dwconv_bn_train_qkv_cuda(x, q, k, v, g[kGeomH], g[kGeomW], g[kGeomStrideQ], g[kGeomStrideKv], g[kGeomCls]);
  }
  static std::array<DwBnBwdOut, 3> dwbn_qkv_bwd(const at::Tensor& x, const DwBnBwdProj& q, const DwBnBwdProj& k,
                                                const DwBnBwdProj& v, at::IntArrayRef g) {
    return dwconv_bn_backward_qkv_cuda(x, q, k, v, g[kGeomH], g[kGeomW], g[kGeomStrideQ], g[kGeomStrideKv],
                                       g[kGeomCls], /*sum_dx=*/true);
  }
  static at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const OptT& res,
                           c10::string_view act = "none") {
    return linear_cuda(x, w, b, res, act);
  }
  static at::Tensor linear_rounded(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                                   const at::Tensor& res) {
    return linear_rounded_cuda(x, w, b, res);
  }
  static at::Tensor linear_scaled(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const at::Tensor& res,
                                  const at::Tensor& rs, c10::string_view scale) {
    return linear_row_scaled_cuda(x, w, b, res, rs, scale);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> mlp(const at::Tensor& x, const at::Tensor& w1,
                                                            const at::Tensor& b1, const at::Tensor& w2,
                                                            const at::Tensor& b2, const at::Tensor& res,
                                                            const OptT& rs, bool rounded) {
    return mlp_run(x, w1, b1, w2, b2, res, rs, rounded);
  }
  // dg: fc1's saved GELU derivative (fc2's dgrad), else none
  static std::tuple<at::Tensor, at::Tensor> dgrad(const at::Tensor& g, const at::Tensor& w, const OptT& dg,
                                                   const OptT& db_to = {}) {
    return linear_dgrad_into(g, w, std::nullopt, dg, db_to);
  }
  static std::tuple<at::Tensor, at::Tensor> wgrad(const at::Tensor& g, const at::Tensor& x, bool bias,
                                                   const GradTo& to) {
    return linear_wgrad_into(g, x, bias, to.w, to.b);
  }
  // (dW, db, the GEMMs' gradient: g scaled by rs where given, in x's dtype)
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> wgrad_scaled(const at::Tensor& g, const at::Tensor& x,
                                                                     const OptT& rs, const GradTo& to) {
    return linear_wgrad_scaled_into(g, x, true, rs, to.w, to.b, /*wide_ok=*/true);
  }
  static std::tuple<at::Tensor, at::Tensor> attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 double scale) {
    return attention_cuda(q, k, v, scale);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> attn_bwd(const at::Tensor& g, const at::Tensor& q,
                                                                 const at::Tensor& k, const at::Tensor& v,
                                                                 const at::Tensor& o, const at::Tensor& lse,
                                                                 double scale) {
    return attention_backward_cuda(g, q, k, v, o, lse, scale, std::nullopt);
  }
};

// Other devices: the public ops through the dispatcher (below autograd: their references).
struct DispatchedCalls {
  static constexpr bool kDefersSums = false;
  static constexpr bool kSideStream = false;
  static void flush_sums(const at::Tensor&) {}
  static at::Tensor ln(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps) {
    static auto op = public_op<LayerNormSig>("cvt_cutlass::layer_norm_tokens");
    return op.call(x, w, b, eps, std::nullopt, std::nullopt);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> ln_bwd(const at::Tensor& g, const at::Tensor& x,
                                                               const at::Tensor& w, double eps, const OptT& res,
                                                               const OptT& res_scale, const OptT& g2, const OptT& g3,
                                                               const GradTo& to, at::Tensor* branch = nullptr,
                                                               const OptT& branch_scale = std::nullopt) {
    static auto op = public_op<LayerNormBwdSig>("cvt_cutlass::layer_norm_tokens_backward");
    TORCH_CHECK(!res_scale || res, "cvt_cutlass.cvt_layer_backward: a residual row scale without a residual gradient");
    auto [dx, dw, db] = op.call(g, x, w, eps, scaled_residual(res, res_scale), g2, g3);
    if (branch) *branch = branch_grad(dx, branch_scale, w.scalar_type());
    return {dx, given(to.w, dw), given(to.b, db)};
  }
  static at::Tensor dw(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::IntArrayRef g, int i) {
    static auto op = public_op<DwSig>("cvt_cutlass::dwconv_tokens");
    return op.call(x, w, b, g[kGeomH], g[kGeomW], proj_stride(g, i), g[kGeomCls]);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> dwbn(const at::Tensor& x, const at::Tensor& w,
                                                             const at::Tensor& bnw, const at::Tensor& bnb,
                                                             const OptT& rm, const OptT& rv, double momentum,
                                                             double eps, at::IntArrayRef g, int i) {
    static auto op = public_op<DwBnSig>("cvt_cutlass::dwconv_bn_train");
    return op.call(x, w, bnw, bnb, rm, rv, momentum, eps, g[kGeomH], g[kGeomW], proj_stride(g, i), g[kGeomCls]);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dwbn_bwd(
      const at::Tensor& gr, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bnw, const at::Tensor& mean,
      const at::Tensor& invstd, at::IntArrayRef g, int i) {
    static auto op = public_op<DwBnBwdSig>("cvt_cutlass::dwconv_bn_backward");
    return op.call(gr, x, w, bnw, mean, invstd, g[kGeomH], g[kGeomW], proj_stride(g, i), g[kGeomCls]);
  }
  static std::array<DwBnOut, 3> dwbn_qkv(const at::Tensor& x, const DwBnProj& q, const DwBnProj& k, const DwBnProj& v,
                                         at::IntArrayRef g) {
    return {dwbn(x, q.w, *q.bnw, *q.bnb, q.rm, q.rv, q.momentum, q.eps, g, 0),
            dwbn(x, k.w, *k.bnw, *k.bnb, k.rm, k.rv, k.momentum, k.eps, g, 1),
            dwbn(x, v.w, *v.bnw, *v.bnb, v.rm, v.rv, v.momentum, v.eps, g, 2)};
  }
  static std::array<DwBnBwdOut, 3> dwbn_qkv_bwd(const at::Tensor& x, const DwBnBwdProj& q, const DwBnBwdProj& k,
                                                const DwBnBwdProj& v, at::IntArrayRef g) {
    return {dwbn_bwd(q.g, x, q.w, *q.bnw, q.mean, q.invstd, g, 0),
            dwbn_bwd(k.g, x, k.w, *k.bnw, k.mean, k.invstd, g, 1),
            dwbn_bwd(v.g, x, v.w, *v.bnw, v.mean, v.invstd, g, 2)};
  }
  static at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const OptT& res,
                           c10::string_view act = "none") {
    static auto op = public_op<LinearSig>("cvt_cutlass::linear");
    return op.call(x, w, b, res, act);
  }
  static at::Tensor linear_scaled(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const at::Tensor& res,
                                  const at::Tensor& rs, c10::string_view scale) {
    static auto op = public_op<RowScaledSig>("cvt_cutlass_C::linear_row_scaled");
    return op.call(x, w, b, res, rs, scale);
  }
  static at::Tensor linear_rounded(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                                   const at::Tensor& res) {
    static auto op = public_op<RoundedSig>("cvt_cutlass_C::linear_rounded");
    return op.call(x, w, b, res);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> mlp(const at::Tensor& x, const at::Tensor& w1,
                                                            const at::Tensor& b1, const at::Tensor& w2,
                                                            const at::Tensor& b2, const at::Tensor& res,
                                                            const OptT& rs, bool rounded) {
    static auto op = public_op<MlpSig>("cvt_cutlass::mlp");
    static auto aux = public_op<GeluPairSig>("cvt_cutlass_C::linear_gelu_dgelu");
    if (!rs) {
      auto [y, hidden, dgelu] = op.call(x, w1, b1, w2, b2, res);  // (the fp32 sum, rounded once where asked)
      return {rounded ? y.to(x.scalar_type()) : y, hidden, dgelu};
    }
    auto [hidden, dgelu] = aux.call(x, w1, b1);
    return {linear_scaled(hidden, w2, b2, res, *rs, "all"), hidden, dgelu};
  }
  static std::tuple<at::Tensor, at::Tensor> dgrad(const at::Tensor& g, const at::Tensor& w, const OptT& dg,
                                                   const OptT& db_to = {}) {
    static auto op = public_op<DgradSig>("cvt_cutlass::linear_dgrad");
    auto [dx, db] = op.call(g, w, std::nullopt, dg);
    return {dx, dg ? given(db_to, db) : db};
  }
  static std::tuple<at::Tensor, at::Tensor> wgrad(const at::Tensor& g, const at::Tensor& x, bool bias,
                                                   const GradTo& to) {
    static auto op = public_op<WgradSig>("cvt_cutlass::linear_wgrad");
    auto [dw, db] = op.call(g, x, bias);
    return {given(to.w, dw), bias ? given(to.b, db) : db};
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> wgrad_scaled(const at::Tensor& g, const at::Tensor& x,
                                                                     const OptT& rs, const GradTo& to) {
    const at::Tensor gs = branch_grad(g, rs, x.scalar_type());
    auto [dw, db] = wgrad(gs, x, true, to);
    return {dw, db, gs};
  }
  static std::tuple<at::Tensor, at::Tensor> attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 double scale) {
    static auto op = public_op<AttentionSig>("cvt_cutlass::attention");
    return op.call(q, k, v, scale);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> attn_bwd(const at::Tensor& g, const at::Tensor& q,
                                                                 const at::Tensor& k, const at::Tensor& v,
                                                                 const at::Tensor& o, const at::Tensor& lse,
                                                                 double scale) {
    static auto op = public_op<AttentionBwdSig>("cvt_cutlass::attention_backward");
    return op.call(g, q, k, v, o, lse, scale, std::nullopt);
  }
};

// ------------------------------------------------------------------------------------ checks
inline void check_layer(const at::Tensor& x, at::TensorList w, at::TensorList running, at::ArrayRef<double> f,
                        at::IntArrayRef geom, bool train) {
  TORCH_CHECK_VALUE((geom.size() == kLayerGeom || geom.size() == kLayerGeom - 1) && f.size() == kLayerScalars,
                    "cvt_cutlass.cvt_layer: geom takes 6 or 7 ints and scalars 8 floats (see csrc/ops/layer.cpp)");
  const size_t want = kProj + (train ? 9 : 6);
  TORCH_CHECK_VALUE(w.size() == want, "cvt_cutlass.cvt_layer: " + std::to_string(want) + " weights expected for " +
                                          (train ? "training" : "inference") + " (or " + std::to_string(want - 15) +
                                          ", the first 16 as one buffer), got " + std::to_string(w.size()));
  TORCH_CHECK_VALUE(running.empty() || (train && running.size() == 6),
                    "cvt_cutlass.cvt_layer: running takes the 6 running statistics in training, or none");
  TORCH_CHECK_VALUE(x.dim() == 3 && x.size(1) == geom[kGeomCls] + geom[kGeomH] * geom[kGeomW],
                    "cvt_cutlass.cvt_layer: x must be (B, cls + H*W, C) for H, W, cls = " +
                        std::to_string(geom[kGeomH]) + ", " + std::to_string(geom[kGeomW]) + ", " +
                        std::to_string(geom[kGeomCls]) + "; got " + dims(x.sizes()));
  TORCH_CHECK_VALUE(geom[kGeomHeads] > 0 && x.size(2) % geom[kGeomHeads] == 0 && geom[kGeomStrideQ] == 1,
                    "cvt_cutlass.cvt_layer: C must split into the heads and the query stride be 1 (the residual "
                    "needs as many queries as tokens)");
}

// geom's "rounded" (see the top): on an fp32 residual stream only (fp32 x, 16-bit weights, w0 the first
// LayerNorm's weight), without drop path after the residual.
inline void check_rounded(const at::Tensor& x, const at::Tensor& w0, const OptT& dout, at::IntArrayRef geom) {
  TORCH_CHECK_VALUE(!rounded_out(geom) || (x.scalar_type() == at::kFloat && w0.scalar_type() != at::kFloat && !dout),
                    "cvt_cutlass.cvt_layer: a rounded output (geom[6] = 1) takes an fp32 residual stream (float32 x, "
                    "16-bit weights) and no drop_out");
}

// drop_attn / drop_out: drop path's per-row scales (see the top), or None.
inline void check_drop(const at::Tensor& x, const OptT& da, const OptT& dout) {
  const auto want = at::promote_types(x.scalar_type(), at::kFloat);
  for (const OptT* t : {&da, &dout})
    TORCH_CHECK_VALUE(!*t || ((*t)->scalar_type() == want && (*t)->dim() == 1 &&
                              (*t)->numel() == x.size(0) * x.size(1) && (*t)->is_contiguous() &&
                              (*t)->device() == x.device()),
                      "cvt_cutlass.cvt_layer: drop_attn / drop_out are drop path's scales per token row: float32 "
                      "(float64 for float64 x), (B * L,), contiguous, on x's device");
}

// The kProj weights (or their gradients) as views of one 1-D buffer holding them in order (C
// from x; fc1's width from the buffer's size).
inline std::vector<at::Tensor> flat_views(const at::Tensor& flat, int64_t c) {
  const int64_t n = flat.numel(), hd = (n - 4 * c * c - 9 * c) / (2 * c + 1);
  TORCH_CHECK_VALUE(flat.dim() == 1 && hd > 0 && 4 * c * c + 9 * c + hd * (2 * c + 1) == n,
                    "cvt_cutlass.cvt_layer: a 1-D buffer of the 16 weights before the projections' expected "
                    "(4 C^2 + 9 C + H (2 C + 1) elements for C = " + std::to_string(c) + "), got " +
                        dims(flat.sizes()));
  const std::vector<int64_t> shapes = {1, c, 1, c, 2, c, c, 1, c, 2, c, c, 1, c, 2, c, c, 1, c, 2, c, c, 1, c,
                                       1, c, 1, c, 2, hd, c, 1, hd, 2, c, hd, 1, c};  // shapes_of's form
  return views_of(flat, shapes);
}

inline int64_t channels_of(const at::Tensor& x) { return x.dim() == 3 ? x.size(2) : 0; }

// Whether a weight buffer of w0's dtype computes on x: the same dtype, or x an fp32 residual
// stream (16-bit weights; the LayerNorms read it, the out-projection and fc2 add to it in fp32).
inline bool weights_fit(const at::Tensor& w0, const at::Tensor& x) {
  return w0.scalar_type() == x.scalar_type() || x.scalar_type() == at::kFloat;
}

// Whether the first kProj weights came as one 1-D buffer: one tensor before the projections' (3 per
// projection in training, 2 in inference).
inline bool weights_as_buffer(at::TensorList w, bool train) { return w.size() == 1 + (train ? 9 : 6); }

// The weights as the body reads them (kProj + nproj tensors): as given, or the first kProj
// given as one 1-D buffer (flat_views).
inline std::vector<at::Tensor> layer_weights(at::TensorList w, const at::Tensor& x, bool train) {
  if (!weights_as_buffer(w, train)) return w.vec();
  TORCH_CHECK_VALUE(weights_fit(w[0], x),
                    "cvt_cutlass.cvt_layer: the buffer of the 16 weights must have x's dtype (or x be an fp32 "
                    "residual stream)");
  std::vector<at::Tensor> out = flat_views(w[0].contiguous(), channels_of(x));
  out.insert(out.end(), w.begin() + 1, w.end());
  return out;
}

// Where a backward given the weights as one buffer writes their gradients: views of one new
// buffer like it (none where a view would not be 16-byte aligned for the kernels' stores).
inline std::pair<at::Tensor, std::vector<at::Tensor>> weight_grad_buffer(at::TensorList w, const at::Tensor& x) {
  if (!weights_as_buffer(w, true) || !weights_fit(w[0], x)) return {};  // (layer_weights raises)
  at::Tensor flat = at::empty({w[0].numel()}, w[0].options());
  std::vector<at::Tensor> views = flat_views(flat, channels_of(x));
  for (const at::Tensor& v : views)
    if (!aligned16(v)) return {};
  return {flat, views};
}

// The weights' gradients of a backward (d[1..]) in the form the weights came: the first kProj as
// one 1-D buffer when they came as one (`flat`, where they were written into its views, else
// their concatenation).
inline void pack_weight_grads(std::vector<at::Tensor>& d, size_t n_given, const at::Tensor& flat) {
  if (d.size() == 1 + n_given) return;
  if (flat.defined()) {
    d[1] = flat;
  } else {
    std::vector<at::Tensor> parts;
    parts.reserve(kProj);
    for (size_t i = 1; i <= kProj; ++i) parts.push_back(d[i].reshape({-1}));
    d[1] = at::cat(parts);
  }
  d.erase(d.begin() + 2, d.begin() + 1 + kProj);
}

inline OptT running_at(at::TensorList running, size_t i) { return running.empty() ? OptT() : OptT(running[i]); }

// ------------------------------------------------------------------------------------ forward
// The projections' training forward into saved (their conv outputs and batch statistics): q, k
// and v in one set of launches where a library serves the three (C::dwbn_qkv).
template <class C>
void layer_projections_train(const at::Tensor& h, at::TensorList w, at::TensorList running, at::ArrayRef<double> f,
                             at::IntArrayRef geom, at::Tensor* saved) {
  auto proj = [&](int i) {
    const size_t p = kProj + 3 * i;
    return DwBnProj{w[p], w[p + 1], w[p + 2], running_at(running, 2 * i), running_at(running, 2 * i + 1),
                    f[kMomentum + i], f[kBnEps + i]};
  };
  const std::array<DwBnOut, 3> out = C::dwbn_qkv(h, proj(0), proj(1), proj(2), geom);
  for (int i = 0; i < 3; ++i) std::tie(saved[kSavedY + i], saved[kSavedMean + i], saved[kSavedInvstd + i]) = out[i];
}

// q, k, v (B, L, heads, D) from h: the projections (BatchNorm on batch statistics in training,
// folded in inference) and their GEMMs; in training the conv outputs and batch statistics go to
// saved (kLayerSaved entries).
template <class C>
std::array<at::Tensor, 3> layer_qkv(const at::Tensor& h, at::TensorList w, at::TensorList running,
                                    at::ArrayRef<double> f, at::IntArrayRef geom, bool train, at::Tensor* saved) {
  const int64_t b = h.size(0), c = h.size(2), heads = geom[kGeomHeads];
  if (train) layer_projections_train<C>(h, w, running, f, geom, saved);
  std::array<at::Tensor, 3> qkv;
  for (int i = 0; i < 3; ++i) {
    const at::Tensor y = train ? saved[kSavedY + i] : C::dw(h, w[kProj + 2 * i], w[kProj + 2 * i + 1], geom, i);
    const at::Tensor t = C::linear(y, w[kWq + 2 * i], w[kBq + 2 * i], std::nullopt);
    qkv[i] = t.view({b, t.size(1), heads, c / heads});
  }
  return qkv;
}

// {out} in inference; {out, then the kLayerSaved tensors the backward reads} in training.
template <class C>
std::vector<at::Tensor> layer_forward(const at::Tensor& x, at::TensorList w, at::TensorList running,
                                      const OptT& drop_attn, const OptT& drop_out, at::ArrayRef<double> f,
                                      at::IntArrayRef geom, bool train) {
  check_layer(x, w, running, f, geom, train);
  check_drop(x, drop_attn, drop_out);
  check_rounded(x, w[kLn1W], drop_out, geom);
  const bool rounded = rounded_out(geom);
  const int64_t b = x.size(0), c = x.size(2);
  std::vector<at::Tensor> s(1 + kLayerSaved);
  at::Tensor* saved = s.data() + 1;
  at::Tensor& h = saved[kSavedH];
  h = C::ln(x, w[kLn1W], w[kLn1B], f[kLn1Eps]);
  const auto qkv = layer_qkv<C>(h, w, running, f, geom, train, saved);
  auto [o, lse] = C::attn(qkv[0], qkv[1], qkv[2], std::pow(static_cast<double>(c), -0.5));
  const at::Tensor o3 = o.view({b, o.size(1), c});
  at::Tensor t1 = drop_attn ? C::linear_scaled(o3, w[kWo], w[kBo], x, *drop_attn, "branch")
                            : C::linear(o3, w[kWo], w[kBo], x);  // out-projection + residual (+ drop path)
  at::Tensor h2 = C::ln(t1, w[kLn2W], w[kLn2B], f[kLn2Eps]);
  at::Tensor& y = s[0];
  if (!train) {
    const at::Tensor f1 = C::linear(h2, w[kW1], w[kB1], std::nullopt, "gelu");
    if (rounded) return {C::linear_rounded(f1, w[kW2], w[kB2], t1)};
    return {drop_out ? C::linear_scaled(f1, w[kW2], w[kB2], t1, *drop_out, "all") : C::linear(f1, w[kW2], w[kB2], t1)};
  }
  std::tie(y, saved[kSavedHidden], saved[kSavedDgelu]) = C::mlp(h2, w[kW1], w[kB1], w[kW2], w[kB2], t1, drop_out, rounded);
  for (int i = 0; i < 3; ++i) saved[kSavedQ + i] = qkv[i];
  saved[kSavedO] = o;
  saved[kSavedLse] = lse;
  saved[kSavedT1] = t1;
  saved[kSavedH2] = h2;
  return s;
}

// ------------------------------------------------------------------------------------ backward
// Where a call writes weight i's gradient: d's entry given beforehand (a view of one buffer), else
// a new tensor; grad_to: a weight's and a bias's.
inline OptT grad_at(const std::vector<at::Tensor>& d, int i) { return if_defined(d[1 + i]); }
inline GradTo grad_to(const std::vector<at::Tensor>& d, int i, int j) { return {grad_at(d, i), grad_at(d, j)}; }

// A branch's output gradient as the later calls read it: for the GEMMs (x's dtype), and for a
// residual (res, whose rows the LayerNorm backward scales by res_scale where given).
struct BranchGrad {
  at::Tensor gemm, res;
  OptT res_scale;
};

// Weight i's and bias j's gradients from g (its rows scaled by drop path's rs first, where given)
// and x, into d; returns the gradient the later calls read (g, or g scaled: the wgrad's row-sum
// pass writes it). An fp32 residual stream's gradient is scaled and rounded to x's dtype for the
// GEMMs once, by that same pass (no separate cast); its residual is g as it comes, with rs as the
// LayerNorm backward's row scale. (The MLP branch's; the attention branch's 16-bit gradient comes
// from the second LayerNorm's backward: mlp_half_backward.)
template <class C>
BranchGrad branch_wgrad(const at::Tensor& g, const at::Tensor& x, const OptT& rs, std::vector<at::Tensor>& d, int i,
                        int j, SideGroup side) {
  // (Where the row pass writes the GEMMs' dY, the weight gradient stays on the current stream: with
  // that copy written first by one pass and fc2's weight gradient beside, the captured step at batch
  // 128 took 20.13 ms against 19.98 with one stream, H100, 2026-12-07.)
  at::Tensor gs;
  if (g.scalar_type() != x.scalar_type()) {
    std::tie(d[1 + i], d[1 + j], gs) = C::wgrad_scaled(g, x, rs, grad_to(d, i, j));
    return {gs, g, rs};
  }
  if (!rs) {  // nothing later reads what it writes: beside the critical path
    std::tie(d[1 + i], d[1 + j]) = beside(side, [&] { return C::wgrad(g, x, true, grad_to(d, i, j)); }, {g});
    return {g, g, std::nullopt};
  }
  std::tie(d[1 + i], d[1 + j], gs) = C::wgrad_scaled(g, x, rs, grad_to(d, i, j));
  return {gs, gs, std::nullopt};
}

// Gradients of the MLP half from the layer's output gradient (drop_out's rows scale it: HF's drop
// path after the residual): (dt1, and into d: W1, b1, W2, b2, ln2). On an fp32 residual stream
// (dt1 fp32, 16-bit weights) the LayerNorm backward also writes the attention branch's 16-bit
// gradient (dt1 scaled by drop_attn's rows, one rounding) into ga.
template <class C>
at::Tensor mlp_half_backward(const at::Tensor& grad, at::TensorList w, at::TensorList s, const OptT& drop_out,
                             const OptT& drop_attn, at::ArrayRef<double> f, std::vector<at::Tensor>& d,
                             at::Tensor& ga) {
  const BranchGrad bg = branch_wgrad<C>(grad, s[kSavedHidden], drop_out, d, kW2, kB2, kSideFc2);
  const at::Tensor& g = bg.gemm;
  auto [dz, db1] = C::dgrad(g, w[kW2], s[kSavedDgelu], grad_at(d, kB1));  // GELU' and fc1's bias gradient
  d[1 + kB1] = db1;
  d[1 + kW1] =  // beside the critical path (fc1's dgrad, the LayerNorm backward)
      std::get<0>(beside(kSideFc1, [&] { return C::wgrad(dz, s[kSavedH2], false, {grad_at(d, kW1), {}}); }, {dz}));
  at::Tensor dt1;  // with the residual's gradient g added by the LayerNorm backward
  const bool stream32 = s[kSavedT1].scalar_type() != w[kLn2W].scalar_type();
  std::tie(dt1, d[1 + kLn2W], d[1 + kLn2B]) =
      C::ln_bwd(std::get<0>(C::dgrad(dz, w[kW1], std::nullopt)), s[kSavedT1], w[kLn2W], f[kLn2Eps], bg.res,
                bg.res_scale, {}, {}, grad_to(d, kLn2W, kLn2B), stream32 ? &ga : nullptr,
                stream32 ? drop_attn : std::nullopt);
  return dt1;
}

// Gradients of the attention half from dt1 (or, on an fp32 stream, from ga16: dt1's 16-bit copy
// with drop path applied): (the gradients of h from the q, k and v projections, which the
// LayerNorm backward sums, and into d: Wo, bo, Wq..bv, the projections' weights).
template <class C>
std::array<at::Tensor, 3> attention_half_backward(const at::Tensor& dt1, const at::Tensor& ga16, at::TensorList w,
                                                  at::TensorList s, const OptT& drop_attn, at::ArrayRef<double> f,
                                                  at::IntArrayRef geom, std::vector<at::Tensor>& d) {
  const at::Tensor& o = s[kSavedO];
  const int64_t b = o.size(0), lq = o.size(1), c = o.size(2) * o.size(3);
  at::Tensor ga = ga16;  // the LayerNorm backward's 16-bit copy, drop path applied (an fp32 stream)
  if (ga.defined()) {
    TORCH_CHECK(ga.scalar_type() == o.scalar_type(), "cvt_cutlass.cvt_layer_backward: the attention branch's ",
                "gradient is ", ga.scalar_type(), " (the LayerNorm weights' dtype), its output ", o.scalar_type());
    std::tie(d[1 + kWo], d[1 + kBo]) =
        beside(kSideOut, [&] { return C::wgrad(ga, o.view({b, lq, c}), true, grad_to(d, kWo, kBo)); }, {ga});
  } else {
    ga = branch_wgrad<C>(dt1, o.view({b, lq, c}), drop_attn, d, kWo, kBo, kSideOut).gemm;
  }
  const at::Tensor dout = std::get<0>(C::dgrad(ga, w[kWo], std::nullopt)).view(o.sizes());
  auto [dq, dk, dv] = C::attn_bwd(dout, s[kSavedQ], s[kSavedQ + 1], s[kSavedQ + 2], o, s[kSavedLse],
                                  std::pow(static_cast<double>(c), -0.5));
  std::array<at::Tensor, 3> gp = {dq, dk, dv};
  for (at::Tensor& g : gp) g = g.view({b, g.size(1), c});
  beside(  // the three weight gradients beside the critical path: the dgrads below, the depthwise backward
      kSideQkv, [&] {
        for (int i = 0; i < 3; ++i)
          std::tie(d[1 + kWq + 2 * i], d[1 + kBq + 2 * i]) =
              C::wgrad(gp[i], s[kSavedY + i], true, grad_to(d, kWq + 2 * i, kBq + 2 * i));
        return 0;
      },
      {gp[0], gp[1], gp[2]});
  std::array<at::Tensor, 3> dy;  // the projections' output gradients (before their GEMMs)
  for (int i = 0; i < 3; ++i) dy[i] = std::get<0>(C::dgrad(gp[i], w[kWq + 2 * i], std::nullopt));
  auto proj = [&](int i) {
    return DwBnBwdProj{dy[i], w[kProj + 3 * i], w[kProj + 3 * i + 1], s[kSavedMean + i], s[kSavedInvstd + i]};
  };
  const std::array<DwBnBwdOut, 3> out = C::dwbn_qkv_bwd(s[kSavedH], proj(0), proj(1), proj(2), geom);
  std::array<at::Tensor, 3> dh;  // h's gradient from each projection, or their sum in dh[0] (the others undefined)
  for (int i = 0; i < 3; ++i) {  // fp32; converted to the weights' dtypes by layer_backward
    const size_t p = kProj + 3 * i;
    std::tie(dh[i], d[1 + p], d[1 + p + 1], d[1 + p + 2]) = out[i];
  }
  return dh;
}

// (dx, then one gradient per weight) of a training forward, from its saved tensors; the first
// kProj weights' gradients written into `to` where given (weight_grad_buffer's views).
template <class C>
std::vector<at::Tensor> layer_backward(const at::Tensor& grad, const at::Tensor& x, at::TensorList w,
                                       at::TensorList s, const OptT& drop_attn, const OptT& drop_out,
                                       at::ArrayRef<double> f, at::IntArrayRef geom, at::TensorList to) {
  check_layer(x, w, at::TensorList(), f, geom, true);
  check_drop(x, drop_attn, drop_out);
  check_rounded(x, w[kLn1W], drop_out, geom);
  TORCH_CHECK_VALUE(s.size() == kLayerSaved,
                    "cvt_cutlass.cvt_layer_backward: takes a training forward's saved tensors");
  const at::ScalarType out_dtype = rounded_out(geom) ? w[kLn1W].scalar_type() : x.scalar_type();
  TORCH_CHECK_VALUE(grad.scalar_type() == out_dtype, "cvt_cutlass.cvt_layer_backward: grad is ", grad.scalar_type(),
                    ", the output's dtype is ", out_dtype);
  std::vector<at::Tensor> d(1 + w.size());
  std::copy(to.begin(), to.end(), d.begin() + 1);  // grad_to hands these to the calls
  const at::Tensor g = grad.is_contiguous() ? grad : grad.contiguous();  // the kernels read packed rows
  at::Tensor ga16;  // an fp32 stream's attention branch gradient, written beside dt1
  const at::Tensor dt1 = mlp_half_backward<C>(g, w, s, drop_out, drop_attn, f, d, ga16);
  const auto dh = attention_half_backward<C>(dt1, ga16, w, s, drop_attn, f, geom, d);
  std::tie(d[0], d[1 + kLn1W], d[1 + kLn1B]) =  // h's gradients summed, the residual's added
      C::ln_bwd(dh[0], x, w[kLn1W], f[kLn1Eps], dt1, std::nullopt, if_defined(dh[1]), if_defined(dh[2]),
                grad_to(d, kLn1W, kLn1B));
  join_side();       // the weight gradients launched beside the critical path, before their sums
  C::flush_sums(x);  // the weight gradients' deferred column sums, before anything reads them (and
                     // the side stream after them: plans.h, DeferredSums::flush)
  for (size_t p = kProj; p < kProj + 9; ++p)
    if (d[1 + p].scalar_type() != w[p].scalar_type()) d[1 + p] = d[1 + p].to(w[p].scalar_type());
  return d;
}

// ------------------------------------------------------------------------------------ bindings
// cvt_layer_train's result: out and the kLayerSaved tensors, a fixed tuple (see the top).
template <size_t... I>
auto tuple_of(std::vector<at::Tensor>&& v, std::index_sequence<I...>) {
  return std::make_tuple(std::move(v[I])...);
}
using LayerTrainOut = decltype(tuple_of(std::vector<at::Tensor>(), std::make_index_sequence<1 + kLayerSaved>()));

inline LayerTrainOut as_train_out(std::vector<at::Tensor>&& v) {
  return tuple_of(std::move(v), std::make_index_sequence<1 + kLayerSaved>());
}

inline std::vector<at::Tensor> from_train_out(const LayerTrainOut& t) {
  return std::apply([](const auto&... a) { return std::vector<at::Tensor>{a...}; }, t);
}

inline std::string train_returns() {
  std::string r = "(Tensor";
  for (int i = 0; i < kLayerSaved; ++i) r += ", Tensor";
  return r + ")";
}

// CUDA: the hot paths; other devices: the dispatcher (below autograd: the ops' references).
template <class C>
struct LayerImpl {
  static at::Tensor infer(const at::Tensor& x, at::TensorList w, const OptT& da, const OptT& dout,
                          at::ArrayRef<double> f, at::IntArrayRef geom) {
    OpHostTimer timer(kCvtLayer);
    at::AutoDispatchBelowADInplaceOrView below;
    at::Tensor y = layer_forward<C>(x, layer_weights(w, x, false), {}, da, dout, f, geom, false)[0];
    count_call(kCvtLayer, 0);
    return y;
  }
  static LayerTrainOut train(const at::Tensor& x, at::TensorList w, at::TensorList running, const OptT& da,
                             const OptT& dout, at::ArrayRef<double> f, at::IntArrayRef geom) {
    OpHostTimer timer(kCvtLayer);
    at::AutoDispatchBelowADInplaceOrView below;
    auto out = as_train_out(layer_forward<C>(x, layer_weights(w, x, true), running, da, dout, f, geom, true));
    count_call(kCvtLayer, 0);
    return out;
  }
  static std::vector<at::Tensor> backward(const at::Tensor& g, const at::Tensor& x, at::TensorList w,
                                          at::TensorList s, const OptT& da, const OptT& dout,
                                          at::ArrayRef<double> f, at::IntArrayRef geom) {
    OpHostTimer timer(kCvtLayerBackward);
    at::AutoDispatchBelowADInplaceOrView below;
    DeferredSums sums;
    const bool defer = C::kDefersSums && g_defer_sums.load(std::memory_order_relaxed);
    const ThreadScope<DeferredSums> scope(t_deferred_sums, defer ? &sums : nullptr);
    const auto [flat, to] = weight_grad_buffer(w, x);
    // (only where the weight gradients go into that buffer: none of the side stream's memory leaves)
    SideStream side(x, C::kSideStream && !to.empty());
    const ThreadScope<SideStream> side_scope(t_side_stream, side.on() ? &side : nullptr);
    auto d = layer_backward<C>(g, x, layer_weights(w, x, true), s, da, dout, f, geom, to);
    pack_weight_grads(d, w.size(), flat);
    TORCH_INTERNAL_ASSERT(sums.list()->count == 0, "cvt_cutlass.cvt_layer_backward left column sums unflushed");
    count_call(kCvtLayerBackward, 0);
    return d;
  }
};

// ------------------------------------------------------------------------------------ autograd
using LayerTrainSig = LayerTrainOut(const at::Tensor&, at::TensorList, at::TensorList, const OptT&, const OptT&,
                                    at::ArrayRef<double>, at::IntArrayRef);
using LayerBwdSig = std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, at::TensorList, at::TensorList,
                                            const OptT&, const OptT&, at::ArrayRef<double>, at::IntArrayRef);

// One node per layer: saves x, the masks, the weights and the forward's saved tensors (the
// LayerNorm inputs, the projections' conv outputs and batch statistics, q, k, v, the attention
// output and lse, fc1's output and GELU derivative); the backward is one cvt_layer_backward call.
struct LayerFn : torch::autograd::Function<LayerFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList w, at::TensorList running,
                               const OptT& da, const OptT& dout, std::vector<double> f, std::vector<int64_t> geom) {
    static auto op = public_op<LayerTrainSig>("cvt_cutlass::cvt_layer_train");
    at::AutoDispatchBelowADInplaceOrView below;
    std::vector<at::Tensor> out = from_train_out(op.call(x, w, running, da, dout, f, geom));
    std::vector<at::Tensor> keep = {x, da ? *da : at::Tensor(), dout ? *dout : at::Tensor()};
    keep.insert(keep.end(), w.begin(), w.end());
    keep.insert(keep.end(), out.begin() + 1, out.end());
    ctx->save_for_backward(keep);
    ctx->saved_data["scalars"] = f;
    ctx->saved_data["geom"] = geom;
    ctx->saved_data["weights"] = static_cast<int64_t>(w.size());
    ctx->saved_data["running"] = static_cast<int64_t>(running.size());
    return {out[0]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = public_op<LayerBwdSig>("cvt_cutlass::cvt_layer_backward");
    const int64_t nw = ctx->saved_data["weights"].toInt(), nr = ctx->saved_data["running"].toInt();
    variable_list out(1 + nw + nr + 4);  // per input of apply: x, weights, running, the masks, scalars, geom
    if (!grads[0].defined()) return out;
    const auto s = ctx->get_saved_variables();
    const OptT da = if_defined(s[1]), dout = if_defined(s[2]);
    const at::TensorList all(s);
    const auto d = op.call(grads[0], s[0], all.slice(3, nw), all.slice(3 + nw), da, dout,
                           ctx->saved_data["scalars"].toDoubleVector(), ctx->saved_data["geom"].toIntVector());
    for (int64_t i = 0; i <= nw; ++i)
      if (ctx->needs_input_grad(i)) out[i] = d[i];
    return out;
  }
};

// The autograd kernel of cvt_layer_train: the node when a gradient is recorded; the saved tensors
// are then kept by the node, and the op's other results are undefined.
inline LayerTrainOut cvt_layer_train_autograd(const at::Tensor& x, at::TensorList w, at::TensorList running,
                                              const OptT& da, const OptT& dout, at::ArrayRef<double> f,
                                              at::IntArrayRef geom) {
  bool grad = at::GradMode::is_enabled() && x.requires_grad();
  for (const at::Tensor& t : w) grad = grad || (at::GradMode::is_enabled() && t.requires_grad());
  if (grad) {
    std::vector<at::Tensor> out(1 + kLayerSaved);
    out[0] = LayerFn::apply(x, w, running, da, dout, f.vec(), geom.vec())[0];
    return as_train_out(std::move(out));
  }
  static auto op = public_op<LayerTrainSig>("cvt_cutlass::cvt_layer_train");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(x, w, running, da, dout, f, geom);
}

inline std::vector<OpSchema> layer_schemas() {
  // no planner (each step plans through its own op) and no Python fallback (each step has its own)
  return {{"cvt_layer", kLayerArgs, "Tensor", "", false},
          {"cvt_layer_train", kLayerTrainArgs, train_returns(), "", false},
          {"cvt_layer_backward", kLayerBwdArgs, "Tensor[]", "", false}};
}

inline void register_layer(torch::Library& pub) {
  using Direct = LayerImpl<DirectCalls>;
  using Dispatched = LayerImpl<DispatchedCalls>;
  constexpr auto any = c10::DispatchKey::CompositeExplicitAutograd;
  define_public(pub, layer_schemas());
  impl_op(pub, "cvt_layer", &Direct::infer);
  pub.impl("cvt_layer", torch::dispatch(any, &Dispatched::infer));
  impl_op(pub, "cvt_layer_train", &Direct::train, &cvt_layer_train_autograd);
  pub.impl("cvt_layer_train", torch::dispatch(any, &Dispatched::train));
  impl_op(pub, "cvt_layer_backward", &Direct::backward);
  pub.impl("cvt_layer_backward", torch::dispatch(any, &Dispatched::backward));
}

inline void register_layer_private(torch::Library& priv) { define_private(priv, layer_schemas()); }

}  // namespace cvt
