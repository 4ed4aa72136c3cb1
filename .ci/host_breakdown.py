"""Where the eager training step's host time goes, without a profiler attached: per phase (zero_grad,
forward + loss, backward, optimizer step) the host time to enqueue it, the GPU time it launched,
its kernel launches, and how much of the host time was inside the layer op's C++ (its forward and
backward) and inside the kernel libraries' launch entry points; plus what one bare launch costs
from Python on this host. CvT-13 224, bf16 autocast, fused SGD with momentum, the swapped model.

With --python, the Python functions of the forward and of the backward by own time (cProfile,
five steps at the first batch), instead of the table.

With --compile, the swapped model under torch.compile (Inductor, default mode).

With --immediate-sums, the layer op's backward runs each kernel's finishing column sums where the
kernel runs instead of deferring them to one launch; with --ab-sums, both interleaved step by step
in one process (median step time, forward and backward host time per mode); with --ab-buffers,
each layer's 16 weights cast into one buffer (the default) and each into a view of its own,
likewise interleaved; with --ab-optimizer, the planned fused SGD step (the default) and torch's own.

Usage: python .ci/host_breakdown.py [batches, default 32,128] [trials, default 12] [--python]
       [--compile] [--immediate-sums | --ab-sums | --ab-buffers | --ab-optimizer]
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from cvt_cutlass import fallback, params, runtime
from cvt_cutlass.checkpoint import random_cvt
from cvt_cutlass.swap import swap
from cvt_cutlass.train import PlannedSGD, make_optimizer

PHASES = ("zero_grad", "forward", "backward", "optimizer")


def bare_launch_us(n: int = 4000) -> float:
    """Host microseconds per torch.cuda._sleep(0) call (Python, a thin C++ path, the launch)."""
    for _ in range(100):
        torch.cuda._sleep(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        torch.cuda._sleep(0)
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def phase_fns(model, opt, x, y):
    state = {}

    def fwd():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            state["loss"] = F.cross_entropy(model(x).logits.float(), y)

    return {"zero_grad": lambda: opt.zero_grad(set_to_none=True), "forward": fwd,
            "backward": lambda: state.pop("loss").backward(), "optimizer": lambda: opt.step()}


def host_split() -> tuple[float, float]:
    """(ms inside the layer op's CUDA implementations, ms inside the kernel libraries) so far."""
    op_host = getattr(runtime, "op_host_time", dict)  # absent in versions before it (measured as 0)
    op = sum(ns for _, ns in op_host().values()) / 1e6
    lib = sum(ns for _, ns in runtime.library_host_time().values()) / 1e6
    return op, lib


def timed_step(fns) -> dict[str, tuple[float, float, float, float]]:
    """One step, phase by phase with a sync before each: {phase: (host ms, GPU ms, op ms, lib ms)}."""
    out = {}
    for name in PHASES:
        torch.cuda.synchronize()
        fallback.reset()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        t0 = time.perf_counter()
        fns[name]()
        host = (time.perf_counter() - t0) * 1e3
        ev1.record()
        torch.cuda.synchronize()
        out[name] = (host, ev0.elapsed_time(ev1), *host_split())
    return out


def launches(fns) -> dict[str, int]:
    """Kernel launches per phase (one profiled step; memcpy / memset not counted)."""
    counts = {}
    for name in PHASES:
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fns[name]()
            torch.cuda.synchronize()
        counts[name] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                           and not e.name.startswith(("Memcpy", "Memset")))
    return counts


def setup(batch: int):
    model = swap(random_cvt("cvt-13").cuda().train())
    if "--compile" in sys.argv:
        model = torch.compile(model)
    opt = make_optimizer(model.parameters(), "sgd", 0.01, 0.0)
    OPTIMIZERS[:] = [opt]
    g = torch.Generator(device="cuda").manual_seed(batch)
    x = torch.randn(batch, 3, 224, 224, device="cuda", generator=g)
    y = torch.randint(0, 1000, (batch,), device="cuda", generator=g)
    return phase_fns(model, opt, x, y)


def python_profile(batch: int) -> None:
    """Own time of the Python functions (and the C functions they call) in the forward and the
    backward phases, five steps, the GPU synchronized between phases (not profiled)."""
    fns = setup(batch)
    for _ in range(4):
        timed_step(fns)
    profs = {"forward": cProfile.Profile(), "backward": cProfile.Profile()}
    for _ in range(5):
        for name in PHASES:
            torch.cuda.synchronize()
            prof = profs.get(name)
            if prof is not None:
                prof.enable()
            fns[name]()
            if prof is not None:
                prof.disable()
    for name, prof in profs.items():
        print(f"\n=== {name}, batch {batch}, 5 steps (cProfile, by own time)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(35)
    # the C++ side (ops, autograd nodes, the engine) by self CPU time: torch profiler, one step,
    # the first profiled call in each phase a warm-up (the profiler's first launch is slow)
    for name in ("forward", "backward"):
        fns["zero_grad"]()
        if name == "backward":
            fns["forward"]()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as tp:
            torch.cuda._sleep(0)
            fns[name]()
            torch.cuda.synchronize()
        if name == "forward":
            fns["backward"]()
        print(f"\n=== {name}, batch {batch}, one step (torch profiler, CPU, by self time)")
        print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=90))
        print(f"copies in the {name} by input shapes (calls):")
        for e in tp.key_averages(group_by_input_shape=True):
            if e.key in ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy"):
                print(f"  {e.key:16s} {e.count:4d}  {str(e.input_shapes)[:140]}")
    kernel_counts(fns)


