"""LayerNorm on CvT's tokens: ``torch.ops.cvt_cutlass.layer_norm_tokens``.

``layer_norm_tokens(x, weight, bias, eps, prefix=None)``: x (B, L, C) tokens (unit stride along
C; rows and images may be strided), weight and bias (C,) in x's dtype, ``prefix`` an optional
(P, C) tensor in x's dtype; returns a new contiguous (B, P + L, C) whose first P rows of every
image are ``prefix`` and the rest ``LayerNorm(x)`` (statistics in fp32). CvT's stage-3 embedding
writes its cls token this way instead of a ``torch.cat``.

Wrong arguments raise. Calls no kernel can serve (CPU tensors, fp32 activations, channel counts
that are not a multiple of 8 or above 4096, misaligned views, a GPU older than sm_80) run the
PyTorch equivalent, counted and logged by :mod:`cvt_cutlass.fallback` (or raise in strict mode).
Backward: PyTorch's LayerNorm gradients for now (vjp of the reference); the kernel can also store
each row's (mean, rstd) for a fused backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import fallback, runtime
from ..operators.norm import channels_supported
from ..selection import select_layernorm
from .common import DTYPES as _DTYPES
from .common import aligned as _aligned
from .common import device_plan


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
    for name, t in (("weight", weight), ("bias", bias), ("prefix", prefix)):
        if t is None:
            continue
        if t.dtype != x.dtype:
            raise TypeError(f"cvt_cutlass.layer_norm_tokens: {name} is {t.dtype} but x is {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"cvt_cutlass.layer_norm_tokens: {name} is on {t.device} but x is on {x.device}")


def _plan(x: Tensor, weight: Tensor, bias: Tensor, prefix: Optional[Tensor]):
    why = device_plan(x)
    if why:
        return why
    c = x.shape[2]
    if not channels_supported(c):
        return ("channels", f"C={c}: kernels take multiples of 8 up to 4096")
    if x.stride(2) != 1 or x.stride(1) % 8 or (x.shape[0] > 1 and x.stride(0) % 8) or not _aligned(x):
        return ("layout", f"x strides {x.stride()}: rows must be contiguous, 16-byte aligned")
    for t in (weight, bias, prefix):
        if t is not None and (not t.is_contiguous() or not _aligned(t)):
            return ("layout", "weight, bias and prefix must be contiguous and 16-byte aligned")
    if x.shape[0] > 65535:
        return ("batch", f"{x.shape[0]} images (at most 65535 per launch)")
    return None


@torch.library.custom_op("cvt_cutlass::layer_norm_tokens", mutates_args=())
def layer_norm_tokens(x: Tensor, weight: Tensor, bias: Tensor, eps: float, prefix: Optional[Tensor] = None) -> Tensor:
    _check(x, weight, bias, eps, prefix)
    why = _plan(x, weight, bias, prefix)
    if why is not None:
        fallback.record_fallback("layer_norm_tokens", *why)
        return layer_norm_tokens_reference(x, weight, bias, eps, prefix)
    b, rows, c = x.shape
    pre = 0 if prefix is None else prefix.shape[0]
    out = x.new_empty(b, pre + rows, c)
    if out.numel() == 0:
        return out
    if rows == 0:  # nothing to normalise: only the prefix rows
        return out.copy_(prefix.unsqueeze(0).expand(b, -1, -1))
    dev = runtime.device_info(x.device.index)
    choice = select_layernorm(b * rows, c, _DTYPES[x.dtype], runtime.arch_for(dev.cc), dev.name)
    kid = runtime.load_kernel(choice.spec, dev.cc)
    torch.ops.cvt_cutlass_C.layer_norm(kid, x, weight, bias, prefix, out, None, eps)
    fallback.record_kernel_call("layer_norm_tokens")
    fallback.record_selection("layer_norm_tokens", choice.source)
    return out


@layer_norm_tokens.register_fake
def _(x, weight, bias, eps, prefix=None):
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


layer_norm_tokens.register_autograd(_backward, setup_context=_setup)
