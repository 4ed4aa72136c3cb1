"""PNG plots of a profile sweep (``cvt-cutlass plot``): per-shape TFLOP/s and a roofline.

Input: a profiler-schema CSV written by ``cvt-cutlass profile`` and, for the roofline, the
``<stem>_ceilings.csv`` the same sweep measured (copy bandwidth, dense GEMM TFLOP/s). One pair of
figures per (kernel path, dtype) in the CSV:

* ``<op>_tflops_<path>_<dtype>.png``: achieved TFLOP/s of the best passing CUTLASS kernel and of
  PyTorch's unfused sequence for every Linear layer of the model, one panel per batch, with the
  speedup (PyTorch time / CUTLASS time) above each pair.
* ``<op>_roofline_<path>_<dtype>.png``: arithmetic intensity (FLOP per byte of the fused problem's
  minimum traffic) against achieved TFLOP/s, under min(bandwidth x intensity, GEMM peak).

Nothing here needs a GPU; matplotlib is the only extra dependency.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..operators.spec import DT_FROM_TAG
from .sweep.driver import ceilings_path, read_rows
from .sweep.linear import best_per_problem


def _layer_groups(model: str, batches, image_size):
    """{batch: [(label, (m, n, k, epilogue))]} with layers of equal problems merged (s1.k/v)."""
    from ..operators.linear.problems import linear_problems

    out = {}
    for b in batches:
        seen: dict[tuple, list[str]] = {}
        for p in linear_problems(model, b, image_size):
            seen.setdefault((p.m, p.n, p.k, p.epilogue), []).append(p.label)
        out[b] = [(_merge_labels(v), key) for key, v in seen.items()]
    return out


def _merge_labels(labels: list[str]) -> str:
    if len(labels) == 1:
        return labels[0]
    stem = labels[0].rsplit(".", 1)[0]
    if all(lab.startswith(stem + ".") for lab in labels):
        return stem + "." + "/".join(lab.rsplit(".", 1)[1] for lab in labels)
    return "/".join(labels)


def read_ceilings(path: Path | None) -> dict:
    """{"copy_GBps": float, "gemm_TFLOPs": {dtype: float}, "gpu": str}: medians over the rows."""
    if path is None or not Path(path).is_file():
        return {}
    rows = _csv_rows(path, ("kind", "dtype", "value"), "a ceilings CSV (`cvt-cutlass profile` writes one)")
    out: dict = {"gemm_TFLOPs": {}}
    copies = sorted(float(r["value"]) for r in rows if r["kind"] == "copy_bandwidth")
    if copies:
        out["copy_GBps"] = copies[len(copies) // 2]
    for dt in {r["dtype"] for r in rows if r["kind"] == "gemm_tflops"}:
        v = sorted(float(r["value"]) for r in rows if r["kind"] == "gemm_tflops" and r["dtype"] == dt)
        out["gemm_TFLOPs"][dt] = v[len(v) // 2]
    out["gpu"] = rows[0]["gpu"] if rows else ""
    return out


def _tflops(row: dict | None) -> float:
    if not row or not row.get("Runtime"):
        return float("nan")
    return float(row["Flops"]) / float(row["Runtime"]) / 1e9


def _csv_rows(path, needs: tuple[str, ...], what: str) -> list[dict]:
    """The rows of ``path``, a CSV with the columns ``needs`` (``what`` names it in the error)."""
    try:
        rows = read_rows(Path(path))
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text CSV ({what})") from None
    missing = [c for c in needs if rows and c not in rows[0]]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} column(s): not {what}")
    return rows


def plot_profile(profile_csv, out_dir, *, model: str = "cvt-13", batches=(1, 32, 256),
                 image_size: int | None = None, ceilings_csv=None, op: str = "linear") -> list[Path]:
    """Write the TFLOP/s and roofline PNGs for every (path, dtype) of the forward Linear rows in
    ``profile_csv`` (the other ops' and the backward passes' profiles are tables: `cvt-cutlass table`)."""
    import matplotlib

    matplotlib.use("Agg")
    what = "a forward Linear profile (`cvt-cutlass profile --op linear`)"
    rows = _csv_rows(profile_csv, ("OperationKind", "epilogue", "m", "n", "k", "A", "Flops", "Runtime"), what)
    rows = [r for r in rows if r["OperationKind"] == "gemm" and ":" not in r["epilogue"]]  # dgrad:/wgrad: rows
    if not rows:
        raise ValueError(f"{profile_csv}: no profile rows of {what}")
    best = best_per_problem(rows)
    ceil = read_ceilings(Path(ceilings_csv) if ceilings_csv else ceilings_path(Path(profile_csv)))
    groups = _layer_groups(model, batches, image_size)
    pairs = {(k[0], k[1]) for k in best}  # (kernel path, dtype)
    if not any((*pd, epi, m, n, k) in best for pd in pairs for b in batches for _, (m, n, k, epi) in groups[b]):
        raise ValueError(f"{profile_csv}: no rows of {model}'s layers at batch {', '.join(map(str, batches))}"
                         f"{f' and image size {image_size}' if image_size else ''} (see --model, --batch, --image-size)")
    gpu = next((r["gpu"] for r in rows if r.get("gpu")), "GPU")
    date = max((r["date"] for r in rows if r.get("date")), default="")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for path_name, dt in sorted(pairs):
        dtype = DT_FROM_TAG.get(dt, dt)
        label = f"{path_name} path" + (" (SM80-class kernels run on this GPU)" if path_name == "sm89" else "")
        title = f"{model} {op} layers, {dtype}, {label}: {gpu}, {date}"
        points, path = _tflops_figure(best, groups, batches, path_name, dt, title, out_dir / f"{op}_tflops_{path_name}_{dtype}.png")
        written.append(path)
        written.append(_roofline_figure(points, batches, ceil, dtype, f"{model} {op} roofline, {dtype}, {label}\n{gpu}, {date}",
                                        out_dir / f"{op}_roofline_{path_name}_{dtype}.png"))
    return written


def _tflops_figure(best, groups, batches, path_name, dt, title, out: Path):
    """Per-shape TFLOP/s, one panel per batch: (roofline points (intensity, CUTLASS TFLOP/s,
    PyTorch TFLOP/s, batch), the PNG written)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(batches), 1, figsize=(13, 3.4 * len(batches)), squeeze=False)
    points = []
    for ax, b in zip(axes[:, 0], batches, strict=True):
        labels, cut, peer = [], [], []
        for lab, (m, n, k, epi) in groups[b]:
            hit = best.get((path_name, dt, epi, m, n, k))
            if hit is None:
                continue
            row, prow = hit
            labels.append(f"{lab}\n{epi}")
            cut.append(_tflops(row))
            peer.append(_tflops(prow))
            points.append((float(row["Flops/Byte"]), cut[-1], peer[-1], b))
        x = list(range(len(labels)))
        ax.bar([i - 0.2 for i in x], peer, 0.4, label="PyTorch (unfused)", color="#8c8c8c")
        ax.bar([i + 0.2 for i in x], cut, 0.4, label="CUTLASS (best in sweep)", color="#76b900")
        for i, (c, p) in enumerate(zip(cut, peer, strict=True)):
            if math.isfinite(c) and math.isfinite(p) and c > 0:
                ax.text(i, max(c, p) * 1.02, f"{c / p:.2f}x", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"batch {b}", fontsize=9, loc="left")
        ax.margins(y=0.15)
    axes[0, 0].legend(fontsize=8, loc="upper right")
    fig.suptitle(title + "\nspeedup = PyTorch time / CUTLASS time (CUDA-graph medians)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return points, out


def _roofline_figure(points, batches, ceil: dict, dtype: str, title: str, out: Path) -> Path:
    """The problems' achieved TFLOP/s against their arithmetic intensity, under the measured ceilings."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    colors = {b: c for b, c in zip(batches, ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"), strict=False)}
    for b in batches:
        pts = [q for q in points if q[3] == b]
        ax.scatter([q[0] for q in pts], [q[1] for q in pts], color=colors.get(b), marker="o", label=f"CUTLASS, batch {b}")
        ax.scatter([q[0] for q in pts], [q[2] for q in pts], facecolors="none", edgecolors=colors.get(b), marker="s",
                   label=f"PyTorch, batch {b}")
    ais = [q[0] for q in points] or [1.0]
    lo, hi = min(ais) / 2, max(ais) * 2
    bw, peak = ceil.get("copy_GBps"), ceil.get("gemm_TFLOPs", {}).get(dtype)
    if bw and peak:
        xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(xs, [min(bw * x / 1e3, peak) for x in xs], "k-", lw=1,
                label=f"measured: copy {bw / 1e3:.2f} TB/s, GEMM {peak:.0f} TFLOP/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of the fused problem)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


_PROVIDER_LABELS = {"hf": "HF eager", "hf_graph": "HF eager + CUDA graph", "compile": "torch.compile",
                    "compile_max": "torch.compile max-autotune", "swapped": "cvt_cutlass swapped",
                    "swapped_ops": "cvt_cutlass swapped, op by op",
                    "swapped_graph": "cvt_cutlass swapped + CUDA graph",
                    "compile_ro": "torch.compile reduce-overhead",
                    "swapped_compile": "torch.compile(cvt_cutlass swapped)",
                    "swapped_compile_ro": "torch.compile(cvt_cutlass swapped) reduce-overhead"}


def plot_model_bench(bench_csv, out_dir) -> list[Path]:
    """``model_<model>_<dtype>.png`` per (model, dtype) of a ``cvt-cutlass bench --op model`` CSV
    (``train_<model>_<dtype>.png`` for ``--op train``'s): throughput (img/s) against batch, one
    panel per image size, one line per provider (the most recent row of each (size, batch,
    provider) wins)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _csv_rows(bench_csv, ("model", "dtype", "provider", "batch", "img_per_s"),
                     "a `cvt-cutlass bench --op model` or `--op train` CSV")
    if not rows:
        raise ValueError(f"{bench_csv} has no rows")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    train = rows[0].get("op") == "train"
    for model, dt in sorted({(r["model"], r["dtype"]) for r in rows}):
        sel = {}
        for r in rows:
            if (r["model"], r["dtype"]) == (model, dt):
                sel[(int(r["image_size"]), int(r["batch"]), r["provider"])] = r
        sizes = sorted({k[0] for k in sel})
        fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
        for ax, size in zip(axes[0], sizes, strict=True):
            provs = [p for p in _PROVIDER_LABELS if any(k[0] == size and k[2] == p for k in sel)]
            for p in provs:
                pts = sorted((k[1], float(v["img_per_s"])) for k, v in sel.items() if k[0] == size and k[2] == p)
                ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=_PROVIDER_LABELS[p],
                        color=f"C{list(_PROVIDER_LABELS).index(p)}",  # the same colour in every panel
                        linewidth=2.5 if p.startswith("swapped") else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch")
            ax.set_ylabel("training images / s" if train else "images / s")
            ax.set_title(f"{model} {size}x{size} {dt}" + (" autocast, SGD momentum" if train else ""))
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        any_row = next(iter(sel.values()))
        fig.suptitle(f"{any_row['gpu']}, torch {any_row['torch']}, {any_row['date']}", fontsize=9)
        fig.tight_layout()
        p = out / f"{'train' if train else 'model'}_{model}_{dt}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths
