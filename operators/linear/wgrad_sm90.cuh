// The Linear weight gradient on wgmma (CUTLASS 3.x SM90: TMA + wgmma, cooperative, stream-K tile
// scheduler; sm_90a): dW (N, K) = dY^T . X, the token rows split by the stream-K scheduler
// (kWaves 0: CUTLASS's stream-K / data-parallel heuristic; w: split-K into enough splits for w
// waves), reduced in fp32 in the scheduler's workspace in a fixed order (deterministic), dW written
// in the weight's dtype by the epilogue. CUTLASS 3.x has no operand-reducing mainloop, so db, when
// asked for, is a separate deterministic row-sum pass over dY (common/reduce.cuh).
//
// GEMM M = N (dY's columns), N = K (X's columns), K = tokens: A = dY^T (the column-major view of
// the row-major dY), B = X (its K x N view is row-major), D = dW (N, K) row-major, no C.
// Cfg (a kernel's generated .cu, operators/linear/wgrad.py): Element, TileShape, kWaves.
#pragma once
#include "common/tma_driver.cuh"  // before any CUTLASS header

// (CUTLASS's headers in the order its own SM90 GEMM examples include them.)
#include <cstdint>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler_params.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "linear/abi.h"
#include "common/device.cuh"
#include "common/reduce.cuh"
#include "common/universal.cuh"

namespace cvt_kernel {

template <class Cfg>
struct WgradSm90 {
  static constexpr int kFamily = CVT_FAMILY_WGRAD;
  static constexpr int kWaves = Cfg::kWaves;  // 0: CUTLASS's stream-K heuristic; w: split-K for w waves of tiles
  using Element = typename Cfg::Element;
  using TileShape = typename Cfg::TileShape;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  static constexpr int64_t kTileM = cute::size<0>(TileShape{}), kTileN = cute::size<1>(TileShape{});

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor, 8, Element, cutlass::layout::RowMajor, 8,
      cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cutlass::layout::ColumnMajor, 8, Element, cutlass::layout::RowMajor, 8,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
      cute::Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue, cutlass::gemm::StreamKScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  static constexpr int kSmemBytes = GemmKernel::SharedStorageSize;

  static const void* kernel_fn() { return reinterpret_cast<const void*>(cutlass::device_kernel<GemmKernel>); }

  static int sms_of(const cvt_wgrad_args& p) {
    const int s = p.sm_count > 0 ? p.sm_count : sm_count_of(p.device_id);
    return s > 0 ? s : 132;
  }

  // Row splits (split-K mode): p.splits if set, else enough for kWaves waves over the output tiles.
  static int splits_of(const cvt_wgrad_args& p) {
    if (p.splits > 0) return p.splits;
    if (kWaves == 0) return 1;
    const int64_t tiles = ((p.n + kTileM - 1) / kTileM) * ((p.k + kTileN - 1) / kTileN);
    const int64_t s = (kWaves * int64_t(sms_of(p)) + tiles - 1) / tiles;
    return int(s < 1 ? 1 : (s > 512 ? 512 : s));
  }

  static typename GemmKernel::Arguments make_arguments(const cvt_wgrad_args& p) {
    using StrideA = typename CollectiveMainloop::StrideA;
    using StrideB = typename CollectiveMainloop::StrideB;
    using StrideD = typename CollectiveEpilogue::StrideD;
    StrideA stride_a = cute::make_stride(cute::Int<1>{}, int64_t(p.ldy), int64_t(0));
    StrideB stride_b = cute::make_stride(cute::Int<1>{}, int64_t(p.ldx), int64_t(0));
    StrideD stride_d = cute::make_stride(int64_t(p.k), cute::Int<1>{}, int64_t(0));
    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = p.device_id;
    hw_info.sm_count = sms_of(p);
    typename GemmKernel::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {int(p.n), int(p.k), int(p.m), 1},
        {static_cast<Element const*>(p.dy), stride_a, static_cast<Element const*>(p.x), stride_b},
        {{}, nullptr, stride_d, static_cast<Element*>(p.dw), stride_d},
        hw_info};
    args.epilogue.thread.alpha = 1.f;
    args.epilogue.thread.beta = 0.f;
    using Mode = cutlass::gemm::kernel::detail::DecompositionMode;
    args.scheduler.splits = splits_of(p);
    args.scheduler.decomposition_mode = (kWaves == 0 && p.splits <= 0) ? Mode::Heuristic : Mode::SplitK;
    args.scheduler.reduction_mode = cutlass::gemm::kernel::detail::ReductionMode::Deterministic;
    return args;
  }

  static size_t gemm_workspace(const cvt_wgrad_args& p) {
    return (Gemm::get_workspace_size(make_arguments(p)) + 255) / 256 * 256;
  }

  static size_t workspace_size(const cvt_wgrad_args& p) {
    return gemm_workspace(p) + (p.db ? rowsum_workspace(p.m, p.n, sms_of(p)) : 0);
  }

  static bool can_implement(const cvt_wgrad_args& p) {
    if (p.m <= 0 || p.n <= 0 || p.k <= 0 || p.m > INT32_MAX || p.n * p.k > INT32_MAX) return false;
    if (p.n % 8 || p.k % 8 || p.ldy % 8 || p.ldx % 8 || p.ldy < p.n || p.ldx < p.k) return false;
    if ((reinterpret_cast<uintptr_t>(p.dy) | reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.dw)) % 16)
      return false;
    if (!tma_ready()) return false;
    return Gemm::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
  }

  static int launch(const cvt_wgrad_args& p, void* workspace, cudaStream_t stream) {
    if (!smem_ready<GemmKernel>(kernel_fn(), kSmemBytes, p.device_id)) return CVT_ERR_SMEM;
    if (int st = run_universal<GemmKernel, Gemm>(make_arguments(p), workspace, stream); st != CVT_OK) return st;
    if (p.db) {
      float* part = reinterpret_cast<float*>(static_cast<char*>(workspace) + gemm_workspace(p));
      rowsum(static_cast<const Element*>(p.dy), p.m, p.n, p.ldy, sms_of(p), part, static_cast<Element*>(p.db), stream,
             p.defer);
    }
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }
};

}  // namespace cvt_kernel
