"""What every ``cvt-cutlass bench`` run sets up first: the GPU, the kernel path, a seeded
generator, and the columns each result row starts with (date, GPU, versions, path, model)."""

from __future__ import annotations

import datetime as _dt
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
