"""Profile sweeps in cutlass_profiler's CSV schema, and the selection table they feed (GPU).

``cvt-cutlass profile --op linear --model cvt-13 --batch 1,32,256 --dtype fp16 --arch 90 --out F``
enumerates the Linear problems the model runs, builds every candidate instantiation (parallel,
progress bar), checks each against an fp32 reference (output poisoned with NaN first; pass = error
within 2x PyTorch's same-dtype error + 1e-4), times the passing ones and PyTorch's unfused sequence
in the same process, and appends one row per (problem, kernel) to ``F``. Rows already in ``F`` are
skipped, so an interrupted sweep resumes. ``--update-table`` writes the fastest passing kernel of
each problem into ``profiles/linear_selection.csv``.
"""

from __future__ import annotations

import csv
import datetime as _dt
import math
import sys
import time
from pathlib import Path

from .csvfile import append_csv
from .operators.spec import DT_FROM_TAG
from .operators.spec import DT_TAG as _DT

GEMM_COLUMNS = (
    "Problem", "Provider", "OperationKind", "Operation", "Disposition", "Status",
    "gemm_kind", "m", "n", "k", "A", "B", "C", "D", "alpha", "beta", "split_k_mode", "split_k_slices",
    "batch_count", "raster_order", "swizzle_size", "op_class", "accum", "cta_m", "cta_n", "cta_k",
    "cluster_m", "cluster_n", "cluster_k", "stages", "warps_m", "warps_n", "warps_k",
    "inst_m", "inst_n", "inst_k", "min_cc", "max_cc",
    "Bytes", "Flops", "Flops/Byte", "Runtime", "GB/s", "GFLOPs",
    # ours, after the profiler's columns
    "epilogue", "kernel_path", "gpu", "date", "cutlass_version", "rel_err", "peer_rel_err",
)
# A sweep times many candidates: fewer, shorter trials than the benchmark (which confirms the choice).
SWEEP_TRIALS = 11
SWEEP_TARGET_MS = 2.0


def gemm_row(problem_idx: int, provider: str, operation: str, disposition: str, status: str,
             m: int, n: int, k: int, dtype: str, epilogue: str, runtime_ms: float | None,
             spec=None, extra: dict | None = None) -> dict:
    """One row in the profiler's GEMM schema (A row-major, B column-major: our x and nn.Linear W)."""
    e = 2
    nbytes = e * (m * k + n * k + m * n) + (e * m * n if "residual" in epilogue else 0) \
        + (e * n if "bias" in epilogue else 0) + (e * m * n if epilogue.endswith("aux") or "dgelu" in epilogue else 0)
    flops = 2 * m * n * k
    dt = _DT[dtype]
    row = {
        "Problem": problem_idx, "Provider": provider, "OperationKind": "gemm", "Operation": operation,
        "Disposition": disposition, "Status": status, "gemm_kind": "universal", "m": m, "n": n, "k": k,
        "A": f"{dt}:row", "B": f"{dt}:column", "C": f"{dt}:row", "D": f"{dt}:row",
        "alpha": 1, "beta": 1 if "residual" in epilogue else 0, "split_k_mode": "serial",
        "split_k_slices": 1, "batch_count": 1, "Bytes": nbytes, "Flops": flops,
        "Flops/Byte": f"{flops / nbytes:.2f}", "epilogue": epilogue,
    }
    if spec is not None:
        tm, tn, tk = spec.tile
        row.update(op_class="tensorop", accum="f32", cta_m=tm, cta_n=tn, cta_k=tk,
                   cluster_m=spec.cluster[0], cluster_n=spec.cluster[1], cluster_k=spec.cluster[2],
                   stages=spec.stages or "auto", min_cc=spec.min_cc, max_cc=1024)
        if spec.arch == 90:
            row.update(raster_order={"h": "heuristic", "m": "along_m", "n": "along_n"}[spec.raster],
                       swizzle_size=spec.swizzle, inst_m=64, inst_n=tn, inst_k=16)
        else:
            row.update(warps_m=spec.warps[0], warps_n=spec.warps[1], warps_k=spec.warps[2],
                       swizzle_size=spec.swizzle, inst_m=16, inst_n=8, inst_k=16)
    if runtime_ms:
        row.update(Runtime=f"{runtime_ms:.6f}", **{"GB/s": f"{nbytes / runtime_ms / 1e6:.1f}",
                                                    "GFLOPs": f"{flops / runtime_ms / 1e6:.1f}"})
    row.update(extra or {})
    return row


def best_cutlass_ms(rows: list[dict]) -> float:
    """The fastest timed CUTLASS row's runtime (ms) among a problem's rows; nan if none ran."""
    return min((float(r["Runtime"]) for r in rows if r["Provider"] == "cutlass" and r.get("Runtime")),
               default=float("nan"))


def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def append_rows(path: Path, rows: list[dict]) -> None:
    append_csv(path, rows, GEMM_COLUMNS, ignore_extra=True)


def _row_key(r: dict) -> tuple:
    return (r["Provider"], r["Operation"], str(r["m"]), str(r["n"]), str(r["k"]), r["epilogue"],
            r["kernel_path"], r["A"])


def best_per_problem(rows: list[dict]) -> dict[tuple, tuple[dict, dict | None]]:
    """{(path, dtype, epilogue, m, n, k): (fastest passing cutlass row, pytorch row)}."""
    best: dict[tuple, dict] = {}
    peer: dict[tuple, dict] = {}
    for r in rows:
        key = (r["kernel_path"], r["A"].split(":")[0], r["epilogue"], int(r["m"]), int(r["n"]), int(r["k"]))
        if r["Provider"] == "pytorch":
            peer[key] = r
        elif r["Provider"] == "cutlass" and r["Disposition"] == "passed" and r.get("Runtime"):
            if key not in best or float(r["Runtime"]) < float(best[key]["Runtime"]):
                best[key] = r
    return {k: (v, peer.get(k)) for k, v in best.items()}


