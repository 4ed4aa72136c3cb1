"""Where a training step's host time goes in Python (cProfile): the swapped model eager and
compiled (torch.compile of the swapped model), one batch size, bf16 autocast, SGD momentum, as
.ci/train_profile.py builds the steps. Per provider: host enqueue ms per step without the
profiler, then cProfile's top entries by own time over the profiled steps (built-ins such as
Inductor's size asserts and reinterpret_tensor are entries of their own), and the top entries by
cumulative time.
Usage: python .ci/host_profile.py [batch] [providers] [steps]."""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch
from train_profile import build_step  # .ci/, the script's own directory

from cvt_cutlass.checkpoint import random_cvt
from cvt_cutlass.train import precision_of


def host_ms(step, x, y, n: int) -> float:
    """Enqueue time per step (the GPU keeps up after a sync: the host is what is timed)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step(x, y)
    ms = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    return ms


def profile_steps(step, x, y, n: int) -> pstats.Stats:
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(n):
        step(x, y)
    prof.disable()
    torch.cuda.synchronize()
    return pstats.Stats(prof, stream=io.StringIO())


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    provs = sys.argv[2].split(",") if len(sys.argv) > 2 else ["swapped", "swapped_compile"]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    base = random_cvt("cvt-13").train()
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    prec = precision_of("fp32", "bf16", True)
    summary = []
    for prov in provs:
        step = build_step(base, prov, prec)
        for _ in range(8 if prov.endswith("compile") else 4):
            step(x, y)
        host = min(host_ms(step, x, y, 5) for _ in range(3))
        stats = profile_steps(step, x, y, steps)
        total = stats.total_tt / steps * 1e3
        print(f"\n=== {prov} batch {batch}: host {host:.2f} ms/step without the profiler, "
              f"{total:.2f} ms/step under cProfile ({steps} steps)", flush=True)
        out = io.StringIO()
        stats.stream = out
        stats.sort_stats("tottime").print_stats(40)
        print(out.getvalue()[-12000:])
        out = io.StringIO()
        stats.stream = out
        stats.sort_stats("cumulative").print_stats(60)  # which calls hold the time (the compiled wrappers')
        print(out.getvalue()[-14000:])
        top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:4]
        summary.append((prov, host, total, "; ".join(f"{pstats.func_std_string(f)[-48:]} {v[2] / steps * 1e3:.2f}"
                                                     for f, v in top)))
        del step
        torch.cuda.empty_cache()
    print("\n| provider | host ms/step | cProfile ms/step | top own time per step (ms) |\n|---|---|---|---|")
    for prov, host, total, top in summary:
        print(f"| {prov} | {host:.2f} | {total:.2f} | {top} |")


if __name__ == "__main__":
    main()
