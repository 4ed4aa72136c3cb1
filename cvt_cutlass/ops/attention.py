"""Fused attention: ``torch.ops.cvt_cutlass.attention(q, k, v, scale) -> (out, lse)``.

q (B, Lq, H, D), k and v (B, Lkv, H, D) in the layout CvT's projections write ((B, L, H*D) rows
viewed per head; k and v may be two halves of one (B, L, 2*H*D) GEMM output): unit stride along
D, other strides free. ``out = softmax(scale * q k^T) v`` as (B, Lq, H, D) (contiguous: the
out-projection reads it as (B, Lq, H*D)); ``lse`` (B, H, Lq) float32 is the natural-log
logsumexp of ``scale * q k^T`` per query, which a backward pass needs. ``lse``'s (batch, head)
rows are padded to a multiple of 32 (the kernel's layout): it is a view with strides
(H*Lp, Lp, 1), Lp = ceil(Lq / 32) * 32, on every path, the fallback included.

Defined in C++ (csrc/ops/attention.cpp: schema, CUDA hot path); this module holds the planner,
the PyTorch fallback, the fake kernel and autograd. Wrong arguments raise. Calls no kernel serves
(CPU tensors, fp32, head dims that are not a multiple of 8 or above 256, misaligned strides, a
GPU older than sm_80) run the same math in PyTorch (fp32 softmax), counted and logged (strict
mode raises). Backward: ``attention_backward`` on its own kernels (example 88's Hopper mainloop
on sm90, example 41's on both paths; head dims up to 128; for Lkv <= 64 and head dims up to 64 the
short-key kernel, operators/attention/short_bwd.cuh), with the same visible fallback.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .. import runtime
from ..operators.attention import attn_bwd_heuristic, select_attention
from ..operators.selection import Choice
from . import common

LSE_ALIGN = 32  # csrc/ops/attention.cpp: kLseAlign


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(softmax(scale * q k^T) v, logsumexp) on one fused kernel (see the module docstring)."""
    return torch.ops.cvt_cutlass.attention.default(q, k, v, scale)


def lse_padded_len(lq: int) -> int:
    return -(-lq // LSE_ALIGN) * LSE_ALIGN


def new_lse(q: Tensor, b: int, h: int, lq: int) -> Tensor:
    """An uninitialised log-sum-exp buffer (b, h, lq) fp32 with rows padded as the kernels write them."""
    lp = lse_padded_len(lq)
    return torch.empty_strided((b, h, lq), (h * lp, lp, 1), dtype=torch.float32, device=q.device)


def attention_reference(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """HF's math (einsum, softmax, einsum) in fp32 or wider: (out (B, Lq, H, D) in q's dtype, lse)."""
    cdt = torch.promote_types(q.dtype, torch.float32)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(cdt), k.to(cdt)) * scale
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.to(cdt)).to(q.dtype).contiguous()
    return out, lse


def _check(q: Tensor, k: Tensor, v: Tensor, scale: float) -> None:
    common.check_floating("attention", q=q, k=k, v=v)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"cvt_cutlass.attention: q, k, v must be (B, L, H, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, _, h, d = q.shape
    if k.shape[0] != b or k.shape[2] != h or k.shape[3] != d or v.shape != k.shape:
        raise ValueError(f"cvt_cutlass.attention: k and v must be (B={b}, Lkv, H={h}, D={d}) and equal; got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] < 1:
        raise ValueError("cvt_cutlass.attention: Lkv must be >= 1")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"cvt_cutlass.attention: scale must be a positive number, got {scale}")
    common.check_like("attention", "q", q, k=k, v=v)


def _why_not(q: Tensor, k: Tensor, v: Tensor):
    """(reason, detail) when no kernel serves these arguments, else None."""
    why = common.device_plan(q)
    if why:
        return why
    b, lq, h, d = q.shape
    if d % 8 or d > 256 or d == 0:
        return ("head_dim", f"head dim {d}: kernels take positive multiples of 8 up to 256")
    if b > 65535 or h > 65535 or b * lq * h * d > 2**31 - 1:
        return ("size", f"q {tuple(q.shape)}: at most 65535 images and heads, 2**31 - 1 elements per launch")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(3) != 1 or any(s % 8 for s in t.stride()[:3]):
            return ("layout", f"{name} strides {t.stride()}: unit stride along D, others multiples of 8")
    return None


def _plan(q, k, v, scale):
    _check(q, k, v, scale)
    if _why_not(q, k, v):
        return common.PLAN_FALLBACK
    b, lq, h, d = q.shape
    if q.numel() == 0:
        return common.PLAN_EMPTY
    dev = runtime.device_info(q.device.index)
    choice = select_attention(b, h, lq, k.shape[1], d, common.DTYPES[q.dtype], runtime.arch_for(dev.cc), dev.name)
    return common.kernel_plan(choice, q.device.index)


def _fallback(q, k, v, scale):
    _check(q, k, v, scale)
    common.record_fallback("attention", _why_not(q, k, v), q, k, v)
    b, lq, h, _ = q.shape
    out, ref_lse = attention_reference(q, k, v, scale)
    lse = new_lse(q, b, h, lq)
    lse.copy_(ref_lse)
    return out, lse


def _fake(q, k, v, scale):
    _check(q, k, v, scale)
    b, lq, h, d = q.shape
    return q.new_empty(b, lq, h, d), new_lse(q, b, h, lq)


# autograd: csrc/ops/attention.cpp (AttentionFn: saves q, k, v, out and lse; dq, dk, dv by
# attention_backward; a gradient of lse itself is folded into the kernels' rowsum(dout * out) term)
common.register_op("attention", plan=_plan, fallback=_fallback, fake=_fake)