def linear_table_key(row: dict) -> tuple[str, str, str, str, int, int, int]:
    """(op, arch, dtype, epilogue, m, n, k) of a GEMM-schema row: the key select_linear looks up."""
    return ("linear", row["kernel_path"].removeprefix("sm"), DT_FROM_TAG[row["A"].split(":")[0]], row["epilogue"],
            int(row["m"]), int(row["n"]), int(row["k"]))


def update_tables(rows: list[dict], key_fn, table_dir: str | None = None, tolerance: float = 0.0) -> list[Path]:
    """Write the selection rows of profile ``rows`` (any family; ``key_fn(row)`` gives its table
    key (op, arch, dtype, epilogue, m, n, k)): per problem the kernel :func:`selection.choose_kernels`
    picks from the passing measurements (the fastest, or with ``tolerance`` > 0 one of a smaller
    kernel set within that fraction of the fastest), with the fastest PyTorch time beside it."""
    from .build import cutlass_version
    from .selection import SelectionTable, choose_kernels, reload_tables, table_path

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


def rewrite_tables(profile_csv: str | Path, table_dir: str | None = None, tolerance: float = 0.0) -> list[Path]:
    """The selection tables of a profile CSV measured earlier, whatever its family (GEMM, Conv2d
    or attention schema, told apart by their columns)."""
    rows = read_rows(Path(profile_csv))
    if not rows:
        raise ValueError(f"{profile_csv}: no profile rows")
    if "gemm_kind" in rows[0]:
        return update_tables(rows, linear_table_key, table_dir, tolerance)
    if "conv_kind" in rows[0]:
        return update_tables(rows, conv_full_key, table_dir, tolerance)
    if "heads" in rows[0]:
        return update_tables(rows, attn_table_key, table_dir, tolerance)
    raise ValueError(f"{profile_csv}: not a cvt-cutlass profile CSV (no GEMM, Conv2d or attention columns)")


def update_selection_table(rows: list[dict], table_dir: str | None = None, tolerance: float = 0.0) -> Path:
    """The Linear selection table from GEMM-schema profile rows (see :func:`update_tables`)."""
    paths = update_tables(rows, linear_table_key, table_dir, tolerance)
    from .selection import table_path

    return paths[0] if paths else table_path("linear", table_dir)


CEILING_COLUMNS = ("gpu", "date", "dtype", "kind", "problem", "runtime_ms", "value", "unit")


def ceilings_path(profile_csv: Path) -> Path:
    """Where a sweep keeps the roofline ceilings it measured: ``<stem>_ceilings.csv`` beside it."""
    return Path(profile_csv).with_name(Path(profile_csv).stem + "_ceilings.csv")


