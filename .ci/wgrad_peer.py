"""The Linear weight gradients of a CvT-13 training step alone, ours (``linear_wgrad``: the selected
kernel, its row-sum and column-sum passes) against PyTorch's (``dY^T @ X`` on cuBLAS, plus
``dY.sum(0)`` where the bias gradient is asked for), at the stage shapes of batch 128 by default,
bf16: each side's kernels by name with their device time per call (torch profiler, 20 calls after
warm-up, random inputs), so that cuBLAS's kernel names (tile, cluster, split) stand beside ours.
--kernels times named weight-gradient kernels (sweep candidates, by the kernel-name grammar) on
each problem too; a kernel whose dW is not within 1e-2 of the float32 product is reported, not timed.
--ncu launches each side (and each named kernel) twice per problem, untimed, for Nsight Compute.
Usage: python .ci/wgrad_peer.py [batch] [--only q,fc1,...] [--kernels NAME,...] [--ncu]"""

from __future__ import annotations

import argparse
import sys

import torch
from dwbn_qkv import kernels, print_table  # (this folder: the profiler's per-kernel device time)

# name: (tokens an image, dY columns (out features), X columns (in features), bias gradient)
PROBLEMS = {
    "s1.q": (3136, 64, 64, True), "s1.fc1": (3136, 256, 64, False), "s1.fc2": (3136, 64, 256, True),
    "s2.q": (784, 192, 192, True), "s2.kv": (196, 192, 192, True), "s2.fc1": (784, 768, 192, False),
    "s2.fc2": (784, 192, 768, True),
    "s3.q": (197, 384, 384, True), "s3.kv": (50, 384, 384, True), "s3.fc1": (197, 1536, 384, False),
    "s3.fc2": (197, 384, 1536, True),
}


def sides(b: int, tokens: int, n: int, k: int, bias: bool):
    from cvt_cutlass.ops.linear import linear_wgrad

    g = torch.Generator(device="cuda").manual_seed(n * k + tokens)
    dy = torch.randn(b * tokens, n, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(b * tokens, k, device="cuda", generator=g).to(torch.bfloat16)

    def torch_side():
        dw = dy.t() @ x
        return (dw, dy.sum(0)) if bias else dw

    return (lambda: linear_wgrad(dy, x, bias)), torch_side, 2.0 * b * tokens * n * k


def timed(fn, n: int, ncu: bool) -> dict[str, float]:
    """Device us per call of each kernel of fn (the profiler), or, for ncu, fn run twice untimed."""
    if not ncu:
        return kernels(fn, n)
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    return {}


def named_kernels(names: list[str], b: int, tokens: int, n: int, k: int, bias: bool,
                  ncu: bool = False) -> list[tuple[str, float, float, dict[str, float]]]:
    """(name, device us, dW's relative error, us per launched kernel) of each named wgrad kernel on
    one problem (its raw launch: the GEMM and its row / column passes); kernels that cannot serve
    it or whose dW is wrong are reported and left out."""
    from cvt_cutlass.operators.spec import parse_kernel_name

    from cvt_cutlass import runtime

    g = torch.Generator(device="cuda").manual_seed(n * k + tokens)
    dy = torch.randn(b * tokens, n, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(b * tokens, k, device="cuda", generator=g).to(torch.bfloat16)
    ref = dy.float().t() @ x.float()
    dw = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    db = torch.empty(n, device="cuda", dtype=torch.bfloat16) if bias else None
    out = []
    for name in names:
        kid = runtime.load_kernel(parse_kernel_name(name), runtime.device_info(0).cc)
        launch = lambda kid=kid: torch.ops.cvt_cutlass_C.wgrad(kid, dy, x, dw, db)  # noqa: E731
        try:
            launch()
        except RuntimeError as e:
            print(f"  {name}: cannot serve ({str(e).splitlines()[0][:120]})")
            continue
        err = float((dw.float() - ref).norm() / ref.norm())
        if err > 1e-2:
            print(f"  {name}: dW relative error {err:.1e} against the float32 product: not timed")
            continue
        us = timed(launch, 20, ncu)
        out.append((name, sum(us.values()), err, us))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="CvT-13's weight gradients, ours against cuBLAS")
    ap.add_argument("batch", nargs="?", type=int, default=128)
    ap.add_argument("--only", default="", help="problem names, comma-separated (default: all)")
    ap.add_argument("--kernels", default="", help="wgrad kernel names to time on each problem too, comma-separated")
    ap.add_argument("--ncu", action="store_true", help="launch each side twice per problem, untimed (for ncu)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("wgrad_peer.py: needs a CUDA GPU (the library's kernels)")
    print(f"device: {torch.cuda.get_device_name()}, batch {a.batch}, bf16")
    names = [n for n in PROBLEMS if not a.only or n in a.only.split(",")]
    table = []
    for name in names:
        ours, peer, flop = sides(a.batch, *PROBLEMS[name])
        got = {}
        for side, fn in (("ours", ours), ("torch", peer)):
            us = timed(fn, 20, a.ncu)
            got[side] = sum(us.values())
            for k, v in sorted(us.items(), key=lambda kv: -kv[1]):
                print(f"  {name} {side} {v:8.1f} us  {k[:150]}")
        table.append((name, got["ours"], got["torch"], flop))
        for kname, us, err, parts in named_kernels([x for x in a.kernels.split(",") if x], a.batch,
                                                  *PROBLEMS[name], a.ncu):
            print(f"  {name} named {us:8.1f} us  rel err {err:.1e}  {kname}")
            for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
                print(f"    {v:8.1f} us  {k[:150]}")
            table.append((f"{name} {kname.split('_nt_')[-1]}", us, got["torch"], flop))
    if a.ncu:
        return
    print_table(["problem", "ours us", "torch us", "ours / torch", "ours TFLOP/s"],
                [[name, f"{o:.1f}", f"{t:.1f}", f"{o / t:.2f}", f"{flop / o / 1e6:.0f}"] for name, o, t, flop in table])


if __name__ == "__main__":
    main()
