"""Linear family: ``y = epilogue(x @ W^T)``, the GEMMs of CvT's nn.Linear layers.

x is (M, K) row-major (any leading stride), W is (N, K) exactly as ``nn.Linear`` stores it, so the
problem is CUTLASS's "TN" GEMM (A row-major, B column-major) with a row-major output. fp32
accumulation; fp16/bf16 in and out.

Two paths:

* ``arch=90``: CUTLASS 3.x SM90 kernels (TMA + wgmma, warp-specialized, persistent tile
  scheduler), built for ``sm_90a``.
* ``arch=89``: CUTLASS 2.x SM80-class kernels (cp.async + mma.sync) with tiles that fit the
  99 KB of shared memory an sm_89 (RTX 4090) block can use. Built for ``sm_89``; the same
  instantiation is built for the running device when it is another 8.x/9.x part (the H200 tests).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from .exports import COLSUM_HELPER, DEVICE_HELPERS, TMA_DRIVER_SHIM, arch_ok, c_exports
from .spec import (
    CUTLASS_ELEMENT,
    DTYPES,
    KernelSpec,
    NameHead,
    SpecError,
    check_sm80_stages,
    check_sm80_warps,
    triple,
    xs,
)

__all__ = ["CUTLASS_ELEMENT", "DTYPES", "LinearSpec", "LinearProblem", "SpecError", "candidates",
           "heuristic_spec", "refinements"]


SM90_SCHEDULES = {
    # name: (kernel schedule, epilogue schedule)
    "coop": (
        "cutlass::gemm::KernelTmaWarpSpecializedCooperative",
        "cutlass::epilogue::TmaWarpSpecializedCooperative",
    ),
    "pingpong": (
        "cutlass::gemm::KernelTmaWarpSpecializedPingpong",
        "cutlass::epilogue::TmaWarpSpecialized",
    ),
    "ws": (
        "cutlass::gemm::KernelTmaWarpSpecialized",
        "cutlass::epilogue::TmaWarpSpecialized",
    ),
}
TILE_SCHEDULERS = {"persistent": "void", "streamk": "cutlass::gemm::StreamKScheduler"}
RASTER = {
    "h": "cutlass::gemm::kernel::detail::RasterOrderOptions::Heuristic",
    "m": "cutlass::gemm::kernel::detail::RasterOrderOptions::AlongM",
    "n": "cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN",
}
# The GEMM operand layouts of each pass (CUTLASS's row/column letters for A and B): forward
# x (M, K) . W^T with W (N, K) as stored ("tn"); dgrad dY (M, N) . W, reading the same (N, K)
# weight as a row-major B ("tt", no transposed copy). The weight gradient is its own family
# (operators/linear_wgrad.py: an operand-reducing SM80-class GEMM that also sums dY into dbias).
LAYOUTS = {"fwd": "tn", "dgrad": "tt"}
# B's CUTLASS layout and CuTe stride (SM90) per pass.
_B_LAYOUT = {"fwd": "cutlass::layout::ColumnMajor", "dgrad": "cutlass::layout::RowMajor"}
_B_STRIDE = {"fwd": "cute::make_stride(int64_t(p.ldb), cute::Int<1>{}, int64_t(0))",
             "dgrad": "cute::make_stride(cute::Int<1>{}, int64_t(p.ldb), int64_t(0))"}


@dataclass(frozen=True)
class LinearSpec(KernelSpec):
    """One Linear kernel instantiation. ``name`` is its procedural name (operators/spec.py's
    grammar), used for the source file, the cache entry, profile rows and error messages."""

    arch: int
    dtype: str
    epilogue: str
    tile: tuple[int, int, int]
    cluster: tuple[int, int, int] = (1, 1, 1)
    schedule: str = "coop"
    stages: int = 0  # 0 = as many as fit (sm90); the SM80-class path needs an explicit count
    warps: tuple[int, int, int] = (2, 2, 1)  # SM80-class path: warps along M, N, K
    raster: str = "h"  # sm90 tile scheduler raster order: heuristic / along M / along N
    scheduler: str = "persistent"  # sm90 tile scheduler: 'persistent' or 'streamk' (coop only)
    epi_tile: tuple[int, int] | None = None  # sm90 epilogue subtile (M, N); None = CUTLASS's auto
    pdl: bool = False  # sm90: programmatic dependent launch (prologue overlaps the previous kernel)
    swizzle: int = 1  # sm90: max swizzle size of the tile scheduler; sm89: threadblock swizzle
    align: int = 8  # elements; 8 x 16-bit = 16 bytes, what TMA and cp.async.16 need
    pass_: str = "fwd"

    op: ClassVar[str] = "linear"
    family: ClassVar[str] = "gemm"
    PASSES: ClassVar[tuple[str, ...]] = ("fwd", "dgrad")

    # ------------------------------------------------------------------ naming
    @property
    def layout(self) -> str:
        return LAYOUTS[self.pass_]

    def variant(self) -> str:
        t = xs(self.tile)
        if self.arch == 90:
            st = f"s{self.stages}" if self.stages else "sauto"
            if self.epi_tile:
                st += f"_e{self.epi_tile[0]}x{self.epi_tile[1]}"
            sk = "_sk" if self.scheduler == "streamk" else ""
            sched = f"{self.schedule}{sk}_r{self.raster}{self.swizzle}{'_pdl' if self.pdl else ''}"
            return f"{self.epilogue}_t{t}_c{xs(self.cluster)}_{st}_{sched}_a{self.align}"
        return f"{self.epilogue}_t{t}_w{xs(self.warps)}_s{self.stages}_sw{self.swizzle}_a{self.align}"

    @classmethod
    def from_variant(cls, head: NameHead) -> LinearSpec | None:
        if head.arch == 90:
            m = _VARIANT_SM90.fullmatch(head.variant)
            if not m:
                return None
            return cls(90, head.dtype, m["epi"], triple(m["t"]), cluster=triple(m["c"]),
                       stages=0 if m["st"] == "auto" else int(m["st"]), schedule=m["sched"],
                       scheduler="streamk" if m["sk"] else "persistent",
                       epi_tile=tuple(int(v) for v in m["e"].split("x")) if m["e"] else None,
                       pdl=bool(m["pdl"]), raster=m["r"], swizzle=int(m["sw"]), align=int(m["al"]),
                       pass_=head.pass_)
        m = _VARIANT_SM89.fullmatch(head.variant)
        if not m:
            return None
        return cls(89, head.dtype, m["epi"], triple(m["t"]), warps=triple(m["w"]), stages=int(m["st"]),
                   schedule="multistage", swizzle=int(m["sw"]), align=int(m["al"]), pass_=head.pass_)

    # -------------------------------------------------------------- validation
    def validate(self) -> None:
        from cvt_cutlass.epilogues import epilogues_of_pass

        self.check_common()
        have = epilogues_of_pass(self.pass_)
        if self.epilogue not in have:
            raise SpecError(f"unknown epilogue {self.epilogue!r} for pass {self.pass_}; have {sorted(have)}")
        if self.align != 8:
            raise SpecError("only 16-byte alignment (align=8) kernels are instantiated")
        tm, tn, tk = self.tile
        if self.arch == 90:
            self._validate_sm90(tm, tn, tk)
        else:
            self._validate_sm89(tm, tn, tk)

    def _validate_sm90(self, tm: int, tn: int, tk: int) -> None:
        if self.schedule not in SM90_SCHEDULES:
            raise SpecError(f"sm90 schedule must be one of {sorted(SM90_SCHEDULES)}")
        if self.raster not in RASTER:
            raise SpecError(f"raster must be one of {sorted(RASTER)}")
        if self.scheduler not in TILE_SCHEDULERS:
            raise SpecError(f"sm90 tile scheduler must be one of {sorted(TILE_SCHEDULERS)}")
        if self.scheduler == "streamk" and self.schedule != "coop":
            raise SpecError("stream-K needs the cooperative schedule")
        if self.epi_tile is not None:
            em, en = self.epi_tile
            max_m = 128 if self.schedule == "coop" else 64
            if tm % em or tn % en or em % 64 or em > max_m or en % 16 or en > tn:
                raise SpecError(f"epilogue tile {self.epi_tile} must divide the CTA tile {self.tile} "
                                f"with M a multiple of 64 up to {max_m} and N a multiple of 16")
        if self.swizzle not in (1, 2, 4, 8):
            raise SpecError("sm90 swizzle must be 1, 2, 4 or 8")
        if self.schedule == "ws" and (self.raster != "h" or self.swizzle != 1):
            # The non-persistent kernel launches one CTA per tile in grid order: it has no
            # tile scheduler that would read the raster order or the swizzle.
            raise SpecError("raster order and swizzle apply to the persistent schedules (coop, pingpong)")
        min_m = 128 if self.schedule == "coop" else 64
        if tm % 64 or tm < min_m or tm > 256:
            raise SpecError(f"sm90 {self.schedule} tile M must be a multiple of 64 in [{min_m}, 256]")
        if tn % 16 or not 16 <= tn <= 256:
            raise SpecError("sm90 tile N must be a multiple of 16 in [16, 256]")
        if tk not in (32, 64, 128):
            raise SpecError("sm90 tile K must be 32, 64 or 128 (16-bit operands)")
        cm, cn, ck = self.cluster
        if ck != 1 or cm * cn > 4 or cm not in (1, 2, 4) or cn not in (1, 2, 4):
            raise SpecError("sm90 cluster must be (1|2|4, 1|2|4, 1) with at most 4 CTAs")
        if self.stages and not 2 <= self.stages <= 8:
            raise SpecError("sm90 stages must be 0 (auto) or in [2, 8]")

    def _validate_sm89(self, tm: int, tn: int, tk: int) -> None:
        if self.schedule != "multistage":
            raise SpecError("the sm89 path has one schedule: 'multistage'")
        if (self.cluster != (1, 1, 1) or self.raster != "h" or self.scheduler != "persistent"
                or self.epi_tile is not None or self.pdl):
            raise SpecError("clusters, raster order, stream-K, epilogue tiles and PDL are sm90-only")
        if self.swizzle not in (1, 2, 4, 8):
            raise SpecError("sm89 threadblock swizzle must be 1, 2, 4 or 8")
        check_sm80_warps(self.tile, self.warps)
        if tk not in (32, 64):
            raise SpecError("sm89 tile K must be 32 or 64")
        check_sm80_stages(self.name, self.tile, self.stages)

    # ------------------------------------------------------------------ emission
    def template_values(self) -> dict[str, str]:
        """Substitutions for the C++ template of this spec's path (not the epilogue parts)."""
        tm, tn, tk = self.tile
        v = {
            "name": self.name,
            "element": CUTLASS_ELEMENT[self.dtype],
            "tm": str(tm),
            "tn": str(tn),
            "tk": str(tk),
            "align": str(self.align),
            "min_cc": str(self.min_cc),
            "arch_ok": arch_ok(self.min_cc),
            # PDL: CUTLASS's SM90 kernels then execute griddepcontrol.wait in their producer warps
            # before any global load (consumers write only after consuming that data), so an
            # early start cannot read unfinished inputs or overwrite memory still being read.
            "pdl_define": "#define CUTLASS_ENABLE_GDC_FOR_SM90 1\n" if self.pdl else "",
            "pdl_run_args": ", nullptr, /*launch_with_pdl=*/true" if self.pdl else "",
            "layout_b": _B_LAYOUT[self.pass_],
            "stride_b": _B_STRIDE[self.pass_],
        }
        if self.arch == 90:
            ks, es = SM90_SCHEDULES[self.schedule]
            v.update(
                cm=str(self.cluster[0]),
                cn=str(self.cluster[1]),
                kernel_schedule=ks,
                epilogue_schedule=es,
                stage_count=(
                    f"cutlass::gemm::collective::StageCount<{self.stages}>"
                    if self.stages
                    else "cutlass::gemm::collective::StageCountAutoCarveout<"
                    "static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>"
                ),
                raster=RASTER[self.raster],
                swizzle=str(self.swizzle),
                tile_scheduler=TILE_SCHEDULERS[self.scheduler],
                epi_tile=(
                    f"Shape<_{self.epi_tile[0]}, _{self.epi_tile[1]}>"
                    if self.epi_tile
                    else "cutlass::epilogue::collective::EpilogueTileAuto"
                ),
            )
        else:
            wm, wn, wk = self.warps
            v.update(
                wm=str(tm // wm),
                wn=str(tn // wn),
                wk=str(tk // wk),
                stages=str(self.stages),
                swizzle=str(self.swizzle),
            )
        return v

    def template(self) -> str:
        if self.pass_ == "dgrad":
            return SM90_DGRAD_TEMPLATE if self.arch == 90 else SM80_DGRAD_TEMPLATE
        return SM90_TEMPLATE if self.arch == 90 else SM80_TEMPLATE


@dataclass(frozen=True)
class LinearProblem:
    """One Linear problem: M rows, N outputs, K inputs (what the selection table keys on)."""

    m: int
    n: int
    k: int
    label: str = field(default="", compare=False)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


_VARIANT_SM90 = re.compile(
    r"(?P<epi>[a-z_]+?)_t(?P<t>\d+x\d+x\d+)_c(?P<c>\d+x\d+x\d+)"
    r"_s(?P<st>auto|\d+)(?:_e(?P<e>\d+x\d+))?_(?P<sched>coop|pingpong|ws)(?P<sk>_sk)?"
    r"_r(?P<r>[hmn])(?P<sw>\d+)(?P<pdl>_pdl)?_a(?P<al>\d+)"
)
_VARIANT_SM89 = re.compile(
    r"(?P<epi>[a-z_]+?)_t(?P<t>\d+x\d+x\d+)_w(?P<w>\d+x\d+x\d+)_s(?P<st>\d+)_sw(?P<sw>\d+)_a(?P<al>\d+)"
)


# The sm90 sweep space: CTA tiles from 64x64 (many CTAs for the memory-bound K = 64 layers of
# stage 1) to 256x128 (the compute-bound stage-3 MLP).
_SM90_SPACE = (
    # (tile, cluster, schedule, stages, scheduler)
    ((128, 64, 64), (1, 1, 1), "coop", 0, "persistent"),
    ((128, 64, 64), (1, 1, 1), "pingpong", 0, "persistent"),
    ((64, 64, 64), (1, 1, 1), "pingpong", 0, "persistent"),
    ((256, 64, 64), (1, 1, 1), "coop", 0, "persistent"),
    # non-persistent, 3 stages: small enough smem for 2 CTAs per SM (memory-bound K = 64 layers)
    ((128, 64, 64), (1, 1, 1), "ws", 3, "persistent"),
    ((128, 64, 64), (1, 1, 1), "ws", 0, "persistent"),
    ((64, 96, 64), (1, 1, 1), "pingpong", 0, "persistent"),
    ((128, 96, 64), (1, 1, 1), "coop", 0, "persistent"),
    ((64, 128, 64), (1, 1, 1), "pingpong", 0, "persistent"),
    ((128, 128, 64), (1, 1, 1), "pingpong", 0, "persistent"),
    ((128, 128, 64), (1, 1, 1), "coop", 0, "persistent"),
    # stream-K: for problems of a few waves of tiles (e.g. M = 12800, N = K = 384)
    ((128, 128, 64), (1, 1, 1), "coop", 0, "streamk"),
    ((64, 192, 64), (1, 1, 1), "pingpong", 0, "persistent"),
    ((128, 192, 64), (1, 1, 1), "coop", 0, "persistent"),
    ((128, 256, 64), (1, 1, 1), "coop", 0, "persistent"),
    ((256, 128, 64), (1, 1, 1), "coop", 0, "persistent"),
    # K = 128 tiles: half the mainloop iterations on short-K, few-wave problems (s3.k).
    ((64, 128, 128), (1, 1, 1), "pingpong", 0, "persistent"),
    ((128, 128, 128), (1, 1, 1), "pingpong", 0, "persistent"),
    # Clusters of 2 along M multicast the weight tile: on s3.k (M = 12800, N = K = 384) 64x128
    # tiles re-read the whole weight from L2 200 times, ~88 MB of L2 traffic for a 20 MB problem.
    ((64, 128, 64), (2, 1, 1), "pingpong", 0, "persistent"),
    ((128, 128, 64), (2, 1, 1), "pingpong", 0, "persistent"),
    ((64, 192, 64), (2, 1, 1), "pingpong", 0, "persistent"),
    ((128, 192, 64), (2, 1, 1), "coop", 0, "persistent"),
    ((128, 64, 64), (2, 1, 1), "coop", 0, "persistent"),
    ((256, 64, 64), (2, 1, 1), "coop", 0, "persistent"),
)
# Programmatic dependent launch for the tiles that serve small, latency-bound problems (s3.k, the
# head, batch 1): a kernel's launch and prologue overlap the tail of the kernel before it.
_SM90_PDL_SPACE = (
    ((64, 64, 64), "pingpong"),
    ((128, 64, 64), "pingpong"),
    ((64, 128, 64), "pingpong"),
    ((128, 128, 64), "pingpong"),
    ((64, 192, 64), "pingpong"),
    ((128, 64, 64), "coop"),
    ((128, 64, 64), "ws"),
    ((256, 128, 64), "coop"),
)
# Epilogue subtiles spanning the whole 64-wide CTA tile: one TMA store per tile (or per warp
# group) instead of 32-wide pieces, for the bandwidth-bound N = 64 layers.
_SM90_EPI_SPACE = (
    ((128, 64, 64), "coop", (128, 64)),
    ((256, 64, 64), "coop", (128, 64)),
    ((128, 64, 64), "pingpong", (64, 64)),
)
# (tile, warps, stages) for the SM80-class path; every entry fits sm_89's 99 KB.
_SM89_SPACE = (
    ((128, 128, 32), (2, 2, 1), 4),
    ((128, 64, 32), (2, 2, 1), 4),
    ((64, 64, 32), (2, 2, 1), 5),
    ((64, 128, 32), (2, 2, 1), 4),
    ((128, 256, 32), (2, 4, 1), 3),
    ((256, 128, 32), (4, 2, 1), 3),
    ((128, 128, 64), (2, 2, 1), 3),
)


def candidates(arch: int, dtype: str, epilogue: str) -> list[LinearSpec]:
    """The instantiations a profile sweep tries for one (arch, dtype, epilogue)."""
    if arch == 90:
        return [
            LinearSpec(90, dtype, epilogue, tile=t, cluster=c, schedule=s, stages=st, scheduler=sch)
            for t, c, s, st, sch in _SM90_SPACE
        ] + [LinearSpec(90, dtype, epilogue, tile=t, schedule=s, epi_tile=e) for t, s, e in _SM90_EPI_SPACE] + [
        LinearSpec(90, dtype, epilogue, tile=t, schedule=s, pdl=True) for t, s in _SM90_PDL_SPACE
    ]
    return [
        LinearSpec(89, dtype, epilogue, tile=t, warps=w, stages=st, schedule="multistage")
        for t, w, st in _SM89_SPACE
    ]


# The dgrad sweep's space on sm90: the forward's main tiles and schedules (no PDL variants), and
# for the wide tiles 128 x 64 epilogue subtiles (half the subtile iterations, each with its Z load,
# GELU', row reduction and TMA store, of CUTLASS's auto choice). (tile, schedule, scheduler,
# epilogue tile, stages.) Run B5 also tried non-persistent 2-CTA-per-SM kernels (128x64 / 128x128
# with 3 stages, 128x192 with 2) and 64x256 pingpong: 1.5-5x slower than the best on every CvT-13
# dgrad problem at batch 128, dropped. On the SM80-class path the forward's whole space.
_SM90_DGRAD_SPACE = (
    ((128, 64, 64), "coop", "persistent", None, 0),
    ((128, 64, 64), "pingpong", "persistent", None, 0),
    ((128, 128, 64), "coop", "persistent", None, 0),
    ((128, 128, 64), "pingpong", "persistent", None, 0),
    ((128, 128, 64), "coop", "streamk", None, 0),
    ((128, 192, 64), "coop", "persistent", None, 0),
    ((128, 256, 64), "coop", "persistent", None, 0),
    ((256, 128, 64), "coop", "persistent", None, 0),
    ((128, 256, 64), "coop", "persistent", (128, 64), 0),
    ((256, 128, 64), "coop", "persistent", (128, 64), 0),
)


def backward_candidates(arch: int, dtype: str, pass_: str, epilogue: str) -> list:
    """What the backward sweep tries for one (path, dtype, pass, epilogue): dgrad kernels of the
    path, or the wgrad kernels (SM80-class tiles x row-split waves; on sm90 also the SM90 stream-K ones)."""
    if pass_ == "wgrad":
        from .linear_wgrad import wgrad_candidates

        return wgrad_candidates(dtype, arch)
    if pass_ != "dgrad":
        raise SpecError(f"no backward pass {pass_!r} (dgrad, wgrad)")
    if arch == 90:
        return [LinearSpec(90, dtype, epilogue, tile=t, schedule=s, scheduler=sch, epi_tile=e, stages=st, pass_="dgrad")
                for t, s, sch, e, st in _SM90_DGRAD_SPACE]
    return [LinearSpec(89, dtype, epilogue, tile=t, warps=w, stages=st, schedule="multistage", pass_="dgrad")
            for t, w, st in _SM89_SPACE]


def refinements(spec: LinearSpec) -> list[LinearSpec]:
    """Raster-order and swizzle variants of a sweep's winner (the sweep's second stage).

    They change only the order in which tiles are visited (L2 reuse of the operand panels), so
    they are tried on the best kernel of each problem instead of multiplying the whole space.
    sm90: along M, along N (swizzle 1) and the heuristic raster with swizzle 2 and 4, for the
    persistent schedules; sm89: threadblock swizzle 2 and 4.
    """
    if spec.arch == 90:
        if spec.schedule == "ws":
            return []
        variants = [("m", 1), ("n", 1), ("h", 2), ("h", 4)]
        return [spec.with_(raster=r, swizzle=sw) for r, sw in variants
                if (r, sw) != (spec.raster, spec.swizzle)]
    return [spec.with_(swizzle=sw) for sw in (1, 2, 4) if sw != spec.swizzle]


def heuristic_spec(m: int, n: int, k: int, dtype: str, epilogue: str, arch: int, pass_: str = "fwd") -> LinearSpec:
    """The kernel for a problem that the selection table does not list.

    Few distinct tiles on purpose: each one is another kernel to compile.
    """
    if arch == 90:
        if n <= 64:
            tile = (128, 64, 64)
        elif n <= 128:
            tile = (128, 128, 64)
        elif n % 192 == 0 and n <= 384:
            tile = (128, 192, 64)
        else:
            tile = (128, 256, 64)
        return LinearSpec(90, dtype, epilogue, tile=tile, schedule="coop", pass_=pass_)
    tile = (128, 64, 32) if n <= 64 else (128, 128, 32)
    return LinearSpec(89, dtype, epilogue, tile=tile, warps=(2, 2, 1), stages=4, schedule="multistage", pass_=pass_)


# ---------------------------------------------------------------------------------------------
# C++ templates. ${fusion_decl} / ${fusion_callbacks} / ${fusion_args} come from the traced EVT
# (cvt_cutlass.epilogues.packing). Everything else is ours: the kernel type, can_implement, the
# workspace query and a launcher that takes the caller's stream and workspace, never allocates,
# never synchronises and sets the shared-memory attribute once per device.
# ---------------------------------------------------------------------------------------------

_COMMON_PRELUDE = r"""// Generated by cvt_cutlass for kernel ${name}. Do not edit.
// ${description}
${pdl_define}#include <cstdint>
#include <cuda_runtime.h>
#include "cutlass/cutlass.h"
#include "cvt_kernel_abi.h"
""" + DEVICE_HELPERS

_COMMON_EXPORTS = c_exports("gemm", "p")

SM90_TEMPLATE = (
    _COMMON_PRELUDE.replace("${pdl_define}", "${pdl_define}" + TMA_DRIVER_SHIM.replace("$", "$$"))
    + r"""#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler_params.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"

// A named namespace: an anonymous one plus `using namespace cute` (which has its own anonymous
// namespace) makes nvcc's generated stub ambiguous.
namespace cvt_kernel {
using namespace cute;
constexpr int kFamily = CVT_FAMILY_GEMM;

using ElementA = ${element};
using ElementB = ${element};
using TileShape = Shape<_${tm}, _${tn}, _${tk}>;
using ClusterShape = Shape<_${cm}, _${cn}, _1>;
using KernelSchedule = ${kernel_schedule};
using EpilogueSchedule = ${epilogue_schedule};
using ElementCDescriptor = ${element_c};  // void when the epilogue reads no C

using EpilogueDescriptor = cutlass::epilogue::collective::detail::EpilogueDescriptor<
    TileShape, ${epi_tile}, ElementCDescriptor, ${element},
    EpilogueSchedule>;

// ---- fusion callbacks traced from cvt_cutlass.epilogues.linear.${epilogue}
${fusion_decl}
// ----

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    ${epi_tile}, float, float,
    ElementC, StrideC, ${align}, ElementD, StrideD, ${align},
    EpilogueSchedule, ${fusion_callbacks}>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementA, cutlass::layout::RowMajor, ${align},
    ElementB, ${layout_b}, ${align},
    float, TileShape, ClusterShape, ${stage_count}, KernelSchedule>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
    Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue, ${tile_scheduler}>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

constexpr int kSmemBytes = GemmKernel::SharedStorageSize;
const void* const kKernelFn = reinterpret_cast<const void*>(cutlass::device_kernel<GemmKernel>);

typename GemmKernel::Arguments make_arguments(const cvt_gemm_args& p) {
  using StrideA = typename CollectiveMainloop::StrideA;
  using StrideB = typename CollectiveMainloop::StrideB;
  StrideA stride_a = cute::make_stride(int64_t(p.lda), cute::Int<1>{}, int64_t(0));
  StrideB stride_b = ${stride_b};
  StrideD stride_d = cute::make_stride(int64_t(p.ldd), cute::Int<1>{}, cute::Int<0>{});
  StrideC stride_c{};
  if constexpr (!cute::is_void_v<ElementC>) {
    stride_c = cute::make_stride(int64_t(p.ldc), cute::Int<1>{}, cute::Int<0>{});
  }
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = p.device_id;
  hw_info.sm_count = p.sm_count > 0 ? p.sm_count : sm_count_of(p.device_id);

  typename GemmKernel::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {int(p.m), int(p.n), int(p.k), 1},
      {static_cast<ElementA const*>(p.a), stride_a, static_cast<ElementB const*>(p.b), stride_b},
      {${fusion_args},
       static_cast<ElementC const*>(p.c), stride_c,
       static_cast<ElementD*>(p.d), stride_d},
      hw_info};
  args.scheduler.raster_order = ${raster};
  args.scheduler.max_swizzle_size = ${swizzle};
  return args;
}

bool can_implement(const cvt_gemm_args& p) {
  if (p.m <= 0 || p.n <= 0 || p.k <= 0 || p.m > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX)
    return false;
  if (!tma_ready()) return false;
  return Gemm::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
}

size_t workspace_size(const cvt_gemm_args& p) { return Gemm::get_workspace_size(make_arguments(p)); }

int launch(const cvt_gemm_args& p, void* workspace, cudaStream_t stream) {
  if (!smem_ready(kKernelFn, kSmemBytes, p.device_id)) return CVT_ERR_SMEM;
  auto args = make_arguments(p);
  if (GemmKernel::initialize_workspace(args, workspace, stream) != cutlass::Status::kSuccess)
    return CVT_ERR_INIT;
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, workspace);
  if (Gemm::run(params, stream${pdl_run_args}) != cutlass::Status::kSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_LAUNCH;
  }
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}
}  // namespace cvt_kernel
"""
    + _COMMON_EXPORTS
)

SM80_TEMPLATE = (
    _COMMON_PRELUDE
    + r"""#include "cute/tensor.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/default_gemm_universal_with_visitor.h"
#include "cutlass/epilogue/threadblock/fusion/visitors.hpp"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"

namespace cvt_kernel {
using namespace cute;
constexpr int kFamily = CVT_FAMILY_GEMM;

using ElementA = ${element};
using ElementB = ${element};
using ThreadblockShape = cutlass::gemm::GemmShape<${tm}, ${tn}, ${tk}>;
using WarpShape = cutlass::gemm::GemmShape<${wm}, ${wn}, ${wk}>;
using InstructionShape = cutlass::gemm::GemmShape<16, 8, 16>;
constexpr int kEpilogueStages = ${epilogue_stages};

using OutputTileThreadMap = cutlass::epilogue::threadblock::OutputTileThreadLayout<
    ThreadblockShape, WarpShape, ${element}, ${align}, kEpilogueStages>;

// ---- fusion callbacks traced from cvt_cutlass.epilogues.linear.${epilogue}
${fusion_decl}
// ----

using GemmKernel = typename cutlass::gemm::kernel::DefaultGemmWithVisitor<
    ElementA, cutlass::layout::RowMajor, cutlass::ComplexTransform::kNone, ${align},
    ElementB, ${layout_b}, cutlass::ComplexTransform::kNone, ${align},
    ${element}, cutlass::layout::RowMajor, ${align},
    float, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
    ThreadblockShape, WarpShape, InstructionShape, ${fusion_callbacks},
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<${swizzle}>, ${stages},
    cutlass::arch::OpMultiplyAdd, kEpilogueStages>::GemmKernel;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

constexpr int kSmemBytes = int(sizeof(typename GemmKernel::SharedStorage));
const void* const kKernelFn = reinterpret_cast<const void*>(cutlass::Kernel2<GemmKernel>);

typename Gemm::Arguments make_arguments(const cvt_gemm_args& p) {
  return typename Gemm::Arguments(
      cutlass::gemm::GemmUniversalMode::kGemm, {int(p.m), int(p.n), int(p.k)}, /*batch*/ 1,
      ${fusion_args},
      p.a, p.b, /*C, D: written through the visitor tree*/ nullptr, nullptr,
      /*batch strides*/ 0, 0, 0, 0,
      p.lda, p.ldb, /*ldc, ldd (unused)*/ 0, 0);
}

bool can_implement(const cvt_gemm_args& p) {
  if (p.m <= 0 || p.n <= 0 || p.k <= 0 || p.m > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX)
    return false;
  // The visitor epilogue accesses D, C and Z in 16-byte vectors: their leading dimensions must
  // keep every row aligned, which GemmUniversal::can_implement cannot see.
  if (p.ldd % ${align} || (p.c && p.ldc % ${align}) || (p.aux && p.ldaux % ${align})) return false;
  return Gemm::can_implement(make_arguments(p)) == cutlass::Status::kSuccess;
}

size_t workspace_size(const cvt_gemm_args& p) { return Gemm::get_workspace_size(make_arguments(p)); }

int launch(const cvt_gemm_args& p, void* workspace, cudaStream_t stream) {
  if (!smem_ready(kKernelFn, kSmemBytes, p.device_id)) return CVT_ERR_SMEM;
  Gemm gemm;
  if (gemm.initialize(make_arguments(p), workspace, stream) != cutlass::Status::kSuccess)
    return CVT_ERR_INIT;
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_LAUNCH;
  }
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}
}  // namespace cvt_kernel
"""
    + _COMMON_EXPORTS
)


# ---------------------------------------------------------------------------------------------
# dgrad: dX = dY . W (A = dY (M, N) row-major, B = the (N, K) weight read as a row-major K x N
# operand), the forward's kernel with B's layout flipped. The dgelu_dbias epilogue multiplies by
# GELU's exact (erf) derivative at the saved pre-activation Z (read as C) and reduces the result
# over rows into dbias (the cuBLASLt DGELU_BGRAD semantics). CUTLASS's own dGELU functor is the
# tanh approximation's derivative, so the traced tree names a placeholder (Sigmoid) that
# epilogues.packing swaps for this functor.
# ---------------------------------------------------------------------------------------------
# The epilogue's cost is this math (run B6: on the stage-3 MLP shape the plain dgrad takes 0.055
# ms, with GELU' 0.116, with GELU' and the dbias reduction 0.122; ncu: issue-latency bound, about
# 5 cycles between a warp's instructions). erff (a branchy polynomial) and expf each serialise a
# fragment's elements; this form has no branch, so the compiler interleaves a fragment's
# independent elements. (Run B3 tried the same formula with an IEEE division and expf, which
# branch too: 18% slower.)
_DGELU_FUNCTOR = r"""constexpr int kFamily = CVT_FAMILY_GEMM;

// d/dz gelu(z) for nn.GELU's exact (erf) form: Phi(z) + z * phi(z), in fp32, branch-free.
// erf(|x|), x = z / sqrt(2), by Abramowitz & Stegun 7.1.26 (absolute error <= 1.5e-7) from the
// same e = exp(-x^2) = exp(-z^2 / 2) that phi needs; __expf (ex2.approx) and __fdividef (rcp.approx)
// add < 1e-6 where e matters (|z| < 4) and nothing beyond it. Total absolute error < 2e-6, against
// an output rounded to 2^-9 (bf16) or 2^-12 (fp16) relative.
CUTLASS_HOST_DEVICE float dgelu_exp(float v) {
#if defined(__CUDA_ARCH__)
  return __expf(v);
#else
  return expf(v);
#endif
}
CUTLASS_HOST_DEVICE float dgelu_rcp(float v) {
#if defined(__CUDA_ARCH__)
  return __fdividef(1.f, v);
#else
  return 1.f / v;
#endif
}
template <class T>
struct DGeluErf {
  static const bool kIsHeavy = true;
  CUTLASS_HOST_DEVICE T operator()(T const& z) const {
    const float x = float(z);
    const float e = dgelu_exp(-0.5f * x * x);
    const float t = dgelu_rcp(fmaf(0.3275911f * 0.70710678118654752f, fabsf(x), 1.f));
    const float p = t * fmaf(t, fmaf(t, fmaf(t, fmaf(t, 1.061405429f, -1.453152027f), 1.421413741f), -0.284496736f),
                             0.254829592f);
    return T(0.5f + 0.5f * copysignf(1.f - p * e, x) + x * 0.39894228040143268f * e);
  }
};
template <class T, int N>
struct DGeluErf<cutlass::Array<T, N>> {
  static const bool kIsHeavy = true;
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& z) const {
    cutlass::Array<T, N> y;
    DGeluErf<T> f;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) y[i] = f(z[i]);
    return y;
  }
};
"""


def _must_replace(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise AssertionError(f"template piece not found exactly once: {old[:60]!r}")
    return text.replace(old, new)


_FAMILY_LINE = "constexpr int kFamily = CVT_FAMILY_GEMM;\n"
# SM90: the row-reduction visitor writes one fp32 partial dbias row per M-tile (CUTLASS's
# Sm90RowReduction without its final pass, whose last-CTA serial sum over thousands of M-tiles
# was most of the kernel's time) into the workspace's tail, passed as p.bias; a column sum over
# the M-tiles in fixed order (deterministic) rounds it into p.aux.
SM90_DGRAD_TEMPLATE = _must_replace(
    _must_replace(_must_replace(SM90_TEMPLATE, '#include "cute/tensor.hpp"\n', COLSUM_HELPER + '#include "cute/tensor.hpp"\n'),
                  _FAMILY_LINE, _DGELU_FUNCTOR),
    r"""size_t workspace_size(const cvt_gemm_args& p) { return Gemm::get_workspace_size(make_arguments(p)); }

int launch(const cvt_gemm_args& p, void* workspace, cudaStream_t stream) {
  if (!smem_ready(kKernelFn, kSmemBytes, p.device_id)) return CVT_ERR_SMEM;
  auto args = make_arguments(p);""",
    r"""constexpr bool kReducesBias = ${reduces_bias};
// The M-tiles' partial dbias rows: (ceil(M / tile M), N rounded up to tile N) fp32.
int64_t dbias_rows(const cvt_gemm_args& p) { return (p.m + ${tm} - 1) / ${tm}; }
int64_t dbias_ld(const cvt_gemm_args& p) { return (p.n + ${tn} - 1) / ${tn} * ${tn}; }
size_t gemm_workspace(const cvt_gemm_args& p) { return (Gemm::get_workspace_size(make_arguments(p)) + 255) / 256 * 256; }
size_t workspace_size(const cvt_gemm_args& p) {
  return gemm_workspace(p) + (kReducesBias ? size_t(dbias_rows(p) * dbias_ld(p)) * sizeof(float) : 0);
}

int launch_gemm(const cvt_gemm_args& p, void* workspace, cudaStream_t stream);

int launch(const cvt_gemm_args& p0, void* workspace, cudaStream_t stream) {
  cvt_gemm_args p = p0;
  float* partials = nullptr;
  if constexpr (kReducesBias) {
    partials = reinterpret_cast<float*>(static_cast<char*>(workspace) + gemm_workspace(p0));
    p.bias = partials;  // the visitor's ptr_row (make_arguments)
  }
  const int rc = launch_gemm(p, workspace, stream);
  if (rc != CVT_OK || !kReducesBias) return rc;
  colsum(partials, dbias_rows(p), dbias_ld(p), p.n, static_cast<${element}*>(p0.aux), stream);
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}

int launch_gemm(const cvt_gemm_args& p, void* workspace, cudaStream_t stream) {
  if (!smem_ready(kKernelFn, kSmemBytes, p.device_id)) return CVT_ERR_SMEM;
  auto args = make_arguments(p);""",
)

# SM80-class: CUTLASS's row-reduction visitor adds with atomics, so dbias is summed in fp32 in the
# workspace's tail (zeroed first) and rounded into p.aux after the GEMM.
SM80_DGRAD_TEMPLATE = _must_replace(
    _must_replace(SM80_TEMPLATE, _FAMILY_LINE, _DGELU_FUNCTOR),
    r"""size_t workspace_size(const cvt_gemm_args& p) { return Gemm::get_workspace_size(make_arguments(p)); }

int launch(const cvt_gemm_args& p, void* workspace, cudaStream_t stream) {
  if (!smem_ready(kKernelFn, kSmemBytes, p.device_id)) return CVT_ERR_SMEM;
  Gemm gemm;
  if (gemm.initialize(make_arguments(p), workspace, stream) != cutlass::Status::kSuccess)
    return CVT_ERR_INIT;
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_LAUNCH;
  }
  return""",
    r"""constexpr bool kReducesBias = ${reduces_bias};
size_t gemm_workspace(const cvt_gemm_args& p) { return (Gemm::get_workspace_size(make_arguments(p)) + 255) / 256 * 256; }
size_t workspace_size(const cvt_gemm_args& p) {
  return gemm_workspace(p) + (kReducesBias ? size_t(p.n) * sizeof(float) : 0);
}

__global__ void round_dbias(const float* acc, ${element}* out, int n) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = ${element}(acc[i]);
}

int launch(const cvt_gemm_args& p0, void* workspace, cudaStream_t stream) {
  if (!smem_ready(kKernelFn, kSmemBytes, p0.device_id)) return CVT_ERR_SMEM;
  cvt_gemm_args p = p0;
  float* dbias_acc = nullptr;
  if constexpr (kReducesBias) {  // the visitor's fp32 atomics land here (p.bias in make_arguments)
    dbias_acc = reinterpret_cast<float*>(static_cast<char*>(workspace) + gemm_workspace(p0));
    if (cudaMemsetAsync(dbias_acc, 0, size_t(p.n) * sizeof(float), stream) != cudaSuccess) {
      (void)cudaGetLastError();
      return CVT_ERR_INIT;
    }
    p.bias = dbias_acc;
  }
  Gemm gemm;
  if (gemm.initialize(make_arguments(p), workspace, stream) != cutlass::Status::kSuccess)
    return CVT_ERR_INIT;
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_LAUNCH;
  }
  if constexpr (kReducesBias)
    round_dbias<<<unsigned((p.n + 255) / 256), 256, 0, stream>>>(dbias_acc, static_cast<${element}*>(p0.aux), int(p.n));
  return""",
)
