"""Kernel selection: the tuned table (operators/<op>/<op>_selection.csv) first, a heuristic otherwise.

This module is the machinery every family shares; each family's ``select.py`` holds its table key
(which epilogue string and (m, n, k) a problem is filed under) and its ``select_*`` functions.

A table row says: for this (op, arch, gpu, dtype, epilogue) and problem (m, n, k), the best
passing kernel measured was ``kernel`` (a procedural name). A lookup takes rows with the same
op/arch/dtype/epilogue/n/k, prefers the running GPU's rows, and picks the row whose m is nearest
in log scale, if within a factor of 16 (the batch changes m; the tile that wins at m = 802816
need not win at m = 197). Anything else gets the op family's heuristic, and is counted as such.

The file is plain CSV, sorted, one row per problem: readable and diff-friendly.
"""

from __future__ import annotations

import csv
import functools
import io
import math
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .spec import KernelSpec, parse_kernel_name

TABLE_COLUMNS = (
    "op", "arch", "gpu", "cutlass", "dtype", "epilogue", "m", "n", "k",
    "kernel", "runtime_ms", "peer_ms", "date",
)
_KEY = ("op", "arch", "gpu", "dtype", "epilogue", "m", "n", "k")
MAX_M_RATIO = 16.0


@dataclass(frozen=True)
class Choice:
    spec: KernelSpec
    source: str  # "table" or "heuristic"


class SelectionTable:
    def __init__(self, rows: list[dict] | None = None, path: Path | None = None):
        self.rows: list[dict] = []
        self.path = path
        self._index: dict[tuple, list[dict]] = {}
        for r in rows or []:
            self.upsert(r)

    # ------------------------------------------------------------------ io
    @classmethod
    def load(cls, path: str | Path) -> SelectionTable:
        path = Path(path)
        if not path.is_file():
            return cls(path=path)
        lines = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
        rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
        missing = set(TABLE_COLUMNS) - set(rows[0]) if rows else set()
        if missing:
            raise ValueError(f"{path}: selection table lacks columns {sorted(missing)}")
        return cls(rows, path)

    def dumps(self) -> str:
        out = io.StringIO()
        out.write("# cvt_cutlass kernel selection table (written by `cvt-cutlass profile`/`bench`).\n")
        out.write("# One row per problem: the best passing kernel measured, and PyTorch's time.\n")
        w = csv.DictWriter(out, fieldnames=TABLE_COLUMNS, lineterminator="\n", extrasaction="ignore")
        w.writeheader()
        for r in sorted(self.rows, key=_sort_key):
            w.writerow(r)
        return out.getvalue()

    def save(self, path: str | Path | None = None) -> Path:
        path = Path(path or self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.dumps())
        os.replace(tmp, path)
        return path

    # ------------------------------------------------------------------ edit / query
    def upsert(self, row: dict) -> None:
        row = {c: str(row.get(c, "")) for c in TABLE_COLUMNS}
        key = tuple(row[c] for c in _KEY)
        self.rows = [r for r in self.rows if tuple(r[c] for c in _KEY) != key]
        self.rows.append(row)
        self._index.clear()

    def _rows_for(self, op: str, arch: int, dtype: str, epilogue: str, n: int, k: int) -> list[dict]:
        if not self._index:
            for r in self.rows:
                idx = (r["op"], r["arch"], r["dtype"], r["epilogue"], r["n"], r["k"])
                self._index.setdefault(idx, []).append(r)
        return self._index.get((op, str(arch), dtype, epilogue, str(n), str(k)), [])

    def critical_ms(self, op: str, arch: int, dtype: str, epilogue: str, n: int, k: int) -> list[float]:
        """The m values where :meth:`lookup`'s answer for (n, k) can change: each row's m / 16
        and m * 16 (the reach of a row), and the geometric mean of every two rows' m (where the
        nearest row changes). Between two neighbouring critical values the answer is constant."""
        ms = sorted({int(r["m"]) for r in self._rows_for(op, arch, dtype, epilogue, n, k)})
        out = [m * f for m in ms for f in (1 / MAX_M_RATIO, MAX_M_RATIO)]
        out += [math.sqrt(a * b) for i, a in enumerate(ms) for b in ms[i + 1:]]
        return sorted(out)

    def lookup(self, op: str, arch: int, dtype: str, epilogue: str, m: int, n: int, k: int,
               gpu: str | None = None) -> str | None:
        rows = self._rows_for(op, arch, dtype, epilogue, n, k)
        best, best_d = None, None
        for r in rows:
            d = abs(math.log2(max(m, 1)) - math.log2(max(int(r["m"]), 1)))
            if d > math.log2(MAX_M_RATIO):
                continue
            score = (0 if gpu and r["gpu"] == gpu else 1, d)
            if best_d is None or score < best_d:
                best, best_d = r, score
        return best["kernel"] if best else None


