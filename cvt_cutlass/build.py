"""Build: kernel .cu -> shared library, cached on disk by content; the torch binding.

* One translation unit per kernel, compiled by nvcc in parallel into its own shared library
  (``kernel.so``) that exports the plain-C ABI of ``csrc/cvt_kernel_abi.h``. Kernel libraries
  include no torch header: they build wherever nvcc 13 is, and can be built on one machine
  and carried to another (set ``CVT_CUTLASS_CACHE`` on both).
* Cache key: sha256 of the source, the ABI header, the nvcc flags, the target (``sm_90a``,
  ``sm_89``, ...), the nvcc release and the CUTLASS version. The cache lives in
  ``$CVT_CUTLASS_CACHE`` (default ``~/.cache/cvt_cutlass``).
* Two processes building the same kernel at once are safe: each entry is built under an
  exclusive file lock and published with an atomic rename.
* The binding (``csrc/binding.cpp``) registers the ``cvt_cutlass_C`` ops with the installed torch.
  It links only libc10/libtorch_cpu (the CUDA stream comes through c10's device-generic
  interface), so it builds against a CPU torch as well.
"""

from __future__ import annotations

import concurrent.futures as cf
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
ABI_HEADER = CSRC / "cvt_kernel_abi.h"
CONV_ABI_HEADER = CSRC / "cvt_conv_abi.h"
BINDING_SRC = CSRC / "binding.cpp"

NVCC_FLAGS = (
    "-std=c++17",
    "-O3",
    "-DNDEBUG",  # without it a device assert serialises wgmma (ptxas C7510)
    "--expt-relaxed-constexpr",
    "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1",
    "-Xcompiler=-fPIC,-fvisibility=hidden",
    "-shared",
    "-cudart=shared",  # share torch's CUDA runtime instead of a static copy per kernel
    "--resource-usage",  # registers / spills / smem go to the build log
)


class BuildError(RuntimeError):
    """Something needed to build kernels is missing or failed."""


class NvccNotFoundError(BuildError):
    pass


class KernelBuildError(BuildError):
    def __init__(self, failures: Sequence[tuple[str, str, Path]]):
        self.failures = list(failures)
        lines = [f"nvcc failed for {len(failures)} kernel(s):"]
        for name, target, log in failures:
            tail = _tail(log, 12)
            lines.append(f"  {name} [{target}]  log: {log}\n{tail}")
        super().__init__("\n".join(lines))


def _tail(path: Path, n: int) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "    (no log)"
    errs = [ln for ln in text if "error" in ln.lower()] or text
    return "\n".join("    | " + ln[:300] for ln in errs[-n:])


# ------------------------------------------------------------------------------- environment
def cache_root() -> Path:
    env = os.environ.get("CVT_CUTLASS_CACHE")
    if env:
        return Path(env).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cvt_cutlass"


DEFAULT_NVCC_LOCATIONS = ("/usr/local/cuda/bin/nvcc",)


def _executable(path: str | None) -> bool:
    return bool(path) and os.path.isfile(path) and os.access(path, os.X_OK)


