"""The Python API behind ``cvt-cutlass emit`` and ``cvt-cutlass build``: which kernels, and their sources."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from .epilogues import LINEAR_EPILOGUES
from .models import linear_problems
from .operators.linear import DTYPES, LinearSpec, candidates
from .selection import select_linear

OPS = ("linear",)
KERNEL_SETS = ("selected", "candidates")


def _as_tuple(v, default: Sequence) -> tuple:
    if v is None:
        return tuple(default)
    if isinstance(v, (str, int)):
        return (v,)
    return tuple(v)


def kernels_for(
    op: str = "linear",
    arch: int | Iterable[int] = 90,
    epilogue: str | Iterable[str] | None = None,
    dtype: str | Iterable[str] | None = None,
    *,
    which: str = "selected",
    model: str = "cvt-13",
    batches: Sequence[int] = (1, 32, 256),
    image_size: int | None = None,
    gpu: str | None = None,
) -> list[LinearSpec]:
    """Kernel specs of one op family.

    which="selected": the kernels the runtime picks (selection table, else heuristic) for every
    Linear problem of ``model`` at ``batches``, for each requested epilogue (also those the model
    does not use, so every epilogue has kernels). which="candidates": the profile sweep's space.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if which not in KERNEL_SETS:
        raise ValueError(f"which must be one of {KERNEL_SETS}, got {which!r}")
    archs = [int(a) for a in _as_tuple(arch, (89, 90))]
    epis = _as_tuple(epilogue, LINEAR_EPILOGUES)
    dtypes = _as_tuple(dtype, DTYPES)
    for e in epis:
        if e not in LINEAR_EPILOGUES:
            raise ValueError(f"unknown epilogue {e!r}; have {sorted(LINEAR_EPILOGUES)}")
    out: dict[str, LinearSpec] = {}
    for a in archs:
        for dt in dtypes:
            for e in epis:
                if which == "candidates":
                    specs = candidates(a, dt, e)
                else:
                    shapes = {(p.m, p.n, p.k) for b in batches for p in linear_problems(model, b, image_size)}
                    specs = [select_linear(m, n, k, dt, e, a, gpu).spec for m, n, k in sorted(shapes)]
                for s in specs:
                    out.setdefault(s.name, s)
    return list(out.values())


def emit(
    op: str = "linear",
    arch: int | Iterable[int] = 90,
    epilogue: str | Iterable[str] | None = None,
    dtype: str | Iterable[str] | None = None,
    out: str | Path = "cvt_cutlass_kernels",
    *,
    which: str = "selected",
    specs: Iterable[LinearSpec] | None = None,
    **kw,
) -> list[Path]:
    """Write one ``<procedural name>.cu`` per kernel (plus the ABI header) into ``out``. No GPU needed."""
    from .emitter import write_sources

    if specs is None:
        specs = kernels_for(op, arch, epilogue, dtype, which=which, **kw)
    return write_sources(specs, out)