def measure_ceilings(dtypes, copy_bytes: int = 2**30, gemm_mnk: int = 8192) -> list[dict]:
    """The roofline's ceilings on this GPU, measured: device-to-device copy bandwidth (GB/s,
    read + write bytes) and dense GEMM throughput of PyTorch's matmul (TFLOP/s) per dtype."""
    import torch

    from . import runtime
    from .bench.timing import time_cuda

    dev = runtime.device_info(torch.cuda.current_device())
    date = _dt.datetime.now().strftime("%Y-%m-%d")
    base = {"gpu": dev.name, "date": date}
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    src = torch.rand(copy_bytes // 4, device="cuda", generator=gen)
    dst = torch.empty_like(src)
    t = time_cuda(lambda i, d=dst, s=src: d.copy_(s), trials=21, target_ms=20, graph=False)
    rows.append({**base, "dtype": "fp32", "kind": "copy_bandwidth", "problem": f"{copy_bytes} B",
                 "runtime_ms": f"{t.median_ms:.4f}", "value": f"{2 * copy_bytes / t.median_ms / 1e6:.1f}",
                 "unit": "GB/s"})
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


def _build_all(specs, device_cc: int, jobs: int | None) -> set[str]:
    """Build every kernel a sweep will time in one parallel nvcc pool; the names of those that
    failed to compile (their log is printed), which the sweep records as not_supported."""
    from . import runtime
    from .build import KernelBuildError

    try:
        runtime.prebuild(specs, device_cc, jobs=jobs)
    except KernelBuildError as e:
        print(e, file=sys.stderr)
        return {name for name, _, _ in e.failures}
    return set()


def profile_main(a) -> int:
    import torch

    if a.op == "layernorm":
        print("cvt-cutlass profile has no LayerNorm sweep yet: LayerNorm kernels come from "
              "operators.layernorm.layernorm_heuristic (see `cvt-cutlass bench --op model --breakdown`)")
        return 2
    if not torch.cuda.is_available():
        print("cvt-cutlass profile needs a CUDA GPU; none is visible")
        return 2
    out = Path(a.out)
    ceil_path = ceilings_path(out)
    append_ceilings(ceil_path, measure_ceilings(a.dtype or ["fp16", "bf16"]))
    print(f"roofline ceilings measured: {ceil_path}", flush=True)
    rows = read_rows(out)
    if a.op == "attention":
        sweep = sweep_attention_backward if a.passes == ["bwd"] else sweep_attention
        new_rows = sweep(a, {_attn_row_key(r) for r in rows}, out)
        if a.update_table:
            print(f"selection table updated: {update_attn_selection_table(rows + new_rows, a.table_dir, a.tolerance)}")
        return 0
    if a.op in ("conv2d", "dwconv"):
        from .profile_conv_backward import sweep_conv_training

        done = {_conv_row_key(r) for r in rows}
        passes = getattr(a, "passes", None) or ["fwd"]
        new_rows = sweep_conv(a, done, out) if "fwd" in passes else []
        if set(passes) - {"fwd"}:
            new_rows += sweep_conv_training(a, done, out)
        if a.update_table:
            for p in update_conv_selection_tables(rows + new_rows, a.table_dir, a.tolerance):
                print(f"selection table updated: {p}")
        return 0
    done = {_row_key(r) for r in rows}
    passes = getattr(a, "passes", None) or ["fwd"]
    new_rows = sweep_linear(a, done, out, prior=rows) if "fwd" in passes else []
    if set(passes) - {"fwd"}:
        from .profile_backward import sweep_linear_backward

        new_rows += sweep_linear_backward(a, done, out)
    if a.update_table:
        path = update_selection_table(rows + new_rows, a.table_dir, a.tolerance)
        print(f"selection table updated: {path}")
    return 0


def _problems(a, epilogues):
    from .models import linear_problems

    seen, probs = set(), []
    for b in a.batch:
        for p in linear_problems(a.model, b, a.image_size):
            if p.epilogue in epilogues and (p.m, p.n, p.k, p.epilogue) not in seen:
                seen.add((p.m, p.n, p.k, p.epilogue))
                probs.append(p)
    return probs


def sweep_linear(a, done: set, out: Path, prior: list[dict] = ()) -> list[dict]:
    """Sweep, appending each problem's rows to ``out`` as soon as they exist (an interrupted
    sweep keeps what it measured and resumes from there).

    Stage 1 times the candidate space on every problem. Stage 2 (unless ``a.refine`` is false)
    times the raster-order / swizzle variants of each problem's stage-1 winner
    (:func:`operators.linear.refinements`), built together in one parallel pool.
    """
    import torch

    from . import runtime
    from .build import cutlass_version
    from .models import linear_problems
    from .operators.linear import candidates, refinements
    from .operators.spec import parse_kernel_name

    dev = runtime.device_info(torch.cuda.current_device())
    date = _dt.datetime.now().strftime("%Y-%m-%d")
    dtypes = a.dtype or ["fp16", "bf16"]
    model_epis = sorted({p.epilogue for p in linear_problems(a.model, 1, a.image_size)})
    probs = _problems(a, a.epilogue or model_epis)
    runtime.ensure_binding()
    rows: list[dict] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    work = [(arch, dt, p) for arch in a.arch for dt in dtypes for p in probs]
    # Build every candidate of the sweep up front: one parallel nvcc pool for all of them.
    all_cands = {s.name: s for arch, dt, p in work for s in candidates(arch, dt, p.epilogue)}
    broken = _build_all(all_cands.values(), dev.cc, a.jobs)

    def run_stage(stage: str, specs_of) -> None:
        nonlocal rows
        t0 = time.perf_counter()
        for i, (arch, dt, p) in enumerate(work):
            base = {"kernel_path": f"sm{arch}", "gpu": dev.name, "date": date,
                    "cutlass_version": cutlass_version()}
            new = _sweep_problem(i, p, dt, specs_of(i, arch, dt, p), broken, base, done, dev, gen)
            append_rows(out, new)
            rows += new
            done.update(_row_key(r) for r in new)  # stage 2 must not time PyTorch again
            el = time.perf_counter() - t0
            eta = el / (i + 1) * (len(work) - i - 1)
            best = best_cutlass_ms(new)
            print(f"[profile {stage} {i + 1}/{len(work)} {el:.0f}s, ETA {eta:.0f}s] sm{arch} {dt} {p.label} "
                  f"{p.m}x{p.n}x{p.k} {p.epilogue}: best new cutlass {best:.4f} ms", flush=True)

    run_stage("stage 1", lambda i, arch, dt, p: candidates(arch, dt, p.epilogue))
    if not getattr(a, "refine", True):
        return rows
    # Stage 2: raster / swizzle variants of each problem's winner so far (this run and earlier ones).
    winners = best_per_problem(list(prior) + rows)
    variants: dict[int, list] = {}
    for i, (arch, dt, p) in enumerate(work):
        hit = winners.get((f"sm{arch}", _DT[dt], p.epilogue, p.m, p.n, p.k))
        variants[i] = refinements(parse_kernel_name(hit[0]["Operation"])) if hit else []
    todo = {s.name: s for vs in variants.values() for s in vs}
    print(f"[profile stage 2] {len(todo)} raster/swizzle variants of {len(winners)} winners", flush=True)
    broken |= _build_all(todo.values(), dev.cc, a.jobs)
    run_stage("stage 2", lambda i, arch, dt, p: variants[i])
    return rows


def _sweep_problem(idx, p, dt, cands, broken, base, done, dev, gen) -> list[dict]:
    """Rows for one problem: PyTorch's unfused sequence, then every candidate kernel."""
    import torch

    from . import runtime
    from .bench.linear import make_case, rel_err
    from .bench.timing import time_cuda

    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dt]
    m, n, k, epi = p.m, p.n, p.k, p.epilogue
    c = make_case(m, n, k, epi, tdt, gen)
    xs, w, bias, rs, ref, sets = c.xs, c.w, c.bias, c.rs or [None] * c.sets, c.ref, c.sets
    peer = c.peer
    peer_err = rel_err(peer(0), ref)
    base = {**base, "peer_rel_err": f"{peer_err:.3e}"}
    a_col = f"{_DT[dt]}:row"
    rows = []
    peer_name = f"torch:{p.unfused}"
    if ("pytorch", peer_name, str(m), str(n), str(k), epi, base["kernel_path"], a_col) not in done:
        t = time_cuda(peer, sets=sets, trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS)
        rows.append(gemm_row(idx, "pytorch", peer_name, "passed", "success", m, n, k, dt, epi, t.median_ms,
                             extra=base))
    outs = [torch.empty(m, n, device="cuda", dtype=tdt) for _ in range(sets)]
    for spec in cands:
        if ("cutlass", spec.name, str(m), str(n), str(k), epi, base["kernel_path"], a_col) in done:
            continue
        if spec.name in broken:
            rows.append(gemm_row(idx, "cutlass", spec.name, "not_supported", "error", m, n, k, dt, epi,
                                 None, spec, extra=base))
            continue
        kid = runtime.load_kernel(spec, dev.cc)

        def run(j, kid=kid):
            torch.ops.cvt_cutlass_C.gemm(kid, xs[j], w, bias, rs[j], outs[j], None)

        outs[0].fill_(float("nan"))  # every element must be written
        try:
            run(0)
            torch.cuda.synchronize()
        except RuntimeError as e:
            rows.append(gemm_row(idx, "cutlass", spec.name, "not_supported", "error", m, n, k, dt, epi,
                                 None, spec, extra={**base, "rel_err": str(e)[:80]}))
            continue
        err = rel_err(outs[0], ref)
        ok = math.isfinite(err) and err <= 2 * peer_err + 1e-4
        timing = time_cuda(run, sets=sets, trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS) if ok else None
        rows.append(gemm_row(idx, "cutlass", spec.name, "passed" if ok else "incorrect", "success",
                             m, n, k, dt, epi, timing.median_ms if timing else None, spec,
                             extra={**base, "rel_err": f"{err:.3e}"}))
    return rows