def find_nvcc() -> str:
    """nvcc from $CVT_CUTLASS_NVCC (taken strictly), $CUDACXX, $CUDA_HOME/bin, PATH, /usr/local/cuda."""
    forced = os.environ.get("CVT_CUTLASS_NVCC")
    if forced:
        if not _executable(forced):
            raise NvccNotFoundError(f"CVT_CUTLASS_NVCC={forced} is not an executable nvcc")
        return forced
    candidates = [os.environ.get("CUDACXX")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home:
            candidates.append(os.path.join(home, "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), *DEFAULT_NVCC_LOCATIONS]
    for c in candidates:
        if _executable(c):
            return c
    raise NvccNotFoundError(
        "cvt_cutlass needs nvcc (CUDA 12.4+; 13.0 tested) to build its kernels and found none: "
        "install the CUDA toolkit, or point CVT_CUTLASS_NVCC / CUDACXX / CUDA_HOME at it"
    )


@functools.cache
def nvcc_release(nvcc: str) -> str:
    """'13.0' from `nvcc --version` (the release, not the build number)."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise NvccNotFoundError(f"cannot run {nvcc} --version: {e}") from e
    m = re.search(r"release (\d+\.\d+)", out)
    if not m:
        raise BuildError(f"cannot parse the CUDA release from `{nvcc} --version`:\n{out}")
    return m.group(1)


@functools.cache
def cutlass_version() -> str:
    from importlib.metadata import version

    return version("nvidia-cutlass")


@functools.cache
def cutlass_source_dir() -> Path:
    """The CUTLASS source tree shipped in the nvidia-cutlass wheel (include/, examples/, tools/)."""
    import cutlass_library

    return Path(cutlass_library.source_path)


@functools.cache
def cutlass_include_dirs() -> tuple[str, ...]:
    import cutlass_library

    src = Path(cutlass_library.source_path)
    dirs = (src / "include", src / "tools" / "util" / "include")
    for d in dirs:
        if not d.is_dir():
            raise BuildError(f"CUTLASS headers not found at {d} (is nvidia-cutlass==4.2.0.0 installed?)")
    return tuple(str(d) for d in dirs)


def gencode(target: str) -> str:
    """'sm_90a' -> -gencode=arch=compute_90a,code=sm_90a."""
    m = re.fullmatch(r"sm_(\d+a?)", target)
    if not m:
        raise ValueError(f"target must look like sm_90a or sm_89, got {target!r}")
    return f"-gencode=arch=compute_{m.group(1)},code={target}"


def target_for(arch: int, device_cc: int | None = None) -> str:
    """The nvcc target of a kernel path on a device (or for the path's own GPU when None).

    arch 90 kernels use wgmma/TMA and need sm_90a exactly; arch 89 (SM80-class) kernels are
    built for the device that runs them (sm_89 for an RTX 4090, sm_90 on an H200).
    """
    if arch == 90:
        if device_cc is not None and device_cc != 90:
            raise BuildError(f"sm90 kernels run only on compute capability 9.0, not {device_cc}")
        return "sm_90a"
    if device_cc is None:
        return "sm_89"
    if device_cc < 80:
        raise BuildError(f"the SM80-class kernels need compute capability >= 8.0, not {device_cc}")
    return f"sm_{device_cc}"


# ------------------------------------------------------------------------------- kernels
@dataclass(frozen=True)
class KernelBuild:
    name: str
    target: str
    source: str
    key: str
    dir: Path
    headers: tuple[Path, ...] = (ABI_HEADER,)  # ABI headers the source includes (copied beside it)
    includes: tuple[str, ...] = ()  # extra include dirs, relative to the CUTLASS source tree

    @property
    def library(self) -> Path:
        return self.dir / "kernel.so"

    @property
    def log(self) -> Path:
        return self.dir / "build.log"

    @property
    def is_built(self) -> bool:
        return self.library.is_file()


def kernel_key(source: str, target: str, nvcc_rel: str, headers: tuple[Path, ...] = (ABI_HEADER,),
               includes: tuple[str, ...] = ()) -> str:
    h = hashlib.sha256()
    header_text = [p.read_text() for p in headers]
    extra = ["-I" + " -I".join(includes)] if includes else []  # absent for kernels without any
    for part in (source, *header_text, " ".join(NVCC_FLAGS), *extra, target, nvcc_rel, cutlass_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def abi_headers(names: tuple[str, ...] = ("cvt_kernel_abi.h",)) -> tuple[Path, ...]:
    """csrc/ paths of the ABI headers a kernel family includes."""
    paths = tuple(CSRC / n for n in names)
    for p in paths:
        if not p.is_file():
            raise BuildError(f"ABI header {p} is missing from the installed package")
    return paths


def plan_kernel(name: str, source: str, target: str, nvcc_rel: str,
                headers: tuple[Path, ...] = (ABI_HEADER,), includes: tuple[str, ...] = ()) -> KernelBuild:
    key = kernel_key(source, target, nvcc_rel, headers, includes)
    return KernelBuild(name, target, source, key, cache_root() / "kernels" / name / f"{target}-{key[:16]}",
                       headers, includes)


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _compile_one(job: KernelBuild, nvcc: str) -> float:
    """Compile one kernel under its lock; returns seconds spent (0 if another process built it)."""
    with _file_lock(job.dir.with_suffix(".lock")):
        if job.is_built:
            return 0.0
        job.dir.mkdir(parents=True, exist_ok=True)
        src = job.dir / "kernel.cu"
        src.write_text(job.source)
        for h in job.headers:
            shutil.copyfile(h, job.dir / h.name)
        tmp = job.dir / f"kernel.so.tmp{os.getpid()}"
        cmd = [nvcc, *NVCC_FLAGS, gencode(job.target)]
        cmd += [f"-I{d}" for d in cutlass_include_dirs()] + [f"-I{job.dir}"]
        for d in job.includes:  # "csrc:<dir>" = a fallback dir of ours, searched after all others
            cmd += ([f"-Xcompiler=-idirafter,{CSRC / d[5:]}"] if d.startswith("csrc:")
                    else [f"-I{cutlass_source_dir() / d}"])
        cmd += ["-o", str(tmp), str(src)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        dt = time.perf_counter() - t0
        job.log.write_text(
            f"$ {' '.join(cmd)}\n# exit {proc.returncode} after {dt:.1f}s\n{proc.stdout}{proc.stderr}"
        )
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise KernelBuildError([(job.name, job.target, job.log)])
        (job.dir / "meta.json").write_text(
            json.dumps({"name": job.name, "target": job.target, "key": job.key, "seconds": round(dt, 1)})
        )
        os.replace(tmp, job.library)  # publish atomically
        return dt


class _Progress:
    """A one-line progress bar with ETA on stderr (a line per kernel when not a terminal)."""

    def __init__(self, total: int, jobs: int, enabled: bool):
        self.total, self.jobs, self.enabled = total, jobs, enabled and total > 0
        self.done = 0
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.lock = threading.Lock()
        if self.enabled:
            self._emit(f"building {total} kernel(s) with {jobs} parallel nvcc job(s)", final=True)

    def _emit(self, text: str, final: bool = False) -> None:
        if self.tty and not final:
            sys.stderr.write("\r[cvt_cutlass] " + text + "\033[K")
        else:
            sys.stderr.write("[cvt_cutlass] " + text + "\n")
        sys.stderr.flush()

    def step(self, name: str, ok: bool) -> None:
        if not self.enabled:
            return
        with self.lock:
            self.done += 1
            el = time.perf_counter() - self.t0
            eta = el / self.done * (self.total - self.done)
            w = 24
            bar = "#" * (w * self.done // self.total) + "-" * (w - w * self.done // self.total)
            status = "" if ok else " FAILED"
            self._emit(
                f"[{bar}] {self.done}/{self.total} {el:5.0f}s elapsed, ETA {eta:4.0f}s  {name}{status}",
                final=not self.tty,
            )
            if self.tty and self.done == self.total:
                sys.stderr.write("\n")


def default_jobs() -> int:
    env = os.environ.get("CVT_CUTLASS_JOBS")
    if env:
        return max(1, int(env))
    # A CUTLASS SM90 TU takes ~3.5 GB in nvcc: do not run more jobs than memory allows.
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = 16
    return max(1, min(os.cpu_count() or 1, int(mem_gb // 4)))


def build_kernels(
    builds: Iterable[KernelBuild], *, jobs: int | None = None, progress: bool = True
) -> dict[str, Path]:
    """Compile every kernel not yet in the cache; returns {name@target: library path}.

    Raises KernelBuildError naming every kernel that failed and its log file.
    """
    builds = list({(b.name, b.target): b for b in builds}.values())
    todo = [b for b in builds if not b.is_built]
    if todo:
        nvcc = find_nvcc()
        jobs = min(jobs or default_jobs(), len(todo))
        bar = _Progress(len(todo), jobs, progress)
        failures: list[tuple[str, str, Path]] = []
        with cf.ThreadPoolExecutor(max_workers=jobs) as pool:
            futs = {pool.submit(_compile_one, b, nvcc): b for b in todo}
            for fut in cf.as_completed(futs):
                b = futs[fut]
                try:
                    fut.result()
                    bar.step(b.name, True)
                except KernelBuildError as e:
                    failures.extend(e.failures)
                    bar.step(b.name, False)
        if failures:
            raise KernelBuildError(failures)
    return {f"{b.name}@{b.target}": b.library for b in builds}


# ------------------------------------------------------------------------------- binding
def _torch_build_info() -> tuple[list[str], list[str], str, str]:
    """Include and library dirs, the libstdc++ ABI flag and the C++ standard that the installed
    torch builds its own extensions with (torch moved from C++17 to C++20; its headers follow)."""
    import inspect

    import torch
    from torch.utils import cpp_extension

    includes = cpp_extension.include_paths()
    libdirs = cpp_extension.library_paths()
    abi = str(int(torch._C._GLIBCXX_USE_CXX11_ABI))
    std = "c++20" if "-std=c++20" in inspect.getsource(cpp_extension) else "c++17"
    return includes, libdirs, abi, std


def binding_library() -> Path:
    """Build (once per torch version and source) and return the torch binding library."""
    import torch

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise BuildError("no C++ compiler (c++/g++ or $CXX) to build the cvt_cutlass torch binding")
    includes, libdirs, abi, std = _torch_build_info()
    flags = ["-O2", f"-std={std}", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-Wall"]
    h = hashlib.sha256()
    for part in (BINDING_SRC.read_text(), ABI_HEADER.read_text(), CONV_ABI_HEADER.read_text(),
                 (CSRC / "cvt_attn_abi.h").read_text(), (CSRC / "cvt_norm_abi.h").read_text(), torch.__version__, " ".join(flags), cxx):
        h.update(part.encode() + b"\0")
    key = h.hexdigest()[:16]
    out_dir = cache_root() / "binding" / f"torch{torch.__version__}-{key}"
    lib = out_dir / "cvt_cutlass_binding.so"
    if lib.is_file():
        return lib
    with _file_lock(out_dir.with_suffix(".lock")):
        if lib.is_file():
            return lib
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f"tmp{os.getpid()}.so"
        cmd = [cxx, *flags, f"-I{CSRC}", *[f"-I{d}" for d in includes], str(BINDING_SRC), "-o", str(tmp)]
        cmd += [f"-L{d}" for d in libdirs] + [f"-Wl,-rpath,{d}" for d in libdirs]
        cmd += ["-lc10", "-ltorch_cpu", "-ltorch", "-ldl"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log = out_dir / "build.log"
        log.write_text(f"$ {' '.join(cmd)}\n# exit {proc.returncode}\n{proc.stdout}{proc.stderr}")
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise BuildError(f"building the cvt_cutlass torch binding failed; log: {log}\n{_tail(log, 15)}")
        os.replace(tmp, lib)
    return lib
