"""Conv kernel specs: CvT's convolutional token embedding and its depthwise conv projection.

Two families, both on NHWC tensors, which is CvT's token layout ((B, H*W, C) = (B, H, W, C)):

* :class:`ConvSpec` -- conv2d fprop as an implicit GEMM (CUTLASS 2.x ``DefaultConv2dFprop``,
  SM80-class: cp.async + mma.sync, fp32 accumulation), M = N*P*Q, N = K, K = R*S*C. The bias is
  added in the epilogue by reading C through a zero-stride tensor (every output pixel sees the
  same (K,) vector), so the output is written once, directly as tokens. The 3-channel stem is
  padded to 4 channels and read with the ``fixed_channels`` iterator (one 8-byte access per
  filter tap), or read unpadded with ``few_channels``.
* :class:`DwConvSpec` -- depthwise 3x3 conv (CvT's q/k/v conv projection) with BatchNorm folded
  into fp32 weights and bias: our own CuTe kernel (CUTLASS's DepthwiseDirect2dConv accumulates
  in fp16). fp16/bf16 in and out, fp32 accumulation; one thread computes ``pix`` consecutive
  outputs along W for 8 channels (one 16-byte access), so the input columns the outputs share are
  loaded once. It reads tokens with a row offset and writes them with one, so CvT's stage-3 cls
  token passes through at row 0 of every image without a ``torch.cat``.

Every spec has a procedural name (source file, cache entry, profile row, error messages) and
``parse_conv_name`` inverts it.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, replace
from typing import ClassVar

from .exports import c_exports
from .linear import CUTLASS_ELEMENT, DTYPES, SpecError, check_sm80_stages, check_sm80_warps

CONV_ITERATORS = {
    "optimized": "kOptimized",
    "fixed_channels": "kFixedChannels",
    "few_channels": "kFewChannels",
}
CONV_ARCHS = (89,)  # the SM80-class implicit GEMM serves both paths (see NOTES / closing note)
DW_ARCHS = (89, 90)
_DT = {"fp16": "f16", "bf16": "bf16"}
_DT_INV = {v: k for k, v in _DT.items()}


@dataclass(frozen=True)
class ConvSpec:
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

    op: ClassVar[str] = "conv2d"
    family: ClassVar[str] = "conv2d_fprop"
    abi_headers: ClassVar[tuple[str, ...]] = ("cvt_kernel_abi.h", "cvt_conv_abi.h")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def name(self) -> str:
        t = "x".join(map(str, self.tile))
        w = "x".join(map(str, self.warps))
        return (f"cvt_conv2d_fprop_sm{self.arch}_{_DT[self.dtype]}_{self.epilogue}_t{t}_w{w}_s{self.stages}"
                f"_sw{self.swizzle}_{self.iterator}_a{self.align}")

    @property
    def min_cc(self) -> int:
        return 80

    def with_(self, **kw) -> ConvSpec:
        return replace(self, **kw)

    def validate(self) -> None:
        if self.arch not in CONV_ARCHS:
            raise SpecError(f"conv2d arch must be one of {CONV_ARCHS} (SM80-class kernels), got {self.arch}")
        if self.dtype not in DTYPES:
            raise SpecError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
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
            "min_cc": str(self.min_cc), "dtype": self.dtype,
        }

    def source(self) -> str:
        return string.Template(CONV_SM80_TEMPLATE).substitute(self.template_values())


@dataclass(frozen=True)
class Conv90Spec:
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

    arch: ClassVar[int] = 90
    iterator: ClassVar[str] = "im2col_tma"
    op: ClassVar[str] = "conv2d"
    family: ClassVar[str] = "conv2d_fprop"
    abi_headers: ClassVar[tuple[str, ...]] = ("cvt_kernel_abi.h", "cvt_conv_abi.h")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def name(self) -> str:
        t = "x".join(map(str, self.tile))
        c = "x".join(map(str, self.cluster))
        st = f"s{self.stages}" if self.stages else "sauto"
        return f"cvt_conv2d_fprop_sm90a_{_DT[self.dtype]}_{self.epilogue}_t{t}_c{c}_{st}_ws_a{self.align}"

    @property
    def min_cc(self) -> int:
        return 90

    def with_(self, **kw) -> Conv90Spec:
        return replace(self, **kw)

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise SpecError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
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
                "min_cc": str(self.min_cc), "dtype": self.dtype}

    def source(self) -> str:
        return string.Template(CONV_SM90_TEMPLATE).substitute(self.template_values())


@dataclass(frozen=True)
class DwConvSpec:
    """One depthwise 3x3 conv instantiation (stride fixed at compile time, pad 1, dilation 1)."""

    arch: int
    dtype: str
    stride: int
    pix: int = 2  # outputs along W per thread
    threads: int = 256
    kernel: int = 3
    epilogue: str = "bias"

    op: ClassVar[str] = "dwconv"
    family: ClassVar[str] = "dwconv2d"
    abi_headers: ClassVar[tuple[str, ...]] = ("cvt_kernel_abi.h", "cvt_conv_abi.h")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def name(self) -> str:
        target = "sm90a" if self.arch == 90 else "sm89"
        return (f"cvt_dwconv{self.kernel}x{self.kernel}_{target}_{_DT[self.dtype]}_{self.epilogue}"
                f"_st{self.stride}_p{self.pix}_b{self.threads}")

    @property
    def min_cc(self) -> int:
        return 90 if self.arch == 90 else 80

    def with_(self, **kw) -> DwConvSpec:
        return replace(self, **kw)

    def validate(self) -> None:
        if self.arch not in DW_ARCHS:
            raise SpecError(f"dwconv arch must be one of {DW_ARCHS}, got {self.arch}")
        if self.dtype not in DTYPES:
            raise SpecError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kernel != 3:
            raise SpecError("only 3x3 depthwise kernels are instantiated (CvT's conv projection)")
        if self.stride not in (1, 2):
            raise SpecError("depthwise stride must be 1 or 2")
        if self.pix not in (1, 2, 4, 8):
            raise SpecError("pix (outputs per thread) must be 1, 2, 4 or 8")
        if self.threads not in (64, 128, 256, 512):
            raise SpecError("threads per block must be 64, 128, 256 or 512")
        if self.epilogue != "bias":
            raise SpecError("dwconv kernels have one epilogue: 'bias' (folded BatchNorm)")

    def template_values(self) -> dict[str, str]:
        return {
            "name": self.name, "element": CUTLASS_ELEMENT[self.dtype], "stride": str(self.stride),
            "pix": str(self.pix), "threads": str(self.threads), "kernel": str(self.kernel),
            "min_cc": str(self.min_cc), "dtype": self.dtype,
        }

    def source(self) -> str:
        return string.Template(DWCONV_TEMPLATE).substitute(self.template_values())


_CONV_RE = re.compile(
    r"cvt_conv2d_fprop_sm(?P<arch>\d+)_(?P<dt>f16|bf16)_(?P<epi>[a-z_]+?)_t(?P<t>\d+x\d+x\d+)"
    r"_w(?P<w>\d+x\d+x\d+)_s(?P<st>\d+)_sw(?P<sw>\d+)_(?P<it>optimized|fixed_channels|few_channels)"
    r"_a(?P<al>\d+)"
)
_CONV90_RE = re.compile(
    r"cvt_conv2d_fprop_sm90a_(?P<dt>f16|bf16)_(?P<epi>[a-z_]+?)_t(?P<t>\d+x\d+x\d+)_c(?P<c>\d+x\d+x\d+)"
    r"_s(?P<st>auto|\d+)_ws_a(?P<al>\d+)"
)
_DW_RE = re.compile(
    r"cvt_dwconv(?P<k>\d+)x(?P=k)_(?P<target>sm89|sm90a)_(?P<dt>f16|bf16)_(?P<epi>[a-z_]+?)"
    r"_st(?P<st>\d+)_p(?P<pix>\d+)_b(?P<thr>\d+)"
)


def _triple(s: str) -> tuple[int, int, int]:
    a, b, c = (int(v) for v in s.split("x"))
    return a, b, c


def parse_conv_name(name: str) -> ConvSpec | Conv90Spec | DwConvSpec:
    """The spec a conv or depthwise kernel name stands for (raises ValueError otherwise)."""
    m = _CONV90_RE.fullmatch(name)
    if m:
        return Conv90Spec(_DT_INV[m["dt"]], _triple(m["t"]), _triple(m["c"]),
                          0 if m["st"] == "auto" else int(m["st"]), m["epi"], int(m["al"]))
    m = _CONV_RE.fullmatch(name)
    if m:
        return ConvSpec(int(m["arch"]), _DT_INV[m["dt"]], _triple(m["t"]), _triple(m["w"]), int(m["st"]),
                        m["it"], int(m["al"]), int(m["sw"]), m["epi"])
    m = _DW_RE.fullmatch(name)
    if m:
        return DwConvSpec(90 if m["target"] == "sm90a" else 89, _DT_INV[m["dt"]], int(m["st"]),
                          int(m["pix"]), int(m["thr"]), int(m["k"]), m["epi"])
    raise ValueError(f"not a conv kernel name: {name!r}")


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


def dwconv_candidates(dtype: str, stride: int, arch: int) -> list[DwConvSpec]:
    return [DwConvSpec(arch, dtype, stride, pix, thr) for pix in (1, 2, 4, 8) for thr in (128, 256)]


def dwconv_heuristic(dtype: str, stride: int, arch: int) -> DwConvSpec:
    return DwConvSpec(arch, dtype, stride, 2 if stride == 1 else 1, 256)


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

int launch(const cvt_conv_args& p, void* workspace, cudaStream_t stream) {
  Conv conv;  // initialize() raises the dynamic shared-memory limit when the kernel needs it
  if (conv.initialize(make_arguments(p), workspace, stream) != cutlass::Status::kSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_INIT;
  }
  if (conv.run(stream) != cutlass::Status::kSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_LAUNCH;
  }
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}
}  // namespace cvt_kernel
""" + _EXPORTS