# ------------------------------------------------------------------------------------------
# Conv2d (token embedding) and depthwise conv sweeps, in the profiler's Conv2d schema
# ------------------------------------------------------------------------------------------
CONV_COLUMNS = (
    "Problem", "Provider", "OperationKind", "Operation", "Disposition", "Status",
    "conv_kind", "n", "h", "w", "c", "k", "r", "s", "p", "q", "g", "pad_h", "pad_w", "stride_h", "stride_w",
    "dilation_h", "dilation_w", "Activation", "Filter", "Output", "conv_mode", "iterator_algorithm",
    "alpha", "beta", "split_k_mode", "split_k_slices", "op_class", "accum", "cta_m", "cta_n", "cta_k",
    "cluster_m", "cluster_n", "cluster_k", "stages", "warps_m", "warps_n", "warps_k", "inst_m", "inst_n", "inst_k", "min_cc", "max_cc",
    "Bytes", "Flops", "Flops/Byte", "Runtime", "GB/s", "GFLOPs",
    # ours, after the profiler's columns
    "epilogue", "kernel_path", "gpu", "date", "cutlass_version", "rel_err", "peer_rel_err", "cls_rows", "layer",
)


CONV_KINDS = {"fwd": "fprop", "dgrad": "dgrad", "wgrad": "wgrad", "bn_fwd": "fprop", "bn_bwd": "dgrad_wgrad"}


def conv_row(problem_idx: int, provider: str, operation: str, disposition: str, status: str, layer, dtype: str,
             runtime_ms: float | None, spec=None, extra: dict | None = None, pass_: str = "fwd",
             epilogue: str = "bias") -> dict:
    """One row in the profiler's Conv2d schema (NHWC activations, KRSC filters; depthwise: g = C).
    ``pass_``: fwd, the backward GEMMs dgrad / wgrad of an embedding conv, or the depthwise
    projection's training kernels bn_fwd / bn_bwd (conv_kind fprop / dgrad_wgrad); ``epilogue``:
    the selection-table key (bias, dgrad, wgrad, bn_<fwd|bwd>_st<s>)."""
    from .operators.conv2d import stem_channels

    dw = layer.kind == "dwconv"
    c = layer.c if dw else stem_channels(layer.c)
    e = 2
    out_px = layer.n * layer.p * layer.q
    x_el, y_el = layer.n * layer.h * layer.w * c, out_px * layer.k
    nbytes = e * (x_el + y_el + (x_el if pass_ == "bn_bwd" else 0)) + (
        4 * (layer.r * layer.r * c + c) if dw else e * (layer.k * layer.r * layer.r * c + layer.k))
    flops = 2 * out_px * layer.k * layer.r * layer.r * (1 if dw else c) * (2 if pass_ == "bn_bwd" else 1)
    dt = _DT[dtype]
    row = {
        "Problem": problem_idx, "Provider": provider, "OperationKind": "conv2d", "Operation": operation,
        "Disposition": disposition, "Status": status, "conv_kind": CONV_KINDS[pass_], "n": layer.n, "h": layer.h,
        "w": layer.w, "c": c, "k": layer.k, "r": layer.r, "s": layer.r, "p": layer.p, "q": layer.q,
        "g": c if dw else 1, "pad_h": layer.pad, "pad_w": layer.pad, "stride_h": layer.stride,
        "stride_w": layer.stride, "dilation_h": 1, "dilation_w": 1, "Activation": f"{dt}:nhwc",
        "Filter": "f32:rsc" if dw else f"{dt}:nhwc", "Output": f"{dt}:nhwc", "conv_mode": "cross",
        "alpha": 1, "beta": 1, "split_k_mode": "serial", "split_k_slices": 1, "Bytes": nbytes, "Flops": flops,
        "Flops/Byte": f"{flops / nbytes:.2f}", "epilogue": epilogue, "cls_rows": layer.cls, "layer": layer.label,
    }
    if spec is not None:
        if dw:
            row.update(op_class="simt", accum="f32", iterator_algorithm="direct", cta_m=spec.threads * spec.pix,
                       cta_n=8, cta_k=1, min_cc=spec.min_cc, max_cc=1024)
        elif spec.arch == 90:  # CUTLASS 3.x SM90 (wgmma)
            tm, tn, tk = spec.tile
            row.update(op_class="tensorop", accum="f32", iterator_algorithm=spec.iterator, cta_m=tm, cta_n=tn,
                       cta_k=tk, cluster_m=spec.cluster[0], cluster_n=spec.cluster[1], cluster_k=spec.cluster[2],
                       stages=spec.stages or "auto", inst_m=64, inst_n=tn, inst_k=16, min_cc=90, max_cc=90)
        else:
            tm, tn, tk = spec.tile
            row.update(op_class="tensorop", accum="f32", iterator_algorithm=spec.iterator, cta_m=tm, cta_n=tn,
                       cta_k=tk, cluster_m=1, cluster_n=1, cluster_k=1, stages=spec.stages, warps_m=spec.warps[0],
                       warps_n=spec.warps[1], warps_k=spec.warps[2], inst_m=16, inst_n=8, inst_k=16,
                       min_cc=spec.min_cc, max_cc=1024)
    if runtime_ms:
        row.update(Runtime=f"{runtime_ms:.6f}", **{"GB/s": f"{nbytes / runtime_ms / 1e6:.1f}",
                                                    "GFLOPs": f"{flops / runtime_ms / 1e6:.1f}"})
    row.update(extra or {})
    return row


