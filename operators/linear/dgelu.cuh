// nn.GELU's exact (erf) form and its derivative as EVT compute functors, from shared parts
// (gelu_parts): DGeluErf is what the dgrad epilogues (dgelu, dgelu_dbias) multiply dY . W by at a
// saved pre-activation Z (the traced tree names a placeholder that cvt_cutlass.epilogues.packing
// replaces; CUTLASS's own dGELU is the tanh approximation's derivative); the training forward
// (bias_gelu_dgelu) computes GeluErf for its output and DGeluErf for the derivative it saves from
// one set of parts (the compiler shares them: the sm_90a kernel has the MUFU and FFMA counts of
// DGeluErf alone), and its backward only multiplies by the saved factor.
//
// Its cost is this math: on the stage-3 MLP dgrad (H200, batch 128, 2026-11-22) the plain dgrad
// took 0.055 ms, with GELU' 0.116, with GELU' and the dbias reduction 0.122 (ncu: issue-latency
// bound, about 5 cycles between a warp's instructions). erff (a branchy polynomial) and expf each
// serialise a fragment's elements; this form has no branch, so the compiler interleaves a
// fragment's independent elements (the same formula with an IEEE division and expf branches too:
// 18% slower).
#pragma once
#include <cmath>

#include "cutlass/array.h"
#include "cutlass/cutlass.h"

namespace cvt_kernel {

// __expf (ex2.approx) and __fdividef (rcp.approx) on the device: they add < 1e-6 where e matters
// (|z| < 4) and nothing beyond it.
CUTLASS_HOST_DEVICE float dgelu_exp(float v) {
#if defined(__CUDA_ARCH__)
  return __expf(v);
#else
  return expf(v);
#endif
}
CUTLASS_HOST_DEVICE float dgelu_rcp(float v) {
#if defined(__CUDA_ARCH__)
  return __fdividef(1.f, v);
#else
  return 1.f / v;
#endif
}
// Phi(z), the standard normal's CDF, and e = exp(-z^2 / 2), which GELU and its derivative share:
// gelu(z) = z Phi(z), gelu'(z) = Phi(z) + z phi(z) with phi(z) = e / sqrt(2 pi). The tail
// Q(|z|) = erfc(|x|) / 2, x = |z| / sqrt(2), by Abramowitz & Stegun 7.1.26 (erfc within 1.5e-7
// absolute) from e; Phi is Q(|z|) for z < 0 (no cancellation in the left tail) and 1 - Q(|z|)
// else, chosen by a select, not a branch.
struct GeluParts {
  float cdf, e;
};
CUTLASS_HOST_DEVICE GeluParts gelu_parts(float x) {
  const float e = dgelu_exp(-0.5f * x * x);
  const float t = dgelu_rcp(fmaf(0.3275911f * 0.70710678118654752f, fabsf(x), 1.f));
  const float p = t * fmaf(t, fmaf(t, fmaf(t, fmaf(t, 1.061405429f, -1.453152027f), 1.421413741f), -0.284496736f),
                           0.254829592f);
  const float q = 0.5f * p * e;
  return {x < 0.f ? q : 1.f - q, e};
}

// d/dz gelu(z) = Phi(z) + z phi(z), fp32, branch-free: absolute error < 2e-6, against an output
// rounded to 2^-9 (bf16) or 2^-12 (fp16) relative.
template <class T>
struct DGeluErf {
  static const bool kIsHeavy = true;
  CUTLASS_HOST_DEVICE T operator()(T const& z) const {
    const float x = float(z);
    const GeluParts g = gelu_parts(x);
    return T(g.cdf + x * 0.39894228040143268f * g.e);
  }
};

// nn.GELU's exact form, z Phi(z), from the same parts as DGeluErf: where an epilogue computes both
// for one value (the training forward's GELU and the derivative it saves) the compiler computes the
// parts once. Absolute error < 2e-6 |z|.
template <class T>
struct GeluErf {
  static const bool kIsHeavy = true;
  CUTLASS_HOST_DEVICE T operator()(T const& z) const {
    const float x = float(z);
    return T(x * gelu_parts(x).cdf);
  }
};
// The two functors on CUTLASS's Array fragments (the epilogue's form): each element in turn.
template <template <class> class F, class T, int N>
CUTLASS_HOST_DEVICE cutlass::Array<T, N> each_of(cutlass::Array<T, N> const& z) {
  cutlass::Array<T, N> y;
  F<T> f;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < N; ++i) y[i] = f(z[i]);
  return y;
}
template <class T, int N>
struct DGeluErf<cutlass::Array<T, N>> {
  static const bool kIsHeavy = true;
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& z) const {
    return each_of<cvt_kernel::DGeluErf>(z);
  }
};
template <class T, int N>
struct GeluErf<cutlass::Array<T, N>> {
  static const bool kIsHeavy = true;
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& z) const {
    return each_of<cvt_kernel::GeluErf>(z);
  }
};

}  // namespace cvt_kernel
