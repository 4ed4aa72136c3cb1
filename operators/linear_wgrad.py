"""Linear weight gradient: ``dW = dY^T . X`` and ``db = sum_rows(dY)``.

The GEMM's reduction dimension is the token count (up to 802,816 rows for stage 1 at batch 256)
while its output is as small as 64 x 64, so the rows are split across CTAs. A = dY read as the
column-major (N, M) operand, B = X row-major (M, K): no transposed copies. Two kernels, chosen per
problem by the backward sweep:

* ``kred`` (SM80-class, cp.async + mma.sync; serves sm_89 and, built for the running GPU, sm_90):
  parallel split-K with fp32 partials in the workspace summed by one small pass, and db as
  CUTLASS's operand reduction (``GemmWithKReduction``, example 23): the mainloop sums the dY tiles
  it already streams through shared memory, so db costs no extra pass over dY.
* ``rsum`` (CUTLASS 3.x SM90: TMA + wgmma, cooperative, stream-K tile scheduler; sm_90a): the rows
  split by the stream-K scheduler (``_k0``: CUTLASS's stream-K / data-parallel heuristic;
  ``_k<w>``: split-K into enough splits for w waves), reduced in fp32 in the scheduler's workspace,
  in a fixed order (deterministic), dW written in the weight's dtype by the epilogue. CUTLASS 3.x
  has no operand-reducing mainloop, so when db is asked for it is a separate deterministic
  row-sum pass over dY (per-chunk fp32 partials, then a column sum).

Names: ``cvt_linear_wgrad_sm89_<dtype>_nt_kred_t<tile>_w<warps>_s<stages>_a8[_k<waves>]`` and
``cvt_linear_wgrad_sm90a_<dtype>_nt_rsum_t<tile>_c1x1x1_sauto_coop_sk_a8_k<waves>``.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import ClassVar

from .exports import COLSUM_HELPER, DEVICE_HELPERS, ROWSUM_HELPER, TMA_DRIVER_SHIM, arch_ok, c_exports
from .spec import (
    CUTLASS_ELEMENT,
    KernelSpec,
    NameHead,
    SpecError,
    check_sm80_stages,
    check_sm80_warps,
    triple,
    xs,
)


@dataclass(frozen=True)
class LinearWgradSpec(KernelSpec):
    """arch 89: the SM80-class ``kred`` kernel (tile, warps, stages, waves = CTAs per SM the row
    splits aim for); arch 90: the SM90 ``rsum`` kernel (tile; waves 0 = CUTLASS's stream-K
    heuristic, else split-K for that many waves; warps and stages are not used: leave them)."""

    arch: int
    dtype: str
    tile: tuple[int, int, int]
    warps: tuple[int, int, int] = (2, 2, 1)
    stages: int = 4
    pass_: str = "wgrad"
    waves: int = 2

    op: ClassVar[str] = "linear"
    family: ClassVar[str] = "wgrad"
    PASSES: ClassVar[tuple[str, ...]] = ("wgrad",)
    ARCHS: ClassVar[tuple[int, ...]] = (89, 90)
    abi_headers: ClassVar[tuple[str, ...]] = ("cvt_kernel_abi.h", "cvt_wgrad_abi.h")
    layout: ClassVar[str] = "nt"
    # What the profiler's GEMM rows describe (profile.gemm_row): no clusters, default rasters.
    cluster: ClassVar[tuple[int, int, int]] = (1, 1, 1)
    swizzle: ClassVar[int] = 1
    raster: ClassVar[str] = "h"

    def variant(self) -> str:
        if self.arch == 90:
            return f"rsum_t{xs(self.tile)}_c1x1x1_sauto_coop_sk_a8_k{self.waves}"
        return f"kred_t{xs(self.tile)}_w{xs(self.warps)}_s{self.stages}_a8" + ("" if self.waves == 2 else f"_k{self.waves}")

    @classmethod
    def from_variant(cls, head: NameHead) -> LinearWgradSpec | None:
        if head.arch == 90:
            m = _VARIANT_SM90.fullmatch(head.variant)
            return cls(90, head.dtype, triple(m["t"]), pass_=head.pass_, waves=int(m["k"])) if m else None
        m = _VARIANT.fullmatch(head.variant)
        if not m:
            return None
        return cls(head.arch, head.dtype, triple(m["t"]), triple(m["w"]), int(m["s"]), head.pass_, int(m["k"] or 2))

    def validate(self) -> None:
        self.check_common()
        if self.arch == 90:
            self._validate_sm90()
            return
        tm, tn, tk = self.tile
        if tk not in (32, 64):
            raise SpecError("wgrad tile K must be 32 or 64")
        if self.waves not in (1, 2, 4, 8):
            raise SpecError(f"wgrad split waves (CTAs per SM the row splits aim for) must be 1, 2, 4 or 8, got {self.waves}")
        check_sm80_warps(self.tile, self.warps)
        check_sm80_stages(self.name, self.tile, self.stages)

    def _validate_sm90(self) -> None:
        tm, tn, tk = self.tile
        if (self.warps, self.stages) != (LinearWgradSpec.warps, LinearWgradSpec.stages):
            raise SpecError("the sm90 wgrad kernel has no warps / stages to set (wgmma warp groups, auto stages)")
        if tm not in (128, 256) or tn % 16 or not 16 <= tn <= 256 or tk != 64:
            raise SpecError(f"sm90 wgrad tile must be (128|256, 16..256 by 16, 64), got {self.tile}")
        if self.waves not in (0, 1, 2):
            raise SpecError(f"sm90 wgrad waves must be 0 (stream-K heuristic), 1 or 2 (split-K), got {self.waves}")

    def source(self) -> str:
        tm, tn, tk = self.tile
        common = dict(name=self.name, element=CUTLASS_ELEMENT[self.dtype], tm=tm, tn=tn, tk=tk, waves=self.waves,
                      min_cc=self.min_cc, arch_ok=arch_ok(self.min_cc))
        if self.arch == 90:
            return string.Template(SM90_WGRAD_TEMPLATE).substitute(common)
        wm, wn, wk = self.warps
        return string.Template(WGRAD_TEMPLATE).substitute(common, wm=tm // wm, wn=tn // wn, wk=tk // wk,
                                                          stages=self.stages)


_VARIANT = re.compile(r"kred_t(?P<t>\d+x\d+x\d+)_w(?P<w>\d+x\d+x\d+)_s(?P<s>\d+)_a8(?:_k(?P<k>\d+))?")
_VARIANT_SM90 = re.compile(r"rsum_t(?P<t>\d+x\d+x\d+)_c1x1x1_sauto_coop_sk_a8_k(?P<k>\d+)")

# The sweep's space: 64-wide tiles for the 64-channel stage-1 layers, wider ones for the MLPs.
_SPACE = (
    ((64, 64, 32), (2, 2, 1), 5),
    ((128, 64, 32), (2, 2, 1), 4),
    ((64, 128, 32), (2, 2, 1), 4),
    ((128, 128, 32), (2, 2, 1), 4),
    ((128, 128, 64), (2, 2, 1), 3),
    ((128, 256, 32), (2, 4, 1), 3),
    ((256, 128, 32), (4, 2, 1), 3),
)
# sm90: the wgmma tiles x (stream-K heuristic, split-K for one wave).
_SM90_SPACE = ((128, 64, 64), (128, 128, 64), (128, 192, 64), (128, 256, 64), (256, 128, 64))


def wgrad_candidates(dtype: str, arch: int = 89) -> list[LinearWgradSpec]:
    """The sweep's space: every SM80-class tile with row splits for 2 and for 4 CTAs per SM; on the
    sm90 path also the SM90 tiles, stream-K (k0) and one-wave split-K (k1)."""
    out = [LinearWgradSpec(89, dtype, t, w, s, waves=v) for t, w, s in _SPACE for v in (2, 4)]
    if arch == 90:
        out += [LinearWgradSpec(90, dtype, t, waves=v) for t in _SM90_SPACE for v in (0, 1)]
    return out


def wgrad_heuristic(n: int, k: int, dtype: str) -> LinearWgradSpec:
    """dW is (n, k): 64-wide tiles when it is small (stage 1), 128 x 128 otherwise (SM80-class:
    the kernel that serves both paths, db fused)."""
    if n <= 64 or k <= 64:
        return LinearWgradSpec(89, dtype, (64, 64, 32), (2, 2, 1), 5)
    return LinearWgradSpec(89, dtype, (128, 128, 32), (2, 2, 1), 4)


WGRAD_TEMPLATE = r"""// Generated by cvt_cutlass for kernel ${name}. Do not edit.
// dW = dY^T X with db = dY summed over rows (operand K-reduction), parallel split-K over the rows
#include <cstdint>
#include <cuda_runtime.h>
#include "cutlass/cutlass.h"
#include "cutlass/gemm/device/gemm_with_k_reduction.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"
#include "cvt_wgrad_abi.h"
""" + DEVICE_HELPERS + COLSUM_HELPER + r"""
namespace cvt_kernel {
constexpr int kFamily = CVT_FAMILY_WGRAD;
using Element = ${element};
using EpilogueOp = cutlass::epilogue::thread::LinearCombination<
    float, 4, float, float, cutlass::epilogue::thread::ScaleType::OnlyAlphaScaling>;
// GEMM M = N (dY's columns), N = K (X's columns), K = tokens: A = dY^T (column-major view of the
// row-major dY), B = X (row-major), D = fp32 partial dW per split (row-major).
using Gemm = cutlass::gemm::device::GemmWithKReduction<
    Element, cutlass::layout::ColumnMajor, Element, cutlass::layout::RowMajor, float, cutlass::layout::RowMajor,
    float, cutlass::arch::OpClassTensorOp, /*ReduceKForA=*/true, cutlass::arch::Sm80,
    cutlass::gemm::GemmShape<${tm}, ${tn}, ${tk}>, cutlass::gemm::GemmShape<${wm}, ${wn}, ${wk}>,
    cutlass::gemm::GemmShape<16, 8, 16>, EpilogueOp, cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>,
    ${stages}, 8, 8>;
constexpr int kTileM = ${tm}, kTileN = ${tn}, kTileK = ${tk};

// Enough row splits for ${waves} CTA(s) per SM over the output tiles, each split at least 8 K-tiles; then
// the count CUTLASS really runs (rows per split rounded up to 8: ceil(M / that)), which the
// partials' layout and the final sum must use.
inline int splits_of(const cvt_wgrad_args& p) {
  int64_t s = p.splits;
  if (s <= 0) {
    int64_t sms = p.sm_count > 0 ? p.sm_count : sm_count_of(p.device_id);
    if (sms <= 0) sms = 132;
    const int64_t tiles = ((p.n + kTileM - 1) / kTileM) * ((p.k + kTileN - 1) / kTileN);
    const int64_t want = (${waves} * sms + tiles - 1) / tiles, most = p.m / (8 * kTileK);
    s = want < most ? want : most;
  }
  s = s < 1 ? 1 : (s > 512 ? 512 : s);
  const int64_t rows = ((p.m + s - 1) / s + 7) / 8 * 8;
  return int((p.m + rows - 1) / rows);
}

// The split partials, fp32 dW (splits, N, K) then fp32 db (splits, N), at the workspace's start:
// GemmUniversalBase points the kernel at them itself only in kGemm mode, so they are passed here.
typename Gemm::Arguments make_arguments(const cvt_wgrad_args& p, void* workspace = nullptr) {
  const int splits = splits_of(p);
  float* part_w = static_cast<float*>(workspace);
  float* part_b = part_w ? part_w + int64_t(splits) * p.n * p.k : nullptr;
  return typename Gemm::Arguments(
      cutlass::gemm::GemmUniversalMode::kGemmSplitKParallel, {int(p.n), int(p.k), int(p.m)}, splits,
      {1.f, 0.f}, p.dy, p.x, nullptr, part_w, part_b,
      /*batch strides A, B, C, D, reduction*/ 0, 0, 0, p.n * p.k, p.n,
      p.ldy, p.ldx, p.k, p.k, p.n);
}

size_t gemm_workspace(const cvt_wgrad_args& p) {
  const size_t partials = size_t(splits_of(p)) * size_t(p.n * p.k + p.n) * sizeof(float);
  const size_t cutlass_bytes = Gemm::get_workspace_size(make_arguments(p));
  return partials > cutlass_bytes ? partials : cutlass_bytes;
}

bool can_implement(const cvt_wgrad_args& p) {
  if (p.m <= 0 || p.n <= 0 || p.k <= 0 || p.m > INT32_MAX || p.n * p.k > INT32_MAX) return false;
  if (p.n % 8 || p.k % 8 || p.ldy % 8 || p.ldx % 8 || p.ldy < p.n || p.ldx < p.k) return false;
  if ((reinterpret_cast<uintptr_t>(p.dy) | reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.dw)) % 16)
    return false;
  return Gemm::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
}

