"""``cvt-cutlass run``: the main job. Load a CvT, build its kernels, swap it, check, time.

1. the model: ``--checkpoint`` (anything :func:`cvt_cutlass.load_cvt` reads) or ``--model``
   (a named config, random init with randomised BatchNorm statistics and LayerNorm affines);
2. with a GPU: build every kernel the swapped model can call at this image size and dtype, at any
   batch size (parallel nvcc with the torch binding beside them, progress bar; cached
   afterwards), run the fp32 model, the unswapped model in the run dtype and the swapped one on
   the same random images, and time HF eager, HF + CUDA graph, swapped and swapped + CUDA graph
   (CUDA events, warm-up, medians); say how long the start took (kernels built, first forward);
3. without a GPU: say so and run the CPU reference path instead (the swapped model's ops run their
   PyTorch references, each call counted as a fallback), in fp32 at a small batch;
4. a short table: logits SQNR against fp32, top-1 agreement with the unswapped model, ms, img/s,
   kernel calls and fallbacks. Exit status 1 when the swapped logits are worse than the unswapped
   model's in the same dtype by more than 3 dB, or anything fell back on the GPU.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import os
import sys
import time

from ..api import model_kernels


def process_age() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere since this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()
CPU_BATCH = 2  # the CPU reference path's largest batch


def load_model(a):
    """(model, label) of the ``--checkpoint`` / ``--model`` arguments of run and train: the
    checkpoint's weights (anything :func:`cvt_cutlass.load_cvt` reads), or a named config with
    random weights (:func:`cvt_cutlass.checkpoint.random_cvt`)."""
    from ..checkpoint import load_cvt, random_cvt

    if a.checkpoint:
        return load_cvt(a.checkpoint, config=a.config, num_heads=a.num_heads), a.checkpoint
    if a.config or a.num_heads:
        raise ValueError("--config / --num-heads describe a --checkpoint's model (--model names the random "
                         "model's config)")
    return random_cvt(a.model), f"{a.model} (random weights)"


def _first_forward(model, x) -> float:
    """Seconds since the process started when the first forward of ``model`` (if any) finished on
    the GPU."""
    import torch

    if model is not None:
        model(x)
    torch.cuda.synchronize()
    return process_age()


def _table(rows: list[dict]) -> str:
    head = "| model | provider | ms | img/s | SQNR vs fp32 dB | top-1 = unswapped | CUTLASS calls | fallbacks |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['provider']} | {r['ms']} | {r['img_s']} | {r['sqnr']} | {r['top1']} | "
                     f"{r['calls']} | {r['fallbacks']} |")
    return "\n".join(lines)


def run_main(a) -> int:
    import torch

    t_enter = process_age()
    if not torch.cuda.is_available():
        return _cpu_reference(a, *load_model(a))
    from .. import runtime

    dev = runtime.device_info(torch.cuda.current_device())
    arch = runtime.arch_for(dev.cc)
    if arch is None:
        print(f"cvt-cutlass run: {dev.name} (sm_{dev.cc}) is older than sm_80; the kernels need sm_80 or newer")
        return 2
    phases = {"python, torch, cvt_cutlass imports": t_enter}
    with cf.ThreadPoolExecutor(max_workers=1) as pool:
        # A named config's kernels build while the model is constructed (a checkpoint's config
        # comes with its weights: then after).
        building = None if a.checkpoint else pool.submit(_build, a, _named_config(a.model), dev, arch)
        model, label = load_model(a)
        phases["transformers, model"] = process_age()
        building = building or pool.submit(_build, a, model.config, dev, arch)
        specs, missing = building.result()
    phases["kernels + binding (beside the model)"] = process_age()
    x = torch.randn(a.batch, 3, a.image_size, a.image_size, device="cuda",
                    generator=torch.Generator(device="cuda").manual_seed(0))
    model = model.cuda()
    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    phases["model to GPU"] = _first_forward(None, None)
    with torch.inference_mode():
        phases["first swapped forward"] = _first_forward(_swapped(model, tdt), x.to(tdt))
    print(f"start: {missing} kernel(s) built, {len(specs) - missing} from the cache; seconds since the process "
          "started: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()), flush=True)
    return _compare(a, model, label, x, tdt)


def _named_config(name: str):
    from ..checkpoint import hf_config

    return hf_config(name)


def _build(a, config, dev, arch) -> tuple[list, int]:
    """Every kernel the swapped model can call at this image size and dtype (any batch), built
    in parallel beside the torch binding; (specs, how many were missing)."""
    from .. import runtime

    # the model runs in a.dtype without autocast: no fp32 residual stream
    specs = model_kernels(config, a.image_size, a.dtype, arch, gpu=dev.name, residual_stream="compute")
    jobs = runtime.plan(specs, dev.cc)
    missing = sum(not j.is_built for j in jobs)
    print(f"cvt-cutlass run: {a.model if not a.checkpoint else a.checkpoint}, batch {a.batch}, "
          f"{a.image_size}x{a.image_size}, {a.dtype}, {dev.name} (sm{arch} path): {len(specs)} kernels serve every "
          f"batch size 1-1024 ({missing} to build)", flush=True)
    runtime.prebuild(specs, dev.cc, jobs=a.jobs, binding=True, planned=jobs)
    return specs, missing


def _swapped(model, dtype):
    from ..swap import swap

    return swap(copy.deepcopy(model).to(dtype))


def _cpu_reference(a, model, label) -> int:
    """No GPU: the swapped model's ops run their PyTorch references, every call a fallback."""
    import torch

    from .. import fallback
    from ..swap import swap, unswap
    from ..tools.compare import sqnr_db

    print("cvt-cutlass run: no CUDA GPU is visible (torch.cuda.is_available() is False); running the CPU "
          f"reference path: the swapped model's ops run their PyTorch references (fp32, not --dtype {a.dtype}; every "
          "call counted as a fallback), no kernel is built or timed.", flush=True)
    b, size = min(a.batch, CPU_BATCH), a.image_size
    if b != a.batch:
        print(f"cvt-cutlass run: the CPU reference path runs batch {b} (--batch {a.batch} asked)", file=sys.stderr)
    x = torch.randn(b, 3, size, size, generator=torch.Generator().manual_seed(0))
    fallback.reset()
    with torch.inference_mode():
        ref = model(x).logits
        swap(model)
        t0 = time.perf_counter()
        out = model(x).logits
        ms = (time.perf_counter() - t0) * 1e3
    st = fallback.stats()
    rows = [{"model": label, "provider": f"swapped, CPU reference (batch {b}, fp32)", "ms": f"{ms:.1f}",
             "img_s": f"{b / ms * 1e3:.1f}", "sqnr": f"{sqnr_db(out, ref):.1f}",
             "top1": f"{(out.argmax(-1) == ref.argmax(-1)).float().mean().item():.3f}",
             "calls": sum(st["kernel_calls"].values()), "fallbacks": sum(st["fallbacks"].values())}]
    print(_table(rows))
    unswap(model)
    return 0 if sqnr_db(out, ref) > 80 else 1


