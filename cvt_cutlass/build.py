"""Build: kernel .cu -> shared library, cached on disk by content; the torch binding.

* One translation unit per kernel (a spec's instantiation of its family's headers under
  ``operators/``), compiled by nvcc in parallel into its own shared library (``kernel.so``) that
  exports the plain-C ABI of ``operators/common/abi.h``. Kernel libraries include no torch header:
  they build wherever nvcc 13 is, and can be built on one machine and carried to another (set
  ``CVT_CUTLASS_CACHE`` on both).
* Cache key: sha256 of the source, every header of ours it includes (followed transitively), the
  nvcc flags, the target (``sm_90a``, ``sm_89``, ...), the nvcc release and the CUTLASS version.
  The cache lives in ``$CVT_CUTLASS_CACHE`` (default ``~/.cache/cvt_cutlass``).
* Two processes building the same kernel at once are safe: each entry is built under an
  exclusive file lock and published with an atomic rename.
* Every published library has its size and sha256 recorded beside it (the entry's ``meta.json``,
  the binding's ``cvt_cutlass_binding.json``). An entry is "built" only when the library matches
  that record (``KernelBuild.check``), so a truncated, empty or garbage library left by a crash or
  a bad copy is logged and rebuilt instead of failing in dlopen. When a library that passed the
  check still fails to load (another toolchain, say), runtime code calls ``invalidate(job, why)``
  for a kernel or ``rebuild_binding(why)`` for the binding.
* Kernels are compiled slowest first (``estimate_seconds``), so that N parallel nvcc jobs finish
  near the time of the slowest kernel rather than with it started last.
* The binding (``csrc/binding.cpp``, with the families' ``abi.h``) registers the ops with the installed torch.
  It links only libc10/libtorch_cpu (the CUDA stream comes through c10's device-generic
  interface), so it builds against a CPU torch as well.
"""

from __future__ import annotations

import concurrent.futures as cf
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
BINDING_SRC = CSRC / "binding.cpp"  # the one translation unit; it #includes the other csrc files
BINDING_SUFFIXES = (".cpp", ".h", ".inc")  # csrc files hashed into the binding's cache key


def _operators_dir() -> Path:
    """The kernel families' folder (top-level operators/ in the source tree, installed as
    cvt_cutlass.operators): the include root of every kernel source and of the binding's ABI
    headers."""
    from . import operators

    return Path(operators.__file__).resolve().parent


OPERATORS = _operators_dir()
HEADER_SUFFIXES = (".h", ".cuh", ".hpp")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)

_log = logging.getLogger("cvt_cutlass")

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


# ------------------------------------------------------------------------------- integrity
# Verdicts of _verify, memoised by the stat of the library and of its record: a library is
# hashed at most once per process (per version of the file), so hot paths pay one stat.
_VERDICTS: dict[tuple, str | None] = {}


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _stat_key(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _verify(lib: Path, record: Path) -> str | None:
    """None when ``lib`` exists and matches the size and sha256 in ``record`` (a json), else why not.

    "missing" means there is nothing to distrust (build it); any other reason means a damaged
    entry. Memoised by path, inode, mtime and size of both files, so a rebuilt library (new inode)
    is checked afresh while an unchanged one is hashed once."""
    lib_key = _stat_key(lib)
    if lib_key is None:
        return "missing"
    memo = (str(lib), lib_key, _stat_key(record))
    if memo not in _VERDICTS:
        try:
            _VERDICTS[memo] = _verdict(lib, record, lib_key[2])
        except FileNotFoundError:  # removed while we looked: a rebuild is under way
            return "missing"
    return _VERDICTS[memo]


def _verdict(lib: Path, record: Path, size: int) -> str | None:
    """_verify's uncached work: the size and sha256 against the record (no memo, no stat)."""
    if size == 0:
        return f"empty {lib.name}"
    try:
        meta = json.loads(record.read_text())
    except FileNotFoundError:
        return f"no {record.name}"
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict):
        return f"unreadable {record.name}"
    if "sha256" not in meta:  # recorded before hashes were: check the ELF structure instead
        return _elf_problem(lib, size)
    if meta.get("size") != size:
        return f"size mismatch: {size} bytes, {record.name} says {meta.get('size')}"
    if _sha256_file(lib) != meta["sha256"]:
        return f"sha256 mismatch with {record.name}"
    return None


