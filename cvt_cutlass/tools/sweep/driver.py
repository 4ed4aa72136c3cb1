"""The one sweep driver behind every ``cvt-cutlass profile`` sweep (GPU).

A sweep is a list of :class:`Item` (a problem on one kernel path in one dtype, with the candidate
kernels to try) and a :class:`Family` that knows the problem kind: its CSV schema (cutlass_profiler's
columns), its resume key, and how to make a :class:`Case` (random inputs, a reference, the
PyTorch / cuDNN peers, a raw launch of a kernel). :func:`run_sweep` builds every candidate in one
parallel nvcc pool, then per item: times each peer, checks each candidate against the reference
(outputs poisoned with NaN first; pass = error within 2x the worst peer's same-dtype error + the
family's floor), times the passing ones, and appends the item's rows to the CSV as soon as they
exist. Rows already in the CSV (``done``) are skipped: an interrupted sweep resumes.
"""

from __future__ import annotations

import csv
import datetime as _dt
import math
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..csvfile import append_csv

# A sweep times many candidates: fewer, shorter trials than the benchmark (which confirms the choice).
SWEEP_TRIALS = 11
SWEEP_TARGET_MS = 2.0
TORCH_DTYPES = ("fp16", "bf16")


@dataclass
class Item:
    """One problem of a sweep on one kernel path (arch 90 / 89) in one dtype."""

    arch: int
    dtype: str
    problem: Any
    candidates: list = field(default_factory=list)
    pass_: str = "fwd"


class Case(Protocol):
    """Random inputs of one item, an fp32 (or float64) reference, its peers and raw launches."""

    sets: int  # input sets the launches rotate through (problems smaller than the L2)

    def peers(self) -> dict[str, float]: ...  # peer name -> its relative error against the reference

    def peer_ms(self, name: str) -> float: ...  # the peer's GPU time

    def check(self, kid: int) -> float: ...  # outputs poisoned with NaN, one launch, relative error

    def launch(self, kid: int, i: int) -> None: ...  # one launch on input set i (what is timed)


class Family(Protocol):
    """A problem kind's schema and cases (tools/sweep/linear.py, conv.py, attention.py)."""

    columns: tuple[str, ...]
    floor: float  # the pass criterion's absolute floor

    def case(self, item: Item, gen) -> Case: ...

    def row(self, i: int, item: Item, provider: str, operation: str, disposition: str, status: str,
            ms: float | None, spec, extra: dict) -> dict: ...

    def key(self, row: dict) -> tuple: ...  # the resume key of a row (also of rows read back)

    def describe(self, item: Item) -> str: ...  # the progress line's problem


def finish_row(row: dict, kernel_columns: dict | None, runtime_ms: float | None, extra: dict | None) -> dict:
    """A profile row's tail, the same in every schema: the kernel's description columns (kernel
    rows), the runtime with its GB/s and GFLOP/s from the row's Bytes and Flops (measured rows), then
    the run's columns (gpu, date, path, ...)."""
    row.update(kernel_columns or {})
    if runtime_ms:
        row.update(Runtime=f"{runtime_ms:.6f}", **{"GB/s": f"{row['Bytes'] / runtime_ms / 1e6:.1f}",
                                                    "GFLOPs": f"{row['Flops'] / runtime_ms / 1e6:.1f}"})
    row.update(extra or {})
    return row


