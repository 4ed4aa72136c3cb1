"""The stem's row-window conv kernels (ConvRowsSpec forward, ConvRowsWgradSpec weight gradient) by
name on ragged shapes, for `compute-sanitizer --tool memcheck|racecheck|synccheck` (the
gpu-session's conv-sanitize step). Kernels must already be built.

    python .ci/sanitize_conv_rows.py

Shapes (N, H, W, K) of a 7 x 7 / 4 / 2 conv of 4 channels: rows of 56, 12 and 4 pixels (one
m-tile short of 64, several, one), one and two channel blocks; the wgrad with 1, 5 and the
automatic count of CTAs, with and without db."""
import torch
from cvt_cutlass.operators.conv2d import ConvRowsSpec, ConvRowsWgradSpec

from cvt_cutlass import runtime

dt = torch.bfloat16
cc = 90 if torch.cuda.get_device_capability()[0] == 9 else 89
fwd = [runtime.load_kernel(ConvRowsSpec("bf16", 7, st), cc) for st in (2, 3)]
wgrad = [runtime.load_kernel(ConvRowsWgradSpec("bf16", 7, st), cc) for st in (2, 3)]
calls = 0
for n, h, w, k in ((2, 224, 224, 64), (3, 45, 48, 128), (1, 13, 16, 64)):
    p, q = (h + 4 - 7) // 4 + 1, (w + 4 - 7) // 4 + 1
    x = torch.randn(n, h, w, 4, device="cuda", dtype=dt)
    wt = torch.randn(k, 7, 7, 4, device="cuda", dtype=dt)
    b = torch.randn(k, device="cuda", dtype=dt)
    dy = torch.randn(n, p, q, k, device="cuda", dtype=dt)
    for kid in fwd:
        y = torch.empty(n, p, q, k, device="cuda", dtype=dt)
        torch.ops.cvt_cutlass_C.conv2d(kid, x, wt, b, y, [2, 2], [4, 4], 0)
        calls += 1
    for kid in wgrad:
        for splits in (1, 5, 0):
            dw, db = torch.empty_like(wt), torch.empty(k, device="cuda", dtype=dt)
            torch.ops.cvt_cutlass_C.conv2d_bwd(kid, dy, x, wt, None, dw, db if splits else None, 2, 4, splits)
            calls += 1
torch.cuda.synchronize()
print("sanitize calls done:", calls)
