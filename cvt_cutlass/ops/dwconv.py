"""The depthwise conv projection on tokens: ``torch.ops.cvt_cutlass.dwconv_tokens``.

``dwconv_tokens(x, weight, bias, height, width, stride, cls_rows)``: the depthwise 3x3 conv
projection (padding 1) on tokens x (B, cls_rows + H*W, C); weight (3, 3, C) and bias (C,) in
fp32 (BatchNorm folded in by :func:`fold_batchnorm`); returns (B, cls_rows + P*Q, C) whose first
``cls_rows`` rows are x's, unchanged (CvT's stage-3 cls token: no split, no ``torch.cat``).

Defined in C++ (csrc/ops/dwconv.cpp: schema, CUDA hot path); this module holds the planner, the
PyTorch fallback, the fake kernel and autograd. Wrong arguments raise. Calls no kernel can serve
(CPU tensors, fp32 activations, channels that are not a multiple of 8, non-packed views, a GPU
older than sm_80, filters other than 3x3, strides other than 1 and 2) run the PyTorch
equivalent, counted and logged by :mod:`cvt_cutlass.fallback` (or raise in strict mode).
Backward: PyTorch's conv gradients for now (vjp of the reference).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import runtime
from ..selection import select_dwconv
from .common import DTYPES as _DTYPES
from .common import (
    PLAN_EMPTY,
    PLAN_FALLBACK,
    check_floating,
    device_plan,
    kernel_plan,
    record_fallback,
    register_op,
)
from .conv2d import conv_out


def dwconv_tokens(x: Tensor, weight: Tensor, bias: Optional[Tensor], height: int, width: int, stride: int,
                  cls_rows: int = 0) -> Tensor:
    """Depthwise conv of tokens with the cls rows passed through (see the module docstring)."""
    return torch.ops.cvt_cutlass.dwconv_tokens.default(x, weight, bias, height, width, stride, cls_rows)


def fold_batchnorm(conv_weight: Tensor, running_mean: Tensor, running_var: Tensor, bn_weight: Optional[Tensor],
                   bn_bias: Optional[Tensor], eps: float, conv_bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Eval-mode BatchNorm after a depthwise conv, folded into it: (w (R, S, C), b (C,)) in fp32
    with ``bn(conv(x, conv_weight) + conv_bias) == conv(x, w) + b``."""
    c = conv_weight.shape[0]
    if conv_weight.dim() != 4 or conv_weight.shape[1] != 1:
        raise ValueError(f"expected a depthwise (C, 1, R, S) weight, got {tuple(conv_weight.shape)}")
    scale = torch.rsqrt(running_var.double() + eps)
    if bn_weight is not None:
        scale = scale * bn_weight.double()
    shift = -running_mean.double() * scale
    if bn_bias is not None:
        shift = shift + bn_bias.double()
    if conv_bias is not None:
        shift = shift + conv_bias.double() * scale
    w = conv_weight.double()[:, 0] * scale.view(c, 1, 1)  # (C, R, S)
    return w.permute(1, 2, 0).contiguous().float(), shift.float().contiguous()


