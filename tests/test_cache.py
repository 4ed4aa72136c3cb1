"""The kernel cache's integrity checks: damaged entries are found, logged and rebuilt; intact ones
are left alone; ``invalidate`` and ``rebuild_binding``; the slowest-first build order.

Most tests compile with a fake nvcc (a shell script that writes a small file and logs each call),
so they need neither a GPU nor nvcc; the ``nvcc`` ones compile a tiny real kernel, and one test
builds the real torch binding with c++."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cvt_cutlass import build

from .conftest import requires_nvcc

_FAKE_COMPILER = """#!/bin/sh
# Writes "<payload> <output path>" to the file after -o and logs the call, like a compiler would.
out=""
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then out="$2"; fi
  shift
done
printf 'fake library %s\\n' "$out" > "$out"
echo "$out" >> "$FAKE_COMPILER_CALLS"
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache, and no verdicts memoised from other tests."""
    monkeypatch.setenv("CVT_CUTLASS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_VERDICTS", {})
    return tmp_path / "cache"


@pytest.fixture
def fake_compiler(tmp_path, monkeypatch):
    """A fake nvcc and c++; returns a function giving the number of compiles so far."""
    script = tmp_path / "fake-compiler"
    script.write_text(_FAKE_COMPILER)
    script.chmod(0o755)
    calls = tmp_path / "compiles.log"
    monkeypatch.setenv("FAKE_COMPILER_CALLS", str(calls))
    monkeypatch.setenv("CVT_CUTLASS_NVCC", str(script))
    monkeypatch.setenv("CXX", str(script))
    return lambda: len(calls.read_text().splitlines()) if calls.exists() else 0


def _job(name: str = "cvt_linear_fwd_sm89_f16_tn_bias_tiny", target: str = "sm_89",
         source: str = 'extern "C" int f() { return 1; }\n') -> build.KernelBuild:
    return build.plan_kernel(name, source, target, "13.0")


def _damage(lib: Path, how: str) -> None:
    data = lib.read_bytes()
    if how == "truncated":
        lib.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        lib.write_bytes(b"")
    else:  # garbage of the same size: only the hash can tell
        lib.write_bytes(bytes((b + 1) % 256 for b in data))


def _forget_verdicts(monkeypatch) -> None:
    """What a fresh process sees: nothing memoised."""
    monkeypatch.setattr(build, "_VERDICTS", {})


# ------------------------------------------------------------------------------- kernels (fake nvcc)
def test_publish_records_size_and_hash(cache, fake_compiler):
    job = _job()
    libs = build.build_kernels([job], progress=False)
    assert libs == {f"{job.name}@sm_89": job.library} and fake_compiler() == 1
    meta = json.loads(job.meta.read_text())
    data = job.library.read_bytes()
    assert meta["name"] == job.name and meta["target"] == "sm_89" and meta["key"] == job.key
    assert meta["size"] == len(data) and meta["sha256"] == build._sha256_file(job.library)
    assert job.check() is None and job.is_built
    assert not list(job.dir.glob("*.tmp*"))


@pytest.mark.parametrize("how, reason", [("truncated", "size mismatch"), ("empty", "empty"),
                                         ("garbage", "sha256 mismatch")])
def test_damaged_kernel_is_logged_and_rebuilt(cache, fake_compiler, monkeypatch, caplog, how, reason):
    job = _job()
    build.build_kernels([job], progress=False)
    _damage(job.library, how)
    assert reason in job.check() and not job.is_built
    with caplog.at_level(logging.WARNING, logger="cvt_cutlass"):
        build.build_kernels([job], progress=False)
    assert fake_compiler() == 2 and job.check() is None
    (rec,) = [r for r in caplog.records if r.name == "cvt_cutlass"]
    msg = rec.getMessage()
    assert job.name in msg and reason in msg and "rebuilding" in msg and "\n" not in msg


def test_missing_meta_json_is_rebuilt(cache, fake_compiler, caplog):
    job = _job()
    build.build_kernels([job], progress=False)
    job.meta.unlink()
    assert job.check() == "no meta.json"
    with caplog.at_level(logging.WARNING, logger="cvt_cutlass"):
        build.build_kernels([job], progress=False)
    assert fake_compiler() == 2 and job.is_built and "no meta.json" in caplog.text


def test_intact_entry_is_not_rebuilt(cache, fake_compiler, monkeypatch, caplog):
    job = _job()
    build.build_kernels([job], progress=False)
    before = job.library.stat().st_mtime_ns
    _forget_verdicts(monkeypatch)  # as in a new process: hashed again, still intact
    with caplog.at_level(logging.WARNING, logger="cvt_cutlass"):
        build.build_kernels([job], progress=False)
    assert fake_compiler() == 1 and job.library.stat().st_mtime_ns == before
    assert not caplog.records


def test_hashed_once_per_process(cache, fake_compiler, monkeypatch):
    """The builder hashes what it publishes and need not hash it again; another process hashes
    a library once, however often it asks."""
    hashed = []
    real = build._sha256_file
    monkeypatch.setattr(build, "_sha256_file", lambda p: hashed.append(p) or real(p))
    job = _job()
    build.build_kernels([job], progress=False)
    assert job.is_built and len(hashed) == 1  # the temporary file, before its rename
    _forget_verdicts(monkeypatch)
    hashed.clear()
    for _ in range(5):
        assert job.is_built
    assert hashed == [job.library]
    _damage(job.library, "garbage")  # a new mtime: checked afresh
    assert not job.is_built and len(hashed) == 2


def test_legacy_entry_without_hash_is_checked_as_elf(cache, fake_compiler):
    """Entries recorded before hashes were (meta.json without sha256) are trusted only when
    kernel.so is a whole ELF shared object, so an existing cache is not rebuilt wholesale."""
    job = _job()
    build.build_kernels([job], progress=False)
    job.meta.write_text(json.dumps({"name": job.name, "target": job.target, "key": job.key, "seconds": 1}))
    assert job.check() == "not an ELF shared library"  # the fake compiler writes text
    shutil.copyfile(_a_shared_library(), job.library)
    assert job.check() is None
    _damage(job.library, "truncated")
    assert job.check().startswith("truncated ELF")


def _a_shared_library() -> Path:
    """A real ELF shared object on this machine (the C extension of a stdlib module)."""
    import _ctypes

    return Path(_ctypes.__file__)


def test_invalidate_removes_the_entry(cache, fake_compiler, caplog):
    job = _job()
    build.build_kernels([job], progress=False)
    with caplog.at_level(logging.WARNING, logger="cvt_cutlass"):
        build.invalidate(job, "dlopen: wrong ELF class")
    assert not job.dir.exists() and not job.is_built
    assert job.name in caplog.text and "dlopen: wrong ELF class" in caplog.text
    build.build_kernels([job], progress=False)
    assert fake_compiler() == 2 and job.is_built


# ------------------------------------------------------------------------------- build order
_ORDER_CASES = [  # (name, target), fastest first; kernel names in the old and the new grammar
    ("cvt_layernorm_fwd_sm90a_bf16_blc_c1024_l32_b256", "sm_90a"),
    ("cvt_dwconv_fwd_sm90a_bf16_nhwc_bias_k3_st2_p1_b256", "sm_90a"),
    ("cvt_attention_fwd_sm89_bf16_blhd_ex41_q64_k64_d64_a8", "sm_89"),
    ("cvt_conv2d_fwd_sm89_bf16_nhwc_bias_t128x128x32_w2x2x1_s4_sw1_optimized_a8", "sm_89"),
    ("cvt_linear_fwd_sm89_bf16_tn_bias_t128x128x32_w2x2x1_s4_sw1_a8", "sm_90"),
    ("cvt_attention_fwd_sm90a_f16_blhd_ex88_t64x128x64_tma_a8", "sm_90a"),
    ("cvt_conv2d_fwd_sm90a_f16_nhwc_bias_t128x128x64_c1x1x1_sauto_ws_a8", "sm_90a"),
    ("cvt_linear_fwd_sm90a_bf16_tn_bias_t128x192x64_c1x1x1_sauto_ws_a8", "sm_90a"),
]
_SM90 = {n for n, _ in _ORDER_CASES[-3:]}


def _build_order(monkeypatch, jobs) -> list[str]:
    order = []
    monkeypatch.setattr(build, "_compile_one", lambda job, nvcc: order.append(job.name) or 1.0)
    build.build_kernels(jobs, jobs=1, progress=False)
    return order


def test_slowest_first(cache, fake_compiler, monkeypatch):
    jobs = [_job(n, t) for n, t in _ORDER_CASES]
    order = _build_order(monkeypatch, jobs)
    assert set(order[:3]) == _SM90
    assert order[3].startswith("cvt_linear_fwd_sm89_")
    assert set(order[-2:]) == {n for n, _ in _ORDER_CASES[:2]}
    assert build.estimate_seconds(jobs[-1]) >= 35 and build.estimate_seconds(jobs[0]) <= 6


def test_recorded_seconds_win_over_the_table(cache, fake_compiler, monkeypatch):
    """A previous build's meta.json (another key, same name) says the depthwise kernel is slow."""
    slow = _job("cvt_dwconv_fwd_sm89_f16_nhwc_bias_k3_st1_p2_b256", "sm_89")
    old = cache / "kernels" / slow.name / "sm_89-0123456789abcdef" / "meta.json"
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps({"name": slow.name, "target": "sm_89", "seconds": 99.0}))
    assert build.estimate_seconds(slow) == 99.0
    jobs = [_job(n, t) for n, t in _ORDER_CASES] + [slow]
    assert _build_order(monkeypatch, jobs)[0] == slow.name


