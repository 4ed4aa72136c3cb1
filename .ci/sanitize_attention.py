"""Our attention kernels by name on ragged shapes, for `compute-sanitizer --tool
memcheck|racecheck|synccheck` (the gpu-session's attn-sanitize step) and Nsight Compute (attn-ncu).
Kernels must already be built.

    python .ci/sanitize_attention.py [--short | --wgmma] [--stage3-b128 | --stage1-b32] [--deterministic]

--short (the default): the short-key kernels (AttnShortSpec forward, AttnShortBwdSpec backward at
both CTA budgets): Lq off the 64-row blocks (197 = 196 tokens + the cls row, 65, 1), Lkv 50 / 63 /
64, head dims 64 and 32, packed k / v views. --wgmma: the Hopper backward (AttnWgmmaBwdSpec,
sm_90 only) after example 88's forward: Lq 197 / 65 / 1 / 130, Lkv 145 / 130 / 7 / 256 (partial
and whole 128-key blocks, a warpgroup with no key). --stage3-b128 / --stage1-b32: CvT-13's stage 3 at batch
128 (B 128, H 6, Lq 197, Lkv 50) or stage 1 at batch 32 (B 32, H 1, Lq 3136, Lkv 784) instead:
one launch of each kernel, for Nsight Compute. --deterministic: each backward launched a second
time under torch.use_deterministic_algorithms(True) (the wgmma kernel's ordered dq sums)."""
import sys

import torch
from cvt_cutlass.operators.attention import Attn88Spec, AttnShortBwdSpec, AttnShortSpec, AttnWgmmaBwdSpec

from cvt_cutlass import runtime
from cvt_cutlass.ops.attention import new_lse

dt = torch.bfloat16
cc = 90 if torch.cuda.get_device_capability()[0] == 9 else 89
if "--wgmma" in sys.argv:
    fwd = runtime.load_kernel(Attn88Spec("bf16", (64, 128, 64)), cc)
    bwd = [runtime.load_kernel(AttnWgmmaBwdSpec("bf16"), cc)]
    shapes = ((2, 2, 197, 145, 64), (1, 3, 65, 130, 64), (2, 1, 1, 7, 64), (1, 2, 130, 256, 64))
else:
    fwd = runtime.load_kernel(AttnShortSpec("bf16"), cc)
    bwd = [runtime.load_kernel(AttnShortBwdSpec("bf16", blocks), cc) for blocks in (2, 3)]
    shapes = ((2, 6, 197, 50, 64), (1, 2, 65, 63, 32), (2, 3, 1, 64, 64))
if "--stage3-b128" in sys.argv:
    shapes = ((128, 6, 197, 50, 64),)
if "--stage1-b32" in sys.argv:
    shapes = ((32, 1, 3136, 784, 64),)
calls = 0
for b, h, lq, lkv, d in shapes:
    q = torch.randn(b, lq, h, d, device="cuda", dtype=dt)
    kv = torch.randn(b, lkv, 2 * h * d, device="cuda", dtype=dt)
    k, v = kv[..., : h * d].view(b, lkv, h, d), kv[..., h * d:].view(b, lkv, h, d)
    o, lse = torch.empty_like(q), new_lse(q, b, h, lq)
    torch.ops.cvt_cutlass_C.attention(fwd, q, k, v, o, lse, 0.1)
    for kid in bwd:
        for det in (False, True) if "--deterministic" in sys.argv else (False,):
            torch.use_deterministic_algorithms(det)
            grads = [torch.empty_like(t) for t in (q, k, v)]
            torch.ops.cvt_cutlass_C.attention_backward(kid, torch.randn_like(o), q, k, v, o, lse, *grads, 0.1)
            torch.use_deterministic_algorithms(False)
            calls += 1
    calls += 1
torch.cuda.synchronize()
print("sanitize calls done:", calls)