size_t workspace_size(const cvt_wgrad_args& p) { return gemm_workspace(p); }

int launch(const cvt_wgrad_args& p, void* workspace, cudaStream_t stream) {
  // (GemmUniversalBase raises the kernel's shared-memory limit itself, once per device.)
  const int splits = splits_of(p);
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
  colsum(part_w, splits, nk, nk, static_cast<Element*>(p.dw), stream);
  if (p.db) colsum(part_b, splits, p.n, p.n, static_cast<Element*>(p.db), stream);
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}
}  // namespace cvt_kernel
""" + c_exports("wgrad", "p")


SM90_WGRAD_TEMPLATE = (
    r"""// Generated by cvt_cutlass for kernel ${name}. Do not edit.
// dW = dY^T X on wgmma, the token rows split by the stream-K scheduler; db = dY summed over rows
// by a separate deterministic row-sum pass (CUTLASS 3.x has no operand-reducing mainloop).
#include <cstdint>
""" + TMA_DRIVER_SHIM.replace("$", "$$") + r"""#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler_params.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cvt_wgrad_abi.h"
""" + DEVICE_HELPERS + COLSUM_HELPER + ROWSUM_HELPER + r"""
namespace cvt_kernel {
using namespace cute;
constexpr int kFamily = CVT_FAMILY_WGRAD;
using Element = ${element};
using TileShape = Shape<_${tm}, _${tn}, _${tk}>;
using ClusterShape = Shape<_1, _1, _1>;

// GEMM M = N (dY's columns), N = K (X's columns), K = tokens: A = dY^T (column-major view of the
// row-major dY), B = X (its K x N view is row-major), D = dW (N, K) row-major, no C.
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
    Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue, cutlass::gemm::StreamKScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
constexpr int kSmemBytes = GemmKernel::SharedStorageSize;
const void* const kKernelFn = reinterpret_cast<const void*>(cutlass::device_kernel<GemmKernel>);
constexpr int kWaves = ${waves};  // 0: CUTLASS's stream-K heuristic; w: split-K for w waves of output tiles

inline int sms_of(const cvt_wgrad_args& p) {
  const int s = p.sm_count > 0 ? p.sm_count : sm_count_of(p.device_id);
  return s > 0 ? s : 132;
}

// Row splits (split-K mode): p.splits if set, else enough for kWaves waves over the output tiles.
inline int splits_of(const cvt_wgrad_args& p) {
  if (p.splits > 0) return p.splits;
  if (kWaves == 0) return 1;
  const int64_t tiles = ((p.n + ${tm} - 1) / ${tm}) * ((p.k + ${tn} - 1) / ${tn});
  const int64_t s = (kWaves * int64_t(sms_of(p)) + tiles - 1) / tiles;
  return int(s < 1 ? 1 : (s > 512 ? 512 : s));
}

typename GemmKernel::Arguments make_arguments(const cvt_wgrad_args& p) {
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

size_t gemm_workspace(const cvt_wgrad_args& p) { return (Gemm::get_workspace_size(make_arguments(p)) + 255) / 256 * 256; }

size_t workspace_size(const cvt_wgrad_args& p) {
  return gemm_workspace(p) + (p.db ? rowsum_workspace(p.m, p.n, sms_of(p)) : 0);
}

bool can_implement(const cvt_wgrad_args& p) {
  if (p.m <= 0 || p.n <= 0 || p.k <= 0 || p.m > INT32_MAX || p.n * p.k > INT32_MAX) return false;
  if (p.n % 8 || p.k % 8 || p.ldy % 8 || p.ldx % 8 || p.ldy < p.n || p.ldx < p.k) return false;
  if ((reinterpret_cast<uintptr_t>(p.dy) | reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.dw)) % 16)
    return false;
  if (!tma_ready()) return false;
  return Gemm::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
}

int launch(const cvt_wgrad_args& p, void* workspace, cudaStream_t stream) {
  if (!smem_ready(kKernelFn, kSmemBytes, p.device_id)) return CVT_ERR_SMEM;
  auto args = make_arguments(p);
  if (GemmKernel::initialize_workspace(args, workspace, stream) != cutlass::Status::kSuccess) return CVT_ERR_INIT;
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, workspace);
  if (Gemm::run(params, stream) != cutlass::Status::kSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_LAUNCH;
  }
  if (p.db) {
    float* part = reinterpret_cast<float*>(static_cast<char*>(workspace) + gemm_workspace(p));
    rowsum(static_cast<const Element*>(p.dy), p.m, p.n, p.ldy, sms_of(p), part, static_cast<Element*>(p.db), stream);
  }
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}
}  // namespace cvt_kernel
"""
    + c_exports("wgrad", "p")
)
