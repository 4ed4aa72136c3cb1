// The Linear weight gradient on wgmma (CUTLASS 3.x SM90: TMA + wgmma, cooperative or ping-pong; sm_90a):
// dW (N, K) = dY^T . X with the token rows split across CTAs, deterministically, in one of two ways
// (Cfg::kSlabs):
//   stream-K (kSlabs false): the stream-K tile scheduler (kWaves 0: CUTLASS's stream-K /
//     data-parallel heuristic; w: split-K into enough splits for w waves), the splits' partials
//     reduced in fp32 in the scheduler's workspace in a fixed order inside the kernel, dW written in
//     the weight's dtype by the epilogue. That ordered reduction makes each split of a tile wait for
//     the one before it: on a small dW (384 x 384 over 25,216 rows) it is most of the kernel's time.
//   slabs (kSlabs true): a batched GEMM whose batch index is the split: split l multiplies rows
//     [l M / S, (l + 1) M / S) (S divides M, S < 64) into its own fp32 slab of the workspace, no split
//     waits for another, and the slabs are summed per element in split order by the column-sum pass
//     (common/reduce.cuh; deferred to the caller's list where given) that rounds dW to its dtype.
// CUTLASS 3.x has no operand-reducing mainloop, so db, when asked for, is a separate deterministic
// row-sum pass over dY (common/reduce.cuh), launched before the GEMM: it also zeroes the stream-K
// barrier flags, in place of CUTLASS's memset. A row scale (drop path's backward) is applied by
// that pass too, and fp32 dY rounded there (an fp32 residual stream's gradient): it writes the
// scaled or rounded dY the GEMM then reads.
//
// GEMM M = N (dY's columns), N = K (X's columns), K = tokens: A = dY^T (the column-major view of
// the row-major dY), B = X (its K x N view is row-major), D = dW (N, K) row-major, no C.
// Cfg (a kernel's generated .cu, operators/linear/wgrad.py): Element, TileShape, ClusterShape (CTAs
// sharing operand panels by TMA multicast), kWaves, kSlabs, KernelSchedule and EpilogueSchedule
// (cooperative, or ping-pong: each consumer warp group on a tile of its own, with the persistent
// scheduler, so slabs only), as the forward GEMM's (linear/spec.py's SM90_SCHEDULES).
#pragma once
#include "common/tma_driver.cuh"  // before any CUTLASS header

