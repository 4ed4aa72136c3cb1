"""Kernel selection: the tuned table (operators/<op>/<op>_selection.csv) first, a heuristic otherwise.

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
from dataclasses import dataclass
from pathlib import Path

from .operators.linear import LinearSpec, heuristic_spec
from .operators.spec import parse_kernel_name

TABLE_COLUMNS = (
    "op", "arch", "gpu", "cutlass", "dtype", "epilogue", "m", "n", "k",
    "kernel", "runtime_ms", "peer_ms", "date",
)
_KEY = ("op", "arch", "gpu", "dtype", "epilogue", "m", "n", "k")
MAX_M_RATIO = 16.0


@dataclass(frozen=True)
class Choice:
    spec: LinearSpec  # or a conv family's spec
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


def _sort_key(r: dict):
    return (r["op"], r["arch"], r["gpu"], r["dtype"], r["epilogue"], int(r["n"]), int(r["k"]), int(r["m"]))


def table_path(op: str, directory: str | Path | None = None) -> Path:
    """<directory>/<op>_selection.csv; by default $CVT_CUTLASS_SELECTION_DIR if set, else the
    op family's packaged table, operators/<op>/<op>_selection.csv."""
    d = directory or os.environ.get("CVT_CUTLASS_SELECTION_DIR")
    if d:
        return Path(d) / f"{op}_selection.csv"
    from .build import OPERATORS

    return OPERATORS / op / f"{op}_selection.csv"


_tables: dict[Path, SelectionTable] = {}
_tables_lock = threading.Lock()


def get_table(op: str) -> SelectionTable:
    path = table_path(op)
    with _tables_lock:
        if path not in _tables:
            _tables[path] = SelectionTable.load(path)
        return _tables[path]


def reload_tables() -> None:
    """Read the tables again (after a sweep wrote them); every op chooses its kernels again."""
    from .runtime import clear_plans

    with _tables_lock:
        _tables.clear()
    clear_plans()
    _select_cached.cache_clear()
    select_conv2d.cache_clear()
    select_dwconv.cache_clear()
    select_dwconv_bn.cache_clear()
    select_attention.cache_clear()
    select_layernorm.cache_clear()
    select_linear_backward.cache_clear()


@functools.lru_cache(maxsize=4096)
def _select_cached(m: int, n: int, k: int, dtype: str, epilogue: str, arch: int, gpu: str | None) -> Choice:
    name = get_table("linear").lookup("linear", arch, dtype, epilogue, m, n, k, gpu)
    if name is not None:
        spec = parse_kernel_name(name)
        if (spec.arch, spec.dtype, spec.epilogue) == (arch, dtype, epilogue):
            return Choice(spec, "table")
    return Choice(heuristic_spec(m, n, k, dtype, epilogue, arch), "heuristic")


def select_linear(m: int, n: int, k: int, dtype: str, epilogue: str, arch: int,
                  gpu: str | None = None) -> Choice:
    """The kernel for one Linear problem on one path (memoised; callers count the source)."""
    return _select_cached(m, n, k, dtype, epilogue, arch, gpu)


@functools.lru_cache(maxsize=4096)
def select_linear_backward(pass_: str, m: int, n: int, k: int, dtype: str, epilogue: str, arch: int,
                           gpu: str | None = None) -> Choice:
    """The kernel of one Linear backward GEMM: ``dgrad`` (m rows, n = the layer's K, k = its N) or
    ``wgrad`` (m rows, dW (n, k); epilogue ``dbias`` or ``none``: whether it also sums db). Table
    rows carry the epilogue as ``<pass>:<epilogue>``. SM80-class wgrad kernels (arch 89 specs)
    serve both paths, SM90 ones the sm90 path; every wgrad kernel serves both of its epilogues, so
    a wgrad problem the table lists only with the other epilogue takes that row's kernel."""
    from .operators.linear import wgrad_heuristic

    keys = [epilogue] + ([e for e in ("dbias", "none") if e != epilogue] if pass_ == "wgrad" else [])
    for key in keys:
        name = get_table("linear").lookup("linear", arch, dtype, f"{pass_}:{key}", m, n, k, gpu)
        if name is None:
            continue
        spec = parse_kernel_name(name)
        if spec.pass_ == pass_ and spec.dtype == dtype and (spec.arch == arch or (pass_ == "wgrad" and spec.arch == 89)):
            return Choice(spec, "table")
    if pass_ == "wgrad":
        return Choice(wgrad_heuristic(n, k, dtype), "heuristic")
    return Choice(heuristic_spec(m, n, k, dtype, epilogue, arch, pass_=pass_), "heuristic")


@functools.lru_cache(maxsize=4096)
def select_conv2d(m: int, n: int, k: int, channels: int, dtype: str, arch: int, gpu: str | None = None):
    """The implicit-GEMM conv kernel for output pixels m = N*P*Q, n = K output channels,
    k = R*S*C (C = ``channels`` as the kernel reads them: the stem padded to 4).

    The conv kernels are SM80-class on both paths (arch 89 specs); ``arch`` says which path's
    table rows to prefer."""
    from .operators.conv2d import conv_heuristic

    name = get_table("conv2d").lookup("conv2d", arch, dtype, "bias", m, n, k, gpu)
    if name is not None:
        spec = parse_kernel_name(name)
        # An SM90 (wgmma) kernel serves only the sm90 path; SM80-class ones serve both.
        if spec.dtype == dtype and spec.channels_ok(channels) and (spec.arch != 90 or arch == 90):
            return Choice(spec, "table")
    return Choice(conv_heuristic(dtype, channels, n), "heuristic")


