"""Selection tables from profile rows: what ``profile --update-table`` and ``cvt-cutlass table``
write into the runtime's tables (:mod:`cvt_cutlass.selection`)."""

from __future__ import annotations

from pathlib import Path

from . import attention, conv, linear
from .driver import read_rows

# Each family's profile schema, told apart by a column only it has, and its table key.
_TABLE_KEYS = (("gemm_kind", linear.table_key), ("conv_kind", conv.table_key), ("heads", attention.table_key))


def update_tables(rows: list[dict], key_fn, table_dir: str | None = None, tolerance: float = 0.0) -> list[Path]:
    """Write the selection rows of profile ``rows`` (any family; ``key_fn(row)`` gives its table
    key (op, arch, dtype, epilogue, m, n, k)): per problem the kernel :func:`operators.selection.choose_kernels`
    picks from the passing measurements (the fastest, or with ``tolerance`` > 0 one of a smaller
    kernel set within that fraction of the fastest), with the fastest peer time beside it."""
    from ...build import cutlass_version
    from ...operators.selection import SelectionTable, choose_kernels, table_path
    from ...runtime import reload_tables

    measured: dict[tuple, dict[str, float]] = {}
    peer: dict[tuple, float] = {}
    info: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if not r.get("Runtime"):
            continue
        kf = key_fn(r)
        key = (*kf[:2], r["gpu"], *kf[2:])  # (op, arch, gpu, dtype, epilogue, m, n, k)
        t = float(r["Runtime"])
        if r["Provider"] == "pytorch":
            peer[key] = min(t, peer.get(key, t))
        elif r["Provider"] == "cutlass" and r["Disposition"] == "passed":
            measured.setdefault(key, {})[r["Operation"]] = t
            info.setdefault(key, {})[r["Operation"]] = r  # the chosen kernel's own row (its date)
    tables: dict[str, SelectionTable] = {}
    for key, name in choose_kernels(measured, tolerance).items():
        op, arch, gpu, dt, epi, m, n, k = key
        t = tables.setdefault(op, SelectionTable.load(table_path(op, table_dir)))
        t.upsert({"op": op, "arch": arch, "gpu": gpu, "cutlass": cutlass_version(), "dtype": dt, "epilogue": epi,
                  "m": m, "n": n, "k": k, "kernel": name, "runtime_ms": f"{measured[key][name]:.6f}",
                  "peer_ms": f"{peer[key]:.6f}" if key in peer else "", "date": info[key][name]["date"]})
    out = [t.save(table_path(op, table_dir)) for op, t in tables.items()]
    reload_tables()
    return out


def table_key_of(rows: list[dict], what: str = "profile rows"):
    """The table-key function of profile rows of any family (by their schema's columns)."""
    for column, key_fn in _TABLE_KEYS:
        if rows and column in rows[0]:
            return key_fn
    raise ValueError(f"{what}: not a cvt-cutlass profile CSV (no GEMM, Conv2d or attention columns)")


def update_from_rows(rows: list[dict], table_dir: str | None = None, tolerance: float = 0.0) -> list[Path]:
    """The selection tables of in-memory profile rows of one family (any of the three schemas)."""
    return update_tables(rows, table_key_of(rows), table_dir, tolerance) if rows else []


def rewrite_tables(profile_csv: str | Path, table_dir: str | None = None, tolerance: float = 0.0) -> list[Path]:
    """The selection tables of a profile CSV measured earlier, whatever its family."""
    rows = read_rows(Path(profile_csv))
    if not rows:
        raise ValueError(f"{profile_csv}: no profile rows")
    return update_tables(rows, table_key_of(rows, str(profile_csv)), table_dir, tolerance)
