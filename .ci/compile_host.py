"""Where a compiled inference forward's host time goes, against the eager one: the swapped CvT-13
(224, fp16, inference_mode, stage graphs on) eager and under torch.compile at one batch size.
Prints host ms per forward (enqueued back to back), the time inside each stage's graph call
(cvt_cutlass.graphs.timed_stage_calls), the time of one stage op called directly against the
stage module's call, and the stage-graph counters.
With an output folder, also writes the torch profiler's CPU trace of five forwards of each
(compile_host_<eager|compiled>.json) there.
Each forward is also timed alone (a synchronize before it, as `bench --op model` does) with the
stage-graph counters it moved and the profiler's top CPU ops.
COMPILE_MODE=reduce-overhead (or another torch.compile mode) compiles with that mode.
Usage: python .ci/compile_host.py [batch, default 1] [forwards, default 200] [trace folder]."""

from __future__ import annotations

import collections
import os
import statistics
import sys
import threading
import time

import torch

import cvt_cutlass
from cvt_cutlass.checkpoint import random_cvt
from cvt_cutlass.graphs import timed_stage_calls
from cvt_cutlass.swap import swap


def host_ms(fn, n: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    ms = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    return ms


def synced_ms(fn, n: int) -> tuple[float, float]:
    """(host ms, event ms): medians over ``n`` calls each started on an idle GPU (a synchronize
    before it), as ``bench --op model`` times them: the call's wall time and its CUDA-event time
    to the end of its GPU work."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host, ev = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        ev.append(start.elapsed_time(end))
    return statistics.median(host), statistics.median(ev)


def counted(fn, what: str) -> None:
    """Prints the stage-graph counters that ``fn`` moved, and the profiler's top CPU ops of five
    calls of it, each after a synchronize."""
    before = collections.Counter(cvt_cutlass.stats().get("stage_graphs") or {})
    host, ev = synced_ms(fn, 50)
    moved = collections.Counter(cvt_cutlass.stats().get("stage_graphs") or {})
    moved.subtract(before)
    print(f"| {what} | synced: host {host:.3f} ms, events {ev:.3f} ms | stage graphs over 50 calls: "
          f"{dict(+moved)} |")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            torch.cuda.synchronize()
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def sampled(fn, seconds: float = 2.0, every_s: float = 2e-5, top: int = 30) -> None:
    """Run fn back to back for ``seconds`` while a thread samples the main thread's Python stack:
    prints the most frequent innermost lines and the most frequent lines anywhere on the stack."""
    main_id, stop = threading.get_ident(), threading.Event()
    inner, anywhere = collections.Counter(), collections.Counter()

    def sample():
        while not stop.is_set():
            f = sys._current_frames().get(main_id)
            if f is not None:
                inner[f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}"] += 1
                seen = set()
                while f is not None:
                    k = f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}"
                    if k not in seen:
                        anywhere[k] += 1
                        seen.add(k)
                    f = f.f_back
            time.sleep(every_s)
    t = threading.Thread(target=sample, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(every_s)  # the sampler gets the interpreter often enough
    t.start()
    t0, calls = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    stop.set()
    t.join()
    sys.setswitchinterval(interval)
    torch.cuda.synchronize()
    total = sum(inner.values())
    print(f"\n=== {calls} calls, {total} samples; innermost lines")
    for k, v in inner.most_common(top):
        print(f"{v / total:6.1%} {k}")
    print("=== lines on the stack")
    for k, v in anywhere.most_common(top):
        print(f"{v / total:6.1%} {k}")


def main() -> None:
    b = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    model = swap(random_cvt("cvt-13").cuda().half().eval())
    stages = list(model.cvt.encoder.stages)
    comp = torch.compile(model, mode=os.environ.get("COMPILE_MODE") or None)
    x = torch.randn(b, 3, 224, 224, device="cuda").half()
    with torch.inference_mode():
        for name, fn in (("eager", lambda: model(x)), ("compiled", lambda: comp(x)), ("eager", lambda: model(x))):
            with timed_stage_calls() as inside:
                ms = host_ms(fn, n)
            per = statistics.median(inside) * 1e3 if inside else float("nan")
            print(f"| {name} | batch {b} | host {ms:.3f} ms per forward | stage graph call {per:.3f} ms (median) |")
        for name, fn in (("eager", lambda: model(x)), ("compiled", lambda: comp(x))):
            counted(fn, name)
        kept = (model(x).logits, comp(x).logits)  # as bench --op model keeps its first output
        for name, fn in (("eager, one result kept", lambda: model(x)), ("compiled, one result kept", lambda: comp(x))):
            counted(fn, name)
        del kept
        y = torch.randn(b, 64, 56, 56, device="cuda").half().to(memory_format=torch.channels_last)
        op = torch.ops.cvt_cutlass.stage_infer.default
        for name, fn in (("stage op", lambda: op(y, stages[1].handle, torch.float16, torch.float16)),
                         ("stage module call", lambda: stages[1](y))):
            print(f"| {name} (stage 1) | host {host_ms(fn, n):.3f} ms per call |")
        if len(sys.argv) > 3:
            for name, fn in (("eager", lambda: model(x)), ("compiled", lambda: comp(x))):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    for _ in range(5):
                        fn()
                    torch.cuda.synchronize()
                prof.export_chrome_trace(f"{sys.argv[3]}/compile_host_{name}.json")
        sampled(lambda: comp(x))
    print(cvt_cutlass.stats().get("stage_graphs"))


if __name__ == "__main__":
    main()
