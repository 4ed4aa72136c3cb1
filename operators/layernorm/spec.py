"""LayerNorm kernel specs: CvT's LayerNorms over the channels of its tokens (kernels:
operators/layernorm/layernorm_fwd.cuh, layernorm_bwd.cuh).

CvT runs a LayerNorm after every token embedding and two per block (before attention, before
the MLP): 29 of them in CvT-13, on (B, L, C) tokens with C = 64 / 192 / 384 (CvT-W24: 192 / 768
/ 1024). PyTorch's kernel spends one thread block per row, which for 64 channels is mostly idle
(21% of HF's CvT-13 forward at batch 256 on an H200, ``cvt-cutlass bench --op model
--breakdown``). :class:`LayerNormSpec` is our own kernel on CUTLASS's vector types: a group of
``lanes`` threads (a power of two, <= 32) owns one row, each thread holds C / (8 * lanes) 16-byte
vectors in registers, so a row is read once; mean and variance are two exact passes over the
registers (fp32, group shuffles), the output is written once. The channel count is a template
constant (one kernel per C), rows per block = threads / lanes.

The output can start with ``prefix_rows`` rows copied from a (P, C) tensor for every image: CvT's
cls token in front of stage 3's embedding tokens, written by the LayerNorm instead of a
``torch.cat``. Optionally the kernel stores (mean, rstd) per row for a backward pass.

With an fp32 residual stream (HF's CvT under autocast) the forward reads fp32 x (``io="xf32"``: a
layer's LayerNorm) or writes fp32 y and prefix rows (``io="yf32"``: an embedding's, which starts
the stream); the backward of the first reads fp32 x and the residual gradient and writes fp32 dx,
that of the second reads fp32 dy; the weights and their gradients stay in the 16-bit dtype. A
layer's backward may take its residual gradient in the 16-bit dtype beside fp32 x and dx
(``io="xf32r16"``: the gradient of a stage output the next embedding reads in 16 bits).

Names follow operators/spec.py: ``cvt_layernorm_<fwd|bwd>_<arch>_<dtype>_blc_c<C>_l<lanes>_b<threads>[_v4][_xf32|_yf32|_xf32r16]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from ..spec import CUTLASS_ELEMENT, KernelSpec, NameHead, SpecError, instantiation_file, match_variant

LN_MAX_VECS = 16  # 16-byte vectors per thread: C <= 16 * 8 * 32 = 4096
LN_BWD_MAX_VECS = 4  # the backward holds x, dy and two partial sums per channel: C <= 1024


@dataclass(frozen=True)
class LayerNormSpec(KernelSpec):
    """One LayerNorm instantiation: channels fixed at compile time, ``lanes`` threads per row."""

    arch: int
    dtype: str
    channels: int
    lanes: int
    threads: int = 256
    pass_: str = "fwd"
    vec: int = 8  # elements per vector load (8: 16 bytes; the backward may take 4: fewer registers)
    # the fp32 side: "" (none), "xf32" (x; dx and the residual gradient), "yf32" (y; dy) or, in the
    # backward, "xf32r16" (x and dx; the residual gradient in the 16-bit dtype)
    io: str = ""

    op: ClassVar[str] = "layernorm"
    family: ClassVar[str] = "layernorm"
    PASSES: ClassVar[tuple[str, ...]] = ("fwd", "bwd")

    layout: ClassVar[str] = "blc"

    def variant(self) -> str:
        return (f"c{self.channels}_l{self.lanes}_b{self.threads}" + ("" if self.vec == 8 else f"_v{self.vec}")
                + (f"_{self.io}" if self.io else ""))

    @classmethod
    def from_variant(cls, head: NameHead) -> LayerNormSpec | None:
        return match_variant(head, _LN_VARIANT, None, lambda m: cls(
            head.arch, head.dtype, int(m["c"]), int(m["l"]), int(m["b"]), head.pass_, int(m["v"] or 8), m["io"] or ""))

    @property
    def vecs(self) -> int:
        return self.channels // (self.vec * self.lanes)

    def validate(self) -> None:
        self.check_common()
        if self.lanes not in (1, 2, 4, 8, 16, 32):
            raise SpecError(f"lanes (threads per row) must be a power of two <= 32, got {self.lanes}")
        if self.threads not in (64, 128, 256, 512, 1024):
            raise SpecError(f"threads per block must be 64 ... 1024 (a power of two), got {self.threads}")
        c, v = self.channels, self.vec
        if self.io not in IOS:
            raise SpecError(f"io must be one of {IOS} (fp32 x or y), got {self.io!r}")
        if self.io == "xf32r16" and self.pass_ != "bwd":
            raise SpecError("io 'xf32r16' (a 16-bit residual gradient beside fp32 x) is the backward's")
        if v not in (4, 8) or (v == 4 and self.pass_ != "bwd"):
            raise SpecError(f"vector width must be 8 elements (4 in the backward), got {v}")
        if c <= 0 or c % 8 or c % (v * self.lanes):
            raise SpecError(f"channels {c} must be a positive multiple of 8 and of {v} * lanes = {v * self.lanes} "
                            f"({2 * v}-byte vectors spread evenly over the row's threads)")
        if self.pass_ == "bwd" and self.vecs > LN_BWD_MAX_VECS:
            raise SpecError(f"the backward holds at most {LN_BWD_MAX_VECS} vectors per thread (C <= "
                            f"{LN_BWD_MAX_VECS * v * self.lanes} with {self.lanes} lanes), got {self.vecs}")
        if self.vecs > LN_MAX_VECS:
            raise SpecError(f"channels {c} with {self.lanes} lanes is {self.vecs} vectors per thread "
                            f"(at most {LN_MAX_VECS}: more lanes, or C <= {LN_MAX_VECS * 8 * 32})")

    def instantiation(self) -> str:
        """The kernel's ``.cu``: operators/layernorm/layernorm_fwd.cuh or layernorm_bwd.cuh with
        this spec's channels, lanes, threads (and the backward's vector width)."""
        element = CUTLASS_ELEMENT[self.dtype]
        x = "float" if self.io in ("xf32", "xf32r16") else element
        y = "float" if self.io == "yf32" else element
        if self.pass_ == "bwd":
            res = f", {element}" if self.io == "xf32r16" else ""
            kernel = (f"LayerNormBwd<{element}, {self.channels}, {self.lanes}, {self.threads}, {self.vec}, {x}, {y}"
                      f"{res}>")
            what = "LayerNorm backward: dx, then dweight / dbias from per-block fp32 partials"
        else:
            kernel = f"LayerNormFwd<{element}, {self.channels}, {self.lanes}, {self.threads}, {x}, {y}>"
            what = "LayerNorm, optional prefix rows (cls token) in front of each image's output"
        return instantiation_file(
            self, headers=(f"layernorm/layernorm_{self.pass_}.cuh",), body=f"using Kernel = {kernel};",
            abi="normbwd" if self.pass_ == "bwd" else "norm",
            description=f"{what}; C = {self.channels}; {self._io_text()}, fp32 statistics")

    def _io_text(self) -> str:
        return {"": f"{self.dtype} x and y", "xf32": f"fp32 x, {self.dtype} y",
                "yf32": f"{self.dtype} x, fp32 y",
                "xf32r16": f"fp32 x, {self.dtype} y, {self.dtype} residual gradient"}[self.io]


IOS = ("", "xf32", "yf32", "xf32r16")
_LN_VARIANT = re.compile(r"c(?P<c>\d+)_l(?P<l>\d+)_b(?P<b>\d+)(?:_v(?P<v>4))?(?:_(?P<io>xf32r16|[xy]f32))?")


def channels_supported(c: int) -> bool:
    """Whether some LayerNorm instantiation takes ``c`` channels."""
    return c > 0 and c % 8 == 0 and c // 8 <= 32 * LN_MAX_VECS


def _lane_options(c: int) -> list[int]:
    return [ln for ln in (1, 2, 4, 8, 16, 32) if c % (8 * ln) == 0 and c // (8 * ln) <= LN_MAX_VECS]


def _bwd_options(c: int) -> list[tuple[int, int, int, int]]:
    """(channels per thread (at least 8), -vector, lanes, vector) of every backward split of the row."""
    return [(max(c // ln, 8), -v, ln, v) for ln in (1, 2, 4, 8, 16, 32) for v in (8, 4)
            if c % 8 == 0 and c % (v * ln) == 0 and c // (v * ln) <= LN_BWD_MAX_VECS]


def bwd_channels_supported(c: int) -> bool:
    """Whether some LayerNorm backward instantiation takes ``c`` channels (a multiple of 8 that
    splits into at most 4 vectors over at most 32 threads)."""
    return c > 0 and bool(_bwd_options(c))


def layernorm_heuristic(dtype: str, channels: int, arch: int, pass_: str = "fwd") -> LayerNormSpec:
    """Forward: the most lanes that divide the row evenly in 16-byte vectors (a 64-channel row:
    8 threads of one vector each; 384: 16 threads of 3; 1024: 32 threads of 4). Backward (it
    holds x, dy and two partial sums per channel in registers): the fewest channels per thread,
    at least 8, 8-byte vectors where 16-byte ones would not split the row (192: 16 threads of 3
    x 4; 384: 32 of 3 x 4). 256 threads per block."""
    if not channels_supported(channels):
        raise SpecError(f"no LayerNorm kernel for {channels} channels (a multiple of 8, at most "
                        f"{32 * LN_MAX_VECS * 8})")
    if pass_ != "bwd":
        return LayerNormSpec(arch, dtype, channels, max(_lane_options(channels)), 256, pass_)
    options = _bwd_options(channels)
    if not options:
        raise SpecError(f"no LayerNorm backward kernel for {channels} channels (at most {LN_BWD_MAX_VECS * 8 * 32})")
    _, _, lanes, vec = min(options)
    return LayerNormSpec(arch, dtype, channels, lanes, 256, pass_, vec)


def layernorm_candidates(dtype: str, channels: int, arch: int) -> list[LayerNormSpec]:
    """The sweep's space for one channel count: every even split of the row, 128-512 threads."""
    return [LayerNormSpec(arch, dtype, channels, ln, thr) for ln in _lane_options(channels)
            if ln >= 4 for thr in (128, 256, 512)]
