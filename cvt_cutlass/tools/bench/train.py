"""``cvt-cutlass bench --op train``: ms per training step and img/s, all providers in one process.

Providers (``--providers``, default all): ``hf`` HF eager, ``hf_graph`` HF's whole step captured
in a CUDA graph, ``compile`` torch.compile(HF), ``swapped`` cvt_cutlass.swap eager,
``swapped_ops`` the same with every layer run op by op (``set_layer_op(False)``: the path before
the layer op), ``swapped_launched`` swapped eager with its stages' CUDA graphs off
(``set_stage_graphs(False)``: every kernel launched from the host on every step; ``swapped``
replays each stage's captured forward and backward, :mod:`cvt_cutlass.graphs`), ``swapped_graph`` the swapped model's whole step (forward, backward, SGD) captured in a CUDA graph
(:func:`cvt_cutlass.train.make_captured_step`), ``swapped_ckpt`` the swapped model with activation
checkpointing per layer (``gradient_checkpointing_enable()``), ``swapped_compile`` torch.compile(swapped);
these keep the residual stream in fp32 under autocast as HF's CvT does (swap's default);
``swapped_16bit`` / ``swapped_graph_16bit`` run it in autocast's dtype instead (``swap(model,
residual_stream="compute")``: the faster, less accurate stream),
``hf_det`` / ``swapped_det`` HF eager / swapped eager under ``torch.use_deterministic_algorithms(True)``
(CUBLAS_WORKSPACE_CONFIG=:4096:8 for the whole run where unset, as PyTorch requires: the cost of
bitwise-reproducible gradients). Each
trains a copy
of the same randomly initialised CvT (fp32 master weights) on the same random images and labels:
forward under ``torch.autocast`` in ``--dtype`` (bf16 by default; fp16 with a GradScaler), fp32
cross-entropy, backward, SGD with momentum 0.9. A step is timed with CUDA events around the whole
step (host time included: the events bracket what the host launched), the median over trials after
warm-up steps, each step waited for (a loop that reads its loss every step); "pipelined" is the
same number of steps launched back to back with one sync after the last (a loop that reads no
value per step: the host runs ahead); the first step (compilation, kernel builds, a graph's warm-up and capture) is timed
apart, in wall seconds. Peak memory is torch's peak allocation over the provider's whole run
(parameters, optimizer state, activations, a captured graph's pool).
One extra step is counted, with the stages' CUDA graphs off (a replay calls no op): CUTLASS kernel
calls in the forward (up to the loss) and in the rest (backward and optimizer), and every fallback
with its reason; the stage-graph replays and eager calls (by reason) of the timed steps are counted
too.

Rows go to ``--out`` (long format, one row per provider and batch); the table prints last with
the speedups over HF eager and over torch.compile(HF); ``cvt-cutlass plot --op model --profile``
of the CSV draws img/s against batch (``train_<model>_<dtype>.png``).
"""

from __future__ import annotations

import copy
import functools
import gc
import os
import statistics
import time

from ...checkpoint import random_cvt
from .common import deterministic_mode, markdown

# The compiled providers run last, after every batch size of the eager ones: eager steps measured
# after a torch.compile in the same process were slower (H200, batch 128, 2026-11-23: swapped eager
# 29.6 ms/step measured before compile(HF), 38.0 after it; host-bound steps, so host work left
# running by the compilation is the likely cause, not established).
TRAIN_PROVIDERS = ("hf", "hf_graph", "swapped_ops", "swapped_launched", "swapped", "swapped_graph", "swapped_ckpt",
                   "swapped_16bit", "swapped_graph_16bit", "hf_det", "swapped_det", "compile", "swapped_compile")
TRIALS, WARMUP = 15, 3


def _provider_model(base, prov: str):
    """A fresh copy of the fp32 model for one provider, on the GPU, in train mode; (module to
    step, module holding the parameters)."""
    import torch

    from ...swap import swap

    model = copy.deepcopy(base).cuda().train()
    if prov.startswith("swapped"):  # *_16bit: the residual stream in autocast's dtype
        swap(model, residual_stream="compute" if prov.endswith("_16bit") else "fp32")
    if prov == "swapped_ckpt":  # transformers 5 names it activation_checkpointing_enable
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    return (torch.compile(model) if prov.endswith("compile") else model), model


