"""Host cost of a training step through one op, C++ autograd formula vs a Python one (A/B, same
process, same kernels): forward + autograd.grad on tiny shapes (GPU time negligible), timed over
many back-to-back calls (perf_counter, one synchronize at the end, median of 7 repeats), next to
PyTorch's own op. The Python variant wraps the same public ops in a torch.autograd.Function whose
backward calls the same backward ops: what the ops ran before their formulas moved to C++."""
import statistics
import time

import torch
import torch.nn.functional as F

from cvt_cutlass.ops.layernorm import layer_norm_tokens
from cvt_cutlass.ops.linear import linear, mlp

ops = torch.ops.cvt_cutlass


class PyLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return ops.layer_norm_tokens(x, w, b, 1e-5)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return (*ops.layer_norm_tokens_backward(g, x, w, 1e-5),)


class PyLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return ops.linear(x, w, b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx = ops.linear_dgrad(g, w)[0]
        dw, db = ops.linear_wgrad(g, x, True)
        return dx, dw, db


class PyMlp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):
        y, h, z = ops.mlp(x, w1, b1, w2, b2)
        ctx.save_for_backward(x, w1, w2, h, z)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w1, w2, h, z = ctx.saved_tensors
        dw2, db2 = ops.linear_wgrad(g, h, True)
        dz, db1 = ops.linear_dgrad(g, w2, z)
        dw1 = ops.linear_wgrad(dz, x, False)[0]
        dx = ops.linear_dgrad(dz, w1)[0]
        return dx, dw1, db1, dw2, db2


def host_us(fn, leaves, n=300):
    g = torch.randn_like(fn(*leaves))

    def once():
        torch.autograd.grad(fn(*leaves), leaves, g)
    for _ in range(30):
        once()
    torch.cuda.synchronize()
    reps = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n):
            once()
        torch.cuda.synchronize()
        reps.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(reps)


def main():
    dt = torch.bfloat16
    r = lambda *s: torch.randn(*s, device="cuda", dtype=dt).requires_grad_()  # noqa: E731
    c, h = 64, 256
    ln = [r(2, 16, c), r(c), r(c)]
    lin = [r(32, c), r(c, c), r(c)]
    ml = [r(32, c), r(h, c), r(h), r(c, h), r(c)]
    rows = [
        ("layer_norm_tokens", ln, lambda x, w, b: layer_norm_tokens(x, w, b, 1e-5), PyLayerNorm.apply,
         lambda x, w, b: F.layer_norm(x, (c,), w, b, 1e-5)),
        ("linear", lin, linear, PyLinear.apply, F.linear),
        ("mlp", ml, mlp, PyMlp.apply, lambda x, w1, b1, w2, b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)),
    ]
    from cvt_cutlass import fallback

    fallback.set_strict(True)  # every call on the kernels
    print("| op (fwd + autograd.grad, tiny) | C++ formula us | Python formula us | torch us |")
    print("|---|---|---|---|")
    for name, leaves, cpp, py, peer in rows:
        a, b, t = host_us(cpp, leaves), host_us(py, leaves), host_us(peer, leaves)
        print(f"| {name} | {a:.1f} | {b:.1f} | {t:.1f} |", flush=True)


if __name__ == "__main__":
    main()
