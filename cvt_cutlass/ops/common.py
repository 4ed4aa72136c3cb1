"""What every op shares: its registration around the C++ schema, and the checks before a kernel.

An op ``cvt_cutlass::<name>`` is defined in C++ (csrc/ops/<file>.cpp: schema and CUDA hot path,
which keeps a plan per call signature). Its Python module supplies, through :func:`register_op`:

* ``plan(*args) -> (kernel id | PLAN_FALLBACK | PLAN_EMPTY, source)``: the CUDA hot path's
  planner, run once per (op, sizes, strides, dtypes, devices): argument checks (user errors
  raise), whether a kernel can serve the call, the kernel's selection and build;
* ``fallback(*args)``: the PyTorch reference, counted and logged (strict mode raises); the
  implementation for CPU and other devices, and what the hot path calls when no kernel serves a
  call or its pointers are not 16-byte aligned;
* ``fake``: torch.compile's shapes.

Every op's autograd formula is C++ (csrc/ops/<op>.cpp): a call that needs no gradient never
reaches Python, and a backward runs the backward ops (themselves ops of this kind, with no
autograd formula of their own).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .. import fallback, runtime

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
PLAN_FALLBACK = (-1, 0)  # no kernel serves these arguments (csrc/plans.h: kPlanFallback)
PLAN_EMPTY = (-2, 0)  # valid arguments, empty output: nothing to launch (kPlanEmpty)
_SOURCES = {"table": 0, "heuristic": 1}

runtime.ensure_binding()


def register_op(name: str, *, plan: Callable | None, fallback: Callable, fake: Callable,
                hot_path: bool = True) -> None:
    """Attach the Python parts of ``cvt_cutlass::<name>`` (see the module docstring): its planner
    (None for an op whose hot path plans through other ops' planners: mlp, its two Linear plans),
    its PyTorch fallback (also the CPU implementation; ``cvt_cutlass_C::<name>_fallback`` too, which
    the C++ hot path calls, unless ``hot_path`` is False: an op with no CUDA kernel, whose
    fallback serves every device) and its fake kernel. Backward ops (linear_dgrad, ...) are
    registered the same way; they have no autograd formula of their own (no double backward
    through the kernels)."""
    public = f"cvt_cutlass::{name}"
    if plan is not None:
        torch.library.impl(f"cvt_cutlass_C::{name}_plan", "CUDA", plan)
    ops = (f"cvt_cutlass_C::{name}_fallback", public) if hot_path else (public,)
    for op in ops:
        torch.library.impl(op, "CompositeExplicitAutograd", fallback)
    torch.library.register_fake(public, fake)


def kernel_plan(choice, device_index: int) -> tuple[int, int]:
    """(kernel id, selection source) of a selection ``Choice``: loads the kernel, building it
    first if the cache lacks it (one kernel; whole models prebuild theirs in parallel)."""
    cc = runtime.device_info(device_index).cc
    return runtime.load_kernel(choice.spec, cc), _SOURCES[choice.source]


def check_floating(op: str, **tensors: Tensor | None) -> None:
    """Non-floating inputs are a user error on every op (PyTorch's own ops raise too)."""
    for name, t in tensors.items():
        if t is not None and not t.is_floating_point():
            raise TypeError(f"cvt_cutlass.{op}: {name} must be a floating-point tensor (float16/bfloat16 run "
                            f"on the kernels, float32/float64 on PyTorch), got {t.dtype}")


def check_like(op: str, ref_name: str, ref: Tensor, dtype: torch.dtype | None = None, **tensors: Tensor | None) -> None:
    """Every given tensor has ``ref``'s device and ``dtype`` (default: ``ref``'s dtype)."""
    for name, t in tensors.items():
        if t is None:
            continue
        if dtype is not None and t.dtype != dtype:
            raise TypeError(f"cvt_cutlass.{op}: {name} must be {dtype}, got {t.dtype}")
        if dtype is None and t.dtype != ref.dtype:
            raise TypeError(f"cvt_cutlass.{op}: {name} is {t.dtype} but {ref_name} is {ref.dtype}")
        if t.device != ref.device:
            raise ValueError(f"cvt_cutlass.{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")


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


def nondeterministic(what: str):
    """(reason, detail) of a call whose kernel sums with fp32 atomics (``what``) while
    torch.use_deterministic_algorithms(True) is in force (warn_only too): the PyTorch path runs,
    counted as a fallback, so that reruns give the same bits; else None. The C++ plan caches
    key on the setting."""
    if not torch.are_deterministic_algorithms_enabled():
        return None
    return ("deterministic", f"torch.use_deterministic_algorithms(True): {what}")


def aligned(t: Tensor) -> bool:
    """16-byte aligned start (TMA, cp.async and our vector accesses read 16-byte vectors)."""
    return t.data_ptr() % 16 == 0


def record_fallback(op: str, why, *tensors: Tensor | None) -> None:
    """Count the fallback of an op the hot path sent back to Python: ``why`` from the op's checks,
    else the misaligned operand among ``tensors`` (the hot path's per-call check)."""
    fallback.record_fallback(op, *(why or misaligned(*tensors) or ("alignment", "misaligned operand")))


def misaligned(*tensors: Tensor | None):
    """(reason, detail) when a tensor does not start 16-byte aligned (checked per call by the hot
    path, which then runs the fallback), else None."""
    for t in tensors:
        if t is not None and t.numel() and not aligned(t):
            return ("alignment", "a tensor does not start 16-byte aligned (an offset view?)")
    return None
