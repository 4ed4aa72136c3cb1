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
* :class:`ConvBwdSpec` (arch 89, SM80-class, serves both paths) -- the backward: ``dgrad``
  (CUTLASS 2.x ``DefaultConv2dDgrad``, the strided-dgrad kernel: M = N*H*W, N = C, K = K*R*S) and
  ``wgrad`` (``DefaultConv2dWgrad``: M = K, N = R*S*C, K = N*P*Q, up to 401,408 for the stem at
  batch 128 against a 64 x 196 output, so GEMM-K is split: CUTLASS's parallel split-K writes fp32
  partials per split into the workspace and one small pass sums them in split order, deterministic
  and without the fp16 round trips of serial split-K). db is a deterministic row-sum pass over dY
  in the same launch (CUTLASS 2.x conv has no operand-reducing mainloop).

Names follow operators/spec.py: ``cvt_conv2d_<pass>_<arch>_<dtype>_nhwc_<variant>``.
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


CONV_BWD_ITERATORS = {"optimized": "kOptimized", "analytic": "kAnalytic"}


@dataclass(frozen=True)
class ConvBwdSpec(KernelSpec):
    """One SM80-class implicit-GEMM conv2d backward instantiation (NHWC dy and x, KRSC filter).

    ``dgrad``: dx = the transposed conv of dy (CUTLASS's strided-dgrad kernel, any stride, its
    ``swizzle`` the strided-dgrad threadblock swizzle 1/4/8; ``align`` 8: C and K multiples of 8).
    ``wgrad``: dw (+ db); ``align`` is the activation's access width (8, or 4 for the 4-channel
    stem), ``waves`` the CTAs per SM the automatic GEMM-K split aims for."""

    arch: int
    dtype: str
    pass_: str
    tile: tuple[int, int, int]
    warps: tuple[int, int, int] = (2, 2, 1)
    stages: int = 4
    iterator: str = "optimized"
    align: int = 8
    swizzle: int = 1
    waves: int = 2

    op: ClassVar[str] = "conv2d"
    family: ClassVar[str] = "conv2d_bwd"
    PASSES: ClassVar[tuple[str, ...]] = ("dgrad", "wgrad")
    ARCHS: ClassVar[tuple[int, ...]] = CONV_ARCHS
    abi_headers: ClassVar[tuple[str, ...]] = ("cvt_kernel_abi.h", "cvt_conv_bwd_abi.h")
    layout: ClassVar[str] = "nhwc"
    epilogue: ClassVar[str] = "none"

    def variant(self) -> str:
        body = f"t{xs(self.tile)}_w{xs(self.warps)}_s{self.stages}"
        if self.pass_ == "dgrad":
            return f"strided_{body}_sw{self.swizzle}_{self.iterator}_a{self.align}"
        return f"dbias_{body}_{self.iterator}_a{self.align}_k{self.waves}"

    @classmethod
    def from_variant(cls, head: NameHead) -> ConvBwdSpec | None:
        m = _CONV_BWD_VARIANT.fullmatch(head.variant)
        if head.arch != 89 or not m or (m["kind"] == "strided") != (head.pass_ == "dgrad"):
            return None
        return cls(89, head.dtype, head.pass_, triple(m["t"]), triple(m["w"]), int(m["st"]), m["it"], int(m["al"]),
                   int(m["sw"] or 1), int(m["k"] or 2))

    def validate(self) -> None:
        self.check_common()
        if self.iterator not in CONV_BWD_ITERATORS:
            raise SpecError(f"conv backward iterator must be one of {sorted(CONV_BWD_ITERATORS)}")
        if self.pass_ == "dgrad":
            if self.align != 8 or self.waves != 2:
                raise SpecError("conv dgrad reads 16-byte vectors (align=8) and splits nothing (waves=2)")
            if self.swizzle not in (1, 4, 8):
                raise SpecError("the strided-dgrad threadblock swizzle must be 1, 4 or 8")
        else:
            if self.align not in (4, 8) or self.swizzle != 1:
                raise SpecError("conv wgrad: align 8, or 4 for the 4-channel stem; swizzle 1")
            if self.waves not in (1, 2, 4, 8):
                raise SpecError(f"conv wgrad split waves (CTAs per SM) must be 1, 2, 4 or 8, got {self.waves}")
        check_sm80_warps(self.tile, self.warps)
        if self.tile[2] not in (32, 64):
            raise SpecError("conv backward tile K must be 32 or 64")
        check_sm80_stages(self.name, self.tile, self.stages)

    def channels_ok(self, c: int) -> bool:
        """Whether this instantiation serves inputs with ``c`` channels."""
        return c % self.align == 0

    def source(self) -> str:
        tm, tn, tk = self.tile
        wm, wn, _ = self.warps
        values = {"name": self.name, "element": CUTLASS_ELEMENT[self.dtype], "tm": tm, "tn": tn, "tk": tk,
                  "wm": tm // wm, "wn": tn // wn, "wk": tk, "stages": self.stages, "swizzle": self.swizzle,
                  "iterator": CONV_BWD_ITERATORS[self.iterator], "align": self.align, "waves": self.waves,
                  "min_cc": self.min_cc, "arch_ok": arch_ok(self.min_cc), "dtype": self.dtype}
        template = CONV_DGRAD_TEMPLATE if self.pass_ == "dgrad" else CONV_WGRAD_TEMPLATE
        return string.Template(template).substitute(values)


