"""What programmatic dependent launch (PDL) saves per kernel boundary on this GPU: a chain of 200
dependent kernels (each reads the buffer the one before wrote: x * 1.0001 + 1), launched plainly
and with PDL (every kernel waits for its prerequisite grid first; the trigger for its dependents
none, at the start of each block, or after each block's work), timed in a CUDA graph (replays
bracketed by CUDA events, median of 20) and eagerly, at kernel sizes from one block (a CvT kernel
at batch 1 is 2-5 us) to two waves of blocks. Every mode's result is checked bit for bit against
the plain chain's (a missed dependency would read a half-written buffer).
Usage: python .ci/pdl_probe.py [chain length, default 200]"""

from __future__ import annotations

import ctypes
import functools
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CASES = (  # label, floats, blocks, threads
    ("1 block, 4 KB", 1024, 1, 256),
    ("8 blocks, 256 KB", 1 << 16, 8, 256),
    ("132 blocks, 4 MB", 1 << 20, 132, 256),
    ("528 blocks, 32 MB", 1 << 23, 528, 256),
    ("1,056 blocks, 128 MB", 1 << 25, 1056, 256),
)
MODES = (("plain", False, 0), ("PDL, no trigger", True, 0), ("PDL, trigger at start", True, 1),
         ("PDL, trigger after work", True, 2))


class Chain:
    """.ci/pdl_probe.cu built for sm_90a and loaded: ``run(a, b, count, blocks, threads, pdl, trigger)``
    on the current stream."""

    def __init__(self):
        src = Path(__file__).resolve().with_suffix(".cu")
        lib = Path(tempfile.mkdtemp()) / "pdl_probe.so"
        subprocess.run(["nvcc", "-std=c++17", "-O3", "-gencode", "arch=compute_90a,code=sm_90a", "-Xcompiler",
                        "-fPIC", "-shared", str(src), "-o", str(lib)], check=True)
        self._fn = ctypes.CDLL(str(lib)).run_chain
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                             ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]

    def run(self, a, b, count: int, blocks: int, threads: int, pdl: bool, trigger: int) -> None:
        err = self._fn(a.data_ptr(), b.data_ptr(), a.numel(), count, blocks, threads, int(pdl), trigger,
                       torch.cuda.current_stream().cuda_stream)
        if err:
            raise RuntimeError(f"pdl_probe: launch failed with CUDA error {err}")


def per_kernel_us(fn, count: int, trials: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(trials + 3):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:]) * 1e3 / count


def run_case(ext, n: int, blocks: int, threads: int, count: int) -> dict[str, tuple[float, float]]:
    """{mode: (graph us per kernel, eager us per kernel)}, after checking each mode's bits."""
    g = torch.Generator(device="cuda").manual_seed(0)
    init = torch.rand(n, device="cuda", generator=g)
    out, ref = {}, None
    for name, pdl, trigger in MODES:
        a, b = init.clone(), torch.empty_like(init)
        ext.run(a, b, count, blocks, threads, pdl, trigger)  # a chain of even length ends in a
        torch.cuda.synchronize()
        if ref is None:
            ref = a.clone()
        elif not torch.equal(a, ref):
            raise SystemExit(f"pdl_probe: {name} gave other bits than the plain chain ({n} floats, {blocks} blocks)")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ext.run(a, b, count, blocks, threads, pdl, trigger)
        out[name] = (per_kernel_us(graph.replay, count),
                     per_kernel_us(functools.partial(ext.run, a, b, count, blocks, threads, pdl, trigger), count))
    return out


def main() -> int:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    count += count % 2
    ext = Chain()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; a chain of {count} kernels, us per kernel")
    print("| kernel | " + " | ".join(f"{m} (graph / eager)" for m, _, _ in MODES) + " | PDL's best saving (graph) |")
    print("|---" * (len(MODES) + 2) + "|")
    for label, n, blocks, threads in CASES:
        r = run_case(ext, n, blocks, threads, count)
        best = min(v[0] for k, v in r.items() if k != "plain")
        cells = " | ".join(f"{g:.2f} / {e:.2f}" for g, e in r.values())
        print(f"| {label} | {cells} | {r['plain'][0] - best:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