def test_default_jobs_is_the_cpu_count_capped_by_memory(monkeypatch):
    monkeypatch.delenv("CVT_CUTLASS_JOBS", raising=False)
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert build.default_jobs() == max(1, min(len(os.sched_getaffinity(0)), int(mem_gb // 4)))
    monkeypatch.setenv("CVT_CUTLASS_JOBS", "3")
    assert build.default_jobs() == 3


# ------------------------------------------------------------------------------- binding
def test_binding_key_covers_every_csrc_file(cache, fake_compiler, tmp_path, monkeypatch):
    """Adding or editing any *.cpp/*.h/*.inc under csrc/ (subfolders too) changes the binding's
    cache key; only binding.cpp is compiled, with csrc/ on the include path."""
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", csrc)
    first = build._binding_plan()
    assert str(csrc / "binding.cpp") in first.cmd and f"-I{csrc}" in first.cmd
    assert not [a for a in first.cmd if a.endswith((".h", ".inc"))]
    (csrc / "notes.txt").write_text("not C++")
    assert build._binding_plan().lib == first.lib
    (csrc / "parts").mkdir()
    (csrc / "parts" / "ops.inc").write_text("// one more part\n")
    second = build._binding_plan()
    assert second.lib != first.lib
    (csrc / "parts" / "ops.inc").write_text("// edited\n")
    assert build._binding_plan().lib not in (first.lib, second.lib)
    sources = build.binding_sources()
    rel = [p.relative_to(csrc).as_posix() for p in sources if csrc in p.parents]
    assert rel == sorted(rel) and "parts/ops.inc" in rel and "binding.cpp" in rel
    abi = {p.relative_to(build.OPERATORS).as_posix() for p in sources if p.name == "abi.h"}
    assert {"common/abi.h", "linear/abi.h", "conv2d/abi.h", "attention/abi.h"} <= abi  # the kernels' ABI structs


def test_damaged_binding_is_rebuilt_and_rebuild_binding(cache, fake_compiler, caplog):
    lib = build.binding_library()
    assert fake_compiler() == 1 and json.loads(lib.with_suffix(".json").read_text())["size"] > 0
    assert build.binding_library() == lib and fake_compiler() == 1  # intact: reused
    for n, how in enumerate(("truncated", "empty", "garbage"), start=2):
        _damage(lib, how)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="cvt_cutlass"):
            assert build.binding_library() == lib
        assert fake_compiler() == n and "binding" in caplog.text and "rebuilding" in caplog.text
    with caplog.at_level(logging.WARNING, logger="cvt_cutlass"):
        assert build.rebuild_binding("load_library: undefined symbol") == lib
    assert fake_compiler() == 5 and "undefined symbol" in caplog.text
    assert build._verify(lib, lib.with_suffix(".json")) is None


# ------------------------------------------------------------------------------- real compilers
@requires_nvcc
@pytest.mark.nvcc
def test_real_kernel_truncated_then_rebuilt(cache, caplog):
    """nvcc builds a tiny kernel; truncated, it is rebuilt and loads. (Not loaded before the
    damage: glibc would hand back the first handle, whose pages the truncation pulled away.)"""
    rel = build.nvcc_release(build.find_nvcc())
    source = 'extern "C" __attribute__((visibility("default"))) int f() { return 1; }\n'
    job = build.plan_kernel("cvt_test_tiny", source, "sm_89", rel)
    build.build_kernels([job], progress=False)
    assert build._elf_problem(job.library, job.library.stat().st_size) is None
    meta = json.loads(job.meta.read_text())
    assert meta["size"] == job.library.stat().st_size and meta["seconds"] > 0
    _damage(job.library, "truncated")
    with caplog.at_level(logging.WARNING, logger="cvt_cutlass"):
        build.build_kernels([job], progress=False)
    assert "cvt_test_tiny" in caplog.text and "size mismatch" in caplog.text
    assert job.is_built and ctypes.CDLL(str(job.library)).f() == 1


@requires_nvcc
def test_real_binding_garbage_then_rebuilt(cache, caplog):
    """The real binding (c++ against the installed torch), overwritten with garbage, is rebuilt
    and loads in a fresh process (not in this one: other tests may have loaded a binding)."""
    lib = build.binding_library()
    lib.write_bytes(b"\0garbage" * 1000)
    with caplog.at_level(logging.WARNING, logger="cvt_cutlass"):
        assert build.binding_library() == lib
    assert "corrupt" in caplog.text and build._elf_problem(lib, lib.stat().st_size) is None
    code = "import sys, torch; torch.ops.load_library(sys.argv[1]); print('ok')"
    out = subprocess.run([sys.executable, "-c", code, str(lib)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