def _conv_row_key(r: dict) -> tuple:
    return (r["Provider"], r["Operation"], r["layer"], str(r["n"]), str(r["h"]), str(r["w"]), r["kernel_path"],
            r["Activation"], r.get("epilogue") or "bias")


def append_conv_rows(path: Path, rows: list[dict]) -> None:
    append_csv(path, rows, CONV_COLUMNS, ignore_extra=True)


def conv_table_key(row: dict) -> tuple[str, str, int, int, int]:
    """(op, epilogue, m, n, k) under which a conv row goes into its selection table; the same
    key :func:`cvt_cutlass.selection.select_conv2d` / ``select_dwconv`` look up."""
    m = int(row["n"]) * int(row["p"]) * int(row["q"])
    epi = row.get("epilogue") or "bias"
    if str(row["g"]) != "1":
        epi = f"bias_st{row['stride_h']}" if epi == "bias" else epi
        return "dwconv", epi, m, int(row["c"]), int(row["r"]) * int(row["s"])
    return "conv2d", epi, m, int(row["k"]), int(row["r"]) * int(row["s"]) * int(row["c"])


def conv_full_key(row: dict) -> tuple:
    """(op, arch, dtype, epilogue, m, n, k) of a Conv2d-schema row."""
    op, epi, m, n, k = conv_table_key(row)
    return (op, row["kernel_path"].removeprefix("sm"), DT_FROM_TAG[row["Activation"].split(":")[0]], epi, m, n, k)


def update_conv_selection_tables(rows: list[dict], table_dir: str | None = None,
                                 tolerance: float = 0.0) -> list[Path]:
    """The conv2d and dwconv selection tables from Conv2d-schema rows (see :func:`update_tables`)."""
    return update_tables(rows, conv_full_key, table_dir, tolerance)


def sweep_conv(a, done: set, out: Path) -> list[dict]:
    """Every candidate of the op family on every conv of that kind in the model, against the
    step HF runs (its module sequence, in the same process). Resumable like the Linear sweep."""
    import torch

    from . import runtime
    from .bench.conv import make_conv_case
    from .bench.timing import time_cuda
    from .build import cutlass_version
    from .models import conv_problems
    from .operators.conv2d import conv_candidates, stem_channels
    from .operators.dwconv import dwconv_candidates

    kind = "embed" if a.op == "conv2d" else "dwconv"
    dev = runtime.device_info(torch.cuda.current_device())
    date = _dt.datetime.now().strftime("%Y-%m-%d")
    dtypes = a.dtype or ["fp16", "bf16"]
    layers = [lay for b in a.batch for lay in conv_problems(a.model, b, a.image_size) if lay.kind == kind]

    def cands(arch, dt, lay):
        if kind == "embed":
            return conv_candidates(dt, stem_channels(lay.c), arch)
        return dwconv_candidates(dt, lay.stride, arch)

    work = [(arch, dt, lay) for arch in a.arch for dt in dtypes for lay in layers]
    all_specs = {s.name: s for arch, dt, lay in work for s in cands(arch, dt, lay)}
    broken = _build_all(all_specs.values(), dev.cc, a.jobs)
    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16}
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []
    t0 = time.perf_counter()
    for i, (arch, dt, lay) in enumerate(work):
        base = {"kernel_path": f"sm{arch}", "gpu": dev.name, "date": date, "cutlass_version": cutlass_version()}
        case = make_conv_case(lay, tdt[dt], gen)
        with torch.no_grad():
            peer_err = float((case.hf(0).float() - case.ref).norm() / case.ref.norm())
        base["peer_rel_err"] = f"{peer_err:.3e}"
        new = []
        act = f"{_DT[dt]}:nhwc"
        if ("pytorch", "torch:hf_sequence", lay.label, str(lay.n), str(lay.h), str(lay.w), base["kernel_path"],
                act, "bias") not in done:
            with torch.no_grad():
                t = time_cuda(case.hf, trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS)
            new.append(conv_row(i, "pytorch", "torch:hf_sequence", "passed", "success", lay, dt, t.median_ms,
                                extra=base))
        for spec in cands(arch, dt, lay):
            if ("cutlass", spec.name, lay.label, str(lay.n), str(lay.h), str(lay.w), base["kernel_path"],
                    act, "bias") in done:
                continue
            if spec.name in broken:
                new.append(conv_row(i, "cutlass", spec.name, "not_supported", "error", lay, dt, None, spec, base))
                continue
            kid = runtime.load_kernel(spec, dev.cc)
            case.out.fill_(float("nan"))
            try:
                case.launch(kid)
                torch.cuda.synchronize()
            except RuntimeError as e:
                new.append(conv_row(i, "cutlass", spec.name, "not_supported", "error", lay, dt, None, spec,
                                    {**base, "rel_err": str(e)[:80]}))
                continue
            err = float((case.out.float() - case.ref).norm() / case.ref.norm())
            ok = math.isfinite(err) and err <= 2 * peer_err + 1e-4
            timing = (time_cuda(lambda _, kid=kid, c=case: c.launch(kid), trials=SWEEP_TRIALS,
                                target_ms=SWEEP_TARGET_MS) if ok else None)
            new.append(conv_row(i, "cutlass", spec.name, "passed" if ok else "incorrect", "success", lay, dt,
                                timing.median_ms if timing else None, spec, {**base, "rel_err": f"{err:.3e}"}))
        append_conv_rows(out, new)
        rows += new
        done.update(_conv_row_key(r) for r in new)
        el = time.perf_counter() - t0
        best = best_cutlass_ms(new)
        print(f"[profile {i + 1}/{len(work)} {el:.0f}s, ETA {el / (i + 1) * (len(work) - i - 1):.0f}s] sm{arch} {dt} "
              f"b={lay.n} {lay.label}: best cutlass {best:.4f} ms", flush=True)
    return rows


