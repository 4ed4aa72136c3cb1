"""CUDA timing: warm-up, CUDA-graph replays timed with events, medians.

Small kernels are timed as ``reps`` back-to-back calls captured in one CUDA graph (no launch gaps
from Python), each replay timed with CUDA events, per-call time = replay time / reps, median over
``trials`` replays. ``fn(i)`` gets the index of the input set to use, so problems smaller than the
L2 cache rotate through several input sets instead of timing the cache.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

L2_BYTES = 60 * 2**20  # H200 (and H100: 50 MB); a bound for "fits in L2"


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int
    trials: int


def input_sets_for(bytes_per_call: int, cap: int = 16) -> int:
    """How many distinct input sets keep the working set at >= 3x the L2."""
    return max(1, min(cap, math.ceil(3 * L2_BYTES / max(bytes_per_call, 1))))


def time_cuda(fn: Callable[[int], object], *, sets: int = 1, trials: int = 15, target_ms: float = 4.0,
              max_reps: int = 256, graph: bool = True) -> Timing:
    import torch

    for i in range(3):  # warm-up: kernel selection, builds, loads, allocator
        fn(i % sets)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(5):
        fn(i % sets)
    end.record()
    end.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)
    reps = max(1, min(max_reps, int(target_ms / est)))

    if graph:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            with torch.cuda.graph(g, stream=side):
                for i in range(reps):
                    fn(i % sets)
        torch.cuda.current_stream().wait_stream(side)
        run = g.replay
    else:
        def run():
            for i in range(reps):
                fn(i % sets)

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    times.sort()
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    return Timing(statistics.median(times), q[0], q[-1], reps, trials)


def median_event_ms(fn: Callable[[], object], trials: int = 10, warmup: int = 3) -> float:
    """Median ms of ``fn()`` timed call by call with CUDA events (host time included: eager
    forwards, training steps), after ``warmup`` calls."""
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


def graphed(fn: Callable[[], object]):
    """``fn`` captured in a CUDA graph (after a warm-up on a side stream); returns (replay, output)."""
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


def pass_timer(torch, pass_: str, fn, leaves, g):
    """A timing callable of one pass of ``fn(*leaves)``: ``fwd`` under no_grad, ``bwd`` (the
    backward of one kept forward), ``fwd+bwd`` (forward and autograd.grad)."""
    if pass_ == "fwd":
        def run(i):
            with torch.no_grad():
                fn(*leaves)
        return run
    if pass_ == "bwd":
        out = fn(*leaves)
        return lambda i: torch.autograd.grad(out, leaves, g, retain_graph=True)
    return lambda i: torch.autograd.grad(fn(*leaves), leaves, g)


def pass_gpu_ms(torch, pass_: str, fn, leaves, g) -> float | None:
    """GPU time of a pass: CUDA-graph replays of the forward (no_grad) or of forward + autograd.grad
    captured together (the engine then runs on the capturing stream); bwd = fwd+bwd - forward with
    autograd recording. None if the capture fails."""
    def graph_ms(f):
        return time_cuda(f).median_ms

    try:
        if pass_ == "fwd":
            return graph_ms(pass_timer(torch, "fwd", fn, leaves, g))
        both = graph_ms(lambda i: torch.autograd.grad(fn(*leaves), leaves, g))
        return both if pass_ == "fwd+bwd" else both - graph_ms(lambda i: fn(*leaves))
    except RuntimeError as e:
        print(f"[bench] no CUDA-graph time for {pass_}: {str(e).splitlines()[0][:120]}", flush=True)
        return None


# Host calls that submit work to a stream: kernel launches (runtime and driver API), graph
# launches, asynchronous copies and fills.
LAUNCH_APIS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel", "cuLaunchKernel",
                         "cuLaunchKernelEx", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync"})


@dataclass(frozen=True)
class CallProfile:
    """Per call of a step or forward: host submissions (``launches``), kernels the GPU ran, host
    time (the call's wall time from an idle GPU, no synchronisation inside: Python, dispatcher,
    autograd and launches), GPU time (the kernels' summed durations) and the GPU's busy time (the
    union of their intervals: kernels that overlap, on a side stream or started early by
    programmatic dependent launch while their predecessor drains, count once)."""

    launches: float
    kernels: float
    host_ms: float
    gpu_ms: float
    gpu_busy_ms: float


def call_profile(fn: Callable[[], object], calls: int = 5) -> CallProfile:
    """:class:`CallProfile` of ``fn()`` (warm: call it first), from torch.profiler's CUDA runtime /
    driver API and kernel records over ``calls`` calls; host time is the median over the calls,
    each started after a synchronize."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    host = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.events()
    launches, kernels, gpu_us = count_events(events)
    return CallProfile(launches / calls, kernels / calls, statistics.median(host), gpu_us / calls / 1e3,
                       busy_us(events) / calls / 1e3)


def count_events(events) -> tuple[int, int, float]:
    """(host launch calls, GPU kernels, GPU kernel microseconds) of profiler events."""
    from torch.autograd import DeviceType

    launches = kernels = 0
    gpu_us = 0.0
    for e in events:
        if e.device_type == DeviceType.CUDA:
            if not e.name.startswith(("Memcpy", "Memset")):
                kernels += 1
                gpu_us += e.time_range.elapsed_us()
        elif e.name in LAUNCH_APIS:
            launches += 1
    return launches, kernels, gpu_us


def busy_us(events) -> float:
    """Microseconds in which the GPU ran at least one kernel: the union of the kernel records'
    intervals (the records :func:`count_events` sums; memcpy / memset and annotations are not
    kernels), merged per device."""
    from torch.autograd import DeviceType

    spans: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")) \
                and not getattr(e, "is_user_annotation", False):
            spans.setdefault(getattr(e, "device_index", 0), []).append((e.time_range.start, e.time_range.end))
    total = 0.0
    for intervals in spans.values():
        end = -math.inf
        for a, b in sorted(intervals):
            if b > end:
                total += b - max(a, end)
                end = b
    return total

