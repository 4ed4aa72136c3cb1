// CvT's token-embedding conv, forward, on CUTLASS 2.x's SM80-class implicit GEMM (cp.async +
// mma.sync, multistage; serves sm_89 and, built for the running GPU, sm_90): y (N, P, Q, K) NHWC =
// conv2d(x (N, H, W, C) NHWC, w (K, R, S, C) KRSC) + bias (K,), fp32 accumulation. GEMM M = N*P*Q,
// N = K, K = R*S*C. The bias is added by the epilogue reading C through a zero-stride tensor (every
// output pixel sees the same (K,) vector), so the output is written once, directly as tokens.
//
// A kernel's generated .cu (operators/conv2d/spec.py: ConvSpec) defines Cfg:
//   Element                        cutlass::half_t | cutlass::bfloat16_t
//   ThreadblockShape, WarpShape    cutlass::gemm::GemmShape<...> (instructions 16x8x16)
//   kStages, kSwizzle              mainloop stages, GemmIdentityThreadblockSwizzle's size
//   kIterator                      cutlass::conv::IteratorAlgorithm: kOptimized (C % 8 == 0),
//                                  kFixedChannels (C == kAlign: the stem padded to 4 channels, one
//                                  access per filter tap) or kFewChannels (C % kAlign == 0)
//   kAlign                         elements per access of the activation and filter loads
#pragma once
#include "conv2d/sm80_conv.cuh"

namespace cvt_kernel {

template <class Cfg>
struct FpropSm80 {
  static constexpr int kFamily = CVT_FAMILY_CONV2D_FPROP;
  using Element = typename Cfg::Element;
  using Layout = cutlass::layout::TensorNHWC;
  // D = 1 * accum + 1 * C, C read through a zero-stride tensor: the (K,) bias for every pixel.
  using EpilogueOp = cutlass::epilogue::thread::LinearCombination<Element, 8, float, float>;
  using ConvKernel = typename cutlass::conv::kernel::DefaultConv2dFprop<
      Element, Layout, Element, Layout, Element, Layout, float,
      cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      typename Cfg::ThreadblockShape, typename Cfg::WarpShape,
      cutlass::gemm::GemmShape<16, 8, 16>, EpilogueOp,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<Cfg::kSwizzle>, Cfg::kStages,
      cutlass::arch::OpMultiplyAdd, Cfg::kIterator,
      cutlass::conv::StrideSupport::kStrided, Cfg::kAlign, Cfg::kAlign>::Kernel;
  using Conv = cutlass::conv::device::ImplicitGemmConvolution<ConvKernel>;

  static bool geometry_ok(const cvt_conv_args& p) {
    const int64_t lim = INT32_MAX;
    if (p.n <= 0 || p.h <= 0 || p.w <= 0 || p.c <= 0 || p.k <= 0 || p.r <= 0 || p.s <= 0 || p.p <= 0 || p.q <= 0)
      return false;
    if (p.n * p.h * p.w * p.c > lim || p.n * p.p * p.q * p.k > lim || p.cls_rows != 0) return false;
    if (p.p != (p.h + 2 * p.pad_h - p.dilation_h * (p.r - 1) - 1) / p.stride_h + 1) return false;
    if (p.q != (p.w + 2 * p.pad_w - p.dilation_w * (p.s - 1) - 1) / p.stride_w + 1) return false;
    // The implicit-GEMM iterators address packed images; the epilogue writes packed rows.
    if (p.x_image_stride != p.h * p.w * p.c || p.y_image_stride != p.p * p.q * p.k) return false;
    if (p.k % 8 || !p.bias) return false;
    return true;
  }

  static typename Conv::Arguments make_arguments(const cvt_conv_args& p) {
    cutlass::conv::Conv2dProblemSize problem(
        int(p.n), int(p.h), int(p.w), int(p.c), int(p.k), int(p.r), int(p.s), int(p.p), int(p.q),
        int(p.pad_h), int(p.pad_w), int(p.stride_h), int(p.stride_w), int(p.dilation_h), int(p.dilation_w),
        cutlass::conv::Mode::kCrossCorrelation, /*split_k_slices=*/1, /*groups=*/1);
    Layout lx = Layout::packed({int(p.n), int(p.h), int(p.w), int(p.c)});
    Layout lw = Layout::packed({int(p.k), int(p.r), int(p.s), int(p.c)});
    Layout ly = Layout::packed({int(p.n), int(p.p), int(p.q), int(p.k)});
    Layout lbias(cutlass::make_Coord(0, 0, 0));
    using Ref = cutlass::TensorRef<Element, Layout>;
    return typename Conv::Arguments(
        problem, Ref(static_cast<Element*>(const_cast<void*>(p.x)), lx),
        Ref(static_cast<Element*>(const_cast<void*>(p.filter)), lw),
        Ref(static_cast<Element*>(const_cast<void*>(p.bias)), lbias), Ref(static_cast<Element*>(p.y), ly),
        {1.0f, 1.0f}, cutlass::conv::SplitKMode::kSerial);
  }

  static bool can_implement(const cvt_conv_args& p) {
    if (!geometry_ok(p)) return false;
    return Conv::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
  }

  static size_t workspace_size(const cvt_conv_args& p) { return Conv::get_workspace_size(make_arguments(p)); }

  static int launch(const cvt_conv_args& p, void* workspace, cudaStream_t stream) {
    return launch_sm80_conv<ConvKernel>(make_arguments(p), workspace, p.device_id, stream);
  }
};

}  // namespace cvt_kernel