# ------------------------------------------------------------------------------------------
# Attention sweeps (no cutlass_profiler kind exists for FMHA: the GEMM-style columns, with the
# attention problem's own arguments in place of m, n, k)
# ------------------------------------------------------------------------------------------
ATTN_COLUMNS = (
    "Problem", "Provider", "OperationKind", "Operation", "Disposition", "Status",
    "batch", "heads", "lq", "lkv", "head_dim", "scale", "Q", "K", "V", "O", "LSE", "op_class", "accum",
    "cta_q", "cta_kv", "cta_d", "schedule", "min_cc", "max_cc",
    "Bytes", "Flops", "Flops/Byte", "Runtime", "GB/s", "GFLOPs",
    "kernel_path", "gpu", "date", "cutlass_version", "rel_err", "peer_rel_err", "layer",
)


def attn_row(problem_idx: int, provider: str, operation: str, disposition: str, status: str, lay, dtype: str,
             runtime_ms: float | None, spec=None, extra: dict | None = None, bwd: bool = False) -> dict:
    """One attention profile row; ``bwd``: of the backward (OperationKind fmha_bwd: q, k, v, o, dO
    read, dq, dk, dv written; 2.5x the forward's FLOPs)."""
    b, h, lq, lkv, d = lay.n, lay.heads, lay.lq, lay.lkv, lay.head_dim
    nbytes = 2 * b * h * d * ((4 * lq + 4 * lkv) if bwd else (2 * lq + 2 * lkv)) + 4 * b * h * lq
    flops = (10 if bwd else 4) * b * h * lq * lkv * d
    dt = _DT[dtype]
    row = {"Problem": problem_idx, "Provider": provider, "OperationKind": "fmha_bwd" if bwd else "fmha",
           "Operation": operation,
           "Disposition": disposition, "Status": status, "batch": b, "heads": h, "lq": lq, "lkv": lkv,
           "head_dim": d, "scale": f"{lay.scale:.6g}", "Q": f"{dt}:blhd", "K": f"{dt}:blhd", "V": f"{dt}:blhd",
           "O": f"{dt}:blhd", "LSE": "f32:bhl", "Bytes": nbytes, "Flops": flops,
           "Flops/Byte": f"{flops / nbytes:.2f}", "layer": lay.label}
    if spec is not None:
        if spec.kernel == "ex88":
            sched = getattr(spec, "schedule", "coop")
            row.update(op_class="tensorop(wgmma)", accum="f32", cta_q=spec.tile[0], cta_kv=spec.tile[1],
                       cta_d=spec.tile[2], min_cc=90, max_cc=90,
                       schedule=sched + (f"_s{spec.stages}" if getattr(spec, "stages", 0) else "")
                       + (f"_b{spec.blocks}" if getattr(spec, "blocks", 0) else ""))
        else:
            row.update(op_class="tensorop(mma.sync)", accum="f32", cta_q=spec.queries, cta_kv=spec.keys,
                       cta_d=spec.max_k, schedule="ex41", min_cc=80, max_cc=1024)
    if runtime_ms:
        row.update(Runtime=f"{runtime_ms:.6f}", **{"GB/s": f"{nbytes / runtime_ms / 1e6:.1f}",
                                                    "GFLOPs": f"{flops / runtime_ms / 1e6:.1f}"})
    row.update(extra or {})
    return row


def _attn_row_key(r: dict) -> tuple:
    return (r["Provider"], r["Operation"], str(r["batch"]), str(r["heads"]), str(r["lq"]), str(r["lkv"]),
            r["kernel_path"], r["Q"], r.get("OperationKind", "fmha"))


def attn_table_key(row: dict) -> tuple:
    """(op, arch, dtype, epilogue, m, n, k) of an attention row: the key select_attention looks up,
    (batch * Lq, Lkv, head dim) under epilogue h<heads> (forward) or h<heads>_bwd (backward)."""
    epilogue = f"h{row['heads']}" + ("_bwd" if row.get("OperationKind") == "fmha_bwd" else "")
    return ("attention", row["kernel_path"].removeprefix("sm"), DT_FROM_TAG[row["Q"].split(":")[0]], epilogue,
            int(row["batch"]) * int(row["lq"]), int(row["lkv"]), int(row["head_dim"]))


def update_attn_selection_table(rows: list[dict], table_dir: str | None = None, tolerance: float = 0.0) -> Path:
    """The attention selection table from attention profile rows (see :func:`update_tables`)."""
    from .selection import table_path

    paths = update_tables(rows, attn_table_key, table_dir, tolerance)
    return paths[0] if paths else table_path("attention", table_dir)


