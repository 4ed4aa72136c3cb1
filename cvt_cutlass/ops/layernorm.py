"""LayerNorm on CvT's tokens: ``torch.ops.cvt_cutlass.layer_norm_tokens``.

``layer_norm_tokens(x, weight, bias, eps, prefix=None, out_dtype=None)``: x (B, L, C) tokens
(unit stride along C; rows and images may be strided), weight and bias (C,) of one dtype,
``prefix`` an optional (P, C) tensor in the output's dtype; returns a new contiguous
(B, P + L, C) in ``out_dtype`` (default: the weight's) whose first P rows of every image are
``prefix`` and the rest ``LayerNorm(x)`` (statistics in fp32). CvT's stage-3 embedding writes its
cls token this way instead of a ``torch.cat``. x and the output take the weight's dtype, or, with
16-bit weights, one of them float32: an fp32 residual stream (HF's CvT under autocast), read by a
layer's LayerNorm (fp32 x) and started by an embedding's (fp32 output); the backward then gives dx
in x's dtype and the weight's gradients in the weight's.

Defined in C++ (csrc/ops/layernorm.cpp: schema, CUDA hot path); this module holds the planner,
the PyTorch fallback, the fake kernel and autograd. Wrong arguments raise. Calls no kernel can
serve (CPU tensors, fp32 activations, channel counts that are not a multiple of 8 or above 4096,
misaligned views, a GPU older than sm_80) run the PyTorch equivalent, counted and logged by
:mod:`cvt_cutlass.fallback` (or raise in strict mode). Backward: ``layer_norm_tokens_backward``,
its own kernel (dx in one pass, dweight / dbias from per-block partials; up to three gradients of
the output summed and a residual branch's gradient added in the pass), with the same visible
fallback; the prefix (cls) rows' gradient is their sum over images.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import runtime
from ..operators.layernorm import bwd_channels_supported, channels_supported, select_layernorm
from . import common

MAX_MORE_GRADS = 2  # further output gradients the backward kernel sums (operators/layernorm/abi.h)


def layer_norm_tokens(x: Tensor, weight: Tensor, bias: Tensor, eps: float, prefix: Optional[Tensor] = None,
                      out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """[prefix; LayerNorm(x)] per image on one kernel (see the module docstring)."""
    return torch.ops.cvt_cutlass.layer_norm_tokens.default(x, weight, bias, eps, prefix, out_dtype)


def layer_norm_tokens_reference(x: Tensor, weight: Tensor, bias: Tensor, eps: float,
                                prefix: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """The same math in PyTorch: LayerNorm computed in fp32 (or wider, as x), rounded once to the
    output's dtype (``out_dtype``, default the weight's), prefix rows in front."""
    cdt = torch.promote_types(x.dtype, torch.float32)
    out = out_dtype or weight.dtype
    y = F.layer_norm(x.to(cdt), (x.shape[-1],), weight.to(cdt), bias.to(cdt), eps).to(out)
    if prefix is None:
        return y.contiguous()
    return torch.cat([prefix.unsqueeze(0).expand(x.shape[0], -1, -1), y], 1)


def stream_io(x_dtype: torch.dtype, w_dtype: torch.dtype, y_dtype: torch.dtype) -> str:
    """The kernels' fp32 side for these dtypes (operators/layernorm/spec.py: io): "xf32" for fp32
    x, "yf32" for an fp32 output (or dy) with 16-bit weights, "" when all share the weight's."""
    if w_dtype == torch.float32:
        return ""
    return "xf32" if x_dtype == torch.float32 else "yf32" if y_dtype == torch.float32 else ""


def _check_stream_dtypes(op: str, x: Tensor, weight: Tensor, y_name: str, y_dtype: torch.dtype) -> None:
    """x and the output (or its gradient) in the weight's dtype, or one of them float32."""
    w = weight.dtype
    for name, dt in (("x", x.dtype), (y_name, y_dtype)):
        if dt not in (w, torch.float32):
            raise TypeError(f"cvt_cutlass.{op}: {name} is {dt} but the weight is {w} (the weight's dtype or float32)")
    if w != torch.float32 and x.dtype == y_dtype == torch.float32:
        raise TypeError(f"cvt_cutlass.{op}: x and {y_name} are both float32 with a {w} weight (one of them may be)")


def _check(x: Tensor, weight: Tensor, bias: Tensor, eps: float, prefix: Optional[Tensor],
           out_dtype: Optional[torch.dtype] = None) -> None:
    common.check_floating("layer_norm_tokens", x=x, weight=weight, bias=bias, prefix=prefix)
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
    out = out_dtype or weight.dtype
    _check_stream_dtypes("layer_norm_tokens", x, weight, "the output", out)
    common.check_like("layer_norm_tokens", "weight", weight, bias=bias)
    common.check_like("layer_norm_tokens", "x", x, out, prefix=prefix)
    common.check_like("layer_norm_tokens", "x", x, weight.dtype, weight=weight)


