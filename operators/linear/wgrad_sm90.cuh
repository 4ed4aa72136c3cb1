// The Linear weight gradient on wgmma (CUTLASS 3.x SM90: TMA + wgmma, cooperative, stream-K tile
// scheduler; sm_90a): dW (N, K) = dY^T . X, the token rows split by the stream-K scheduler
// (kWaves 0: CUTLASS's stream-K / data-parallel heuristic; w: split-K into enough splits for w
// waves), reduced in fp32 in the scheduler's workspace in a fixed order (deterministic), dW written
// in the weight's dtype by the epilogue. CUTLASS 3.x has no operand-reducing mainloop, so db, when
// asked for, is a separate deterministic row-sum pass over dY (common/reduce.cuh), launched before the
// GEMM: it also zeroes the stream-K barrier flags, in place of CUTLASS's memset. A row scale
// (drop path's backward) is applied by that pass too, and fp32 dY rounded there (an fp32 residual
// stream's gradient): it writes the scaled or rounded dY the GEMM then reads.
//
// GEMM M = N (dY's columns), N = K (X's columns), K = tokens: A = dY^T (the column-major view of
// the row-major dY), B = X (its K x N view is row-major), D = dW (N, K) row-major, no C.
// Cfg (a kernel's generated .cu, operators/linear/wgrad.py): Element, TileShape, kWaves.
#pragma once
#include "common/tma_driver.cuh"  // before any CUTLASS header

// (CUTLASS's headers in the order its own SM90 GEMM examples include them.)
#include <cstdint>
#include <utility>

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
#include "linear/wgrad_rows.cuh"

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

  // Row splits (split-K mode): p.splits if set, else enough for kWaves waves over the output tiles.
  static int splits_of(const cvt_wgrad_args& p) {
    if (p.splits > 0) return p.splits;
    if (kWaves == 0) return 1;
    const int64_t tiles = ((p.n + kTileM - 1) / kTileM) * ((p.k + kTileN - 1) / kTileN);
    const int64_t s = (kWaves * int64_t(sms_of(p)) + tiles - 1) / tiles;
    return int(s < 1 ? 1 : (s > 512 ? 512 : s));
  }

  static typename GemmKernel::Arguments make_arguments(const cvt_wgrad_args& p0) {
    const cvt_wgrad_args p = cvt_wgrad_gemm_view(p0);
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
    if (!wgrad_rows_ok<Element>(p)) return false;
    if (!tma_ready()) return false;
    return Gemm::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
  }

  // Where CUTLASS's initialize_workspace zeroes the stream-K barrier flags (a memset before every
  // launch): {byte offset into the workspace, bytes}, bytes 0 where no tile is split. The workspace
  // holds the epilogue's part (none here, checked), then the scheduler's: the reduction partials, then
  // the barrier flags; the sizes come from the scheduler's own function, called with the arguments
  // GemmUniversal::initialize_workspace and the stream-K scheduler's initialize_workspace pass it.
  // {0, SIZE_MAX} where that layout does not hold (the memset is kept then).
  static std::pair<size_t, size_t> barrier_region(const typename GemmKernel::Arguments& args) {
    using Sched = typename GemmKernel::TileScheduler;
    using Epi = typename GemmKernel::CollectiveEpilogue;
    constexpr size_t kUnknown = SIZE_MAX;
    if (Epi::get_workspace_size(args.problem_shape, args.epilogue) != 0) return {0, kUnknown};
    const auto shape = cute::append<4>(args.problem_shape, 1);
    const dim3 blocks = Sched::get_tiled_cta_shape_mnl(shape, TileShape{}, ClusterShape{});
    const auto k_tiles = uint32_t(cute::size(cute::ceil_div(cute::shape<2>(shape), cute::shape<2>(TileShape{}))));
    constexpr uint32_t kSubTiles = Epi::get_store_pipe_increment(TileShape{});
    size_t barrier = 0, reduction = 0;
    Sched::Params::get_workspace_component_sizes(
        blocks, k_tiles, cutlass::gemm::to_gemm_coord(TileShape{}), cutlass::gemm::to_gemm_coord(ClusterShape{}),
        barrier, reduction, args.hw_info, args.scheduler.splits, args.scheduler.max_swizzle_size,
        args.scheduler.raster_order, args.scheduler.decomposition_mode, args.scheduler.reduction_mode,
        GemmKernel::NumMmaWarpGroups, cutlass::sizeof_bits<typename Sched::BarrierType>::value,
        cutlass::sizeof_bits<float>::value, kSubTiles, 1);
    const size_t total = Sched::template get_workspace_size<typename GemmKernel::ProblemShape, float>(
        args.scheduler, args.problem_shape, args.hw_info, GemmKernel::NumMmaWarpGroups, kSubTiles);
    if (barrier + reduction != total || barrier % 4 || reduction % 4) return {0, kUnknown};
    return {reduction, barrier};
  }

  // With a bias gradient, a row scale or fp32 dY, the row pass runs first (summing db, scaling or
  // rounding dY) and zeroes the barrier flags on the way (one launch fewer than CUTLASS's memset);
  // the GEMM follows on the same stream.
  static int launch(const cvt_wgrad_args& p, void* workspace, cudaStream_t stream) {
    if (!smem_ready<GemmKernel>(kernel_fn(), kSmemBytes, p.device_id)) return CVT_ERR_SMEM;
    const auto args = make_arguments(p);
    bool zeroed = false;
    if (p.db || p.row_scale || p.dy_fp32) {
      char* ws = static_cast<char*>(workspace);
      float* part = p.db ? reinterpret_cast<float*>(ws + gemm_workspace(p)) : nullptr;
      const auto [offset, bytes] = barrier_region(args);
      zeroed = bytes != SIZE_MAX;
      const auto seg = wgrad_rows<Element>(p, sms_of(p), part, stream,
                                           zeroed ? reinterpret_cast<uint32_t*>(ws + offset) : nullptr,
                                           zeroed ? int64_t(bytes / 4) : 0);
      if (p.db) colsum2_or_defer<Element>(seg, {}, p.defer, stream);
    }
    if (int st = run_universal<GemmKernel, Gemm>(args, workspace, stream, !zeroed); st != CVT_OK) return st;
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }
};

}  // namespace cvt_kernel
