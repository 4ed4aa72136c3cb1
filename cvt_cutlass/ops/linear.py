"""Linear ops: ``torch.ops.cvt_cutlass.linear`` and ``torch.ops.cvt_cutlass.linear_gelu_aux``.

``linear(x, weight, bias=None, residual=None, activation="none")`` computes
``act(x @ weight^T + bias) (+ residual)`` like ``F.linear`` followed by ``F.gelu`` or ``+ r``:

=====================  ===================  ==================
bias / residual / act  CUTLASS epilogue     PyTorch sequence
=====================  ===================  ==================
- / - / none           none                 F.linear
b / - / none           bias                 F.linear
b / - / gelu           bias_gelu            F.linear, F.gelu
b / r / none           bias_residual        F.linear, + r
=====================  ===================  ==================

Shapes: x (..., K), weight (N, K) as nn.Linear stores it (used in place, never transposed or
copied), bias (N,), residual (..., N); returns (..., N) in x's dtype (fp16/bf16; fp32 accumulate).

The ops are defined in C++ (csrc/ops/linear.cpp: schema, CUDA hot path with a plan per call
signature); this module holds the planner, the PyTorch fallback, the fake kernels and autograd.
Wrong arguments (shapes, mixed dtypes or devices, non-floating dtypes) raise. Calls no kernel can
serve (CPU tensors, fp32, N or K not a multiple of 8, rows that are not 16-byte aligned, a GPU
older than sm_80, a bias/residual/activation combination without a kernel) run the PyTorch
sequence instead, counted and logged by :mod:`cvt_cutlass.fallback` (or raise in strict mode).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import runtime
from ..selection import select_linear
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

ACTIVATIONS = ("none", "gelu")
_EPILOGUES = {
    (False, False, "none"): "none",
    (True, False, "none"): "bias",
    (True, False, "gelu"): "bias_gelu",
    (True, True, "none"): "bias_residual",
}


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, residual: Optional[Tensor] = None,
           activation: str = "none") -> Tensor:
    """``act(x @ weight^T + bias) (+ residual)`` on one CUTLASS kernel (see the module docstring)."""
    return torch.ops.cvt_cutlass.linear.default(x, weight, bias, residual, activation)


def linear_gelu_aux(x: Tensor, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(gelu(x W^T + b), x W^T + b): the pre-activation is stored by the same epilogue, for backward."""
    return torch.ops.cvt_cutlass.linear_gelu_aux.default(x, weight, bias)


def epilogue_for(has_bias: bool, has_residual: bool, activation: str) -> str | None:
    """The CUTLASS epilogue for an argument combination, or None if none is instantiated."""
    return _EPILOGUES.get((has_bias, has_residual, activation))


