"""Where an eager inference forward's host time goes: the swapped CvT-13 (224, fp16, inference_mode,
stage graphs on, as `bench --op model`'s `swapped` provider runs it; `swapped_compile`: torch.compile
of it) at each batch: ms per forward with a sync after each (CUDA events), host ms to enqueue one,
then cProfile's top entries by own time, the torch profiler's CPU ops by self time, and the GPU's
idle gaps inside one synced forward (device work by start time, gaps over 2 us with the work
on either side and the host call that launched the later one).
Usage: python .ci/infer_profile.py [batches, default 1,32] [forwards, default 200]
[providers, default swapped,swapped_compile] [dtype, default fp16]"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
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
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[sys.argv[4] if len(sys.argv) > 4 else "fp16"]
    swapped = swap(random_cvt("cvt-13").cuda().to(dtype).eval())
    for prov in providers:
        model = torch.compile(swapped) if prov == "swapped_compile" else swapped
        for b in batches:
            profile_batch(model, prov, b, n)


def profile_batch(model, prov: str, b: int, n: int) -> None:
    x = torch.randn(b, 3, 224, 224, device="cuda").to(next(model.parameters()).dtype)
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
        print_gaps(model, x)


def print_gaps(model, x, forwards: int = 3) -> None:
    """The GPU's idle time inside synced forwards, from the profiler's trace: per forward the span
    from the first host call to the last device work's end, the device's busy time, and each gap."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as tp:
        for i in range(forwards):
            torch.cuda.synchronize()
            with torch.profiler.record_function(f"forward_{i}"):
                model(x)
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        tp.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    for mark in sorted((e for e in events if str(e.get("name", "")).startswith("forward_")
                        and e.get("cat") == "user_annotation"), key=lambda e: e["ts"]):
        t0, t1 = mark["ts"], mark["ts"] + mark["dur"]
        work = [e for e in device if launches.get(e["args"].get("correlation"), {}).get("ts", -1) >= t0
                and launches.get(e["args"].get("correlation"), {}).get("ts", 1e30) <= t1]
        if not work:
            continue
        busy = sum(e["dur"] for e in work)
        end = max(e["ts"] + e["dur"] for e in work)
        print(f"{mark['name']}: host call {mark['dur']:.0f} us, first device work {work[0]['ts'] - t0:.0f} us "
              f"after the call began, span {end - t0:.0f} us, device busy {busy:.0f} us, {len(work)} items")
        for a, b in zip(work, work[1:], strict=False):
            gap = b["ts"] - (a["ts"] + a["dur"])
            if gap > 2:
                call = launches.get(b["args"].get("correlation"), {})
                print(f"  gap {gap:6.1f} us  after {a['name'][:60]}  before {b['name'][:60]}"
                      f"  (launched by {call.get('name', '?')} at +{call.get('ts', t0) - t0:.0f} us)")


if __name__ == "__main__":
    main()