def _why_not(x: Tensor, weight: Tensor, bias: Tensor, prefix: Optional[Tensor]):
    """(reason, detail) when no kernel serves these arguments, else None."""
    why = common.device_plan(weight if x.dtype == torch.float32 else x)  # fp32 x with 16-bit weights: a kernel
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


def _plan(x, weight, bias, eps, prefix=None, out_dtype=None):
    _check(x, weight, bias, eps, prefix, out_dtype)
    if _why_not(x, weight, bias, prefix):
        return common.PLAN_FALLBACK
    b, rows, c = x.shape
    if b * rows * c == 0:
        return common.PLAN_EMPTY  # nothing to normalise: the hot path writes the prefix rows, if any
    dev = runtime.device_info(x.device.index)
    io = stream_io(x.dtype, weight.dtype, out_dtype or weight.dtype)
    choice = select_layernorm(b * rows, c, common.DTYPES[weight.dtype], runtime.arch_for(dev.cc), dev.name, io=io)
    return common.kernel_plan(choice, x.device.index)


def _fallback(x, weight, bias, eps, prefix=None, out_dtype=None):
    _check(x, weight, bias, eps, prefix, out_dtype)
    common.record_fallback("layer_norm_tokens", _why_not(x, weight, bias, prefix), x, weight, bias, prefix)
    return layer_norm_tokens_reference(x, weight, bias, eps, prefix, out_dtype)


def _fake(x, weight, bias, eps, prefix=None, out_dtype=None):
    _check(x, weight, bias, eps, prefix, out_dtype)
    pre = 0 if prefix is None else prefix.shape[0]
    return x.new_empty(x.shape[0], pre + x.shape[1], x.shape[2], dtype=out_dtype or weight.dtype)


# autograd: csrc/ops/layernorm.cpp (LayerNormFn: saves x and weight; dx, dweight, dbias by
# layer_norm_tokens_backward; the cls prefix rows' gradient summed over images)
common.register_op("layer_norm_tokens", plan=_plan, fallback=_fallback, fake=_fake)