def choose_kernels(measured: dict[tuple, dict[str, float]], tolerance: float = 0.0) -> dict[tuple, str]:
    """The kernel to use for each measured problem: ``measured[key] = {kernel: runtime}`` with key
    (op, arch, gpu, dtype, ...).

    tolerance 0: each problem's fastest kernel. tolerance > 0: per (op, arch, gpu, dtype), a small
    set of kernels (greedy set cover) such that every problem gets a kernel within
    ``1 + tolerance`` of its fastest measured one, and each problem the fastest of that set.
    Fewer distinct kernels is fewer kernels for a model to compile on its first run.
    """
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    groups: dict[tuple, list[tuple]] = {}
    for key, times in measured.items():
        if times:
            groups.setdefault(key[:4], []).append(key)
    out: dict[tuple, str] = {}
    for keys in groups.values():
        ok = {k: {n for n, t in measured[k].items() if t <= min(measured[k].values()) * (1 + tolerance)}
              for k in keys}
        chosen = _greedy_cover(ok)
        for k in keys:
            out[k] = min((n for n in ok[k] if n in chosen), key=lambda n, k=k: (measured[k][n], n))
    return out


def _greedy_cover(ok: dict[tuple, set[str]]) -> set[str]:
    """A small set of kernels containing an acceptable one for every problem: repeatedly take the
    kernel acceptable for the most problems not yet covered (ties by name, for stable tables)."""
    chosen: set[str] = set()
    left = set(ok)
    while left:
        counts: dict[str, int] = {}
        for k in left:
            for n in ok[k]:
                counts[n] = counts.get(n, 0) + 1
        best = max(counts, key=lambda n: (counts[n], n))
        chosen.add(best)
        left = {k for k in left if best not in ok[k]}
    return chosen


def batch_probes(op: str, arch: int, dtype: str, epilogue: str, n: int, k: int, m_per_image: int,
                 max_batch: int) -> list[int]:
    """Batch sizes in [1, max_batch] at which to evaluate a selection whose problem has
    m = batch * m_per_image, so that the kernels chosen there are all the kernels any batch in that
    range chooses: both ends and the batches on either side of every critical m."""
    probes = {1, max_batch}
    for c in get_table(op).critical_ms(op, arch, dtype, epilogue, n, k):
        b = c / max(m_per_image, 1)
        for v in (math.floor(b) - 1, math.floor(b), math.ceil(b), math.ceil(b) + 1):
            if 1 <= v <= max_batch:
                probes.add(v)
    return sorted(probes)


BatchesOf = Callable[[str, str, int, int, int], Iterable[int]]
"""``batches_of(op, epilogue, m_per_image, n, k)``: the batch sizes at which a family's
``model_specs`` evaluates the choice for a problem filed under (op, epilogue, m, n, k) with
m = batch * m_per_image."""


def fixed_batches(batches: Iterable[int]) -> BatchesOf:
    """The same batch sizes for every problem."""
    batches = tuple(batches)
    return lambda op, epilogue, m1, n, k: batches


def probed_batches(arch: int, dtype: str, max_batch: int) -> BatchesOf:
    """The batch sizes of :func:`batch_probes`: every choice any batch in [1, max_batch] makes."""
    return lambda op, epilogue, m1, n, k: batch_probes(op, arch, dtype, epilogue, n, k, m1, max_batch)


def _sort_key(r: dict):
    return (r["op"], r["arch"], r["gpu"], r["dtype"], r["epilogue"], int(r["n"]), int(r["k"]), int(r["m"]))


def table_path(op: str, directory: str | Path | None = None) -> Path:
    """<directory>/<op>_selection.csv; by default $CVT_CUTLASS_SELECTION_DIR if set, else the
    op family's packaged table, operators/<op>/<op>_selection.csv."""
    d = directory or os.environ.get("CVT_CUTLASS_SELECTION_DIR")
    if d:
        return Path(d) / f"{op}_selection.csv"
    return Path(__file__).resolve().parent / op / f"{op}_selection.csv"


_tables: dict[Path, SelectionTable] = {}
_tables_lock = threading.Lock()


def get_table(op: str) -> SelectionTable:
    path = table_path(op)
    with _tables_lock:
        if path not in _tables:
            _tables[path] = SelectionTable.load(path)
        return _tables[path]


_selectors: list = []


def selector(fn):
    """A family's memoised ``select_*`` function: its answers are forgotten by :func:`clear`."""
    cached = functools.lru_cache(maxsize=4096)(fn)
    _selectors.append(cached)
    return cached


def clear() -> None:
    """Forget the tables read and every family's memoised choices (the runtime's
    ``reload_tables`` also drops the plans built from them)."""
    with _tables_lock:
        _tables.clear()
    for fn in _selectors:
        fn.cache_clear()


def lookup_spec(op: str, arch: int, dtype: str, epilogue: str, m: int, n: int, k: int,
                gpu: str | None = None) -> KernelSpec | None:
    """The spec of the table row nearest to the problem, or None (the caller checks it serves)."""
    name = get_table(op).lookup(op, arch, dtype, epilogue, m, n, k, gpu)
    return None if name is None else parse_kernel_name(name)
