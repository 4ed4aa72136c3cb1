"""``cvt-cutlass bench --op model``: whole-model inference, all providers in one process.

Providers (``--providers``, default all but max-autotune, which compiles for minutes):
``hf`` HF eager, ``hf_graph`` HF eager captured in a CUDA graph, ``compile`` torch.compile
(default mode), ``compile_max`` torch.compile(mode="max-autotune-no-cudagraphs"), ``swapped``
cvt_cutlass.swap eager, ``swapped_graph`` swapped + CUDA graph. Every provider runs the same
randomly initialised CvT (BatchNorm statistics and LayerNorm affines randomised too) on the same
random images under ``torch.inference_mode()``; median ms over CUDA-event-timed trials after a
warm-up, img/s, speedup over HF eager and over the best torch.compile, SQNR of the logits against
the fp32 model, and for the swapped providers the ops that ran on CUTLASS, on PyTorch by design
(LayerNorm) and as fallbacks.
"""

from __future__ import annotations

import math
import statistics

PROVIDERS = ("hf", "hf_graph", "compile", "compile_max", "swapped", "swapped_graph")
DEFAULT_PROVIDERS = ("hf", "hf_graph", "compile", "swapped", "swapped_graph")


def sqnr_db(x, ref) -> float:
    x, ref = x.double(), ref.double()
    noise = (x - ref).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


def build_model(name: str, num_labels: int = 1000):
    """A random-init HF CvtForImageClassification of a named config, with randomised BatchNorm
    statistics and LayerNorm affines (fresh modules would make BN folding trivial)."""
    import torch
    from transformers import CvtForImageClassification

    from ..checkpoint import hf_config

    torch.manual_seed(0)
    model = CvtForImageClassification(hf_config(name, num_labels=num_labels)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.2)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            elif isinstance(m, torch.nn.LayerNorm):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
    return model


def _time(fn, trials: int = 10, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(trials):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _graphed(fn):
    """fn captured in a CUDA graph (after a warm-up on a side stream); returns (replay, output)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g.replay, out


def bench_main(a) -> int:
    import copy

    import torch

    from .. import fallback
    from ..csvfile import append_csv
    from ..swap import swap
    from .breakdown import format_table, kernel_times
    from .common import start

    run = start(a)
    if run is None:
        return 2
    providers = a.providers or list(DEFAULT_PROVIDERS)
    bad = set(providers) - set(PROVIDERS)
    if bad:
        print(f"unknown providers {sorted(bad)}; have {PROVIDERS}")
        return 2
    rows, table, breakdowns = [], [], []
    base = build_model(a.model).cuda()
    for size in a.image_size_list:
        for b in a.batch:
            images = torch.randn(b, 3, size, size, device="cuda", generator=run.gen)
            with torch.inference_mode():
                ref = base(images).logits.float()
            for dt in a.dtype:
                tdt = run.torch_dtype[dt]
                x = images.to(tdt)
                hf = copy.deepcopy(base).to(tdt)
                results, kernels = {}, {}
                for prov in providers:
                    fallback.reset()
                    model = hf
                    if prov.startswith("swapped"):
                        model = swap(copy.deepcopy(hf))
                    elif prov.startswith("compile"):
                        torch._dynamo.reset()
                        mode = "max-autotune-no-cudagraphs" if prov == "compile_max" else None
                        model = torch.compile(hf, mode=mode)
                    with torch.inference_mode():
                        fn = lambda m=model, x=x: m(x).logits  # noqa: E731
                        if prov.endswith("_graph"):
                            replay, out = _graphed(fn)
                            ms = _time(replay)
                        else:
                            out = fn()
                            ms = _time(fn)
                        if a.breakdown and not prov.endswith("_graph"):  # graphs replay the same kernels
                            kernels[prov] = kernel_times(fn)
                        fallback.reset()
                        out = fn().float()  # one counted forward
                    st = fallback.stats()
                    results[prov] = (ms, sqnr_db(out, ref), st)
                    if prov.startswith("swapped"):
                        del model
                        torch.cuda.empty_cache()
                hf_ms = results["hf"][0] if "hf" in results else math.nan
                comp = [results[p][0] for p in ("compile", "compile_max") if p in results]
                best_comp = min(comp) if comp else math.nan
                for prov, (ms, sq, st) in results.items():
                    kc = sum(st["kernel_calls"].values())
                    fb = sum(st["fallbacks"].values())
                    row = {**run.row, "image_size": size, "dtype": dt, "batch": b, "provider": prov,
                           "ms": f"{ms:.4f}", "img_per_s": f"{b / ms * 1e3:.1f}",
                           "vs_hf": f"{hf_ms / ms:.3f}", "vs_best_compile": f"{best_comp / ms:.3f}",
                           "sqnr_db": f"{sq:.1f}", "cutlass_ops": kc, "fallbacks": fb}
                    rows.append(row)
                    table.append(row)
                print(f"[bench model] {a.model} {size} b={b} {dt}: " + ", ".join(
                    f"{p} {r[0]:.3f} ms" for p, r in results.items()), flush=True)
                if kernels:
                    text = f"\n### kernel time by category: {a.model} {size} batch {b} {dt}\n\n" + format_table(kernels)
                    breakdowns.append(text)
                    print(text, flush=True)
                del hf
                torch.cuda.empty_cache()
    if a.out:
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
    print("\n| image | dtype | batch | provider | ms | img/s | vs HF eager | vs best compile | SQNR dB | "
          "CUTLASS ops | fallbacks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['image_size']} | {r['dtype']} | {r['batch']} | {r['provider']} | {r['ms']} | {r['img_per_s']} | "
              f"{r['vs_hf']}x | {r['vs_best_compile']}x | {r['sqnr_db']} | {r['cutlass_ops']} | "
              f"{r['fallbacks']} |")
    return 0
