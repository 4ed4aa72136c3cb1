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

The CvT layer op's drop path runs in the epilogue of a private variant,
``cvt_cutlass_C::linear_row_scaled(x, weight, bias, residual, row_scale, scale)``: per token row an
fp32 scale s, ``(x W^T + b) * s + residual`` (scale "branch", epilogue bias_scale_residual) or
``(x W^T + b + residual) * s`` ("all", bias_residual_scale); no autograd (the layer op's backward
applies the scales). Another, ``cvt_cutlass_C::linear_rounded(x, weight, bias, residual)``, adds an
fp32 residual in fp32 and rounds the sum once to x's dtype (kernels with residual variant "f32in"):
a stage's last sum on an fp32 residual stream, which the next embedding reads in 16 bits. A third,
``cvt_cutlass_C::linear_gelu_dgelu(x, weight, bias)``, is the mlp and layer ops' fc1: ``gelu(z)`` and
``gelu'(z)`` (fp16 for 16-bit x; epilogue bias_gelu_dgelu), what fc2's input gradient multiplies by.

Shapes: x (..., K), weight (N, K) as nn.Linear stores it (used in place, never transposed or
copied), bias (N,), residual (..., N); returns (..., N) in x's dtype (fp16/bf16; fp32 accumulate).
An fp32 residual with 16-bit x (linear, mlp and the row-scaled variant: an fp32 residual stream, as HF's CvT keeps under autocast) is
added in fp32 and the result is fp32 (the kernels' epilogue reads and writes fp32: no rounding of
the branch to 16 bits); its gradient reaches the residual in fp32 and the GEMMs in x's dtype.

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
from ..epilogues import LINEAR_EPILOGUES
from ..epilogues import gelu_grad as gelu_derivative
from ..operators.linear import select_linear, select_linear_backward
from . import common

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
    common.check_floating("linear", x=x, weight=weight, bias=bias, residual=residual)
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"cvt_cutlass.linear: x (..., K) and weight (N, K) do not match: {tuple(x.shape)} vs {tuple(weight.shape)}"
        )
    n = weight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"cvt_cutlass.linear: bias must be ({n},), got {tuple(bias.shape)}")
    if residual is not None and tuple(residual.shape) != (*x.shape[:-1], n):
        raise ValueError(f"cvt_cutlass.linear: residual must be {(*x.shape[:-1], n)}, got {tuple(residual.shape)}")
    common.check_like("linear", "x", x, weight=weight, bias=bias)
    if residual is not None and residual.dtype != x.dtype and residual.dtype != torch.float32:
        raise TypeError(f"cvt_cutlass.linear: residual is {residual.dtype} but x is {x.dtype} (the residual takes "
                        "x's dtype or float32)")
    common.check_like("linear", "x", x, residual.dtype if residual is not None else None, residual=residual)


def residual_kind(x: Tensor, residual: Optional[Tensor]) -> str:
    """The kernels' residual variant: "f32" for an fp32 residual (and output) with 16-bit x, else ""."""
    return "f32" if residual is not None and residual.dtype == torch.float32 and x.dtype != torch.float32 else ""


def _out_dtype(x: Tensor, residual: Optional[Tensor]) -> torch.dtype:
    return torch.float32 if residual_kind(x, residual) else x.dtype


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
    why = common.device_plan(x)
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
    if residual_kind(x, residual):  # the kernels' arithmetic: the branch unrounded into the fp32 sum
        x, weight, bias = x.float(), weight.float(), None if bias is None else bias.float()
    y = F.linear(x, weight, bias)
    if activation == "gelu":
        y = F.gelu(y)
    if residual is not None:
        y = y + residual
    return y


def _select(x, weight, bias, residual, epilogue: str | None, residual_variant: str | None = None) -> tuple[int, int]:
    """The planner's answer for checked arguments: a kernel, the fallback, or nothing to do
    (``residual_variant``: the kernels' residual variant, default :func:`residual_kind`'s)."""
    if _why_not(x, weight, bias, residual, epilogue):
        return common.PLAN_FALLBACK
    m, (n, k) = x.numel() // max(x.shape[-1], 1), weight.shape
    if m == 0 or n == 0:
        return common.PLAN_EMPTY
    dev = runtime.device_info(x.device.index)
    variant = residual_kind(x, residual) if residual_variant is None else residual_variant
    choice = select_linear(m, n, k, common.DTYPES[x.dtype], epilogue, runtime.arch_for(dev.cc), dev.name, variant)
    return common.kernel_plan(choice, x.device.index)


