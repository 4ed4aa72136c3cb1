"""``cvt-cutlass bench --op backward``: the GEMM family's and LayerNorm's backward on CUTLASS vs
torch autograd (cuBLAS / PyTorch's LayerNorm backward), same process, CvT-13 shapes.

Rows (pass column ``bwd``): stage-1 qkv (Linear + bias: dX, dW, db); each stage's MLP backward
(fc2, GELU', fc1: dX, dW1, db1, dW2, db2 and the residual's gradient), which is fc1 + fc2 of
the issue's per-layer table taken together, since our GELU' lives in fc2's dgrad epilogue; and
LayerNorm backward (dX, dgamma, dbeta). Timed with CUDA events over CUDA-graph replays of
``torch.autograd.grad`` launched back to back (both sides the same way; autograd runs on the forward's stream, so it is not captured in a CUDA graph), medians of 15, random inputs; bytes and FLOPs
as the math needs them (GB/s for LayerNorm, TFLOP/s for the GEMMs).
"""

from __future__ import annotations

import math

from .. import fallback, runtime
from ..csvfile import append_csv
from .timing import time_cuda

STAGES = {1: (3136, 64), 2: (784, 192), 3: (197, 384)}  # tokens per image (+ cls), channels (CvT-13)


def _cases(batch: int):
    for st, (tokens, c) in STAGES.items():
        yield ("linear", f"s{st}.qkv", batch * tokens, c, c) if st == 1 else None
        yield ("mlp", f"s{st}.mlp", batch * tokens, c, 4 * c)
        yield ("layernorm", f"s{st}.ln", batch, tokens, c)


def _inputs(torch, op, a, b, c, dt):
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s, scale=1.0):
        return (scale * torch.randn(*s, device="cuda", generator=g)).to(dt).requires_grad_()

    if op == "linear":
        return [r(a, c), r(b, c, scale=1 / math.sqrt(c)), r(b)], r(a, b).detach()
    if op == "mlp":
        return [r(a, b), r(c, b, scale=1 / math.sqrt(b)), r(c), r(b, c, scale=1 / math.sqrt(c)), r(b), r(a, b)], \
            r(a, b).detach()
    return [r(a, b, c), (1 + 0.1 * r(c)).detach().requires_grad_(), r(c)], r(a, b, c).detach()


def _fns(torch, op):
    import torch.nn.functional as F

    from ..ops.layernorm import layer_norm_tokens
    from ..ops.linear import linear, mlp

    if op == "linear":
        return (lambda x, w, b: linear(x, w, b)), (lambda x, w, b: F.linear(x, w, b))
    if op == "mlp":
        return mlp, (lambda x, w1, b1, w2, b2, r: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2) + r)
    return (lambda x, w, b: layer_norm_tokens(x, w, b, 1e-5)), \
        (lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5))


def _work(op, a, b, c, dt_bytes):
    """(FLOPs, bytes) of the backward."""
    if op == "linear":
        return 4 * a * b * c, dt_bytes * (2 * a * b + 2 * a * c)
    if op == "mlp":
        return 8 * a * b * c, dt_bytes * (4 * a * b + 5 * a * c)
    return 0, dt_bytes * 3 * a * b * c


def _time_backward(torch, fn, leaves, g):
    out = fn(*leaves)
    return time_cuda(lambda i: torch.autograd.grad(out, leaves, g, retain_graph=True), graph=False).median_ms


def bench_main(a) -> int:
    import torch

    if not torch.cuda.is_available():
        print("cvt-cutlass bench --op backward needs a CUDA GPU")
        return 2
    runtime.ensure_binding()
    dts = {"fp16": torch.float16, "bf16": torch.bfloat16}
    rows = []
    hdr = f"{'op':10} {'case':8} {'dtype':5} {'pass':4} {'torch ms':>9} {'cutlass ms':>10} {'ratio':>6} {'rate':>14}"
    print(hdr)
    with runtime.kernel_path(a.path):
        for batch in a.batch:
            for dtype in a.dtype:
                for case in filter(None, _cases(batch)):
                    rows.append(_one(torch, case, dtype, dts[dtype], batch))
    if a.out:
        append_csv(a.out, rows, list(rows[0]))
    return 0


def _one(torch, case, dtype, dt, batch):
    op, label, x, y, z = case
    leaves, g = _inputs(torch, op, x, y, z, dt)
    ours_fn, torch_fn = _fns(torch, op)
    fallback.reset()
    t_torch = _time_backward(torch, torch_fn, leaves, g)
    t_ours = _time_backward(torch, ours_fn, leaves, g)
    fb = fallback.stats()["fallbacks"]
    flops, nbytes = _work(op, x, y, z, 2)
    rate = f"{flops / t_ours / 1e9:.0f} TFLOP/s" if flops else f"{nbytes / t_ours / 1e6:.0f} GB/s"
    print(f"{op:10} {label:8} {dtype:5} {'bwd':4} {t_torch:9.3f} {t_ours:10.3f} {t_torch / t_ours:6.2f}x {rate:>14}"
          + (f"  FALLBACKS {fb}" if fb else ""), flush=True)
    return {"op": op, "case": label, "batch": batch, "dtype": dtype, "pass": "bwd", "m": x, "n": y, "k": z,
            "torch_ms": f"{t_torch:.4f}", "cutlass_ms": f"{t_ours:.4f}", "speedup": f"{t_torch / t_ours:.3f}",
            "rate": rate, "fallbacks": sum(fb.values()), "gpu": torch.cuda.get_device_name()}