def _timed_steps(step, x, y, trials: int) -> list[float]:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(trials):
        start.record()
        step(x, y)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _pipelined_ms(step, x, y, n: int) -> float:
    """ms per step of ``n`` steps launched back to back with one sync after the last: a loop that
    reads no value per step, whose host runs ahead of the GPU as far as its launches allow."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        step(x, y)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def counted_step(runner, opt, prec, x, y) -> tuple[dict, dict]:
    """Kernel calls and fallbacks of one step: (forward up to the loss, the whole step), with the
    stages' CUDA graphs off (a replay calls no op)."""
    from ...graphs import using_stage_graphs

    with using_stage_graphs(False):
        return _counted_step(runner, opt, prec, x, y)


def _counted_step(runner, opt, prec, x, y) -> tuple[dict, dict]:
    import torch
    import torch.nn.functional as F

    from ... import fallback

    fallback.reset()
    with torch.autocast("cuda", dtype=prec.amp, enabled=prec.amp is not None):
        loss = F.cross_entropy(runner(x).logits.float(), y)
    torch.cuda.synchronize()
    fwd = fallback.stats()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.cuda.synchronize()
    return fwd, fallback.stats()


def measure_provider(base, prov: str, prec, x, y, lr: float = 0.01) -> dict:
    """ms / step (median), img/s, first-step seconds, peak GiB, kernel calls and fallbacks."""
    from ...graphs import set_stage_graphs
    from ...layer import set_layer_op

    set_layer_op(prov != "swapped_ops")
    set_stage_graphs(False if prov == "swapped_launched" else None)
    try:
        with deterministic_mode(prov.endswith("_det")):
            return _measure(base, prov, prec, x, y, lr)
    finally:
        set_layer_op(None)
        set_stage_graphs(None)


