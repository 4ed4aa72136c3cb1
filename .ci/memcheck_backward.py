"""One call of each backward kernel (dgrad, dgrad + dGELU + dbias, dgrad times a saved GELU' + dbias
and the forward that saves it, wgrad + db, LayerNorm backward,
attention backward, the depthwise conv + BatchNorm training forward and backward at stride 1
and 2 with a cls row; on sm_90 also the SM90 stream-K wgrad with and without db, split-K and
stream-K, and the Hopper attention backward next to example 41's; the q / k / v library of a
layer with dx summed; the LayerNorm backward with residual and further gradients) on small ragged
shapes, for `compute-sanitizer --tool memcheck` and `--tool racecheck` (the gpu-session's memcheck
step). Kernels must already be built (the GPU tests build them); strict mode: a fallback raises."""
import torch

from cvt_cutlass import fallback
from cvt_cutlass.ops.dwconv import dwconv_bn_backward, dwconv_bn_train
from cvt_cutlass.ops.layernorm import layer_norm_tokens_backward
from cvt_cutlass.ops.linear import linear_dgrad, linear_wgrad

fallback.set_strict(True)
dt = torch.bfloat16
g, w, z = (torch.randn(*s, device="cuda", dtype=dt) for s in ((1000, 72), (72, 40), (1000, 40)))
linear_dgrad(g, w)
linear_dgrad(g, w, z)
linear_dgrad(g, w, gelu_grad=z.half())
torch.ops.cvt_cutlass_C.linear_gelu_dgelu(z, torch.randn(72, 40, device="cuda", dtype=dt),
                                          torch.randn(72, device="cuda", dtype=dt))
linear_wgrad(g, z, True)
x = torch.randn(3, 7, 1024, device="cuda", dtype=dt)
layer_norm_tokens_backward(x + 1, x, torch.rand(1024, device="cuda", dtype=dt), 1e-5)
for stride in (1, 2):  # ragged: 72 channels (one group per block), 7 x 9 pixels, a cls row
    xt = torch.randn(3, 1 + 63, 72, device="cuda", dtype=dt)
    wt, gamma, beta = torch.randn(3, 3, 72, device="cuda"), torch.rand(72, device="cuda") + 0.5, torch.randn(72, device="cuda")
    rm, rv = torch.zeros(72, device="cuda"), torch.ones(72, device="cuda")
    y, mean, invstd = dwconv_bn_train(xt, wt, gamma, beta, rm, rv, 0.1, 1e-5, 7, 9, stride, 1)
    dwconv_bn_backward(torch.randn_like(y), xt, wt, gamma, mean, invstd, 7, 9, stride, 1)
# The q / k / v library of a layer (q at stride 1, k and v at 2, a cls row, dx summed into one) and
# the LayerNorm backward with a residual gradient and a further output gradient (rows staged in
# shared memory by cp.async)
qkv_w = [[torch.randn(3, 3, 72, device="cuda"), torch.rand(72, device="cuda") + 0.5, torch.randn(72, device="cuda")]
         for _ in range(3)]
run = [t for _ in range(3) for t in (torch.zeros(72, device="cuda"), torch.ones(72, device="cuda"))]
xt = torch.randn(3, 1 + 63, 72, device="cuda", dtype=dt)
out = torch.ops.cvt_cutlass_C.dwconv_bn_train_qkv(xt, *([p[i] for p in qkv_w] for i in range(3)), run, [0.1] * 3,
                                                 [1e-5] * 3, 7, 9, 1, 2, 1)
torch.ops.cvt_cutlass_C.dwconv_bn_backward_qkv(xt, [torch.randn_like(out[3 * i]) for i in range(3)],
                                               [p[0] for p in qkv_w], [p[1] for p in qkv_w], out[1::3], out[2::3],
                                               7, 9, 1, 2, 1, True)
layer_norm_tokens_backward(x + 1, x, torch.rand(1024, device="cuda", dtype=dt), 1e-5, torch.randn_like(x),
                           (torch.randn_like(x),))
if torch.cuda.get_device_capability() == (9, 0):
    from cvt_cutlass.operators.linear import LinearWgradSpec

    from cvt_cutlass import runtime

    for waves in (0, 1):
        kid = runtime.load_kernel(LinearWgradSpec(90, "bf16", (128, 128, 64), waves=waves), 90)
        for db in (torch.empty(72, device="cuda", dtype=dt), None):
            torch.ops.cvt_cutlass_C.wgrad(kid, g, z, torch.empty(72, 40, device="cuda", dtype=dt), db)
# Attention backward, odd lengths (Lq, Lkv not tile multiples), the path's default kernel, then
# example 41's backward on both paths by name.
from cvt_cutlass.operators.attention import AttnBwdSpec  # noqa: E402

from cvt_cutlass import runtime  # noqa: E402
from cvt_cutlass.ops.attention import attention, attention_backward  # noqa: E402

q = torch.randn(2, 197, 6, 64, device="cuda", dtype=dt)
kv = torch.randn(2, 50, 2 * 6 * 64, device="cuda", dtype=dt)
k, v = kv[..., :384].view(2, 50, 6, 64), kv[..., 384:].view(2, 50, 6, 64)
o, lse = attention(q, k, v, 0.05)
attention_backward(o, q, k, v, o, lse, 0.05)
attention_backward(o, q, k, v, o, lse, 0.05, torch.randn(lse.shape, device="cuda"))
kid = runtime.load_kernel(AttnBwdSpec("bf16"), torch.cuda.get_device_capability()[0] * 10)
grads = [torch.empty_like(t) for t in (q, k, v)]
torch.ops.cvt_cutlass_C.attention_backward(kid, o, q, k, v, o, lse, *grads, 0.05)
torch.cuda.synchronize()
print("memcheck calls done:", fallback.stats()["kernel_calls"])
