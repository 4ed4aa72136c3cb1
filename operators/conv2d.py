"""conv2d kernel specs: CvT's convolutional token embedding, an implicit GEMM on NHWC tokens.

CvT's token layout (B, H*W, C) is NHWC, so the embedding reads the previous stage's tokens and
writes the next stage's tokens without a permute. Two families:

* :class:`ConvSpec` (arch 89, SM80-class: cp.async + mma.sync, fp32 accumulation; serves both
  paths) -- CUTLASS 2.x ``DefaultConv2dFprop``, M = N*P*Q, N = K, K = R*S*C. The bias is added in
  the epilogue by reading C through a zero-stride tensor (every output pixel sees the same (K,)
  vector), so the output is written once, directly as tokens. The 3-channel stem is padded to 4
  channels and read with the ``fixed_channels`` iterator (one 8-byte access per filter tap), or
  read unpadded with ``few_channels``.
* :class:`Conv90Spec` (sm_90a) -- CUTLASS 3.x SM90 implicit GEMM (TMA im2col + wgmma) where TMA can
  read the input (C a multiple of 8).

Names follow operators/spec.py: ``cvt_conv2d_fwd_<arch>_<dtype>_nhwc_<variant>``.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import ClassVar

from .exports import DEVICE_HELPERS, TMA_DRIVER_SHIM, arch_ok, c_exports
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

CONV_ITERATORS = {
    "optimized": "kOptimized",
    "fixed_channels": "kFixedChannels",
    "few_channels": "kFewChannels",
}
CONV_ARCHS = (89,)  # the SM80-class implicit GEMM serves both paths (see NOTES / closing note)


@dataclass(frozen=True)
class ConvSpec(KernelSpec):
    """One implicit-GEMM conv2d fprop instantiation (NHWC activations, KRSC filters)."""

    arch: int
    dtype: str
    tile: tuple[int, int, int]
    warps: tuple[int, int, int] = (2, 2, 1)
    stages: int = 3
    iterator: str = "optimized"
    align: int = 8  # elements per access of the activation (and filter) loads
    swizzle: int = 1
    epilogue: str = "bias"
    pass_: str = "fwd"

    op: ClassVar[str] = "conv2d"
    family: ClassVar[str] = "conv2d_fprop"
    ARCHS: ClassVar[tuple[int, ...]] = CONV_ARCHS
    abi_headers: ClassVar[tuple[str, ...]] = ("cvt_kernel_abi.h", "cvt_conv_abi.h")

    layout: ClassVar[str] = "nhwc"

    def variant(self) -> str:
        return (f"{self.epilogue}_t{xs(self.tile)}_w{xs(self.warps)}_s{self.stages}_sw{self.swizzle}"
                f"_{self.iterator}_a{self.align}")

    @classmethod
    def from_variant(cls, head: NameHead) -> ConvSpec | None:
        m = _CONV_VARIANT.fullmatch(head.variant)
        if head.arch != 89 or not m:
            return None
        return cls(89, head.dtype, triple(m["t"]), triple(m["w"]), int(m["st"]), m["it"], int(m["al"]),
                   int(m["sw"]), m["epi"], head.pass_)

    def validate(self) -> None:
        self.check_common()
        if self.epilogue != "bias":
            raise SpecError("conv2d kernels have one epilogue: 'bias'")
        if self.iterator not in CONV_ITERATORS:
            raise SpecError(f"iterator must be one of {sorted(CONV_ITERATORS)}")
        if self.iterator == "optimized" and self.align != 8:
            raise SpecError("the optimized iterator is instantiated for 16-byte accesses (align=8)")
        if self.iterator == "fixed_channels" and self.align not in (2, 4, 8):
            raise SpecError("fixed_channels needs align = the (padded) channel count: 2, 4 or 8")
        if self.iterator == "few_channels" and self.align not in (1, 2, 4):
            raise SpecError("few_channels needs align 1, 2 or 4 (a divisor of the channel count)")
        if self.swizzle not in (1, 2, 4, 8):
            raise SpecError("threadblock swizzle must be 1, 2, 4 or 8")
        check_sm80_warps(self.tile, self.warps)
        if self.tile[2] not in (16, 32, 64):
            raise SpecError("tile K must be 16, 32 or 64")
        check_sm80_stages(self.name, self.tile, self.stages)

    def channels_ok(self, c: int) -> bool:
        """Whether this instantiation can read an input with ``c`` channels."""
        if self.iterator == "fixed_channels":
            return c == self.align
        return c % self.align == 0

    def template_values(self) -> dict[str, str]:
        tm, tn, tk = self.tile
        wm, wn, _ = self.warps
        return {
            "name": self.name, "element": CUTLASS_ELEMENT[self.dtype], "tm": str(tm), "tn": str(tn),
            "tk": str(tk), "wm": str(tm // wm), "wn": str(tn // wn), "wk": str(tk),
            "stages": str(self.stages), "swizzle": str(self.swizzle),
            "iterator": CONV_ITERATORS[self.iterator], "align": str(self.align),
            "min_cc": str(self.min_cc), "arch_ok": arch_ok(self.min_cc), "dtype": self.dtype,
        }

    def source(self) -> str:
        return string.Template(CONV_SM80_TEMPLATE).substitute(self.template_values())


@dataclass(frozen=True)
class Conv90Spec(KernelSpec):
    """One CUTLASS 3.x SM90 implicit-GEMM conv2d fprop (TMA im2col + wgmma, sm_90a only).

    CUTLASS 4.2's SM90 conv kernel is the non-persistent warp-specialized one (its cooperative
    and ping-pong conv schedules are not wired to a kernel), so the knobs are the tile, the
    cluster and the stage count. The bias is the epilogue's per-column (per output channel)
    broadcast. TMA needs 16-byte rows: C and K multiples of 8 (the stem stays SM80-class)."""

    dtype: str
    tile: tuple[int, int, int]
    cluster: tuple[int, int, int] = (1, 1, 1)
    stages: int = 0  # 0 = as many as fit
    epilogue: str = "bias"
    align: int = 8
    pass_: str = "fwd"

    arch: ClassVar[int] = 90
    iterator: ClassVar[str] = "im2col_tma"
    op: ClassVar[str] = "conv2d"
    family: ClassVar[str] = "conv2d_fprop"
    abi_headers: ClassVar[tuple[str, ...]] = ("cvt_kernel_abi.h", "cvt_conv_abi.h")

    layout: ClassVar[str] = "nhwc"

    def variant(self) -> str:
        st = f"s{self.stages}" if self.stages else "sauto"
        return f"{self.epilogue}_t{xs(self.tile)}_c{xs(self.cluster)}_{st}_ws_a{self.align}"

    @classmethod
    def from_variant(cls, head: NameHead) -> Conv90Spec | None:
        m = _CONV90_VARIANT.fullmatch(head.variant)
        if head.arch != 90 or not m:
            return None
        return cls(head.dtype, triple(m["t"]), triple(m["c"]), 0 if m["st"] == "auto" else int(m["st"]),
                   m["epi"], int(m["al"]), head.pass_)

    def validate(self) -> None:
        self.check_common()
        if self.epilogue != "bias":
            raise SpecError("conv2d kernels have one epilogue: 'bias'")
        if self.align != 8:
            raise SpecError("SM90 conv kernels read 16-byte TMA rows (align=8)")
        tm, tn, tk = self.tile
        if tm not in (64, 128) or tn % 16 or not 16 <= tn <= 256 or tk not in (32, 64, 128):
            raise SpecError("SM90 conv tile: M 64 or 128 (one consumer warp group), N a multiple of 16 up "
                            "to 256, K 32/64/128")
        cm, cn, ck = self.cluster
        if ck != 1 or cm not in (1, 2) or cn not in (1, 2):
            raise SpecError("SM90 conv cluster must be (1|2, 1|2, 1)")
        if self.stages and not 2 <= self.stages <= 8:
            raise SpecError("stages must be 0 (auto) or in [2, 8]")

    def channels_ok(self, c: int) -> bool:
        return c % 8 == 0

    def template_values(self) -> dict[str, str]:
        tm, tn, tk = self.tile
        cm, cn, _ = self.cluster
        stage_count = (f"cutlass::conv::collective::StageCount<{self.stages}>" if self.stages else
                       "cutlass::conv::collective::StageCountAutoCarveout<"
                       "static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>")
        return {"name": self.name, "element": CUTLASS_ELEMENT[self.dtype], "tm": str(tm), "tn": str(tn),
                "tk": str(tk), "cm": str(cm), "cn": str(cn), "stage_count": stage_count,
                "min_cc": str(self.min_cc), "arch_ok": arch_ok(self.min_cc), "dtype": self.dtype}

    def source(self) -> str:
        return string.Template(CONV_SM90_TEMPLATE).substitute(self.template_values())


_CONV_VARIANT = re.compile(
    r"(?P<epi>[a-z_]+?)_t(?P<t>\d+x\d+x\d+)_w(?P<w>\d+x\d+x\d+)_s(?P<st>\d+)_sw(?P<sw>\d+)"
    r"_(?P<it>optimized|fixed_channels|few_channels)_a(?P<al>\d+)"
)
_CONV90_VARIANT = re.compile(
    r"(?P<epi>[a-z_]+?)_t(?P<t>\d+x\d+x\d+)_c(?P<c>\d+x\d+x\d+)_s(?P<st>auto|\d+)_ws_a(?P<al>\d+)"
)


def stem_channels(c: int) -> int:
    """How many channels the implicit-GEMM kernels read for a c-channel input."""
    return c if c % 8 == 0 else (4 if c <= 4 else -(-c // 8) * 8)


# ------------------------------------------------------------------------------------------
# Sweep spaces and heuristics
# ------------------------------------------------------------------------------------------
# (tile, warps, stages); all fit sm_89's 99 KB. N = output channels: 64 (stem), 192, 384 for
# CvT-13/21; 192, 768, 1024 for W24.
_CONV_SPACE = (
    ((128, 64, 32), (2, 2, 1), 4),
    ((64, 64, 32), (2, 2, 1), 5),
    ((256, 64, 32), (4, 1, 1), 3),
    ((128, 64, 64), (2, 2, 1), 3),
    ((128, 128, 32), (2, 2, 1), 4),
    ((64, 128, 32), (2, 2, 1), 4),
    ((128, 128, 64), (2, 2, 1), 3),
    ((128, 256, 32), (2, 4, 1), 3),
    ((256, 128, 32), (4, 2, 1), 3),
    # (128, 192, 32) with 2x2 warps compiled but left output unwritten (NaN) in the H200 sweep
    # of 2026-11-21 (the profile marked it "incorrect"): not in the space.
)
_STEM_SPACE = (
    ((128, 64, 32), (2, 2, 1), 4),
    ((64, 64, 32), (2, 2, 1), 5),
    ((256, 64, 32), (4, 1, 1), 3),
    ((128, 64, 64), (2, 2, 1), 3),
    # (128, 64, 16) x 6 stages: CUTLASS refused every stem problem (can_implement), dropped.
)


_CONV90_SPACE = (
    # (tile, cluster)
    ((128, 64, 64), (1, 1, 1)),
    ((128, 128, 64), (1, 1, 1)),
    ((128, 192, 64), (1, 1, 1)),
    ((128, 256, 64), (1, 1, 1)),
    ((64, 128, 64), (1, 1, 1)),
    ((64, 192, 64), (1, 1, 1)),
    ((128, 128, 64), (2, 1, 1)),
    ((128, 192, 64), (2, 1, 1)),
    ((128, 128, 128), (1, 1, 1)),
)


def conv_candidates(dtype: str, channels: int, arch: int = 89) -> list:
    """The instantiations a profile sweep tries for inputs with ``channels`` channels (already
    padded: the stem's 3 channels arrive as 4). The sm90 path also tries the CUTLASS 3.x SM90
    kernels where TMA can read the input (C a multiple of 8)."""
    if channels % 8 == 0:
        sm80 = [ConvSpec(89, dtype, t, w, st) for t, w, st in _CONV_SPACE]
        return sm80 + ([Conv90Spec(dtype, t, c) for t, c in _CONV90_SPACE] if arch == 90 else [])
    if channels in (2, 4):
        return ([ConvSpec(89, dtype, t, w, st, "fixed_channels", channels) for t, w, st in _STEM_SPACE]
                + [ConvSpec(89, dtype, t, w, st, "few_channels", channels) for t, w, st in _STEM_SPACE[:2]])
    return [ConvSpec(89, dtype, t, w, st, "few_channels", 1) for t, w, st in _STEM_SPACE[:2]]


def conv_heuristic(dtype: str, channels: int, out_channels: int, arch: int = 89) -> ConvSpec:
    """SM80-class on both paths until a sweep has measured the SM90 kernels on the problem."""
    tile, warps, stages = ((128, 64, 32), (2, 2, 1), 4) if out_channels <= 64 else ((128, 128, 32), (2, 2, 1), 4)
    if channels % 8 == 0:
        return ConvSpec(89, dtype, tile, warps, stages)
    if channels in (2, 4):
        return ConvSpec(89, dtype, tile, warps, stages, "fixed_channels", channels)
    return ConvSpec(89, dtype, tile, warps, stages, "few_channels", 1)


# ------------------------------------------------------------------------------------------
# C++ templates
# ------------------------------------------------------------------------------------------
_EXPORTS = c_exports("conv", "p")

CONV_SM80_TEMPLATE = r"""// Generated by cvt_cutlass for kernel ${name}. Do not edit.
// conv2d fprop (implicit GEMM, SM80-class), NHWC x KRSC -> NHWC, + bias; ${dtype}; fp32 accumulation
#include <cstdint>
#include <cuda_runtime.h>
#include "cutlass/cutlass.h"
#include "cutlass/conv/conv2d_problem_size.h"
#include "cutlass/conv/kernel/default_conv2d_fprop.h"
#include "cutlass/conv/device/implicit_gemm_convolution.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cvt_conv_abi.h"
""" + DEVICE_HELPERS + r"""
namespace cvt_kernel {
constexpr int kFamily = CVT_FAMILY_CONV2D_FPROP;
using Element = ${element};
using Layout = cutlass::layout::TensorNHWC;
// D = 1 * accum + 1 * C, C read through a zero-stride tensor: the (K,) bias for every pixel.
using EpilogueOp = cutlass::epilogue::thread::LinearCombination<Element, 8, float, float>;
using Kernel = typename cutlass::conv::kernel::DefaultConv2dFprop<
    Element, Layout, Element, Layout, Element, Layout, float,
    cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
    cutlass::gemm::GemmShape<${tm}, ${tn}, ${tk}>, cutlass::gemm::GemmShape<${wm}, ${wn}, ${wk}>,
    cutlass::gemm::GemmShape<16, 8, 16>, EpilogueOp,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<${swizzle}>, ${stages},
    cutlass::arch::OpMultiplyAdd, cutlass::conv::IteratorAlgorithm::${iterator},
    cutlass::conv::StrideSupport::kStrided, ${align}, ${align}>::Kernel;
using Conv = cutlass::conv::device::ImplicitGemmConvolution<Kernel>;
bool geometry_ok(const cvt_conv_args& p) {
  const int64_t lim = INT32_MAX;
  if (p.n <= 0 || p.h <= 0 || p.w <= 0 || p.c <= 0 || p.k <= 0 || p.r <= 0 || p.s <= 0 || p.p <= 0 || p.q <= 0)
    return false;
  if (p.n * p.h * p.w * p.c > lim || p.n * p.p * p.q * p.k > lim || p.cls_rows != 0) return false;
  if (p.p != (p.h + 2 * p.pad_h - p.dilation_h * (p.r - 1) - 1) / p.stride_h + 1) return false;
  if (p.q != (p.w + 2 * p.pad_w - p.dilation_w * (p.s - 1) - 1) / p.stride_w + 1) return false;
  // The implicit-GEMM iterators address packed images; the epilogue writes packed rows.
  if (p.x_image_stride != p.h * p.w * p.c || p.y_image_stride != p.p * p.q * p.k) return false;
  if (p.k % 8 || !p.bias) return false;
  return true;
}

typename Conv::Arguments make_arguments(const cvt_conv_args& p) {
  cutlass::conv::Conv2dProblemSize problem(
      int(p.n), int(p.h), int(p.w), int(p.c), int(p.k), int(p.r), int(p.s), int(p.p), int(p.q),
      int(p.pad_h), int(p.pad_w), int(p.stride_h), int(p.stride_w), int(p.dilation_h), int(p.dilation_w),
      cutlass::conv::Mode::kCrossCorrelation, /*split_k_slices=*/1, /*groups=*/1);
  Layout lx = Layout::packed({int(p.n), int(p.h), int(p.w), int(p.c)});
  Layout lw = Layout::packed({int(p.k), int(p.r), int(p.s), int(p.c)});
  Layout ly = Layout::packed({int(p.n), int(p.p), int(p.q), int(p.k)});
  Layout lbias(cutlass::make_Coord(0, 0, 0));
  using Ref = cutlass::TensorRef<Element, Layout>;
  return typename Conv::Arguments(
      problem, Ref(static_cast<Element*>(const_cast<void*>(p.x)), lx),
      Ref(static_cast<Element*>(const_cast<void*>(p.filter)), lw),
      Ref(static_cast<Element*>(const_cast<void*>(p.bias)), lbias), Ref(static_cast<Element*>(p.y), ly),
      {1.0f, 1.0f}, cutlass::conv::SplitKMode::kSerial);
}

bool can_implement(const cvt_conv_args& p) {
  if (!geometry_ok(p)) return false;
  return Conv::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
}

size_t workspace_size(const cvt_conv_args& p) { return Conv::get_workspace_size(make_arguments(p)); }

// Launched directly (not through ImplicitGemmConvolution::initialize/run, which set the
// shared-memory attribute on every call): the attribute once per device, then the kernel.
int launch(const cvt_conv_args& p, void* workspace, cudaStream_t stream) {
  constexpr int kSmem = int(sizeof(typename Kernel::SharedStorage));
  if (!smem_ready(reinterpret_cast<const void*>(cutlass::Kernel<Kernel>), kSmem, p.device_id)) return CVT_ERR_SMEM;
  typename Kernel::Params params(make_arguments(p), static_cast<int*>(workspace));
  typename Kernel::ThreadblockSwizzle swizzle;
  dim3 grid = swizzle.get_grid_shape(params.grid_tiled_shape);
  dim3 block(Kernel::kThreadCount, 1, 1);
  cutlass::Kernel<Kernel><<<grid, block, kSmem, stream>>>(params);
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}
}  // namespace cvt_kernel
""" + _EXPORTS

CONV_SM90_TEMPLATE = r"""// Generated by cvt_cutlass for kernel ${name}. Do not edit.
// conv2d fprop (CUTLASS 3.x SM90 implicit GEMM: TMA im2col + wgmma), NHWC x KRSC -> NHWC, + bias; ${dtype}; fp32 accumulation
""" + TMA_DRIVER_SHIM.replace("$", "$$") + r"""#include <cstdint>
#include <cuda_runtime.h>
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cute/tensor.hpp"
#include "cutlass/conv/convnd_problem_shape.hpp"
#include "cutlass/conv/dispatch_policy.hpp"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/conv/kernel/conv_universal.hpp"
#include "cutlass/conv/device/conv_universal_adapter.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cvt_conv_abi.h"
""" + DEVICE_HELPERS + r"""
namespace cvt_kernel {
using namespace cute;
constexpr int kFamily = CVT_FAMILY_CONV2D_FPROP;
using Element = ${element};
using Layout = cutlass::layout::TensorNHWC;
using TileShape = Shape<_${tm}, _${tn}, Shape<_${tk}>>;
using ClusterShape = Shape<_${cm}, _${cn}, _1>;
// D = acc + bias[k]: the bias is a per-column (output-channel) broadcast; no C operand is read.
using Fusion = cutlass::epilogue::fusion::LinCombPerColBias<Element, float, Element, Element, float, 8>;
using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, Layout, 8, Element, Layout, 8, cutlass::epilogue::TmaWarpSpecialized, Fusion>::CollectiveOp;
using CollectiveMainloop = typename cutlass::conv::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::conv::Operator::kFprop,
    Element, Layout, 8, Element, Layout, 8, float, TileShape, ClusterShape,
    ${stage_count}, cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;
using ProblemShape = cutlass::conv::ConvProblemShape<cutlass::conv::Operator::kFprop,
                                                     CollectiveMainloop::DispatchPolicy::NumSpatialDimensions>;
using ConvKernel = cutlass::conv::kernel::ConvUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Conv = cutlass::conv::device::ConvUniversalAdapter<ConvKernel>;
using StrideC = typename ConvKernel::StrideC;
using StrideD = typename ConvKernel::StrideD;

bool geometry_ok(const cvt_conv_args& p) {
  if (p.n <= 0 || p.h <= 0 || p.w <= 0 || p.c <= 0 || p.k <= 0 || p.r <= 0 || p.s <= 0 || p.p <= 0 || p.q <= 0)
    return false;
  if (p.n * p.h * p.w * p.c > INT32_MAX || p.n * p.p * p.q * p.k > INT32_MAX || p.cls_rows != 0) return false;
  if (p.p != (p.h + 2 * p.pad_h - p.dilation_h * (p.r - 1) - 1) / p.stride_h + 1) return false;
  if (p.q != (p.w + 2 * p.pad_w - p.dilation_w * (p.s - 1) - 1) / p.stride_w + 1) return false;
  if (p.x_image_stride != p.h * p.w * p.c || p.y_image_stride != p.p * p.q * p.k) return false;
  if (p.c % 8 || p.k % 8 || !p.bias) return false;
  return true;
}

typename Conv::Arguments make_arguments(const cvt_conv_args& p) {
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

bool can_implement(const cvt_conv_args& p) {
  if (!geometry_ok(p) || !tma_ready()) return false;
  return Conv::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
}

size_t workspace_size(const cvt_conv_args& p) { return Conv::get_workspace_size(make_arguments(p)); }

// Launched through the adapter's static run (its initialize() sets the shared-memory attribute
// on every call): the attribute once per device, then the kernel.
int launch(const cvt_conv_args& p, void* workspace, cudaStream_t stream) {
  constexpr int kSmem = int(ConvKernel::SharedStorageSize);
  if (!smem_ready(reinterpret_cast<const void*>(cutlass::device_kernel<ConvKernel>), kSmem, p.device_id))
    return CVT_ERR_SMEM;
  auto args = make_arguments(p);
  if (ConvKernel::initialize_workspace(args, workspace, stream) != cutlass::Status::kSuccess) return CVT_ERR_INIT;
  typename ConvKernel::Params params = ConvKernel::to_underlying_arguments(args, workspace);
  if (Conv::run(params, stream) != cutlass::Status::kSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_LAUNCH;
  }
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}
}  // namespace cvt_kernel
""" + _EXPORTS

