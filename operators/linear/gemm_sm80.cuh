// The Linear family's GEMM on CUTLASS 2.x SM80-class kernels (cp.async + mma.sync, multistage),
// the sm89 path: tiles that fit the 99 KB of shared memory an sm_89 (RTX 4090) block can use; the
// same instantiation built for the running GPU serves sm_90 too. GemmSm80<Cfg> computes
// D = epilogue(A @ B^T) with A (M, K) row-major and D (M, N) row-major, the epilogue an EVT visitor
// tree (C, D and Z are aux load / store nodes of the tree); B as in linear/gemm_sm90.cuh.
//
// A kernel's generated .cu (operators/linear/spec.py) defines Cfg:
//   Element                        cutlass::half_t | cutlass::bfloat16_t
//   ElementD                       Element, or float for an fp32 residual stream (D and a residual C)
//   ThreadblockShape, WarpShape    cutlass::gemm::GemmShape<...> (instructions 16x8x16)
//   LayoutB                        ColumnMajor (forward) | RowMajor (dgrad)
//   kStages, kSwizzle, kAlign      mainloop stages, threadblock swizzle, 16-byte accesses (8)
//   kEpilogueStages                the visitor epilogue's stages (what the EVT tracer asks)
//   template <class OutputTileThreadMap> struct Fusion
//                                  the EVT traced from cvt_cutlass.epilogues: Callbacks and
//                                  arguments(p) packing its operands from the cvt_gemm_args fields
#pragma once
// (CUTLASS's headers in this order: visitors.hpp needs the GEMM kernel headers first.)
#include <cstdint>

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "linear/abi.h"
#include "common/device.cuh"
#include "cute/tensor.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/default_gemm_universal_with_visitor.h"
#include "cutlass/epilogue/threadblock/fusion/visitors.hpp"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"

namespace cvt_kernel {

template <class Cfg>
struct GemmSm80 {
  static constexpr int kFamily = CVT_FAMILY_GEMM;
  static constexpr int kAlign = Cfg::kAlign;
  static constexpr int kEpilogueStages = Cfg::kEpilogueStages;
  using Element = typename Cfg::Element;
  using ThreadblockShape = typename Cfg::ThreadblockShape;
  using WarpShape = typename Cfg::WarpShape;
  using InstructionShape = cutlass::gemm::GemmShape<16, 8, 16>;
  // the output's element type, as the base epilogue's shared-memory iterator takes it (an fp32 D
  // under a 16-bit element's map would put accumulators at the other map's coordinates)
  using OutputTileThreadMap = cutlass::epilogue::threadblock::OutputTileThreadLayout<
      ThreadblockShape, WarpShape, typename Cfg::ElementD, kAlign, kEpilogueStages>;
  using Fusion = typename Cfg::template Fusion<OutputTileThreadMap>;

  using GemmKernel = typename cutlass::gemm::kernel::DefaultGemmWithVisitor<
      Element, cutlass::layout::RowMajor, cutlass::ComplexTransform::kNone, kAlign,
      Element, typename Cfg::LayoutB, cutlass::ComplexTransform::kNone, kAlign,
      typename Cfg::ElementD, cutlass::layout::RowMajor, kAlign,
      float, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      ThreadblockShape, WarpShape, InstructionShape, typename Fusion::Callbacks,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<Cfg::kSwizzle>, Cfg::kStages,
      cutlass::arch::OpMultiplyAdd, kEpilogueStages>::GemmKernel;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  static constexpr int kSmemBytes = int(sizeof(typename GemmKernel::SharedStorage));

  static const void* kernel_fn() { return reinterpret_cast<const void*>(cutlass::Kernel2<GemmKernel>); }

  static typename Gemm::Arguments make_arguments(const cvt_gemm_args& p) {
    return typename Gemm::Arguments(
        cutlass::gemm::GemmUniversalMode::kGemm, {int(p.m), int(p.n), int(p.k)}, /*batch*/ 1,
        Fusion::arguments(p),
        p.a, p.b, /*C, D: written through the visitor tree*/ nullptr, nullptr,
        /*batch strides*/ 0, 0, 0, 0,
        p.lda, p.ldb, /*ldc, ldd (unused)*/ 0, 0);
  }

  static bool can_implement(const cvt_gemm_args& p) {
    if (p.m <= 0 || p.n <= 0 || p.k <= 0 || p.m > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX)
      return false;
    // The visitor epilogue accesses D, C and Z in 16-byte vectors: their leading dimensions must
    // keep every row aligned, which GemmUniversal::can_implement cannot see.
    if (p.ldd % kAlign || (p.c && p.ldc % kAlign) || (p.aux && p.ldaux % kAlign)) return false;
    return Gemm::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
  }

  static size_t workspace_size(const cvt_gemm_args& p) { return Gemm::get_workspace_size(make_arguments(p)); }

  // The GEMM on `stream` (no smem check: launch() does it).
  static int run(const cvt_gemm_args& p, void* workspace, cudaStream_t stream) {
    Gemm gemm;
    if (gemm.initialize(make_arguments(p), workspace, stream) != cutlass::Status::kSuccess)
      return CVT_ERR_INIT;
    if (gemm.run(stream) != cutlass::Status::kSuccess) {
      (void)cudaGetLastError();
      return CVT_ERR_LAUNCH;
    }
    return CVT_OK;
  }

  static int launch(const cvt_gemm_args& p, void* workspace, cudaStream_t stream) {
    if (!smem_ready<GemmKernel>(kernel_fn(), kSmemBytes, p.device_id)) return CVT_ERR_SMEM;
    const int rc = run(p, workspace, stream);
    if (rc != CVT_OK) return rc;
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }
};

}  // namespace cvt_kernel
