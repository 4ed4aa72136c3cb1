"""Spec -> CUDA C++ source. Works with no GPU.

The kernel type and the launcher come from the op family's template (``cvt_cutlass.operators``);
the epilogue's fusion callbacks come from cutlass_cppgen tracing the EVT function
(``cvt_cutlass.epilogues``). Each kernel is one self-contained translation unit that includes
no torch header and exports the plain-C ABI of ``csrc/cvt_kernel_abi.h``.
"""

from __future__ import annotations

import shutil
import string
from collections.abc import Iterable
from pathlib import Path

from .epilogues import get_linear_epilogue
from .epilogues.packing import trace_linear_epilogue
from .operators.linear import CUTLASS_ELEMENT, LinearSpec

CSRC = Path(__file__).resolve().parent / "csrc"
ABI_HEADER = CSRC / "cvt_kernel_abi.h"


def kernel_source(spec) -> str:
    """The complete .cu source of one kernel instantiation (any op family)."""
    if not isinstance(spec, LinearSpec):
        return spec.source()  # conv families: no traced epilogue, the template is the whole kernel
    epi = get_linear_epilogue(spec.epilogue, spec.pass_)
    traced = trace_linear_epilogue(epi, spec.dtype, spec.arch)
    values = spec.template_values()
    values.update(
        epilogue=spec.epilogue,
        description=f"{spec.op}: {epi.doc}; {spec.dtype}; fp32 accumulation",
        fusion_decl=traced.fusion_decl,
        fusion_callbacks=traced.fusion_callbacks,
        fusion_args=traced.fusion_args,
        element_c=CUTLASS_ELEMENT[spec.dtype] if traced.reads_c else "void",
        epilogue_stages=str(traced.epilogue_stages),
        reduces_bias="true" if epi.reduces else "false",
    )
    return string.Template(spec.template()).substitute(values)


def write_sources(specs: Iterable, out_dir: str | Path) -> list[Path]:
    """Write ``<name>.cu`` for each spec (and the ABI header they include) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for h in sorted(CSRC.glob("cvt_*_abi.h")):
        shutil.copyfile(h, out / h.name)
    paths = []
    for spec in specs:
        path = out / f"{spec.name}.cu"
        path.write_text(kernel_source(spec))
        paths.append(path)
    return paths
