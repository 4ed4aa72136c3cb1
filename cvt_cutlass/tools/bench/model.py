"""``cvt-cutlass bench --op model``: whole-model inference, all providers in one process.

Providers (``--providers``; by default all but the two slowest to compile, ``compile_max``
and ``compile_ro``): ``hf`` HF eager, ``hf_graph`` HF eager captured in a CUDA graph, ``compile``
torch.compile(HF) (default mode), ``compile_ro`` torch.compile(HF, mode="reduce-overhead"),
``compile_max`` torch.compile(HF, mode="max-autotune-no-cudagraphs"), ``swapped_launched``
cvt_cutlass.swap eager with its stages' CUDA graphs off (every kernel launched from the host),
``swapped`` cvt_cutlass.swap eager (each stage replays its captured forward:
:mod:`cvt_cutlass.graphs`), ``swapped_graph`` swapped + the whole forward in one CUDA graph, ``swapped_compile``
torch.compile(swapped), ``swapped_compile_ro`` torch.compile(swapped, mode="reduce-overhead").

Every provider runs the same randomly initialised CvT (BatchNorm statistics and LayerNorm
affines randomised too) on the same random images under ``torch.inference_mode()``; median ms
over CUDA-event-timed trials after a warm-up, img/s, speedup over HF eager and over the best
torch.compile of HF, SQNR of the logits against the fp32 model, the kernel calls and fallbacks
(of one forward with the stages' graphs off: a replay calls no op).
Each compiled provider is compiled once per (image size, dtype) and then sees every batch size in
turn, so the table also says how many graphs each batch size made it compile (dynamic batch:
none after the first batch size >= 2) and how long its first call at that batch size took.
"""

from __future__ import annotations

import math

from ...checkpoint import random_cvt
from ..compare import sqnr_db
from ..timing import call_profile, graphed, median_event_ms

PROVIDERS = ("hf", "hf_graph", "compile", "compile_ro", "compile_max", "swapped_launched", "swapped", "swapped_graph",
             "swapped_compile", "swapped_compile_ro")
DEFAULT_PROVIDERS = ("hf", "hf_graph", "compile", "swapped_launched", "swapped", "swapped_graph", "swapped_compile",
                     "swapped_compile_ro")
_COMPILE_MODES = {"compile": None, "compile_ro": "reduce-overhead", "compile_max": "max-autotune-no-cudagraphs",
                  "swapped_compile": None, "swapped_compile_ro": "reduce-overhead"}


def _models(hf, providers):
    """One module per provider: HF, the swapped copy, and a fresh copy for each compiled one (so
    their graphs, recompiles and CUDA-graph trees are their own)."""
    import copy

    import torch

    from ...swap import swap

    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        raise ValueError(f"unknown provider(s) {unknown}; choose from {', '.join(PROVIDERS)}")
    swapped = swap(copy.deepcopy(hf)) if {"swapped", "swapped_graph", "swapped_launched"} & set(providers) else None
    out = {}
    for prov in providers:
        if prov in _COMPILE_MODES:
            base = swap(copy.deepcopy(hf)) if prov.startswith("swapped") else copy.deepcopy(hf)
            out[prov] = torch.compile(base, mode=_COMPILE_MODES[prov])
        else:
            out[prov] = swapped if prov.startswith("swapped") else hf
    return out


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _run_provider(prov: str, model, x, breakdown: bool):
    """(ms, logits, graphs compiled by the first call, first call s, kernel table or None, its
    :class:`~cvt_cutlass.tools.timing.CallProfile`)."""
    import time

    import torch

    from .breakdown import kernel_times

    fn = lambda m=model, x=x: m(x).logits  # noqa: E731
    graphs, t0 = _graphs_compiled(), time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    first_s, graphs = time.perf_counter() - t0, _graphs_compiled() - graphs
    run = fn
    if prov.endswith("_graph"):
        run, out = graphed(fn)
    ms, calls = median_event_ms(run), call_profile(run)
    kernels = kernel_times(fn) if breakdown and not prov.endswith("_graph") else None
    return ms, out, graphs, first_s, kernels, calls


def bench_main(a) -> int:
    import copy

    import torch

    from .common import start

    run = start(a)
    if run is None:
        return 2
    providers = a.providers or list(DEFAULT_PROVIDERS)
    # Every compiled provider keeps a graph per batch kind; the HF forward's code object is shared.
    cfg = torch._dynamo.config
    for name, limit in (("recompile_limit", 64), ("cache_size_limit", 64), ("accumulated_recompile_limit", 512),
                        ("accumulated_cache_size_limit", 512)):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))
    rows, breakdowns = [], []
    base = random_cvt(a.model).cuda()
    for size in a.image_size_list:
        for dt in a.dtype:
            torch._dynamo.reset()
            hf = copy.deepcopy(base).to(run.torch_dtype[dt])
            models = _models(hf, providers)
            for b in a.batch:
                images = torch.randn(b, 3, size, size, device="cuda", generator=run.gen)
                with torch.inference_mode():
                    ref = base(images).logits.float()
                rows += _bench_batch(a, run, models, images.to(run.torch_dtype[dt]), ref, size, dt, breakdowns)
            del models, hf
            torch.cuda.empty_cache()
    _report(a, rows, breakdowns)
    return 0


