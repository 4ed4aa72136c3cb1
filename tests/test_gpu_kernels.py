"""tests/gpu_kernels.py on CPU: the GPU suite's kernels enumerate without a GPU, name by name.

The enumeration feeds conftest's prebuild (and ``python -m tests.gpu_kernels --build``); a spec
that does not round-trip through its name, a missing op family or arch, or an sm_90a kernel
offered to another device would turn into lazy builds or build errors on the GPU box only.
"""

from __future__ import annotations

import pytest
from cvt_cutlass.operators.spec import parse_kernel_name

from cvt_cutlass import runtime

from . import conftest
from .gpu_kernels import FAMILIES, gpu_paths, main, suite_specs


def test_h200_suite_covers_every_family_and_both_archs():
    specs = suite_specs(90, "NVIDIA H200")
    names = [s.name for s in specs]
    assert specs and len(set(names)) == len(names)
    for s in specs:
        assert parse_kernel_name(s.name) == s
    assert {s.op for s in specs} == set(FAMILIES)
    assert {s.arch for s in specs} == {89, 90}


def test_other_devices_get_no_sm90_kernels():
    """An RTX 4090 runs the sm89 path only; a pre-Ampere GPU runs nothing on kernels."""
    specs = suite_specs(89, "NVIDIA GeForce RTX 4090")
    assert specs and {s.arch for s in specs} == {89} and {s.op for s in specs} == set(FAMILIES)
    assert suite_specs(75, "Tesla T4") == []
    assert gpu_paths(90) == ["sm90", "sm89"] and gpu_paths(89) == ["sm89"] and gpu_paths(None) == ["sm90", "sm89"]


def test_modules_restrict_the_set():
    """conftest passes the selected tests' modules (pytest's names or bare ones)."""
    conv = suite_specs(90, "NVIDIA H200", ["tests.test_conv"])
    assert conv and {s.op for s in conv} <= {"conv2d", "dwconv"}
    assert {s.name for s in suite_specs(90, "NVIDIA H200", ["test_conv"])} == {s.name for s in conv}
    assert suite_specs(90, "NVIDIA H200", []) == []


def test_paths_are_restored():
    """Enumerating switches kernel paths to read each one's arch; the caller's path survives."""
    with runtime.kernel_path("sm89"):
        suite_specs(90, "NVIDIA H200", ["tests.test_layernorm"])
        assert runtime.get_kernel_path() == "sm89"


def test_command_line_lists_and_counts(capsys):
    assert main(["--cc", "89", "--gpu", "NVIDIA GeForce RTX 4090", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    n = len(suite_specs(89, "NVIDIA GeForce RTX 4090"))
    assert len(lines) == n + 1 and lines[-1].startswith(f"{n} kernels for sm_89 NVIDIA GeForce RTX 4090 (linear ")
    assert all(ln.startswith("cvt_") for ln in lines[:-1])


def test_prebuild_name_filter(monkeypatch):
    """CVT_CUTLASS_TEST_PREBUILD=names:a,b prebuilds only kernels whose names contain a or b;
    other values filter nothing; an empty list is refused."""
    monkeypatch.setenv("CVT_CUTLASS_TEST_PREBUILD", "names:gelu,rf32")
    assert conftest.prebuild_filter() == ("gelu", "rf32")
    monkeypatch.setenv("CVT_CUTLASS_TEST_PREBUILD", "1")
    assert conftest.prebuild_filter() == ()
    monkeypatch.setenv("CVT_CUTLASS_TEST_PREBUILD", "names:")
    with pytest.raises(ValueError, match="one or more texts"):
        conftest.prebuild_filter()


def test_prebuild_under_a_keyword_selection_takes_the_kernels_its_tests_name():
    """-k narrows the prebuild to the kernels named in the selected tests' ids; a selection whose
    ids name none (or no -k) keeps every kernel of the selected modules."""
    specs = suite_specs(90, "NVIDIA H200", ["test_backward"])[:3]
    ids = [f"tests/test_backward.py::test_x_gpu[{specs[1].name}]", "tests/test_backward.py::test_y"]
    assert conftest.named_in_selection(specs, ids, "x_gpu") == [specs[1]]
    assert conftest.named_in_selection(specs, ids, "") == specs
    assert conftest.named_in_selection(specs, ["tests/test_backward.py::test_y"], "test_y") == specs


def test_prebuild_opt_out(monkeypatch):
    """CVT_CUTLASS_TEST_PREBUILD=0 turns the session prebuild off; without a GPU it is off anyway."""
    monkeypatch.setenv("CVT_CUTLASS_TEST_PREBUILD", "0")
    assert not conftest.prebuild_enabled()
    if conftest.CUDA_CC is None:
        monkeypatch.delenv("CVT_CUTLASS_TEST_PREBUILD")
        assert not conftest.prebuild_enabled()
