// CvT's token-embedding conv, input gradient, on CUTLASS 2.x's SM80-class strided-dgrad implicit
// GEMM (cp.async + mma.sync; serves sm_89 and, built for the running GPU, sm_90): dx (N, H, W, C)
// NHWC = the transposed conv of dy (N, P, Q, K) NHWC with w (K, R, S, C) KRSC, any stride, fp32
// accumulation. GEMM M = N*H*W (per stride phase), N = C, K = K*R*S: A = dy, B = the filter, D = dx.
// dy and dx are read and written in 16-byte vectors: C and K multiples of 8.
//
// A kernel's generated .cu (operators/conv2d/spec.py: ConvBwdSpec, pass dgrad) defines Cfg:
//   Element                        cutlass::half_t | cutlass::bfloat16_t
//   ThreadblockShape, WarpShape    cutlass::gemm::GemmShape<...> (instructions 16x8x16)
//   kStages                        mainloop stages
//   kSwizzle                       StridedDgradIdentityThreadblockSwizzle's size (1, 4 or 8)
//   kIterator                      cutlass::conv::IteratorAlgorithm (kOptimized | kAnalytic)
#pragma once
#include "conv2d/sm80_conv.cuh"
#include "conv2d/bwd_geometry.cuh"

namespace cvt_kernel {

template <class Cfg>
struct DgradSm80 {
  static constexpr int kFamily = CVT_FAMILY_CONV2D_BWD;
  using Element = typename Cfg::Element;
  using Layout = cutlass::layout::TensorNHWC;
  // dx = 1 * accum (beta 0: no source read).
  using EpilogueOp = cutlass::epilogue::thread::LinearCombination<Element, 8, float, float>;
  using ConvKernel = typename cutlass::conv::kernel::DefaultConv2dDgrad<
      Element, Layout, Element, Layout, Element, Layout, float,
      cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      typename Cfg::ThreadblockShape, typename Cfg::WarpShape,
      cutlass::gemm::GemmShape<16, 8, 16>, EpilogueOp,
      cutlass::conv::threadblock::StridedDgradIdentityThreadblockSwizzle<Cfg::kSwizzle>, Cfg::kStages,
      cutlass::arch::OpMultiplyAdd, Cfg::kIterator,
      cutlass::conv::StrideSupport::kStrided, 8, 8>::Kernel;
  using Conv = cutlass::conv::device::ImplicitGemmConvolution<ConvKernel>;

  static typename Conv::Arguments make_arguments(const cvt_convbwd_args& p) {
    Layout lx = Layout::packed({int(p.n), int(p.h), int(p.w), int(p.c)});
    Layout lw = Layout::packed({int(p.k), int(p.r), int(p.s), int(p.c)});
    Layout ly = Layout::packed({int(p.n), int(p.p), int(p.q), int(p.k)});
    using Ref = cutlass::TensorRef<Element, Layout>;
    Element* dx = static_cast<Element*>(p.dx);
    return typename Conv::Arguments(
        convbwd_problem(p, 1), Ref(static_cast<Element*>(const_cast<void*>(p.dy)), ly),
        Ref(static_cast<Element*>(const_cast<void*>(p.filter)), lw), Ref(dx, lx), Ref(dx, lx),
        {1.0f, 0.0f}, cutlass::conv::SplitKMode::kSerial);
  }

  static bool can_implement(const cvt_convbwd_args& p) {
    if (!convbwd_geometry_ok(p) || p.c % 8 || !p.filter || !p.dx) return false;
    return Conv::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
  }

  static size_t workspace_size(const cvt_convbwd_args& p) { return Conv::get_workspace_size(make_arguments(p)); }

  // Every dx pixel is written (stride phases no filter tap reaches get zeros): dx needs no clearing.
  static int launch(const cvt_convbwd_args& p, void* workspace, cudaStream_t stream) {
    return launch_sm80_conv<ConvKernel>(make_arguments(p), workspace, p.device_id, stream);
  }
};

}  // namespace cvt_kernel