CONV_SM90_TEMPLATE = r"""// Generated by cvt_cutlass for kernel ${name}. Do not edit.
// conv2d fprop (CUTLASS 3.x SM90 implicit GEMM: TMA im2col + wgmma), NHWC x KRSC -> NHWC, + bias; ${dtype}; fp32 accumulation
#include <cstdint>
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
  return args;
}

bool can_implement(const cvt_conv_args& p) {
  if (!geometry_ok(p)) return false;
  return Conv::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
}

size_t workspace_size(const cvt_conv_args& p) { return Conv::get_workspace_size(make_arguments(p)); }

int launch(const cvt_conv_args& p, void* workspace, cudaStream_t stream) {
  Conv conv;  // initialize() raises the dynamic shared-memory limit when the kernel needs it
  if (conv.initialize(make_arguments(p), workspace, stream) != cutlass::Status::kSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_INIT;
  }
  if (conv.run(stream) != cutlass::Status::kSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_LAUNCH;
  }
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}
}  // namespace cvt_kernel
""" + _EXPORTS

DWCONV_TEMPLATE = r"""// Generated by cvt_cutlass for kernel ${name}. Do not edit.
// depthwise ${kernel}x${kernel} conv, stride ${stride}, NHWC tokens -> NHWC tokens, + bias (folded BatchNorm);
// ${dtype} in/out, fp32 weights and accumulation
#include <cstdint>
#include <cuda_runtime.h>
#include "cute/tensor.hpp"
#include "cutlass/array.h"
#include "cutlass/fast_math.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/numeric_types.h"
#include "cvt_conv_abi.h"

namespace cvt_kernel {
using namespace cute;
constexpr int kFamily = CVT_FAMILY_DWCONV2D;
using Element = ${element};
constexpr int kVec = 8;             // channels per thread: one 16-byte access
constexpr int kPix = ${pix};        // consecutive outputs along W per thread
constexpr int kStride = ${stride};
constexpr int kR = ${kernel}, kS = ${kernel};
constexpr int kCols = (kPix - 1) * kStride + kS;  // input columns the kPix outputs read
constexpr int kThreads = ${threads};
using Vec = cutlass::Array<Element, kVec>;
using VecF = cutlass::Array<float, kVec>;

// One thread: kPix consecutive outputs along W of one output row, 8 channels. blockIdx.y is the
// image; indices within an image fit in 32 bits (can_implement checks) and are split with
// precomputed fast divisions, so a thread spends its time on loads, not on 64-bit integer math.
__global__ void __launch_bounds__(kThreads) dwconv_kernel(cvt_conv_args a, int work, int spatial_items,
                                                          cutlass::FastDivmod div_c8, cutlass::FastDivmod div_qg) {
  const int tid = int(blockIdx.x) * kThreads + int(threadIdx.x);
  if (tid >= work) return;
  const int img = int(blockIdx.y);
  const int c8n = int(a.c / kVec);
  int item, c8;
  div_c8(item, c8, tid);
  const Element* xb = static_cast<const Element*>(a.x) + int64_t(img) * a.x_image_stride;
  Element* yb = static_cast<Element*>(a.y) + int64_t(img) * a.y_image_stride;
  if (item >= spatial_items) {  // the rows in front of the image (cls token): copied unchanged
    const int row = item - spatial_items - int(a.cls_rows);  // -cls_rows .. -1
    reinterpret_cast<uint4*>(yb + int64_t(row) * a.k)[c8] = __ldg(reinterpret_cast<const uint4*>(xb + int64_t(row) * a.c) + c8);
    return;
  }
  int p, qg;
  div_qg(p, qg, item);
  const int q0 = qg * kPix;
  const int H = int(a.h), W = int(a.w);
  // Images as CuTe tensors of 16-byte vectors: (row, col, channel group), row-major NHWC.
  auto X = make_tensor(make_gmem_ptr(reinterpret_cast<const uint4*>(xb)),
                       make_layout(make_shape(H, W, c8n), make_stride(W * c8n, c8n, Int<1>{})));
  auto Y = make_tensor(make_gmem_ptr(reinterpret_cast<uint4*>(yb)),
                       make_layout(make_shape(int(a.p), int(a.q), c8n), make_stride(int(a.q) * c8n, c8n, Int<1>{})));
  const float* wgt = static_cast<const float*>(a.filter) + c8 * kVec;
  cutlass::NumericArrayConverter<float, Element, kVec> to_float;
  cutlass::NumericArrayConverter<Element, float, kVec> to_out;

  VecF acc[kPix];
  if (a.bias) {
    const float4* bp = reinterpret_cast<const float4*>(static_cast<const float*>(a.bias) + c8 * kVec);
    const float4 lo = __ldg(bp), hi = __ldg(bp + 1);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kPix; ++j) {
      acc[j][0] = lo.x; acc[j][1] = lo.y; acc[j][2] = lo.z; acc[j][3] = lo.w;
      acc[j][4] = hi.x; acc[j][5] = hi.y; acc[j][6] = hi.z; acc[j][7] = hi.w;
    }
  } else {
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kPix; ++j) acc[j].fill(0.f);
  }
  const int iw0 = q0 * kStride - int(a.pad_w);
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < kR; ++r) {
    const int ih = p * kStride - int(a.pad_h) + r;
    if (ih < 0 || ih >= H) continue;
    // The row's input vectors first (all loads in flight together), then the math.
    VecF xf[kCols];
    CUTLASS_PRAGMA_UNROLL
    for (int u = 0; u < kCols; ++u) {
      const int iw = iw0 + u;
      if (iw >= 0 && iw < W) {
        const uint4 raw = __ldg(&X(ih, iw, c8));
        xf[u] = to_float(reinterpret_cast<Vec const&>(raw));
      } else {
        xf[u].fill(0.f);
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < kS; ++s) {
      const float4* wp = reinterpret_cast<const float4*>(wgt + (r * kS + s) * int(a.c));
      const float4 lo = __ldg(wp), hi = __ldg(wp + 1);
      const float wv[kVec] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kPix; ++j) {
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < kVec; ++v) acc[j][v] = fmaf(wv[v], xf[j * kStride + s][v], acc[j][v]);
      }
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kPix; ++j) {
    if (q0 + j < int(a.q)) {
      Vec o = to_out(acc[j]);
      Y(p, q0 + j, c8) = reinterpret_cast<uint4 const&>(o);
    }
  }
}

bool can_implement(const cvt_conv_args& p) {
  if (p.n <= 0 || p.h <= 0 || p.w <= 0 || p.c <= 0 || p.p <= 0 || p.q <= 0) return false;
  if (p.k != p.c || p.r != kR || p.s != kS || p.stride_h != kStride || p.stride_w != kStride) return false;
  if (p.dilation_h != 1 || p.dilation_w != 1 || p.pad_h < 0 || p.pad_w < 0 || p.cls_rows < 0) return false;
  if (p.p != (p.h + 2 * p.pad_h - kR) / kStride + 1 || p.q != (p.w + 2 * p.pad_w - kS) / kStride + 1) return false;
  // 16-byte accesses: channels, image strides and pointers in multiples of 8 elements.
  if (p.c % kVec || p.x_image_stride % kVec || p.y_image_stride % kVec) return false;
  if ((reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.y) |
       reinterpret_cast<uintptr_t>(p.filter)) % 16) return false;
  if (p.bias && reinterpret_cast<uintptr_t>(p.bias) % 16) return false;
  if (p.x_image_stride < (p.cls_rows + p.h * p.w) * p.c || p.y_image_stride < (p.cls_rows + p.p * p.q) * p.c)
    return false;
  // 32-bit indexing within an image; the batch runs along grid y.
  if ((p.cls_rows + p.h * p.w) * p.c > INT32_MAX || (p.cls_rows + p.p * p.q) * p.c > INT32_MAX) return false;
  if (p.n > 65535) return false;
  return true;
}

size_t workspace_size(const cvt_conv_args&) { return 0; }

int launch(const cvt_conv_args& p, void*, cudaStream_t stream) {
  const int q_groups = int((p.q + kPix - 1) / kPix);
  const int spatial_items = int(p.p) * q_groups;
  const int c8n = int(p.c / kVec);
  const int work = (spatial_items + int(p.cls_rows)) * c8n;
  dim3 grid((work + kThreads - 1) / kThreads, unsigned(p.n));
  dwconv_kernel<<<grid, kThreads, 0, stream>>>(p, work, spatial_items, cutlass::FastDivmod(c8n),
                                               cutlass::FastDivmod(q_groups));
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}
}  // namespace cvt_kernel
""" + _EXPORTS
