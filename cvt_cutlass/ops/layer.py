"""The fake kernels of the CvT layer as one op: ``torch.ops.cvt_cutlass.cvt_layer(x, weights,
drop_attn, drop_out, scalars, geom) -> out`` (inference), ``cvt_layer_train(x, weights, running,
drop_attn, drop_out, scalars, geom) -> (out, *saved)`` and ``cvt_layer_backward``. The weights'
first 16 may come as one 1-D buffer (their gradient is then one buffer too).

The op is C++ (csrc/ops/layer.cpp: the argument lists, the forward and backward bodies, one
autograd node per layer); on CUDA its steps call the family ops' hot paths directly, elsewhere
their PyTorch references, so it needs no planner or fallback of its own. The weight lists of a
CvtLayer are built by :mod:`cvt_cutlass.layer`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import new_lse
from .linear import dgelu_dtype


def _tokens_out(x: Tensor, geom, stride: int) -> int:
    hh, ww, cls = geom[0], geom[1], geom[2]
    return cls + ((hh - 1) // stride + 1) * ((ww - 1) // stride + 1)


def _out_dtype(x: Tensor, weights, geom) -> torch.dtype:
    """The output's dtype: x's, or the weights' where geom's seventh entry asks for a rounded output
    (an fp32 residual stream's last sum in a stage, csrc/ops/layer.cpp)."""
    return weights[0].dtype if len(geom) > 6 and geom[6] else x.dtype


def _fake(x, weights, drop_attn, drop_out, scalars, geom):
    return torch.empty_like(x, dtype=_out_dtype(x, weights, geom))


def _hidden(weights, c: int) -> int:
    """fc1's width: W1's rows, or from the size of the one buffer holding the first 16 weights
    (4 C^2 + 9 C + H (2 C + 1) elements)."""
    if len(weights) == 10:
        return (weights[0].numel() - 4 * c * c - 9 * c) // (2 * c + 1)
    return weights[12].shape[0]


def _fake_train(x, weights, running, drop_attn, drop_out, scalars, geom):
    b, n, c = x.shape
    heads = geom[3]
    lq, lkv = _tokens_out(x, geom, geom[4]), _tokens_out(x, geom, geom[5])
    sdt = torch.promote_types(x.dtype, torch.float32)
    h = x.new_empty(b, n, c, dtype=weights[0].dtype)  # the compute dtype (x may be an fp32 residual stream)
    ys = [h.new_empty(b, lq, c), h.new_empty(b, lkv, c), h.new_empty(b, lkv, c)]
    stats = [x.new_empty(c, dtype=sdt) for _ in range(6)]
    qkv = [h.new_empty(b, lq, heads, c // heads)] + [h.new_empty(b, lkv, heads, c // heads) for _ in range(2)]
    hidden = _hidden(weights, c)
    saved = [h, *ys, *stats[:3], *stats[3:], *qkv, h.new_empty(b, lq, heads, c // heads),
             new_lse(h, b, heads, lq), x.new_empty(b, n, c), h.new_empty(b, n, c), h.new_empty(b, n, hidden),
             h.new_empty(b, n, hidden, dtype=dgelu_dtype(h.dtype))]  # fc1's saved GELU derivative
    return (x.new_empty(b, n, c, dtype=_out_dtype(x, weights, geom)), *saved)


def _fake_backward(grad, x, weights, saved, drop_attn, drop_out, scalars, geom):
    return [torch.empty_like(x)] + [torch.empty_like(w) for w in weights]


torch.library.register_fake("cvt_cutlass::cvt_layer", _fake)
torch.library.register_fake("cvt_cutlass::cvt_layer_train", _fake_train)
torch.library.register_fake("cvt_cutlass::cvt_layer_backward", _fake_backward)

