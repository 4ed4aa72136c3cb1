"""Shared fixtures. The same files hold CPU tests (CI) and GPU tests (skipped without CUDA)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch


def _cuda_cc() -> int | None:
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


CUDA_CC = _cuda_cc()
HAS_NVCC = shutil.which("nvcc") is not None or shutil.which("/usr/local/cuda/bin/nvcc") is not None

requires_cuda = pytest.mark.skipif(CUDA_CC is None, reason="needs a CUDA GPU")
requires_sm80 = pytest.mark.skipif(CUDA_CC is None or CUDA_CC < 80, reason="needs a GPU of sm_80 or newer")
requires_sm90 = pytest.mark.skipif(CUDA_CC != 90, reason="needs an sm_90 GPU (H100/H200)")
requires_nvcc = pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")


def _paths() -> list[str]:
    from .gpu_kernels import gpu_paths

    return gpu_paths(CUDA_CC)


PATHS = _paths()  # the kernel paths the GPU tests run on this machine (sm90 and / or sm89)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}  # the kernels' dtypes


def _nvcc_found() -> bool:
    """Whether the runtime can find nvcc (its own search: CVT_CUTLASS_NVCC, CUDACXX, CUDA_HOME, PATH)."""
    from cvt_cutlass import build

    try:
        build.find_nvcc()
    except build.NvccNotFoundError:
        return False
    return True


def prebuild_enabled() -> bool:
    """Prebuild the GPU tests' kernels: only with a CUDA device and nvcc (CPU CI builds nothing),
    unless CVT_CUTLASS_TEST_PREBUILD=0 (e.g. one test on a cold cache: its kernels build lazily)."""
    if CUDA_CC is None or os.environ.get("CVT_CUTLASS_TEST_PREBUILD", "1").strip() == "0":
        return False
    return _nvcc_found()


def prebuild_filter() -> tuple[str, ...]:
    """CVT_CUTLASS_TEST_PREBUILD=names:TEXT[,TEXT...]: prebuild only the selected modules' kernels
    whose names contain one of the texts (the module's other kernels, if a selected test loads
    them, build lazily): for a -k selection of a few tests in a module of a hundred kernels."""
    value = os.environ.get("CVT_CUTLASS_TEST_PREBUILD", "").strip()
    if not value.startswith("names:"):
        return ()
    texts = tuple(t for t in value.removeprefix("names:").split(",") if t)
    if not texts:
        raise ValueError("CVT_CUTLASS_TEST_PREBUILD=names: takes one or more texts, e.g. names:gelu,rf32")
    return texts


def named_in_selection(specs: list, nodeids: list[str], keyword: str) -> list:
    """Under a -k selection (keyword), the specs whose names the selected tests' ids carry (tests
    parametrized by kernel name), when any do; otherwise all of them. A selected test that loads
    a kernel its id does not name builds it lazily."""
    if not keyword:
        return specs
    ids = "\n".join(nodeids)
    named = [s for s in specs if s.name in ids]
    return named or specs


@pytest.fixture(scope="session", autouse=True)
def prebuilt_kernels(request):
    """Build every kernel the selected GPU tests will load, in parallel (slowest first, with a
    progress bar; cached ones cost nothing), before the first test: lazily, each would compile
    inside its first op call, one after the other (30-45 s each for sm_90a). Only the modules of
    the selected tests count, and under -k the kernels the selected tests' ids name, if any. A
    kernel that fails to build is left to its tests, which then fail with the build log; the rest
    of the suite runs. Returns the specs (empty when skipped)."""
    if not prebuild_enabled():
        return []
    import torch

    from cvt_cutlass import build, runtime

    from .gpu_kernels import suite_specs

    modules = {item.module.__name__ for item in request.session.items if getattr(item, "module", None)}
    specs = suite_specs(CUDA_CC, torch.cuda.get_device_name(), modules)
    specs = named_in_selection(specs, [item.nodeid for item in request.session.items],
                               request.config.getoption("keyword", ""))
    texts = prebuild_filter()
    if texts:
        specs = [s for s in specs if any(t in s.name for t in texts)]
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():  # show the bar
        try:
            runtime.prebuild(specs, CUDA_CC)
        except build.KernelBuildError as e:
            warnings.warn(f"prebuilding the GPU tests' kernels: {e}", stacklevel=1)
    return specs


@pytest.fixture
def strict_fallbacks():
    """Any fallback to PyTorch raises: proves the call ran on a CUTLASS kernel."""
    from cvt_cutlass import fallback

    fallback.set_strict(True)
    fallback.reset()
    yield
    fallback.set_strict(None)


@pytest.fixture
def counted_fallbacks():
    from cvt_cutlass import fallback

    fallback.set_strict(False)
    fallback.reset()
    yield fallback
    fallback.set_strict(None)
    fallback.reset()


@pytest.fixture
def loaded_kernels(monkeypatch) -> set[str]:
    """The names of the kernels the test loads (every op plans again: the plans are cleared first)."""
    from cvt_cutlass import runtime

    loaded: set[str] = set()
    real = runtime.load_kernel
    monkeypatch.setattr(runtime, "load_kernel", lambda spec, cc: loaded.add(spec.name) or real(spec, cc))
    runtime.clear_plans()
    return loaded


def graph_replayed(fn):
    """Capture ``fn()`` in a CUDA graph on a side stream, fill its outputs with NaN and replay the
    graph: the outputs as the replay wrote them (a launch that escaped the capture, or one that
    reads outside it, shows as NaN or as a mismatch with an eager call)."""
    torch.cuda.synchronize()
    graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        out = fn()
    torch.cuda.current_stream().wait_stream(s)
    for t in out if isinstance(out, (tuple, list)) else (out,):
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return out


# What a CUDA kernel definition looks like, kept as test data (tests/data/) rather than in a Python
# string: the layout test checks that no Python file holds one.
KERNEL_DEFINITION = re.compile((Path(__file__).parent / "data" / "cuda_kernel_definition.regex").read_text().strip())


def no_kernel_body(src: str) -> bool:
    """An emitted kernel source is an instantiation of its family's headers (operators/<family>/*.cuh):
    it defines no CUDA kernel of its own."""
    return KERNEL_DEFINITION.search(src) is None



@pytest.fixture(autouse=True)
def _stage_graphs(request):
    """The fused stages' CUDA graphs (on by default for users) are off in tests, which count the
    kernel calls of each call (a replay counts none); a test module with STAGE_GRAPHS = True
    (tests/test_stage_graphs.py) runs them on."""
    from cvt_cutlass.graphs import using_stage_graphs

    with using_stage_graphs(True if getattr(request.module, "STAGE_GRAPHS", False) else False):
        yield
