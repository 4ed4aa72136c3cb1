"""The token-embedding conv: ``torch.ops.cvt_cutlass.conv2d_nhwc``.

``conv2d_nhwc(x, weight, bias, stride, padding)``: x (N, H, W, C) NHWC, weight (K, R, S, C),
bias (K,), all in x's dtype; returns (N, P, Q, K), i.e. tokens (N, P*Q, K) without a permute.
The token embedding of a CvT stage. For the 3-channel stem, :func:`image_to_nhwc` and
:func:`conv_filter_krsc` pad image and filter to 4 channels (the zero channel adds nothing).

Defined in C++ (csrc/ops/conv2d.cpp: schema, CUDA hot path); this module holds the planner, the
PyTorch fallback, the fake kernel and autograd. Wrong arguments raise. Calls no kernel can serve
(CPU tensors, fp32 activations, output channels that are not a multiple of 8, misaligned or
non-packed views, a GPU older than sm_80, no bias) run the PyTorch equivalent instead, counted
and logged by :mod:`cvt_cutlass.fallback` (or raise in strict mode). Backward:
``conv2d_nhwc_backward``, CUTLASS implicit-GEMM dgrad and wgrad kernels (db in the wgrad launch),
with the C++ autograd formula in csrc/ops/conv2d.cpp; the parts no kernel serves (dx of the
4-channel stem image, fp32, CPU, ...) run PyTorch visibly, as the forward's fallback does.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import runtime
from ..models import conv_out
from ..operators.conv2d import (
    conv_window,
    select_conv2d,
    select_conv2d_backward,
    stem_channels,  # noqa: F401  (re-exported: prepares the stem)
)
from . import common


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


def image_to_nhwc(images: Tensor, channels: int = 4, dtype: torch.dtype | None = None) -> Tensor:
    """NCHW images as a contiguous NHWC batch with ``channels`` channels (zero-padded), in
    ``dtype`` (default: the images'): a zero fill and one copy that converts and transposes (a
    fill of the padding channel alone, strided, took longer than the whole one: 37 against 16 us at
    batch 128, 224x224, H100, 2026-11-27)."""
    n, c, h, w = images.shape
    if channels < c:
        raise ValueError(f"cannot pad {c} channels down to {channels}")
    make = images.new_zeros if channels > c else images.new_empty
    out = make(n, h, w, channels, dtype=dtype or images.dtype)
    out[..., :c].copy_(images.permute(0, 2, 3, 1))
    return out


def conv2d_nhwc_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: int, padding: int) -> Tensor:
    y = F.conv2d(x.permute(0, 3, 1, 2), weight.permute(0, 3, 1, 2), bias, stride, padding)
    return y.permute(0, 2, 3, 1).contiguous()


def _check_conv2d(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: int, padding: int) -> None:
    if x.dim() != 4 or weight.dim() != 4 or x.shape[3] != weight.shape[3]:
        raise ValueError(f"cvt_cutlass.conv2d_nhwc: x (N, H, W, C) and weight (K, R, S, C) do not match: "
                         f"{tuple(x.shape)} vs {tuple(weight.shape)}")
    if stride < 1 or padding < 0:
        raise ValueError(f"cvt_cutlass.conv2d_nhwc: stride must be >= 1 and padding >= 0, got {stride}, {padding}")
    if conv_out(x.shape[1], weight.shape[1], stride, padding) < 1 or conv_out(x.shape[2], weight.shape[2], stride,
                                                                               padding) < 1:
        raise ValueError(f"cvt_cutlass.conv2d_nhwc: input {tuple(x.shape)} is smaller than the filter")
    common.check_floating("conv2d_nhwc", x=x, weight=weight, bias=bias)
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"cvt_cutlass.conv2d_nhwc: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    common.check_like("conv2d_nhwc", "x", x, weight=weight, bias=bias)


def _why_not(x, weight, bias, stride: int, padding: int):
    """(reason, detail) when no kernel serves these arguments, else None."""
    why = common.device_plan(x)
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
        return common.PLAN_FALLBACK
    n, h, w, c = x.shape
    k, r, s, _ = weight.shape
    p, q = conv_out(h, r, stride, padding), conv_out(w, s, stride, padding)
    if n * p * q * k == 0:
        return common.PLAN_EMPTY
    dev = runtime.device_info(x.device.index)
    choice = select_conv2d(n * p * q, k, r * s * c, c, common.DTYPES[x.dtype], runtime.arch_for(dev.cc), dev.name,
                           conv_window(c, k, r, s, w, stride, padding))
    return common.kernel_plan(choice, x.device.index)


def _fallback(x, weight, bias, stride, padding):
    _check_conv2d(x, weight, bias, stride, padding)
    common.record_fallback("conv2d_nhwc", _why_not(x, weight, bias, stride, padding), x, weight, bias)
    return conv2d_nhwc_reference(x, weight, bias, stride, padding)


def _fake(x, weight, bias, stride, padding):
    _check_conv2d(x, weight, bias, stride, padding)
    n, h, w, _ = x.shape
    k, r, s, _ = weight.shape
    return x.new_empty(n, conv_out(h, r, stride, padding), conv_out(w, s, stride, padding), k)


# autograd: csrc/ops/conv2d.cpp (Conv2dFn: saves x and weight; dx (only when x requires grad), dw
# and db by conv2d_nhwc_backward)
common.register_op("conv2d_nhwc", plan=_plan, fallback=_fallback, fake=_fake)


# ----------------------------------------------------------------------------- backward
def conv2d_nhwc_backward(grad: Tensor, x: Tensor, weight: Tensor, stride: int, padding: int, need_dx: bool = True,
                         need_dw: bool = True, need_db: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, db) of ``conv2d_nhwc(x, weight, bias, stride, padding)`` from grad (N, P, Q, K):
    dx (N, H, W, C) by the dgrad kernel, dw (K, R, S, C) by the wgrad kernel (GEMM-K split, fp32
    partials summed in order), db (K,) by a deterministic row-sum pass in the wgrad launch. What is
    not asked for comes back as an empty (0,) tensor."""
    return torch.ops.cvt_cutlass.conv2d_nhwc_backward.default(grad, x, weight, stride, padding, need_dx, need_dw,
                                                              need_db)