# ----------------------------------------------------------------------------- backward
def layer_norm_tokens_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float,
                               residual_grad: Tensor | None = None,
                               more_grads: Sequence[Tensor] = ()) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias) of ``LayerNorm(x) * weight + bias`` over the channels of tokens x
    (B, L, C), from grad (B, L, C) (any image / row strides, unit channel stride): one kernel pass
    for dx (statistics recomputed in registers), per-block fp32 partials for dweight / dbias.
    ``residual_grad`` (B, L, C), x's gradient from another branch (a residual connection), is
    added to dx in the same pass (in fp32, rounded once); in x's dtype, or, with fp32 x (an fp32
    residual stream), in the weight's 16-bit dtype too (a stream ending in 16 bits before the next
    embedding: its gradient comes back 16-bit). ``more_grads``: up to two further
    gradients of the output (contiguous (B, L, C), where the output feeds several ops: CvT's
    q / k / v projections), summed with grad in fp32 as they are loaded."""
    if len(more_grads) > MAX_MORE_GRADS:
        raise ValueError(f"cvt_cutlass.layer_norm_tokens_backward: more_grads takes at most {MAX_MORE_GRADS} "
                         f"tensors, got {len(more_grads)}")
    g2, g3 = (*more_grads, None, None)[:2]
    return torch.ops.cvt_cutlass.layer_norm_tokens_backward.default(grad, x, weight, eps, residual_grad, g2, g3)


def _more(grad2, grad3) -> list[Tensor]:
    return [g for g in (grad2, grad3) if g is not None]


def _bwd_check(grad, x, weight, eps, residual_grad=None, grad2=None, grad3=None):
    more_grads = _more(grad2, grad3)
    common.check_floating("layer_norm_tokens_backward", grad=grad, x=x, weight=weight)
    if x.dim() != 3 or tuple(grad.shape) != tuple(x.shape) or tuple(weight.shape) != (x.shape[2],):
        raise ValueError(f"cvt_cutlass.layer_norm_tokens_backward: grad and x must be (B, L, C) alike and weight "
                         f"(C,): {tuple(grad.shape)}, {tuple(x.shape)}, {tuple(weight.shape)}")
    if residual_grad is not None and tuple(residual_grad.shape) != tuple(x.shape):
        raise ValueError(f"cvt_cutlass.layer_norm_tokens_backward: residual_grad must be shaped like x "
                         f"{tuple(x.shape)}, got {tuple(residual_grad.shape)}")
    if any(tuple(g.shape) != tuple(x.shape) for g in more_grads):
        raise ValueError(f"cvt_cutlass.layer_norm_tokens_backward: grad2 / grad3 must be shaped like x "
                         f"{tuple(x.shape)}, got {[tuple(g.shape) for g in more_grads]}")
    if not eps > 0:
        raise ValueError(f"cvt_cutlass.layer_norm_tokens_backward: eps must be > 0, got {eps}")
    _check_stream_dtypes("layer_norm_tokens_backward", x, weight, "grad", grad.dtype)
    common.check_like("layer_norm_tokens_backward", "x", x, weight.dtype, weight=weight)
    if residual_grad is not None and residual_grad.dtype != x.dtype and not (
            x.dtype == torch.float32 and residual_grad.dtype == weight.dtype):
        raise TypeError(f"cvt_cutlass.layer_norm_tokens_backward: residual_grad is {residual_grad.dtype}; it takes "
                        f"x's dtype ({x.dtype}), or the weight's beside float32 x")
    common.check_like("layer_norm_tokens_backward", "x", x, residual_grad.dtype if residual_grad is not None else None,
                      residual_grad=residual_grad)
    common.check_like("layer_norm_tokens_backward", "grad", grad, grad2=grad2, grad3=grad3)


def _bwd_why_not(grad, x, weight, residual_grad=None, grad2=None, grad3=None):
    why = common.device_plan(weight if x.dtype == torch.float32 else x)
    if why:
        return why
    c = x.shape[2]
    if not bwd_channels_supported(c):
        return ("channels", f"C={c}: the backward kernels take multiples of 8 up to 1024 that split into "
                            "at most 4 vectors over 32 threads")
    for t in (x, grad):
        if t.stride(2) != 1 or t.stride(1) % 8 or (t.shape[0] > 1 and t.stride(0) % 8):
            return ("layout", f"strides {t.stride()}: rows must be contiguous, 16-byte aligned")
    if not weight.is_contiguous():
        return ("layout", "weight must be contiguous")
    if residual_grad is not None and not residual_grad.is_contiguous():
        return ("layout", "residual_grad must be contiguous")
    if not all(g.is_contiguous() for g in _more(grad2, grad3)):
        return ("layout", "grad2 / grad3 must be contiguous")
    return None


def _bwd_plan(grad, x, weight, eps, residual_grad=None, grad2=None, grad3=None):
    _bwd_check(grad, x, weight, eps, residual_grad, grad2, grad3)
    if _bwd_why_not(grad, x, weight, residual_grad, grad2, grad3):
        return common.PLAN_FALLBACK
    b, rows, c = x.shape
    if b * rows * c == 0:
        return common.PLAN_EMPTY
    dev = runtime.device_info(x.device.index)
    io = stream_io(x.dtype, weight.dtype, grad.dtype)
    if io == "xf32" and residual_grad is not None and residual_grad.dtype != x.dtype:
        io = "xf32r16"  # the residual gradient in the weight's dtype
    choice = select_layernorm(b * rows, c, common.DTYPES[weight.dtype], runtime.arch_for(dev.cc), dev.name, "bwd", io)
    return common.kernel_plan(choice, x.device.index)


def _bwd_fallback(grad, x, weight, eps, residual_grad=None, grad2=None, grad3=None):
    _bwd_check(grad, x, weight, eps, residual_grad, grad2, grad3)
    common.record_fallback("layer_norm_tokens_backward",
                           _bwd_why_not(grad, x, weight, residual_grad, grad2, grad3), grad, x, weight, residual_grad,
                           grad2, grad3)
    cdt = torch.promote_types(x.dtype, torch.float32)
    cdt = torch.promote_types(cdt, grad.dtype)
    xf, gf, wf = x.to(cdt), grad.to(cdt), weight.to(cdt)
    for g in _more(grad2, grad3):
        gf = gf + g.to(cdt)
    mean = xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt(xf.var(-1, unbiased=False, keepdim=True) + eps)
    xhat = (xf - mean) * rstd
    gw = gf * wf
    dx = rstd * (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True))
    if residual_grad is not None:
        dx = dx + residual_grad.to(cdt)
    c, wdt = x.shape[2], weight.dtype
    return dx.to(x.dtype), (gf * xhat).reshape(-1, c).sum(0).to(wdt), gf.reshape(-1, c).sum(0).to(wdt)


def _bwd_fake(grad, x, weight, eps, residual_grad=None, grad2=None, grad3=None):
    _bwd_check(grad, x, weight, eps, residual_grad, grad2, grad3)
    return torch.empty_like(x, memory_format=torch.contiguous_format), weight.new_empty(x.shape[2]), \
        weight.new_empty(x.shape[2])


common.register_op("layer_norm_tokens_backward", plan=_bwd_plan, fallback=_bwd_fallback, fake=_bwd_fake)
