"""Where an eager inference forward's host time goes: the swapped CvT-13 (224, fp16, inference_mode,
stage graphs on, as `bench --op model`'s `swapped` provider runs it; `swapped_compile`: torch.compile
of it) at each batch: ms per forward with a sync after each (CUDA events), host ms to enqueue one,
then cProfile's top entries by own time and the torch profiler's CPU ops by self time.
Usage: python .ci/infer_profile.py [batches, default 1,32] [forwards, default 200]
[providers, default swapped,swapped_compile]."""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time

import torch

from cvt_cutlass.checkpoint import random_cvt
from cvt_cutlass.swap import swap


def timed(model, x, n: int) -> tuple[float, float]:
    """(median ms per forward with a sync after each, host ms per forward enqueued back to back)."""
    ms = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        model(x)
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(min(n, 100)):
        model(x)
    host = (time.perf_counter() - t0) / min(n, 100) * 1e3
    torch.cuda.synchronize()
    return statistics.median(ms), host


def main() -> None:
    batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,32").split(",")]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    providers = (sys.argv[3] if len(sys.argv) > 3 else "swapped,swapped_compile").split(",")
    swapped = swap(random_cvt("cvt-13").cuda().half().eval())
    for prov in providers:
        model = torch.compile(swapped) if prov == "swapped_compile" else swapped
        for b in batches:
            profile_batch(model, prov, b, n)


def profile_batch(model, prov: str, b: int, n: int) -> None:
    x = torch.randn(b, 3, 224, 224, device="cuda").half()
    with torch.inference_mode():
        for _ in range(5):
            model(x)
        ms, host = timed(model, x, n)
        print(f"\n=== {prov} batch {b}: {ms:.3f} ms per forward (sync each), host {host:.3f} ms per forward",
              flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            model(x)
        prof.disable()
        torch.cuda.synchronize()
        print("cProfile, 50 forwards, by own time")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
            for _ in range(5):
                model(x)
            torch.cuda.synchronize()
        print("torch profiler, 5 forwards, CPU by self time")
        print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=80))


if __name__ == "__main__":
    main()