def _bwd_check(grad, x, weight, stride, padding, *needs) -> None:
    _check_conv2d(x, weight, None, stride, padding)
    common.check_floating("conv2d_nhwc_backward", grad=grad)
    n, h, w, _ = x.shape
    k, r, s, _ = weight.shape
    want = (n, conv_out(h, r, stride, padding), conv_out(w, s, stride, padding), k)
    if tuple(grad.shape) != want:
        raise ValueError(f"cvt_cutlass.conv2d_nhwc_backward: grad must be the output's shape {want}, got "
                         f"{tuple(grad.shape)}")
    common.check_like("conv2d_nhwc_backward", "x", x, grad=grad)


def _bwd_why_not(grad, x, weight, stride: int, padding: int, pass_: str):
    """(reason, detail) when no ``pass_`` ("dgrad" / "wgrad") kernel serves these arguments, else None."""
    why = common.device_plan(x)
    if why:
        return why
    n, h, w, c = x.shape
    k, r, s, _ = weight.shape
    if k % 8:
        return ("alignment", f"K={k} output channels: must be a multiple of 8")
    if pass_ == "dgrad" and c % 8:
        return ("channels", f"dx of a {c}-channel input (the stem's image): dgrad kernels take C multiple of 8")
    if pass_ == "wgrad" and c % 4:
        return ("channels", f"dw of a {c}-channel input: wgrad kernels take C multiple of 4 (pad the stem to 4)")
    if pass_ == "dgrad" and max(r, s) > 32:
        return ("filter", f"{r}x{s} filter: the dgrad kernels take at most 32x32")
    if max(x.numel(), grad.numel(), weight.numel()) > 2**31 - 1:
        return ("size", "the implicit-GEMM kernels index with 32-bit integers")
    if not (grad.is_contiguous() and x.is_contiguous() and weight.is_contiguous()):
        return ("layout", "grad, x and weight must be contiguous (packed NHWC / KRSC)")
    return None


