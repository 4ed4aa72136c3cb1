"""The kernel-spec base: one kernel-name grammar for every op family, and its parser.

Every kernel cvt_cutlass emits has one procedural name, used for its ``.cu`` file, its cache
entry, its profile rows, its selection-table rows and its error messages::

    cvt_<op>_<pass>_<arch>_<dtype>_<layout>_<variant>

========  ======================================================================================
op        linear | conv2d | dwconv | attention | layernorm (the op file that serves it)
pass      fwd | dgrad | wgrad | bwd (forward; gradient of the input; of the weight; a fused
          backward that computes several gradients)
arch      sm89 (SM80-class: cp.async + mma.sync, tiles within sm_89's 99 KB; built for the GPU
          that runs it) | sm90a (TMA + wgmma, sm_90a only)
dtype     f16 | bf16 (activations; fp32 accumulation everywhere)
layout    the operands' layout: ``tn`` (GEMM: x (M, K) row-major, W (N, K) as nn.Linear stores
          it), ``nhwc`` (convs on tokens), ``blhd`` (attention q/k/v (B, L, H, D)), ``blc``
          (LayerNorm rows (B, L, C))
variant   the family's own knobs (epilogue, tile, cluster, stages, schedule, ...): each family
          writes it (``variant()``) and reads it back (``from_variant``)
========  ======================================================================================

e.g. ``cvt_linear_fwd_sm90a_f16_tn_bias_gelu_t128x256x64_c1x1x1_sauto_coop_rh1_a8``.
:func:`parse_kernel_name` reads the common head once and hands the variant to the family
registered for the op, so a new pass of an existing family (the backward GEMMs) needs no new
parser. Shared vocabulary (dtypes, CUTLASS element types, the SM80-class tile checks) lives
here too.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from dataclasses import dataclass
from typing import ClassVar

DTYPES = ("fp16", "bf16")
CUTLASS_ELEMENT = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}
DT_TAG = {"fp16": "f16", "bf16": "bf16"}
DT_FROM_TAG = {v: k for k, v in DT_TAG.items()}
ARCH_TAG = {89: "sm89", 90: "sm90a"}
PASSES = ("fwd", "dgrad", "wgrad", "bwd")
SM89_SMEM_BYTES = 99 * 1024  # max dynamic shared memory per block on sm_86/sm_89

# Modules that define spec families (imported on the first parse so that they register).
FAMILY_MODULES = ("linear", "linear_wgrad", "conv2d", "dwconv", "attention", "layernorm")

_HEAD = re.compile(
    r"cvt_(?P<op>[a-z0-9]+)_(?P<pass>" + "|".join(PASSES) + r")_(?P<arch>sm89|sm90a)"
    r"_(?P<dt>f16|bf16)_(?P<layout>[a-z0-9]+)_(?P<variant>.+)"
)
_REGISTRY: dict[str, list[type]] = {}


class SpecError(ValueError):
    """A kernel spec that CUTLASS cannot instantiate, or a name that is not one; the message
    names the rule."""


@dataclass(frozen=True)
class NameHead:
    """The common part of a kernel name."""

    op: str
    pass_: str
    arch: int
    dtype: str
    layout: str
    variant: str


def split_name(name: str) -> NameHead:
    m = _HEAD.fullmatch(name)
    if not m:
        raise SpecError(f"not a cvt_cutlass kernel name: {name!r} (expected "
                        "cvt_<op>_<pass>_<arch>_<dtype>_<layout>_<variant>)")
    arch = 90 if m["arch"] == "sm90a" else 89
    return NameHead(m["op"], m["pass"], arch, DT_FROM_TAG[m["dt"]], m["layout"], m["variant"])


def parse_kernel_name(name: str):
    """The spec a kernel name stands for, whatever its family (raises SpecError otherwise)."""
    head = split_name(name)
    for mod in FAMILY_MODULES:
        importlib.import_module(f"{__package__}.{mod}")
    families = _REGISTRY.get(head.op)
    if not families:
        raise SpecError(f"{name!r}: unknown op {head.op!r}; have {sorted(_REGISTRY)}")
    passes = sorted({p for cls in families for p in cls.PASSES})
    if head.pass_ not in passes:
        raise SpecError(f"{name!r}: the {head.op} family instantiates the passes {passes}, not {head.pass_!r}")
    for cls in families:
        if head.pass_ not in cls.PASSES:
            continue
        spec = cls.from_variant(head)
        if spec is not None and spec.name == name:
            return spec
    raise SpecError(f"{name!r}: not a valid {head.op} {head.pass_} kernel variant ({head.variant!r})")


class KernelSpec:
    """Base of the frozen spec dataclasses of every op family.

    A family sets ``op`` (and ``PASSES``, the passes it instantiates), has ``arch``, ``dtype`` and
    ``pass_`` attributes (fields or class constants), and implements ``layout``, ``variant()``
    and ``from_variant(head)``; the name, its parse and the common checks come from here.
    """

    op: ClassVar[str]
    family: ClassVar[str]
    PASSES: ClassVar[tuple[str, ...]] = ("fwd",)
    ARCHS: ClassVar[tuple[int, ...]] = (89, 90)
    abi_headers: ClassVar[tuple[str, ...]] = ("cvt_kernel_abi.h",)
    include_dirs: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        raise NotImplementedError

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "op" in cls.__dict__:
            _REGISTRY.setdefault(cls.op, []).append(cls)

    @property
    def layout(self) -> str:
        raise NotImplementedError

    def variant(self) -> str:
        raise NotImplementedError

    @classmethod
    def from_variant(cls, head: NameHead):
        """The spec of this family that ``head`` names, or None if it is not one of ours."""
        raise NotImplementedError

    @property
    def name(self) -> str:
        return (f"cvt_{self.op}_{self.pass_}_{ARCH_TAG[self.arch]}_{DT_TAG[self.dtype]}_{self.layout}_"
                f"{self.variant()}")

    @property
    def min_cc(self) -> int:
        return 90 if self.arch == 90 else 80

    def with_(self, **kw):
        return dataclasses.replace(self, **kw)

    def check_common(self) -> None:
        """The checks every family shares: arch, dtype, pass."""
        if self.arch not in self.ARCHS:
            raise SpecError(f"{self.op} arch must be one of {self.ARCHS}, got {self.arch}")
        if self.dtype not in DTYPES:
            raise SpecError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.pass_ not in self.PASSES:
            raise SpecError(f"{type(self).__name__} instantiates the passes {self.PASSES}, not {self.pass_!r}")


# ----------------------------------------------------------------------------- name pieces
def triple(s: str) -> tuple[int, int, int]:
    """'128x64x32' -> (128, 64, 32)."""
    a, b, c = (int(v) for v in s.split("x"))
    return (a, b, c)


def xs(t) -> str:
    """(128, 64, 32) -> '128x64x32'."""
    return "x".join(map(str, t))


# ----------------------------------------------------------------------------- SM80-class checks
def sm80_mainloop_smem_bytes(tile: tuple[int, int, int], stages: int) -> int:
    """Shared memory of an SM80-class multistage mainloop with 16-bit operands (A and B tiles,
    all stages): what has to fit sm_89's 99 KB."""
    tm, tn, tk = tile
    return stages * (tm + tn) * tk * 2


def check_sm80_warps(tile: tuple[int, int, int], warps: tuple[int, int, int]) -> None:
    """The warp layout of an SM80-class (mma.sync 16x8x16) tile."""
    tm, tn, _ = tile
    wm, wn, wk = warps
    if wk != 1 or tm % wm or tn % wn:
        raise SpecError("warps must split the tile evenly along M and N (warps K = 1)")
    warp_m, warp_n = tm // wm, tn // wn
    if warp_m % 16 or warp_n % 8 or warp_m < 16 or warp_n < 16:
        raise SpecError(f"warp tile {warp_m}x{warp_n} does not fit the 16x8x16 mma")


def check_sm80_stages(name: str, tile: tuple[int, int, int], stages: int) -> None:
    """An SM80-class multistage mainloop: at least 2 stages, all of them within sm_89's shared memory."""
    if stages < 2:
        raise SpecError("the SM80-class path needs stages >= 2")
    smem = sm80_mainloop_smem_bytes(tile, stages)
    if smem > SM89_SMEM_BYTES:
        raise SpecError(f"{name}: mainloop needs {smem} B of shared memory, sm_89 allows {SM89_SMEM_BYTES}")
