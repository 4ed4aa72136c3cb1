"""What every ``cvt-cutlass bench`` run sets up first: the GPU, the kernel path, a seeded
generator, and the columns each result row starts with (date, GPU, versions, path, model)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
from dataclasses import dataclass


@dataclass
class BenchRun:
    dev: object  # runtime.DeviceInfo
    arch: int  # the kernel path in use (90 or 89)
    gen: object  # torch.Generator on the GPU, seed 0
    torch_dtype: dict  # "fp16" / "bf16" -> torch dtype
    row: dict  # the leading columns of every result row


def start(a) -> BenchRun | None:
    """None (after saying why) when no GPU is visible; otherwise the run's context."""
    import torch

    from ... import runtime
    from ...build import cutlass_version

    if not torch.cuda.is_available():
        print("cvt-cutlass bench needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
        return None
    runtime.set_kernel_path(a.path)
    dev = runtime.device_info(torch.cuda.current_device())
    arch = runtime.arch_for(dev.cc)
    row = {"date": _dt.datetime.now().strftime("%Y-%m-%d"), "gpu": dev.name, "torch": torch.__version__,
           "cutlass": cutlass_version(), "path": f"sm{arch}", "model": a.model, "image_size": a.image_size or ""}
    return BenchRun(dev, arch, torch.Generator(device="cuda").manual_seed(0),
                    {"fp16": torch.float16, "bf16": torch.bfloat16}, row)


def run_bench(a, problems_of, measure, columns, table) -> int:
    """The loop every per-op benchmark shares: for each dtype and batch of ``a``, the problems
    ``problems_of(run, dtype, batch)`` lists (it may prebuild their kernels), each measured by
    ``measure(run, dtype, batch, problem)`` (result rows, printed as they come); the rows are
    appended to ``a.out`` and printed by ``table(rows)``. Exit status 2 without a GPU."""
    from ..csvfile import append_csv

    run = start(a)
    if run is None:
        return 2
    rows: list[dict] = []
    for dt_name in a.dtype:
        for batch in a.batch:
            for problem in problems_of(run, dt_name, batch):
                rows += measure(run, dt_name, batch, problem)
    if a.out:
        append_csv(a.out, rows, columns)
    print()
    print(table(rows))
    return 0


def markdown(head: list[str], cells) -> list[str]:
    """The lines of a markdown table: the header, the rule, one line per row of ``cells``."""
    return ["| " + " | ".join(head) + " |", "|---" * len(head) + "|",
            *("| " + " | ".join(str(c) for c in row) + " |" for row in cells)]


@contextlib.contextmanager
def deterministic_mode(on: bool):
    """torch.use_deterministic_algorithms(True) inside where ``on`` (left on if it already was),
    the caller's setting restored after."""
    import torch

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(was or on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))
