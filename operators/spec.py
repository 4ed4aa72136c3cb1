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

A spec instantiates its family's kernel template (real ``.cuh`` headers in ``operators/<family>/``)
with :meth:`KernelSpec.instantiation`: the text of one small ``.cu`` translation unit that
includes the header, sets the template's parameters and defines the four ``extern "C"`` entry
points of the family's ABI (:func:`instantiation_file`).
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
FAMILY_MODULES = ("linear", "conv2d", "dwconv", "attention", "layernorm")

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
    # Extra include directories of the kernel's translation unit: relative to the CUTLASS source
    # tree ("examples/41_fused_multi_head_attention"), or "operators:<dir>" for a directory of
    # ours searched after every other (a shim header).
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

    def instantiation(self) -> str:
        """The complete ``.cu`` source of this kernel: its family's template instantiated
        (:func:`instantiation_file`)."""
        raise NotImplementedError

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
def match_variant(head: NameHead, pattern: re.Pattern, arch: int | None, build):
    """``build(match)`` when ``head``'s variant matches ``pattern`` (and its arch is ``arch``, when
    given): what a family's ``from_variant`` returns; None otherwise."""
    m = pattern.fullmatch(head.variant)
    return build(m) if m and (arch is None or head.arch == arch) else None


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


def check_sm80_tile(name: str, tile: tuple[int, int, int], warps: tuple[int, int, int], stages: int,
                    tile_k: tuple[int, ...] = (32, 64)) -> None:
    """An SM80-class (mma.sync 16x8x16, multistage) tile: its warp layout, its K among ``tile_k``
    (what the family's iterators were instantiated and checked with) and its stages."""
    check_sm80_warps(tile, warps)
    if tile[2] not in tile_k:
        raise SpecError(f"{name}: tile K must be one of {', '.join(map(str, tile_k))}")
    check_sm80_stages(name, tile, stages)


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


# ----------------------------------------------------------------------------- instantiation
# The ABIs whose argument struct carries a `defer` list of column sums (common/abi.h): their
# libraries also export cvt_colsum_flush, the one launch that sums a list.
DEFERRING_ABIS = frozenset({"gemm", "wgrad", "normbwd", "dwbnbwd"})


def instantiation_file(spec: KernelSpec, *, headers: tuple[str, ...], body: str, description: str,
                       abi: str, defines: tuple[str, ...] = ()) -> str:
    """The ``.cu`` translation unit of one kernel: ``defines`` (macros the headers read), the
    family's ``headers`` (paths under ``operators/``), ``body`` (C++ in ``namespace cvt_kernel``
    that ends with ``using Kernel = <template><...>;``) and the ``extern "C"`` entry points of the
    ABI ``cvt_<abi>_*`` (``cvt_<abi>_args``, operators/<family>/abi.h) that call ``Kernel``."""
    args = f"cvt_{abi}_args"
    k = "cvt_kernel::Kernel"
    lines = [f"// Generated by cvt_cutlass for kernel {spec.name}. Do not edit.", f"// {description}"]
    lines += [f"#define {d}" for d in defines]
    lines += [f'#include "{h}"' for h in headers]
    if abi in DEFERRING_ABIS:
        lines.append('#include "common/reduce.cuh"')
    lines += ["", "namespace cvt_kernel {", body.strip("\n"),
              "}  // namespace cvt_kernel", "", 'extern "C" {',
              "CVT_EXPORT const cvt_kernel_info* cvt_kernel_info_get(void) {",
              f'  return cvt_kernel::kernel_info<{k}>({spec.min_cc}, "{spec.name}");',
              "}",
              f"CVT_EXPORT int cvt_{abi}_can_implement(const {args}* a) {{",
              f"  return cvt_kernel::can_implement_on_device<{k}>(a, {spec.min_cc});",
              "}",
              f"CVT_EXPORT size_t cvt_{abi}_workspace_size(const {args}* a) {{ return {k}::workspace_size(*a); }}",
              f"CVT_EXPORT int cvt_{abi}_launch(const {args}* a, void* workspace, void* stream) {{",
              f"  return cvt_kernel::launch_on<{k}>(a, workspace, stream);",
              "}"]
    if abi in DEFERRING_ABIS:
        lines += ["CVT_EXPORT int cvt_colsum_flush(cvt_colsum_list* list, void* stream) {",
                  "  return cvt_kernel::colsum_flush(list, static_cast<cudaStream_t>(stream));",
                  "}"]
    lines += ['}  // extern "C"', ""]
    return "\n".join(lines)


def cute_shape(t) -> str:
    """(128, 64, 64) -> 'cute::Shape<cute::_128, cute::_64, cute::_64>'."""
    return "cute::Shape<" + ", ".join(f"cute::_{v}" for v in t) + ">"


def gemm_shape(t) -> str:
    """(128, 64, 32) -> 'cutlass::gemm::GemmShape<128, 64, 32>'."""
    return "cutlass::gemm::GemmShape<" + ", ".join(map(str, t)) + ">"