def _elf_problem(lib: Path, size: int) -> str | None:
    """Why ``lib`` is not a whole 64-bit little-endian ELF shared object, or None.

    For entries whose meta.json predates recorded hashes (so an existing cache is not rebuilt
    wholesale): the linker writes the section header table last, so a truncated file loses it."""
    with open(lib, "rb") as f:
        head = f.read(64)
    if len(head) < 64 or head[:6] != b"\x7fELF\x02\x01":
        return "not an ELF shared library"
    e_type = struct.unpack_from("<H", head, 16)[0]
    shoff = struct.unpack_from("<Q", head, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
    if e_type != 3:  # ET_DYN
        return "not an ELF shared library"
    if shoff + shentsize * shnum > size:
        return f"truncated ELF ({size} bytes, section headers end at {shoff + shentsize * shnum})"
    return None


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _publish(tmp: Path, lib: Path, record: Path, meta: dict) -> None:
    """Record the size and sha256 of the freshly built ``tmp``, then rename it to ``lib``.

    The record goes first: whoever sees the library also sees the record that vouches for it
    (a record without a library reads as "missing", and is rebuilt under the lock). The verdict
    is memoised as intact, so this process does not hash the file a second time."""
    _write_json_atomic(record, {**meta, "size": tmp.stat().st_size, "sha256": _sha256_file(tmp)})
    os.replace(tmp, lib)
    _VERDICTS[(str(lib), _stat_key(lib), _stat_key(record))] = None


def _built_ok(proc: subprocess.CompletedProcess, out: Path) -> bool:
    """The compiler succeeded and left a non-empty output (an empty one would never verify)."""
    return proc.returncode == 0 and out.is_file() and out.stat().st_size > 0


# ------------------------------------------------------------------------------- kernels
def project_headers(source: str, includes: tuple[str, ...] = ()) -> tuple[Path, ...]:
    """Every header of ours a kernel source depends on: its ``#include "..."`` lines that name a
    file under operators/, followed transitively (what else it includes is CUTLASS's, keyed by the
    CUTLASS version), and the files of its "operators:<dir>" include directories; sorted."""
    found: set[Path] = set()
    todo = [source]
    while todo:
        for rel in _INCLUDE.findall(todo.pop()):
            path = (OPERATORS / rel).resolve()
            if path not in found and path.is_file() and OPERATORS in path.parents:
                found.add(path)
                todo.append(path.read_text())
    for d in includes:
        if d.startswith("operators:"):
            found.update(f for f in (OPERATORS / d[len("operators:"):]).rglob("*") if f.suffix in HEADER_SUFFIXES)
    return tuple(sorted(found))


@dataclass(frozen=True)
class KernelBuild:
    name: str
    target: str
    source: str
    key: str
    dir: Path
    includes: tuple[str, ...] = ()  # extra include dirs (KernelSpec.include_dirs)

    @property
    def library(self) -> Path:
        return self.dir / "kernel.so"

    @property
    def log(self) -> Path:
        return self.dir / "build.log"

    @property
    def meta(self) -> Path:
        return self.dir / "meta.json"

    def check(self) -> str | None:
        """None when the entry is complete and intact (kernel.so matches the size and sha256 in
        meta.json), else the reason: "missing", "empty kernel.so", "no meta.json",
        "size mismatch: ...", "sha256 mismatch ...", ... Hashes at most once per process."""
        return _verify(self.library, self.meta)

    @property
    def is_built(self) -> bool:
        return self.check() is None


def kernel_key(source: str, target: str, nvcc_rel: str, includes: tuple[str, ...] = ()) -> str:
    """sha256 of what a kernel library depends on: the source, our headers it includes (by path
    under operators/ and content), the flags, the extra include dirs, the target, the nvcc release
    and the CUTLASS version."""
    h = hashlib.sha256()
    headers = [f"{p.relative_to(OPERATORS).as_posix()}\n{p.read_text()}" for p in project_headers(source, includes)]
    extra = ["-I" + " -I".join(includes)] if includes else []
    for part in (source, *headers, " ".join(NVCC_FLAGS), *extra, target, nvcc_rel, cutlass_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def plan_kernel(name: str, source: str, target: str, nvcc_rel: str, includes: tuple[str, ...] = ()) -> KernelBuild:
    key = kernel_key(source, target, nvcc_rel, includes)
    return KernelBuild(name, target, source, key, cache_root() / "kernels" / name / f"{target}-{key[:16]}",
                       includes)


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _nvcc_command(job: KernelBuild, nvcc: str, src: Path, out: Path) -> list[str]:
    """The nvcc command line that compiles ``src`` into ``out`` (it goes into the build log)."""
    cmd = [nvcc, *NVCC_FLAGS, gencode(job.target), f"-I{OPERATORS}"]
    cmd += [f"-I{d}" for d in cutlass_include_dirs()]
    for d in job.includes:  # "operators:<dir>" = a fallback dir of ours, searched after all others
        cmd += ([f"-Xcompiler=-idirafter,{OPERATORS / d[len('operators:'):]}"] if d.startswith("operators:")
                else [f"-I{cutlass_source_dir() / d}"])
    return cmd + ["-o", str(out), str(src)]


def _compile_one(job: KernelBuild, nvcc: str) -> float:
    """Compile one kernel under its lock; returns seconds spent (0 if another process built it).

    The entry is checked again under the lock (another process may have built or repaired it);
    a damaged one (truncated, empty, garbage, no meta.json) is logged, removed and rebuilt."""
    with _file_lock(job.dir.with_suffix(".lock")):
        reason = job.check()
        if reason is None:
            return 0.0
        if reason != "missing":
            _log.warning("cvt_cutlass: kernel %s [%s] in the cache is corrupt (%s): removing %s and "
                         "rebuilding it", job.name, job.target, reason, job.dir)
        shutil.rmtree(job.dir, ignore_errors=True)  # stale tmp files, logs and records too
        job.dir.mkdir(parents=True, exist_ok=True)
        src = job.dir / "kernel.cu"
        src.write_text(job.source)
        tmp = job.dir / f"kernel.so.tmp{os.getpid()}"
        cmd = _nvcc_command(job, nvcc, src, tmp)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        dt = time.perf_counter() - t0
        job.log.write_text(
            f"$ {' '.join(cmd)}\n# exit {proc.returncode} after {dt:.1f}s\n{proc.stdout}{proc.stderr}"
        )
        if not _built_ok(proc, tmp):
            tmp.unlink(missing_ok=True)
            raise KernelBuildError([(job.name, job.target, job.log)])
        meta = {"name": job.name, "target": job.target, "key": job.key, "seconds": round(dt, 1)}
        _publish(tmp, job.library, job.meta, meta)  # atomically, with its size and sha256
        return dt


# ------------------------------------------------------------------------------- index
# <cache>/index/<emitter fingerprint>/<name>@<target> holds the key of a built kernel, so that a
# process finds a cached kernel by name without emitting its source (runtime.plan).
def _index_path(name: str, target: str, fingerprint: str) -> Path:
    return cache_root() / "index" / fingerprint / f"{name}@{target}"


def index_kernel(job: KernelBuild, fingerprint: str) -> None:
    """Record a built kernel under its name for this emitter fingerprint."""
    p = _index_path(job.name, job.target, fingerprint)
    if job.source and not p.is_file() and job.is_built:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f"{p.name}.tmp{os.getpid()}")
        tmp.write_text(job.key)
        os.replace(tmp, p)


def indexed_kernel(name: str, target: str, fingerprint: str, includes: tuple[str, ...] = ()) -> KernelBuild | None:
    """The built, intact cache entry recorded for ``name`` under this fingerprint, or None (then
    the caller emits the source and plans it). The entry has no source: it is never rebuilt."""
    try:
        key = _index_path(name, target, fingerprint).read_text().strip()
    except OSError:
        return None
    job = KernelBuild(name, target, "", key, cache_root() / "kernels" / name / f"{target}-{key[:16]}", includes)
    return job if job.is_built else None


def invalidate(job: KernelBuild, reason: str) -> None:
    """Remove ``job``'s cache entry (under its lock) and log why; the next build_kernels rebuilds it.

    For runtime code whose dlopen of a library that passed ``job.check()`` still fails (built by
    another toolchain, a missing dependency, ...): call ``invalidate(job, str(error))`` then
    ``build_kernels([job])`` once more, and give up if the fresh library fails too."""
    with _file_lock(job.dir.with_suffix(".lock")):
        _log.warning("cvt_cutlass: kernel %s [%s] invalidated (%s): removing %s; it will be rebuilt",
                     job.name, job.target, reason, job.dir)
        shutil.rmtree(job.dir, ignore_errors=True)


# Seconds to compile one kernel on a 2-core build machine with nvcc 13.0 (measured): CUTLASS 3.x
# SM90 collectives (TMA + wgmma) dominate, SM80-class GEMMs next, the small kernels last.
_SECONDS_SM90, _SECONDS_LINEAR, _SECONDS_CONV_ATTN, _SECONDS_SMALL = 40.0, 13.0, 6.0, 4.0


def _recorded_seconds(job: KernelBuild) -> float | None:
    """nvcc time recorded in the meta.json of a previous build of the same kernel name (any key;
    the same target preferred), or None. One small glob per kernel to build."""
    found: list[tuple[bool, float]] = []
    for meta in (cache_root() / "kernels" / job.name).glob("*/meta.json"):
        try:
            seconds = float(json.loads(meta.read_text())["seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if seconds > 0:
            found.append((meta.parent.name.startswith(f"{job.target}-"), seconds))
    return max(found)[1] if found else None


def estimate_seconds(job: KernelBuild) -> float:
    """Expected nvcc time of ``job``, to schedule the slowest kernels first.

    A previous build's recorded ``seconds`` when the cache has one, else this table, measured on
    the 2-core build machine with nvcc 13.0: CUTLASS 3.x SM90 kernels (target sm_90a, "_sm90a_"
    Linear, conv2d and example-88 attention) 35-45 s; SM80-class Linear GEMMs 12-15 s; SM80-class
    conv2d and example-41 attention ~6 s; depthwise conv, LayerNorm and anything else 3-6 s."""
    recorded = _recorded_seconds(job)
    if recorded is not None:
        return recorded
    op = job.name.split("_")[1] if job.name.startswith("cvt_") else ""  # cvt_<op>_...
    sm90 = job.target == "sm_90a" and "_sm90a_" in job.name
    if op == "linear":
        return _SECONDS_SM90 if sm90 else _SECONDS_LINEAR
    if op == "conv2d":
        return _SECONDS_SM90 if sm90 else _SECONDS_CONV_ATTN
    if op in ("attention", "attn"):
        return _SECONDS_SM90 if sm90 and "ex88" in job.name else _SECONDS_CONV_ATTN
    return _SECONDS_SMALL  # dwconv, layernorm, anything new


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


def _usable_cpus() -> int:
    """CPUs this process may run on (a container's cpuset, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_jobs() -> int:
    """$CVT_CUTLASS_JOBS, else one nvcc job per usable CPU, capped by memory (4 GiB a job)."""
    env = os.environ.get("CVT_CUTLASS_JOBS")
    if env:
        return max(1, int(env))
    # A CUTLASS SM90 TU takes ~3.5 GB in nvcc: do not run more jobs than memory allows.
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = 16
    return max(1, min(_usable_cpus(), int(mem_gb // 4)))


def build_kernels(
    builds: Iterable[KernelBuild], *, jobs: int | None = None, progress: bool = True
) -> dict[str, Path]:
    """Compile every kernel not yet in the cache; returns {name@target: library path}.

    Entries that fail their check (truncated, empty, garbage) count as missing: they are logged
    and rebuilt. The slowest kernels are started first (``estimate_seconds``), so with N parallel
    jobs and at most N kernels the wall time is about that of the slowest one.
    Raises KernelBuildError naming every kernel that failed and its log file.
    """
    builds = list({(b.name, b.target): b for b in builds}.values())
    todo = sorted((b for b in builds if not b.is_built), key=estimate_seconds, reverse=True)
    lost = [b.name for b in todo if not b.source]
    if lost:  # found through the index, then removed before it was loaded
        raise BuildError(f"cache entries of {lost} disappeared while in use; run again to rebuild them")
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


def binding_sources() -> list[Path]:
    """Every C++ file under csrc/ (``*.cpp``, ``*.h``, ``*.inc``, recursively) and the families'
    ABI headers (operators/*/abi.h), sorted by path: all of them go into the binding's cache key,
    so splitting binding.cpp into more files (which it #includes) needs no change here."""
    files = [p for p in CSRC.rglob("*") if p.is_file() and p.suffix in BINDING_SUFFIXES]
    return sorted(files + sorted(OPERATORS.glob("*/abi.h")), key=_binding_rel)


def _binding_rel(path: Path) -> str:
    return path.relative_to(CSRC).as_posix() if CSRC in path.parents else "operators/" + path.relative_to(
        OPERATORS).as_posix()


@dataclass(frozen=True)
class _Binding:
    """Where the binding for the installed torch and the current sources lives, and how to build it."""

    lib: Path
    cmd: tuple[str, ...]  # the compile command, less "-o <output>"

    @property
    def record(self) -> Path:
        return self.lib.with_suffix(".json")

    @property
    def log(self) -> Path:
        return self.lib.parent / "build.log"

    @property
    def lock(self) -> Path:
        return self.lib.parent.with_suffix(".lock")


def _binding_plan() -> _Binding:
    import torch

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise BuildError("no C++ compiler (c++/g++ or $CXX) to build the cvt_cutlass torch binding")
    includes, libdirs, abi, std = _torch_build_info()
    flags = ["-O2", f"-std={std}", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-Wall"]
    h = hashlib.sha256()
    for src in binding_sources():
        h.update(_binding_rel(src).encode() + b"\0" + src.read_bytes() + b"\0")
    for part in (torch.__version__, " ".join(flags), cxx):
        h.update(part.encode() + b"\0")
    out_dir = cache_root() / "binding" / f"torch{torch.__version__}-{h.hexdigest()[:16]}"
    cmd = [cxx, *flags, f"-I{CSRC}", f"-I{OPERATORS}", *[f"-I{d}" for d in includes], str(CSRC / BINDING_SRC.name)]
    cmd += [f"-L{d}" for d in libdirs] + [f"-Wl,-rpath,{d}" for d in libdirs]
    cmd += ["-lc10", "-ltorch_cpu", "-ltorch", "-ldl"]
    return _Binding(out_dir / "cvt_cutlass_binding.so", tuple(cmd))


def _build_binding(b: _Binding) -> None:
    """Compile the binding into a temporary file and publish it with its size and sha256 (call
    under ``b.lock``); whatever was there before is removed first."""
    import torch

    b.lib.unlink(missing_ok=True)
    b.record.unlink(missing_ok=True)
    b.lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = b.lib.parent / f"tmp{os.getpid()}.so"
    cmd = [*b.cmd, "-o", str(tmp)]
    sys.stderr.write(f"[cvt_cutlass] building the torch binding for torch {torch.__version__} (once per torch "
                     "version and source; ~10-30 s)\n")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    b.log.write_text(f"$ {' '.join(cmd)}\n# exit {proc.returncode}\n{proc.stdout}{proc.stderr}")
    if not _built_ok(proc, tmp):
        tmp.unlink(missing_ok=True)
        raise BuildError(f"building the cvt_cutlass torch binding failed; log: {b.log}\n{_tail(b.log, 15)}")
    _publish(tmp, b.lib, b.record, {"torch": torch.__version__, "seconds": round(dt, 1)})


def binding_library() -> Path:
    """Build (once per torch version and source) and return the torch binding library.

    A cached library is returned only if it matches its recorded size and sha256; a damaged one
    (truncated, empty, garbage) is logged and rebuilt under the lock."""
    b = _binding_plan()
    if _verify(b.lib, b.record) is None:
        return b.lib
    with _file_lock(b.lock):
        reason = _verify(b.lib, b.record)  # another process may have built it meanwhile
        if reason is None:
            return b.lib
        if reason != "missing":
            _log.warning("cvt_cutlass: the torch binding %s is corrupt (%s): rebuilding it", b.lib, reason)
        _build_binding(b)
    return b.lib


def rebuild_binding(reason: str) -> Path:
    """Rebuild the binding unconditionally (under its lock), log why, and return its path.

    For runtime code whose ``torch.ops.load_library`` fails on a library that passed the hash
    check (built by another toolchain, say): call it once with the error, load the result, and
    give up if that fails too."""
    b = _binding_plan()
    with _file_lock(b.lock):
        _log.warning("cvt_cutlass: rebuilding the torch binding %s (%s)", b.lib, reason)
        _build_binding(b)
    return b.lib