def sweep_attention(a, done: set, out: Path) -> list[dict]:
    """Every candidate (example 41 on both paths, example 88 on the sm90 path) on every attention
    problem of the model, against the fastest PyTorch path measured in the same process (HF's
    einsum sequence and SDPA with PyTorch's default backend choice)."""
    import torch
    import torch.nn.functional as F

    from . import runtime
    from .bench.timing import time_cuda
    from .build import cutlass_version
    from .models import attention_problems
    from .operators.attention import attn_candidates
    from .ops.attention import _new_lse, attention_reference

    dev = runtime.device_info(torch.cuda.current_device())
    date = _dt.datetime.now().strftime("%Y-%m-%d")
    dtypes = a.dtype or ["fp16", "bf16"]
    layers = [lay for b in a.batch for lay in attention_problems(a.model, b, a.image_size)]
    work = [(arch, dt, lay) for arch in a.arch for dt in dtypes for lay in layers]
    all_specs = {s.name: s for arch, dt, lay in work for s in attn_candidates(dt, lay.head_dim, arch)}
    broken = _build_all(all_specs.values(), dev.cc, a.jobs)
    runtime.ensure_binding()
    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16}
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []
    t0 = time.perf_counter()
    for i, (arch, dt, lay) in enumerate(work):
        b, h, lq, lkv, d, s = lay.n, lay.heads, lay.lq, lay.lkv, lay.head_dim, lay.scale
        base = {"kernel_path": f"sm{arch}", "gpu": dev.name, "date": date, "cutlass_version": cutlass_version()}
        q = torch.randn(b, lq, h * d, device="cuda", generator=gen).to(tdt[dt]).view(b, lq, h, d)
        kv = torch.randn(b, lkv, 2 * h * d, device="cuda", generator=gen).to(tdt[dt])
        k, v = kv[..., : h * d].view(b, lkv, h, d), kv[..., h * d:].view(b, lkv, h, d)
        with torch.no_grad():
            ref = attention_reference(q[:1], k[:1], v[:1], s)[0].float()
        qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))

        def hf(_, qh=qh, kh=kh, vh=vh, s=s):
            sc = torch.einsum("bhlk,bhtk->bhlt", qh, kh) * s
            return torch.einsum("bhlt,bhtv->bhlv", torch.softmax(sc, dim=-1), vh).permute(0, 2, 1, 3)

        def sdpa(_, qh=qh, kh=kh, vh=vh, s=s):
            return F.scaled_dot_product_attention(qh, kh, vh, scale=s).permute(0, 2, 1, 3)

        new = []
        act = f"{_DT[dt]}:blhd"
        peer_err = 0.0
        for pname, fn in (("torch:hf_einsum", hf), ("torch:sdpa_default", sdpa)):
            e = float((fn(0)[:1].float() - ref).norm() / ref.norm())
            peer_err = max(peer_err, e)
            if ("pytorch", pname, str(b), str(h), str(lq), str(lkv), base["kernel_path"], act, "fmha") in done:
                continue
            t = time_cuda(fn, trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS)
            new.append(attn_row(i, "pytorch", pname, "passed", "success", lay, dt, t.median_ms,
                                extra={**base, "rel_err": f"{e:.3e}"}))
        base["peer_rel_err"] = f"{peer_err:.3e}"
        o = q.new_empty(b, lq, h, d)
        lse = _new_lse(q, b, h, lq)
        for spec in attn_candidates(dt, d, arch):
            if ("cutlass", spec.name, str(b), str(h), str(lq), str(lkv), base["kernel_path"], act, "fmha") in done:
                continue
            if spec.name in broken:
                new.append(attn_row(i, "cutlass", spec.name, "not_supported", "error", lay, dt, None, spec, base))
                continue
            kid = runtime.load_kernel(spec, dev.cc)

            def run(_, kid=kid, o=o, lse=lse, q=q, k=k, v=v, s=s):
                torch.ops.cvt_cutlass_C.attention(kid, q, k, v, o, lse, s)

            o.fill_(float("nan"))
            try:
                run(0)
                torch.cuda.synchronize()
            except RuntimeError as e:
                new.append(attn_row(i, "cutlass", spec.name, "not_supported", "error", lay, dt, None, spec,
                                    {**base, "rel_err": str(e).splitlines()[0][:80]}))
                continue
            err = float((o[:1].float() - ref).norm() / ref.norm())
            ok = math.isfinite(err) and err <= 2 * peer_err + 1e-4
            timing = time_cuda(run, trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS) if ok else None
            new.append(attn_row(i, "cutlass", spec.name, "passed" if ok else "incorrect", "success", lay, dt,
                                timing.median_ms if timing else None, spec, {**base, "rel_err": f"{err:.3e}"}))
        append_csv(out, new, ATTN_COLUMNS, ignore_extra=True)
        rows += new
        done.update(_attn_row_key(r) for r in new)
        el = time.perf_counter() - t0
        best = best_cutlass_ms(new)
        print(f"[profile {i + 1}/{len(work)} {el:.0f}s, ETA {el / (i + 1) * (len(work) - i - 1):.0f}s] sm{arch} {dt} "
              f"b={b} {lay.label}: best cutlass {best:.4f} ms", flush=True)
    return rows


def _attn_bwd_inputs(torch, lay, dtype, gen):
    """q and a packed kv as the projections write them, the forward's out / lse (float64 math),
    a random output gradient, and float64 reference gradients of image 0."""
    from .ops.attention import _new_lse, attention_backward_reference, attention_reference

    b, h, lq, lkv, d = lay.n, lay.heads, lay.lq, lay.lkv, lay.head_dim
    q = torch.randn(b, lq, h * d, device="cuda", generator=gen).to(dtype).view(b, lq, h, d)
    kv = torch.randn(b, lkv, 2 * h * d, device="cuda", generator=gen).to(dtype)
    k, v = kv[..., : h * d].view(b, lkv, h, d), kv[..., h * d:].view(b, lkv, h, d)
    out, lse_ref = attention_reference(q, k, v, lay.scale)
    lse = _new_lse(q, b, h, lq)
    lse.copy_(lse_ref)
    dout = torch.randn(out.shape, device="cuda", generator=gen).to(dtype)
    ref = attention_backward_reference(dout[:1].double(), *(t[:1].double() for t in (q, k, v)), lay.scale)
    return (q, k, v, out, lse, dout), ref


