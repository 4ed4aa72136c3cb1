"""LayerNorm on CvT's tokens: ``torch.ops.cvt_cutlass.layer_norm_tokens``.

``layer_norm_tokens(x, weight, bias, eps, prefix=None)``: x (B, L, C) tokens (unit stride along
C; rows and images may be strided), weight and bias (C,) in x's dtype, ``prefix`` an optional
(P, C) tensor in x's dtype; returns a new contiguous (B, P + L, C) whose first P rows of every
image are ``prefix`` and the rest ``LayerNorm(x)`` (statistics in fp32). CvT's stage-3 embedding
writes its cls token this way instead of a ``torch.cat``.

Defined in C++ (csrc/ops/layernorm.cpp: schema, CUDA hot path); this module holds the planner,
the PyTorch fallback, the fake kernel and autograd. Wrong arguments raise. Calls no kernel can
serve (CPU tensors, fp32 activations, channel counts that are not a multiple of 8 or above 4096,
misaligned views, a GPU older than sm_80) run the PyTorch equivalent, counted and logged by
:mod:`cvt_cutlass.fallback` (or raise in strict mode). Backward: PyTorch's LayerNorm gradients
for now (vjp of the reference); the kernel can also store each row's (mean, rstd) for a fused
backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import runtime
from ..operators.layernorm import channels_supported
from ..selection import select_layernorm
from .common import DTYPES as _DTYPES
from .common import (
    PLAN_EMPTY,
    PLAN_FALLBACK,
    check_floating,
    check_like,
    device_plan,
    kernel_plan,
    record_fallback,
    register_op,
)


def layer_norm_tokens(x: Tensor, weight: Tensor, bias: Tensor, eps: float, prefix: Optional[Tensor] = None) -> Tensor:
    """[prefix; LayerNorm(x)] per image on one kernel (see the module docstring)."""
    return torch.ops.cvt_cutlass.layer_norm_tokens.default(x, weight, bias, eps, prefix)


def layer_norm_tokens_reference(x: Tensor, weight: Tensor, bias: Tensor, eps: float,
                                prefix: Optional[Tensor] = None) -> Tensor:
    """The same math in PyTorch: LayerNorm computed in fp32 (or x's dtype if wider), rounded
    once to x's dtype, prefix rows in front."""
    cdt = torch.promote_types(x.dtype, torch.float32)
    y = F.layer_norm(x.to(cdt), (x.shape[-1],), weight.to(cdt), bias.to(cdt), eps).to(x.dtype)
    if prefix is None:
        return y.contiguous()
    return torch.cat([prefix.unsqueeze(0).expand(x.shape[0], -1, -1), y], 1)


def _check(x: Tensor, weight: Tensor, bias: Tensor, eps: float, prefix: Optional[Tensor]) -> None:
    check_floating("layer_norm_tokens", x=x, weight=weight, bias=bias, prefix=prefix)
    if x.dim() != 3:
        raise ValueError(f"cvt_cutlass.layer_norm_tokens: x must be tokens (B, L, C), got {tuple(x.shape)}")
    c = x.shape[2]
    for name, t in (("weight", weight), ("bias", bias)):
        if tuple(t.shape) != (c,):
            raise ValueError(f"cvt_cutlass.layer_norm_tokens: {name} must be ({c},), got {tuple(t.shape)}")
    if prefix is not None and (prefix.dim() != 2 or prefix.shape[1] != c):
        raise ValueError(f"cvt_cutlass.layer_norm_tokens: prefix must be (P, {c}), got {tuple(prefix.shape)}")
    if not eps > 0:
        raise ValueError(f"cvt_cutlass.layer_norm_tokens: eps must be > 0, got {eps}")
    check_like("layer_norm_tokens", "x", x, weight=weight, bias=bias, prefix=prefix)


def _why_not(x: Tensor, weight: Tensor, bias: Tensor, prefix: Optional[Tensor]):
    """(reason, detail) when no kernel serves these arguments, else None."""
    why = device_plan(x)
    if why:
        return why
    c = x.shape[2]
    if not channels_supported(c):
        return ("channels", f"C={c}: kernels take multiples of 8 up to 4096")
    if x.stride(2) != 1 or x.stride(1) % 8 or (x.shape[0] > 1 and x.stride(0) % 8):
        return ("layout", f"x strides {x.stride()}: rows must be contiguous, 16-byte aligned")
    for t in (weight, bias, prefix):
        if t is not None and not t.is_contiguous():
            return ("layout", "weight, bias and prefix must be contiguous")
    if x.shape[0] > 65535:
        return ("batch", f"{x.shape[0]} images (at most 65535 per launch)")
    return None


def _plan(x, weight, bias, eps, prefix=None):
    _check(x, weight, bias, eps, prefix)
    if _why_not(x, weight, bias, prefix):
        return PLAN_FALLBACK
    b, rows, c = x.shape
    if b * rows * c == 0:
        return PLAN_EMPTY  # nothing to normalise: the hot path writes the prefix rows, if any
    dev = runtime.device_info(x.device.index)
    return kernel_plan(select_layernorm(b * rows, c, _DTYPES[x.dtype], runtime.arch_for(dev.cc), dev.name),
                       x.device.index)


def _fallback(x, weight, bias, eps, prefix=None):
    _check(x, weight, bias, eps, prefix)
    record_fallback("layer_norm_tokens", _why_not(x, weight, bias, prefix), x, weight, bias, prefix)
    return layer_norm_tokens_reference(x, weight, bias, eps, prefix)


def _fake(x, weight, bias, eps, prefix=None):
    _check(x, weight, bias, eps, prefix)
    pre = 0 if prefix is None else prefix.shape[0]
    return x.new_empty(x.shape[0], pre + x.shape[1], x.shape[2])


def _setup(ctx, inputs, output):
    x, weight, bias, eps, prefix = inputs
    ctx.eps, ctx.has_prefix = eps, prefix is not None
    ctx.save_for_backward(x, weight, bias, prefix)


def _backward(ctx, grad):
    x, weight, bias, prefix = ctx.saved_tensors
    args = [x, weight, bias] + ([prefix] if ctx.has_prefix else [])

    def f(x, weight, bias, prefix=None):
        return layer_norm_tokens_reference(x, weight, bias, ctx.eps, prefix)

    _, vjp = torch.func.vjp(f, *args)
    grads = vjp(grad.contiguous())
    return grads[0], grads[1], grads[2], None, grads[3] if ctx.has_prefix else None


register_op("layer_norm_tokens", plan=_plan, fallback=_fallback, fake=_fake, backward=_backward, setup_context=_setup)