# ----------------------------------------------------------------------------- linear
def _plan(x, weight, bias=None, residual=None, activation="none"):
    _check_args(x, weight, bias, residual, activation)
    return _select(x, weight, bias, residual, epilogue_for(bias is not None, residual is not None, activation))


def _fallback(x, weight, bias=None, residual=None, activation="none"):
    _check_args(x, weight, bias, residual, activation)
    epilogue = epilogue_for(bias is not None, residual is not None, activation)
    common.record_fallback("linear", _why_not(x, weight, bias, residual, epilogue), x, weight, bias, residual)
    return _torch_linear(x, weight, bias, residual, activation)


def _fake(x, weight, bias=None, residual=None, activation="none"):
    _check_args(x, weight, bias, residual, activation)
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=_out_dtype(x, residual))


# autograd of linear / linear_gelu_aux / mlp: csrc/ops/linear.cpp (LinearFn, GeluAuxFn, MlpFn)
common.register_op("linear", plan=_plan, fallback=_fallback, fake=_fake)


# ----------------------------------------------------------------------------- row-scaled linear
# The layer op's drop path in the epilogue (csrc/ops/linear.cpp: linear_row_scaled, private): per
# token row s (fp32), "branch": (x W^T + b) * s + residual, "all": (x W^T + b + residual) * s.
ROW_SCALED_EPILOGUES = {e.scale: name for name, e in LINEAR_EPILOGUES.items() if e.scale}


def _row_scaled_check(x, weight, bias, residual, row_scale, scale) -> None:
    _check_args(x, weight, bias, residual, "none")
    if scale not in ROW_SCALED_EPILOGUES:
        raise ValueError(f"cvt_cutlass.linear_row_scaled: scale must be one of {sorted(ROW_SCALED_EPILOGUES)}, "
                         f"got {scale!r}")
    if bias is None or residual is None:
        raise ValueError("cvt_cutlass.linear_row_scaled: takes a bias and a residual")
    rows, want = x.numel() // max(x.shape[-1], 1), torch.promote_types(x.dtype, torch.float32)
    if row_scale.dtype != want or row_scale.shape != (rows,) or row_scale.device != x.device:
        raise ValueError(f"cvt_cutlass.linear_row_scaled: row_scale must be ({rows},) {want} on {x.device}, got "
                         f"{tuple(row_scale.shape)} {row_scale.dtype} on {row_scale.device}")


def _row_scaled_plan(x, weight, bias, residual, row_scale, scale):
    _row_scaled_check(x, weight, bias, residual, row_scale, scale)
    if not row_scale.is_contiguous():  # what the plan key holds (the hot path checks alignment per call)
        return common.PLAN_FALLBACK
    return _select(x, weight, bias, residual, ROW_SCALED_EPILOGUES[scale])


def row_scaled_reference(x, weight, bias, residual, row_scale, scale):
    """The row-scaled Linear in fp32 (fp64 for fp64 x; x's dtype out, fp32 for an fp32 residual):
    the kernels' arithmetic."""
    dt = torch.promote_types(x.dtype, torch.float32)
    s = row_scale.view(*x.shape[:-1], 1).to(dt)
    y = F.linear(x.to(dt), weight.to(dt), bias.to(dt))
    y = y * s + residual.to(dt) if scale == "branch" else (y + residual.to(dt)) * s
    return y.to(_out_dtype(x, residual))


def _row_scaled_fallback(x, weight, bias, residual, row_scale, scale):
    _row_scaled_check(x, weight, bias, residual, row_scale, scale)
    why = _why_not(x, weight, bias, residual, ROW_SCALED_EPILOGUES[scale])
    if why is None and not row_scale.is_contiguous():
        why = ("layout", "row_scale must be contiguous")
    common.record_fallback("linear_row_scaled", why, x, weight, bias, residual, row_scale)
    return row_scaled_reference(x, weight, bias, residual, row_scale, scale)