def _measure(base, prov: str, prec, x, y, lr: float) -> dict:
    import torch

    from ...graphs import graph_stats, reset_graph_stats
    from ...train import make_captured_step, make_optimizer, make_step
    from ..timing import call_profile

    torch.cuda.reset_peak_memory_stats()  # the peak over the provider's whole run (a graph's pool is
    runner, model = _provider_model(base, prov)  # allocated while it is captured)
    opt = make_optimizer(model.parameters(), "sgd", lr, 0.0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if prov.removesuffix("_16bit").endswith("graph"):
        step = make_captured_step(runner, opt, prec, x, y)  # first step = warm-up + capture
    else:
        step = make_step(runner, opt, prec, "cuda")
    step(x, y)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(WARMUP):
        step(x, y)
    torch.cuda.synchronize()
    reset_graph_stats()
    ms = statistics.median(_timed_steps(step, x, y, TRIALS))
    replays = graph_stats()  # the stages' CUDA graph counts over the timed steps
    pipelined = _pipelined_ms(step, x, y, TRIALS)
    peak = torch.cuda.max_memory_allocated() / 2**30
    calls = call_profile(functools.partial(step, x, y))
    fwd, both = counted_step(runner, opt, prec, x, y)
    del runner, model, opt, step
    gc.collect()  # a step closure refers to itself: the model would outlive this call into the next peak
    torch.cuda.empty_cache()
    if prov.endswith("compile"):
        torch._dynamo.reset()
    calls_f, calls_all = sum(fwd["kernel_calls"].values()), sum(both["kernel_calls"].values())
    # the counted step runs eagerly: its host times inside the layer op and the libraries are not a
    # replayed graph's (which spends none there)
    eager_host = not prov.removesuffix("_16bit").endswith("graph")
    return {"ms_per_step": ms, "img_per_s": x.shape[0] / ms * 1e3, "ms_per_step_pipelined": pipelined,
            "first_step_s": first_s, "peak_gib": peak,
            "launches_per_step": round(calls.launches), "gpu_kernels_per_step": round(calls.kernels),
            "host_ms": round(calls.host_ms, 3), "gpu_kernel_ms": round(calls.gpu_ms, 3),
            "gpu_busy_ms": round(calls.gpu_busy_ms, 3),
            "kernel_calls_fwd": calls_f, "kernel_calls_bwd": calls_all - calls_f,
            "stage_graph_replays": replays.get("replays", 0),
            "stage_graph_eager": ";".join(f"{k[len('eager: '):]}={v}" for k, v in sorted(replays.items())
                                          if k.startswith("eager: ")),
            "fallbacks": sum(both["fallbacks"].values()),
            "fallback_reasons": ";".join(f"{k}={v}" for k, v in sorted(both["fallbacks"].items())),
            "layer_op_host_ms": round(sum(both.get("op_host_us", {}).values()) / 1e3, 3) if eager_host else 0.0,
            "library_host_ms": round(sum(both["library_host_us"].values()) / 1e3, 3) if eager_host else 0.0,
            "library_host_us_by_family": ";".join(f"{k}={v:.0f}" for k, v in sorted(both["library_host_us"].items()))
            if eager_host else ""}


def bench_main(a) -> int:
    import torch

    from ...train import precision_of
    from ..csvfile import append_csv
    from . import common

    run = common.start(a)
    if run is None:
        return 2
    provs = a.providers or list(TRAIN_PROVIDERS)
    if any(p.endswith("_det") for p in provs):  # read by cuBLAS when it makes its workspace: before any step
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    size = a.image_size or 224
    base = random_cvt(a.model).train()
    rows = []
    for dt in a.dtype:
        prec = precision_of("fp32", dt, True)
        data = {b: (torch.randn(b, 3, size, size, device="cuda", generator=run.gen),
                    torch.randint(0, 1000, (b,), device="cuda", generator=run.gen)) for b in a.batch}
        for prov in provs:
            for b, (x, y) in data.items():
                r = {**run.row, "image_size": size, "op": "train", "provider": prov, "dtype": dt, "batch": b,
                     **measure_provider(base, prov, prec, x, y)}
                print(f"[bench train] {dt} b={b} {prov}: {r['ms_per_step']:.2f} ms/step, {r['img_per_s']:.0f} img/s, "
                      f"{r['ms_per_step_pipelined']:.2f} ms/step pipelined, "
                      f"{r['launches_per_step']} launches, host {r['host_ms']:.2f} ms (in the layer op "
                      f"{r['layer_op_host_ms']:.2f}, in kernel libraries {r['library_host_ms']:.2f}), "
                      f"GPU kernels {r['gpu_kernel_ms']:.2f} ms (busy {r['gpu_busy_ms']:.2f}), "
                      f"first step {r['first_step_s']:.1f} s, peak {r['peak_gib']:.2f} GiB, "
                      f"{r['kernel_calls_fwd']}+{r['kernel_calls_bwd']} kernel calls, {r['fallbacks']} fallbacks; "
                      f"library host us by family: {r['library_host_us_by_family'] or '-'}",
                      flush=True)
                rows.append(r)
    rows.sort(key=lambda r: (r["dtype"], r["batch"], provs.index(r["provider"])))
    _ratios(rows)
    rows = [_fmt(r) for r in rows]
    if a.out:
        append_csv(a.out, rows, list(rows[0]))
    print(markdown_table(rows))
    return 0


def _ratios(rows: list[dict]) -> None:
    """speedup over HF eager and over torch.compile(HF) at the same (dtype, batch), where measured."""
    by = {(r["dtype"], r["batch"], r["provider"]): r["ms_per_step"] for r in rows}
    for r in rows:
        for peer, col in (("hf", "vs_hf"), ("compile", "vs_compile")):
            p = by.get((r["dtype"], r["batch"], peer))
            r[col] = f"{p / r['ms_per_step']:.2f}" if p else ""


def _fmt(r: dict) -> dict:
    out = dict(r)
    for k, f in (("ms_per_step", "{:.3f}"), ("img_per_s", "{:.0f}"), ("ms_per_step_pipelined", "{:.3f}"),
                 ("first_step_s", "{:.1f}"),
                 ("peak_gib", "{:.2f}")):
        out[k] = f.format(r[k])
    return out


def markdown_table(rows: list[dict]) -> str:
    head = ["dtype", "batch", "provider", "ms/step", "img/s", "vs HF", "vs compile", "ms/step pipelined", "launches",
            "host ms", "GPU kernel ms", "GPU busy ms", "first step s", "peak GiB", "kernel calls fwd+bwd",
            "stage graph replays", "fallbacks"]
    return "\n".join(markdown(head, ([
        *(r[c] for c in ("dtype", "batch", "provider", "ms_per_step", "img_per_s", "vs_hf", "vs_compile",
                         "ms_per_step_pipelined", "launches_per_step", "host_ms", "gpu_kernel_ms", "gpu_busy_ms",
                         "first_step_s", "peak_gib")),
        f"{r['kernel_calls_fwd']}+{r['kernel_calls_bwd']}",
        f"{r.get('stage_graph_replays', 0)} {r.get('stage_graph_eager', '')}".strip(),
        f"{r['fallbacks']} {r['fallback_reasons']}"]
        for r in rows)))


# ----------------------------------------------------------------------------- gradient agreement
# "_16bit": the swapped model with swap(residual_stream="compute") (the residual stream in autocast's
# dtype); the others keep it in fp32 under autocast (swap's default, HF's autocast numerics)
GRAD_MODES = ("bf16", "fp16", "autocast_bf16", "autocast_fp16", "autocast_bf16_16bit", "autocast_fp16_16bit")


def _grads(model, x, y, mode: str, seed: int) -> dict:
    """{name: fp64 gradient} of one cross-entropy step of ``model`` in ``mode``."""
    import torch
    import torch.nn.functional as F

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[mode.removeprefix("autocast_")]
    auto = mode.startswith("autocast")
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dt, enabled=auto):
        loss = F.cross_entropy(model(x if auto else x.to(dt)).logits.float(), y)
    loss.backward()
    return {n: p.grad.double() for n, p in model.named_parameters()}


