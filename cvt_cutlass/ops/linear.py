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

Wrong arguments (shapes, mixed dtypes or devices) raise. Calls no kernel can serve (CPU tensors,
fp32, N or K not a multiple of 8, rows that are not 16-byte aligned, a GPU older than sm_80, a
bias/residual/activation combination without a kernel) run the PyTorch sequence instead, counted
and logged by :mod:`cvt_cutlass.fallback` (or raise in strict mode).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import fallback, runtime
from ..selection import select_linear
from .common import DTYPES as _DTYPES
from .common import aligned as _aligned

ACTIVATIONS = ("none", "gelu")
_EPILOGUES = {
    (False, False, "none"): "none",
    (True, False, "none"): "bias",
    (True, False, "gelu"): "bias_gelu",
    (True, True, "none"): "bias_residual",
}


def epilogue_for(has_bias: bool, has_residual: bool, activation: str) -> str | None:
    """The CUTLASS epilogue for an argument combination, or None if none is instantiated."""
    return _EPILOGUES.get((has_bias, has_residual, activation))


def _check_args(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
                activation: str) -> None:
    """User errors raise, whatever the device (also under fake tensors)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"cvt_cutlass.linear: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"cvt_cutlass.linear: x (..., K) and weight (N, K) do not match: {tuple(x.shape)} vs {tuple(weight.shape)}"
        )
    n = weight.shape[0]
    tensors = [("weight", weight)]
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"cvt_cutlass.linear: bias must be ({n},), got {tuple(bias.shape)}")
        tensors.append(("bias", bias))
    if residual is not None:
        want = (*x.shape[:-1], n)
        if tuple(residual.shape) != want:
            raise ValueError(f"cvt_cutlass.linear: residual must be {want}, got {tuple(residual.shape)}")
        tensors.append(("residual", residual))
    for name, t in tensors:
        if t.dtype != x.dtype:
            raise TypeError(f"cvt_cutlass.linear: {name} is {t.dtype} but x is {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"cvt_cutlass.linear: {name} is on {t.device} but x is on {x.device}")


def _rows_view(t: Tensor, cols: int) -> Tensor | None:
    """t as (rows, cols) with unit column stride and 16-byte aligned rows, without a copy."""
    if t.numel() == 0:
        return t.reshape(-1, cols)
    try:
        v = t.view(-1, cols)
    except RuntimeError:
        return None
    if v.stride(1) != 1 or (v.size(0) > 1 and v.stride(0) % 8) or not _aligned(v):
        return None
    return v


def _plan_call(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
               epilogue: str | None):
    """(None, x2, r2) with x and residual as (rows, cols) views when a kernel can serve this
    call, else ((reason, detail), None, None)."""
    if x.device.type != "cuda":
        return ("device", f"{x.device.type} tensors"), None, None
    if x.dtype not in _DTYPES:
        return ("dtype", f"{x.dtype} (kernels take float16/bfloat16)"), None, None
    if epilogue is None:
        detail = f"bias={bias is not None}, residual={residual is not None} has no fused kernel"
        return ("epilogue", detail), None, None
    n, k = weight.shape
    if n % 8 or k % 8:
        return ("alignment", f"N={n}, K={k}: both must be multiples of 8 (16-byte rows)"), None, None
    cc = runtime.device_info(x.device.index).cc
    if runtime.arch_for(cc) is None:
        return ("arch", f"compute capability {cc // 10}.{cc % 10} < 8.0"), None, None
    if not weight.is_contiguous() or not _aligned(weight):
        return ("layout", "weight must be contiguous and 16-byte aligned"), None, None
    if bias is not None and (not bias.is_contiguous() or not _aligned(bias)):
        return ("layout", "bias must be contiguous and 16-byte aligned"), None, None
    x2 = _rows_view(x, k)
    if x2 is None:
        detail = f"x {tuple(x.shape)} strides {x.stride()} cannot be viewed as 16-byte aligned rows"
        return ("layout", detail), None, None
    r2 = None
    if residual is not None:
        r2 = _rows_view(residual, n)
        if r2 is None:
            return ("layout", "residual cannot be viewed as 16-byte aligned rows"), None, None
    return None, x2, r2


def _torch_linear(x, weight, bias, residual, activation):
    y = F.linear(x, weight, bias)
    if activation == "gelu":
        y = F.gelu(y)
    if residual is not None:
        y = y + residual
    return y


def _launch(x2: Tensor, weight: Tensor, bias, r2, out2: Tensor, aux2, epilogue: str) -> None:
    m, k = x2.shape
    n = weight.shape[0]
    dev = runtime.device_info(x2.device.index)
    arch = runtime.arch_for(dev.cc)
    choice = select_linear(m, n, k, _DTYPES[x2.dtype], epilogue, arch, dev.name)
    kid = runtime.load_kernel(choice.spec, dev.cc)
    torch.ops.cvt_cutlass_C.gemm(kid, x2, weight, bias, r2, out2, aux2)
    fallback.record_kernel_call("linear")
    fallback.record_selection("linear", choice.source)


@torch.library.custom_op("cvt_cutlass::linear", mutates_args=())
def linear(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    residual: Optional[Tensor] = None,
    activation: str = "none",
) -> Tensor:
    _check_args(x, weight, bias, residual, activation)
    epilogue = epilogue_for(bias is not None, residual is not None, activation)
    why, x2, r2 = _plan_call(x, weight, bias, residual, epilogue)
    if why is not None:
        fallback.record_fallback("linear", *why)
        return _torch_linear(x, weight, bias, residual, activation)
    n = weight.shape[0]
    out = x.new_empty(*x.shape[:-1], n)
    if out.numel() == 0:
        return out
    _launch(x2, weight, bias, r2, out.view(-1, n), None, epilogue)
    return out


@linear.register_fake
def _(x, weight, bias=None, residual=None, activation="none"):
    _check_args(x, weight, bias, residual, activation)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _linear_setup_context(ctx, inputs, output):
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


def _linear_backward(ctx, grad: Tensor):
    x, weight, bias = ctx.saved_tensors
    g = grad
    if ctx.activation == "gelu":
        # The pre-activation was not kept (use linear_gelu_aux in training): recompute it.
        z = torch.ops.cvt_cutlass.linear(x, weight, bias)
        g = torch.ops.aten.gelu_backward(grad, z)
    dx, dw, db = _linear_grads(ctx, g, x, weight)
    dr = grad if ctx.has_residual and ctx.needs_input_grad[3] else None
    return dx, dw, db, dr, None


linear.register_autograd(_linear_backward, setup_context=_linear_setup_context)


@torch.library.custom_op("cvt_cutlass::linear_gelu_aux", mutates_args=())
def linear_gelu_aux(x: Tensor, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(gelu(x W^T + b), x W^T + b): the pre-activation is stored by the same epilogue, for backward."""
    _check_args(x, weight, bias, None, "gelu")
    why, x2, _ = _plan_call(x, weight, bias, None, "bias_gelu_aux")
    if why is not None:
        fallback.record_fallback("linear_gelu_aux", *why)
        z = F.linear(x, weight, bias)
        return F.gelu(z), z
    n = weight.shape[0]
    out = x.new_empty(*x.shape[:-1], n)
    z = torch.empty_like(out)
    if out.numel() == 0:
        return out, z
    _launch(x2, weight, bias, None, out.view(-1, n), z.view(-1, n), "bias_gelu_aux")
    return out, z


@linear_gelu_aux.register_fake
def _(x, weight, bias):
    _check_args(x, weight, bias, None, "gelu")
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    return out, torch.empty_like(out)


def _aux_setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.has_bias = True
    ctx.save_for_backward(x, weight, output[1])


def _aux_backward(ctx, grad_out: Tensor, grad_z: Optional[Tensor]):
    x, weight, z = ctx.saved_tensors
    g = torch.ops.aten.gelu_backward(grad_out, z) if grad_out is not None else torch.zeros_like(z)
    if grad_z is not None:
        g = g + grad_z
    return _linear_grads(ctx, g, x, weight)


linear_gelu_aux.register_autograd(_aux_backward, setup_context=_aux_setup_context)