def read_rows(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def best_cutlass_ms(rows: Iterable[dict]) -> float:
    """The fastest timed CUTLASS row's runtime (ms) among a problem's rows; nan if none ran."""
    return min((float(r["Runtime"]) for r in rows if r["Provider"] == "cutlass" and r.get("Runtime")),
               default=float("nan"))


def build_all(specs, device_cc: int, jobs: int | None) -> set[str]:
    """Build every kernel a sweep will time in one parallel nvcc pool; the names of those that
    failed to compile (their log is printed), which the sweep records as not_supported."""
    from ... import runtime
    from ...build import KernelBuildError

    try:
        runtime.prebuild(list(specs), device_cc, jobs=jobs)
    except KernelBuildError as e:
        print(e, file=sys.stderr)
        return {name for name, _, _ in e.failures}
    return set()


def run_sweep(family: Family, items: list[Item], out: Path, done: set, *, jobs: int | None = None,
              stage: str = "") -> list[dict]:
    """Every item's peer and candidate rows, appended to ``out`` item by item (see the module
    docstring); ``done`` (resume keys) is updated with what was written."""
    import torch

    from ... import runtime
    from ...build import cutlass_version

    dev = runtime.device_info(torch.cuda.current_device())
    runtime.ensure_binding()
    broken = build_all({s.name: s for it in items for s in it.candidates}.values(), dev.cc, jobs)
    base0 = {"gpu": dev.name, "date": _dt.datetime.now().strftime("%Y-%m-%d"), "cutlass_version": cutlass_version()}
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []
    t0 = time.perf_counter()
    for i, item in enumerate(items):
        new = _item_rows(family, i, item, {**base0, "kernel_path": f"sm{item.arch}"}, broken, done, dev.cc, gen)
        append_csv(out, new, family.columns, ignore_extra=True)
        rows += new
        done.update(family.key(r) for r in new)
        el = time.perf_counter() - t0
        eta = el / (i + 1) * (len(items) - i - 1)
        print(f"[profile{' ' + stage if stage else ''} {i + 1}/{len(items)} {el:.0f}s, ETA {eta:.0f}s] "
              f"{family.describe(item)}: best new cutlass {best_cutlass_ms(new):.4f} ms", flush=True)
    return rows


def _item_rows(family: Family, i: int, item: Item, base: dict, broken: set, done: set, cc: int, gen) -> list[dict]:
    """One item's rows: each peer's (timed unless already in the CSV), then each candidate's."""
    case = family.case(item, gen)
    errs = case.peers()
    peer_err = max(errs.values())
    base = {**base, "peer_rel_err": f"{peer_err:.3e}"}
    rows = []
    for name, err in errs.items():
        extra = {**base, "rel_err": f"{err:.3e}"}
        if family.key(family.row(i, item, "pytorch", name, "passed", "success", None, None, extra)) not in done:
            rows.append(family.row(i, item, "pytorch", name, "passed", "success", case.peer_ms(name), None, extra))
    for spec in item.candidates:
        if family.key(family.row(i, item, "cutlass", spec.name, "", "", None, spec, base)) in done:
            continue
        rows.append(_candidate_row(family, case, i, item, spec, base, spec.name in broken, cc, peer_err))
    return rows


def _candidate_row(family: Family, case: Case, i: int, item: Item, spec, base: dict, broken: bool, cc: int,
                   peer_err: float) -> dict:
    """A candidate's row: not_supported (did not build, or refused the problem), incorrect, or
    passed with its median time."""
    from ... import runtime
    from ..timing import time_cuda

    if broken:
        return family.row(i, item, "cutlass", spec.name, "not_supported", "error", None, spec, base)
    kid = runtime.load_kernel(spec, cc)
    try:
        err = case.check(kid)
    except RuntimeError as e:
        return family.row(i, item, "cutlass", spec.name, "not_supported", "error", None, spec,
                          {**base, "rel_err": str(e).splitlines()[0][:80]})
    ok = math.isfinite(err) and err <= 2 * peer_err + family.floor
    ms = time_cuda(lambda j: case.launch(kid, j), sets=case.sets, trials=SWEEP_TRIALS,
                   target_ms=SWEEP_TARGET_MS).median_ms if ok else None
    return family.row(i, item, "cutlass", spec.name, "passed" if ok else "incorrect", "success", ms, spec,
                      {**base, "rel_err": f"{err:.3e}"})


def sweep_items(arches, dtypes, problems, candidates_of, passes=("fwd",)) -> list[Item]:
    """The items of a sweep: every (arch, dtype, problem, pass) with ``candidates_of(arch, dtype,
    problem, pass)``; None from it drops the item (a pass the problem does not run)."""
    out = []
    for arch in arches:
        for dt in dtypes:
            for p in problems:
                for pass_ in passes:
                    cands = candidates_of(arch, dt, p, pass_)
                    if cands is not None:
                        out.append(Item(arch, dt, p, list(cands), pass_))
    return out


# ----------------------------------------------------------------------------- roofline ceilings
CEILING_COLUMNS = ("gpu", "date", "dtype", "kind", "problem", "runtime_ms", "value", "unit")


def ceilings_path(profile_csv: Path) -> Path:
    """Where a sweep keeps the roofline ceilings it measured: ``<stem>_ceilings.csv`` beside it."""
    return Path(profile_csv).with_name(Path(profile_csv).stem + "_ceilings.csv")


def measure_ceilings(dtypes, copy_bytes: int = 2**30, gemm_mnk: int = 8192) -> list[dict]:
    """The roofline's ceilings on this GPU, measured: device-to-device copy bandwidth (GB/s,
    read + write bytes) and dense GEMM throughput of PyTorch's matmul (TFLOP/s) per dtype."""
    import torch

    from ... import runtime
    from ..timing import time_cuda

    dev = runtime.device_info(torch.cuda.current_device())
    base = {"gpu": dev.name, "date": _dt.datetime.now().strftime("%Y-%m-%d")}
    gen = torch.Generator(device="cuda").manual_seed(1)
    src = torch.rand(copy_bytes // 4, device="cuda", generator=gen)
    dst = torch.empty_like(src)
    t = time_cuda(lambda i, d=dst, s=src: d.copy_(s), trials=21, target_ms=20, graph=False)
    rows = [{**base, "dtype": "fp32", "kind": "copy_bandwidth", "problem": f"{copy_bytes} B",
             "runtime_ms": f"{t.median_ms:.4f}", "value": f"{2 * copy_bytes / t.median_ms / 1e6:.1f}", "unit": "GB/s"}]
    del src, dst
    n = gemm_mnk
    for dt in dtypes:
        tdt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dt]
        x = torch.randn(n, n, device="cuda", generator=gen).to(tdt)
        y = torch.randn(n, n, device="cuda", generator=gen).to(tdt)
        t = time_cuda(lambda i, x=x, y=y: torch.mm(x, y), trials=21, target_ms=20, graph=False)
        rows.append({**base, "dtype": dt, "kind": "gemm_tflops", "problem": f"{n}x{n}x{n} torch.mm",
                     "runtime_ms": f"{t.median_ms:.4f}", "value": f"{2 * n**3 / t.median_ms / 1e9:.1f}",
                     "unit": "TFLOP/s"})
    return rows


def append_ceilings(path: Path, rows: list[dict]) -> None:
    append_csv(path, rows, CEILING_COLUMNS)