_CONV_BWD_VARIANT = re.compile(
    r"(?P<kind>strided|dbias)_t(?P<t>\d+x\d+x\d+)_w(?P<w>\d+x\d+x\d+)_s(?P<st>\d+)(?:_sw(?P<sw>\d+))?"
    r"_(?P<it>optimized|analytic)_a(?P<al>\d+)(?:_k(?P<k>\d+))?"
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


# Backward. dgrad: M = N*H*W (large), N = C (64 / 192 / 768), K = K*R*S. wgrad: M = K (64 .. 1024),
# N = R*S*C (196 for the stem, 576 .. 6912), K = N*P*Q split across CTAs.
_DGRAD_SPACE = (
    ((128, 64, 32), (2, 2, 1), 4),
    ((64, 64, 32), (2, 2, 1), 5),
    ((128, 128, 32), (2, 2, 1), 4),
    ((128, 64, 64), (2, 2, 1), 3),
    ((256, 64, 32), (4, 1, 1), 3),
    ((128, 128, 64), (2, 2, 1), 3),
    # 256-row tiles won every dgrad of run C6: deeper pipelines and wider ones around them
    ((256, 64, 32), (4, 1, 1), 4),
    ((256, 128, 32), (4, 2, 1), 3),
    ((256, 64, 64), (4, 1, 1), 2),
)
_WGRAD_SPACE = (
    ((64, 64, 32), (2, 2, 1), 5),
    ((64, 128, 32), (2, 2, 1), 4),
    ((128, 64, 32), (2, 2, 1), 4),
    ((128, 128, 32), (2, 2, 1), 4),
    ((64, 64, 64), (2, 2, 1), 4),
    ((128, 128, 64), (2, 2, 1), 3),
)


def conv_bwd_candidates(pass_: str, dtype: str, channels: int, arch: int = 89) -> list[ConvBwdSpec]:
    """The backward sweep's space for inputs with ``channels`` channels (the stem's padded 4) on
    the ``arch`` path (the SM80-class kernels serve both): dgrad tiles x swizzle 1 (and 4 for the
    first two); wgrad tiles x split waves 2 and 4."""
    if pass_ == "dgrad":
        if channels % 8:
            return []
        return ([ConvBwdSpec(89, dtype, "dgrad", t, w, st) for t, w, st in _DGRAD_SPACE]
                + [ConvBwdSpec(89, dtype, "dgrad", t, w, st, swizzle=4) for t, w, st in _DGRAD_SPACE[:2]])
    align = 8 if channels % 8 == 0 else 4 if channels % 4 == 0 else 0
    if not align:
        return []
    return [ConvBwdSpec(89, dtype, "wgrad", t, w, st, align=align, waves=v) for t, w, st in _WGRAD_SPACE
            for v in (2, 4, 8)]


def conv_bwd_heuristic(pass_: str, dtype: str, channels: int, out_channels: int) -> ConvBwdSpec:
    """dgrad: 128-row tiles, 64 or 128 wide by C; wgrad: 64 x 64 tiles for the 64-channel stem, 128 x
    128 otherwise, GEMM-K split for 2 CTAs per SM. Raises SpecError when no kernel serves
    ``channels`` (the op falls back visibly)."""
    if pass_ == "dgrad":
        if channels % 8:
            raise SpecError(f"no conv dgrad kernel for C={channels} (a multiple of 8)")
        tile, st = ((128, 64, 32), 4) if channels <= 64 else ((128, 128, 32), 4)
        return ConvBwdSpec(89, dtype, "dgrad", tile, (2, 2, 1), st)
    if channels % 4:
        raise SpecError(f"no conv wgrad kernel for C={channels} (a multiple of 4)")
    align = 8 if channels % 8 == 0 else 4
    tile, st = ((64, 64, 32), 5) if out_channels <= 64 else ((128, 128, 32), 4)
    return ConvBwdSpec(89, dtype, "wgrad", tile, (2, 2, 1), st, align=align)


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


# ------------------------------------------------------------------------------------------
# Backward templates (SM80-class, both paths)
# ------------------------------------------------------------------------------------------
_BWD_EXPORTS = c_exports("convbwd", "p")

# The geometry every backward kernel checks: packed NHWC / KRSC, 32-bit GEMM extents, no dilation
# (the strided-dgrad kernel has none), K a multiple of 8 (16-byte dy rows).
_BWD_GEOMETRY = r"""
bool geometry_ok(const cvt_convbwd_args& p) {
  if (p.n <= 0 || p.h <= 0 || p.w <= 0 || p.c <= 0 || p.k <= 0 || p.r <= 0 || p.s <= 0 || p.p <= 0 || p.q <= 0)
    return false;
  if (p.n * p.h * p.w * p.c > INT32_MAX || p.n * p.p * p.q * p.k > INT32_MAX || p.k * p.r * p.s * p.c > INT32_MAX)
    return false;
  if (p.pad_h < 0 || p.pad_w < 0 || p.stride_h < 1 || p.stride_w < 1 || p.dilation_h != 1 || p.dilation_w != 1)
    return false;
  if (p.p != (p.h + 2 * p.pad_h - p.dilation_h * (p.r - 1) - 1) / p.stride_h + 1) return false;
  if (p.q != (p.w + 2 * p.pad_w - p.dilation_w * (p.s - 1) - 1) / p.stride_w + 1) return false;
  return p.k % 8 == 0 && p.dy;
}

cutlass::conv::Conv2dProblemSize problem_of(const cvt_convbwd_args& p, int splits) {
  return cutlass::conv::Conv2dProblemSize(
      int(p.n), int(p.h), int(p.w), int(p.c), int(p.k), int(p.r), int(p.s), int(p.p), int(p.q),
      int(p.pad_h), int(p.pad_w), int(p.stride_h), int(p.stride_w), int(p.dilation_h), int(p.dilation_w),
      cutlass::conv::Mode::kCrossCorrelation, splits, /*groups=*/1);
}
"""

CONV_DGRAD_TEMPLATE = r"""// Generated by cvt_cutlass for kernel ${name}. Do not edit.
// conv2d dgrad (implicit GEMM, SM80-class, strided-dgrad kernel): dx (NHWC) from dy (NHWC) and w (KRSC); ${dtype}; fp32 accumulation
#include <cstdint>
#include <cuda_runtime.h>
#include "cutlass/cutlass.h"
#include "cutlass/conv/conv2d_problem_size.h"
#include "cutlass/conv/kernel/default_conv2d_dgrad.h"
#include "cutlass/conv/device/implicit_gemm_convolution.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cvt_conv_bwd_abi.h"
""" + DEVICE_HELPERS + r"""
namespace cvt_kernel {
constexpr int kFamily = CVT_FAMILY_CONV2D_BWD;
using Element = ${element};
using Layout = cutlass::layout::TensorNHWC;
// dx = 1 * accum (beta 0: no source read).
using EpilogueOp = cutlass::epilogue::thread::LinearCombination<Element, 8, float, float>;
// GEMM M = N*H*W (per stride phase), N = C, K = K*R*S: A = dy, B = the filter, D = dx.
using Kernel = typename cutlass::conv::kernel::DefaultConv2dDgrad<
    Element, Layout, Element, Layout, Element, Layout, float,
    cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
    cutlass::gemm::GemmShape<${tm}, ${tn}, ${tk}>, cutlass::gemm::GemmShape<${wm}, ${wn}, ${wk}>,
    cutlass::gemm::GemmShape<16, 8, 16>, EpilogueOp,
    cutlass::conv::threadblock::StridedDgradIdentityThreadblockSwizzle<${swizzle}>, ${stages},
    cutlass::arch::OpMultiplyAdd, cutlass::conv::IteratorAlgorithm::${iterator},
    cutlass::conv::StrideSupport::kStrided, 8, 8>::Kernel;
using Conv = cutlass::conv::device::ImplicitGemmConvolution<Kernel>;
""" + _BWD_GEOMETRY + r"""
typename Conv::Arguments make_arguments(const cvt_convbwd_args& p) {
  Layout lx = Layout::packed({int(p.n), int(p.h), int(p.w), int(p.c)});
  Layout lw = Layout::packed({int(p.k), int(p.r), int(p.s), int(p.c)});
  Layout ly = Layout::packed({int(p.n), int(p.p), int(p.q), int(p.k)});
  using Ref = cutlass::TensorRef<Element, Layout>;
  Element* dx = static_cast<Element*>(p.dx);
  return typename Conv::Arguments(
      problem_of(p, 1), Ref(static_cast<Element*>(const_cast<void*>(p.dy)), ly),
      Ref(static_cast<Element*>(const_cast<void*>(p.filter)), lw), Ref(dx, lx), Ref(dx, lx),
      {1.0f, 0.0f}, cutlass::conv::SplitKMode::kSerial);
}

bool can_implement(const cvt_convbwd_args& p) {
  if (!geometry_ok(p) || p.c % 8 || !p.filter || !p.dx) return false;
  return Conv::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
}

size_t workspace_size(const cvt_convbwd_args& p) { return Conv::get_workspace_size(make_arguments(p)); }

// Launched directly (ImplicitGemmConvolution::initialize/run set the shared-memory attribute on
// every call): the attribute once per device, then the kernel. Every dx pixel is written (stride
// phases no filter tap reaches get zeros), so dx needs no clearing.
int launch(const cvt_convbwd_args& p, void* workspace, cudaStream_t stream) {
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
""" + _BWD_EXPORTS

CONV_WGRAD_TEMPLATE = r"""// Generated by cvt_cutlass for kernel ${name}. Do not edit.
// conv2d wgrad (implicit GEMM, SM80-class, parallel split-K over N*P*Q): dw (KRSC) from dy and x (NHWC),
// db = dy summed over N*P*Q by a deterministic row-sum pass; ${dtype}; fp32 accumulation
#include <cstdint>
#include <cuda_runtime.h>
#include "cutlass/cutlass.h"
#include "cutlass/conv/conv2d_problem_size.h"
#include "cutlass/conv/kernel/default_conv2d_wgrad.h"
#include "cutlass/conv/device/implicit_gemm_convolution.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cvt_conv_bwd_abi.h"
""" + DEVICE_HELPERS + COLSUM_HELPER + ROWSUM_HELPER + r"""
namespace cvt_kernel {
constexpr int kFamily = CVT_FAMILY_CONV2D_BWD;
using Element = ${element};
using Layout = cutlass::layout::TensorNHWC;
// Each split writes its fp32 partial dw (beta 0) to its own slab of the workspace.
using EpilogueOp = cutlass::epilogue::thread::LinearCombination<float, 4, float, float>;
// GEMM M = K, N = R*S*C, K = N*P*Q: A = dy (K contiguous), B = im2col(x) (C contiguous, ${align}-element
// accesses: 4 reads the stem's padded 4 channels), D = fp32 partial dw (K, R, S, C) per split.
using Kernel = typename cutlass::conv::kernel::DefaultConv2dWgrad<
    Element, Layout, Element, Layout, float, Layout, float,
    cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
    cutlass::gemm::GemmShape<${tm}, ${tn}, ${tk}>, cutlass::gemm::GemmShape<${wm}, ${wn}, ${wk}>,
    cutlass::gemm::GemmShape<16, 8, 16>, EpilogueOp,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, ${stages},
    cutlass::arch::OpMultiplyAdd, cutlass::conv::IteratorAlgorithm::${iterator},
    cutlass::conv::StrideSupport::kStrided, 8, ${align}>::Kernel;
using Conv = cutlass::conv::device::ImplicitGemmConvolution<Kernel>;
constexpr int kTileM = ${tm}, kTileN = ${tn}, kTileK = ${tk};
""" + _BWD_GEOMETRY + r"""
inline int sms_of(const cvt_convbwd_args& p) {
  const int s = p.sm_count > 0 ? p.sm_count : sm_count_of(p.device_id);
  return s > 0 ? s : 132;
}

// GEMM-K splits: p.splits if set, else enough for ${waves} CTA(s) per SM over the output tiles, each
// split at least 8 K-tiles. CUTLASS runs exactly this many (grid z); split z reads K-tiles z, z + splits, ...
inline int splits_of(const cvt_convbwd_args& p) {
  int64_t s = p.splits;
  if (s <= 0) {
    const int64_t tiles = ((p.k + kTileM - 1) / kTileM) * ((p.r * p.s * p.c + kTileN - 1) / kTileN);
    const int64_t want = (${waves} * int64_t(sms_of(p)) + tiles - 1) / tiles, most = p.n * p.p * p.q / (8 * kTileK);
    s = want < most ? want : most;
  }
  return int(s < 1 ? 1 : (s > 512 ? 512 : s));
}

inline int64_t dw_size(const cvt_convbwd_args& p) { return p.k * p.r * p.s * p.c; }
inline size_t partials_bytes(const cvt_convbwd_args& p) {
  return (size_t(splits_of(p)) * size_t(dw_size(p)) * sizeof(float) + 255) / 256 * 256;
}

typename Conv::Arguments make_arguments(const cvt_convbwd_args& p, float* partials) {
  Layout lx = Layout::packed({int(p.n), int(p.h), int(p.w), int(p.c)});
  Layout ly = Layout::packed({int(p.n), int(p.p), int(p.q), int(p.k)});
  cutlass::layout::TensorNHWC lw = cutlass::layout::TensorNHWC::packed({int(p.k), int(p.r), int(p.s), int(p.c)});
  using Ref = cutlass::TensorRef<Element, Layout>;
  using RefD = cutlass::TensorRef<float, Layout>;
  return typename Conv::Arguments(
      problem_of(p, splits_of(p)), Ref(static_cast<Element*>(const_cast<void*>(p.dy)), ly),
      Ref(static_cast<Element*>(const_cast<void*>(p.x)), lx), RefD(partials, lw), RefD(partials, lw),
      {1.0f, 0.0f}, cutlass::conv::SplitKMode::kParallel);
}

bool can_implement(const cvt_convbwd_args& p) {
  if (!geometry_ok(p) || p.c % ${align} || !p.x || !p.dw) return false;
  return Conv::can_implement(make_arguments(p, nullptr)) == cutlass::Status::kSuccess;
}

size_t workspace_size(const cvt_convbwd_args& p) {
  return partials_bytes(p) + (p.db ? rowsum_workspace(p.n * p.p * p.q, p.k, sms_of(p)) : 0);
}

// The wgrad kernel (split z writes fp32 partial dw z), the partials summed in split order into dw,
// then db from dy's rows: all on `stream`, no atomics (deterministic).
int launch(const cvt_convbwd_args& p, void* workspace, cudaStream_t stream) {
  constexpr int kSmem = int(sizeof(typename Kernel::SharedStorage));
  if (!workspace) return CVT_ERR_WORKSPACE;
  if (!smem_ready(reinterpret_cast<const void*>(cutlass::Kernel<Kernel>), kSmem, p.device_id)) return CVT_ERR_SMEM;
  float* partials = static_cast<float*>(workspace);
  typename Kernel::Params params(make_arguments(p, partials), nullptr);
  typename Kernel::ThreadblockSwizzle swizzle;
  dim3 grid = swizzle.get_grid_shape(params.grid_tiled_shape);
  dim3 block(Kernel::kThreadCount, 1, 1);
  cutlass::Kernel<Kernel><<<grid, block, kSmem, stream>>>(params);
  colsum(partials, splits_of(p), dw_size(p), dw_size(p), static_cast<Element*>(p.dw), stream);
  if (p.db) {
    float* part_b = reinterpret_cast<float*>(static_cast<char*>(workspace) + partials_bytes(p));
    rowsum(static_cast<const Element*>(p.dy), p.n * p.p * p.q, p.k, p.k, sms_of(p), part_b,
           static_cast<Element*>(p.db), stream);
  }
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}
}  // namespace cvt_kernel
""" + _BWD_EXPORTS