def _check_args(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
                activation: str) -> None:
    """User errors raise, whatever the device (also under fake tensors)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"cvt_cutlass.linear: activation must be one of {ACTIVATIONS}, got {activation!r}")
    check_floating("linear", x=x, weight=weight, bias=bias, residual=residual)
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"cvt_cutlass.linear: x (..., K) and weight (N, K) do not match: {tuple(x.shape)} vs {tuple(weight.shape)}"
        )
    n = weight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"cvt_cutlass.linear: bias must be ({n},), got {tuple(bias.shape)}")
    if residual is not None and tuple(residual.shape) != (*x.shape[:-1], n):
        raise ValueError(f"cvt_cutlass.linear: residual must be {(*x.shape[:-1], n)}, got {tuple(residual.shape)}")
    check_like("linear", "x", x, weight=weight, bias=bias, residual=residual)


def _rows_ok(t: Tensor, cols: int) -> bool:
    """t viewable as (rows, cols) with unit column stride and rows 16 bytes apart, without a copy."""
    if t.numel() == 0:
        return True
    try:
        v = t.view(-1, cols)
    except RuntimeError:
        return False
    return v.stride(1) == 1 and not (v.size(0) > 1 and v.stride(0) % 8)


def _why_not(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor], epilogue: str | None):
    """(reason, detail) when no kernel serves these arguments (sizes, strides, dtypes, devices:
    what the hot path's plan key holds), else None."""
    why = device_plan(x)
    if why:
        return why
    if epilogue is None:
        return ("epilogue", f"bias={bias is not None}, residual={residual is not None} has no fused kernel")
    n, k = weight.shape
    if n % 8 or k % 8 or k == 0:
        return ("alignment", f"N={n}, K={k}: both must be positive multiples of 8 (16-byte rows)")
    if x.numel() // k > 2**31 - 1:
        return ("size", f"{x.numel() // k} rows: the kernels index rows with 32-bit integers")
    if not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        return ("layout", "weight and bias must be contiguous")
    if not _rows_ok(x, k):
        return ("layout", f"x {tuple(x.shape)} strides {x.stride()} cannot be viewed as 16-byte aligned rows")
    if residual is not None and not _rows_ok(residual, n):
        return ("layout", "residual cannot be viewed as 16-byte aligned rows")
    return None


def _torch_linear(x, weight, bias, residual, activation):
    y = F.linear(x, weight, bias)
    if activation == "gelu":
        y = F.gelu(y)
    if residual is not None:
        y = y + residual
    return y


def _select(x, weight, bias, residual, epilogue: str | None) -> tuple[int, int]:
    """The planner's answer for checked arguments: a kernel, the fallback, or nothing to do."""
    if _why_not(x, weight, bias, residual, epilogue):
        return PLAN_FALLBACK
    m, (n, k) = x.numel() // max(x.shape[-1], 1), weight.shape
    if m == 0 or n == 0:
        return PLAN_EMPTY
    dev = runtime.device_info(x.device.index)
    return kernel_plan(select_linear(m, n, k, _DTYPES[x.dtype], epilogue, runtime.arch_for(dev.cc), dev.name),
                       x.device.index)


# ----------------------------------------------------------------------------- linear
def _plan(x, weight, bias=None, residual=None, activation="none"):
    _check_args(x, weight, bias, residual, activation)
    return _select(x, weight, bias, residual, epilogue_for(bias is not None, residual is not None, activation))


def _fallback(x, weight, bias=None, residual=None, activation="none"):
    _check_args(x, weight, bias, residual, activation)
    epilogue = epilogue_for(bias is not None, residual is not None, activation)
    record_fallback("linear", _why_not(x, weight, bias, residual, epilogue), x, weight, bias, residual)
    return _torch_linear(x, weight, bias, residual, activation)


def _fake(x, weight, bias=None, residual=None, activation="none"):
    _check_args(x, weight, bias, residual, activation)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _setup(ctx, inputs, output):
    x, weight, bias, residual, activation = inputs
    ctx.activation = activation
    ctx.has_bias = bias is not None
    ctx.has_residual = residual is not None
    ctx.save_for_backward(x, weight, bias)


def _linear_grads(ctx, g: Tensor, x: Tensor, weight: Tensor):
    """dx, dW, db for dL/d(pre-activation) = g (PyTorch matmuls until the CUTLASS backward lands)."""
    n, k = weight.shape
    g2 = g.reshape(-1, n)
    dx = (g2 @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
    dw = g2.t() @ x.reshape(-1, k) if ctx.needs_input_grad[1] else None
    db = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return dx, dw, db


def _backward(ctx, grad: Tensor):
    x, weight, bias = ctx.saved_tensors
    g = grad
    if ctx.activation == "gelu":
        # The pre-activation was not kept (use linear_gelu_aux in training): recompute it.
        z = torch.ops.cvt_cutlass.linear(x, weight, bias)
        g = torch.ops.aten.gelu_backward(grad, z)
    dx, dw, db = _linear_grads(ctx, g, x, weight)
    dr = grad if ctx.has_residual and ctx.needs_input_grad[3] else None
    return dx, dw, db, dr, None


register_op("linear", plan=_plan, fallback=_fallback, fake=_fake, backward=_backward, setup_context=_setup)


# ----------------------------------------------------------------------------- linear_gelu_aux
def _aux_plan(x, weight, bias):
    _check_args(x, weight, bias, None, "gelu")
    return _select(x, weight, bias, None, "bias_gelu_aux")


def _aux_fallback(x, weight, bias):
    _check_args(x, weight, bias, None, "gelu")
    record_fallback("linear_gelu_aux", _why_not(x, weight, bias, None, "bias_gelu_aux"), x, weight, bias)
    z = F.linear(x, weight, bias)
    return F.gelu(z), z


def _aux_fake(x, weight, bias):
    _check_args(x, weight, bias, None, "gelu")
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    return out, torch.empty_like(out)


def _aux_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.has_bias = True
    ctx.save_for_backward(x, weight, output[1])


def _aux_backward(ctx, grad_out: Optional[Tensor], grad_z: Optional[Tensor]):
    x, weight, z = ctx.saved_tensors
    g = torch.ops.aten.gelu_backward(grad_out, z) if grad_out is not None else torch.zeros_like(z)
    if grad_z is not None:
        g = g + grad_z
    return _linear_grads(ctx, g, x, weight)


register_op("linear_gelu_aux", plan=_aux_plan, fallback=_aux_fallback, fake=_aux_fake, backward=_aux_backward,
            setup_context=_aux_setup)