# ----------------------------------------------------------------------------- backward
def attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                       grad_lse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of :func:`attention` from its inputs, its outputs ``out`` and ``lse`` (as it
    returned them) and the output gradient ``grad`` (B, Lq, H, D) (and ``grad_lse`` (B, H, Lq)
    float when lse itself was used): one rowsum(grad * out) pass, then the fused backward kernel (the
    short-key kernel for Lkv <= 64 computes that sum inside itself)."""
    return torch.ops.cvt_cutlass.attention_backward.default(grad, q, k, v, out, lse, scale, grad_lse)


def _bwd_check(grad, q, k, v, out, lse, scale, grad_lse):
    _check(q, k, v, scale)
    common.check_floating("attention_backward", grad=grad, out=out, lse=lse, grad_lse=grad_lse)
    common.check_like("attention_backward", "q", q, grad=grad, out=out)
    if tuple(grad.shape) != tuple(q.shape) or tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"cvt_cutlass.attention_backward: grad and out must be q's shape {tuple(q.shape)}, got "
                         f"{tuple(grad.shape)}, {tuple(out.shape)}")
    b, lq, h, _ = q.shape
    for name, t in (("lse", lse), ("grad_lse", grad_lse)):
        if t is not None and (tuple(t.shape) != (b, h, lq) or t.dtype != torch.float32 or t.device != q.device):
            raise ValueError(f"cvt_cutlass.attention_backward: {name} must be float32 (B, H, Lq) = {(b, h, lq)} on "
                             f"{q.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def _bwd_why_not(grad, q, k, v, out, lse, grad_lse):
    """(reason, detail) when no backward kernel serves these arguments, else None."""
    why = _why_not(q, k, v)
    if why:
        return why
    d = q.shape[3]
    if d > 128:
        return ("head_dim", f"head dim {d}: backward kernels take multiples of 8 up to 128")
    for name, t in (("grad", grad), ("out", out)):
        if t.stride(3) != 1 or any(s % 8 for s in t.stride()[:3]):
            return ("layout", f"{name} strides {t.stride()}: unit stride along D, others multiples of 8")
    if not out.is_contiguous():
        return ("layout", "out must be packed (B, Lq, H, D), as attention returns it")
    h = q.shape[2]
    if lse.stride(2) != 1 or lse.stride(1) % 8 or lse.stride(0) != h * lse.stride(1):
        return ("layout", f"lse strides {lse.stride()}: (H*Lp, Lp, 1) with Lp a multiple of 8, as attention returns it")
    if grad_lse is not None and (grad_lse.stride(2) != 1 or grad_lse.stride(0) != h * grad_lse.stride(1)):
        return ("layout", f"grad_lse strides {grad_lse.stride()}: packed (B, H, Lq) rows")
    return None


def _bwd_plan(grad, q, k, v, out, lse, scale, grad_lse=None):
    _bwd_check(grad, q, k, v, out, lse, scale, grad_lse)
    if _bwd_why_not(grad, q, k, v, out, lse, grad_lse):
        return common.PLAN_FALLBACK
    b, lq, h, d = q.shape
    if q.numel() == 0:
        return common.PLAN_EMPTY
    dev = runtime.device_info(q.device.index)
    choice = select_attention(b, h, lq, k.shape[1], d, common.DTYPES[q.dtype], runtime.arch_for(dev.cc), dev.name, "bwd")
    return common.kernel_plan(deterministic_choice(choice, common.DTYPES[q.dtype], d, k.shape[1]), q.device.index)


def deterministic_choice(choice, dtype: str, head_dim: int, lkv: int):
    """choice, or under torch.use_deterministic_algorithms(True), where its kernel sums dq in the
    order CTAs arrive (its spec's DETERMINISTIC is False), the sm89 path's heuristic backward:
    example 41 (with one key split it sums dq in order) or the short-key kernel (no sum across CTAs)."""
    if torch.are_deterministic_algorithms_enabled() and not choice.spec.DETERMINISTIC:
        return Choice(attn_bwd_heuristic(dtype, head_dim, 89, lkv), "heuristic")
    return choice


def attention_backward_reference(grad, q, k, v, scale, grad_lse=None):
    """(dq, dk, dv) of HF's math in fp32 (or wider), in q's dtype: the softmax gradient written
    out (dS = P * (dP - rowsum(dP * P) + grad_lse)), so it also runs under functorch transforms."""
    cdt = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf, gf = (t.to(cdt) for t in (q, k, v, grad))
    p = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale, dim=-1)
    dp = torch.einsum("bqhd,bkhd->bhqk", gf, vf)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    if grad_lse is not None:
        ds = ds + p * grad_lse.to(cdt).unsqueeze(-1)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, gf)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _bwd_fallback(grad, q, k, v, out, lse, scale, grad_lse=None):
    _bwd_check(grad, q, k, v, out, lse, scale, grad_lse)
    common.record_fallback("attention_backward", _bwd_why_not(grad, q, k, v, out, lse, grad_lse), grad, q, k, v, out, lse)
    return tuple(t.contiguous() for t in attention_backward_reference(grad, q, k, v, scale, grad_lse))


def _bwd_fake(grad, q, k, v, out, lse, scale, grad_lse=None):
    _bwd_check(grad, q, k, v, out, lse, scale, grad_lse)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


common.register_op("attention_backward", plan=_bwd_plan, fallback=_bwd_fallback, fake=_bwd_fake)
