"""The token-embedding conv: ``torch.ops.cvt_cutlass.conv2d_nhwc``.

``conv2d_nhwc(x, weight, bias, stride, padding)``: x (N, H, W, C) NHWC, weight (K, R, S, C),
bias (K,), all in x's dtype; returns (N, P, Q, K), i.e. tokens (N, P*Q, K) without a permute.
The token embedding of a CvT stage. For the 3-channel stem, :func:`image_to_nhwc` and
:func:`conv_filter_krsc` pad image and filter to 4 channels (the zero channel adds nothing).

Defined in C++ (csrc/ops/conv2d.cpp: schema, CUDA hot path); this module holds the planner, the
PyTorch fallback, the fake kernel and autograd. Wrong arguments raise. Calls no kernel can serve
(CPU tensors, fp32 activations, output channels that are not a multiple of 8, misaligned or
non-packed views, a GPU older than sm_80, no bias) run the PyTorch equivalent instead, counted
and logged by :mod:`cvt_cutlass.fallback` (or raise in strict mode). Backward: PyTorch's conv
gradients for now (vjp of the reference).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import runtime
from ..operators.conv2d import stem_channels  # noqa: F401  (re-exported: prepares the stem)
from ..selection import select_conv2d
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


def conv2d_nhwc(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: int, padding: int) -> Tensor:
    """conv2d(x, weight) + bias on NHWC tensors, one CUTLASS implicit-GEMM kernel (see the module docstring)."""
    return torch.ops.cvt_cutlass.conv2d_nhwc.default(x, weight, bias, stride, padding)


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


def conv2d_nhwc_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: int, padding: int) -> Tensor:
    y = F.conv2d(x.permute(0, 3, 1, 2), weight.permute(0, 3, 1, 2), bias, stride, padding)
    return y.permute(0, 2, 3, 1).contiguous()


def conv_out(size: int, k: int, s: int, p: int) -> int:
    return (size + 2 * p - k) // s + 1


def _check_conv2d(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: int, padding: int) -> None:
    if x.dim() != 4 or weight.dim() != 4 or x.shape[3] != weight.shape[3]:
        raise ValueError(f"cvt_cutlass.conv2d_nhwc: x (N, H, W, C) and weight (K, R, S, C) do not match: "
                         f"{tuple(x.shape)} vs {tuple(weight.shape)}")
    if stride < 1 or padding < 0:
        raise ValueError(f"cvt_cutlass.conv2d_nhwc: stride must be >= 1 and padding >= 0, got {stride}, {padding}")
    if conv_out(x.shape[1], weight.shape[1], stride, padding) < 1 or conv_out(x.shape[2], weight.shape[2], stride,
                                                                               padding) < 1:
        raise ValueError(f"cvt_cutlass.conv2d_nhwc: input {tuple(x.shape)} is smaller than the filter")
    check_floating("conv2d_nhwc", x=x, weight=weight, bias=bias)
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"cvt_cutlass.conv2d_nhwc: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    check_like("conv2d_nhwc", "x", x, weight=weight, bias=bias)


def _why_not(x, weight, bias, stride: int, padding: int):
    """(reason, detail) when no kernel serves these arguments, else None."""
    why = device_plan(x)
    if why:
        return why
    if bias is None:
        return ("epilogue", "conv kernels add a bias; call with one (zeros for none)")
    if weight.shape[0] % 8:
        return ("alignment", f"K={weight.shape[0]} output channels: must be a multiple of 8")
    n, h, w, c = x.shape
    k, r, s, _ = weight.shape
    if max(x.numel(), n * k * conv_out(h, r, stride, padding) * conv_out(w, s, stride, padding)) > 2**31 - 1:
        return ("size", f"x {tuple(x.shape)}: the implicit-GEMM kernels index with 32-bit integers")
    if not x.is_contiguous() or not weight.is_contiguous() or not bias.is_contiguous():
        return ("layout", "x, weight and bias must be contiguous (packed NHWC / KRSC)")
    return None


def _plan(x, weight, bias, stride, padding):
    _check_conv2d(x, weight, bias, stride, padding)
    if _why_not(x, weight, bias, stride, padding):
        return PLAN_FALLBACK
    n, h, w, c = x.shape
    k, r, s, _ = weight.shape
    p, q = conv_out(h, r, stride, padding), conv_out(w, s, stride, padding)
    if n * p * q * k == 0:
        return PLAN_EMPTY
    dev = runtime.device_info(x.device.index)
    choice = select_conv2d(n * p * q, k, r * s * c, c, _DTYPES[x.dtype], runtime.arch_for(dev.cc), dev.name)
    return kernel_plan(choice, x.device.index)


def _fallback(x, weight, bias, stride, padding):
    _check_conv2d(x, weight, bias, stride, padding)
    record_fallback("conv2d_nhwc", _why_not(x, weight, bias, stride, padding), x, weight, bias)
    return conv2d_nhwc_reference(x, weight, bias, stride, padding)


def _fake(x, weight, bias, stride, padding):
    _check_conv2d(x, weight, bias, stride, padding)
    n, h, w, _ = x.shape
    k, r, s, _ = weight.shape
    return x.new_empty(n, conv_out(h, r, stride, padding), conv_out(w, s, stride, padding), k)


def _setup(ctx, inputs, output):
    x, weight, bias, stride, padding = inputs
    ctx.stride, ctx.padding, ctx.has_bias = stride, padding, bias is not None
    ctx.save_for_backward(x, weight, bias)


def _backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    args = [x, weight] + ([bias] if ctx.has_bias else [])

    def f(x, weight, bias=None):
        return conv2d_nhwc_reference(x, weight, bias, ctx.stride, ctx.padding)

    _, vjp = torch.func.vjp(f, *args)
    grads = vjp(grad.contiguous())
    return grads[0], grads[1], grads[2] if ctx.has_bias else None, None, None


register_op("conv2d_nhwc", plan=_plan, fallback=_fallback, fake=_fake, backward=_backward, setup_context=_setup)
