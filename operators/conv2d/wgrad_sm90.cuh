// CvT's token-embedding conv, weight gradient, on CUTLASS 3.x's SM90 implicit GEMM (TMA im2col +
// wgmma, built for sm_90a): dw (K, R, S, C) KRSC = dy^T . im2col(x), dy (N, P, Q, K) and x (N, H,
// W, C) NHWC, fp32 accumulation over the whole GEMM-K = N * P * Q in one CTA per output tile (no
// split: CUTLASS 4.2's SM90 conv kernel is the non-persistent warp-specialized one), dw written in
// dy's dtype by the epilogue; db (K,) = dy summed over N * P * Q by the deterministic row-sum pass
// and its partials' column sum (common/reduce.cuh) in the same launch. TMA needs 16-byte rows: C
// and K multiples of 8 (the stem stays on the row-window or SM80-class kernels).
//
// The GEMM is M = K output channels, N = R * S * C, so stage 3's 384 x 1,728 (CvT-13) is 42 to 162
// output tiles over 132 SMs, each accumulating 25,088 rows at batch 128: where the SM80-class
// kernel splits GEMM-K for parallelism, this one relies on wgmma's rate per SM.
//
// A kernel's generated .cu (operators/conv2d/spec.py: Conv90BwdSpec) defines Cfg:
//   Element                        cutlass::half_t | cutlass::bfloat16_t
//   TileShape                      Shape<_M, Shape<_N>, Shape<_K>> (cute: N and K nested, as CUTLASS's
//                                  SM90 wgrad builds take it)
//   ClusterShape                   Shape<_CM, _CN, _1> (cute)
//   kStages                        0: as many as fit beside the epilogue's shared storage
#pragma once
#include "conv2d/sm90_conv.cuh"
#include "cutlass/util/packed_stride.hpp"
#include "common/reduce.cuh"
#include "conv2d/bwd_geometry.cuh"

namespace cvt_kernel {

template <class Cfg>
struct WgradSm90 {
  static constexpr int kFamily = CVT_FAMILY_CONV2D_BWD;
  using Element = typename Cfg::Element;
  using TileShape = typename Cfg::TileShape;
  using ClusterShape = typename Cfg::ClusterShape;
  // D = acc (alpha 1, beta 0): no C operand is read. The output's layout tag is TensorKCSR, as
  // CUTLASS's wgrad builds take it (its strides come from the problem: dw packed KRSC).
  using LayoutD = cutlass::layout::TensorKCSR;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD, 8, Element, LayoutD, 8, cutlass::epilogue::TmaWarpSpecialized>::CollectiveOp;
  // A = dy ((K), (Q, P, N)), B = x ((C), (W, H, N)) through TMA im2col
  using Parts = Sm90ConvKernel<Cfg, cutlass::conv::Operator::kWgrad, CollectiveEpilogue>;
  using ProblemShape = typename Parts::ProblemShape;
  using ConvKernel = typename Parts::ConvKernel;
  using Conv = typename Parts::Conv;
  using StrideC = typename ConvKernel::StrideC;
  using StrideD = typename ConvKernel::StrideD;

  static typename Conv::Arguments make_arguments(const cvt_convbwd_args& p) {
    // the activation is x (N, H, W, C), the filter dw (K, R, S, C); dy is the transformed activation
    ProblemShape problem(cutlass::conv::Mode::kCrossCorrelation,
                         {int(p.n), int(p.h), int(p.w), int(p.c)}, {int(p.k), int(p.r), int(p.s), int(p.c)},
                         {int(p.pad_h), int(p.pad_w)}, {int(p.pad_h), int(p.pad_w)},
                         {int(p.stride_h), int(p.stride_w)}, {int(p.dilation_h), int(p.dilation_w)}, 1);
    // dw ((K), (C, S, R)) packed: CUTLASS's own stride for a wgrad output
    const StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, problem.shape_C, problem.stride_C,
                                                              cutlass::conv::Operator::kWgrad);
    typename Conv::Arguments args{
        problem,
        {static_cast<const Element*>(p.dy), static_cast<const Element*>(p.x)},
        {{}, nullptr, StrideC{}, static_cast<Element*>(p.dw), stride_d}};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.hw_info.device_id = p.device_id;
    args.hw_info.sm_count = sm_count_of(p.device_id);
    return args;
  }

  static bool can_implement(const cvt_convbwd_args& p) {
    if (!convbwd_geometry_ok(p) || !p.x || !p.dw || p.c % 8 || !tma_ready()) return false;
    return Conv::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
  }

  static size_t gemm_workspace(const cvt_convbwd_args& p) {
    return (Conv::get_workspace_size(make_arguments(p)) + 255) / 256 * 256;
  }
  static size_t workspace_size(const cvt_convbwd_args& p) {
    return gemm_workspace(p) + (p.db ? rowsum_workspace(p.n * p.p * p.q, p.k, sms_of(p)) : 0);
  }

  // The wgrad GEMM (dw written whole by each output tile's CTA), then db's row partials over dy and
  // their column sum: all on `stream`, no atomics (deterministic).
  static int launch(const cvt_convbwd_args& p, void* workspace, cudaStream_t stream) {
    if (int st = launch_sm90_conv<ConvKernel, Conv>(make_arguments(p), workspace, p.device_id, stream); st != CVT_OK)
      return st;
    if (p.db) {
      float* part_b = reinterpret_cast<float*>(static_cast<char*>(workspace) + gemm_workspace(p));
      colsum2<Element>(rowsum_partials_of(static_cast<const Element*>(p.dy), p.n * p.p * p.q, p.k, p.k, sms_of(p),
                                          part_b, static_cast<Element*>(p.db), stream),
                       {}, stream);
    }
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }
};

}  // namespace cvt_kernel
