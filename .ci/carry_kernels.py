"""Build here, without a GPU, the kernels a device session will load, and pack them (with the
cache index) into .carry/cache.tgz for the device tool's `carry` (.ci/gpu-session unpacks it).

    python .ci/carry_kernels.py [--modules test_layer,test_linear:scale] [--model cvt-13] [--dtype bf16]
                                [--max-batch 128] [--residual-stream fp32] [--path sm90,sm89] [--gpus "NVIDIA H200,NVIDIA H100 80GB HBM3"] [--jobs 2]
                                [--binding] [--kernels NAME,...]

The kernels: the model's training set (every batch size up to --max-batch) for each GPU name
(selection tables are per GPU), plus what the named GPU test modules load (tests/gpu_kernels.py),
all for sm_90, and the kernels --kernels names. Run with CVT_CUTLASS_CACHE pointing at the
repository's .cache/cvt_cutlass.
--binding builds the torch binding for the installed torch too and packs it (on the device: the
next call loads it instead of compiling it again, ~45 s; a binding for another torch or other
sources is never loaded, its cache key differs). A module named MODULE:TEXT adds only its kernels
whose name contains TEXT. Only the current build of each kernel is packed (older builds in the
cache stay behind: the device returns ~17 MiB at most).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from itertools import chain
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def specs_for(a) -> list:
    sys.path.insert(0, str(ROOT))
    from cvt_cutlass.api import model_kernels
    from tests.gpu_kernels import suite_specs, unique

    gpus = a.gpus.split(",")
    model = (s for gpu in gpus if a.model for dt in a.dtype.split(",") for path in a.path.split(",")
             for s in model_kernels(a.model, 224, dt, 89 if path == "sm89" else 90, training=True, gpu=gpu,
                                    max_batch=a.max_batch, residual_stream=a.residual_stream))
    tests = (s for gpu in gpus for mod, _, text in (m.partition(":") for m in a.modules.split(",") if m)
             for s in suite_specs(90, gpu, [mod]) if text in s.name)
    from cvt_cutlass.operators.spec import parse_kernel_name

    named = (parse_kernel_name(n) for n in a.kernels.split(",") if n)
    return unique(chain(model, tests, named))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modules", default="", help="GPU test modules whose kernels to add, e.g. test_layer,test_backward")
    p.add_argument("--model", default="cvt-13", help="the model whose training kernels to add ('': none)")
    p.add_argument("--dtype", default="bf16", help="comma-separated: bf16,fp16")
    p.add_argument("--max-batch", type=int, default=128)
    p.add_argument("--residual-stream", default="fp32", choices=("fp32", "compute"),
                   help="fp32 (swap's default): the model's fp32-residual-stream variants too; compute: without them")
    p.add_argument("--path", default="sm90",
                   help="the model's kernel paths, comma-separated: sm90, sm89 (= the SM80-class kernels, built "
                        "for the sm_90 GPU: bench --path sm89 on an H100 / H200)")
    p.add_argument("--kernels", default="", help="more kernels by name (e.g. a sweep's candidates), comma-separated")
    p.add_argument("--gpus", default="NVIDIA H200,NVIDIA H100 80GB HBM3")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--binding", action="store_true", help="also build and pack the torch binding for this torch")
    a = p.parse_args()
    if not set(a.path.split(",")) <= {"sm90", "sm89"}:
        p.error(f"--path: sm90 and / or sm89, comma-separated, not {a.path!r}")
    cache = Path(os.environ.get("CVT_CUTLASS_CACHE", ROOT / ".cache" / "cvt_cutlass"))
    if cache.resolve() != (ROOT / ".cache" / "cvt_cutlass").resolve():
        print(f"carry_kernels: CVT_CUTLASS_CACHE={cache} is not {ROOT / '.cache/cvt_cutlass'}, which "
              ".ci/gpu-session unpacks: set it so", file=sys.stderr)
        return 2
    from cvt_cutlass import runtime

    specs = specs_for(a)
    t0 = time.time()
    jobs = runtime.plan(specs, 90)
    runtime.prebuild(specs, 90, jobs=a.jobs, planned=jobs)
    print(f"carry_kernels: {len(specs)} kernels ready ({time.time() - t0:.0f} s)", flush=True)
    rel = lambda p: str(p.resolve().relative_to(ROOT))  # noqa: E731
    parts = sorted({rel(j.dir) for j in jobs}) + [".cache/cvt_cutlass/index"]
    if a.binding:
        from cvt_cutlass import build

        runtime.ensure_binding()
        parts.append(rel(build.binding_library().parent))
    (ROOT / ".carry").mkdir(exist_ok=True)
    subprocess.run(["tar", "czf", ".carry/cache.tgz", *parts], cwd=ROOT, check=True)
    size = (ROOT / ".carry" / "cache.tgz").stat().st_size / 2**20
    print(f"carry_kernels: .carry/cache.tgz {size:.1f} MiB (the device tool carries 64 MiB in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
