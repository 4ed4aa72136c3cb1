"""Spec -> CUDA C++ source. Works with no GPU.

A kernel's source is its spec's instantiation of the family's real headers under ``operators/``
(:meth:`cvt_cutlass.operators.spec.KernelSpec.instantiation`): one small, self-contained
translation unit that includes no torch header and exports the plain-C ABI of
``operators/common/abi.h``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from .build import OPERATORS, project_headers


def kernel_source(spec) -> str:
    """The complete .cu source of one kernel instantiation (any op family)."""
    return spec.instantiation()


def write_sources(specs: Iterable, out_dir: str | Path) -> list[Path]:
    """Write ``<name>.cu`` for each spec into ``out_dir``, with the headers of ours they include
    under the same relative paths, so ``nvcc -I <out_dir> -I <CUTLASS include> ...`` compiles each
    one (the CUTLASS example kernels also need their example's directory, see the spec's
    ``include_dirs``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths, headers = [], set()
    for spec in specs:
        src = kernel_source(spec)
        path = out / f"{spec.name}.cu"
        path.write_text(src)
        paths.append(path)
        headers.update(project_headers(src, tuple(spec.include_dirs)))
    for h in sorted(headers):
        dst = out / h.relative_to(OPERATORS)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(h, dst)
    return paths
