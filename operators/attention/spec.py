"""Fused multi-head attention kernel specs: the forward (with the logsumexp a backward needs) and
the backward (kernels: operators/attention/ex41_fwd.cuh, ex88_fwd.cuh, short_fwd.cuh, ex41_bwd.cuh,
ex88_bwd.cuh, short_bwd.cuh, wgmma_bwd.cuh; the backward passes they share in bwd_common.cuh).

Names follow operators/spec.py: ``cvt_attention_<fwd|bwd>_<arch>_<dtype>_blhd_<kernel>_<tile...>``.

:class:`AttnSpec` instantiates CUTLASS's example-41 kernel (``AttentionKernel`` from
``examples/41_fused_multi_head_attention/kernel_forward.h`` in the nvidia-cutlass wheel; ArchTag
Sm80: cp.async + mma.sync, runs on sm_89 and sm_90). It takes CvT's scale (``embed_dim ** -0.5``)
as a parameter, any Lq != Lkv, lengths that are not multiples of 8, and q/k/v in the layout the
projections write: (B, L, H, D) with unit stride along D, no permute copies. The output is
(B, Lq, H, D) packed, i.e. the (B, Lq, C) rows the out-projection reads; the logsumexp is
(B, H, Lq) float in rows padded to 32 (the kernel's layout).

Knobs: queries per block, keys per block, the largest head dim (``max_k``; when it is at most the
keys per block the output accumulates in registers).
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
    instantiation_file,
    match_variant,
    triple,
    xs,
)

EX41_DIR = "examples/41_fused_multi_head_attention"
# Our cuRAND stand-in (operators/attention/shim), searched after every other include directory.
CURAND_SHIM_DIR = "operators:attention/shim"
EX88_SMEM_LIMIT = 227 * 1024 - 2048  # sm_90's per-CTA limit less the pipeline barriers and epilogue staging
LSE_ALIGN = 32  # example 41 pads each (batch, head) logsumexp row to a multiple of 32


@dataclass(frozen=True)
class AttnSpec(KernelSpec):
    """One example-41 (Sm80-class) forward attention instantiation."""

    dtype: str
    queries: int = 64  # queries per block
    keys: int = 64  # keys per block
    max_k: int = 64  # largest head dim this instantiation serves
    arch: int = 89
    kernel: str = "ex41"
    pass_: str = "fwd"

    op: ClassVar[str] = "attention"
    family: ClassVar[str] = "attention"
    # The example's directory (relative to the CUTLASS source tree) and our cuRAND stand-in.
    include_dirs: ClassVar[tuple[str, ...]] = (EX41_DIR, CURAND_SHIM_DIR)

    layout: ClassVar[str] = "blhd"

    def variant(self) -> str:
        return f"{self.kernel}_q{self.queries}_k{self.keys}_d{self.max_k}_a8"

    @classmethod
    def from_variant(cls, head: NameHead) -> AttnSpec | None:
        return match_variant(head, _ATTN41_VARIANT, 89, lambda m: cls(
            head.dtype, int(m["q"]), int(m["k"]), int(m["d"]), 89, "ex41", head.pass_))

    def validate(self) -> None:
        if self.kernel != "ex41" or self.arch != 89:
            raise SpecError("AttnSpec is the example-41 (Sm80-class) kernel: kernel='ex41', arch=89")
        self.check_common()
        if self.queries not in (32, 64, 128) or self.keys not in (32, 64, 128):
            raise SpecError("queries and keys per block must be 32, 64 or 128")
        if self.max_k not in (64, 128, 256) or self.max_k % 8:
            raise SpecError("max_k (largest head dim) must be 64, 128 or 256")
        if self.queries * self.keys > 128 * 64:
            raise SpecError("queries x keys per block above 128 x 64 exceeds the kernel's shared-memory design")

    def serves(self, head_dim: int) -> bool:
        return head_dim <= self.max_k and head_dim % 8 == 0

    def instantiation(self) -> str:
        """The kernel's ``.cu``: operators/attention/ex41_fwd.cuh with this spec's block shape."""
        kernel = f"AttentionEx41Fwd<{CUTLASS_ELEMENT[self.dtype]}, {self.queries}, {self.keys}, {self.max_k}>"
        return instantiation_file(
            self, headers=("attention/ex41_fwd.cuh",), body=f"using Kernel = {kernel};", abi="attn",
            description=f"fused multi-head attention forward (CUTLASS example 41, Sm80-class), {self.dtype}, "
                        "fp32 softmax and accumulation")


EX88_DIR = "examples/88_hopper_fmha"
EX88_SCHEDULES = {
    "tma": "cutlass::gemm::KernelTma",
    "coop": "cutlass::gemm::KernelTmaWarpSpecializedCooperative",
    "pingpong": "cutlass::gemm::KernelTmaWarpSpecializedPingpong",
}


@dataclass(frozen=True)
class Attn88Spec(KernelSpec):
    """One example-88 (Hopper: TMA + wgmma) forward attention instantiation, sm_90a only.

    The example hard-codes the softmax scale to 1/sqrt(D) when it builds the kernel parameters; our
    launcher overwrites the two scale fields of those parameters afterwards, so CvT's
    ``embed_dim ** -0.5`` costs nothing (no pre-scaled copy of q, no change to the weights). The
    residual mask handles Lkv that is not a multiple of the KV tile. Lq may be any length: the
    example's own check asks Lq % 8 == 0, but with q/k/v/o rows of H*D elements (D % 8 == 0) every
    TMA stride is 16-byte aligned whatever Lq is; TMA zero-fills the rows past Lq on load and clips
    them on store, and the logsumexp store is predicated on Lq (``fmha_epilogue.hpp``), so our
    launcher checks the strides instead of the length.

    Knobs: the tile (queries, keys, head dim); the KV pipeline depth (``stages``, 0 = the example's
    4 or 5); the minimum CTAs per SM the non-warp-specialized kernel is compiled for (``blocks``,
    0 = the example's 2; more caps registers per thread). KV tiles are 64, 128 or 256: tiles fitted
    to CvT's lengths were measured on the H200 and lost (64x112 on Lkv = 784: 0.504 ms vs
    0.456 for 64x128; 64x80 on 196: 0.145 vs 0.139 for 64x64), and 64x160 computed wrong results
    (relative error ~1), so only the power-of-two widths the example itself uses are offered."""

    dtype: str
    tile: tuple[int, int, int] = (64, 128, 64)  # (queries, keys, head dim) per CTA
    schedule: str = "tma"
    stages: int = 0
    blocks: int = 0
    pass_: str = "fwd"

    arch: ClassVar[int] = 90
    kernel: ClassVar[str] = "ex88"
    op: ClassVar[str] = "attention"
    family: ClassVar[str] = "attention"
    include_dirs: ClassVar[tuple[str, ...]] = (EX88_DIR,)

    layout: ClassVar[str] = "blhd"

    def variant(self) -> str:
        opts = (f"_s{self.stages}" if self.stages else "") + (f"_b{self.blocks}" if self.blocks else "")
        return f"ex88_t{xs(self.tile)}_{self.schedule}{opts}_a8"

    @classmethod
    def from_variant(cls, head: NameHead) -> Attn88Spec | None:
        return match_variant(head, _ATTN88_VARIANT, 90, lambda m: cls(
            head.dtype, triple(m["t"]), m["s"], int(m["st"] or 0), int(m["bl"] or 0), head.pass_))

    def smem_bytes(self) -> int:
        """Estimated shared memory of the mainloop: the q tile(s) and the K/V stages."""
        tq, tk, td = self.tile
        ws = self.schedule != "tma"
        stages = self.stages or (5 if ws else 4)
        return 2 * (tq * td * (2 if ws else 1) + stages * tk * td)

    def validate(self) -> None:
        self.check_common()
        if self.schedule not in EX88_SCHEDULES:
            raise SpecError(f"example-88 schedule must be one of {sorted(EX88_SCHEDULES)}")
        tq, tk, td = self.tile
        if tq not in (64, 128) or tk not in (64, 128, 256) or td not in (32, 64, 128, 256):
            raise SpecError("example-88 tile: queries 64/128, keys 64/128/256, head dim 32-256")
        if self.schedule == "tma" and tq != 64:
            raise SpecError("the non-warp-specialized example-88 kernel takes 64 queries per CTA")
        if self.schedule != "tma" and tq != 128:
            raise SpecError("the warp-specialized example-88 kernels take 128 queries per CTA")
        if self.stages and not 2 <= self.stages <= 8:
            raise SpecError(f"example-88 KV stages must be 2-8, got {self.stages}")
        if self.blocks and (self.schedule != "tma" or not 1 <= self.blocks <= 4):
            raise SpecError("blocks per SM (1-4) is a knob of the non-warp-specialized (tma) kernel only")
        if self.smem_bytes() > EX88_SMEM_LIMIT:
            raise SpecError(f"{self.name}: ~{self.smem_bytes() // 1024} KiB of shared memory, over the "
                            f"{EX88_SMEM_LIMIT // 1024} KiB an sm_90 CTA can have; use fewer stages")

    def serves(self, head_dim: int, lq: int = 1) -> bool:
        return head_dim <= self.tile[2] and head_dim % 8 == 0

    def options(self) -> list[str]:
        """The example's kernel options this spec sets (none: the example's defaults)."""
        option = "cutlass::fmha::kernel::Option<cutlass::fmha::kernel::Tag::{}, cute::Int<{}>>"
        return ([option.format("kStagesKV", self.stages)] if self.stages else []) + (
            [option.format("kBlocksPerSM", self.blocks)] if self.blocks else [])

    def instantiation(self) -> str:
        """The kernel's ``.cu``: operators/attention/ex88_fwd.cuh with this spec's tile, schedule and
        options."""
        tq, tk, td = self.tile
        args = [f"{CUTLASS_ELEMENT[self.dtype]}, {tq}, {tk}, {td}, {EX88_SCHEDULES[self.schedule]}", *self.options()]
        body = "using Kernel = AttentionEx88Fwd<" + ",\n    ".join(args) + ">;"
        return instantiation_file(
            self, headers=("attention/ex88_fwd.cuh",), body=body, abi="attn",
            description=f"fused multi-head attention forward (CUTLASS example 88, Hopper TMA + wgmma), {self.dtype}, "
                        "fp32 softmax and accumulation")


class _ShortKeys:
    """What the short-key kernels' specs share (operators/attention/short_common.cuh: every key of
    a (batch, head) in one CTA): their limits, their name (``skv64_d64_b<blocks>``) and where
    they serve."""

    arch: ClassVar[int] = 89
    kernel: ClassVar[str] = "skv"
    layout: ClassVar[str] = "blhd"
    MAX_KEYS: ClassVar[int] = 64
    MAX_HEAD_DIM: ClassVar[int] = 64

    def variant(self) -> str:
        return f"skv{self.MAX_KEYS}_d{self.MAX_HEAD_DIM}_b{self.blocks}_a8"

    @classmethod
    def from_variant(cls, head: NameHead):
        return match_variant(head, _ATTN_SHORT_VARIANT, 89, lambda m: cls(head.dtype, int(m["b"]), head.pass_))

    def serves(self, head_dim: int, lkv: int | None = None) -> bool:
        """Head dims up to 64 (multiples of 8); key lengths up to 64 (None: not checked)."""
        return head_dim <= self.MAX_HEAD_DIM and head_dim % 8 == 0 and (lkv is None or lkv <= self.MAX_KEYS)

    # Each spec class sets: its C++ template and header (operators/attention/), its ABI, the CTA
    # budgets it takes (and how an error says them), and what its description adds.
    _TEMPLATE: ClassVar[str]
    _ABI: ClassVar[str]
    _BLOCKS: ClassVar[tuple[int, ...]]
    _BLOCKS_SAID: ClassVar[str]
    _DOES: ClassVar[str]

    def validate(self) -> None:
        self.check_common()
        if self.blocks not in self._BLOCKS:
            raise SpecError(f"short-key {self._pass_said}: {self._BLOCKS_SAID} CTAs per SM, got {self.blocks}")

    @property
    def _pass_said(self) -> str:
        return "forward" if self.pass_ == "fwd" else "backward"

    def instantiation(self) -> str:
        """The kernel's ``.cu``: its header (short_fwd.cuh / short_bwd.cuh) with this spec's element
        type and CTA budget."""
        kernel = f"{self._TEMPLATE}<{CUTLASS_ELEMENT[self.dtype]}, {self.blocks}>"
        header = "attention/short_fwd.cuh" if self.pass_ == "fwd" else "attention/short_bwd.cuh"
        return instantiation_file(
            self, headers=(header,), body=f"using Kernel = {kernel};", abi=self._ABI,
            description=f"fused multi-head attention {self._pass_said} for short keys (Lkv <= 64, ours, mma.sync), "
                        f"{self.dtype}, {self._DOES}")


_ATTN_SHORT_VARIANT = re.compile(r"skv64_d64_b(?P<b>\d+)_a8")


@dataclass(frozen=True)
class AttnShortSpec(_ShortKeys, KernelSpec):
    """The short-key attention forward (operators/attention/short_fwd.cuh, ours; mma.sync, runs on
    sm_89 and sm_90): Lkv <= 64 and head dim <= 64 (CvT-13's stage 3: Lq 197, Lkv 50). Each CTA
    takes 64 queries of one (batch, head) with every key and value in shared memory: the softmax
    sees whole rows, and no key tile is mostly padding (example 88's smallest is 64 x 64, example
    41's 32 x 64 with a running rescale). Knob: the CTAs per SM the registers are budgeted for."""

    dtype: str
    blocks: int = 4
    pass_: str = "fwd"

    op: ClassVar[str] = "attention"  # on the class itself: it registers the name grammar
    family: ClassVar[str] = "attention"
    _TEMPLATE: ClassVar[str] = "AttentionShortFwd"
    _ABI: ClassVar[str] = "attn"
    _BLOCKS: ClassVar[tuple[int, ...]] = (2, 3, 4)
    _BLOCKS_SAID: ClassVar[str] = "2 to 4"
    _DOES: ClassVar[str] = "fp32 softmax and accumulation"


_ATTN88_VARIANT = re.compile(r"ex88_t(?P<t>\d+x\d+x\d+)_(?P<s>tma|coop|pingpong)(?:_s(?P<st>\d+))?(?:_b(?P<bl>\d+))?_a8")
_ATTN41_VARIANT = re.compile(r"ex41_q(?P<q>\d+)_k(?P<k>\d+)_d(?P<d>\d+)_a8")


_EX41_SPACE = ((64, 64), (32, 64), (64, 128), (32, 128), (128, 64))
_SHORT_FWD_BLOCKS = (4,)


_EX88_SPACE = (((64, 128, 64), "tma"), ((64, 64, 64), "tma"), ((64, 256, 64), "tma"),
               ((128, 64, 64), "coop"), ((128, 128, 64), "coop"), ((128, 64, 64), "pingpong"))


def attn_candidates(dtype: str, head_dim: int, arch: int = 89, lkv: int | None = None) -> list:
    """Example-41 instantiations on both paths; on the sm90 path also example-88's; the short-key
    forward's where it serves (key length None: any)."""
    max_k = 64 if head_dim <= 64 else (128 if head_dim <= 128 else 256)
    out = [AttnSpec(dtype, q, k, max_k) for q, k in _EX41_SPACE if q * k <= 128 * 64]
    if arch == 90 and head_dim <= 64:
        out += [Attn88Spec(dtype, t, s) for t, s in _EX88_SPACE]
    return out + [s for s in (AttnShortSpec(dtype, b) for b in _SHORT_FWD_BLOCKS) if s.serves(head_dim, lkv)]


def attn_heuristic(dtype: str, head_dim: int, lq: int, arch: int = 89, lkv: int | None = None):
    """Before a sweep: on the sm90 path example 88's TMA kernel where it applies, 64 x 64 for keys up
    to 64 (faster there than the short-key forward on CvT-13's stage 3: profiles/NOTES.md) and
    64 x 128 otherwise (the best tile of the example's own runner on an H200 for stage 1); on the
    sm89 path the short-key forward where it serves (faster there than example 41), example 41
    otherwise."""
    short = lkv is not None and AttnShortSpec(dtype).serves(head_dim, lkv)
    if arch == 90 and head_dim <= 64 and head_dim % 8 == 0:
        return Attn88Spec(dtype, (64, 64, 64) if short else (64, 128, 64), "tma")
    if short:
        return AttnShortSpec(dtype)
    max_k = 64 if head_dim <= 64 else (128 if head_dim <= 128 else 256)
    return AttnSpec(dtype, 64 if lq >= 64 else 32, 64, max_k)


# ----------------------------------------------------------------------------- backward specs
@dataclass(frozen=True)
class AttnBwdSpec(KernelSpec):
    """One example-41 (Sm80-class) attention backward instantiation: runs on sm_89 and sm_90.

    Our driver runs the example's per-block work (``processBlockIJ``) after one rowsum(dout * o)
    pass of ours, so the key splits (enough blocks to fill the GPU; dq summed in fp32 across
    them) do not each recompute it. Knobs: queries and keys per block, the largest head dim."""

    dtype: str
    queries: int = 64
    keys: int = 64
    max_k: int = 64
    pass_: str = "bwd"

    arch: ClassVar[int] = 89
    kernel: ClassVar[str] = "ex41"
    DETERMINISTIC: ClassVar[bool] = True  # dq summed in key order when the launch asks (one key split)
    op: ClassVar[str] = "attention"
    family: ClassVar[str] = "attention_bwd"
    PASSES: ClassVar[tuple[str, ...]] = ("bwd",)
    include_dirs: ClassVar[tuple[str, ...]] = (EX41_DIR, CURAND_SHIM_DIR)
    layout: ClassVar[str] = "blhd"

    def variant(self) -> str:
        return f"ex41_q{self.queries}_k{self.keys}_d{self.max_k}_a8"

    @classmethod
    def from_variant(cls, head: NameHead) -> AttnBwdSpec | None:
        return match_variant(head, _ATTN41_VARIANT, 89, lambda m: cls(
            head.dtype, int(m["q"]), int(m["k"]), int(m["d"]), head.pass_))

    def validate(self) -> None:
        self.check_common()
        if self.queries not in (64, 128) or self.keys not in (64, 128):
            raise SpecError("backward queries and keys per block must be 64 or 128")
        if self.max_k not in (64, 128, 256):
            raise SpecError("max_k (largest head dim) must be 64, 128 or 256")

    def serves(self, head_dim: int) -> bool:
        return head_dim <= self.max_k and head_dim % 8 == 0

    def instantiation(self) -> str:
        """The kernel's ``.cu``: operators/attention/ex41_bwd.cuh with this spec's block shape."""
        kernel = f"AttentionEx41Bwd<{CUTLASS_ELEMENT[self.dtype]}, {self.queries}, {self.keys}, {self.max_k}>"
        return instantiation_file(
            self, headers=("attention/ex41_bwd.cuh",), body=f"using Kernel = {kernel};", abi="attnbwd",
            description=f"fused multi-head attention backward (CUTLASS example 41, Sm80-class), {self.dtype}, "
                        "fp32 accumulation: dq, dk, dv from q, k, v, o, dout and the forward's logsumexp")


@dataclass(frozen=True)
class AttnShortBwdSpec(_ShortKeys, KernelSpec):
    """The short-key attention backward (operators/attention/short_bwd.cuh, ours; mma.sync, runs on
    sm_89 and sm_90): Lkv <= 64 and head dim <= 64 (CvT-13's stage 3: Lq 197, Lkv 50). One CTA
    per (batch, head) holds all keys and values and walks the queries 64 at a time: dq written
    once per row, dk and dv summed in registers, no atomics, no workspace, no rowsum(dout * o)
    pass (every key is in the CTA: delta = rowsum(P * dP)); deterministic. Knob: the CTAs per SM
    the registers are budgeted for (2 or 3)."""

    dtype: str
    blocks: int = 2
    pass_: str = "bwd"

    op: ClassVar[str] = "attention"  # on the class itself: it registers the name grammar
    family: ClassVar[str] = "attention_bwd"
    PASSES: ClassVar[tuple[str, ...]] = ("bwd",)
    DETERMINISTIC: ClassVar[bool] = True  # every key in one CTA: no sum across CTAs

    _TEMPLATE: ClassVar[str] = "AttentionShortBwd"
    _ABI: ClassVar[str] = "attnbwd"
    _BLOCKS: ClassVar[tuple[int, ...]] = (2, 3)
    _BLOCKS_SAID: ClassVar[str] = "2 or 3"
    _DOES: ClassVar[str] = "fp32 accumulation: dq, dk, dv from q, k, v, dout and the forward's logsumexp"




class _HopperReduceAddBwd:
    """What the sm90 backward specs share (example 88's, our wgmma one): sm_90a only, one pass,
    (B, L, H, D) tensors, dq reduce-added across CTAs (example 88's in the order CTAs arrive:
    refused in deterministic mode; ours in key-block order when the launch asks)."""

    arch: ClassVar[int] = 90
    DETERMINISTIC: ClassVar[bool] = False
    family: ClassVar[str] = "attention_bwd"
    PASSES: ClassVar[tuple[str, ...]] = ("bwd",)
    layout: ClassVar[str] = "blhd"


@dataclass(frozen=True)
class Attn88BwdSpec(_HopperReduceAddBwd, KernelSpec):
    """One example-88 (Hopper) attention backward instantiation, sm_90a only, fp16 and bf16.

    The example ships this mainloop for fp16 only; our copy of it (operators/attention/ex88/)
    converts one float expression to the element type explicitly, so bf16 compiles too (tested
    against float64 on the GPU). Our launcher
    runs its own rowsum(dout * o) pass (fp32 products), zeroes the fp32 dq buffer, runs the
    example's kernel with CvT's scale written into its parameters (the example derives
    1/sqrt(D)), and converts dq with its own pass into the caller's strides. Each CTA owns
    ``tile[1]`` keys (two math warpgroups of half each) and walks the queries ``tile[0]`` at a
    time; dk and dv are stored by TMA, dq is reduce-added by TMA (fp32 atomics: not bitwise
    deterministic, like cuDNN's and flash-attention's backward)."""

    dtype: str
    tile: tuple[int, int, int] = (64, 128, 64)  # (queries, keys, head dim) per CTA
    pass_: str = "bwd"

    kernel: ClassVar[str] = "ex88"
    op: ClassVar[str] = "attention"  # on the class itself: it registers the name grammar
    include_dirs: ClassVar[tuple[str, ...]] = (EX88_DIR,)

    def variant(self) -> str:
        return f"ex88_t{xs(self.tile)}_coop_a8"

    @classmethod
    def from_variant(cls, head: NameHead) -> Attn88BwdSpec | None:
        return match_variant(head, _ATTN88_BWD_VARIANT, 90, lambda m: cls(head.dtype, triple(m["t"]), head.pass_))

    def validate(self) -> None:
        self.check_common()
        tq, tk, td = self.tile
        if tq not in (64, 128) or tk != 128 or td not in (32, 64, 128):
            raise SpecError("example-88 backward tile: queries 64/128, keys 128 (two warpgroups of 64), "
                            "head dim 32/64/128")

    def serves(self, head_dim: int, lq: int = 1) -> bool:
        return head_dim <= self.tile[2] and head_dim % 8 == 0

    def instantiation(self) -> str:
        """The kernel's ``.cu``: operators/attention/ex88_bwd.cuh (example 88's mainloop, our copy
        with its bf16 fix: operators/attention/ex88/) with this spec's tile."""
        kernel = f"AttentionEx88Bwd<{CUTLASS_ELEMENT[self.dtype]}, {', '.join(map(str, self.tile))}>"
        return instantiation_file(
            self, headers=("attention/ex88_bwd.cuh",), body=f"using Kernel = {kernel};", abi="attnbwd",
            description=f"fused multi-head attention backward (CUTLASS example 88's Hopper mainloop: TMA + wgmma, "
                        f"warp-specialized), {self.dtype}, fp32 accumulation")


@dataclass(frozen=True)
class AttnWgmmaBwdSpec(_HopperReduceAddBwd, KernelSpec):
    """The Hopper attention backward written here (operators/attention/wgmma_bwd.cuh, ours: wgmma,
    sm_90a only), head dim 64, fp16 and bf16, for key lengths above the short-key kernel's (CvT's
    stages 1 and 2). Each CTA owns 128 keys (two math warpgroups of 64, and a producer warpgroup
    whose first warp loads the query blocks; in deterministic mode its second adds dq) and walks
    the queries 64 at a time on transposed scores, so P^T and dS^T feed the dv / dk GEMMs from
    registers; the math warpgroups split dq's queries, each over all the CTA's keys (no warpgroup
    does more MMA work than another); dq is reduce-added into an fp32 buffer by bulk copies, in
    the order CTAs reach a query block or, when the launch asks to be deterministic, in key-block
    order (a turn counter per query block and half). Around it: the examples' rowsum(dout * o)
    pass with the lse padded and the dq buffer zeroed, and our dq pass (the buffer holds dq in the
    accumulator's order).
    (64 keys a CTA, two CTAs an SM, measured slower on the H100: 0.825 against 0.778 ms on stage 1
    at batch 128, 2026-11-28; profiles/NOTES.md.)"""

    dtype: str
    pass_: str = "bwd"

    kernel: ClassVar[str] = "wgmma"
    op: ClassVar[str] = "attention"  # on the class itself: it registers the name grammar
    DETERMINISTIC: ClassVar[bool] = True  # dq summed in key-block order when the launch asks
    KEYS: ClassVar[int] = 128
    QUERIES: ClassVar[int] = 64
    HEAD_DIM: ClassVar[int] = 64

    def variant(self) -> str:
        return f"wgmma_k{self.KEYS}_q{self.QUERIES}_d{self.HEAD_DIM}_a8"

    @classmethod
    def from_variant(cls, head: NameHead) -> AttnWgmmaBwdSpec | None:
        return match_variant(head, _ATTN_WGMMA_BWD_VARIANT, 90, lambda m: cls(head.dtype, head.pass_))

    def validate(self) -> None:
        self.check_common()

    def serves(self, head_dim: int, lkv: int | None = None) -> bool:
        """Head dim 64 only (its shared-memory rows are 128 bytes); any key length."""
        return head_dim == self.HEAD_DIM

    def instantiation(self) -> str:
        """The kernel's ``.cu``: operators/attention/wgmma_bwd.cuh with this spec's element type."""
        kernel = f"AttentionWgmmaBwd<{CUTLASS_ELEMENT[self.dtype]}>"
        return instantiation_file(
            self, headers=("attention/wgmma_bwd.cuh",), body=f"using Kernel = {kernel};", abi="attnbwd",
            description=f"fused multi-head attention backward (ours: Hopper wgmma, {self.KEYS} keys per CTA), {self.dtype}, "
                        "fp32 accumulation: dq, dk, dv from q, k, v, o, dout and the forward's logsumexp")


_ATTN_WGMMA_BWD_VARIANT = re.compile(r"wgmma_k128_q64_d64_a8")


# The example-88 backward mainloop (path under EX88_DIR) and our copy of it (path under operators/),
# which ex88_bwd.cuh includes instead: the copy's header comment says what differs and why.
EX88_BWD_MAINLOOP = "collective/fmha_collective_bwd_tma_warpspecialized.hpp"
EX88_BWD_MAINLOOP_COPY = "attention/ex88/fmha_collective_bwd_tma_warpspecialized.hpp"


_ATTN88_BWD_VARIANT = re.compile(r"ex88_t(?P<t>\d+x\d+x\d+)_coop_a8")
_EX41_BWD_SPACE = ((64, 64), (64, 128), (128, 64), (128, 128))
_EX88_BWD_QUERIES = (64, 128)
_SHORT_BWD_BLOCKS = (2, 3)


def _max_k(head_dim: int) -> int:
    return 64 if head_dim <= 64 else (128 if head_dim <= 128 else 256)


def attn_bwd_candidates(dtype: str, head_dim: int, arch: int = 89, lkv: int | None = None) -> list:
    """Backward instantiations for a head dim (and key length: None for any): example 41's on both
    paths, example 88's on sm90, the short-key kernel's where it serves."""
    out: list = [AttnBwdSpec(dtype, q, k, _max_k(head_dim)) for q, k in _EX41_BWD_SPACE]
    if arch == 90 and head_dim <= 128:
        td = 32 if head_dim <= 32 else (64 if head_dim <= 64 else 128)
        out += [Attn88BwdSpec(dtype, (tq, 128, td)) for tq in _EX88_BWD_QUERIES]
    if arch == 90 and AttnWgmmaBwdSpec(dtype).serves(head_dim):
        out.append(AttnWgmmaBwdSpec(dtype))
    short = [AttnShortBwdSpec(dtype, b) for b in _SHORT_BWD_BLOCKS]
    return out + [s for s in short if s.serves(head_dim, lkv)]


def attn_bwd_heuristic(dtype: str, head_dim: int, arch: int = 89, lkv: int | None = None):
    """Before a sweep: the short-key kernel where it serves (Lkv <= 64, head dim <= 64: every key
    in one CTA); on the sm90 path our wgmma kernel for head dim 64 (faster than example 88's on
    CvT's stages 1 and 2: profiles/NOTES.md), example 88's 64x128 tile for other head dims up to
    128; example 41's 64x64 block otherwise (the examples' own choices for head dim 64)."""
    if lkv is not None and AttnShortBwdSpec(dtype).serves(head_dim, lkv):
        return AttnShortBwdSpec(dtype)
    if arch == 90 and AttnWgmmaBwdSpec(dtype).serves(head_dim):
        return AttnWgmmaBwdSpec(dtype)
    cands = attn_bwd_candidates(dtype, head_dim, arch)
    return cands[len(_EX41_BWD_SPACE)] if arch == 90 and head_dim <= 128 else cands[0]