@functools.lru_cache(maxsize=4096)
def select_conv2d_backward(pass_: str, m: int, n: int, k: int, channels: int, dtype: str, arch: int,
                           gpu: str | None = None):
    """The conv backward kernel (``pass_`` "dgrad" or "wgrad") for the conv of output pixels
    m = N*P*Q, n = K output channels, k = R*S*C (C = ``channels`` as the kernels read them). Table
    rows carry the pass as the epilogue column. The kernels are SM80-class on both paths (arch 89
    specs); ``arch`` says which path's table rows to prefer."""
    from .operators.conv2d import conv_bwd_heuristic

    name = get_table("conv2d").lookup("conv2d", arch, dtype, pass_, m, n, k, gpu)
    if name is not None:
        spec = parse_kernel_name(name)
        if spec.pass_ == pass_ and spec.dtype == dtype and spec.channels_ok(channels):
            return Choice(spec, "table")
    return Choice(conv_bwd_heuristic(pass_, dtype, channels, n), "heuristic")


@functools.lru_cache(maxsize=4096)
def select_dwconv(m: int, channels: int, stride: int, dtype: str, arch: int, gpu: str | None = None):
    """The depthwise 3x3 kernel for m = N*P*Q output pixels of ``channels`` channels."""
    from .operators.dwconv import dwconv_heuristic

    name = get_table("dwconv").lookup("dwconv", arch, dtype, f"bias_st{stride}", m, channels, 9, gpu)
    if name is not None:
        spec = parse_kernel_name(name)
        if (spec.arch, spec.dtype, spec.stride) == (arch, dtype, stride):
            return Choice(spec, "table")
    return Choice(dwconv_heuristic(dtype, stride, arch), "heuristic")


@functools.lru_cache(maxsize=4096)
def select_dwconv_bn(m: int, channels: int, stride: int, dtype: str, arch: int, gpu: str | None = None,
                     pass_: str = "fwd"):
    """The depthwise 3x3 conv + training BatchNorm kernel of one pass (``fwd`` / ``bwd``) for
    m = N*P*Q output pixels of ``channels`` channels: table key (m, n, k) = (m, channels, 9),
    epilogue ``bn_<pass>_st<stride>``."""
    from .operators.dwconv import dwconv_bn_heuristic

    name = get_table("dwconv").lookup("dwconv", arch, dtype, f"bn_{pass_}_st{stride}", m, channels, 9, gpu)
    if name is not None:
        spec = parse_kernel_name(name)
        if (spec.arch, spec.dtype, getattr(spec, "stride", None), spec.pass_) == (arch, dtype, stride, pass_) \
                and getattr(spec, "groups", None) is not None:
            return Choice(spec, "table")
    return Choice(dwconv_bn_heuristic(dtype, channels, stride, arch, pass_), "heuristic")


@functools.lru_cache(maxsize=4096)
def select_attention(batch: int, heads: int, lq: int, lkv: int, head_dim: int, dtype: str, arch: int,
                     gpu: str | None = None, pass_: str = "fwd"):
    """The attention kernel for one problem: table key (m, n, k) = (batch * Lq, Lkv, head dim),
    epilogue = "h<heads>" (forward) or "h<heads>_bwd" (the backward kernels)."""
    from .operators.attention import attn_bwd_heuristic, attn_heuristic

    epilogue = f"h{heads}" if pass_ == "fwd" else f"h{heads}_{pass_}"
    name = get_table("attention").lookup("attention", arch, dtype, epilogue, batch * lq, lkv, head_dim, gpu)
    if name is not None:
        spec = parse_kernel_name(name)
        ok = spec.serves(head_dim, lq) if spec.arch == 90 else spec.serves(head_dim)
        if spec.dtype == dtype and spec.pass_ == pass_ and ok and (spec.arch != 90 or arch == 90):
            return Choice(spec, "table")
    if pass_ == "fwd":
        return Choice(attn_heuristic(dtype, head_dim, lq, arch), "heuristic")
    return Choice(attn_bwd_heuristic(dtype, head_dim, arch), "heuristic")


@functools.lru_cache(maxsize=4096)
def select_layernorm(rows: int, channels: int, dtype: str, arch: int, gpu: str | None = None, pass_: str = "fwd"):
    """The LayerNorm kernel for ``rows`` rows (all images) of ``channels`` channels: table key
    (m, n, k) = (rows, channels, 1), epilogue "ln"."""
    from .operators.layernorm import layernorm_heuristic

    epilogue = "ln" if pass_ == "fwd" else f"ln_{pass_}"
    name = get_table("layernorm").lookup("layernorm", arch, dtype, epilogue, rows, channels, 1, gpu)
    if name is not None:
        spec = parse_kernel_name(name)
        if (spec.arch, spec.dtype, spec.channels, spec.pass_) == (arch, dtype, channels, pass_):
            return Choice(spec, "table")
    return Choice(layernorm_heuristic(dtype, channels, arch, pass_), "heuristic")