def kernel_counts(fns) -> None:
    """The kernels each phase launches, by name and count (one profiled step)."""
    for name in PHASES:
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fns[name]()
            torch.cuda.synchronize()
        counts: dict[str, int] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                counts[e.name[:110]] = counts.get(e.name[:110], 0) + 1
        print(f"\n=== kernels in {name}: {sum(counts.values())}")
        for k, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"{n:5d}  {k}")


def run(batch: int, trials: int) -> list[dict]:
    fns = setup(batch)
    for _ in range(4):
        timed_step(fns)
    runs = [timed_step(fns) for _ in range(trials)]
    n = launches(fns)
    rows = []
    for name in PHASES:
        med = [statistics.median(r[name][i] for r in runs) for i in range(4)]
        rows.append({"batch": batch, "phase": name, "host_ms": med[0], "gpu_ms": med[1], "launches": n[name],
                     "layer_op_ms": med[2], "library_ms": med[3]})
    assert fallback.total_fallbacks() == 0, fallback.stats()["fallbacks"]
    return rows


OPTIMIZERS: list = []  # the optimizer setup() made


def set_planned_optimizer(on: bool) -> None:
    """The optimizer's step from its plan (PlannedSGD) or torch's own fused SGD step: the same
    state, so one instance switches class between steps."""
    OPTIMIZERS[0].__class__ = PlannedSGD if on else torch.optim.SGD


# what --ab-<name> alternates: (column label, the setter, the two modes' labels)
AB_TOGGLES = {"sums": ("column sums", runtime.set_deferred_sums, ("deferred", "immediate")),
              "buffers": ("layer weights", params.set_weight_buffers, ("one buffer per layer", "one view each")),
              "optimizer": ("fused SGD step", set_planned_optimizer, ("planned (PlannedSGD)", "torch.optim.SGD"))}


def ab(batch: int, trials: int, toggle: str) -> None:
    """Two modes of one switch (AB_TOGGLES) interleaved step by step in one process (the host's
    drift hits both alike): median step wall time (a sync per step, as a loop reading its loss),
    forward and backward host time, launches, per mode."""
    _, setter, labels = AB_TOGGLES[toggle]
    fns = setup(batch)
    res: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    for i in range(trials + 2):  # two rounds of warm-up (each mode plans its own first step)
        for mode in (True, False):
            setter(mode)
            for name in PHASES:  # one step first: what the switch makes the next forward do once
                fns[name]()  # (the weight-buffer switch finds the stages' recipes again) stays out
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for name in PHASES:
                fns[name]()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
            t = timed_step(fns)
            if i >= 2:
                res[mode].append((wall, t["forward"][0], t["backward"][0], t["optimizer"][0]))
    counts = {}
    for mode in (True, False):
        setter(mode)
        counts[mode] = sum(launches(fns).values())
    setter(True)
    for mode in (True, False):
        med = [statistics.median(r[k] for r in res[mode]) for k in range(4)]
        print(f"| {batch} | {labels[0 if mode else 1]} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} | {med[3]:.2f} | "
              f"{counts[mode]} |")


def main() -> None:
    if "--immediate-sums" in sys.argv:  # each column sum where its kernel runs (the layer op defers them)
        runtime.set_deferred_sums(False)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    batches = [int(b) for b in (args[0] if args else "32,128").split(",")]
    trials = int(args[1]) if len(args) > 1 else 12
    if "--python" in sys.argv:
        return python_profile(batches[0])
    for toggle, (label, _, _) in AB_TOGGLES.items():
        if f"--ab-{toggle}" in sys.argv:
            print(f"| batch | {label} | step ms (sync per step) | forward host ms | backward host ms | "
                  "optimizer host ms | launches per step |")
            print("|---|---|---|---|---|---|---|")
            for b in batches:
                ab(b, trials, toggle)
            return None
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bare launch from Python "
          f"(torch.cuda._sleep(0)): {bare_launch_us():.2f} us", flush=True)
    rows = [r for b in batches for r in run(b, trials)]
    print("\n| batch | phase | host ms | GPU ms | launches | host us / launch | in layer op C++ ms | "
          "in kernel libraries ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        per = r["host_ms"] * 1e3 / r["launches"] if r["launches"] else float("nan")
        print(f"| {r['batch']} | {r['phase']} | {r['host_ms']:.2f} | {r['gpu_ms']:.2f} | {r['launches']} | "
              f"{per:.1f} | {r['layer_op_ms']:.2f} | {r['library_ms']:.2f} |")


if __name__ == "__main__":
    main()