torch.library.impl("cvt_cutlass_C::linear_row_scaled_plan", "CUDA", _row_scaled_plan)
for _op in ("cvt_cutlass_C::linear_row_scaled_fallback", "cvt_cutlass_C::linear_row_scaled"):
    torch.library.impl(_op, "CompositeExplicitAutograd", _row_scaled_fallback)


# ----------------------------------------------------------------------------- rounded linear
# A stage's last sum on an fp32 residual stream (csrc/ops/linear.cpp: linear_rounded, private):
# x W^T + b + residual with an fp32 residual, in fp32, rounded once to x's dtype.
def _rounded_check(x, weight, bias, residual) -> None:
    _check_args(x, weight, bias, residual, "none")
    if x.dtype not in common.DTYPES or residual.dtype != torch.float32:
        raise TypeError(f"cvt_cutlass.linear_rounded: takes 16-bit x and a float32 residual, got {x.dtype} and "
                        f"{residual.dtype}")


def _rounded_plan(x, weight, bias, residual):
    _rounded_check(x, weight, bias, residual)
    return _select(x, weight, bias, residual, "bias_residual", "f32in")


def _rounded_fallback(x, weight, bias, residual):
    _rounded_check(x, weight, bias, residual)
    common.record_fallback("linear_rounded", _why_not(x, weight, bias, residual, "bias_residual"), x, weight, bias,
                           residual)
    return _torch_linear(x, weight, bias, residual, "none").to(x.dtype)


def _rounded_fake(x, weight, bias, residual):
    _rounded_check(x, weight, bias, residual)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


torch.library.impl("cvt_cutlass_C::linear_rounded_plan", "CUDA", _rounded_plan)
for _op in ("cvt_cutlass_C::linear_rounded_fallback", "cvt_cutlass_C::linear_rounded"):
    torch.library.impl(_op, "CompositeExplicitAutograd", _rounded_fallback)
torch.library.register_fake("cvt_cutlass_C::linear_rounded", _rounded_fake)


# ----------------------------------------------------------------------------- linear_gelu_aux
def _aux_plan(x, weight, bias):
    _check_args(x, weight, bias, None, "gelu")
    return _select(x, weight, bias, None, "bias_gelu_aux")


def _aux_fallback(x, weight, bias):
    _check_args(x, weight, bias, None, "gelu")
    common.record_fallback("linear_gelu_aux", _why_not(x, weight, bias, None, "bias_gelu_aux"), x, weight, bias)
    z = F.linear(x, weight, bias)
    return F.gelu(z), z


def _aux_fake(x, weight, bias):
    _check_args(x, weight, bias, None, "gelu")
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    return out, torch.empty_like(out)


common.register_op("linear_gelu_aux", plan=_aux_plan, fallback=_aux_fallback, fake=_aux_fake)


# ----------------------------------------------------------------------------- linear_gelu_dgelu
# fc1 of the mlp and layer ops (csrc/ops/linear.cpp: linear_gelu_dgelu, private): (gelu(z), gelu'(z))
# with z = x W^T + b; the derivative (what the backward needs of z) in fp16 for 16-bit x: it lies in
# [-0.17, 1.13], where fp16 keeps 11 bits (bf16 8), so the saved factor is as exact as gelu' of z
# rounded to bf16 would be.
def dgelu_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype GELU's saved derivative takes for a compute dtype: fp16 for fp16 and bf16."""
    return torch.float16 if dtype in common.DTYPES else dtype


def _dgelu_plan(x, weight, bias):
    _check_args(x, weight, bias, None, "gelu")
    return _select(x, weight, bias, None, "bias_gelu_dgelu")


def _dgelu_fallback(x, weight, bias):
    _check_args(x, weight, bias, None, "gelu")
    common.record_fallback("linear_gelu_dgelu", _why_not(x, weight, bias, None, "bias_gelu_dgelu"), x, weight, bias)
    return _gelu_and_grad(x, weight, bias)


