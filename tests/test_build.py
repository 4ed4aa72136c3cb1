"""Build: cache keys, real nvcc compiles for sm_89 and sm_90a, locking, errors, the torch binding."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import re
from pathlib import Path

import pytest
from cvt_cutlass.epilogues import LINEAR_EPILOGUES
from cvt_cutlass.operators.linear import heuristic_spec
from cvt_cutlass.operators.spec import DEFERRING_ABIS

from cvt_cutlass import build

from .conftest import requires_nvcc


class _Info(ctypes.Structure):
    _fields_ = [("abi", ctypes.c_int), ("family", ctypes.c_int), ("min_cc", ctypes.c_int), ("name", ctypes.c_char_p)]


def abi_version() -> int:
    """CVT_KERNEL_ABI_VERSION as operators/common/abi.h defines it."""
    import re

    text = (build.OPERATORS / "common" / "abi.h").read_text()
    return int(re.search(r"#define CVT_KERNEL_ABI_VERSION (\d+)", text).group(1))


def kernel_info(lib):
    """The cvt_kernel_info record a kernel library reports about itself (operators/common/abi.h)."""
    lib.cvt_kernel_info_get.restype = ctypes.POINTER(_Info)
    return lib.cvt_kernel_info_get().contents


def spill_stores(log: str) -> list[int]:
    """The spill-store bytes ptxas reports for each function in a build log."""
    return [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]


def build_and_check(specs, target: str, families, abi: str, spill_budget=lambda spec: 0) -> None:
    """nvcc-build ``specs`` for ``target``; each library reports its spec's name and family
    (``families(spec)``), exports cvt_<abi>_{can_implement,workspace_size,run} (and cvt_colsum_flush
    where its ABI defers column sums), and its build log shows no errors, no serialised wgmma and,
    in every function, no more spill stores than ``spill_budget(spec)`` bytes (0 unless a test
    names a kernel's known spills)."""
    from cvt_cutlass.emitter import kernel_source

    rel = build.nvcc_release(build.find_nvcc())
    jobs = [build.plan_kernel(s.name, kernel_source(s), target, rel, tuple(s.include_dirs)) for s in specs]
    libs = build.build_kernels(jobs)
    for spec, job in zip(specs, jobs, strict=True):
        lib = ctypes.CDLL(str(libs[f"{spec.name}@{target}"]))
        info = kernel_info(lib)
        assert info.name.decode() == spec.name and info.family == families(spec)
        for sym in (f"cvt_{abi}_can_implement", f"cvt_{abi}_workspace_size", f"cvt_{abi}_launch"):
            assert hasattr(lib, sym)
        assert hasattr(lib, "cvt_colsum_flush") == (abi in DEFERRING_ABIS)  # the libraries that defer sums
        log = job.log.read_text()
        spills = spill_stores(log)
        assert spills and max(spills) <= spill_budget(spec), f"{spec.name}: spill stores {spills}"
        assert "error" not in log.lower() and "C7510" not in log  # wgmma not serialised


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CVT_CUTLASS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_key_depends_on_everything_that_changes_the_binary():
    k = build.kernel_key("src", "sm_90a", "13.0")
    assert k == build.kernel_key("src", "sm_90a", "13.0")
    assert k != build.kernel_key("src2", "sm_90a", "13.0")
    assert k != build.kernel_key("src", "sm_89", "13.0")
    assert k != build.kernel_key("src", "sm_90a", "12.8")


def test_cache_location_follows_env(cache):
    job = build.plan_kernel("cvt_linear_x", "src", "sm_89", "13.0")
    assert str(job.dir).startswith(str(cache / "kernels" / "cvt_linear_x" / "sm_89-"))


def test_targets():
    assert build.target_for(90) == "sm_90a"
    assert build.target_for(89) == "sm_89"
    assert build.target_for(89, 90) == "sm_90"  # the sm89 path's kernels run on an H200
    with pytest.raises(build.BuildError):
        build.target_for(90, 89)
    with pytest.raises(build.BuildError):
        build.target_for(89, 75)
    assert build.gencode("sm_90a") == "-gencode=arch=compute_90a,code=sm_90a"


def test_missing_nvcc_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CVT_CUTLASS_NVCC", "/nonexistent/nvcc")
    with pytest.raises(build.NvccNotFoundError, match="CVT_CUTLASS_NVCC"):
        build.find_nvcc()
    monkeypatch.delenv("CVT_CUTLASS_NVCC")
    for var in ("CUDACXX", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(build, "DEFAULT_NVCC_LOCATIONS", ())
    with pytest.raises(build.NvccNotFoundError, match="needs nvcc"):
        build.find_nvcc()


@requires_nvcc
def test_compile_failure_names_kernel_and_log(cache):
    rel = build.nvcc_release(build.find_nvcc())
    job = build.plan_kernel("cvt_linear_broken", "this is not C++;\n", "sm_89", rel)
    with pytest.raises(build.KernelBuildError) as ei:
        build.build_kernels([job], progress=False)
    msg = str(ei.value)
    assert "cvt_linear_broken" in msg and str(job.log) in msg
    assert job.log.is_file() and not job.is_built


_TINY_KERNEL = (Path(__file__).parent / "data" / "tiny_kernel.cu").read_text()


def _build_tiny(cache_dir: str, q) -> None:
    os.environ["CVT_CUTLASS_CACHE"] = cache_dir
    rel = build.nvcc_release(build.find_nvcc())
    job = build.plan_kernel("tiny", _TINY_KERNEL, "sm_89", rel)
    q.put(build._compile_one(job, build.find_nvcc()))


@requires_nvcc
def test_two_processes_building_one_kernel(cache):
    """Both get the library; exactly one of them compiled it (the other waited on the lock)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_build_tiny, args=(str(cache), q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    seconds = sorted([q.get(), q.get()])
    assert seconds[0] == 0.0 and seconds[1] > 0.0
    libs = list(cache.glob("kernels/tiny/*/kernel.so"))
    assert len(libs) == 1 and not list(cache.glob("kernels/tiny/*/*.tmp*"))


def _specs_one_per_epilogue(arch: int):
    # One kernel of each epilogue; alternate dtypes so both element types are compiled.
    return [
        heuristic_spec(3136, 64 if i % 2 else 192, 64, "fp16" if i % 2 else "bf16", e, arch)
        for i, e in enumerate(sorted(LINEAR_EPILOGUES))
    ]


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("arch", [89, 90])
def test_real_compiles_for_each_epilogue(arch):
    """nvcc builds one kernel of each epilogue for sm_89 (SM80-class) and sm_90a (TMA + wgmma);
    each library loads with no GPU and reports the name of its spec; the binding loads it too and
    names its launches' profiler scope by the name's op and pass. Uses the user cache, so a
    second run is fast."""
    import torch

    from cvt_cutlass.runtime import ensure_binding, plan

    specs = _specs_one_per_epilogue(arch)
    jobs = plan(specs)
    libs = build.build_kernels(jobs)
    assert {j.target for j in jobs} == {"sm_90a" if arch == 90 else "sm_89"}
    for spec, job in zip(specs, jobs, strict=True):
        lib = ctypes.CDLL(str(libs[f"{spec.name}@{job.target}"]))
        info = kernel_info(lib)
        assert info.name.decode() == spec.name
        assert info.min_cc == spec.min_cc and info.abi == abi_version()
        log = job.log.read_text()
        spills = spill_stores(log)
        assert spills and max(spills) == 0 and "error" not in log.lower()
        if arch == 90:
            # The wgmma path: sm_90a code, no serialisation warning (needs -DNDEBUG).
            assert "C7510" not in log
    ensure_binding()
    kid = int(torch.ops.cvt_cutlass_C.load_kernel(str(libs[f"{specs[0].name}@{jobs[0].target}"]), specs[0].name))
    assert torch.ops.cvt_cutlass_C.kernel_name(kid) == specs[0].name
    assert torch.ops.cvt_cutlass_C.kernel_part(kid) == "cvt_kernel::linear_fwd"


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("arch, epilogue, n, residual", [(90, "bias_residual", 64, "f32"),
                                                         (89, "bias_scale_residual", 192, "f32"),
                                                         (90, "bias_residual", 192, "f32in"),
                                                         (89, "bias_residual", 64, "f32in")])
def test_real_compiles_of_an_fp32_residual_epilogue(arch, epilogue, n, residual):
    """nvcc builds a Linear forward with an fp32 residual and output ("f32"), or an fp32 residual
    and a 16-bit output ("f32in"), of 16-bit operands for sm_90a and sm_89 (N = 192: a tile whose
    fp32 output thread map differs from the 16-bit one), without spills; the library names its
    spec."""
    from cvt_cutlass.runtime import plan

    spec = heuristic_spec(3136, n, 64, "bf16", epilogue, arch).with_(residual=residual)
    jobs = plan([spec])
    libs = build.build_kernels(jobs)
    info = kernel_info(ctypes.CDLL(str(libs[f"{spec.name}@{jobs[0].target}"])))
    assert info.name.decode() == spec.name and info.abi == abi_version()
    spills = spill_stores(jobs[0].log.read_text())
    assert spills and max(spills) == 0


@requires_nvcc
def test_binding_builds_and_loads_against_installed_torch(cache):
    """The binding links only libc10/libtorch_cpu: it builds and registers its ops on CPU torch too.

    Loaded in a fresh process: a second copy of the library in this one (other tests may have
    loaded the binding from the user cache) would register the op namespace twice."""
    import subprocess
    import sys

    lib = build.binding_library()
    assert lib.is_file() and Path(lib).parent.parent == cache / "binding"
    code = r"""
import torch
from cvt_cutlass import runtime
runtime.ensure_binding()
ops = torch.ops.cvt_cutlass_C
for name in ("gemm", "conv2d", "attention", "layer_norm", "load_kernel", "kernel_name", "current_stream_handle"):
    assert hasattr(ops, name), name
try:
    ops.load_kernel("/nonexistent.so", "x")
    raise SystemExit("load_kernel of a missing file did not raise")
except RuntimeError as e:
    assert "cannot load kernel library" in str(e), e
if not torch.cuda.is_available():
    # the ops have only CUDA implementations: CPU tensors are refused by the dispatcher
    a = torch.zeros(8, 8, dtype=torch.float16)
    try:
        ops.gemm(0, a, a, None, None, a, None)
        raise SystemExit("gemm accepted CPU tensors")
    except NotImplementedError:
        pass
print("ok")
"""
    env = {**os.environ, "CVT_CUTLASS_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


def _conv_specs():
    from cvt_cutlass.operators.conv2d import ConvSpec
    from cvt_cutlass.operators.dwconv import DwConvSpec

    return [
        ConvSpec(89, "bf16", (128, 128, 32), (2, 2, 1), 4),  # stage 2/3 embeddings (C % 8 == 0)
        ConvSpec(89, "fp16", (128, 64, 32), (2, 2, 1), 4, "fixed_channels", 4),  # the stem, C padded to 4
        DwConvSpec(89, "fp16", 1, 2, 256),  # conv projections (q: stride 1, k/v: stride 2)
        DwConvSpec(90, "bf16", 2, 1, 256),
    ]


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("target", ["sm_89", "sm_90a"])
def test_real_compiles_for_each_conv_kind(target):
    """nvcc builds the implicit-GEMM conv (optimized and fixed-channels iterators) and the depthwise
    kernel for sm_89 and sm_90a; each library reports its name and family, without spills."""
    from cvt_cutlass.operators.conv2d import Conv90Spec

    specs = _conv_specs()
    if target == "sm_90a":  # the CUTLASS 3.x SM90 conv (TMA im2col + wgmma) exists only there
        specs.append(Conv90Spec("fp16", (128, 128, 64)))
    build_and_check(specs, target, lambda s: 2 if s.family == "conv2d_fprop" else 3, "conv")


def test_cache_key_covers_every_header_of_ours_a_source_includes(tmp_path, monkeypatch):
    """The key hashes the headers a source includes under operators/, followed transitively (the
    family's kernel header, its abi.h, common/abi.h, ...), and no other: editing a header rebuilds
    exactly the kernels that include it."""
    ops = tmp_path / "operators"
    (ops / "fam").mkdir(parents=True)
    (ops / "common").mkdir()
    (ops / "common" / "abi.h").write_text("// abi\n")
    (ops / "fam" / "kernel.cuh").write_text('#include "common/abi.h"\n#include "cutlass/cutlass.h"\n')
    (ops / "fam" / "other.cuh").write_text("// not included\n")
    monkeypatch.setattr(build, "OPERATORS", ops.resolve())
    src = '#include "fam/kernel.cuh"\n'
    assert [p.name for p in build.project_headers(src)] == ["abi.h", "kernel.cuh"]
    key = build.kernel_key(src, "sm_89", "13.0")
    (ops / "fam" / "other.cuh").write_text("// edited\n")
    assert build.kernel_key(src, "sm_89", "13.0") == key
    (ops / "common" / "abi.h").write_text("// abi, edited\n")
    assert build.kernel_key(src, "sm_89", "13.0") != key


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("target", ["sm_89", "sm_90a"])
def test_real_compiles_of_the_attention_kernel(target):
    """CUTLASS example 41's forward kernel, instantiated from a spec, builds for sm_89 and sm_90a
    from the wheel's headers (with our cuRAND stand-in where the toolkit lacks cuRAND); example
    88's Hopper kernel for sm_90a."""
    from cvt_cutlass.operators.attention import Attn88Spec, AttnSpec

    specs = [AttnSpec("bf16", 64, 64, 64)]
    if target == "sm_90a":  # example 88 (TMA + wgmma) exists only there
        specs.append(Attn88Spec("fp16", (64, 128, 64), "tma"))
    build_and_check(specs, target, lambda s: 4, "attn")