def _bwd_part(pass_, grad, x, weight, stride, padding):
    if _bwd_why_not(grad, x, weight, stride, padding, pass_):
        return common.PLAN_FALLBACK
    n, h, w, c = x.shape
    k, r, s, _ = weight.shape
    if grad.numel() == 0 or x.numel() == 0 or weight.numel() == 0:
        return common.PLAN_EMPTY
    dev = runtime.device_info(x.device.index)
    choice = select_conv2d_backward(pass_, grad.shape[0] * grad.shape[1] * grad.shape[2], k, r * s * c, c,
                                    common.DTYPES[x.dtype], runtime.arch_for(dev.cc), dev.name,
                                    conv_window(c, k, r, s, w, stride, padding))
    return common.kernel_plan(choice, x.device.index)


def _bwd_plan(grad, x, weight, stride, padding, need_dx, need_dw, need_db):
    """(dgrad kernel, source, wgrad kernel, source): each part planned only when asked for."""
    _bwd_check(grad, x, weight, stride, padding)
    d = _bwd_part("dgrad", grad, x, weight, stride, padding) if need_dx else common.PLAN_FALLBACK
    w = _bwd_part("wgrad", grad, x, weight, stride, padding) if (need_dw or need_db) else common.PLAN_FALLBACK
    return (*d, *w)


def conv2d_nhwc_backward_reference(grad, x, weight, stride, padding, need_dx=True, need_dw=True, need_db=True):
    """The same gradients in PyTorch (fp32 math for 16-bit inputs, rounded once); empty (0,) for
    what is not asked for."""
    cdt = torch.promote_types(x.dtype, torch.float32)
    g = grad.permute(0, 3, 1, 2).to(cdt)
    dx, dw = x.new_empty(0), x.new_empty(0)  # distinct tensors: outputs must not alias
    if need_dx:
        w = weight.permute(0, 3, 1, 2).to(cdt)
        dx = torch.nn.grad.conv2d_input(x.permute(0, 3, 1, 2).shape, w, g, stride, padding)
        dx = dx.permute(0, 2, 3, 1).to(x.dtype).contiguous()
    if need_dw:
        xf = x.permute(0, 3, 1, 2).to(cdt)
        dw = torch.nn.grad.conv2d_weight(xf, weight.permute(0, 3, 1, 2).shape, g, stride, padding)
        dw = dw.permute(0, 2, 3, 1).to(x.dtype).contiguous()
    db = g.sum((0, 2, 3)).to(x.dtype) if need_db else x.new_empty(0)
    return dx, dw, db


def _bwd_fallback(grad, x, weight, stride, padding, need_dx, need_dw, need_db):
    _bwd_check(grad, x, weight, stride, padding)
    why = (_bwd_why_not(grad, x, weight, stride, padding, "dgrad") if need_dx else None) or \
        (_bwd_why_not(grad, x, weight, stride, padding, "wgrad") if (need_dw or need_db) else None)
    common.record_fallback("conv2d_nhwc_backward", why, grad, x, weight)
    return conv2d_nhwc_backward_reference(grad, x, weight, stride, padding, need_dx, need_dw, need_db)


def _bwd_fake(grad, x, weight, stride, padding, need_dx, need_dw, need_db):
    _bwd_check(grad, x, weight, stride, padding)
    return (x.new_empty(x.shape if need_dx else (0,)), x.new_empty(weight.shape if need_dw else (0,)),
            x.new_empty((weight.shape[0],) if need_db else (0,)))


common.register_op("conv2d_nhwc_backward", plan=_bwd_plan, fallback=_bwd_fallback, fake=_bwd_fake)