def _gelu_and_grad(x, weight, bias):
    """(gelu(z), gelu'(z)) as the kernel computes them: z in fp32 (or wider), each output rounded once."""
    wide = torch.promote_types(x.dtype, torch.float32)
    z = F.linear(x.to(wide), weight.to(wide), bias.to(wide))
    return F.gelu(z).to(x.dtype), gelu_derivative(z).to(dgelu_dtype(x.dtype))


def _dgelu_fake(x, weight, bias):
    _check_args(x, weight, bias, None, "gelu")
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    return out, out.new_empty(out.shape, dtype=dgelu_dtype(x.dtype))


torch.library.impl("cvt_cutlass_C::linear_gelu_dgelu_plan", "CUDA", _dgelu_plan)
for _op in ("cvt_cutlass_C::linear_gelu_dgelu_fallback", "cvt_cutlass_C::linear_gelu_dgelu"):
    torch.library.impl(_op, "CompositeExplicitAutograd", _dgelu_fallback)
torch.library.register_fake("cvt_cutlass_C::linear_gelu_dgelu", _dgelu_fake)


# ----------------------------------------------------------------------------- backward GEMMs
def linear_dgrad(grad: Tensor, weight: Tensor, gelu_input: Optional[Tensor] = None,
                 gelu_grad: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(dx, db): dx = grad . weight (grad (..., N), weight (N, K) read in place); with the saved
    pre-activation ``gelu_input`` (..., K) of a GELU, dx *= gelu'(gelu_input) (erf form), or with
    GELU's derivative ``gelu_grad`` (..., K) saved by the forward (:func:`dgelu_dtype`), dx *=
    gelu_grad; then db (K,) = dx summed over rows, both in the GEMM's epilogue. db is (0,) without
    either."""
    return torch.ops.cvt_cutlass.linear_dgrad.default(grad, weight, gelu_input, gelu_grad)


def linear_wgrad(grad: Tensor, x: Tensor, bias: bool) -> tuple[Tensor, Tensor]:
    """(dW, db): dW (N, K) = grad^T . x over all rows (split over the GPU, fp32 accumulation), db
    (N,) = grad summed over rows in the same GEMM when ``bias`` (else (0,))."""
    return torch.ops.cvt_cutlass.linear_wgrad.default(grad, x, bias)


def _dgrad_check(grad, weight, gelu_input, gelu_grad=None):
    common.check_floating("linear_dgrad", grad=grad, weight=weight, gelu_input=gelu_input, gelu_grad=gelu_grad)
    if weight.dim() != 2 or grad.dim() < 1 or grad.shape[-1] != weight.shape[0]:
        raise ValueError(f"cvt_cutlass.linear_dgrad: grad (..., N) and weight (N, K) do not match: "
                         f"{tuple(grad.shape)} vs {tuple(weight.shape)}")
    if gelu_input is not None and gelu_grad is not None:
        raise ValueError("cvt_cutlass.linear_dgrad: takes gelu_input or gelu_grad, not both")
    want = (*grad.shape[:-1], weight.shape[1])
    for name, t in (("gelu_input", gelu_input), ("gelu_grad", gelu_grad)):
        if t is not None and tuple(t.shape) != want:
            raise ValueError(f"cvt_cutlass.linear_dgrad: {name} must be {want}, got {tuple(t.shape)}")
    common.check_like("linear_dgrad", "grad", grad, weight=weight, gelu_input=gelu_input)
    common.check_like("linear_dgrad", "grad", grad, dgelu_dtype(grad.dtype), gelu_grad=gelu_grad)


def _gemm_why_not(a: Tensor, b: Tensor, a_cols: int, b_cols: int, b_rows_ok: bool):
    """(reason, detail) when no backward GEMM serves operands a (..., a_cols) and b, else None."""
    why = common.device_plan(a)
    if why:
        return why
    if a_cols % 8 or b_cols % 8 or not a_cols or not b_cols:
        return ("alignment", f"{a_cols} and {b_cols} columns: both must be positive multiples of 8")
    if a.numel() // a_cols > 2**31 - 1:
        return ("size", f"{a.numel() // a_cols} rows: the kernels index rows with 32-bit integers")
    if not _rows_ok(a, a_cols) or not b_rows_ok:
        return ("layout", "an operand cannot be viewed as 16-byte aligned rows")
    return None


def _dgrad_why_not(grad, weight, gelu_input, gelu_grad=None):
    n, k = weight.shape
    saved = gelu_input if gelu_input is not None else gelu_grad
    why = _gemm_why_not(grad, weight, n, k, weight.is_contiguous() and (saved is None or _rows_ok(saved, k)))
    if why or saved is None:
        return why
    if runtime.arch_for(runtime.device_info(grad.device.index).cc) != 90:  # the SM90 row sum has no atomics
        return common.nondeterministic("the SM80-class dgrad sums the bias gradient with fp32 atomics")
    return None


def _dgrad_plan(grad, weight, gelu_input=None, gelu_grad=None):
    _dgrad_check(grad, weight, gelu_input, gelu_grad)
    if _dgrad_why_not(grad, weight, gelu_input, gelu_grad):
        return common.PLAN_FALLBACK
    (n, k), m = weight.shape, grad.numel() // max(weight.shape[0], 1)
    if m == 0 or k == 0:
        return common.PLAN_EMPTY
    dev = runtime.device_info(grad.device.index)
    epi = "dgelu_dbias" if gelu_input is not None else "dgelu_saved_dbias" if gelu_grad is not None else "none"
    choice = select_linear_backward("dgrad", m, k, n, common.DTYPES[grad.dtype], epi, runtime.arch_for(dev.cc), dev.name)
    return common.kernel_plan(choice, grad.device.index)


def _dgrad_fallback(grad, weight, gelu_input=None, gelu_grad=None):
    _dgrad_check(grad, weight, gelu_input, gelu_grad)
    common.record_fallback("linear_dgrad", _dgrad_why_not(grad, weight, gelu_input, gelu_grad), grad, weight,
                           gelu_input, gelu_grad)
    dx = grad @ weight
    if gelu_input is None and gelu_grad is None:
        return dx, grad.new_empty(0)
    # The kernel's order: the product in fp32 (or wider) rounded to the output dtype, then summed.
    cdt = torch.promote_types(grad.dtype, torch.float32)
    factor = gelu_grad.to(cdt) if gelu_grad is not None else gelu_derivative(gelu_input.to(cdt))
    dx = (dx.to(cdt) * factor).to(grad.dtype)
    return dx, dx.reshape(-1, weight.shape[1]).to(cdt).sum(0).to(grad.dtype)


def _dgrad_fake(grad, weight, gelu_input=None, gelu_grad=None):
    _dgrad_check(grad, weight, gelu_input, gelu_grad)
    k = weight.shape[1]
    return grad.new_empty(*grad.shape[:-1], k), grad.new_empty(k if gelu_input is not None or gelu_grad is not None
                                                               else 0)


common.register_op("linear_dgrad", plan=_dgrad_plan, fallback=_dgrad_fallback, fake=_dgrad_fake)


def _wgrad_check(grad, x, bias):
    common.check_floating("linear_wgrad", grad=grad, x=x)
    if grad.dim() < 1 or x.dim() != grad.dim() or grad.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"cvt_cutlass.linear_wgrad: grad (..., N) and x (..., K) must share their leading "
                         f"dimensions: {tuple(grad.shape)} vs {tuple(x.shape)}")
    common.check_like("linear_wgrad", "grad", grad, x=x)


def _wgrad_why_not(grad, x):
    n, k = grad.shape[-1], x.shape[-1]
    why = _gemm_why_not(grad, x, n, k, _rows_ok(x, k))
    if why is None and n * k > 2**31 - 1:
        return ("size", f"dW ({n}, {k}) has more than 2**31 - 1 elements")
    return why


def _wgrad_plan(grad, x, bias):
    _wgrad_check(grad, x, bias)
    if _wgrad_why_not(grad, x):
        return common.PLAN_FALLBACK
    n, k = grad.shape[-1], x.shape[-1]
    m = grad.numel() // max(n, 1)
    if m == 0 or n == 0 or k == 0:
        return common.PLAN_EMPTY
    dev = runtime.device_info(grad.device.index)
    choice = select_linear_backward("wgrad", m, n, k, common.DTYPES[grad.dtype], "dbias" if bias else "none",
                                    runtime.arch_for(dev.cc), dev.name)
    return common.kernel_plan(choice, grad.device.index)


def _wgrad_fallback(grad, x, bias):
    _wgrad_check(grad, x, bias)
    common.record_fallback("linear_wgrad", _wgrad_why_not(grad, x), grad, x)
    n, k = grad.shape[-1], x.shape[-1]
    g2 = grad.reshape(-1, n)
    dw = (g2.t() @ x.reshape(-1, k)).to(grad.dtype)
    db = g2.to(torch.promote_types(grad.dtype, torch.float32)).sum(0).to(grad.dtype) if bias else grad.new_empty(0)
    return dw, db


def _wgrad_fake(grad, x, bias):
    _wgrad_check(grad, x, bias)
    n = grad.shape[-1]
    return grad.new_empty(n, x.shape[-1]), grad.new_empty(n if bias else 0)


common.register_op("linear_wgrad", plan=_wgrad_plan, fallback=_wgrad_fallback, fake=_wgrad_fake)


# ----------------------------------------------------------------------------- mlp
def mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, residual: Optional[Tensor] = None) -> Tensor:
    """``fc2(gelu(fc1(x))) (+ residual)`` on two forward kernels (fc1's epilogue also saves GELU's
    derivative, :func:`dgelu_dtype`); its backward is the fused chain: fc2's wgrad (dW2, db2), fc2's
    dgrad multiplied by the saved derivative and reducing fc1's db in its epilogue, fc1's wgrad
    (dW1) and dgrad (dx)."""
    return torch.ops.cvt_cutlass.mlp.default(x, w1, b1, w2, b2, residual)[0]


def _mlp_check(x, w1, b1, w2, b2, residual):
    _check_args(x, w1, b1, None, "gelu")
    common.check_floating("mlp", w2=w2, b2=b2, residual=residual)
    h = w1.shape[0]
    if w2.dim() != 2 or w2.shape[1] != h:
        raise ValueError(f"cvt_cutlass.mlp: w2 must be (N, {h}), got {tuple(w2.shape)}")
    n = w2.shape[0]
    if b2.shape != (n,):
        raise ValueError(f"cvt_cutlass.mlp: b2 must be ({n},), got {tuple(b2.shape)}")
    if residual is not None and tuple(residual.shape) != (*x.shape[:-1], n):
        raise ValueError(f"cvt_cutlass.mlp: residual must be {(*x.shape[:-1], n)}, got {tuple(residual.shape)}")
    common.check_like("mlp", "x", x, w2=w2, b2=b2)
    if residual is not None and residual.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"cvt_cutlass.mlp: residual is {residual.dtype} but x is {x.dtype} (the residual takes "
                        "x's dtype or float32)")
    common.check_like("mlp", "x", x, residual.dtype if residual is not None else None, residual=residual)


def _mlp_fallback(x, w1, b1, w2, b2, residual=None):
    _mlp_check(x, w1, b1, w2, b2, residual)
    why = _why_not(x, w1, b1, None, "bias_gelu_dgelu")
    common.record_fallback("mlp", why or ("layout", "fc2's operands (hidden, w2, b2, residual)"), x, w1, b1, w2, b2, residual)
    hidden, dgelu = _gelu_and_grad(x, w1, b1)
    return _torch_linear(hidden, w2, b2, residual, "none"), hidden, dgelu


def _mlp_fake(x, w1, b1, w2, b2, residual=None):
    _mlp_check(x, w1, b1, w2, b2, residual)
    hidden = x.new_empty(*x.shape[:-1], w1.shape[0])
    return (x.new_empty(*x.shape[:-1], w2.shape[0], dtype=_out_dtype(x, residual)), hidden,
            hidden.new_empty(hidden.shape, dtype=dgelu_dtype(x.dtype)))


common.register_op("mlp", plan=None, fallback=_mlp_fallback, fake=_mlp_fake)
