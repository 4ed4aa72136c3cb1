"""The Linear family's search space: what a profile sweep tries (:func:`candidates`,
:func:`backward_candidates`, :func:`refinements`) and what runs before one (:func:`heuristic_spec`)."""

from __future__ import annotations

from ..spec import SpecError
from .spec import LinearSpec

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
# epilogue tile, stages.) Non-persistent 2-CTA-per-SM kernels (128x64 / 128x128 with 3 stages,
# 128x192 with 2) and 64x256 pingpong ran 1.5-5x slower than the best on every CvT-13 dgrad problem
# at batch 128 (H200, 2026-11-22): not in the space. On the SM80-class path the forward's whole space.
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
        from .wgrad import wgrad_candidates

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
