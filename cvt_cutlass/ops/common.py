"""What every op checks before choosing a kernel: device, dtype, GPU generation, alignment."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import runtime

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def device_plan(x: Tensor):
    """(reason, detail) when no kernel runs for x's device / dtype / GPU, else None."""
    if x.device.type != "cuda":
        return ("device", f"{x.device.type} tensors")
    if x.dtype not in DTYPES:
        return ("dtype", f"{x.dtype} (kernels take float16/bfloat16)")
    cc = runtime.device_info(x.device.index).cc
    if runtime.arch_for(cc) is None:
        return ("arch", f"compute capability {cc // 10}.{cc % 10} < 8.0")
    return None


def aligned(t: Tensor) -> bool:
    """16-byte aligned start (TMA, cp.async and our vector accesses read 16-byte vectors)."""
    return t.data_ptr() % 16 == 0
