"""The short-key attention kernels (AttnShortSpec forward, AttnShortBwdSpec backward at both CTA
budgets) by name on ragged shapes: Lq off the 64-row blocks (197 = 196 tokens + the cls row, 65,
1), Lkv 50 / 63 / 64, head dims 64 and 32, packed k / v views; for `compute-sanitizer --tool
memcheck|racecheck|synccheck` (the gpu-session's attn-sanitize step). With --stage3-b128, CvT-13's
stage 3 at batch 128 instead (B 128, H 6, Lq 197, Lkv 50): one launch of each, for Nsight Compute
(the attn-ncu step). Kernels must already be built."""
import sys

import torch
from cvt_cutlass.operators.attention import AttnShortBwdSpec, AttnShortSpec

from cvt_cutlass import runtime
from cvt_cutlass.ops.attention import new_lse

dt = torch.bfloat16
cc = 90 if torch.cuda.get_device_capability()[0] == 9 else 89
fwd = runtime.load_kernel(AttnShortSpec("bf16"), cc)
bwd = [runtime.load_kernel(AttnShortBwdSpec("bf16", blocks), cc) for blocks in (2, 3)]
calls = 0
shapes = ((128, 6, 197, 50, 64),) if "--stage3-b128" in sys.argv else (
    (2, 6, 197, 50, 64), (1, 2, 65, 63, 32), (2, 3, 1, 64, 64))
for b, h, lq, lkv, d in shapes:
    q = torch.randn(b, lq, h, d, device="cuda", dtype=dt)
    kv = torch.randn(b, lkv, 2 * h * d, device="cuda", dtype=dt)
    k, v = kv[..., : h * d].view(b, lkv, h, d), kv[..., h * d:].view(b, lkv, h, d)
    o, lse = torch.empty_like(q), new_lse(q, b, h, lq)
    torch.ops.cvt_cutlass_C.attention(fwd, q, k, v, o, lse, 0.1)
    for kid in bwd:
        grads = [torch.empty_like(t) for t in (q, k, v)]
        torch.ops.cvt_cutlass_C.attention_backward(kid, torch.randn_like(o), q, k, v, o, lse, *grads, 0.1)
    calls += 1 + len(bwd)
torch.cuda.synchronize()
print("sanitize calls done:", calls)
