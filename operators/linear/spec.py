"""Linear specs: ``y = epilogue(x @ W^T)`` and ``dX = epilogue(dY . W)``, the GEMMs of CvT's
nn.Linear layers (kernels: operators/linear/gemm_sm90.cuh, gemm_sm80.cuh, dgrad_sm90.cuh,
dgrad_sm80.cuh; epilogues: cvt_cutlass.epilogues).

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
    triple,
    xs,
)

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
# weight as a row-major B ("tt", no transposed copy). The weight gradient has specs of its own
# (operators/linear/wgrad.py).
LAYOUTS = {"fwd": "tn", "dgrad": "tt"}
# the residual variants (LinearSpec.residual) and what their kernels' descriptions say
RESIDUALS = {"f32": "; fp32 residual and output", "f32in": "; fp32 residual, rounded output"}
# B's CUTLASS layout per pass.
_B_LAYOUT = {"fwd": "cutlass::layout::ColumnMajor", "dgrad": "cutlass::layout::RowMajor"}


def check_sm90_cluster(cluster: tuple[int, int, int]) -> None:
    """An SM90 kernel's cluster: 1, 2 or 4 CTAs along M and N, at most 4 in all."""
    cm, cn, ck = cluster
    if ck != 1 or cm * cn > 4 or cm not in (1, 2, 4) or cn not in (1, 2, 4):
        raise SpecError(f"sm90 cluster must be (1|2|4, 1|2|4, 1) with at most 4 CTAs, got {cluster}")


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
    # the residual C and the output D in fp32 ("f32": an fp32 residual stream, as HF's under
    # autocast), C in fp32 and D in the operands' dtype ("f32in": the stream's last sum of a stage,
    # rounded once where the next embedding reads it in 16 bits), or both in the operands' dtype
    # (""); forward epilogues that read a residual only
    residual: str = ""

    op: ClassVar[str] = "linear"
    family: ClassVar[str] = "gemm"
    PASSES: ClassVar[tuple[str, ...]] = ("fwd", "dgrad")

    # ------------------------------------------------------------------ naming
    @property
    def layout(self) -> str:
        return LAYOUTS[self.pass_]

    def variant(self) -> str:
        t = xs(self.tile)
        epi = self.epilogue + (f"_r{self.residual}" if self.residual else "")
        if self.arch == 90:
            st = f"s{self.stages}" if self.stages else "sauto"
            if self.epi_tile:
                st += f"_e{self.epi_tile[0]}x{self.epi_tile[1]}"
            sk = "_sk" if self.scheduler == "streamk" else ""
            sched = f"{self.schedule}{sk}_r{self.raster}{self.swizzle}{'_pdl' if self.pdl else ''}"
            return f"{epi}_t{t}_c{xs(self.cluster)}_{st}_{sched}_a{self.align}"
        return f"{epi}_t{t}_w{xs(self.warps)}_s{self.stages}_sw{self.swizzle}_a{self.align}"

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
                       pass_=head.pass_, residual=m["res"] or "")
        m = _VARIANT_SM89.fullmatch(head.variant)
        if not m:
            return None
        return cls(89, head.dtype, m["epi"], triple(m["t"]), warps=triple(m["w"]), stages=int(m["st"]),
                   schedule="multistage", swizzle=int(m["sw"]), align=int(m["al"]), pass_=head.pass_,
                   residual=m["res"] or "")

    # -------------------------------------------------------------- validation
    def validate(self) -> None:
        from cvt_cutlass.epilogues import epilogues_of_pass

        self.check_common()
        have = epilogues_of_pass(self.pass_)
        if self.epilogue not in have:
            raise SpecError(f"unknown epilogue {self.epilogue!r} for pass {self.pass_}; have {sorted(have)}")
        if self.align != 8:
            raise SpecError("only 16-byte alignment (align=8) kernels are instantiated")
        if self.residual and (self.residual not in RESIDUALS or not have[self.epilogue].has_residual):
            raise SpecError(f"residual {self.residual!r}: 'f32' (an fp32 residual and output) or 'f32in' (an fp32 "
                            f"residual) takes a forward epilogue that adds a residual, not {self.epilogue!r}")
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
        check_sm90_cluster(self.cluster)
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
        check_sm80_tile(self.name, self.tile, self.warps, self.stages)

    # ------------------------------------------------------------------ instantiation
    def instantiation(self) -> str:
        """The kernel's ``.cu``: the GEMM template of its path and pass (operators/linear/*.cuh)
        with this spec's parameters and the EVT of its epilogue, traced from
        :mod:`cvt_cutlass.epilogues` by cutlass_cppgen."""
        from cvt_cutlass.epilogues import get_linear_epilogue
        from cvt_cutlass.epilogues.packing import trace_linear_epilogue

        epi = get_linear_epilogue(self.epilogue, self.pass_)
        traced = trace_linear_epilogue(epi, self.dtype, self.arch, self.residual)
        sm = "sm90" if self.arch == 90 else "sm80"
        kind = "dgrad" if self.pass_ == "dgrad" else "gemm"
        body = "\n".join([
            "using namespace cute;",
            "",
            f"// The epilogue, traced from cvt_cutlass.epilogues.linear.{self.epilogue}.",
            _fusion_struct(traced, "EpilogueDescriptor" if self.arch == 90 else "OutputTileThreadMap"),
            "",
            "struct Config {",
            *("  " + ln for ln in self._config_lines(traced, epi)),
            "  template <class Context>",
            "  using Fusion = LinearFusion<Context>;",
            "};",
            f"using Kernel = {kind.capitalize()}{sm.capitalize()}<Config>;",
        ])
        # the forward that saves GELU's derivative maps its store node (and computes GELU) there
        extra = ("linear/mapped_store.cuh",) if epi.saves_dgelu else ()
        return instantiation_file(
            self, headers=(f"linear/{kind}_{sm}.cuh", *extra), body=body, abi="gemm",
            description=f"{self.op} {self.pass_}: {epi.doc}; {self.dtype}"
                        f"{RESIDUALS.get(self.residual, '')}; fp32 accumulation",
            defines=("CUTLASS_ENABLE_GDC_FOR_SM90 1",) if self.pdl else ())

    def _config_lines(self, traced, epi) -> list[str]:
        """The C++ members of the template's Cfg (see the headers' comments; with residual "f32in"
        the sm90 ElementC is float while ElementD is Element, and the SM80-class tree loads its fp32
        C as an aux node of that type beside the Element output map; a dgrad reading the saved
        GELU' reads an fp16 C)."""
        tm, tn, tk = self.tile
        out = "float" if self.residual == "f32" else CUTLASS_ELEMENT[self.dtype]
        lines = [f"using Element = {CUTLASS_ELEMENT[self.dtype]};",
                 f"using ElementD = {out};  // the output"
                 + (" (and the residual C, where read)" if self.residual != "f32in" else ""),
                 f"using LayoutB = {_B_LAYOUT[self.pass_]};",
                 f"static constexpr int kAlign = {self.align};",
                 f"static constexpr int kStages = {self.stages};",
                 f"static constexpr int kSwizzle = {self.swizzle};"]
        if self.pass_ == "dgrad":
            lines.append(f"static constexpr bool kReducesBias = {'true' if epi.reduces else 'false'};")
        if self.arch != 90:
            wm, wn, wk = self.warps
            return lines + [f"using ThreadblockShape = {gemm_shape(self.tile)};",
                            f"using WarpShape = {gemm_shape((tm // wm, tn // wn, tk // wk))};",
                            f"static constexpr int kEpilogueStages = {traced.epilogue_stages};"]
        kernel_schedule, epilogue_schedule = SM90_SCHEDULES[self.schedule]
        epi_tile = (f"cute::Shape<cute::_{self.epi_tile[0]}, cute::_{self.epi_tile[1]}>" if self.epi_tile
                    else "cutlass::epilogue::collective::EpilogueTileAuto")
        element_c = ("float" if self.residual else out) if traced.reads_c else "void"
        if epi.activation == "dgelu_saved":
            element_c = CUTLASS_ELEMENT["fp16"]
        return lines + [f"using TileShape = {cute_shape(self.tile)};",
                        f"using ClusterShape = {cute_shape((self.cluster[0], self.cluster[1], 1))};",
                        f"using KernelSchedule = {kernel_schedule};",
                        f"using EpilogueSchedule = {epilogue_schedule};",
                        f"using EpilogueTile = {epi_tile};",
                        f"using ElementC = {element_c};  // void when the epilogue reads no C",
                        f"using TileScheduler = {TILE_SCHEDULERS[self.scheduler]};",
                        f"static constexpr auto kRaster = {RASTER[self.raster]};",
                        f"static constexpr bool kPdl = {'true' if self.pdl else 'false'};"]