def _bench_batch(a, run, models, x, ref, size, dt, breakdowns) -> list[dict]:
    import torch

    from ... import fallback
    from ...graphs import using_stage_graphs
    from .breakdown import format_table

    results, kernels = {}, {}
    for prov, model in models.items():
        fallback.reset()
        with torch.inference_mode(), using_stage_graphs(False if prov == "swapped_launched" else None):
            ms, _, graphs, first_s, kt, calls = _run_provider(prov, model, x, a.breakdown)
        with torch.inference_mode(), using_stage_graphs(False):  # a stage graph's replay counts no op
            fallback.reset()
            out = model(x).logits.float()  # one counted forward
        if kt:
            kernels[prov] = kt
        results[prov] = (ms, sqnr_db(out, ref), fallback.stats(), graphs, first_s, calls)
    b = x.shape[0]
    hf_ms = results["hf"][0] if "hf" in results else math.nan
    comp = [results[p][0] for p in ("compile", "compile_ro", "compile_max") if p in results]
    best_comp = min(comp) if comp else math.nan
    rows = []
    for prov, (ms, sq, st, graphs, first_s, calls) in results.items():
        rows.append({**run.row, "image_size": size, "dtype": dt, "batch": b, "provider": prov,
                     "ms": f"{ms:.4f}", "img_per_s": f"{b / ms * 1e3:.1f}", "vs_hf": _ratio(hf_ms, ms),
                     "vs_best_compile": _ratio(best_comp, ms), "sqnr_db": f"{sq:.1f}",
                     "cutlass_ops": sum(st["kernel_calls"].values()), "fallbacks": sum(st["fallbacks"].values()),
                     "graphs_compiled": graphs, "first_call_s": f"{first_s:.2f}",
                     "launches_per_forward": round(calls.launches), "gpu_kernels_per_forward": round(calls.kernels),
                     "host_ms": f"{calls.host_ms:.3f}", "gpu_kernel_ms": f"{calls.gpu_ms:.3f}",
                     "gpu_busy_ms": f"{calls.gpu_busy_ms:.3f}"})
    print(f"[bench model] {a.model} {size} b={b} {dt}: " + ", ".join(
        f"{p} {r[0]:.3f} ms" + (f" ({r[3]} graph(s) compiled, first call {r[4]:.1f} s)" if r[3] else "")
        for p, r in results.items()), flush=True)
    if kernels:
        text = f"\n### kernel time by category: {a.model} {size} batch {b} {dt}\n\n" + format_table(kernels)
        breakdowns.append(text)
        print(text, flush=True)
    return rows


def _ratio(peer_ms: float, ms: float) -> str:
    """peer / ours, or empty where the peer was not among the measured providers."""
    return "" if math.isnan(peer_ms) else f"{peer_ms / ms:.3f}"


def _x(ratio: str) -> str:
    return f"{ratio}x" if ratio else "- (peer not run)"


def _report(a, rows: list[dict], breakdowns: list[str]) -> None:
    from ..csvfile import append_csv

    if a.out and rows:
        append_csv(a.out, rows, list(rows[0].keys()))
        if breakdowns:
            with open(a.out.rsplit(".", 1)[0] + "_breakdown.md", "a") as f:
                f.write("\n".join(breakdowns) + "\n")
        try:
            from ..plots import plot_model_bench

            for p in plot_model_bench(a.out, str(__import__("pathlib").Path(a.out).parent)):
                print(f"plot: {p}")
        except ImportError:
            print("no plot: matplotlib is not installed (pip install matplotlib, then "
                  f"`cvt-cutlass plot --op model --profile {a.out} --out DIR`)")
    print("\n| image | dtype | batch | provider | ms | img/s | vs HF eager | vs best compile(HF) | SQNR dB | "
          "launches | host ms | GPU kernel ms | GPU busy ms | CUTLASS ops | fallbacks | graphs compiled | first call s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['image_size']} | {r['dtype']} | {r['batch']} | {r['provider']} | {r['ms']} | {r['img_per_s']} | "
              f"{_x(r['vs_hf'])} | {_x(r['vs_best_compile'])} | {r['sqnr_db']} | {r['launches_per_forward']} | "
              f"{r['host_ms']} | {r['gpu_kernel_ms']} | {r['gpu_busy_ms']} | {r['cutlass_ops']} | {r['fallbacks']} | "
              f"{r['graphs_compiled']} | {r['first_call_s']} |")
