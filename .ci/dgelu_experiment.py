"""Where the MLP's fused dgrad spends its time (run B6): raw launches of fc2's dgrad on CvT-13's
MLP shapes at batch 128 (bf16), same tile and schedule, three epilogues: none (plain GEMM),
dgelu (GELU' at Z read as C), dgelu_dbias (+ fc1's dbias row reduction); and fc1's wgrad with and
without its db (SM80-class operand reduction vs SM90 stream-K + row-sum pass). CUDA-event medians.
Usage: python .ci/dgelu_experiment.py [--ncu] (the --ncu run launches the s3 kernels once each)."""
import sys

import torch
from cvt_cutlass.operators.linear import LinearSpec
from cvt_cutlass.operators.linear_wgrad import LinearWgradSpec

from cvt_cutlass import runtime
from cvt_cutlass.bench.timing import time_cuda

TILE = dict(tile=(128, 256, 64), epi_tile=(128, 64))
SHAPES = {"s1": (401408, 64), "s2": (100352, 192), "s3": (25216, 384)}
dt = torch.bfloat16


def specs():
    d = {e: LinearSpec(90, "bf16", e, pass_="dgrad", **TILE) for e in ("none", "dgelu", "dgelu_dbias")}
    w = {"kred_k4": LinearWgradSpec(89, "bf16", (64, 128, 32), stages=4, waves=4),
         "rsum_k0": LinearWgradSpec(90, "bf16", (128, 128, 64), waves=0)}
    return d, w


def main(ncu: bool) -> None:
    d, w = specs()
    runtime.prebuild([*d.values(), *w.values()], 90)
    runtime.ensure_binding()
    ids = {k: runtime.load_kernel(s, 90) for k, s in {**d, **w}.items()}
    print("| stage | kernel | ms |")
    print("|---|---|---|")
    for st, (m, c) in SHAPES.items():
        if ncu and st != "s3":
            continue
        h = 4 * c
        g = torch.randn(m, c, device="cuda", dtype=dt)
        w2 = torch.randn(c, h, device="cuda", dtype=dt) * c ** -0.5
        z = torch.randn(m, h, device="cuda", dtype=dt)
        x = torch.randn(m, c, device="cuda", dtype=dt)
        dz = torch.empty(m, h, device="cuda", dtype=dt)
        db = torch.empty(h, device="cuda", dtype=dt)
        dw = torch.empty(h, c, device="cuda", dtype=dt)
        runs = {
            "dgrad none": lambda i: torch.ops.cvt_cutlass_C.dgrad(ids["none"], g, w2, None, dz, None),
            "dgrad dgelu": lambda i: torch.ops.cvt_cutlass_C.dgrad(ids["dgelu"], g, w2, z, dz, None),
            "dgrad dgelu_dbias": lambda i: torch.ops.cvt_cutlass_C.dgrad(ids["dgelu_dbias"], g, w2, z, dz, db),
            "wgrad1 kred +db": lambda i: torch.ops.cvt_cutlass_C.wgrad(ids["kred_k4"], dz, x, dw, db),
            "wgrad1 kred": lambda i: torch.ops.cvt_cutlass_C.wgrad(ids["kred_k4"], dz, x, dw, None),
            "wgrad1 rsum +db": lambda i: torch.ops.cvt_cutlass_C.wgrad(ids["rsum_k0"], dz, x, dw, db),
            "wgrad1 rsum": lambda i: torch.ops.cvt_cutlass_C.wgrad(ids["rsum_k0"], dz, x, dw, None),
            "torch dz.sum(0)": lambda i: dz.sum(0),
        }
        for name, fn in runs.items():
            if ncu:
                fn(0)
                continue
            print(f"| {st} | {name} | {time_cuda(fn).median_ms:.4f} |", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main("--ncu" in sys.argv)