def gradient_agreement(name: str, mode: str, batch: int = 8, seed: int = 0) -> tuple[list[dict], dict]:
    """Per parameter: the relative error and cosine similarity of HF's and the swapped model's
    gradients in ``mode`` (pure bf16 / fp16 parameters, or fp32 master weights under autocast)
    against HF in fp32, same weights, batch and labels, drop path off; and a summary over all
    tensors (the concatenated gradient, and the median per-tensor ratio of errors). A mode ending
    in "_16bit" swaps with ``residual_stream="compute"`` (the others with swap's default, "fp32")."""
    import torch

    from ...swap import swap

    stream = "compute" if mode.endswith("_16bit") else "fp32"
    run_mode = mode.removesuffix("_16bit")

    ref = random_cvt(name).cuda().train()
    for m in ref.modules():
        if hasattr(m, "drop_prob"):
            m.drop_prob = 0.0
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(batch, 3, 224, 224, device="cuda", generator=g)
    y = torch.randint(0, 1000, (batch,), device="cuda", generator=g)
    low = copy.deepcopy(ref)
    sw = swap(copy.deepcopy(ref), residual_stream=stream)
    if not run_mode.startswith("autocast"):
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[run_mode]
        low, sw = low.to(dt), sw.to(dt)
    want, hf, ours = (_grads(m, x, y, run_mode if m is not ref else "fp32", seed) for m in (ref, low, sw))
    rows = [agreement_row(name, mode, n, want[n], hf[n], ours[n]) for n in want]
    return rows, agreement_summary(rows, want, hf, ours)


def _rel(a, ref) -> float:
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def _cos(a, ref) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(a.flatten(), ref.flatten(), dim=0))


def agreement_row(name, mode, param, want, hf, ours) -> dict:
    return {"model": name, "mode": mode, "param": param, "numel": want.numel(), "ref_norm": float(want.norm()),
            "hf_rel_err": _rel(hf, want), "swapped_rel_err": _rel(ours, want), "hf_cos": _cos(hf, want),
            "swapped_cos": _cos(ours, want)}


def agreement_summary(rows, want, hf, ours) -> dict:
    """The concatenated gradient's error and cosine for both, and over the tensors whose reference
    gradient is not ~0 (>= 1e-3 of the largest norm: the key projections' biases have a zero
    gradient in exact math), the median and max of swapped / HF relative error."""
    import statistics

    import torch

    cat = {k: torch.cat([d[n].flatten() for n in want]) for k, d in (("ref", want), ("hf", hf), ("sw", ours))}
    top = max(r["ref_norm"] for r in rows)
    ratios = [r["swapped_rel_err"] / max(r["hf_rel_err"], 1e-12) for r in rows if r["ref_norm"] >= 1e-3 * top]
    return {"hf_rel_err": _rel(cat["hf"], cat["ref"]), "swapped_rel_err": _rel(cat["sw"], cat["ref"]),
            "hf_cos": _cos(cat["hf"], cat["ref"]), "swapped_cos": _cos(cat["sw"], cat["ref"]),
            "median_ratio": statistics.median(ratios), "max_ratio": max(ratios), "tensors": len(ratios)}
