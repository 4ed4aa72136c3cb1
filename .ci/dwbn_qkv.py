"""The depthwise q / k / v + BatchNorm library of a CvT layer alone (the layer op's path:
``dwconv_bn_train_qkv`` forward, ``dwconv_bn_backward_qkv`` backward with dx summed), at CvT-13's
stage shapes, batch 128 by default, bf16: per stage, ms per forward and per backward (CUDA events,
medians of 50 after warm-up, random inputs), a digest of each pass's output bits (two builds
compared bit for bit), then each kernel's device time per call (torch profiler). --ncu: per
stage the forward twice (the first gives the backward its inputs) and the backward once, nothing
timed, for Nsight Compute (`ncu -k regex:bn_ python .ci/dwbn_qkv.py --ncu`). The rates printed
are x's bytes over the kernel's time (what every pass reads at least).
Usage: python .ci/dwbn_qkv.py [batch] [--stages 1,2,3] [--ncu]"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch

from cvt_cutlass.tools.timing import median_event_ms

STAGES = {1: (56, 56, 64, 0), 2: (28, 28, 192, 0), 3: (14, 14, 384, 1)}  # h, w, c, cls rows
EPS = 1e-5


def inputs(b: int, h: int, w: int, c: int, cls: int, dt: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(c)
    x = (torch.randn(b, cls + h * w, c, device="cuda", generator=g) * 2 + 0.5).to(dt)
    ps = [((torch.randn(3, 3, c, device="cuda", generator=g) / 3), 1 + 0.2 * torch.randn(c, device="cuda", generator=g),
           0.2 * torch.randn(c, device="cuda", generator=g)) for _ in range(3)]
    run = [t for _ in range(3) for t in (torch.zeros(c, device="cuda"), torch.ones(c, device="cuda"))]
    return x, ps, run


def calls(b: int, stage: int, dt: torch.dtype):
    """(forward, backward) closures of one layer's q / k / v library at the stage's shapes."""
    h, w, c, cls = STAGES[stage]
    x, ps, run = inputs(b, h, w, c, cls, dt)
    qkv = torch.ops.cvt_cutlass_C.dwconv_bn_train_qkv
    out = qkv(x, [p[0] for p in ps], [p[1] for p in ps], [p[2] for p in ps], run, [0.1] * 3, [EPS] * 3, h, w, 1, 2, cls)
    # (torch's default CUDA generator gave other numbers in another process: a seeded one)
    g = torch.Generator(device="cuda").manual_seed(c + 1)
    gy = [torch.randn(out[3 * i].shape, device="cuda", generator=g).to(dt) for i in range(3)]
    stats = [(out[3 * i + 1], out[3 * i + 2]) for i in range(3)]

    def fwd():
        return qkv(x, [p[0] for p in ps], [p[1] for p in ps], [p[2] for p in ps], run, [0.1] * 3, [EPS] * 3, h, w, 1,
                   2, cls)

    def bwd():
        return torch.ops.cvt_cutlass_C.dwconv_bn_backward_qkv(
            x, gy, [p[0] for p in ps], [p[1] for p in ps], [s[0] for s in stats], [s[1] for s in stats], h, w, 1, 2,
            cls, True)
    bwd.inputs = gy + [t for s in stats for t in s]  # (their digest: two processes' backward inputs compared)
    return fwd, bwd, x.numel() * x.element_size()


def digest(outs) -> str:
    """A short hash of the bits of a pass's tensors (None entries skipped)."""
    h = hashlib.sha1()
    for t in outs:
        if isinstance(t, torch.Tensor):
            h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:12]


def print_table(head: list[str], rows: list[list[str]]) -> None:
    """A markdown table: the header, its rule, the rows."""
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


def kernels(fn, n: int = 10) -> dict[str, float]:
    """Device us per call of each kernel fn launches (torch profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    got: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0:
            name = e.key.split("(")[0].replace("void ", "").split("<")[0]
            got[name] = got.get(name, 0.0) + e.self_device_time_total / n
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description="the depthwise q / k / v + BatchNorm library alone")
    ap.add_argument("batch", nargs="?", type=int, default=128)
    ap.add_argument("--stages", default="1,2,3", help="CvT-13 stages, comma-separated")
    ap.add_argument("--ncu", action="store_true", help="run each pass once per stage, untimed (for ncu)")
    a = ap.parse_args()
    b, stages = a.batch, [int(s) for s in a.stages.split(",")]
    if not torch.cuda.is_available():
        sys.exit("dwbn_qkv.py: needs a CUDA GPU (the library's kernels)")
    import cvt_cutlass.ops  # noqa: F401  (loads the binding)

    dt = torch.bfloat16
    print(f"device: {torch.cuda.get_device_name()}, batch {b}, bf16")
    rows = []
    for s in stages:
        fwd, bwd, xbytes = calls(b, s, dt)
        if a.ncu:
            fwd()
            bwd()
            torch.cuda.synchronize()
            continue
        rows.append((s, median_event_ms(fwd, 50, 5), median_event_ms(bwd, 50, 5), xbytes))
        print(f"  stage {s}  outputs: forward {digest(fwd())}, backward {digest(bwd())}")
        first, again = bwd(), bwd()
        print(f"  stage {s}  backward by output (its dy {digest(bwd.inputs)}): " + " ".join(
            f"{i}:{digest([t])}" + ("" if digest([t]) == digest([u]) else "(differs in the next call)")
            for i, (t, u) in enumerate(zip(first, again, strict=True))))
        for name, us in sorted({**kernels(fwd), **{f"{k} (bwd)": v for k, v in kernels(bwd).items()}}.items(),
                               key=lambda kv: -kv[1]):
            print(f"  stage {s}  {us:8.1f} us  {name}  (x {xbytes / us / 1e6:.2f} TB/s)")
    if rows:
        print_table(["stage", "fwd ms", "bwd ms", "x MB"],
                    [[str(s), f"{f:.4f}", f"{bw:.4f}", f"{xb / 1e6:.1f}"] for s, f, bw, xb in rows])


if __name__ == "__main__":
    main()
