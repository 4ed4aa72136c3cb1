"""The LayerNorm backward alone (``layer_norm_tokens_backward``, the kernel the layer op and the
embeddings call) at CvT-13's stage shapes, batch 128 by default, bf16 weights, in the dtype
layouts a training step runs: ``16-bit`` (x, dy and the residual gradient in bf16: the 16-bit
stream), ``fp32 stream`` (fp32 x and residual gradient, bf16 dy: a layer's LayerNorm on HF's
autocast stream), ``fp32 x, 16-bit res`` (a stage's last layer before the next embedding) and
``embedding`` (bf16 x, fp32 dy, no residual: an embedding's LayerNorm that starts the fp32
stream). Per case: each kernel's device time per call (torch profiler, 20 calls after warm-up,
random inputs of fixed seeds), a digest of its outputs' bits (equal digests across runs of two
builds: the same dx, dweight and dbias bit for bit) and the dx kernel's rate: the bytes it must
move (x, dy and the residual gradient read, dx written) over its time; a device-to-device copy
of the same byte count beside it, as the ceiling this GPU reaches.
Usage: python .ci/ln_bwd.py [batch] [--stages 1,2,3]"""

from __future__ import annotations

import argparse
import sys

import torch
from dwbn_qkv import digest, kernels, print_table  # (this folder: per-kernel device time, output digests)

STAGES = {1: (3136, 64), 2: (784, 192), 3: (197, 384)}  # tokens an image, channels
CASES = {  # name: (x dtype, dy dtype, residual dtype or None)
    "16-bit": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "fp32 stream": (torch.float32, torch.bfloat16, torch.float32),
    "fp32 x, 16-bit res": (torch.float32, torch.bfloat16, torch.bfloat16),
    "embedding": (torch.bfloat16, torch.float32, None),
}


def case(b: int, rows: int, c: int, xd, dyd, resd):
    """(the backward's closure, the bytes its dx kernel moves)."""
    from cvt_cutlass.ops.layernorm import layer_norm_tokens_backward

    g = torch.Generator(device="cuda").manual_seed(rows + c)
    x = (torch.randn(b, rows, c, device="cuda", generator=g) * 1.5 + 0.3).to(xd)
    dy = torch.randn(b, rows, c, device="cuda", generator=g).to(dyd)
    w = (1 + 0.1 * torch.randn(c, device="cuda", generator=g)).to(torch.bfloat16)
    res = None if resd is None else torch.randn(b, rows, c, device="cuda", generator=g).to(resd)
    moved = sum(t.numel() * t.element_size() for t in (x, dy, res) if t is not None) + x.numel() * x.element_size()
    return (lambda: layer_norm_tokens_backward(dy, x, w, 1e-5, res)), moved


def copy_us(nbytes: int) -> float:
    """Device us of one device-to-device copy moving ``nbytes`` (half read, half written)."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    o = torch.empty_like(a)
    return sum(kernels(lambda: o.copy_(a), 20).values())


def main() -> None:
    ap = argparse.ArgumentParser(description="the LayerNorm backward alone at CvT-13's stage shapes")
    ap.add_argument("batch", nargs="?", type=int, default=128)
    ap.add_argument("--stages", default="1,2,3", help="CvT-13 stages, comma-separated")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ln_bwd.py: needs a CUDA GPU (the library's kernels)")
    print(f"device: {torch.cuda.get_device_name()}, batch {a.batch}, bf16 weights")
    table = []
    for s in (int(v) for v in a.stages.split(",")):
        rows, c = STAGES[s]
        for name, dts in CASES.items():
            fn, moved = case(a.batch, rows, c, *dts)
            us = kernels(fn, 20)
            dx_us = sum(v for k, v in us.items() if "ln_bwd" in k)
            rest = sum(v for k, v in us.items() if "ln_bwd" not in k)
            table.append((s, name, dx_us, rest, moved, copy_us(moved)))
            times = ", ".join(f"{k} {v:.1f} us" for k, v in us.items())
            print(f"  stage {s} {name}: outputs {digest(fn())}; {times}", flush=True)
    print_table(["stage", "case", "dx kernel us", "column sums us", "MB moved", "TB/s", "copy of as many bytes, TB/s"],
                [[str(s), name, f"{dx_us:.1f}", f"{rest:.1f}", f"{moved / 1e6:.1f}", f"{moved / dx_us / 1e6:.2f}",
                  f"{moved / cp / 1e6:.2f}"] for s, name, dx_us, rest, moved, cp in table])


if __name__ == "__main__":
    main()
