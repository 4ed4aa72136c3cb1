"""Conv ops on CvT's token layout: ``torch.ops.cvt_cutlass.conv2d_nhwc`` and ``dwconv_tokens``.

``conv2d_nhwc(x, weight, bias, stride, padding)``: x (N, H, W, C) NHWC, weight (K, R, S, C),
bias (K,), all in x's dtype; returns (N, P, Q, K), i.e. tokens (N, P*Q, K) without a permute.
The token embedding of a CvT stage. For the 3-channel stem, :func:`image_to_nhwc` and
:func:`conv_filter_krsc` pad image and filter to 4 channels (the zero channel adds nothing).

``dwconv_tokens(x, weight, bias, height, width, stride, cls_rows)``: the depthwise 3x3 conv
projection (padding 1) on tokens x (B, cls_rows + H*W, C); weight (3, 3, C) and bias (C,) in
fp32 (BatchNorm folded in by :func:`fold_batchnorm`); returns (B, cls_rows + P*Q, C) whose first
``cls_rows`` rows are x's, unchanged (CvT's stage-3 cls token: no split, no ``torch.cat``).

Wrong arguments raise. Calls no kernel can serve (CPU tensors, fp32 activations, channels that
are not a multiple of 8, misaligned or non-packed views, a GPU older than sm_80, no bias) run the
PyTorch equivalent instead, counted and logged by :mod:`cvt_cutlass.fallback` (or raise in
strict mode). Backward: PyTorch's conv gradients for now (vjp of the reference).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import fallback, runtime
from ..selection import select_conv2d, select_dwconv
from .common import DTYPES as _DTYPES
from .common import aligned as _aligned
from .common import device_plan as _common_plan


# ----------------------------------------------------------------------------- weight preparation
def conv_filter_krsc(weight: Tensor, channels: int | None = None) -> Tensor:
    """nn.Conv2d's (K, C, R, S) weight as a contiguous (K, R, S, C') filter, C' = ``channels``
    (zero-padded; the stem's 3 channels become 4)."""
    k, c, r, s = weight.shape
    out = weight.permute(0, 2, 3, 1)
    if channels is not None and channels != c:
        if channels < c:
            raise ValueError(f"cannot pad {c} channels down to {channels}")
        out = F.pad(out, (0, channels - c))
    return out.contiguous()


def image_to_nhwc(images: Tensor, channels: int = 4) -> Tensor:
    """NCHW images as a contiguous NHWC batch with ``channels`` channels (zero-padded)."""
    n, c, h, w = images.shape
    if channels < c:
        raise ValueError(f"cannot pad {c} channels down to {channels}")
    out = images.new_zeros(n, h, w, channels) if channels > c else images.new_empty(n, h, w, c)
    out[..., :c].copy_(images.permute(0, 2, 3, 1))
    return out


def stem_channels(c: int) -> int:
    """How many channels the implicit-GEMM kernels read for a c-channel input."""
    return c if c % 8 == 0 else (4 if c <= 4 else -(-c // 8) * 8)


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


# ----------------------------------------------------------------------------- references
def conv2d_nhwc_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: int, padding: int) -> Tensor:
    y = F.conv2d(x.permute(0, 3, 1, 2), weight.permute(0, 3, 1, 2), bias, stride, padding)
    return y.permute(0, 2, 3, 1).contiguous()


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


# ----------------------------------------------------------------------------- checks
def _conv_out(size: int, k: int, s: int, p: int) -> int:
    return (size + 2 * p - k) // s + 1


def _check_conv2d(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: int, padding: int) -> None:
    if x.dim() != 4 or weight.dim() != 4 or x.shape[3] != weight.shape[3]:
        raise ValueError(f"cvt_cutlass.conv2d_nhwc: x (N, H, W, C) and weight (K, R, S, C) do not match: "
                         f"{tuple(x.shape)} vs {tuple(weight.shape)}")
    if stride < 1 or padding < 0:
        raise ValueError(f"cvt_cutlass.conv2d_nhwc: stride must be >= 1 and padding >= 0, got {stride}, {padding}")
    if _conv_out(x.shape[1], weight.shape[1], stride, padding) < 1 or _conv_out(x.shape[2], weight.shape[2], stride,
                                                                               padding) < 1:
        raise ValueError(f"cvt_cutlass.conv2d_nhwc: input {tuple(x.shape)} is smaller than the filter")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"cvt_cutlass.conv2d_nhwc: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dtype != x.dtype:
            raise TypeError(f"cvt_cutlass.conv2d_nhwc: {name} is {t.dtype} but x is {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"cvt_cutlass.conv2d_nhwc: {name} is on {t.device} but x is on {x.device}")


def _check_dwconv(x: Tensor, weight: Tensor, bias: Optional[Tensor], height: int, width: int, stride: int,
                  cls_rows: int) -> None:
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


# ----------------------------------------------------------------------------- conv2d_nhwc
def _plan_conv2d(x, weight, bias):
    why = _common_plan(x)
    if why:
        return why
    k = weight.shape[0]
    if bias is None:
        return ("epilogue", "conv kernels add a bias; call with one (zeros for none)")
    if k % 8:
        return ("alignment", f"K={k} output channels: must be a multiple of 8")
    if not x.is_contiguous() or not weight.is_contiguous() or not bias.is_contiguous():
        return ("layout", "x, weight and bias must be contiguous (packed NHWC / KRSC)")
    if not (_aligned(x) and _aligned(weight) and _aligned(bias)):
        return ("layout", "x, weight and bias must be 16-byte aligned")
    return None


@torch.library.custom_op("cvt_cutlass::conv2d_nhwc", mutates_args=())
def conv2d_nhwc(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: int, padding: int) -> Tensor:
    _check_conv2d(x, weight, bias, stride, padding)
    why = _plan_conv2d(x, weight, bias)
    if why is not None:
        fallback.record_fallback("conv2d_nhwc", *why)
        return conv2d_nhwc_reference(x, weight, bias, stride, padding)
    n, h, w, c = x.shape
    k, r, s, _ = weight.shape
    p, q = _conv_out(h, r, stride, padding), _conv_out(w, s, stride, padding)
    out = x.new_empty(n, p, q, k)
    if out.numel() == 0:
        return out
    dev = runtime.device_info(x.device.index)
    arch = runtime.arch_for(dev.cc)
    choice = select_conv2d(n * p * q, k, r * s * c, c, _DTYPES[x.dtype], arch, dev.name)
    kid = runtime.load_kernel(choice.spec, dev.cc)
    torch.ops.cvt_cutlass_C.conv2d(kid, x, weight, bias, out, [padding, padding], [stride, stride], 0)
    fallback.record_kernel_call("conv2d_nhwc")
    fallback.record_selection("conv2d_nhwc", choice.source)
    return out


@conv2d_nhwc.register_fake
def _(x, weight, bias, stride, padding):
    _check_conv2d(x, weight, bias, stride, padding)
    n, h, w, _ = x.shape
    k, r, s, _ = weight.shape
    return x.new_empty(n, _conv_out(h, r, stride, padding), _conv_out(w, s, stride, padding), k)


def _conv2d_setup(ctx, inputs, output):
    x, weight, bias, stride, padding = inputs
    ctx.stride, ctx.padding, ctx.has_bias = stride, padding, bias is not None
    ctx.save_for_backward(x, weight, bias)


def _conv2d_backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    args = [x, weight] + ([bias] if ctx.has_bias else [])

    def f(x, weight, bias=None):
        return conv2d_nhwc_reference(x, weight, bias, ctx.stride, ctx.padding)

    _, vjp = torch.func.vjp(f, *args)
    grads = vjp(grad.contiguous())
    return grads[0], grads[1], grads[2] if ctx.has_bias else None, None, None


conv2d_nhwc.register_autograd(_conv2d_backward, setup_context=_conv2d_setup)


# ----------------------------------------------------------------------------- dwconv_tokens
def _plan_dwconv(x, weight, bias, stride, cls_rows):
    why = _common_plan(x)
    if why:
        return why
    c = x.shape[2]
    if weight.shape[0] != 3:
        return ("kernel", f"{weight.shape[0]}x{weight.shape[1]} filters: kernels are instantiated for 3x3")
    if stride not in (1, 2):
        return ("stride", f"stride {stride}: kernels are instantiated for 1 and 2")
    if c % 8:
        return ("alignment", f"C={c} channels: must be a multiple of 8")
    if x.stride(2) != 1 or x.stride(1) != c or (x.shape[0] > 1 and x.stride(0) % 8) or not _aligned(x):
        return ("layout", f"x strides {x.stride()}: tokens must be packed rows, 16-byte aligned")
    if not weight.is_contiguous() or not _aligned(weight) or (bias is not None and not _aligned(bias)):
        return ("layout", "weight and bias must be contiguous and 16-byte aligned")
    return None


@torch.library.custom_op("cvt_cutlass::dwconv_tokens", mutates_args=())
def dwconv_tokens(x: Tensor, weight: Tensor, bias: Optional[Tensor], height: int, width: int, stride: int,
                  cls_rows: int = 0) -> Tensor:
    _check_dwconv(x, weight, bias, height, width, stride, cls_rows)
    why = _plan_dwconv(x, weight, bias, stride, cls_rows)
    if why is not None:
        fallback.record_fallback("dwconv_tokens", *why)
        return dwconv_tokens_reference(x, weight, bias, height, width, stride, cls_rows)
    b, _, c = x.shape
    pad = weight.shape[0] // 2
    p, q = _conv_out(height, 3, stride, pad), _conv_out(width, 3, stride, pad)
    out = x.new_empty(b, cls_rows + p * q, c)
    if out.numel() == 0:
        return out
    dev = runtime.device_info(x.device.index)
    arch = runtime.arch_for(dev.cc)
    choice = select_dwconv(b * p * q, c, stride, _DTYPES[x.dtype], arch, dev.name)
    kid = runtime.load_kernel(choice.spec, dev.cc)
    xi = x[:, cls_rows:].unflatten(1, (height, width))
    yi = out[:, cls_rows:].unflatten(1, (p, q))
    torch.ops.cvt_cutlass_C.conv2d(kid, xi, weight, bias, yi, [pad, pad], [stride, stride], cls_rows)
    fallback.record_kernel_call("dwconv_tokens")
    fallback.record_selection("dwconv_tokens", choice.source)
    return out


@dwconv_tokens.register_fake
def _(x, weight, bias, height, width, stride, cls_rows=0):
    _check_dwconv(x, weight, bias, height, width, stride, cls_rows)
    pad = weight.shape[0] // 2
    p, q = _conv_out(height, weight.shape[0], stride, pad), _conv_out(width, weight.shape[0], stride, pad)
    return x.new_empty(x.shape[0], cls_rows + p * q, x.shape[2])


def _dw_setup(ctx, inputs, output):
    x, weight, bias, height, width, stride, cls_rows = inputs
    ctx.geom = (height, width, stride, cls_rows)
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, bias)


def _dw_backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    args = [x, weight] + ([bias] if ctx.has_bias else [])

    def f(x, weight, bias=None):
        return dwconv_tokens_reference(x, weight, bias, *ctx.geom)

    _, vjp = torch.func.vjp(f, *args)
    grads = vjp(grad.contiguous())
    return grads[0], grads[1], grads[2] if ctx.has_bias else None, None, None, None, None


dwconv_tokens.register_autograd(_dw_backward, setup_context=_dw_setup)