def _measure(fn):
    """(logits, stats of one counted forward, eager ms, CUDA-graph ms) of a forward ``fn``."""
    from .. import fallback
    from ..tools.timing import graphed, median_event_ms

    fallback.reset()
    out = fn().float()
    st = fallback.stats()
    eager_ms = median_event_ms(fn)
    replay, _ = graphed(fn)
    return out, st, eager_ms, median_event_ms(replay)


def _compare(a, model, label, x, tdt) -> int:
    """fp32 reference, HF in the run dtype and the swapped model: logits and times."""
    import torch

    from ..tools.compare import sqnr_db

    with torch.inference_mode():
        ref = model(x).logits.float()
        hf = copy.deepcopy(model).to(tdt)
        xs = x.to(tdt)
        same = hf(xs).logits.float()
        results = {prov: _measure(lambda m=m: m(xs).logits)
                   for prov, m in (("HF eager", hf), ("swapped", _swapped(hf, tdt)))}
    rows = []
    for prov, (out, st, eager_ms, graph_ms) in results.items():
        for suffix, ms in (("", eager_ms), (" + CUDA graph", graph_ms)):
            rows.append({"model": label, "provider": prov + suffix, "ms": f"{ms:.3f}",
                         "img_s": f"{a.batch / ms * 1e3:.0f}", "sqnr": f"{sqnr_db(out, ref):.1f}",
                         "top1": f"{(out.argmax(-1) == same.argmax(-1)).float().mean().item():.3f}",
                         "calls": sum(st["kernel_calls"].values()), "fallbacks": sum(st["fallbacks"].values())})
    print()
    print(_table(rows))
    s_sw, s_same = sqnr_db(results["swapped"][0], ref), sqnr_db(same, ref)
    fb = sum(results["swapped"][1]["fallbacks"].values())
    hf_ms, sw_ms = results["HF eager"][3], results["swapped"][3]
    print(f"\nswapped + CUDA graph vs HF + CUDA graph: {hf_ms / sw_ms:.2f}x; logits SQNR {s_sw:.1f} dB "
          f"(unswapped {a.dtype}: {s_same:.1f} dB); fallbacks: {fb}")
    if s_sw < s_same - 3 or fb:
        print("cvt-cutlass run: FAILED (swapped logits worse than the unswapped model's by > 3 dB, or fallbacks)")
        return 1
    return 0