def dwconv_tokens_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor], height: int, width: int,
                            stride: int, cls_rows: int) -> Tensor:
    """The same math in PyTorch, computed in fp32 (or in x's dtype if that is wider)."""
    b, _, c = x.shape
    cdt = torch.promote_types(x.dtype, torch.float32)
    img = x[:, cls_rows:].reshape(b, height, width, c).permute(0, 3, 1, 2).to(cdt)
    w = weight.permute(2, 0, 1).unsqueeze(1).to(cdt)  # (C, 1, R, S)
    y = F.conv2d(img, w, None if bias is None else bias.to(cdt), stride, weight.shape[0] // 2, groups=c)
    y = y.flatten(2).transpose(1, 2).to(x.dtype)
    return torch.cat([x[:, :cls_rows], y], 1) if cls_rows else y.contiguous()


def _check_dwconv(x: Tensor, weight: Tensor, bias: Optional[Tensor], height: int, width: int, stride: int,
                  cls_rows: int) -> None:
    check_floating("dwconv_tokens", x=x, weight=weight, bias=bias)
    if x.dim() != 3:
        raise ValueError(f"cvt_cutlass.dwconv_tokens: x must be tokens (B, L, C), got {tuple(x.shape)}")
    c = x.shape[2]
    if weight.dim() != 3 or weight.shape[0] != weight.shape[1] or weight.shape[0] % 2 == 0 or weight.shape[2] != c:
        raise ValueError(f"cvt_cutlass.dwconv_tokens: weight must be (R, R, C={c}) with odd R, got "
                         f"{tuple(weight.shape)}")
    if cls_rows < 0 or height < 1 or width < 1 or stride < 1:
        raise ValueError("cvt_cutlass.dwconv_tokens: height, width, stride must be >= 1 and cls_rows >= 0")
    if x.shape[1] != cls_rows + height * width:
        raise ValueError(f"cvt_cutlass.dwconv_tokens: x has {x.shape[1]} tokens, expected cls_rows + H*W = "
                         f"{cls_rows} + {height}*{width}")
    if bias is not None and tuple(bias.shape) != (c,):
        raise ValueError(f"cvt_cutlass.dwconv_tokens: bias must be ({c},), got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dtype != torch.float32:
            raise TypeError(f"cvt_cutlass.dwconv_tokens: {name} must be float32 (folded BatchNorm), got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"cvt_cutlass.dwconv_tokens: {name} is on {t.device} but x is on {x.device}")


def _why_not(x, weight, bias, stride):
    """(reason, detail) when no kernel serves these arguments, else None."""
    why = device_plan(x)
    if why:
        return why
    c = x.shape[2]
    if weight.shape[0] != 3:
        return ("kernel", f"{weight.shape[0]}x{weight.shape[1]} filters: kernels are instantiated for 3x3")
    if stride not in (1, 2):
        return ("stride", f"stride {stride}: kernels are instantiated for 1 and 2")
    if c % 8:
        return ("alignment", f"C={c} channels: must be a multiple of 8")
    if x.shape[0] > 65535 or x.shape[1] * c > 2**31 - 1:
        return ("size", f"x {tuple(x.shape)}: at most 65535 images of 2**31 - 1 elements per launch")
    if x.stride(2) != 1 or x.stride(1) != c or (x.shape[0] > 1 and x.stride(0) % 8):
        return ("layout", f"x strides {x.stride()}: tokens must be packed rows, 16-byte aligned")
    if not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        return ("layout", "weight and bias must be contiguous")
    return None


def _plan(x, weight, bias, height, width, stride, cls_rows=0):
    _check_dwconv(x, weight, bias, height, width, stride, cls_rows)
    if _why_not(x, weight, bias, stride):
        return PLAN_FALLBACK
    b, _, c = x.shape
    pad = weight.shape[0] // 2
    p, q = conv_out(height, 3, stride, pad), conv_out(width, 3, stride, pad)
    if b * (cls_rows + p * q) * c == 0:
        return PLAN_EMPTY
    dev = runtime.device_info(x.device.index)
    choice = select_dwconv(b * p * q, c, stride, _DTYPES[x.dtype], runtime.arch_for(dev.cc), dev.name)
    return kernel_plan(choice, x.device.index)


def _fallback(x, weight, bias, height, width, stride, cls_rows=0):
    _check_dwconv(x, weight, bias, height, width, stride, cls_rows)
    record_fallback("dwconv_tokens", _why_not(x, weight, bias, stride), x, weight, bias)
    return dwconv_tokens_reference(x, weight, bias, height, width, stride, cls_rows)


def _fake(x, weight, bias, height, width, stride, cls_rows=0):
    _check_dwconv(x, weight, bias, height, width, stride, cls_rows)
    pad = weight.shape[0] // 2
    p, q = conv_out(height, weight.shape[0], stride, pad), conv_out(width, weight.shape[0], stride, pad)
    return x.new_empty(x.shape[0], cls_rows + p * q, x.shape[2])


def _setup(ctx, inputs, output):
    x, weight, bias, height, width, stride, cls_rows = inputs
    ctx.geom = (height, width, stride, cls_rows)
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, bias)


def _backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    args = [x, weight] + ([bias] if ctx.has_bias else [])

    def f(x, weight, bias=None):
        return dwconv_tokens_reference(x, weight, bias, *ctx.geom)

    _, vjp = torch.func.vjp(f, *args)
    grads = vjp(grad.contiguous())
    return grads[0], grads[1], grads[2] if ctx.has_bias else None, None, None, None, None


register_op("dwconv_tokens", plan=_plan, fallback=_fallback, fake=_fake, backward=_backward, setup_context=_setup)
