"""The swapped CvT's training steps and inference forward, bit for bit, under the process's
CVT_CUTLASS_PDL setting (the kernel libraries read it once per process: run this once per setting
and compare the digests it prints). Deterministic mode (torch.use_deterministic_algorithms: every
backward kernel of ours in its ordered form), bf16 autocast, SGD with momentum, the stages' CUDA
graphs on (the first step runs eagerly, the second captures, the third replays); then the eval
forward at batch 1 and 32. Equal digests with PDL on and off are the same bits from both launch
modes on this run; a race that needs a narrower timing window than these shapes give would not
show (the layout test checks the waits themselves: every PDL-launched kernel begins with one).
Usage: python .ci/pdl_bits.py [model, default cvt-13] [batch, default 32] [steps, default 4]"""

from __future__ import annotations

import copy
import hashlib
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cvt_cutlass import fallback  # noqa: E402
from cvt_cutlass.checkpoint import random_cvt  # noqa: E402
from cvt_cutlass.swap import swap  # noqa: E402


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "cvt-13"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    torch.use_deterministic_algorithms(True)
    base = random_cvt(name)
    model = swap(copy.deepcopy(base).cuda().train())
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, 3, 224, 224, device="cuda", generator=gen)
    y = torch.randint(0, 1000, (batch,), device="cuda", generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    fallback.reset()
    for i in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).logits.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grads = digest(p.grad for p in model.parameters() if p.grad is not None)
        opt.step()
        print(f"step {i}: loss {loss.item():.6f}, gradients {grads}", flush=True)
    print(f"parameters after {steps} steps: {digest(model.parameters())}; "
          f"BatchNorm buffers: {digest(model.buffers())}")
    model.eval()
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        for b in (1, 32):
            outs = [model(x[:b]).logits for _ in range(3)]
            print(f"eval forward, batch {b}: logits {digest(outs[-1:])} (three calls equal: "
                  f"{all(torch.equal(o, outs[0]) for o in outs)})")
    print(f"fallbacks: {fallback.stats()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