def _grad_err(grads, ref) -> float:
    return max(float((g[:1].double() - r).norm() / r.norm()) for g, r in zip(grads, ref, strict=True))


def _sdpa_bwd_peers(torch, q, k, v, dout, scale):
    """{name: (grads fn, backward ms)} of SDPA on cuDNN and on flash: the backward's GPU time is
    that of forward + autograd.grad captured together less the forward's (a kept graph's backward
    alone cannot be captured: the engine runs it on its own thread)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .bench.timing import time_cuda

    peers = {}
    for name, backend in (("torch:sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("torch:sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        leaves = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]

        def fwd(_, leaves=leaves, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(*leaves, scale=scale)

        def both(_, leaves=leaves, fwd=fwd):
            return torch.autograd.grad(fwd(0), leaves, dout.transpose(1, 2))

        try:
            grads = both(0)
        except RuntimeError:
            continue
        ms = time_cuda(both, trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS).median_ms - \
            time_cuda(fwd, trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS).median_ms
        peers[name] = ([g.transpose(1, 2) for g in grads], ms)
    return peers


def sweep_attention_backward(a, done: set, out: Path) -> list[dict]:
    """Every backward candidate (example 41 on both paths, example 88's Hopper mainloop on sm90) on
    every attention problem of the model, against SDPA's backward on cuDNN and on flash in the same
    process; kernels whose gradients are worse than 2x the peers' (vs float64) + a floor are
    marked incorrect and not timed."""
    import torch

    from . import runtime
    from .bench.timing import time_cuda
    from .build import cutlass_version
    from .models import attention_problems
    from .operators.attention import attn_bwd_candidates

    dev = runtime.device_info(torch.cuda.current_device())
    base0 = {"gpu": dev.name, "date": _dt.datetime.now().strftime("%Y-%m-%d"), "cutlass_version": cutlass_version()}
    layers = [lay for b in a.batch for lay in attention_problems(a.model, b, a.image_size)]
    work = [(arch, dt, lay) for arch in a.arch for dt in (a.dtype or ["fp16", "bf16"]) for lay in layers]
    specs = {s.name: s for arch, dt, lay in work for s in attn_bwd_candidates(dt, lay.head_dim, arch)}
    broken = _build_all(specs.values(), dev.cc, a.jobs)
    runtime.ensure_binding()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []
    for i, (arch, dt, lay) in enumerate(work):
        (q, k, v, o, lse, dout), ref = _attn_bwd_inputs(torch, lay, {"fp16": torch.float16, "bf16": torch.bfloat16}[dt], gen)
        base = {**base0, "kernel_path": f"sm{arch}"}
        key = (str(lay.n), str(lay.heads), str(lay.lq), str(lay.lkv), base["kernel_path"], f"{_DT[dt]}:blhd", "fmha_bwd")
        new, peer_err = [], 0.0
        for pname, (grads, ms) in _sdpa_bwd_peers(torch, q, k, v, dout, lay.scale).items():
            e = _grad_err(grads, ref)
            peer_err = max(peer_err, e)
            if ("pytorch", pname, *key) not in done:
                new.append(attn_row(i, "pytorch", pname, "passed", "success", lay, dt, ms,
                                    extra={**base, "rel_err": f"{e:.3e}"}, bwd=True))
        base["peer_rel_err"] = f"{peer_err:.3e}"
        for spec in attn_bwd_candidates(dt, lay.head_dim, arch):
            if ("cutlass", spec.name, *key) not in done:
                new.append(_attn_bwd_kernel_row(torch, i, spec, lay, dt, (q, k, v, o, lse, dout), ref, peer_err,
                                                base, spec.name in broken, dev.cc, time_cuda))
        append_csv(out, new, ATTN_COLUMNS, ignore_extra=True)
        rows += new
        done.update(_attn_row_key(r) for r in new)
        print(f"[profile bwd {i + 1}/{len(work)}] sm{arch} {dt} b={lay.n} {lay.label}: " + ", ".join(
            f"{r['Operation'].removeprefix('cvt_attention_bwd_')} {r.get('Runtime', r['Disposition'])}" for r in new),
            flush=True)
    return rows


def _attn_bwd_kernel_row(torch, i, spec, lay, dt, tensors, ref, peer_err, base, broken, cc, time_cuda):
    from . import runtime

    if broken:
        return attn_row(i, "cutlass", spec.name, "not_supported", "error", lay, dt, None, spec, base, bwd=True)
    q, k, v, o, lse, dout = tensors
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    kid = runtime.load_kernel(spec, cc)

    def run(_):
        torch.ops.cvt_cutlass_C.attention_backward(kid, dout, q, k, v, o, lse, dq, dk, dv, lay.scale)

    try:
        run(0)
        torch.cuda.synchronize()
    except RuntimeError as e:
        return attn_row(i, "cutlass", spec.name, "not_supported", "error", lay, dt, None, spec,
                        {**base, "rel_err": str(e).splitlines()[0][:80]}, bwd=True)
    err = _grad_err((dq, dk, dv), ref)
    ok = math.isfinite(err) and err <= 2 * peer_err + 2e-3
    timing = time_cuda(run, trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS) if ok else None
    return attn_row(i, "cutlass", spec.name, "passed" if ok else "incorrect", "success", lay, dt,
                    timing.median_ms if timing else None, spec, {**base, "rel_err": f"{err:.3e}"}, bwd=True)
