// The Linear family's GEMM on CUTLASS 3.x SM90 collectives (TMA + wgmma, warp-specialized,
// persistent tile schedulers), built for sm_90a: GemmSm90<Cfg> computes D = epilogue(A @ B^T)
// with A (M, K) row-major and D (M, N) row-major. The forward, y = epilogue(x @ W^T), reads B = W
// (N, K) as nn.Linear stores it (LayoutB ColumnMajor); the input gradient (linear/dgrad_sm90.cuh)
// reads the same weight as a row-major K x N operand (LayoutB RowMajor: no transposed copy).
//
// A kernel's generated .cu (operators/linear/spec.py) defines Cfg:
//   Element                       cutlass::half_t | cutlass::bfloat16_t (A and B; fp32 accumulation)
//   ElementD                      Element, or float for an fp32 residual stream (D and a residual C)
//   TileShape, ClusterShape       cute shapes of the CTA tile and the cluster
//   KernelSchedule, EpilogueSchedule
//   EpilogueTile                  cutlass::epilogue::collective::EpilogueTileAuto or Shape<_M, _N>
//   ElementC                      void when the epilogue reads no C; else C's type: ElementD (a 16-bit
//                                 residual, or the saved pre-activation Z), float (an fp32 residual,
//                                 also beside a 16-bit D) or cutlass::half_t (the saved GELU')
//   LayoutB                       see above
//   TileScheduler                 void (persistent) or cutlass::gemm::StreamKScheduler
//   kStages                       0: as many as fit beside the epilogue's shared storage
//   kAlign, kRaster, kSwizzle     16-byte accesses (8); tile-scheduler raster order and swizzle
//   kPdl                          programmatic dependent launch: CUTLASS's SM90 kernels then execute
//                                 griddepcontrol.wait in their producer warps before any global
//                                 load (consumers write only after consuming that data), so an
//                                 early start cannot read unfinished inputs or overwrite memory
//                                 still being read (the .cu defines CUTLASS_ENABLE_GDC_FOR_SM90)
//   template <class EpilogueDescriptor> struct Fusion
//                                 the EVT traced from cvt_cutlass.epilogues: Callbacks, ElementC,
//                                 StrideC, ElementD, StrideD, and arguments(p) packing its operands
//                                 from the cvt_gemm_args fields
//
// The launchers take the caller's stream and workspace, never allocate, never synchronise and set
// the shared-memory attribute once per device.
#pragma once
#include "common/tma_driver.cuh"  // before any CUTLASS header

// (CUTLASS's headers in the order its own SM90 GEMM examples include them.)
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "linear/abi.h"
#include "common/device.cuh"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler_params.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "common/universal.cuh"

namespace cvt_kernel {

template <class Cfg>
struct GemmSm90 {
  static constexpr int kFamily = CVT_FAMILY_GEMM;
  static constexpr int kAlign = Cfg::kAlign;
  using Element = typename Cfg::Element;
  using TileShape = typename Cfg::TileShape;
  using ClusterShape = typename Cfg::ClusterShape;
  using EpilogueDescriptor = cutlass::epilogue::collective::detail::EpilogueDescriptor<
      TileShape, typename Cfg::EpilogueTile, typename Cfg::ElementC, typename Cfg::ElementD,
      typename Cfg::EpilogueSchedule>;
  using Fusion = typename Cfg::template Fusion<EpilogueDescriptor>;
  using ElementC = typename Fusion::ElementC;
  using StrideC = typename Fusion::StrideC;
  using ElementD = typename Fusion::ElementD;
  using StrideD = typename Fusion::StrideD;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      typename Cfg::EpilogueTile, float, float,
      ElementC, StrideC, kAlign, ElementD, StrideD, kAlign,
      typename Cfg::EpilogueSchedule, typename Fusion::Callbacks>::CollectiveOp;
  using StageCount = std::conditional_t<
      Cfg::kStages == 0,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::collective::StageCount<Cfg::kStages>>;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cutlass::layout::RowMajor, kAlign,
      Element, typename Cfg::LayoutB, kAlign,
      float, TileShape, ClusterShape, StageCount, typename Cfg::KernelSchedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
      cute::Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue, typename Cfg::TileScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  static constexpr int kSmemBytes = GemmKernel::SharedStorageSize;

  static const void* kernel_fn() { return reinterpret_cast<const void*>(cutlass::device_kernel<GemmKernel>); }

  static typename GemmKernel::Arguments make_arguments(const cvt_gemm_args& p) {
    using StrideA = typename CollectiveMainloop::StrideA;
    using StrideB = typename CollectiveMainloop::StrideB;
    StrideA stride_a = cute::make_stride(int64_t(p.lda), cute::Int<1>{}, int64_t(0));
    StrideB stride_b;
    if constexpr (std::is_same_v<typename Cfg::LayoutB, cutlass::layout::ColumnMajor>)
      stride_b = cute::make_stride(int64_t(p.ldb), cute::Int<1>{}, int64_t(0));
    else
      stride_b = cute::make_stride(cute::Int<1>{}, int64_t(p.ldb), int64_t(0));
    StrideD stride_d = cute::make_stride(int64_t(p.ldd), cute::Int<1>{}, cute::Int<0>{});
    StrideC stride_c{};
    if constexpr (!cute::is_void_v<ElementC>) {
      stride_c = cute::make_stride(int64_t(p.ldc), cute::Int<1>{}, cute::Int<0>{});
    }
    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = p.device_id;
    hw_info.sm_count = p.sm_count > 0 ? p.sm_count : sm_count_of(p.device_id);

    typename GemmKernel::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {int(p.m), int(p.n), int(p.k), 1},
        {static_cast<Element const*>(p.a), stride_a, static_cast<Element const*>(p.b), stride_b},
        {Fusion::arguments(p),
         static_cast<ElementC const*>(p.c), stride_c,
         static_cast<ElementD*>(p.d), stride_d},
        hw_info};
    args.scheduler.raster_order = Cfg::kRaster;
    args.scheduler.max_swizzle_size = Cfg::kSwizzle;
    return args;
  }

  static bool can_implement(const cvt_gemm_args& p) {
    if (p.m <= 0 || p.n <= 0 || p.k <= 0 || p.m > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX)
      return false;
    if (!tma_ready()) return false;
    return Gemm::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
  }

  static size_t workspace_size(const cvt_gemm_args& p) { return Gemm::get_workspace_size(make_arguments(p)); }

  static int launch(const cvt_gemm_args& p, void* workspace, cudaStream_t stream) {
    if (!smem_ready<GemmKernel>(kernel_fn(), kSmemBytes, p.device_id)) return CVT_ERR_SMEM;
    return run_universal<GemmKernel, Gemm, Cfg::kPdl>(make_arguments(p), workspace, stream);
  }
};

}  // namespace cvt_kernel