// (CUTLASS's headers in the order its own SM90 GEMM examples include them.)
#include <cstdint>
#include <type_traits>
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
  // stream-K: 0 = CUTLASS's heuristic, w = split-K for w waves of tiles; slabs: at most w waves of CTAs
  static constexpr int kWaves = Cfg::kWaves;
  static constexpr bool kSlabs = Cfg::kSlabs;
  using Element = typename Cfg::Element;
  using ElementD = std::conditional_t<kSlabs, float, Element>;  // a slab's partial dW, or dW itself
  static constexpr int kAlignD = 16 / int(sizeof(ElementD));
  using TileShape = typename Cfg::TileShape;
  using ClusterShape = typename Cfg::ClusterShape;
  static constexpr int64_t kTileM = cute::size<0>(TileShape{}), kTileN = cute::size<1>(TileShape{});
  static constexpr int64_t kClusterM = cute::size<0>(ClusterShape{}), kClusterN = cute::size<1>(ClusterShape{});
  using KernelSchedule = typename Cfg::KernelSchedule;
  using EpilogueSchedule = typename Cfg::EpilogueSchedule;
  static_assert(kSlabs || std::is_same_v<KernelSchedule, cutlass::gemm::KernelTmaWarpSpecializedCooperative>,
                "CUTLASS's stream-K scheduler is cooperative-only");
  using Scheduler = std::conditional_t<kSlabs, cutlass::gemm::PersistentScheduler, cutlass::gemm::StreamKScheduler>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor, kAlignD, ElementD, cutlass::layout::RowMajor, kAlignD,
      EpilogueSchedule>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cutlass::layout::ColumnMajor, 8, Element, cutlass::layout::RowMajor, 8,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
      cute::Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  static constexpr int kSmemBytes = GemmKernel::SharedStorageSize;

  static const void* kernel_fn() { return reinterpret_cast<const void*>(cutlass::device_kernel<GemmKernel>); }

  // CTAs per split: the tiles over dW, each dimension rounded up to whole clusters
  static int64_t tiles_of(const cvt_wgrad_args& p) {
    const int64_t tm = (p.n + kTileM - 1) / kTileM, tn = (p.k + kTileN - 1) / kTileN;
    return (tm + kClusterM - 1) / kClusterM * kClusterM * ((tn + kClusterN - 1) / kClusterN * kClusterN);
  }

  // Slabs: the divisor S of M (at most p.splits where set, at most 63: the column sum adds fewer
  // than 64 rows in row order, i.e. split order; each split >= kMinRows rows; S at most the CTAs of
  // kWaves waves over the tiles, rounded up) that minimises the estimated time, waves x (rows per
  // split + a split's fixed cost in rows); the smaller S on a tie.
  static constexpr int64_t kMinRows = 256, kFixedRows = 512, kMaxSlabs = 63;
  static int slab_splits(const cvt_wgrad_args& p) {
    const int64_t tiles = tiles_of(p), sms = sms_of(p);
    int64_t most = p.m / kMinRows;
    most = most < kMaxSlabs ? most : kMaxSlabs;
    if (p.splits > 0 && p.splits < most) most = p.splits;
    const int64_t fit = (kWaves * sms + tiles - 1) / tiles;  // splits filling kWaves waves, rounded up
    most = most < fit ? most : fit;
    int64_t best = 1, best_cost = -1;
    for (int64_t s = 1; s <= most; ++s) {
      if (p.m % s) continue;
      const int64_t cost = (tiles * s + sms - 1) / sms * (p.m / s + kFixedRows);
      if (best_cost < 0 || cost < best_cost) best = s, best_cost = cost;
    }
    return int(best);
  }

  // Row splits: slabs as above; stream-K's split-K mode: p.splits if set, else enough for kWaves
  // waves over the output tiles.
  static int splits_of(const cvt_wgrad_args& p) {
    if constexpr (kSlabs) return slab_splits(p);
    if (p.splits > 0) return p.splits;
    if (kWaves == 0) return 1;
    const int64_t tiles = tiles_of(p);
    const int64_t s = (kWaves * int64_t(sms_of(p)) + tiles - 1) / tiles;
    return int(s < 1 ? 1 : (s > 512 ? 512 : s));
  }

  // slabs: where the slabs go (the workspace after the GEMM's own part; null to size or check).
  static typename GemmKernel::Arguments make_arguments(const cvt_wgrad_args& p0, float* slabs = nullptr) {
    const cvt_wgrad_args p = cvt_wgrad_gemm_view(p0);
    using StrideA = typename CollectiveMainloop::StrideA;
    using StrideB = typename CollectiveMainloop::StrideB;
    using StrideD = typename CollectiveEpilogue::StrideD;
    const int64_t splits = kSlabs ? splits_of(p) : 1, rows = p.m / splits;  // rows per slab (S divides M)
    StrideA stride_a = cute::make_stride(cute::Int<1>{}, int64_t(p.ldy), kSlabs ? rows * p.ldy : int64_t(0));
    StrideB stride_b = cute::make_stride(cute::Int<1>{}, int64_t(p.ldx), kSlabs ? rows * p.ldx : int64_t(0));
    StrideD stride_d = cute::make_stride(int64_t(p.k), cute::Int<1>{}, kSlabs ? p.n * p.k : int64_t(0));
    ElementD* d = kSlabs ? reinterpret_cast<ElementD*>(slabs) : static_cast<ElementD*>(p.dw);
    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = p.device_id;
    hw_info.sm_count = sms_of(p);
    typename GemmKernel::Arguments args{
        kSlabs ? cutlass::gemm::GemmUniversalMode::kBatched : cutlass::gemm::GemmUniversalMode::kGemm,
        {int(p.n), int(p.k), int(rows), int(splits)},
        {static_cast<Element const*>(p.dy), stride_a, static_cast<Element const*>(p.x), stride_b},
        {{}, nullptr, stride_d, d, stride_d},
        hw_info};
    args.epilogue.thread.alpha = 1.f;
    args.epilogue.thread.beta = 0.f;
    if constexpr (!kSlabs) {
      using Mode = cutlass::gemm::kernel::detail::DecompositionMode;
      args.scheduler.splits = splits_of(p);
      args.scheduler.decomposition_mode = (kWaves == 0 && p.splits <= 0) ? Mode::Heuristic : Mode::SplitK;
      args.scheduler.reduction_mode = cutlass::gemm::kernel::detail::ReductionMode::Deterministic;
    }
    return args;
  }

  static size_t gemm_workspace(const cvt_wgrad_args& p) {
    return (Gemm::get_workspace_size(make_arguments(p)) + 255) / 256 * 256;
  }

  // The slabs (S, N, K) fp32 after the GEMM's workspace (none for stream-K).
  static size_t slab_bytes(const cvt_wgrad_args& p) {
    return kSlabs ? (size_t(splits_of(p)) * size_t(p.n * p.k) * sizeof(float) + 255) / 256 * 256 : 0;
  }

  static size_t workspace_size(const cvt_wgrad_args& p) {
    return gemm_workspace(p) + slab_bytes(p) + (p.db ? rowsum_workspace(p.m, p.n, sms_of(p)) : 0);
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
  // Slabs: {0, SIZE_MAX} (the persistent scheduler has no flags; nothing is zeroed).
  static std::pair<size_t, size_t> barrier_region(const typename GemmKernel::Arguments& args) {
    if constexpr (kSlabs) return {0, SIZE_MAX};
    else return stream_k_barriers(args);
  }

  static std::pair<size_t, size_t> stream_k_barriers(const typename GemmKernel::Arguments& args) {
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
  // rounding dY) and, for stream-K, zeroes the barrier flags on the way (one launch fewer than
  // CUTLASS's memset); the GEMM follows on the same stream, then the column sums of db's partials
  // and of the slabs (one launch for both, or deferred to p.defer).
  static int launch(const cvt_wgrad_args& p, void* workspace, cudaStream_t stream) {
    if (!smem_ready<GemmKernel>(kernel_fn(), kSmemBytes, p.device_id)) return CVT_ERR_SMEM;
    char* ws = static_cast<char*>(workspace);
    float* slabs = kSlabs ? reinterpret_cast<float*>(ws + gemm_workspace(p)) : nullptr;
    const auto args = make_arguments(p, slabs);
    bool zeroed = false;
    ColsumSegment<Element> db{};
    if (p.db || p.row_scale || p.dy_fp32) {
      float* part = p.db ? reinterpret_cast<float*>(ws + gemm_workspace(p) + slab_bytes(p)) : nullptr;
      const auto [offset, bytes] = barrier_region(args);
      zeroed = bytes != SIZE_MAX;
      db = wgrad_rows<Element>(p, sms_of(p), part, stream, zeroed ? reinterpret_cast<uint32_t*>(ws + offset) : nullptr,
                               zeroed ? int64_t(bytes / 4) : 0);
      if (!p.db) db = {};
    }
    if (int st = run_universal<GemmKernel, Gemm>(args, workspace, stream, !zeroed); st != CVT_OK) return st;
    ColsumSegment<Element> dw{};
    if constexpr (kSlabs) dw = {slabs, splits_of(p), p.n * p.k, p.n * p.k, static_cast<Element*>(p.dw)};
    colsum2_or_defer<Element>(dw, db, p.defer, stream);
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }
};

}  // namespace cvt_kernel