def _fusion_struct(traced, context: str) -> str:
    """The traced EVT as the template's Fusion: its node types (which name ``context``: the SM90
    EpilogueDescriptor or the SM80-class OutputTileThreadMap) and ``arguments(p)``, which packs its
    operands from the kernel ABI's cvt_gemm_args."""
    decl = "\n".join("  " + ln if ln else "" for ln in traced.fusion_decl.splitlines())
    return "\n".join([
        f"template <class {context}>",
        "struct LinearFusion {",
        decl,
        f"  using Callbacks = {traced.fusion_callbacks};",
        "  static typename Callbacks::Arguments arguments(const cvt_gemm_args& p) {",
        f"    return {traced.fusion_args};",
        "  }",
        "};",
    ])


_VARIANT_SM90 = re.compile(
    r"(?P<epi>[a-z_]+?)(?:_r(?P<res>f32in|f32))?_t(?P<t>\d+x\d+x\d+)_c(?P<c>\d+x\d+x\d+)"
    r"_s(?P<st>auto|\d+)(?:_e(?P<e>\d+x\d+))?_(?P<sched>coop|pingpong|ws)(?P<sk>_sk)?"
    r"_r(?P<r>[hmn])(?P<sw>\d+)(?P<pdl>_pdl)?_a(?P<al>\d+)"
)
_VARIANT_SM89 = re.compile(
    r"(?P<epi>[a-z_]+?)(?:_r(?P<res>f32in|f32))?_t(?P<t>\d+x\d+x\d+)_w(?P<w>\d+x\d+x\d+)_s(?P<st>\d+)_sw(?P<sw>\d+)_a(?P<al>\d+)"
)
