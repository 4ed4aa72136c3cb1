"""Every kernel the GPU tests will load, enumerated without a GPU, so that they can be prebuilt.

The GPU tests select their kernels lazily: the first op call of a problem builds its kernel with
nvcc (30-45 s for an sm_90a one), so an empty cache made a GPU box compile ~100 kernels one
after the other. Selection is a pure function of (problem, dtype, arch, GPU name), so each GPU
test module says which kernels its tests select (``gpu_kernel_specs(cc, gpu)``, from the same
case generators as its parametrisations) and :func:`suite_specs` unions them. conftest builds
that union in parallel before the first test; from the repository root,

    python -m tests.gpu_kernels --cc 90 --gpu "NVIDIA H200" --list --build

lists it and warms this machine's kernel cache for such a device (nvcc needs no GPU). Tests that
set no kernel path count under the current one (CVT_CUTLASS_KERNEL_PATH, else auto), as they
will run in the same environment; importing the test modules loads the torch binding.

The helpers below mirror each op's planner (``_plan`` / ``_select`` in cvt_cutlass/ops/<op>.py):
the problem it passes to its select function, and the inputs it sends to the PyTorch fallback
instead (those need no kernel). Where a test's choice depends on what only the run knows, the
enumeration takes a superset: a kernel too many costs build time once, one too few a lazy build.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections import Counter
from collections.abc import Iterable

import pytest
from cvt_cutlass.operators.attention import select_attention
from cvt_cutlass.operators.conv2d import conv_window, select_conv2d, stem_channels
from cvt_cutlass.operators.dwconv import select_dwconv
from cvt_cutlass.operators.layernorm import channels_supported, select_layernorm
from cvt_cutlass.operators.linear import select_linear

from cvt_cutlass import runtime

MODULES = ("tests.test_linear", "tests.test_conv", "tests.test_attention", "tests.test_layernorm",
           "tests.test_swap", "tests.test_selection", "tests.test_backward", "tests.test_conv_backward",
           "tests.test_dwconv_bn", "tests.test_layer", "tests.test_train_step",
           "tests.test_stage_graphs")  # each has gpu_kernel_specs,
# or an entry in _HELD_HERE
FAMILIES = ("linear", "conv2d", "dwconv", "attention", "layernorm")
KERNEL_DTYPES = ("fp16", "bf16")  # what ops/common.py DTYPES runs on kernels (fp32: the fallback)


# ----------------------------------------------------------------------------- model problems
def model_cases(problems_of, sizes, batches) -> list:
    """pytest params (id ``<model>-<size>-b<batch>-<label>``) of the problems
    ``problems_of(model, batch, size)`` of CvT-13, CvT-21 (at 224 only: at other sizes its problems
    are CvT-13's) and CvT-W24 at each size and batch; odd (H, W) sizes only at batches up to 3."""
    cases = []
    for model in ("cvt-13", "cvt-21", "cvt-w24"):
        for size in sizes:
            if model == "cvt-21" and size != 224:
                continue
            for batch in batches:
                if isinstance(size, tuple) and batch > 3:
                    continue
                cases += [pytest.param(p, id=f"{model}-{size}-b{batch}-{p.label}")
                          for p in problems_of(model, batch, size)]
    return cases


# ----------------------------------------------------------------------------- kernel paths
def gpu_paths(cc: int | None) -> list[str]:
    """The kernel paths the GPU tests run on a device of compute capability ``cc``: sm89's
    instantiations everywhere, sm90's too on 9.0; both when there is no GPU (collection only)."""
    return [p for p in ("sm90", "sm89") if cc is None or cc == 90 or p == "sm89"]


def path_arch(path: str, cc: int) -> int | None:
    """The kernel arch a test running under ``kernel_path(path)`` gets on ``cc`` (the runtime's
    own rule, read without a device: arch_for takes the capability as its argument)."""
    with runtime.kernel_path(path):
        return runtime.arch_for(cc)


def path_archs(cc: int) -> list[int]:
    """The archs of every path the path-parametrised GPU tests run on ``cc``."""
    return sorted({path_arch(p, cc) for p in gpu_paths(cc)})


def default_arch(cc: int) -> int | None:
    """The arch of a test that sets no path: the current one (CVT_CUTLASS_KERNEL_PATH, else
    auto), as that test will see it when run in this environment. A forced sm90 on another
    device fails those tests anyway; count them under auto then."""
    try:
        return runtime.arch_for(cc)
    except RuntimeError:
        return path_arch("auto", cc)


# ----------------------------------------------------------------------------- per op: planner mirrors
def linear_spec(m: int, n: int, k: int, dtype: str, epilogue: str | None, arch: int, gpu: str | None,
                residual: str = ""):
    """ops/linear.py: m = rows of x, (n, k) = the weight's shape; ``residual`` "f32" for an fp32
    residual. No kernel for fp32, N or K not a multiple of 8, an epilogue without a kernel (None);
    nothing to launch for m or n = 0."""
    if dtype not in KERNEL_DTYPES or epilogue is None or n % 8 or k % 8 or m == 0 or n == 0:
        return None
    return select_linear(m, n, k, dtype, epilogue, arch, gpu, residual).spec


def conv2d_spec(layer, dtype: str, arch: int, gpu: str | None):
    """ops/conv2d.py for a ConvLayer (operators/conv2d/problems.py) of kind "embed" whose input the caller prepared with
    stem_channels(c) channels (tests and swap both do): m = N*P*Q, n = K, k = R*S*C. No kernel
    when K is not a multiple of 8."""
    c = stem_channels(layer.c)
    m = layer.n * layer.p * layer.q
    if dtype not in KERNEL_DTYPES or layer.k % 8 or m * layer.k == 0:
        return None
    window = conv_window(c, layer.k, layer.r, layer.r, layer.w, layer.stride, layer.pad)
    return select_conv2d(m, layer.k, layer.r * layer.r * c, c, dtype, arch, gpu, window).spec


def dwconv_spec(layer, dtype: str, arch: int, gpu: str | None):
    """ops/dwconv.py for a ConvLayer (operators/conv2d/problems.py) of kind "dwconv": m = B*P*Q. Kernels exist for 3x3
    filters, strides 1 and 2, channels a multiple of 8."""
    m = layer.n * layer.p * layer.q
    if dtype not in KERNEL_DTYPES or layer.r != 3 or layer.stride not in (1, 2) or layer.c % 8:
        return None
    if layer.n * (layer.cls + layer.p * layer.q) * layer.c == 0:
        return None
    return select_dwconv(m, layer.c, layer.stride, dtype, arch, gpu).spec


def attention_spec(batch: int, heads: int, lq: int, lkv: int, head_dim: int, dtype: str, arch: int,
                   gpu: str | None):
    """ops/attention.py: (batch, heads, Lq, Lkv, head dim); head dims are multiples of 8 up to 256."""
    if dtype not in KERNEL_DTYPES or head_dim % 8 or head_dim > 256 or batch * lq * heads * head_dim == 0:
        return None
    return select_attention(batch, heads, lq, lkv, head_dim, dtype, arch, gpu).spec


def attention_bwd_spec(batch: int, heads: int, lq: int, lkv: int, head_dim: int, dtype: str, arch: int,
                       gpu: str | None):
    """ops/attention.py attention_backward: head dims are multiples of 8 up to 128."""
    if dtype not in KERNEL_DTYPES or head_dim % 8 or head_dim > 128 or batch * lq * heads * head_dim == 0:
        return None
    return select_attention(batch, heads, lq, lkv, head_dim, dtype, arch, gpu, "bwd").spec


def layernorm_spec(rows: int, channels: int, dtype: str, arch: int, gpu: str | None, pass_: str = "fwd",
                   io: str = ""):
    """ops/layernorm.py: rows = B*L of every image, ``channels`` supported by some kernel; ``io``
    the fp32 side of an fp32 residual stream."""
    if dtype not in KERNEL_DTYPES or not channels_supported(channels) or rows == 0:
        return None
    return select_layernorm(rows, channels, dtype, arch, gpu, pass_, io).spec


def unique(specs: Iterable) -> list:
    """Specs deduplicated by name (first wins), without the Nones of fallen-back problems."""
    out: dict[str, object] = {}
    for s in specs:
        if s is not None:
            out.setdefault(s.name, s)
    return list(out.values())


# ----------------------------------------------------------------------------- the suite
def _selection_sweep_specs(cc: int, gpu: str | None) -> list:
    """test_selection.py's test_tiny_sweep_end_to_end_gpu (a module this one does not edit): its
    two monkeypatched fc1 candidates and the refinement of each (whichever wins: both)."""
    from cvt_cutlass.operators.linear import heuristic_spec

    arch = 90 if cc == 90 else 89
    first = heuristic_spec(3136, 256, 64, "fp16", "bias_gelu", arch)
    second = (first.with_(schedule="pingpong", tile=(64, 64, 64)) if arch == 90
              else first.with_(tile=(64, 64, 32), stages=5))
    refine = (lambda s: s.with_(raster="m")) if arch == 90 else (lambda s: s.with_(swizzle=2))
    return [first, second, refine(first), refine(second)]


_HELD_HERE = {"tests.test_selection": _selection_sweep_specs}


def module_specs(name: str, cc: int, gpu: str | None) -> list:
    """One test module's GPU kernels: its own gpu_kernel_specs, or the enumeration held here.
    A module that skips at import (test_swap without transformers) runs no GPU test."""
    if name in _HELD_HERE:
        return _HELD_HERE[name](cc, gpu)
    try:
        mod = importlib.import_module(name)
    except pytest.skip.Exception:
        return []
    return mod.gpu_kernel_specs(cc, gpu)


def suite_specs(cc: int, gpu: str | None, modules: Iterable[str] | None = None) -> list:
    """Every kernel spec the GPU tests of ``modules`` (default: all) load on a device of compute
    capability ``cc`` named ``gpu``, every kernel path included; deduplicated by name."""
    if cc < 80:
        return []  # the GPU tests need sm_80; older devices run everything on PyTorch
    # "tests.test_conv" or "test_conv": however the caller (pytest's import mode) named it
    short = None if modules is None else {m.rsplit(".", 1)[-1] for m in modules}
    wanted = [m for m in MODULES if short is None or m.rsplit(".", 1)[-1] in short]
    return unique(s for name in wanted for s in module_specs(name, cc, gpu))


def family_counts(specs: Iterable) -> dict[str, int]:
    """{op family: how many specs}, in FAMILIES order, for the summary line."""
    c = Counter(s.op for s in specs)
    return {f: c[f] for f in (*FAMILIES, *sorted(set(c) - set(FAMILIES))) if c[f]}


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring): count, list and/or build the suite's kernels."""
    p = argparse.ArgumentParser(prog="python -m tests.gpu_kernels", description=__doc__.splitlines()[0])
    p.add_argument("--cc", type=int, required=True, help="compute capability, e.g. 90 (H100/H200) or 89")
    p.add_argument("--gpu", default=None, help='device name as torch reports it, e.g. "NVIDIA H200"')
    p.add_argument("--list", action="store_true", help="print every kernel name")
    p.add_argument("--build", action="store_true", help="build the missing ones here (parallel nvcc)")
    p.add_argument("--jobs", type=int, default=None, help="parallel nvcc jobs (default: per CPU and memory)")
    p.add_argument("--modules", default=None, help="only these test modules' kernels, e.g. test_linear,test_swap")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    specs = suite_specs(a.cc, a.gpu, a.modules.split(",") if a.modules else None)
    dt = time.perf_counter() - t0
    if a.list:
        for s in sorted(specs, key=lambda s: (s.op, s.name)):
            print(s.name)
    per = ", ".join(f"{f} {n}" for f, n in family_counts(specs).items())
    archs = ", ".join(f"arch {a_} {n}" for a_, n in sorted(Counter(s.arch for s in specs).items()))
    print(f"{len(specs)} kernels for sm_{a.cc} {a.gpu or '(no GPU name)'} ({per}; {archs}); "
          f"enumerated in {dt:.1f} s")
    if a.build:
        runtime.prebuild(specs, a.cc, jobs=a.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
