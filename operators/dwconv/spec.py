"""dwconv kernel specs: CvT's depthwise 3x3 conv projection on tokens (kernels:
operators/dwconv/dwconv.cuh, dwbn_fwd.cuh, dwbn_bwd.cuh).

:class:`DwConvSpec` -- depthwise conv with BatchNorm folded into fp32 weights and bias: our own
CuTe kernel (CUTLASS's DepthwiseDirect2dConv accumulates in fp16). fp16/bf16 in and out, fp32
accumulation; one thread computes ``pix`` consecutive outputs along W for 8 channels (one
16-byte access), so the input columns the outputs share are loaded once. It reads tokens with a
row offset and writes them with one, so CvT's stage-3 cls token passes through at row 0 of every
image without a ``torch.cat``.

Names follow operators/spec.py: ``cvt_dwconv_fwd_<arch>_<dtype>_nhwc_<epilogue>_k3_st<s>_p<pix>_b<threads>``.

:class:`DwConvBnSpec` -- the same conv followed by BatchNorm in training mode (batch statistics,
running-stat update), forward (pass ``fwd``) and backward (pass ``bwd``): one kernel library per
pass, each running a few short kernels (dwbn_fwd.cuh, dwbn_bwd.cuh; what they share in
dwbn_common.cuh). Names:
``cvt_dwconv_<fwd|bwd>_<arch>_<dtype>_nhwc_bn_k3_st<s>_p<pix>_g<groups>_b<threads>``. A CvT layer's
q, k and v projections of one input in one set of launches (q of one shape, the k / v pair of
another: DwBnFwdQkv / DwBnBwdQkv) append the pair's shape: ``..._b<threads>_kv_st<s>_p<pix>_g<groups>_b<threads>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from ..spec import CUTLASS_ELEMENT, KernelSpec, NameHead, SpecError, instantiation_file, match_variant


@dataclass(frozen=True)
class DwConvSpec(KernelSpec):
    """One depthwise 3x3 conv instantiation (stride fixed at compile time, pad 1, dilation 1)."""

    arch: int
    dtype: str
    stride: int
    pix: int = 2  # outputs along W per thread
    threads: int = 256
    kernel: int = 3
    epilogue: str = "bias"
    pass_: str = "fwd"

    op: ClassVar[str] = "dwconv"
    family: ClassVar[str] = "dwconv2d"

    layout: ClassVar[str] = "nhwc"

    def variant(self) -> str:
        return f"{self.epilogue}_k{self.kernel}_st{self.stride}_p{self.pix}_b{self.threads}"

    @classmethod
    def from_variant(cls, head: NameHead) -> DwConvSpec | None:
        return match_variant(head, _DW_VARIANT, None, lambda m: cls(
            head.arch, head.dtype, int(m["st"]), int(m["pix"]), int(m["thr"]), int(m["k"]), m["epi"], head.pass_))

    def validate(self) -> None:
        self.check_common()
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

    def instantiation(self) -> str:
        """The kernel's ``.cu``: operators/dwconv/dwconv.cuh with this spec's stride, outputs per
        thread, threads per block and filter size."""
        kernel = (f"DwConv<{CUTLASS_ELEMENT[self.dtype]}, /*Stride=*/{self.stride}, /*Pix=*/{self.pix}, "
                  f"/*Threads=*/{self.threads}, /*Kernel=*/{self.kernel}>")
        return instantiation_file(
            self, headers=("dwconv/dwconv.cuh",), body=f"using Kernel = {kernel};", abi="conv",
            description=f"depthwise {self.kernel}x{self.kernel} conv, stride {self.stride}, NHWC tokens -> NHWC "
                        f"tokens, + bias (folded BatchNorm); {self.dtype} in/out, fp32 weights and accumulation")


_DW_VARIANT = re.compile(r"(?P<epi>[a-z_]+?)_k(?P<k>\d+)_st(?P<st>\d+)_p(?P<pix>\d+)_b(?P<thr>\d+)")


def dwconv_candidates(dtype: str, stride: int, arch: int) -> list[DwConvSpec]:
    return [DwConvSpec(arch, dtype, stride, pix, thr) for pix in (1, 2, 4, 8) for thr in (128, 256)]


def dwconv_heuristic(dtype: str, stride: int, arch: int) -> DwConvSpec:
    return DwConvSpec(arch, dtype, stride, 2 if stride == 1 else 1, 256)


# ------------------------------------------------------------------------------------------
# Training: depthwise conv + BatchNorm with batch statistics, forward and backward
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DwConvBnSpec(KernelSpec):
    """Depthwise 3x3 conv (pad 1) + BatchNorm in training mode, one pass (``fwd`` or ``bwd``).

    ``pix``: forward, conv outputs per thread along W; backward, inputs per thread of its
    dgrad kernel (a multiple of the stride; its reducing kernels then take pix / stride outputs
    per item, the same input footprint). ``groups``: 8-channel groups per block of the
    reducing kernels (a block is ``groups`` x ``threads / groups`` (channels x pixels): threads
    with the same channels sum in registers, then warp shuffles, then warps in a fixed order).
    """

    arch: int
    dtype: str
    stride: int
    pix: int = 2
    groups: int = 8
    threads: int = 256
    pass_: str = "fwd"
    kv: DwConvBnSpec | None = None  # the k / v pair's shape where this library serves q, k and v

    op: ClassVar[str] = "dwconv"
    family: ClassVar[str] = "dwconv_bn"
    PASSES: ClassVar[tuple[str, ...]] = ("fwd", "bwd")

    layout: ClassVar[str] = "nhwc"

    def variant(self) -> str:
        own = f"bn_k3_st{self.stride}_p{self.pix}_g{self.groups}_b{self.threads}"
        if self.kv is None:
            return own
        return own + f"_kv_st{self.kv.stride}_p{self.kv.pix}_g{self.kv.groups}_b{self.kv.threads}"

    @classmethod
    def from_variant(cls, head: NameHead) -> DwConvBnSpec | None:
        def build(m):
            kv = None if m["kst"] is None else cls(head.arch, head.dtype, int(m["kst"]), int(m["kpix"]), int(m["kg"]),
                                                   int(m["kthr"]), head.pass_)
            return cls(head.arch, head.dtype, int(m["st"]), int(m["pix"]), int(m["g"]), int(m["thr"]), head.pass_, kv)
        return match_variant(head, _BN_VARIANT, None, build)

    def with_kv(self, kv: DwConvBnSpec) -> DwConvBnSpec:
        """The library that runs this spec's problem (q) and a k / v pair of ``kv``'s shape in one set of
        launches (validate's rules for a pair: another stride, the same arch, dtype and pass)."""
        if self.kv is not None:
            raise SpecError(f"{kv.name} cannot be the k / v pair of {self.name}: it has one")
        try:
            return DwConvBnSpec(self.arch, self.dtype, self.stride, self.pix, self.groups, self.threads, self.pass_, kv)
        except SpecError as e:
            raise SpecError(f"{kv.name} cannot be the k / v pair of {self.name}: {e}") from None

    def validate(self) -> None:
        self.check_common()
        if self.stride not in (1, 2):
            raise SpecError("depthwise stride must be 1 or 2")
        if self.pix not in (1, 2, 4, 8):
            raise SpecError("pix must be 1, 2, 4 or 8")
        if self.pass_ == "bwd" and (self.pix % self.stride or self.pix > 4):
            raise SpecError(f"the backward's pix (inputs per thread) must be a multiple of the stride and <= 4, "
                            f"got {self.pix} at stride {self.stride}")
        if self.groups not in (1, 2, 4, 8):
            raise SpecError("groups (8-channel groups per block) must be 1, 2, 4 or 8")
        if self.threads not in (64, 128, 256, 512):
            raise SpecError("threads per block must be 64, 128, 256 or 512")
        if self.kv is not None:
            self.kv.validate()
            if self.kv.kv is not None or (self.kv.arch, self.kv.dtype, self.kv.pass_) != (self.arch, self.dtype,
                                                                                          self.pass_):
                raise SpecError("a q / k / v library's pair shape has its arch, dtype and pass and no pair of its own")
            if self.kv.stride == self.stride:
                raise SpecError("a q / k / v library's two shapes have different strides")
            widest = max(self.threads, self.kv.threads)
            if self.pass_ == "bwd" and widest * 9 * (self.groups + self.kv.groups) > 48 * 1024:
                raise SpecError("a q / k / v backward's dz pass holds both shapes' dW sums in static shared "
                                "memory (threads x 9 x groups bytes each): more than 48 KiB")

    def _shape(self) -> str:
        template, knob = ("DwBnBwd", "In") if self.pass_ == "bwd" else ("DwBnFwd", "Pix")
        return (f"{template}<{CUTLASS_ELEMENT[self.dtype]}, /*Stride=*/{self.stride}, /*{knob}=*/{self.pix}, "
                f"/*Groups=*/{self.groups}, /*Threads=*/{self.threads}>")

    def instantiation(self) -> str:
        """The kernel's ``.cu``: operators/dwconv/dwbn_fwd.cuh (``DwBnFwd``, Pix = outputs per
        thread) or dwbn_bwd.cuh (``DwBnBwd``, In = inputs per thread of its dgrad kernel);
        with a k / v pair, ``DwBnFwdQkv`` / ``DwBnBwdQkv`` of the two shapes."""
        kernel, what = self._shape(), f"stride {self.stride}"
        if self.kv is not None:
            group = "DwBnBwdQkv" if self.pass_ == "bwd" else "DwBnFwdQkv"
            kernel = f"{group}<{kernel}, {self.kv._shape()}>"
            what = f"q at stride {self.stride} and a k / v pair at stride {self.kv.stride} in one set of launches"
        return instantiation_file(
            self, headers=(f"dwconv/dwbn_{self.pass_}.cuh",), body=f"using Kernel = {kernel};",
            abi="dwbnbwd" if self.pass_ == "bwd" else "dwbn",
            description=f"depthwise 3x3 conv (pad 1, {what}) + BatchNorm with batch statistics "
                        f"({self.pass_}) on NHWC tokens (cls rows passed through); {self.dtype} activations, "
                        "fp32 weights, statistics and accumulation")


_BN_VARIANT = re.compile(r"bn_k3_st(?P<st>\d+)_p(?P<pix>\d+)_g(?P<g>\d+)_b(?P<thr>\d+)"
                         r"(?:_kv_st(?P<kst>\d+)_p(?P<kpix>\d+)_g(?P<kg>\d+)_b(?P<kthr>\d+))?")


def _groups_for(channels: int) -> int:
    """The most 8-channel groups per block (<= 8) that split the channels evenly (no idle lanes)."""
    c8 = max(channels // 8, 1)
    return next(g for g in (8, 4, 2, 1) if c8 % g == 0)


def dwconv_bn_heuristic(dtype: str, channels: int, stride: int, arch: int, pass_: str = "fwd") -> DwConvBnSpec:
    """Forward: 2 outputs per thread at stride 1 (the shared input columns loaded once), 1 at
    stride 2, 256 threads. Backward: 2 inputs per thread, 128 threads (its dz pass
    keeps 9 taps x 8 channels of fp32 dW sums in registers). Channel groups: the most that divide C/8."""
    g = _groups_for(channels)
    if pass_ == "fwd":
        return DwConvBnSpec(arch, dtype, stride, 2 if stride == 1 else 1, g, 256, "fwd")
    return DwConvBnSpec(arch, dtype, stride, 2, g, 128, "bwd")


def dwconv_bn_candidates(dtype: str, channels: int, stride: int, arch: int, pass_: str) -> list[DwConvBnSpec]:
    """The sweep's space for one problem: pix x threads at the heuristic's channel groups."""
    g = _groups_for(channels)
    if pass_ == "fwd":
        return [DwConvBnSpec(arch, dtype, stride, pix, g, thr, "fwd") for pix in (1, 2, 4) for thr in (128, 256)]
    return [DwConvBnSpec(arch, dtype, stride, pix, g, thr, "bwd") for pix in (1, 2, 4) if pix % stride == 0
            for thr in (64, 128, 256)]

