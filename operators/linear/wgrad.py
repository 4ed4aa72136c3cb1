"""Linear weight-gradient specs: ``dW = dY^T . X`` and ``db = sum_rows(dY)`` (kernels:
operators/linear/wgrad_sm80.cuh, wgrad_sm90.cuh).

The GEMM's reduction dimension is the token count (up to 802,816 rows for stage 1 at batch 256)
while its output is as small as 64 x 64, so the rows are split across CTAs. A = dY read as the
column-major (N, M) operand, B = X row-major (M, K): no transposed copies. Two kernels, chosen per
problem by the backward sweep:

* ``kred`` (SM80-class, cp.async + mma.sync; serves sm_89 and, built for the running GPU, sm_90):
  parallel split-K with fp32 partials in the workspace summed by one small pass, and db as
  CUTLASS's operand reduction (``GemmWithKReduction``, example 23): the mainloop sums the dY tiles
  it already streams through shared memory, so db costs no extra pass over dY.
* ``rsum`` (CUTLASS 3.x SM90: TMA + wgmma, cooperative or ping-pong, clusters; sm_90a), the rows
  split one of two ways:
  ``sk``, by the stream-K scheduler (``_k0``: CUTLASS's stream-K / data-parallel heuristic;
  ``_k<w>``: split-K into enough splits for w waves), reduced in fp32 in the scheduler's workspace
  in a fixed order inside the kernel, dW written in the weight's dtype by the epilogue; or ``ps``
  (parallel slabs), a batched GEMM over S splits of the rows (S divides M, S < 64, about w waves of CTAs),
  each split's fp32 partial dW in a slab of its own, summed per element in split order by the
  column-sum pass: no split waits for another. Both are deterministic. CUTLASS 3.x has no
  operand-reducing mainloop, so when db is asked for it is a separate deterministic row-sum pass
  over dY (per-chunk fp32 partials, then a column sum).

Names: ``cvt_linear_wgrad_sm89_<dtype>_nt_kred_t<tile>_w<warps>_s<stages>_a8[_k<waves>]`` and
``cvt_linear_wgrad_sm90a_<dtype>_nt_rsum_t<tile>_c<cluster>_sauto_<coop|pingpong>_<sk|ps>_a8_k<waves>``.
A cluster shares each operand panel between its CTAs (TMA multicast): a CTA row of the cluster
reads its dY columns once, a CTA column its X columns, so that L2 serves fewer bytes per output.
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
from .spec import SM90_SCHEDULES, check_sm90_cluster


@dataclass(frozen=True)
class LinearWgradSpec(KernelSpec):
    """arch 89: the SM80-class ``kred`` kernel (tile, warps, stages, waves = CTAs per SM the row
    splits aim for); arch 90: the SM90 ``rsum`` kernel (tile; stream-K (``slabs`` False): waves 0 =
    CUTLASS's stream-K heuristic, else split-K for that many waves; ``slabs``: the parallel slabs,
    their CTAs within ``waves`` waves; ``cluster``: CTAs sharing operand panels by TMA multicast;
    ``schedule``: ``coop`` (two warp groups on one 128- or 256-row tile) or ``pingpong`` (each warp
    group on a tile of its own, 64 or 128 rows; slabs only); warps and stages are not used: leave
    them)."""

    arch: int
    dtype: str
    tile: tuple[int, int, int]
    warps: tuple[int, int, int] = (2, 2, 1)
    stages: int = 4
    pass_: str = "wgrad"
    waves: int = 2
    slabs: bool = False
    cluster: tuple[int, int, int] = (1, 1, 1)
    schedule: str = "coop"

    op: ClassVar[str] = "linear"
    family: ClassVar[str] = "wgrad"
    PASSES: ClassVar[tuple[str, ...]] = ("wgrad",)
    ARCHS: ClassVar[tuple[int, ...]] = (89, 90)
    layout: ClassVar[str] = "nt"
    # What the profiler's GEMM rows describe (profile.gemm_row): default rasters.
    swizzle: ClassVar[int] = 1
    raster: ClassVar[str] = "h"

    def variant(self) -> str:
        if self.arch == 90:
            return (f"rsum_t{xs(self.tile)}_c{xs(self.cluster)}_sauto_{self.schedule}_"
                    f"{'ps' if self.slabs else 'sk'}_a8_k{self.waves}")
        return f"kred_t{xs(self.tile)}_w{xs(self.warps)}_s{self.stages}_a8" + ("" if self.waves == 2 else f"_k{self.waves}")

    @classmethod
    def from_variant(cls, head: NameHead) -> LinearWgradSpec | None:
        if head.arch == 90:
            m = _VARIANT_SM90.fullmatch(head.variant)
            return cls(90, head.dtype, triple(m["t"]), pass_=head.pass_, waves=int(m["k"]),
                       slabs=m["sched"] == "ps", cluster=triple(m["c"]), schedule=m["ws"]) if m else None
        m = _VARIANT.fullmatch(head.variant)
        if not m:
            return None
        return cls(head.arch, head.dtype, triple(m["t"]), triple(m["w"]), int(m["s"]), head.pass_, int(m["k"] or 2))

    def validate(self) -> None:
        self.check_common()
        if self.arch == 90:
            self._validate_sm90()
            return
        if self.slabs:
            raise SpecError("the parallel-slab row split is an sm90 (rsum) kernel's; sm89's kred splits in parallel already")
        if (self.cluster, self.schedule) != ((1, 1, 1), "coop"):
            raise SpecError("clusters and the ping-pong schedule are the sm90 (rsum) kernel's")
        tm, tn, tk = self.tile
        if self.waves not in (1, 2, 4, 8):
            raise SpecError(f"wgrad split waves (CTAs per SM the row splits aim for) must be 1, 2, 4 or 8, got {self.waves}")
        check_sm80_tile(self.name, self.tile, self.warps, self.stages)

    def _validate_sm90(self) -> None:
        tm, tn, tk = self.tile
        if (self.warps, self.stages) != (LinearWgradSpec.warps, LinearWgradSpec.stages):
            raise SpecError("the sm90 wgrad kernel has no warps / stages to set (wgmma warp groups, auto stages)")
        if self.schedule not in ("coop", "pingpong"):
            raise SpecError(f"sm90 wgrad schedule must be coop or pingpong, got {self.schedule!r}")
        # cooperative: two warp groups split the tile's rows (128 or 256); ping-pong: each warp group
        # owns a whole tile (64 or 128 rows)
        rows = (128, 256) if self.schedule == "coop" else (64, 128)
        if tm not in rows or tn % 16 or not 16 <= tn <= 256 or tk != 64:
            raise SpecError(f"sm90 {self.schedule} wgrad tile must be ({'|'.join(map(str, rows))}, 16..256 by 16, 64), "
                            f"got {self.tile}")
        check_sm90_cluster(self.cluster)
        if self.schedule == "pingpong" and not self.slabs:
            raise SpecError("the ping-pong wgrad splits its rows in parallel slabs (CUTLASS's stream-K is cooperative-only)")
        if self.slabs and self.waves not in (1, 2):
            raise SpecError(f"sm90 parallel-slab wgrad waves must be 1 or 2 (CTA waves the slabs may fill), got {self.waves}")
        if self.waves not in (0, 1, 2):
            raise SpecError(f"sm90 wgrad waves must be 0 (stream-K heuristic), 1 or 2 (split-K), got {self.waves}")

    def instantiation(self) -> str:
        """The kernel's ``.cu``: operators/linear/wgrad_sm80.cuh (``kred``) or wgrad_sm90.cuh
        (``rsum``) with this spec's parameters."""
        lines = [f"using Element = {CUTLASS_ELEMENT[self.dtype]};",
                 f"static constexpr int kWaves = {self.waves};"]
        if self.arch == 90:
            kernel_schedule, epilogue_schedule = SM90_SCHEDULES[self.schedule]
            lines += [f"static constexpr bool kSlabs = {'true' if self.slabs else 'false'};",
                      f"using TileShape = {cute_shape(self.tile)};",
                      f"using ClusterShape = {cute_shape(self.cluster)};",
                      f"using KernelSchedule = {kernel_schedule};",
                      f"using EpilogueSchedule = {epilogue_schedule};"]
            how = "wgmma, rows in parallel fp32 slabs" if self.slabs else "wgmma, stream-K / split-K rows"
            header, template = "linear/wgrad_sm90.cuh", "WgradSm90"
        else:
            tm, tn, tk = self.tile
            wm, wn, wk = self.warps
            lines += [f"using ThreadblockShape = {gemm_shape(self.tile)};",
                      f"using WarpShape = {gemm_shape((tm // wm, tn // wn, tk // wk))};",
                      f"static constexpr int kStages = {self.stages};"]
            header, template, how = "linear/wgrad_sm80.cuh", "WgradSm80", "mma.sync, parallel split-K rows, db reduced"
        body = "\n".join(["struct Config {", *("  " + ln for ln in lines), "};",
                           f"using Kernel = {template}<Config>;"])
        return instantiation_file(self, headers=(header,), body=body, abi="wgrad",
                                  description=f"dW = dY^T X, db = rowsum(dY) ({how}); {self.dtype}; fp32 accumulation")


