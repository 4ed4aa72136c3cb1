// The Linear weight gradient on an SM80-class GEMM (cp.async + mma.sync; serves sm_89 and, built
// for the running GPU, sm_90): dW (N, K) = dY^T . X with db (N,) = dY summed over rows. GEMM M = N
// (dY's columns), N = K (X's columns), K = tokens (up to 802,816 rows for stage 1 at batch 256
// against a 64 x 64 output): A = dY^T (the column-major view of the row-major dY), B = X
// (row-major), no transposed copies. Parallel split-K over the rows with fp32 partials in the
// workspace summed in split order by one small pass (deterministic), and db as CUTLASS's operand
// reduction (GemmWithKReduction, example 23): the mainloop sums the dY tiles it already streams
// through shared memory, so db costs no extra pass over dY. A row scale (drop path's backward) is
// one pass before the GEMM writing the scaled dY (linear/wgrad_rows.cuh), which the GEMM reads; fp32
// dY (an fp32 residual stream's gradient) is rounded to the 16-bit dtype by that pass.
//
// Cfg (a kernel's generated .cu, operators/linear/wgrad.py): Element, ThreadblockShape,
// WarpShape (cutlass::gemm::GemmShape), kStages, kWaves (CTAs per SM the row splits aim for).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cutlass/gemm/device/gemm_with_k_reduction.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"
#include "linear/abi.h"
#include "common/device.cuh"
#include "common/reduce.cuh"
#include "linear/wgrad_rows.cuh"

namespace cvt_kernel {

template <class Cfg>
struct WgradSm80 {
  static constexpr int kFamily = CVT_FAMILY_WGRAD;
  using Element = typename Cfg::Element;
  using EpilogueOp = cutlass::epilogue::thread::LinearCombination<
      float, 4, float, float, cutlass::epilogue::thread::ScaleType::OnlyAlphaScaling>;
  // D = fp32 partial dW per split (row-major).
  using Gemm = cutlass::gemm::device::GemmWithKReduction<
      Element, cutlass::layout::ColumnMajor, Element, cutlass::layout::RowMajor, float, cutlass::layout::RowMajor,
      float, cutlass::arch::OpClassTensorOp, /*ReduceKForA=*/true, cutlass::arch::Sm80,
      typename Cfg::ThreadblockShape, typename Cfg::WarpShape, cutlass::gemm::GemmShape<16, 8, 16>, EpilogueOp,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, Cfg::kStages, 8, 8>;
  static constexpr int kTileM = Cfg::ThreadblockShape::kM, kTileN = Cfg::ThreadblockShape::kN,
                       kTileK = Cfg::ThreadblockShape::kK;

  // Enough row splits for kWaves CTA(s) per SM over the output tiles, each split at least 8
  // K-tiles; then the count CUTLASS really runs (rows per split rounded up to 8: ceil(M / that)),
  // which the partials' layout and the final sum must use.
  static int splits_of(const cvt_wgrad_args& p) {
    int64_t s = p.splits;
    if (s <= 0) {
      const int64_t sms = sms_of(p);
      const int64_t tiles = ((p.n + kTileM - 1) / kTileM) * ((p.k + kTileN - 1) / kTileN);
      const int64_t want = (Cfg::kWaves * sms + tiles - 1) / tiles, most = p.m / (8 * kTileK);
      s = want < most ? want : most;
    }
    s = s < 1 ? 1 : (s > 512 ? 512 : s);
    const int64_t rows = ((p.m + s - 1) / s + 7) / 8 * 8;
    return int((p.m + rows - 1) / rows);
  }

  // The split partials, fp32 dW (splits, N, K) then fp32 db (splits, N), at the workspace's start:
  // GemmUniversalBase points the kernel at them itself only in kGemm mode, so they are passed here.
  static typename Gemm::Arguments make_arguments(const cvt_wgrad_args& p0, void* workspace = nullptr) {
    const cvt_wgrad_args p = cvt_wgrad_gemm_view(p0);
    const int splits = splits_of(p);
    float* part_w = static_cast<float*>(workspace);
    float* part_b = part_w ? part_w + int64_t(splits) * p.n * p.k : nullptr;
    return typename Gemm::Arguments(
        cutlass::gemm::GemmUniversalMode::kGemmSplitKParallel, {int(p.n), int(p.k), int(p.m)}, splits,
        {1.f, 0.f}, p.dy, p.x, nullptr, part_w, part_b,
        /*batch strides A, B, C, D, reduction*/ 0, 0, 0, p.n * p.k, p.n,
        p.ldy, p.ldx, p.k, p.k, p.n);
  }

  static size_t gemm_workspace(const cvt_wgrad_args& p) {
    const size_t partials = size_t(splits_of(p)) * size_t(p.n * p.k + p.n) * sizeof(float);
    const size_t cutlass_bytes = Gemm::get_workspace_size(make_arguments(p));
    return partials > cutlass_bytes ? partials : cutlass_bytes;
  }

  static bool can_implement(const cvt_wgrad_args& p) {
    if (p.m <= 0 || p.n <= 0 || p.k <= 0 || p.m > INT32_MAX || p.n * p.k > INT32_MAX) return false;
    if (p.n % 8 || p.k % 8 || p.ldy % 8 || p.ldx % 8 || p.ldy < p.n || p.ldx < p.k) return false;
    if ((reinterpret_cast<uintptr_t>(p.dy) | reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.dw)) % 16)
      return false;
    if (!wgrad_rows_ok<Element>(p)) return false;
    return Gemm::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
  }

  static size_t workspace_size(const cvt_wgrad_args& p) { return gemm_workspace(p); }

  static int launch(const cvt_wgrad_args& p, void* workspace, cudaStream_t stream) {
    // (GemmUniversalBase raises the kernel's shared-memory limit itself, once per device.)
    const int splits = splits_of(p);
    if (p.row_scale || p.dy_fp32)  // the scaling / rounding pass alone (no partials: the mainloop sums db)
      wgrad_rows<Element>(p, sms_of(p), nullptr, stream);
    Gemm gemm;
    if (gemm.initialize(make_arguments(p, workspace), workspace, stream) != cutlass::Status::kSuccess)
      return CVT_ERR_INIT;
    if (gemm.run(stream) != cutlass::Status::kSuccess) {
      (void)cudaGetLastError();
      return CVT_ERR_LAUNCH;
    }
    const int64_t nk = p.n * p.k;
    const float* part_w = static_cast<const float*>(workspace);
    const float* part_b = part_w + int64_t(splits) * nk;
    // The split partials (fp32 dW (splits, N, K), then db (splits, N)) summed in split order.
    ColsumSegment<Element> db;
    if (p.db) db = {part_b, splits, p.n, p.n, static_cast<Element*>(p.db)};
    colsum2_or_defer<Element>({part_w, splits, nk, nk, static_cast<Element*>(p.dw)}, db, p.defer, stream);
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }
};

}  // namespace cvt_kernel
