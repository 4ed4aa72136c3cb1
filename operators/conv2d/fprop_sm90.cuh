// CvT's token-embedding conv, forward, on CUTLASS 3.x's SM90 implicit GEMM (TMA im2col + wgmma,
// built for sm_90a): y (N, P, Q, K) NHWC = conv2d(x NHWC, w KRSC) + bias (K,), fp32 accumulation.
// CUTLASS 4.2's SM90 conv kernel is the non-persistent warp-specialized one; the bias is the
// epilogue's per-column (per output channel) broadcast. TMA needs 16-byte rows: C and K multiples
// of 8.
//
// A kernel's generated .cu (operators/conv2d/spec.py: Conv90Spec) defines Cfg:
//   Element                        cutlass::half_t | cutlass::bfloat16_t
//   TileShape                      Shape<_M, _N, Shape<_K>> (cute)
//   ClusterShape                   Shape<_CM, _CN, _1> (cute)
//   kStages                        0: as many as fit beside the epilogue's shared storage
#pragma once
#include "conv2d/sm90_conv.cuh"

namespace cvt_kernel {

template <class Cfg>
struct FpropSm90 {
  static constexpr int kFamily = CVT_FAMILY_CONV2D_FPROP;
  using Element = typename Cfg::Element;
  using Layout = cutlass::layout::TensorNHWC;
  using TileShape = typename Cfg::TileShape;
  using ClusterShape = typename Cfg::ClusterShape;
  // D = acc + bias[k]: the bias is a per-column (output-channel) broadcast; no C operand is read.
  using Fusion = cutlass::epilogue::fusion::LinCombPerColBias<Element, float, Element, Element, float, 8>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, Layout, 8, Element, Layout, 8, cutlass::epilogue::TmaWarpSpecialized, Fusion>::CollectiveOp;
  using Parts = Sm90ConvKernel<Cfg, cutlass::conv::Operator::kFprop, CollectiveEpilogue>;
  using ProblemShape = typename Parts::ProblemShape;
  using ConvKernel = typename Parts::ConvKernel;
  using Conv = typename Parts::Conv;
  using StrideC = typename ConvKernel::StrideC;
  using StrideD = typename ConvKernel::StrideD;

  static bool geometry_ok(const cvt_conv_args& p) {
    if (p.n <= 0 || p.h <= 0 || p.w <= 0 || p.c <= 0 || p.k <= 0 || p.r <= 0 || p.s <= 0 || p.p <= 0 || p.q <= 0)
      return false;
    if (p.n * p.h * p.w * p.c > INT32_MAX || p.n * p.p * p.q * p.k > INT32_MAX || p.cls_rows != 0) return false;
    if (p.p != (p.h + 2 * p.pad_h - p.dilation_h * (p.r - 1) - 1) / p.stride_h + 1) return false;
    if (p.q != (p.w + 2 * p.pad_w - p.dilation_w * (p.s - 1) - 1) / p.stride_w + 1) return false;
    if (p.x_image_stride != p.h * p.w * p.c || p.y_image_stride != p.p * p.q * p.k) return false;
    if (p.c % 8 || p.k % 8 || !p.bias) return false;
    return true;
  }

  static typename Conv::Arguments make_arguments(const cvt_conv_args& p) {
    ProblemShape problem(cutlass::conv::Mode::kCrossCorrelation,
                         {int(p.n), int(p.h), int(p.w), int(p.c)}, {int(p.k), int(p.r), int(p.s), int(p.c)},
                         {int(p.pad_h), int(p.pad_w)}, {int(p.pad_h), int(p.pad_w)},
                         {int(p.stride_h), int(p.stride_w)}, {int(p.dilation_h), int(p.dilation_w)}, 1);
    StrideD stride_d{};
    cute::for_each(cute::make_seq<cute::rank<0>(StrideD{})>{}, [&](auto i) {
      cute::get<0, i>(stride_d) = problem.stride_C[ProblemShape::RankT - 2 - i];
    });
    typename Conv::Arguments args{
        problem,
        {static_cast<const Element*>(p.x), static_cast<const Element*>(p.filter)},
        {{}, nullptr, StrideC{}, static_cast<Element*>(p.y), stride_d}};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.epilogue.thread.bias_ptr = static_cast<const Element*>(p.bias);
    args.hw_info.device_id = p.device_id;
    args.hw_info.sm_count = sm_count_of(p.device_id);
    return args;
  }

  static bool can_implement(const cvt_conv_args& p) {
    if (!geometry_ok(p) || !tma_ready()) return false;
    return Conv::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
  }

  static size_t workspace_size(const cvt_conv_args& p) { return Conv::get_workspace_size(make_arguments(p)); }

  static int launch(const cvt_conv_args& p, void* workspace, cudaStream_t stream) {
    return launch_sm90_conv<ConvKernel, Conv>(make_arguments(p), workspace, p.device_id, stream);
  }
};

}  // namespace cvt_kernel
