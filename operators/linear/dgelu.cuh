// d/dz of nn.GELU's exact (erf) form as an EVT compute functor: what the dgrad epilogues
// (dgelu, dgelu_dbias) multiply dY . W by, at the saved pre-activation Z. CUTLASS's own dGELU is
// the tanh approximation's derivative; the traced tree names a placeholder that
// cvt_cutlass.epilogues.packing replaces with DGeluErf.
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

// d/dz gelu(z) for nn.GELU's exact (erf) form: Phi(z) + z * phi(z), in fp32, branch-free.
// erf(|x|), x = z / sqrt(2), by Abramowitz & Stegun 7.1.26 (absolute error <= 1.5e-7) from the
// same e = exp(-x^2) = exp(-z^2 / 2) that phi needs; __expf (ex2.approx) and __fdividef (rcp.approx)
// add < 1e-6 where e matters (|z| < 4) and nothing beyond it. Total absolute error < 2e-6, against
// an output rounded to 2^-9 (bf16) or 2^-12 (fp16) relative.
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
template <class T>
struct DGeluErf {
  static const bool kIsHeavy = true;
  CUTLASS_HOST_DEVICE T operator()(T const& z) const {
    const float x = float(z);
    const float e = dgelu_exp(-0.5f * x * x);
    const float t = dgelu_rcp(fmaf(0.3275911f * 0.70710678118654752f, fabsf(x), 1.f));
    const float p = t * fmaf(t, fmaf(t, fmaf(t, fmaf(t, 1.061405429f, -1.453152027f), 1.421413741f), -0.284496736f),
                             0.254829592f);
    return T(0.5f + 0.5f * copysignf(1.f - p * e, x) + x * 0.39894228040143268f * e);
  }
};
template <class T, int N>
struct DGeluErf<cutlass::Array<T, N>> {
  static const bool kIsHeavy = true;
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& z) const {
    cutlass::Array<T, N> y;
    DGeluErf<T> f;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) y[i] = f(z[i]);
    return y;
  }
};

}  // namespace cvt_kernel
