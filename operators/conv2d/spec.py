"""conv2d kernel specs: CvT's convolutional token embedding, an implicit GEMM on NHWC tokens.

CvT's token layout (B, H*W, C) is NHWC, so the embedding reads the previous stage's tokens and
writes the next stage's tokens without a permute. Three kinds of kernels:

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

Kernels: operators/conv2d/fprop_sm80.cuh (ConvSpec), fprop_sm90.cuh (Conv90Spec), dgrad_sm80.cuh and
wgrad_sm80.cuh (ConvBwdSpec; their shared geometry check in bwd_geometry.cuh). A spec's
``instantiation()`` writes a ``Config`` struct with its parameters and ``using Kernel = <template><Config>``.

Names follow operators/spec.py: ``cvt_conv2d_<pass>_<arch>_<dtype>_nhwc_<variant>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from ..spec import (
    CUTLASS_ELEMENT,
    KernelSpec,
    NameHead,
    SpecError,
    check_sm80_tile,
    cute_shape,
    gemm_shape,
    instantiation_file,
    match_variant,
    triple,
    xs,
)

# The C++ enum whose values CONV_ITERATORS and CONV_BWD_ITERATORS name.
_ITERATOR = "cutlass::conv::IteratorAlgorithm"
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
    layout: ClassVar[str] = "nhwc"

    def variant(self) -> str:
        return (f"{self.epilogue}_t{xs(self.tile)}_w{xs(self.warps)}_s{self.stages}_sw{self.swizzle}"
                f"_{self.iterator}_a{self.align}")

    @classmethod
    def from_variant(cls, head: NameHead) -> ConvSpec | None:
        return match_variant(head, _CONV_VARIANT, 89, lambda m: cls(
            89, head.dtype, triple(m["t"]), triple(m["w"]), int(m["st"]), m["it"], int(m["al"]), int(m["sw"]),
            m["epi"], head.pass_))

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
        check_sm80_tile(self.name, self.tile, self.warps, self.stages, tile_k=(16, 32, 64))

    def channels_ok(self, c: int) -> bool:
        """Whether this instantiation can read an input with ``c`` channels."""
        if self.iterator == "fixed_channels":
            return c == self.align
        return c % self.align == 0

    def instantiation(self) -> str:
        """The kernel's ``.cu``: operators/conv2d/fprop_sm80.cuh with this spec's parameters."""
        lines = [f"using Element = {CUTLASS_ELEMENT[self.dtype]};",
                 *_sm80_shapes(self.tile, self.warps),
                 f"static constexpr int kStages = {self.stages};",
                 f"static constexpr int kSwizzle = {self.swizzle};",
                 f"static constexpr auto kIterator = {_ITERATOR}::{CONV_ITERATORS[self.iterator]};",
                 f"static constexpr int kAlign = {self.align};"]
        return instantiation_file(
            self, headers=("conv2d/fprop_sm80.cuh",), body=_config_body(lines, "FpropSm80"), abi="conv",
            description=f"conv2d fprop (implicit GEMM, SM80-class), NHWC x KRSC -> NHWC, + bias; {self.dtype}; "
                        "fp32 accumulation")


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
    layout: ClassVar[str] = "nhwc"

    def variant(self) -> str:
        st = f"s{self.stages}" if self.stages else "sauto"
        return f"{self.epilogue}_t{xs(self.tile)}_c{xs(self.cluster)}_{st}_ws_a{self.align}"

    @classmethod
    def from_variant(cls, head: NameHead) -> Conv90Spec | None:
        return match_variant(head, _CONV90_VARIANT, 90, lambda m: cls(
            head.dtype, triple(m["t"]), triple(m["c"]), 0 if m["st"] == "auto" else int(m["st"]), m["epi"],
            int(m["al"]), head.pass_))

    def validate(self) -> None:
        self.check_common()
        if self.epilogue != "bias":
            raise SpecError("conv2d kernels have one epilogue: 'bias'")
        if self.align != 8:
            raise SpecError("SM90 conv kernels read 16-byte TMA rows (align=8)")
        _check_sm90_conv(self.tile, self.cluster, self.stages)

    def channels_ok(self, c: int) -> bool:
        return c % 8 == 0

    def instantiation(self) -> str:
        """The kernel's ``.cu``: operators/conv2d/fprop_sm90.cuh with this spec's parameters."""
        return instantiation_file(
            self, headers=("conv2d/fprop_sm90.cuh",), body=_config_body(_sm90_conv_lines(self), "FpropSm90"),
            abi="conv",
            description="conv2d fprop (CUTLASS 3.x SM90 implicit GEMM: TMA im2col + wgmma), NHWC x KRSC -> NHWC, "
                        f"+ bias; {self.dtype}; fp32 accumulation")


@dataclass(frozen=True)
class Conv90WgradSpec(KernelSpec):
    """One CUTLASS 3.x SM90 implicit-GEMM conv2d weight gradient (TMA im2col + wgmma, sm_90a only;
    ``wgrad_sm90.cuh``): dw = dy^T . im2col(x), the whole GEMM-K (N * P * Q) in one CTA per output
    tile (CUTLASS 4.2's SM90 conv kernel is the non-persistent one: no split), db by a row-sum pass
    in the same launch. TMA needs 16-byte rows: C and K multiples of 8. The knobs are the tile, the
    cluster and the stage count."""

    dtype: str
    tile: tuple[int, int, int]
    cluster: tuple[int, int, int] = (1, 1, 1)
    stages: int = 0  # 0 = as many as fit

    arch: ClassVar[int] = 90
    pass_: ClassVar[str] = "wgrad"
    iterator: ClassVar[str] = "im2col_tma"
    align: ClassVar[int] = 8
    op: ClassVar[str] = "conv2d"
    family: ClassVar[str] = "conv2d_bwd"
    PASSES: ClassVar[tuple[str, ...]] = ("wgrad",)
    layout: ClassVar[str] = "nhwc"
    epilogue: ClassVar[str] = "none"

    def variant(self) -> str:
        st = f"s{self.stages}" if self.stages else "sauto"
        return f"dbias_t{xs(self.tile)}_c{xs(self.cluster)}_{st}_ws_a{self.align}"

    @classmethod
    def from_variant(cls, head: NameHead) -> Conv90WgradSpec | None:
        return match_variant(head, _CONV90_WGRAD_VARIANT, 90, lambda m: cls(
            head.dtype, triple(m["t"]), triple(m["c"]), 0 if m["st"] == "auto" else int(m["st"])))

    def validate(self) -> None:
        self.check_common()
        _check_sm90_conv(self.tile, self.cluster, self.stages)

    def channels_ok(self, c: int) -> bool:
        return c % 8 == 0

    def instantiation(self) -> str:
        """The kernel's ``.cu``: operators/conv2d/wgrad_sm90.cuh with this spec's parameters."""
        return instantiation_file(
            self, headers=("conv2d/wgrad_sm90.cuh",), body=_config_body(_sm90_conv_lines(self), "WgradSm90"),
            abi="convbwd", description="conv2d wgrad (CUTLASS 3.x SM90 implicit GEMM: TMA im2col + wgmma): dw (KRSC) "
                                       f"from dy and x (NHWC), db by a row-sum pass; {self.dtype}; fp32 accumulation")


def _check_sm90_conv(tile: tuple[int, int, int], cluster: tuple[int, int, int], stages: int) -> None:
    """The SM90 conv kernels' knobs (Conv90Spec, Conv90WgradSpec)."""
    tm, tn, tk = tile
    if tm not in (64, 128) or tn % 16 or not 16 <= tn <= 256 or tk not in (32, 64, 128):
        raise SpecError("SM90 conv tile: M 64 or 128 (one consumer warp group), N a multiple of 16 up "
                        "to 256, K 32/64/128")
    cm, cn, ck = cluster
    if ck != 1 or cm not in (1, 2) or cn not in (1, 2):
        raise SpecError("SM90 conv cluster must be (1|2, 1|2, 1)")
    if stages and not 2 <= stages <= 8:
        raise SpecError("stages must be 0 (auto) or in [2, 8]")


def _sm90_conv_lines(spec) -> list[str]:
    tm, tn, tk = spec.tile
    cm, cn, _ = spec.cluster
    # K nested as Shape<_K> (and for the wgrad N too): the tile shapes CUTLASS's SM90 conv builds take
    n = f"cute::Shape<cute::_{tn}>" if spec.pass_ == "wgrad" else f"cute::_{tn}"
    return [f"using Element = {CUTLASS_ELEMENT[spec.dtype]};",
            f"using TileShape = cute::Shape<cute::_{tm}, {n}, cute::Shape<cute::_{tk}>>;",
            f"using ClusterShape = {cute_shape((cm, cn, 1))};",
            f"static constexpr int kStages = {spec.stages};  // 0: as many as fit"]


_CONV_VARIANT = re.compile(
    r"(?P<epi>[a-z_]+?)_t(?P<t>\d+x\d+x\d+)_w(?P<w>\d+x\d+x\d+)_s(?P<st>\d+)_sw(?P<sw>\d+)"
    r"_(?P<it>optimized|fixed_channels|few_channels)_a(?P<al>\d+)"
)
_ROWS_VARIANT = re.compile(r"(?P<kind>d?bias)_rows_r(?P<r>\d+)_s(?P<st>\d+)_k(?P<k>\d+)")
_CONV90_WGRAD_VARIANT = re.compile(
    r"dbias_t(?P<t>\d+x\d+x\d+)_c(?P<c>\d+x\d+x\d+)_s(?P<st>auto|\d+)_ws_a8"
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
        check_sm80_tile(self.name, self.tile, self.warps, self.stages)

    def channels_ok(self, c: int) -> bool:
        """Whether this instantiation serves inputs with ``c`` channels."""
        return c % self.align == 0

    def instantiation(self) -> str:
        """The kernel's ``.cu``: operators/conv2d/dgrad_sm80.cuh or wgrad_sm80.cuh with this spec's
        parameters."""
        lines = [f"using Element = {CUTLASS_ELEMENT[self.dtype]};",
                 *_sm80_shapes(self.tile, self.warps),
                 f"static constexpr int kStages = {self.stages};",
                 f"static constexpr auto kIterator = {_ITERATOR}::{CONV_BWD_ITERATORS[self.iterator]};"]
        if self.pass_ == "dgrad":
            lines.append(f"static constexpr int kSwizzle = {self.swizzle};")
            template, what = "DgradSm80", ("conv2d dgrad (implicit GEMM, SM80-class, strided-dgrad kernel): dx (NHWC) "
                                           "from dy (NHWC) and w (KRSC)")
        else:
            lines += [f"static constexpr int kAlign = {self.align};", f"static constexpr int kWaves = {self.waves};"]
            template, what = "WgradSm80", ("conv2d wgrad (implicit GEMM, SM80-class, parallel split-K over N*P*Q): "
                                           "dw (KRSC) from dy and x (NHWC), db = dy summed over N*P*Q by a "
                                           "deterministic row-sum pass")
        return instantiation_file(
            self, headers=(f"conv2d/{self.pass_}_sm80.cuh",), body=_config_body(lines, template), abi="convbwd",
            description=f"{what}; {self.dtype}; fp32 accumulation")


@dataclass(frozen=True)
class _RowWindowSpec(KernelSpec):
    """What the row-window kernels' specs share (:class:`ConvRowsSpec`, :class:`ConvRowsWgradSpec`):
    SM80-class mma.sync kernels that serve both paths, their knobs ``filter_rows`` R (instantiated),
    ``stages`` (output rows in flight) and ``waves`` (CTAs per SM), their name
    ``<prefix>_rows_r<R>_s<stages>_k<waves>``, and the windows they serve (:func:`rows_serve`, with
    their stages within shared memory: :func:`rows_smem_bytes`). No ``op``: not registered itself."""

    dtype: str
    filter_rows: int = 7
    stages: int = 3
    waves: int = 2

    arch: ClassVar[int] = 89
    ARCHS: ClassVar[tuple[int, ...]] = CONV_ARCHS
    layout: ClassVar[str] = "nhwc"
    iterator: ClassVar[str] = "row_window"
    warps: ClassVar[tuple[int, int, int]] = (2, 4, 1)
    name_prefix: ClassVar[str]  # "bias" (forward) or "dbias" (weight gradient)

    def variant(self) -> str:
        return f"{self.name_prefix}_rows_r{self.filter_rows}_s{self.stages}_k{self.waves}"

    @classmethod
    def from_variant(cls, head: NameHead):
        m = _ROWS_VARIANT.fullmatch(head.variant)
        if not m or m["kind"] != cls.name_prefix or head.arch != 89 or head.pass_ != cls.pass_:
            return None
        return cls(head.dtype, int(m["r"]), int(m["st"]), int(m["k"]))

    def validate(self) -> None:
        self.check_common()
        if not 1 <= self.filter_rows <= 8:
            raise SpecError("row-window conv: filter rows 1 .. 8")
        if self.stages not in (2, 3, 4):
            raise SpecError("row-window conv: 2, 3 or 4 stages")
        if self.waves not in (1, 2, 4):
            raise SpecError(f"row-window conv: 1, 2 or 4 CTAs per SM, got {self.waves}")

    def channels_ok(self, c: int) -> bool:
        return c % 4 == 0

    def serves(self, window: tuple[int, ...] | None) -> bool:
        """Whether this instantiation serves the conv ``window`` = (C, K, R, S, W, stride, pad)."""
        return (window is not None and window[2] == self.filter_rows and rows_serve(*window)
                and rows_smem_bytes(self.pass_, window, self.stages) <= ROWS_SMEM_CAP)

    def _instantiation(self, header: str, template: str, abi: str, description: str) -> str:
        lines = [f"using Element = {CUTLASS_ELEMENT[self.dtype]};",
                 f"static constexpr int kR = {self.filter_rows};",
                 f"static constexpr int kStages = {self.stages};",
                 f"static constexpr int kWaves = {self.waves};"]
        return instantiation_file(self, headers=(header,), body=_config_body(lines, template), abi=abi,
                                  description=f"{description}; {self.dtype}; fp32 accumulation")


@dataclass(frozen=True)
class ConvRowsSpec(_RowWindowSpec):
    """The stem's forward as row-window GEMMs (``fprop_rows.cuh``): each output row is the sum over
    filter rows of an input row's window times that filter row's weights, the windows read from
    whole input rows in shared memory instead of the fixed-channels iterator's 8-byte accesses."""

    pass_: ClassVar[str] = "fwd"
    epilogue: ClassVar[str] = "bias"
    op: ClassVar[str] = "conv2d"
    family: ClassVar[str] = "conv2d_fprop"
    name_prefix: ClassVar[str] = "bias"

    @property
    def tile(self) -> tuple[int, int, int]:
        """The CTA's GEMM tile (profile rows): 64 pixels of a row x 64 channels x R * 32 taps."""
        return (64, 64, self.filter_rows * 32)

    def instantiation(self) -> str:
        """The kernel's ``.cu``: operators/conv2d/fprop_rows.cuh with this spec's parameters."""
        return self._instantiation("conv2d/fprop_rows.cuh", "FpropRows", "conv",
                                   "conv2d fprop of few input channels (row-window GEMMs, SM80-class mma.sync), "
                                   "NHWC x KRSC -> NHWC, + bias")


@dataclass(frozen=True)
class ConvRowsWgradSpec(_RowWindowSpec):
    """The stem's weight gradient as row-window GEMMs (``wgrad_rows.cuh``): for few input channels
    each output pixel's S * C taps of a filter row are one contiguous run of an input row, so the B
    operand is read from whole input rows in shared memory instead of an 8-byte-per-access im2col;
    db in the same pass."""

    pass_: ClassVar[str] = "wgrad"
    op: ClassVar[str] = "conv2d"
    family: ClassVar[str] = "conv2d_bwd"
    PASSES: ClassVar[tuple[str, ...]] = ("wgrad",)
    epilogue: ClassVar[str] = "none"
    name_prefix: ClassVar[str] = "dbias"

    @property
    def tile(self) -> tuple[int, int, int]:
        """The CTA's GEMM tile (profile rows): 64 channels x R * 32 taps x 16 pixels a step."""
        return (64, self.filter_rows * 32, 16)

    def instantiation(self) -> str:
        """The kernel's ``.cu``: operators/conv2d/wgrad_rows.cuh with this spec's parameters."""
        return self._instantiation("conv2d/wgrad_rows.cuh", "WgradRows", "convbwd",
                                   "conv2d wgrad of few input channels (row-window GEMMs, SM80-class mma.sync): "
                                   "dw (KRSC) from dy and x (NHWC), db in the same pass")


def rows_serve(c: int, k: int, r: int, s: int, w: int, stride: int, pad: int) -> bool:
    """Whether the row-window kernels (:class:`ConvRowsSpec`, :class:`ConvRowsWgradSpec`; their
    C++ check is rows_common.cuh's rows_fit) can serve a conv of C input channels, K output
    channels, an R x S filter, input width W, stride and padding: 16-byte window starts (C * stride
    and C * pad multiples of 8), whole 16-byte input rows (W * C), at most 32 taps a filter row
    (S * C), at most 64 output pixels a row, K a multiple of 64, R <= 8. (An instantiation's
    ``serves`` also checks that its stages fit in shared memory.)"""
    q = (w + 2 * pad - s) // stride + 1 if stride >= 1 else 0
    return (stride >= 1 and pad >= 0 and c * stride % 8 == 0 and c * pad % 8 == 0 and w * c % 8 == 0
            and s * c <= 32 and 0 < q <= 64 and k % 64 == 0 and 1 <= r <= 8)


ROWS_SMEM_CAP = 96 * 1024  # rows_common.cuh: kSmemCap (within sm_89's 99 KB per block)


def rows_smem_bytes(pass_: str, window: tuple[int, ...], stages: int) -> int:
    """The shared memory a row-window kernel (``pass_`` "fwd" or "wgrad") takes on the conv
    ``window``, as its launch computes it (fprop_rows.cuh / wgrad_rows.cuh: smem_bytes): 16-bit
    input rows of pad * C zeros, W * C elements and zeros to the last window read (64 pixels for the
    forward, Q rounded up to 16 for the weight gradient), R of them a stage; the forward's weight
    tile, the weight gradient's dy tile (64 x 72 a stage)."""
    c, _, r, s, w, stride, pad = window
    q = (w + 2 * pad - s) // stride + 1
    pixels = 64 if pass_ == "fwd" else -(-q // 16) * 16
    row_len = -(-max((pixels - 1) * stride * c + 32, pad * c + w * c) // 8) * 8
    if pass_ == "fwd":
        return 2 * (64 * (r * 32 + 8) + stages * r * row_len)
    return 2 * stages * (64 * 72 + r * row_len)


def _rows_stages(pass_: str, window: tuple[int, ...] | None) -> list[int]:
    """The stage counts (2, 3, 4) whose row-window kernel serves ``window`` (none where it cannot)."""
    if window is None or not rows_serve(*window):
        return []
    return [st for st in (2, 3, 4) if rows_smem_bytes(pass_, window, st) <= ROWS_SMEM_CAP]


_CONV_BWD_VARIANT = re.compile(
    r"(?P<kind>strided|dbias)_t(?P<t>\d+x\d+x\d+)_w(?P<w>\d+x\d+x\d+)_s(?P<st>\d+)(?:_sw(?P<sw>\d+))?"
    r"_(?P<it>optimized|analytic)_a(?P<al>\d+)(?:_k(?P<k>\d+))?"
)


def _sm80_shapes(tile: tuple[int, int, int], warps: tuple[int, int, int]) -> list[str]:
    """The Config members ThreadblockShape and WarpShape of an SM80-class tile split into warps
    (the warp tile spans the whole K of the tile)."""
    tm, tn, tk = tile
    wm, wn, _ = warps
    return [f"using ThreadblockShape = {gemm_shape(tile)};",
            f"using WarpShape = {gemm_shape((tm // wm, tn // wn, tk))};"]


def _config_body(lines: list[str], template: str) -> str:
    """The instantiation's body: ``struct Config`` with ``lines`` as members, ``using Kernel``."""
    return "\n".join(["struct Config {", *("  " + ln for ln in lines), "};", f"using Kernel = {template}<Config>;"])


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


def conv_candidates(dtype: str, channels: int, arch: int = 89, window: tuple[int, ...] | None = None) -> list:
    """The instantiations a profile sweep tries for inputs with ``channels`` channels (already
    padded: the stem's 3 channels arrive as 4). The sm90 path also tries the CUTLASS 3.x SM90
    kernels where TMA can read the input (C a multiple of 8); where the conv ``window`` (C, K, R,
    S, W, stride, pad) allows it, the row-window kernel at 2, 3 and 4 stages comes first."""
    rows = [ConvRowsSpec(dtype, window[2], st) for st in _rows_stages("fwd", window)]
    if channels % 8 == 0:
        sm80 = [ConvSpec(89, dtype, t, w, st) for t, w, st in _CONV_SPACE]
        return rows + sm80 + ([Conv90Spec(dtype, t, c) for t, c in _CONV90_SPACE] if arch == 90 else [])
    if channels in (2, 4):
        return rows + ([ConvSpec(89, dtype, t, w, st, "fixed_channels", channels) for t, w, st in _STEM_SPACE]
                       + [ConvSpec(89, dtype, t, w, st, "few_channels", channels) for t, w, st in _STEM_SPACE[:2]])
    return [ConvSpec(89, dtype, t, w, st, "few_channels", 1) for t, w, st in _STEM_SPACE[:2]]


def conv_heuristic(dtype: str, channels: int, out_channels: int, arch: int = 89,
                   window: tuple[int, ...] | None = None) -> ConvSpec | ConvRowsSpec:
    """The row-window kernel where the conv ``window`` (C, K, R, S, W, stride, pad) allows it (the
    stem), else SM80-class on both paths until a sweep has measured the SM90 kernels on the problem."""
    stages = _rows_stages("fwd", window)
    if stages:  # 2 stages measured fastest (H100, 2026-12-07)
        return ConvRowsSpec(dtype, window[2], stages[0])
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
    # 256-row tiles won every dgrad of the H200 conv training sweep at batch 128 (2026-11-23,
    # profiles/conv2d_train_cvt13_h200.csv): deeper pipelines and wider ones around them
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


# The SM90 wgrad's tiles (M = output channels, N = R * S * C): no split of GEMM-K, so smaller
# tiles put more CTAs on the 132 SMs (stage 3 of CvT-13: 384 x 1,728, 42 tiles of 128 x 128, 162 of
# 64 x 64). Not run on a GPU yet (2026-12-07): a sweep's float64 check and timing decide.
_WGRAD90_SPACE = (
    ((64, 64, 64), (1, 1, 1)),
    ((64, 128, 64), (1, 1, 1)),
    ((128, 64, 64), (1, 1, 1)),
    ((128, 128, 64), (1, 1, 1)),
)


def conv_bwd_candidates(pass_: str, dtype: str, channels: int, arch: int = 89,
                        window: tuple[int, ...] | None = None) -> list:
    """The backward sweep's space for inputs with ``channels`` channels (the stem's padded 4) on
    the ``arch`` path (the SM80-class kernels serve both): dgrad tiles x swizzle 1 (and 4 for the
    first two); wgrad tiles x split waves 2 and 4, on the sm90 path the SM90 wgrad's tiles where TMA
    reads the input (C a multiple of 8), and where the conv ``window`` (C, K, R, S, W, stride, pad)
    allows it the row-window wgrad at the stages that fit."""
    if pass_ == "dgrad":
        if channels % 8:
            return []
        return ([ConvBwdSpec(89, dtype, "dgrad", t, w, st) for t, w, st in _DGRAD_SPACE]
                + [ConvBwdSpec(89, dtype, "dgrad", t, w, st, swizzle=4) for t, w, st in _DGRAD_SPACE[:2]])
    align = 8 if channels % 8 == 0 else 4 if channels % 4 == 0 else 0
    if not align:
        return []
    rows = [ConvRowsWgradSpec(dtype, window[2], st) for st in _rows_stages("wgrad", window)]
    sm90 = [Conv90WgradSpec(dtype, t, c) for t, c in _WGRAD90_SPACE] if arch == 90 and align == 8 else []
    return rows + sm90 + [ConvBwdSpec(89, dtype, "wgrad", t, w, st, align=align, waves=v) for t, w, st in _WGRAD_SPACE
                          for v in (2, 4, 8)]


def conv_bwd_heuristic(pass_: str, dtype: str, channels: int, out_channels: int,
                       window: tuple[int, ...] | None = None) -> ConvBwdSpec | ConvRowsWgradSpec:
    """dgrad: 128-row tiles, 64 or 128 wide by C; wgrad: the row-window kernel where the conv
    ``window`` (C, K, R, S, W, stride, pad) allows it (the stem), else 64 x 64 tiles for the
    64-channel stem, 128 x 128 otherwise, GEMM-K split for 2 CTAs per SM. Raises SpecError when no
    kernel serves ``channels`` (the op falls back visibly)."""
    if pass_ == "dgrad":
        if channels % 8:
            raise SpecError(f"no conv dgrad kernel for C={channels} (a multiple of 8)")
        tile, st = ((128, 64, 32), 4) if channels <= 64 else ((128, 128, 32), 4)
        return ConvBwdSpec(89, dtype, "dgrad", tile, (2, 2, 1), st)
    if channels % 4:
        raise SpecError(f"no conv wgrad kernel for C={channels} (a multiple of 4)")
    stages = _rows_stages("wgrad", window)
    if stages:  # 3 stages measured fastest at batch 128 (H100, 2026-12-07)
        return ConvRowsWgradSpec(dtype, window[2], 3 if 3 in stages else stages[0])
    align = 8 if channels % 8 == 0 else 4
    tile, st = ((64, 64, 32), 5) if out_channels <= 64 else ((128, 128, 32), 4)
    return ConvBwdSpec(89, dtype, "wgrad", tile, (2, 2, 1), st, align=align)


def conv_window(c: int, k: int, r: int, s: int, w: int, stride: int, pad: int) -> tuple[int, ...] | None:
    """The conv geometry the row-window kernels (forward and weight gradient) need to know they
    serve (C as the kernels read it), or None where a filter row has more than 32 taps (S * C > 32:
    they could never serve it)."""
    return (c, k, r, s, w, stride, pad) if s * c <= 32 else None