_VARIANT = re.compile(r"kred_t(?P<t>\d+x\d+x\d+)_w(?P<w>\d+x\d+x\d+)_s(?P<s>\d+)_a8(?:_k(?P<k>\d+))?")
_VARIANT_SM90 = re.compile(r"rsum_t(?P<t>\d+x\d+x\d+)_c(?P<c>\d+x\d+x\d+)_sauto_(?P<ws>coop|pingpong)_"
                           r"(?P<sched>sk|ps)_a8_k(?P<k>\d+)")

# The sweep's space: 64-wide tiles for the 64-channel stage-1 layers, wider ones for the MLPs.
_SPACE = (
    ((64, 64, 32), (2, 2, 1), 5),
    ((128, 64, 32), (2, 2, 1), 4),
    ((64, 128, 32), (2, 2, 1), 4),
    ((128, 128, 32), (2, 2, 1), 4),
    ((128, 128, 64), (2, 2, 1), 3),
    ((128, 256, 32), (2, 4, 1), 3),
    ((256, 128, 32), (4, 2, 1), 3),
)
# sm90: the wgmma tiles x (stream-K heuristic, split-K for one wave); 128 x 160 is the tile cuBLAS
# picked for CvT-13's stage-3 fc1 weight gradient (dW 1536 x 384 over 25,216 rows) on an H100,
# 2026-12-06, 47.6 us against our 128 x 128 stream-K's 61.5.
_SM90_SPACE = ((128, 64, 64), (128, 128, 64), (128, 160, 64), (128, 192, 64), (128, 256, 64), (256, 128, 64))
# Clustered (TMA multicast) and ping-pong SM90 kernels are built by name (``..._c2x2x1_sauto_pingpong_ps``)
# and are not in the sweep: seven of them, each tiling some of CvT-13's dW shapes in whole clusters
# (128 x 128 in 1 x 2 and 2 x 1, 128 x 192 in 1 x 2 and 2 x 2, ping-pong 64 x 128 alone and in 2 x 1,
# 64 x 192 in 2 x 2), beat the kernels the sweep selects on no CvT-13 weight gradient at batch 128 by
# more than 2% (H100, bf16, 2026-12-07: stage 2's fc2 101.8 us against 104.2; stage 3's q 43.9 at
# best against 39.5, fc1 73.2 against 63.1; .ci/wgrad_peer.py, profiles/NOTES.md).


def wgrad_candidates(dtype: str, arch: int = 89) -> list[LinearWgradSpec]:
    """The sweep's space: every SM80-class tile with row splits for 2 and for 4 CTAs per SM; on the
    sm90 path also the SM90 tiles, stream-K (k0), one-wave split-K (k1) and parallel slabs within
    one and two waves."""
    out = [LinearWgradSpec(89, dtype, t, w, s, waves=v) for t, w, s in _SPACE for v in (2, 4)]
    if arch == 90:
        out += [LinearWgradSpec(90, dtype, t, waves=v) for t in _SM90_SPACE for v in (0, 1)]
        out += [LinearWgradSpec(90, dtype, t, waves=v, slabs=True) for t in _SM90_SPACE for v in (1, 2)]
    return out


def wgrad_heuristic(n: int, k: int, dtype: str) -> LinearWgradSpec:
    """dW is (n, k): 64-wide tiles when it is small (stage 1), 128 x 128 otherwise (SM80-class:
    the kernel that serves both paths, db fused)."""
    if n <= 64 or k <= 64:
        return LinearWgradSpec(89, dtype, (64, 64, 32), (2, 2, 1), 5)
    return LinearWgradSpec(89, dtype, (128, 128, 32), (2, 2, 1), 4)
