"""Runtime: which kernel path a device takes, the torch binding, and kernels built, loaded and
memoised by name.

Kernel path: ``auto`` (sm90 kernels on compute capability 9.0, the SM80-class sm89 path on other
8.x+ devices), or forced with ``CVT_CUTLASS_KERNEL_PATH=sm89|sm90`` / ``kernel_path("sm89")``
(how the H200 tests run the sm_89 path's instantiations). Changing the path (or the selection
tables) clears the binding's plan cache, so every op chooses its kernel again.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from . import build

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
    if path != _path:
        _path = path
        clear_plans()


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
    """Build (first time) and load the torch binding: the public ops torch.ops.cvt_cutlass.* (C++
    schemas and CUDA hot paths) and the private torch.ops.cvt_cutlass_C.*."""
    global _binding_loaded
    if _binding_loaded:
        return
    with _lock:
        if not _binding_loaded:
            import torch

            groups = side_stream_groups(os.environ.get("CVT_CUTLASS_SIDE_STREAM", ""))  # (a bad value raises here)
            try:
                torch.ops.load_library(str(build.binding_library()))
            except OSError as e:  # passed its hash check but does not load (another toolchain?)
                torch.ops.load_library(str(build.rebuild_binding(str(e))))
            _binding_loaded = True
            if groups != frozenset(SIDE_GROUPS):
                torch.ops.cvt_cutlass_C.set_side_stream(_side_mask(groups))


def clear_plans() -> None:
    """Forget every op's plan (kernel choice and prepared arguments): the next call of each shape
    asks the planner again. No-op before the binding is loaded."""
    if _binding_loaded:
        import torch

        torch.ops.cvt_cutlass_C.clear_plans()


def reload_tables() -> None:
    """Read the selection tables again (after a sweep wrote them): every op chooses its kernels
    again on its next call."""
    from .operators import selection

    selection.clear()
    clear_plans()


def plan_count() -> int:
    """Plans the binding holds (one per op and distinct call signature)."""
    if not _binding_loaded:
        return 0
    import torch

    return int(torch.ops.cvt_cutlass_C.plan_count())


def kernel_counters() -> dict[str, tuple[int, int]]:
    """{op: (kernel calls chosen from the tuned table, from the heuristic)} since the last reset."""
    if not _binding_loaded:
        return {}
    import torch

    names, table, heuristic = torch.ops.cvt_cutlass_C.counters()
    return {n: (t, h) for n, t, h in zip(names, table, heuristic, strict=True)}


def library_host_time() -> dict[str, tuple[int, int]]:
    """{kernel family: (launches, host nanoseconds inside the kernel library's launch entry point:
    its params, TMA descriptors and the launch API)} since the last reset; empty without a GPU."""
    if not _binding_loaded:
        return {}
    import torch

    names, calls, ns = torch.ops.cvt_cutlass_C.library_host()
    return {n: (c, t) for n, c, t in zip(names, calls, ns, strict=True)}


def op_host_time() -> dict[str, tuple[int, int]]:
    """{composite op (the layer op forward / backward): (calls, host nanoseconds inside its
    implementation, the kernel libraries' time included)} since the last reset."""
    if not _binding_loaded:
        return {}
    import torch

    names, calls, ns = torch.ops.cvt_cutlass_C.op_host()
    return {n: (c, t) for n, c, t in zip(names, calls, ns, strict=True)}


def set_deferred_sums(enabled: bool) -> bool:
    """Whether the layer op's backward defers its kernels' finishing column sums (the weight and
    bias gradients' partial sums) to one launch at its end (the default) or runs each where it is
    launched; the same bits either way. Returns the previous setting."""
    ensure_binding()
    import torch

    return bool(torch.ops.cvt_cutlass_C.set_defer_sums(enabled))


# The weight gradients that may go on the side stream (csrc/side_stream.h: SideGroup): the layer
# op's fc1, out-projection, q / k / v and fc2 ones (fc2's, and on a 16-bit stream the
# out-projection's, only where their gradient comes in the GEMMs' dtype without drop path: a 16-bit
# stream or a stage's rounded last output; elsewhere their row pass writes the dY their dgrad reads),
# and the token-embedding conv's, beside its dgrad (stages 2 and 3: the stem's image has no dx).
SIDE_GROUPS = {"fc1": 1, "out": 2, "qkv": 4, "fc2": 8, "embed": 16}


def side_stream_groups(spec: str) -> frozenset[str]:
    """The groups a CVT_CUTLASS_SIDE_STREAM value names: unset, empty, "1", "true" or "on": all;
    "0", "false" or "off": none; otherwise comma-separated names of SIDE_GROUPS (lower case)."""
    raw = spec.strip()
    if raw.lower() in ("", "1", "true", "on"):
        return frozenset(SIDE_GROUPS)
    if raw.lower() in ("0", "false", "off"):
        return frozenset()
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    unknown = sorted(names - set(SIDE_GROUPS))
    if unknown or not names:
        what = f"unknown group(s) {unknown}" if unknown else "names no group"
        raise ValueError(f"CVT_CUTLASS_SIDE_STREAM={spec!r}: {what}; the groups are {sorted(SIDE_GROUPS)}, "
                         "or 0 / 1")
    return names


def _side_mask(groups) -> int:
    return sum(SIDE_GROUPS[g] for g in groups)


def set_side_stream(enabled: bool | str | Iterable[str]) -> frozenset[str]:
    """Which weight gradients the backward launches on a second stream of the device: the layer op's
    Linear ones beside the dgrad / attention / LayerNorm / depthwise kernels the next gradient waits
    for, the embedding conv's beside its dgrad: True (the default) all, False none (all in line on
    the current stream), or group names
    (:data:`SIDE_GROUPS`, a list or a comma-separated string as CVT_CUTLASS_SIDE_STREAM takes).
    The same bits either way. Stage graphs captured before a change keep the setting they were
    captured with. Returns the previous groups."""
    if isinstance(enabled, bool):
        groups = frozenset(SIDE_GROUPS) if enabled else frozenset()
    elif isinstance(enabled, str):
        groups = side_stream_groups(enabled)
    else:
        groups = frozenset(enabled)
        if not groups <= set(SIDE_GROUPS):
            raise ValueError(f"unknown side-stream group(s) {sorted(groups - set(SIDE_GROUPS))}; "
                             f"the groups are {sorted(SIDE_GROUPS)}")
    ensure_binding()
    import torch

    prev = int(torch.ops.cvt_cutlass_C.set_side_stream(_side_mask(groups)))
    return frozenset(g for g, bit in SIDE_GROUPS.items() if prev & bit)


def reset_kernel_counters() -> None:
    if _binding_loaded:
        import torch

        torch.ops.cvt_cutlass_C.reset_counters()


@functools.cache
def emitter_fingerprint() -> str:
    """A hash of everything a kernel's source depends on besides its spec (the emitting code, the
    kernel headers, the nvcc flags and release, the CUTLASS version): equal fingerprints mean equal
    sources for equal names, so a built kernel is found by name without emitting it again."""
    import hashlib

    from . import epilogues

    h = hashlib.sha256()
    roots = [build.OPERATORS, Path(epilogues.__file__).resolve().parent]
    files = [f for root in roots for f in sorted(root.rglob("*"))
             if f.suffix in (".py", *build.HEADER_SUFFIXES) and "__pycache__" not in f.parts]
    files.append(Path(__file__).with_name("emitter.py"))
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    for part in (" ".join(build.NVCC_FLAGS), build.nvcc_release(build.find_nvcc()), build.cutlass_version()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def plan(specs, device_cc: int | None = None, *, use_index: bool = True) -> list[build.KernelBuild]:
    """Build plans (source, target, cache entry) for specs, for a device or the path's own GPU.

    A kernel already built by this version of the emitter is found through the cache's index
    without emitting its source (emission imports and traces cutlass_cppgen: seconds at start-up)."""
    from .emitter import kernel_source

    nvcc_rel = build.nvcc_release(build.find_nvcc())
    out = []
    for s in specs:
        target = build.target_for(s.arch, device_cc)
        includes = tuple(s.include_dirs)
        job = build.indexed_kernel(s.name, target, emitter_fingerprint(), includes) if use_index else None
        out.append(job or build.plan_kernel(s.name, kernel_source(s), target, nvcc_rel, includes))
    return out


def _build(jobs: list[build.KernelBuild], n_jobs: int | None, progress: bool) -> dict:
    libs = build.build_kernels(jobs, jobs=n_jobs, progress=progress)
    for job in jobs:
        build.index_kernel(job, emitter_fingerprint())
    return libs


def prebuild(specs, device_cc: int | None = None, *, jobs: int | None = None, progress: bool = True,
             binding: bool = False, planned: list[build.KernelBuild] | None = None):
    """Compile (in parallel, with a progress bar, slowest first) every kernel of ``specs`` missing
    from the cache (``planned``: their plans, if the caller made them already); ``binding=True``
    also builds and loads the torch binding meanwhile."""
    todo = planned if planned is not None else plan(specs, device_cc)
    if not binding or _binding_loaded:
        return _build(todo, jobs, progress)
    with cf.ThreadPoolExecutor(max_workers=1) as pool:
        loaded = pool.submit(ensure_binding)
        libs = _build(todo, jobs, progress)
        loaded.result()
    return libs


def load_kernel(spec, device_cc: int) -> int:
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
            _build([job], None, True)
            try:
                kid = int(torch.ops.cvt_cutlass_C.load_kernel(str(job.library), spec.name))
            except RuntimeError as e:  # intact file that does not load: rebuild it once (from source)
                build.invalidate(job, str(e).splitlines()[0])
                (job,) = plan([spec], device_cc, use_index=False)
                _build([job], None, True)
                kid = int(torch.ops.cvt_cutlass_C.load_kernel(str(job.library), spec.name))
            _kernels[key] = kid
    return kid
