"""Runtime: which kernel path a device takes, and kernels built, loaded and memoised by name.

Kernel path: ``auto`` (sm90 kernels on compute capability 9.0, the SM80-class sm89 path on other
8.x+ devices), or forced with ``CVT_CUTLASS_KERNEL_PATH=sm89|sm90`` / ``kernel_path("sm89")``
(how the H200 tests run the sm_89 path's instantiations).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from dataclasses import dataclass

from . import build
from .operators.linear import LinearSpec

PATHS = ("auto", "sm89", "sm90")
_path: str | None = None
_lock = threading.RLock()
_binding_loaded = False
_kernels: dict[tuple[str, str], int] = {}


def get_kernel_path() -> str:
    p = _path or os.environ.get("CVT_CUTLASS_KERNEL_PATH", "auto")
    if p not in PATHS:
        raise ValueError(f"kernel path must be one of {PATHS}, got {p!r}")
    return p


def set_kernel_path(path: str | None) -> None:
    """'sm90', 'sm89', 'auto', or None (follow CVT_CUTLASS_KERNEL_PATH)."""
    global _path
    if path is not None and path not in PATHS:
        raise ValueError(f"kernel path must be one of {PATHS}, got {path!r}")
    _path = path


@contextlib.contextmanager
def kernel_path(path: str):
    old = _path
    set_kernel_path(path)
    try:
        yield
    finally:
        set_kernel_path(old)


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    cc: int  # 90 for 9.0
    name: str


@functools.cache
def device_info(index: int) -> DeviceInfo:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return DeviceInfo(index, major * 10 + minor, torch.cuda.get_device_name(index))


def arch_for(cc: int) -> int | None:
    """The kernel arch (90 or 89) serving a device of compute capability ``cc``; None if none can."""
    path = get_kernel_path()
    if cc < 80:
        return None
    if path == "sm90":
        if cc != 90:
            raise RuntimeError(f"kernel path 'sm90' was forced, but the device is sm_{cc}")
        return 90
    if path == "sm89":
        return 89
    return 90 if cc == 90 else 89


def ensure_binding() -> None:
    """Build (first time) and load the torch binding that registers torch.ops.cvt_cutlass_C."""
    global _binding_loaded
    if _binding_loaded:
        return
    with _lock:
        if not _binding_loaded:
            import torch

            torch.ops.load_library(str(build.binding_library()))
            _binding_loaded = True


def plan(specs, device_cc: int | None = None) -> list[build.KernelBuild]:
    """Build plans (source, target, cache entry) for specs, for a device or the path's own GPU."""
    from .emitter import kernel_source

    nvcc_rel = build.nvcc_release(build.find_nvcc())
    return [
        build.plan_kernel(s.name, kernel_source(s), build.target_for(s.arch, device_cc), nvcc_rel,
                          build.abi_headers(getattr(s, "abi_headers", ("cvt_kernel_abi.h",))),
                          tuple(getattr(s, "include_dirs", ())))
        for s in specs
    ]


def prebuild(specs, device_cc: int | None = None, *, jobs: int | None = None, progress: bool = True):
    """Compile (in parallel, with a progress bar) every kernel of ``specs`` missing from the cache."""
    return build.build_kernels(plan(specs, device_cc), jobs=jobs, progress=progress)


def load_kernel(spec: LinearSpec, device_cc: int) -> int:
    """The binding's id of ``spec`` built for ``device_cc`` (building it on first use)."""
    target = build.target_for(spec.arch, device_cc)
    key = (spec.name, target)
    kid = _kernels.get(key)
    if kid is not None:
        return kid
    with _lock:
        kid = _kernels.get(key)
        if kid is None:
            import torch

            ensure_binding()
            (job,) = plan([spec], device_cc)
            build.build_kernels([job])
            kid = int(torch.ops.cvt_cutlass_C.load_kernel(str(job.library), spec.name))
            _kernels[key] = kid
    return kid
