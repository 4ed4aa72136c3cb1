// What the conv backward kernels (conv2d/dgrad_sm80.cuh, conv2d/wgrad_sm80.cuh) share: the geometry
// every one of them checks (packed NHWC / KRSC, 32-bit GEMM extents, no dilation: the
// strided-dgrad kernel has none; K a multiple of 8: 16-byte dy rows) and the CUTLASS problem size of
// a cvt_convbwd_args.
#pragma once
#include <cstdint>

#include "cutlass/conv/conv2d_problem_size.h"
#include "conv2d/abi.h"

namespace cvt_kernel {

inline bool convbwd_geometry_ok(const cvt_convbwd_args& p) {
  if (p.n <= 0 || p.h <= 0 || p.w <= 0 || p.c <= 0 || p.k <= 0 || p.r <= 0 || p.s <= 0 || p.p <= 0 || p.q <= 0)
    return false;
  if (p.n * p.h * p.w * p.c > INT32_MAX || p.n * p.p * p.q * p.k > INT32_MAX || p.k * p.r * p.s * p.c > INT32_MAX)
    return false;
  if (p.pad_h < 0 || p.pad_w < 0 || p.stride_h < 1 || p.stride_w < 1 || p.dilation_h != 1 || p.dilation_w != 1)
    return false;
  if (p.p != (p.h + 2 * p.pad_h - p.dilation_h * (p.r - 1) - 1) / p.stride_h + 1) return false;
  if (p.q != (p.w + 2 * p.pad_w - p.dilation_w * (p.s - 1) - 1) / p.stride_w + 1) return false;
  return p.k % 8 == 0 && p.dy;
}

// The GEMM-K dimension split `splits` ways (wgrad's parallel split-K; 1 for dgrad).
inline cutlass::conv::Conv2dProblemSize convbwd_problem(const cvt_convbwd_args& p, int splits) {
  return cutlass::conv::Conv2dProblemSize(
      int(p.n), int(p.h), int(p.w), int(p.c), int(p.k), int(p.r), int(p.s), int(p.p), int(p.q),
      int(p.pad_h), int(p.pad_w), int(p.stride_h), int(p.stride_w), int(p.dilation_h), int(p.dilation_w),
      cutlass::conv::Mode::kCrossCorrelation, splits, /*groups=*/1);
}

}  // namespace cvt_kernel
