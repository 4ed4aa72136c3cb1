"""What keeping a CvT's residual stream, or only its gradient, in bf16 would do to the gradients
under bf16 autocast: HF's model on the CPU, CvtLayer's two residual sums rounded to bf16 where a
16-bit stream would round them, against HF in float64 (same weights, images and labels, drop path
off). Modes:

* autocast: HF's own autocast step (its residual stream and LayerNorms in fp32);
* grad16: the forward stream in fp32, its gradient rounded to bf16 at each layer's two residual
  sums (the values a LayerNorm backward writing a 16-bit stream gradient would hand on);
* fwd16: the forward sums rounded to bf16, the gradient in fp32;
* both16: both rounded (close to, not the same as, swap(residual_stream="compute"), whose
  LayerNorms also read 16-bit inputs).

Prints per mode the whole-gradient relative error and, over tensors whose reference norm is not ~0,
the median / max per-tensor error ratio against HF autocast's and how many exceed 1.5x.
Usage: python .ci/grad_stream_emulation.py [model, default cvt-13] [batch, default 8] [seed, default 0]."""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F
import transformers.models.cvt.modeling_cvt as modeling

from cvt_cutlass.checkpoint import random_cvt
from cvt_cutlass.tools.bench.train import agreement_row, agreement_summary

MODE = {"grad": False, "fwd": False}
MODES = {"autocast": (False, False), "grad16": (True, False), "fwd16": (False, True), "both16": (True, True)}


class _Round(torch.autograd.Function):
    """Identity, with the value (MODE['fwd']) and / or the gradient (MODE['grad']) rounded to bf16."""

    @staticmethod
    def forward(ctx, x):
        return x.to(torch.bfloat16).to(x.dtype) if MODE["fwd"] else x.clone()

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.bfloat16).to(g.dtype) if MODE["grad"] else g


def _round32(x):
    return _Round.apply(x) if x.dtype == torch.float32 else x


def _layer_forward(self, hidden_state, height, width):
    """CvtLayer.forward with its two residual sums passed through _Round (fp32 ones: not the float64 reference)."""
    attention = self.attention(self.layernorm_before(hidden_state), height, width)
    hidden_state = _round32(self.drop_path(attention) + hidden_state)
    out = self.output(self.intermediate(self.layernorm_after(hidden_state)), hidden_state)
    return _round32(self.drop_path(out))


def _grads(model, x, y, autocast: bool) -> dict:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = F.cross_entropy(model(pixel_values=x).logits.float(), y)
    loss.backward()
    return {n: p.grad.double().clone() for n, p in model.named_parameters()}


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "cvt-13"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    modeling.CvtLayer.forward = _layer_forward
    ref = random_cvt(name).train()
    for m in ref.modules():
        if hasattr(m, "drop_prob"):
            m.drop_prob = 0.0
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(batch, 3, 224, 224, generator=gen), torch.randint(0, 1000, (batch,), generator=gen)
    want = _grads(copy.deepcopy(ref).double(), x.double(), y, False)
    got = {}
    for mode, (grad, fwd) in MODES.items():
        MODE.update(grad=grad, fwd=fwd)
        got[mode] = _grads(copy.deepcopy(ref), x, y, True)
    print("| model | batch | seed | mode | rel err | vs HF autocast | median ratio | max ratio | > 1.5x |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, d in got.items():  # the GPU table's measures (gradient_agreement), HF autocast as the peer
        rows = [agreement_row(name, mode, n, want[n], got["autocast"][n], d[n]) for n in want]
        s = agreement_summary(rows, want, got["autocast"], d)
        top = max(r["ref_norm"] for r in rows)
        over = sum(r["swapped_rel_err"] > 1.5 * max(r["hf_rel_err"], 1e-12) for r in rows if r["ref_norm"] >= 1e-3 * top)
        print(f"| {name} | {batch} | {seed} | {mode} | {s['swapped_rel_err']:.4f} "
              f"| {s['swapped_rel_err'] / s['hf_rel_err']:.3f} | {s['median_ratio']:.3f} | {s['max_ratio']:.2f} "
              f"| {over} of {s['tensors']} |", flush=True)

if __name__ == "__main__":
    main()
