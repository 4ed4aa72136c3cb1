// CvT's token-embedding conv, weight gradient, on CUTLASS 2.x's SM80-class implicit GEMM (cp.async +
// mma.sync; serves sm_89 and, built for the running GPU, sm_90): dw (K, R, S, C) KRSC = dy^T .
// im2col(x) with dy (N, P, Q, K) and x (N, H, W, C) NHWC, and db (K,) = dy summed over N*P*Q when
// asked for; fp32 accumulation, dw and db written in dy's dtype. GEMM M = K, N = R*S*C, K = N*P*Q
// (up to 401,408 for the stem at batch 128 against a 64 x 196 output), so GEMM-K is split: CUTLASS's
// parallel split-K writes fp32 partials per split into the workspace and one small pass sums them in
// split order (deterministic, no fp16 round trips). CUTLASS 2.x conv has no operand-reducing
// mainloop: db is a deterministic row-sum pass over dy in the same launch (common/reduce.cuh).
//
// A kernel's generated .cu (operators/conv2d/spec.py: ConvBwdSpec, pass wgrad) defines Cfg:
//   Element                        cutlass::half_t | cutlass::bfloat16_t
//   ThreadblockShape, WarpShape    cutlass::gemm::GemmShape<...> (instructions 16x8x16)
//   kStages                        mainloop stages
//   kIterator                      cutlass::conv::IteratorAlgorithm (kOptimized | kAnalytic)
//   kAlign                         elements per access of x: 8, or 4 for the stem's padded 4 channels
//   kWaves                         CTAs per SM the automatic GEMM-K split aims for
#pragma once
#include "conv2d/sm80_conv.cuh"
#include "common/reduce.cuh"
#include "conv2d/bwd_geometry.cuh"

namespace cvt_kernel {

template <class Cfg>
struct WgradSm80 {
  static constexpr int kFamily = CVT_FAMILY_CONV2D_BWD;
  using Element = typename Cfg::Element;
  using Layout = cutlass::layout::TensorNHWC;
  // Each split writes its fp32 partial dw (beta 0) to its own slab of the workspace.
  using EpilogueOp = cutlass::epilogue::thread::LinearCombination<float, 4, float, float>;
  // A = dy (K contiguous), B = im2col(x) (C contiguous, kAlign-element accesses), D = fp32 partial
  // dw (K, R, S, C) per split.
  using ConvKernel = typename cutlass::conv::kernel::DefaultConv2dWgrad<
      Element, Layout, Element, Layout, float, Layout, float,
      cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      typename Cfg::ThreadblockShape, typename Cfg::WarpShape,
      cutlass::gemm::GemmShape<16, 8, 16>, EpilogueOp,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, Cfg::kStages,
      cutlass::arch::OpMultiplyAdd, Cfg::kIterator,
      cutlass::conv::StrideSupport::kStrided, 8, Cfg::kAlign>::Kernel;
  using Conv = cutlass::conv::device::ImplicitGemmConvolution<ConvKernel>;
  static constexpr int kTileM = Cfg::ThreadblockShape::kM, kTileN = Cfg::ThreadblockShape::kN,
                       kTileK = Cfg::ThreadblockShape::kK;

  // GEMM-K splits: p.splits if set, else enough for kWaves CTA(s) per SM over the output tiles, each
  // split at least 8 K-tiles. CUTLASS runs exactly this many (grid z); split z reads K-tiles z,
  // z + splits, ...
  static int splits_of(const cvt_convbwd_args& p) {
    int64_t s = p.splits;
    if (s <= 0) {
      const int64_t tiles = ((p.k + kTileM - 1) / kTileM) * ((p.r * p.s * p.c + kTileN - 1) / kTileN);
      const int64_t want = (Cfg::kWaves * int64_t(sms_of(p)) + tiles - 1) / tiles,
                    most = p.n * p.p * p.q / (8 * kTileK);
      s = want < most ? want : most;
    }
    return int(s < 1 ? 1 : (s > 512 ? 512 : s));
  }

  static int64_t dw_size(const cvt_convbwd_args& p) { return p.k * p.r * p.s * p.c; }
  static size_t partials_bytes(const cvt_convbwd_args& p) {
    return (size_t(splits_of(p)) * size_t(dw_size(p)) * sizeof(float) + 255) / 256 * 256;
  }

  static typename Conv::Arguments make_arguments(const cvt_convbwd_args& p, float* partials) {
    Layout lx = Layout::packed({int(p.n), int(p.h), int(p.w), int(p.c)});
    Layout ly = Layout::packed({int(p.n), int(p.p), int(p.q), int(p.k)});
    cutlass::layout::TensorNHWC lw = cutlass::layout::TensorNHWC::packed({int(p.k), int(p.r), int(p.s), int(p.c)});
    using Ref = cutlass::TensorRef<Element, Layout>;
    using RefD = cutlass::TensorRef<float, Layout>;
    return typename Conv::Arguments(
        convbwd_problem(p, splits_of(p)), Ref(static_cast<Element*>(const_cast<void*>(p.dy)), ly),
        Ref(static_cast<Element*>(const_cast<void*>(p.x)), lx), RefD(partials, lw), RefD(partials, lw),
        {1.0f, 0.0f}, cutlass::conv::SplitKMode::kParallel);
  }

  static bool can_implement(const cvt_convbwd_args& p) {
    if (!convbwd_geometry_ok(p) || p.c % Cfg::kAlign || !p.x || !p.dw) return false;
    return Conv::can_implement(make_arguments(p, nullptr)) == cutlass::Status::kSuccess;
  }

  static size_t workspace_size(const cvt_convbwd_args& p) {
    return partials_bytes(p) + (p.db ? rowsum_workspace(p.n * p.p * p.q, p.k, sms_of(p)) : 0);
  }

  // The wgrad kernel (split z writes fp32 partial dw z), dy's row partials for db, then both sets of
  // partials summed in order in one launch: all on `stream`, no atomics (deterministic).
  static int launch(const cvt_convbwd_args& p, void* workspace, cudaStream_t stream) {
    if (!workspace) return CVT_ERR_WORKSPACE;
    float* partials = static_cast<float*>(workspace);
    int st = launch_sm80_conv<ConvKernel>(make_arguments(p, partials), /*semaphore=*/nullptr, p.device_id, stream);
    if (st != CVT_OK) return st;
    ColsumSegment<Element> db;  // dy's row partials, summed with dw's split partials in one launch
    if (p.db) {
      float* part_b = reinterpret_cast<float*>(static_cast<char*>(workspace) + partials_bytes(p));
      db = rowsum_partials_of(static_cast<const Element*>(p.dy), p.n * p.p * p.q, p.k, p.k, sms_of(p), part_b,
                              static_cast<Element*>(p.db), stream);
    }
    colsum2<Element>({partials, splits_of(p), dw_size(p), dw_size(p), static_cast<Element*>(p.dw)}, db, stream);
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }
};

}  // namespace cvt_kernel
