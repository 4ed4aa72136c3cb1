"""The depthwise conv projection on tokens: ``torch.ops.cvt_cutlass.dwconv_tokens``.

``dwconv_tokens(x, weight, bias, height, width, stride, cls_rows)``: the depthwise 3x3 conv
projection (padding 1) on tokens x (B, cls_rows + H*W, C); weight (3, 3, C) and bias (C,) in
fp32 (BatchNorm folded in by :func:`fold_batchnorm`); returns (B, cls_rows + P*Q, C) whose first
``cls_rows`` rows are x's, unchanged (CvT's stage-3 cls token: no split, no ``torch.cat``).

Defined in C++ (csrc/ops/dwconv.cpp: schema, CUDA hot path, the autograd formula DwconvFn); this
module holds the planner, the PyTorch fallback and the fake kernel. Wrong arguments raise. Calls
no kernel can serve (CPU tensors, fp32 activations, channels that are not a multiple of 8,
non-packed views, a GPU older than sm_80, filters other than 3x3, strides other than 1 and 2) run
the PyTorch equivalent, counted and logged by :mod:`cvt_cutlass.fallback` (or raise in strict
mode). Its backward, ``dwconv_tokens_backward`` (gradients through the folded eval-mode
projection, e.g. saliency maps of an eval model), has no kernel: PyTorch's depthwise conv
gradients, counted as ``dwconv_tokens_backward`` fallbacks (a training step runs
``dwconv_bn_train`` instead, whose backward is on the kernels).

Training (BatchNorm with batch statistics, which cannot be folded):
``dwconv_bn_train(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, height,
width, stride, cls_rows)`` -> (y, mean, invstd): the conv (weight (3, 3, C), fp32 on the kernels),
then BatchNorm over the N*P*Q output pixels of each channel; y (B, cls_rows + P*Q, C) in x's
dtype with the cls rows copied, mean / invstd (C,) (fp32; float64 for float64 x) for the backward;
running_mean / running_var, when given, updated in place with the factor ``momentum`` as
nn.BatchNorm2d does (unbiased variance). ``dwconv_bn_backward`` returns (dx, dweight,
dbn_weight, dbn_bias); its autograd formula is C++ (csrc/ops/dwconv.cpp: DwconvBnFn saves x, the
weights, mean and invstd: the conv output is recomputed, never stored). :func:`dwconv_bn` runs
an nn.BatchNorm2d module's step (num_batches_tracked, momentum=None as a cumulative average; eval
mode: the folded kernel). No kernel for other filter sizes / strides, channels not a multiple of
8, fp32 activations, non-fp32 parameters, CPU: PyTorch, counted (strict mode raises).

nn.SyncBatchNorm over several processes: the same kernels in parts (``dwconv_bn_stats``,
``dwconv_bn_apply``, ``dwconv_bn_backward_sums``, ``dwconv_bn_backward_apply``) with one
all-gather in the forward and one all-reduce in the backward between them
(:func:`sync_dwconv_bn`; :func:`dwconv_bn` takes that path for a SyncBatchNorm module in training
with more than one process in its group).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import runtime
from ..models import conv_out
from ..operators.dwconv import select_dwconv, select_dwconv_bn
from ..operators.selection import Choice
from . import common


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
    common.check_floating("dwconv_tokens", x=x, weight=weight, bias=bias)
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
    common.check_like("dwconv_tokens", "x", x, torch.float32, weight=weight, bias=bias)  # folded BatchNorm: fp32


def _why_not(x, weight, bias, stride):
    """(reason, detail) when no kernel serves these arguments, else None."""
    why = common.device_plan(x)
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
        return common.PLAN_FALLBACK
    b, _, c = x.shape
    pad = weight.shape[0] // 2
    p, q = conv_out(height, 3, stride, pad), conv_out(width, 3, stride, pad)
    if b * (cls_rows + p * q) * c == 0:
        return common.PLAN_EMPTY
    dev = runtime.device_info(x.device.index)
    choice = select_dwconv(b * p * q, c, stride, common.DTYPES[x.dtype], runtime.arch_for(dev.cc), dev.name)
    return common.kernel_plan(choice, x.device.index)


def _fallback(x, weight, bias, height, width, stride, cls_rows=0):
    _check_dwconv(x, weight, bias, height, width, stride, cls_rows)
    common.record_fallback("dwconv_tokens", _why_not(x, weight, bias, stride), x, weight, bias)
    return dwconv_tokens_reference(x, weight, bias, height, width, stride, cls_rows)


def _fake(x, weight, bias, height, width, stride, cls_rows=0):
    _check_dwconv(x, weight, bias, height, width, stride, cls_rows)
    pad = weight.shape[0] // 2
    p, q = conv_out(height, weight.shape[0], stride, pad), conv_out(width, weight.shape[0], stride, pad)
    return x.new_empty(x.shape[0], cls_rows + p * q, x.shape[2])


def dwconv_tokens_backward(grad: Tensor, x: Tensor, weight: Tensor, height: int, width: int, stride: int,
                           cls_rows: int = 0, bias: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(dx (B, cls_rows + H*W, C) in x's dtype (its cls rows: grad's), dweight (R, R, C), dbias (C,)
    or empty unless ``bias``) of :func:`dwconv_tokens` from grad (B, cls_rows + P*Q, C)."""
    return torch.ops.cvt_cutlass.dwconv_tokens_backward.default(grad, x, weight, height, width, stride, cls_rows,
                                                                 bias)


def dwconv_tokens_backward_reference(grad, x, weight, height, width, stride, cls_rows=0, bias=True):
    """The gradients of :func:`dwconv_tokens_reference` in PyTorch (fp32, or x's dtype if wider):
    the depthwise conv's aten backward on the spatial tokens; the cls rows pass grad through."""
    cdt = torch.promote_types(x.dtype, torch.float32)
    b, _, c = x.shape
    pad = weight.shape[0] // 2
    img = x[:, cls_rows:].reshape(b, height, width, c).permute(0, 3, 1, 2).to(cdt)
    wk = weight.permute(2, 0, 1).unsqueeze(1).to(cdt)
    p, q = conv_out(height, weight.shape[0], stride, pad), conv_out(width, weight.shape[0], stride, pad)
    dy = grad[:, cls_rows:].reshape(b, p, q, c).permute(0, 3, 1, 2).to(cdt)
    dimg, dwk, db = torch.ops.aten.convolution_backward(dy, img, wk, [c] if bias else None, [stride, stride], [pad, pad],
                                                        [1, 1], False, [0, 0], c, [True, True, bias])
    return (_tokens(grad, dimg, cls_rows, x.dtype), dwk[:, 0].permute(1, 2, 0).contiguous(),
            db if bias else grad.new_empty(0, dtype=cdt))


def _check_tokens_bwd(grad, x, weight, height, width, stride, cls_rows):
    _check_dwconv(x, weight, None, height, width, stride, cls_rows)
    pad = weight.shape[0] // 2
    p, q = conv_out(height, weight.shape[0], stride, pad), conv_out(width, weight.shape[0], stride, pad)
    if tuple(grad.shape) != (x.shape[0], cls_rows + p * q, x.shape[2]):
        raise ValueError(f"cvt_cutlass.dwconv_tokens_backward: grad must be {(x.shape[0], cls_rows + p * q, x.shape[2])}, "
                         f"got {tuple(grad.shape)}")
    common.check_like("dwconv_tokens_backward", "x", x, grad=grad)


def _fallback_tokens_bwd(grad, x, weight, height, width, stride, cls_rows, bias):
    _check_tokens_bwd(grad, x, weight, height, width, stride, cls_rows)
    common.record_fallback("dwconv_tokens_backward", common.device_plan(x) or ("no_kernel", "the eval-mode depthwise backward "
                                                                  "runs PyTorch's conv gradients"))
    return dwconv_tokens_backward_reference(grad, x, weight, height, width, stride, cls_rows, bias)


def _fake_tokens_bwd(grad, x, weight, height, width, stride, cls_rows, bias):
    _check_tokens_bwd(grad, x, weight, height, width, stride, cls_rows)
    cdt = torch.promote_types(x.dtype, torch.float32)
    return (torch.empty_like(x), torch.empty_like(weight, dtype=cdt),
            x.new_empty(x.shape[2] if bias else 0, dtype=cdt))


common.register_op("dwconv_tokens", plan=_plan, fallback=_fallback, fake=_fake)
common.register_op("dwconv_tokens_backward", plan=None, fallback=_fallback_tokens_bwd, fake=_fake_tokens_bwd, hot_path=False)



# ----------------------------------------------------------------------------- training: conv + BatchNorm
def dwconv_bn_train(x: Tensor, weight: Tensor, bn_weight: Optional[Tensor], bn_bias: Optional[Tensor],
                    running_mean: Optional[Tensor], running_var: Optional[Tensor], momentum: float, eps: float,
                    height: int, width: int, stride: int, cls_rows: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, invstd) of conv + BatchNorm with batch statistics (see the module docstring);
    the running stats are updated in place."""
    return torch.ops.cvt_cutlass.dwconv_bn_train.default(x, weight, bn_weight, bn_bias, running_mean, running_var,
                                                          momentum, eps, height, width, stride, cls_rows)


def dwconv_bn_backward(grad: Tensor, x: Tensor, weight: Tensor, bn_weight: Optional[Tensor], mean: Tensor,
                       invstd: Tensor, height: int, width: int, stride: int,
                       cls_rows: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dweight (3, 3, C), dbn_weight, dbn_bias) of :func:`dwconv_bn_train` from grad
    (B, cls_rows + P*Q, C) (its cls rows are dx's), with the forward's mean / invstd."""
    return torch.ops.cvt_cutlass.dwconv_bn_backward.default(grad, x, weight, bn_weight, mean, invstd, height, width,
                                                             stride, cls_rows)


def batchnorm_factor(bn: torch.nn.modules.batchnorm._BatchNorm, counted: bool = False) -> float:
    """The running-stat factor of one call of ``bn`` as nn.BatchNorm2d.forward computes it,
    counting num_batches_tracked as it does (unless ``counted``: :func:`count_batches` did;
    momentum=None: 1 / num_batches_tracked, a cumulative average; that reads the counter, a device
    sync on CUDA, as in PyTorch)."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        if not counted:
            bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    return factor


def count_batches(bns) -> set[int]:
    """num_batches_tracked += 1 for every BatchNorm of ``bns`` that counts this call (training,
    tracking), with one foreach kernel per device instead of one each; the ids of those counted."""
    todo: dict[torch.device, list] = {}
    for bn in bns:
        if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
            todo.setdefault(bn.num_batches_tracked.device, []).append(bn)
    for group in todo.values():
        torch._foreach_add_([bn.num_batches_tracked for bn in group], 1)
    return {id(bn) for group in todo.values() for bn in group}


def dwconv_bn(x: Tensor, conv_weight: Tensor, bn: torch.nn.modules.batchnorm._BatchNorm, height: int, width: int,
              stride: int, cls_rows: int = 0, weight_rsc: Optional[Tensor] = None, counted: bool = False) -> Tensor:
    """HF's CvtSelfAttentionConvProjection (depthwise Conv2d (C, 1, 3, 3), no bias, then ``bn``)
    on tokens (B, cls_rows + H*W, C), with nn.BatchNorm2d's semantics: batch statistics (and the
    running-stat update) in training or without running stats; else BatchNorm folded into the
    eval kernel. ``weight_rsc``: conv_weight already in the kernels' layout, fp32 (3, 3, C)
    (differentiable; :class:`cvt_cutlass.params.Caster` makes a stage's at once); ``counted``:
    bn's num_batches_tracked was already advanced for this call (:func:`count_batches`)."""
    if not bn.training and bn.running_mean is not None and bn.running_var is not None:
        w, b = fold_batchnorm(conv_weight, bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.eps)
        return dwconv_tokens(x, w, b, height, width, stride, cls_rows)
    w = weight_rsc if weight_rsc is not None else depthwise_rsc(conv_weight)
    group = sync_group(bn)
    if group is not None:
        return sync_dwconv_bn_modules(x, [(w, bn, stride, counted)], height, width, cls_rows, group)[0]
    factor = batchnorm_factor(bn, counted)
    stats, stats32 = _running32(bn)
    y, _, _ = dwconv_bn_train(x, w, *(_wide(t) for t in (bn.weight, bn.bias)), *(stats32 or (None, None)), factor,
                              bn.eps, height, width, stride, cls_rows)
    _copy_back(stats, stats32)
    return y


def _running32(bn) -> tuple:
    """(running_mean, running_var) of a training BatchNorm that tracks them and their fp32 copies
    for the kernels (the same tensors when fp32 / fp64), or (None, None)."""
    if not (bn.training and bn.running_mean is not None):
        return None, None
    stats = (bn.running_mean, bn.running_var)
    return stats, tuple(_wide(t) for t in stats)


def _copy_back(stats, stats32) -> None:
    """The kernels' fp32 running statistics into a 16-bit module's buffers."""
    for t, t32 in zip(stats or (), stats32 or (), strict=True):
        if t32 is not t:
            with torch.no_grad():
                t.copy_(t32)


def depthwise_rsc(conv_weight: Tensor) -> Tensor:
    """(C, 1, 3, 3) -> the kernels' fp32 (3, 3, C), differentiably (a view + one copy; its
    backward is a copy too, no zero fill)."""
    c, _, r, s = conv_weight.shape
    return _wide(conv_weight.view(c, r, s).permute(1, 2, 0).contiguous())


def _wide(t: Optional[Tensor]) -> Optional[Tensor]:
    """t in float32 when it is narrower (differentiable); fp32 / fp64 tensors as they are."""
    return t if t is None or t.dtype in (torch.float32, torch.float64) else t.float()


def _conv_nchw(x: Tensor, weight: Tensor, height: int, width: int, stride: int, cls_rows: int, cdt) -> Tensor:
    """The conv of the spatial tokens as (B, C, P, Q) in ``cdt``, unrounded."""
    b, _, c = x.shape
    img = x[:, cls_rows:].reshape(b, height, width, c).permute(0, 3, 1, 2).to(cdt)
    return F.conv2d(img, weight.permute(2, 0, 1).unsqueeze(1).to(cdt), None, stride, weight.shape[0] // 2, groups=c)


def _tokens(x: Tensor, img: Tensor, cls_rows: int, dtype) -> Tensor:
    """(B, C, P, Q) -> tokens (B, cls_rows + P*Q, C) in ``dtype``, x's cls rows in front."""
    t = img.flatten(2).transpose(1, 2).to(dtype)
    return torch.cat([x[:, :cls_rows].to(dtype), t], 1) if cls_rows else t.contiguous()


def dwconv_bn_train_reference(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, height,
                              width, stride, cls_rows=0):
    """The same math in PyTorch, in fp32 (or x's dtype if wider), y rounded once; the running stats
    updated in place as nn.BatchNorm2d does."""
    cdt = torch.promote_types(x.dtype, torch.float32)
    z = _conv_nchw(x, weight, height, width, stride, cls_rows, cdt)
    c, n = z.shape[1], z.numel() // max(z.shape[1], 1)
    mean = z.mean((0, 2, 3))
    var = z.var((0, 2, 3), unbiased=False)
    invstd = torch.rsqrt(var + eps)
    scale = invstd * (bn_weight.to(cdt) if bn_weight is not None else 1)
    shift = (bn_bias.to(cdt) if bn_bias is not None else 0) - mean * scale
    y = z * scale.view(1, c, 1, 1) + shift.view(1, c, 1, 1)
    if running_mean is not None:
        with torch.no_grad():
            running_mean.copy_(running_mean.to(cdt) * (1 - momentum) + mean * momentum)
            running_var.copy_(running_var.to(cdt) * (1 - momentum) + var * (n / (n - 1)) * momentum)
    return _tokens(x, y, cls_rows, x.dtype), mean, invstd


def _bn_bwd_terms(grad, x, weight, mean, invstd, height, width, stride, cls_rows):
    """(dy, xhat, conv operands) of a BatchNorm backward in fp32 (or x's dtype if wider), NCHW."""
    cdt = torch.promote_types(x.dtype, torch.float32)
    b, _, c = x.shape
    img = x[:, cls_rows:].reshape(b, height, width, c).permute(0, 3, 1, 2).to(cdt)
    wk = weight.permute(2, 0, 1).unsqueeze(1).to(cdt)
    z = F.conv2d(img, wk, None, stride, weight.shape[0] // 2, groups=c)
    p, q = z.shape[2:]
    dy = grad[:, cls_rows:].reshape(b, p, q, c).permute(0, 3, 1, 2).to(cdt)
    xhat = (z - mean.to(cdt).view(1, c, 1, 1)) * invstd.to(cdt).view(1, c, 1, 1)
    return dy, xhat, img, wk


def _bn_bwd_dx(grad, x, weight, bn_weight, invstd, dy, xhat, img, wk, sum_dy, sum_dy_xhat, count, stride, cls_rows):
    """(dx, dweight): dz of BatchNorm from the sums over ``count`` values, then the conv's vjp."""
    c, cdt = x.shape[2], dy.dtype
    gamma = (bn_weight.to(cdt) if bn_weight is not None else torch.ones(c, dtype=cdt, device=x.device)).view(1, c, 1, 1)
    inv = invstd.to(cdt).view(1, c, 1, 1)
    n = count.to(cdt).reshape(()) if isinstance(count, Tensor) else count
    dz = gamma * inv * (dy - sum_dy.to(cdt).view(1, c, 1, 1) / n - xhat * sum_dy_xhat.to(cdt).view(1, c, 1, 1) / n)
    pad = weight.shape[0] // 2
    dimg, dwk, _ = torch.ops.aten.convolution_backward(dz, img, wk, None, [stride, stride], [pad, pad], [1, 1], False,
                                                       [0, 0], c, [True, True, False])
    return _tokens(grad, dimg, cls_rows, x.dtype), dwk[:, 0].permute(1, 2, 0).contiguous()


def dwconv_bn_backward_reference(grad, x, weight, bn_weight, mean, invstd, height, width, stride, cls_rows=0):
    """(dx, dweight, dbn_weight, dbn_bias) in PyTorch (fp32, or x's dtype if wider): BatchNorm's
    backward with the batch-statistics terms, then the conv's vjp."""
    dy, xhat, img, wk = _bn_bwd_terms(grad, x, weight, mean, invstd, height, width, stride, cls_rows)
    dbias, dgamma = dy.sum((0, 2, 3)), (dy * xhat).sum((0, 2, 3))
    dx, dw = _bn_bwd_dx(grad, x, weight, bn_weight, invstd, dy, xhat, img, wk, dbias, dgamma, dy.numel() // x.shape[2],
                        stride, cls_rows)
    return dx, dw, dgamma, dbias


def _bn_geometry(op: str, x: Tensor, weight: Tensor, height: int, width: int, stride: int, cls_rows: int):
    """(P, Q) of a training conv + BatchNorm call; raises on shapes that are wrong."""
    if x.dim() != 3:
        raise ValueError(f"cvt_cutlass.{op}: x must be tokens (B, L, C), got {tuple(x.shape)}")
    c = x.shape[2]
    if weight.dim() != 3 or weight.shape[0] != weight.shape[1] or weight.shape[0] < 1 or weight.shape[2] != c:
        raise ValueError(f"cvt_cutlass.{op}: weight must be (R, R, C={c}), got {tuple(weight.shape)}")
    if cls_rows < 0 or height < 1 or width < 1 or stride < 1:
        raise ValueError(f"cvt_cutlass.{op}: height, width, stride must be >= 1 and cls_rows >= 0")
    if x.shape[1] != cls_rows + height * width:
        raise ValueError(f"cvt_cutlass.{op}: x has {x.shape[1]} tokens, expected cls_rows + H*W = "
                         f"{cls_rows} + {height}*{width}")
    pad = weight.shape[0] // 2
    return conv_out(height, weight.shape[0], stride, pad), conv_out(width, weight.shape[0], stride, pad)


def _check_vectors(op: str, x: Tensor, **vectors: Optional[Tensor]) -> None:
    c = x.shape[2]
    for name, t in vectors.items():
        if t is None:
            continue
        if tuple(t.shape) != (c,):
            raise ValueError(f"cvt_cutlass.{op}: {name} must be ({c},), got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"cvt_cutlass.{op}: {name} is on {t.device} but x is on {x.device}")


def _check_bn(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, height, width, stride,
              cls_rows):
    op = "dwconv_bn_train"
    common.check_floating(op, x=x, weight=weight, bn_weight=bn_weight, bn_bias=bn_bias, running_mean=running_mean,
                   running_var=running_var)
    p, q = _bn_geometry(op, x, weight, height, width, stride, cls_rows)
    if weight.device != x.device:
        raise ValueError(f"cvt_cutlass.{op}: weight is on {weight.device} but x is on {x.device}")
    _check_vectors(op, x, bn_weight=bn_weight, bn_bias=bn_bias, running_mean=running_mean, running_var=running_var)
    if (running_mean is None) != (running_var is None):
        raise ValueError(f"cvt_cutlass.{op}: give both running_mean and running_var, or neither")
    if x.shape[0] * p * q <= 1:
        raise ValueError(f"cvt_cutlass.{op}: expected more than 1 value per channel when training, got "
                         f"{x.shape[0]} x {p} x {q}")
    if not (eps >= 0 and 0 <= momentum <= 1):
        raise ValueError(f"cvt_cutlass.{op}: eps must be >= 0 and momentum in [0, 1], got {eps}, {momentum}")


def _why_not_geometry(x: Tensor, weight: Tensor, stride: int, height: int, width: int):
    c = x.shape[2]
    if weight.shape[0] != 3:
        return ("kernel", f"{weight.shape[0]}x{weight.shape[1]} filters: kernels are instantiated for 3x3")
    if stride not in (1, 2):
        return ("stride", f"stride {stride}: kernels are instantiated for 1 and 2")
    if c % 8 or c == 0:
        return ("alignment", f"C={c} channels: must be a positive multiple of 8")
    if x.shape[0] > 65535 or x.shape[1] * c > 2**31 - 1 or x.shape[0] * height * width > 2**30 - 1:
        return ("size", f"x {tuple(x.shape)}: at most 65535 images of 2**31 - 1 elements, 2**30 pixels per launch")
    if x.stride(2) != 1 or x.stride(1) != c or (x.shape[0] > 1 and x.stride(0) % 8):
        return ("layout", f"x strides {x.stride()}: tokens must be packed rows, 16-byte aligned")
    return None


def _why_not_params(**params: Optional[Tensor]):
    for name, t in params.items():
        if t is None:
            continue
        if t.dtype != torch.float32:
            return ("param_dtype", f"{name} is {t.dtype}: the kernels take float32 weights and statistics")
        if not t.is_contiguous():
            return ("layout", f"{name} must be contiguous")
    return None


def _why_not_bn(x, weight, bn_weight, bn_bias, running_mean, running_var, stride, height, width):
    return (common.device_plan(x) or _why_not_geometry(x, weight, stride, height, width)
            or _why_not_params(weight=weight, bn_weight=bn_weight, bn_bias=bn_bias, running_mean=running_mean,
                               running_var=running_var))


def _bn_kernel_plan(op: str, pass_: str, x, weight, height, width, stride, cls_rows):
    """The conv + BatchNorm kernel of one pass for a call that passed its checks."""
    p, q = _bn_geometry(op, x, weight, height, width, stride, cls_rows)
    dev = runtime.device_info(x.device.index)
    choice = select_dwconv_bn(x.shape[0] * p * q, x.shape[2], stride, common.DTYPES[x.dtype], runtime.arch_for(dev.cc),
                              dev.name, pass_)
    return common.kernel_plan(choice, x.device.index)


def _plan_bn(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, height, width, stride,
             cls_rows=0):
    _check_bn(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, height, width, stride, cls_rows)
    if _why_not_bn(x, weight, bn_weight, bn_bias, running_mean, running_var, stride, height, width):
        return common.PLAN_FALLBACK
    return _bn_kernel_plan("dwconv_bn_train", "fwd", x, weight, height, width, stride, cls_rows)


def _fallback_bn(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, height, width, stride,
                 cls_rows=0):
    _check_bn(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, height, width, stride, cls_rows)
    common.record_fallback("dwconv_bn_train",
                    _why_not_bn(x, weight, bn_weight, bn_bias, running_mean, running_var, stride, height, width),
                    x, weight)
    return dwconv_bn_train_reference(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps,
                                     height, width, stride, cls_rows)


def _fake_bn(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, height, width, stride,
             cls_rows=0):
    _check_bn(x, weight, bn_weight, bn_bias, running_mean, running_var, momentum, eps, height, width, stride, cls_rows)
    p, q = _bn_geometry("dwconv_bn_train", x, weight, height, width, stride, cls_rows)
    sdt = torch.promote_types(x.dtype, torch.float32)
    return (x.new_empty(x.shape[0], cls_rows + p * q, x.shape[2]), x.new_empty(x.shape[2], dtype=sdt),
            x.new_empty(x.shape[2], dtype=sdt))


# autograd: csrc/ops/dwconv.cpp (DwconvBnFn: saves x, weight, bn_weight, mean, invstd)
common.register_op("dwconv_bn_train", plan=_plan_bn, fallback=_fallback_bn, fake=_fake_bn)


def _check_bn_bwd(grad, x, weight, bn_weight, mean, invstd, height, width, stride, cls_rows):
    op = "dwconv_bn_backward"
    common.check_floating(op, grad=grad, x=x, weight=weight, bn_weight=bn_weight, mean=mean, invstd=invstd)
    p, q = _bn_geometry(op, x, weight, height, width, stride, cls_rows)
    want = (x.shape[0], cls_rows + p * q, x.shape[2])
    if tuple(grad.shape) != want:
        raise ValueError(f"cvt_cutlass.{op}: grad must be {want}, got {tuple(grad.shape)}")
    common.check_like(op, "x", x, grad=grad)
    _check_vectors(op, x, bn_weight=bn_weight, mean=mean, invstd=invstd)
    if x.shape[0] * p * q <= 1:
        raise ValueError(f"cvt_cutlass.{op}: expected more than 1 value per channel")


def _why_not_bn_bwd(grad, x, weight, bn_weight, mean, invstd, stride, height, width):
    why = common.device_plan(x) or _why_not_geometry(x, weight, stride, height, width)
    if why:
        return why
    if not grad.is_contiguous() or (x.shape[0] > 1 and x.stride(0) % 8):
        return ("layout", f"grad strides {grad.stride()}: must be contiguous")
    return _why_not_params(weight=weight, bn_weight=bn_weight, mean=mean, invstd=invstd)


def _plan_bn_bwd(grad, x, weight, bn_weight, mean, invstd, height, width, stride, cls_rows=0):
    _check_bn_bwd(grad, x, weight, bn_weight, mean, invstd, height, width, stride, cls_rows)
    if _why_not_bn_bwd(grad, x, weight, bn_weight, mean, invstd, stride, height, width):
        return common.PLAN_FALLBACK
    return _bn_kernel_plan("dwconv_bn_backward", "bwd", x, weight, height, width, stride, cls_rows)


def _fallback_bn_bwd(grad, x, weight, bn_weight, mean, invstd, height, width, stride, cls_rows=0):
    _check_bn_bwd(grad, x, weight, bn_weight, mean, invstd, height, width, stride, cls_rows)
    common.record_fallback("dwconv_bn_backward",
                    _why_not_bn_bwd(grad, x, weight, bn_weight, mean, invstd, stride, height, width),
                    grad, x, weight, mean, invstd)
    return dwconv_bn_backward_reference(grad, x, weight, bn_weight, mean, invstd, height, width, stride, cls_rows)


def _fake_bn_bwd(grad, x, weight, bn_weight, mean, invstd, height, width, stride, cls_rows=0):
    _check_bn_bwd(grad, x, weight, bn_weight, mean, invstd, height, width, stride, cls_rows)
    sdt = torch.promote_types(x.dtype, torch.float32)
    c = x.shape[2]
    return (torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(*weight.shape, dtype=sdt),
            x.new_empty(c, dtype=sdt), x.new_empty(c, dtype=sdt))


common.register_op("dwconv_bn_backward", plan=_plan_bn_bwd, fallback=_fallback_bn_bwd, fake=_fake_bn_bwd)


def _plan_qkv(x, weight, height, width, stride_q, stride_kv, cls_rows, pass_):
    """The library that runs a CvT layer's q (stride_q) and k / v pair (stride_kv) projections of x
    in one set of launches, for the C++ path that has already planned each on its own kernel: the
    two kernels the tables or the heuristic choose for them, instantiated together
    (operators/dwconv: DwBnFwdQkv / DwBnBwdQkv; q at stride 1 with the pair at stride 2 reads x
    once for the three, its statistics and sums within rounding of the two run alone)."""
    op = "dwconv_bn_backward" if pass_ == "bwd" else "dwconv_bn_train"
    dev = runtime.device_info(x.device.index)
    arch, dtype, b, c = runtime.arch_for(dev.cc), common.DTYPES[x.dtype], x.shape[0], x.shape[2]
    chosen = []
    for stride in (stride_q, stride_kv):
        p, q = _bn_geometry(op, x, weight, height, width, stride, cls_rows)
        chosen.append(select_dwconv_bn(b * p * q, c, stride, dtype, arch, dev.name, pass_))
    spec = chosen[0].spec.with_kv(chosen[1].spec)
    source = "table" if all(ch.source == "table" for ch in chosen) else "heuristic"
    return common.kernel_plan(Choice(spec, source), x.device.index)


torch.library.impl("cvt_cutlass_C::dwconv_bn_qkv_plan", "CUDA", _plan_qkv)


# ----------------------------------------------------------------------------- SyncBatchNorm
# The training kernels in parts, for nn.SyncBatchNorm over several processes (csrc/ops/dwconv.cpp):
# dwconv_bn_stats(x, weight, ...) -> (mean, m2) of this process's batch (m2: the sum of squared
# deviations); dwconv_bn_apply(x, weight, bn_weight, bn_bias, mean, invstd, ...) -> y with given
# statistics; dwconv_bn_backward_sums(grad, x, weight, mean, invstd, ...) -> (sum dy, sum dy * xhat);
# dwconv_bn_backward_apply(grad, x, weight, bn_weight, mean, invstd, sum_dy, sum_dy_xhat, count, ...)
# -> (dx, dweight) from sums over ``count`` values per channel. :func:`sync_dwconv_bn` all-reduces
# between them, as nn.SyncBatchNorm does between its statistics and normalization passes.
def dwconv_bn_stats_reference(x, weight, height, width, stride, cls_rows=0):
    z = _conv_nchw(x, weight, height, width, stride, cls_rows, torch.promote_types(x.dtype, torch.float32))
    mean = z.mean((0, 2, 3))
    return mean, ((z - mean.view(1, -1, 1, 1)) ** 2).sum((0, 2, 3))


def dwconv_bn_apply_reference(x, weight, bn_weight, bn_bias, mean, invstd, height, width, stride, cls_rows=0):
    cdt = torch.promote_types(x.dtype, torch.float32)
    z = _conv_nchw(x, weight, height, width, stride, cls_rows, cdt)
    scale = invstd.to(cdt) * (bn_weight.to(cdt) if bn_weight is not None else 1)
    shift = (bn_bias.to(cdt) if bn_bias is not None else 0) - mean.to(cdt) * scale
    return _tokens(x, z * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1), cls_rows, x.dtype)


def dwconv_bn_backward_sums_reference(grad, x, weight, mean, invstd, height, width, stride, cls_rows=0):
    dy, xhat, _, _ = _bn_bwd_terms(grad, x, weight, mean, invstd, height, width, stride, cls_rows)
    return dy.sum((0, 2, 3)), (dy * xhat).sum((0, 2, 3))


def dwconv_bn_backward_apply_reference(grad, x, weight, bn_weight, mean, invstd, sum_dy, sum_dy_xhat, count, height,
                                       width, stride, cls_rows=0):
    dy, xhat, img, wk = _bn_bwd_terms(grad, x, weight, mean, invstd, height, width, stride, cls_rows)
    return _bn_bwd_dx(grad, x, weight, bn_weight, invstd, dy, xhat, img, wk, sum_dy, sum_dy_xhat, count, stride,
                      cls_rows)


def _check_part(op, x, weight, height, width, stride, cls_rows, grad=None, **vectors):
    common.check_floating(op, x=x, weight=weight, grad=grad, **vectors)
    p, q = _bn_geometry(op, x, weight, height, width, stride, cls_rows)
    if grad is not None and tuple(grad.shape) != (x.shape[0], cls_rows + p * q, x.shape[2]):
        raise ValueError(f"cvt_cutlass.{op}: grad must be {(x.shape[0], cls_rows + p * q, x.shape[2])}, "
                         f"got {tuple(grad.shape)}")
    _check_vectors(op, x, **vectors)
    if x.shape[0] * p * q < 1:
        raise ValueError(f"cvt_cutlass.{op}: an empty batch (the caller skips the op)")
    return p, q


def _part_fallback(op, why, values: int, reference, *args):
    """A part's PyTorch path, counted with ``why``, else with the batch's ``values`` per channel
    when too few for the kernels' plans, else the misaligned operand."""
    if why is None and values < 2:
        why = ("size", "one value per channel in this process's batch (the kernels' plans take two or more)")
    common.record_fallback(op, why, *(a for a in args if isinstance(a, Tensor)))
    return reference(*args)


def _stats_fallback(x, weight, height, width, stride, cls_rows=0):
    p, q = _check_part("dwconv_bn_stats", x, weight, height, width, stride, cls_rows)
    why = _why_not_bn(x, weight, None, None, None, None, stride, height, width)
    return _part_fallback("dwconv_bn_stats", why, x.shape[0] * p * q, dwconv_bn_stats_reference, x, weight, height,
                          width, stride, cls_rows)


def _apply_fallback(x, weight, bn_weight, bn_bias, mean, invstd, height, width, stride, cls_rows=0):
    p, q = _check_part("dwconv_bn_apply", x, weight, height, width, stride, cls_rows, bn_weight=bn_weight,
                       bn_bias=bn_bias, mean=mean, invstd=invstd)
    why = _why_not_bn(x, weight, bn_weight, bn_bias, mean, invstd, stride, height, width)
    return _part_fallback("dwconv_bn_apply", why, x.shape[0] * p * q, dwconv_bn_apply_reference, x, weight,
                          bn_weight, bn_bias, mean, invstd, height, width, stride, cls_rows)


def _sums_fallback(grad, x, weight, mean, invstd, height, width, stride, cls_rows=0):
    p, q = _check_part("dwconv_bn_backward_sums", x, weight, height, width, stride, cls_rows, grad, mean=mean,
                       invstd=invstd)
    why = _why_not_bn_bwd(grad, x, weight, None, mean, invstd, stride, height, width)
    return _part_fallback("dwconv_bn_backward_sums", why, x.shape[0] * p * q, dwconv_bn_backward_sums_reference,
                          grad, x, weight, mean, invstd, height, width, stride, cls_rows)


def _bwd_apply_fallback(grad, x, weight, bn_weight, mean, invstd, sum_dy, sum_dy_xhat, count, height, width, stride,
                        cls_rows=0):
    p, q = _check_part("dwconv_bn_backward_apply", x, weight, height, width, stride, cls_rows, grad,
                       bn_weight=bn_weight, mean=mean, invstd=invstd, sum_dy=sum_dy, sum_dy_xhat=sum_dy_xhat)
    if count.numel() != 1 or count.device != x.device:
        raise ValueError(f"cvt_cutlass.dwconv_bn_backward_apply: count must be one value on x's device, got "
                         f"{tuple(count.shape)} on {count.device}")
    why = _why_not_bn_bwd(grad, x, weight, bn_weight, mean, invstd, stride, height, width)
    return _part_fallback("dwconv_bn_backward_apply", why, x.shape[0] * p * q, dwconv_bn_backward_apply_reference,
                          grad, x, weight, bn_weight, mean, invstd, sum_dy, sum_dy_xhat, count, height, width,
                          stride, cls_rows)


def _fake_vectors(x, k=2):
    sdt = torch.promote_types(x.dtype, torch.float32)
    return tuple(x.new_empty(x.shape[2], dtype=sdt) for _ in range(k))


def _apply_fake(x, weight, bn_weight, bn_bias, mean, invstd, height, width, stride, cls_rows=0):
    p, q = _check_part("dwconv_bn_apply", x, weight, height, width, stride, cls_rows)
    return x.new_empty(x.shape[0], cls_rows + p * q, x.shape[2])


def _bwd_apply_fake(grad, x, weight, bn_weight, mean, invstd, sum_dy, sum_dy_xhat, count, height, width, stride,
                    cls_rows=0):
    _check_part("dwconv_bn_backward_apply", x, weight, height, width, stride, cls_rows, grad)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(*weight.shape, dtype=torch.promote_types(x.dtype, torch.float32)))


common.register_op("dwconv_bn_stats", plan=None, fallback=_stats_fallback,
                   fake=lambda x, weight, *a: _fake_vectors(x))
common.register_op("dwconv_bn_apply", plan=None, fallback=_apply_fallback, fake=_apply_fake)
common.register_op("dwconv_bn_backward_sums", plan=None, fallback=_sums_fallback,
                   fake=lambda grad, x, *a: _fake_vectors(x))
common.register_op("dwconv_bn_backward_apply", plan=None, fallback=_bwd_apply_fallback, fake=_bwd_apply_fake)


def sync_group(bn: torch.nn.modules.batchnorm._BatchNorm):
    """The process group an nn.SyncBatchNorm module synchronizes over in this call, or None: as
    nn.SyncBatchNorm.forward decides (training, a process group started, more than one process)."""
    import torch.distributed as dist

    if not (isinstance(bn, torch.nn.SyncBatchNorm) and bn.training and dist.is_available() and dist.is_initialized()):
        return None
    group = bn.process_group or dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def _merge_stats(parts: list[tuple[Tensor, Tensor, int]], group) -> list[tuple[Tensor, Tensor, Tensor]]:
    """(mean, biased variance, count (1,)) of each projection over the group's batches from each
    process's (mean, m2, count) of it: one all-gather for all of them, then Chan's merge in
    float64, all on the device (no host sync)."""
    import torch.distributed as dist

    mine = torch.stack([torch.stack([torch.full_like(m, float(n)), m, q]) for m, q, n in parts]).double()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    n, means, m2s = torch.stack(every).unbind(2)  # (world, projections, C) each
    total = n.sum(0)
    avg = (n * means).sum(0) / total
    var = (m2s + n * (means - avg) ** 2).sum(0) / total
    dt = parts[0][0].dtype
    return [(avg[i].to(dt), var[i].to(dt), total[i, :1].to(dt)) for i in range(len(parts))]


class SyncProj(NamedTuple):
    """One conv + SyncBatchNorm projection of a shared input: its fp32 (3, 3, C) conv weight,
    BatchNorm weight / bias, fp32 (running_mean, running_var) updated in place (or None), the
    running-stat factor, eps and the conv stride."""

    w: Tensor
    bn_weight: Optional[Tensor]
    bn_bias: Optional[Tensor]
    running: Optional[tuple[Tensor, Tensor]]
    factor: float
    eps: float
    stride: int


class _SyncDwConvBn(torch.autograd.Function):
    """conv + BatchNorm of one or more projections of x with the statistics of the group's batches
    (see the section above): one all-gather in the forward and one all-reduce in the backward for
    all of them. Inputs: x, then (w, bn_weight, bn_bias) per projection."""

    @staticmethod
    def forward(ctx, projs, height, width, cls_rows, group, x, *weights):
        stats = [_local_stats(x, pr, height, width, cls_rows) for pr in projs]
        merged = _merge_stats(stats, group)
        ys, saved = [], []
        for pr, (_, _, n), (mean, var, count) in zip(projs, stats, merged, strict=True):
            invstd = torch.rsqrt(var + pr.eps)
            if pr.running is not None:  # the unbiased variance, as nn.SyncBatchNorm (a group total of 1: inf)
                with torch.no_grad():
                    pr.running[0].mul_(1 - pr.factor).add_(mean, alpha=pr.factor)
                    pr.running[1].mul_(1 - pr.factor).add_(var * (count / (count - 1)), alpha=pr.factor)
            geom = (height, width, pr.stride, cls_rows)
            ys.append(dwconv_bn_apply(x, pr.w, pr.bn_weight, pr.bn_bias, mean, invstd, *geom) if n else
                      x.new_empty(0, cls_rows + _rows(x, pr, height, width, cls_rows), x.shape[2]))
            saved += [mean, invstd, count]
        ctx.save_for_backward(x, *weights, *saved)
        ctx.projs = [pr._replace(w=None, bn_weight=None, bn_bias=None, running=None) for pr in projs]
        ctx.has = [(pr.bn_weight is not None, pr.bn_bias is not None) for pr in projs]
        ctx.geom, ctx.group = (height, width, cls_rows), group
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grads):
        import torch.distributed as dist

        x, *rest = ctx.saved_tensors
        k = len(ctx.projs)
        weights, saved = rest[:3 * k], rest[3 * k:]
        height, width, cls_rows = ctx.geom
        sums, out = [], [None] * (5 + 1 + 3 * k)
        for i, (pr, g) in enumerate(zip(ctx.projs, grads, strict=True)):
            geom = (height, width, pr.stride, cls_rows)
            mean, invstd = saved[3 * i], saved[3 * i + 1]
            sums += dwconv_bn_backward_sums(g.contiguous(), x, weights[3 * i], mean, invstd, *geom) if x.shape[0] \
                else [torch.zeros_like(mean)] * 2
        both = torch.cat(sums)  # this process's sums: the BatchNorm weights' gradients
        dist.all_reduce(both, group=ctx.group)
        total = both.view(2 * k, -1)
        dx = None
        for i, (pr, g) in enumerate(zip(ctx.projs, grads, strict=True)):
            geom, (w, bnw, _) = (height, width, pr.stride, cls_rows), weights[3 * i:3 * i + 3]
            mean, invstd, count = saved[3 * i:3 * i + 3]
            if x.shape[0]:
                dxi, dw = dwconv_bn_backward_apply(g.contiguous(), x, w, bnw if ctx.has[i][0] else None, mean, invstd,
                                                   total[2 * i], total[2 * i + 1], count, *geom)
                dx = dxi if dx is None else dx + dxi
            else:
                dx, dw = torch.zeros_like(x), torch.zeros(w.shape, dtype=mean.dtype, device=x.device)
            out[6 + 3 * i] = dw.to(w.dtype)
            out[7 + 3 * i] = sums[2 * i + 1].to(bnw.dtype) if ctx.has[i][0] else None
            out[8 + 3 * i] = sums[2 * i] if ctx.has[i][1] else None
        out[5] = dx
        return tuple(out)


def _rows(x: Tensor, pr: SyncProj, height: int, width: int, cls_rows: int) -> int:
    """A projection's output pixels per image."""
    p, q = _bn_geometry("dwconv_bn_train", x, pr.w, height, width, pr.stride, cls_rows)
    return p * q


def _local_stats(x: Tensor, pr: SyncProj, height: int, width: int, cls_rows: int) -> tuple[Tensor, Tensor, int]:
    """(mean, m2, count) of this process's batch for one projection (zeros for an empty batch)."""
    n = x.shape[0] * _rows(x, pr, height, width, cls_rows)
    if n:
        return (*dwconv_bn_stats(x, pr.w, height, width, pr.stride, cls_rows), n)
    zero = torch.zeros(x.shape[2], dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    return zero, zero, 0


def dwconv_bn_stats(x, weight, height, width, stride, cls_rows=0):
    return torch.ops.cvt_cutlass.dwconv_bn_stats.default(x, weight, height, width, stride, cls_rows)


def dwconv_bn_apply(x, weight, bn_weight, bn_bias, mean, invstd, height, width, stride, cls_rows=0):
    return torch.ops.cvt_cutlass.dwconv_bn_apply.default(x, weight, bn_weight, bn_bias, mean, invstd, height, width,
                                                         stride, cls_rows)


def dwconv_bn_backward_sums(grad, x, weight, mean, invstd, height, width, stride, cls_rows=0):
    return torch.ops.cvt_cutlass.dwconv_bn_backward_sums.default(grad, x, weight, mean, invstd, height, width, stride,
                                                                 cls_rows)


def dwconv_bn_backward_apply(grad, x, weight, bn_weight, mean, invstd, sum_dy, sum_dy_xhat, count, height, width,
                             stride, cls_rows=0):
    return torch.ops.cvt_cutlass.dwconv_bn_backward_apply.default(grad, x, weight, bn_weight, mean, invstd, sum_dy,
                                                                  sum_dy_xhat, count, height, width, stride,
                                                                  cls_rows)


def sync_dwconv_bn(x: Tensor, projs: list[SyncProj], height: int, width: int, cls_rows: int, group) -> tuple:
    """conv + nn.SyncBatchNorm over ``group`` of projections of x (CvT's q / k / v of one layer,
    or one): the statistics pass on the kernels, one all-gather of each process's (count, mean, m2)
    of every projection, the normalization passes with the merged statistics; in the backward the
    sums passes, one all-reduce of every (sum dy, sum dy * xhat), the gradient passes. The BatchNorm
    weights' gradients are this process's (DDP averages them, as with nn.SyncBatchNorm). Returns
    the projections' outputs."""
    weights = [t for pr in projs for t in (pr.w, pr.bn_weight, pr.bn_bias)]
    flat = [t if t is not None else x.new_empty(0) for t in weights]  # autograd takes tensors
    return _SyncDwConvBn.apply(projs, height, width, cls_rows, group, x, *flat)


def sync_dwconv_bn_modules(x: Tensor, items: list, height: int, width: int, cls_rows: int, group) -> list[Tensor]:
    """:func:`sync_dwconv_bn` for nn.SyncBatchNorm modules: ``items`` (fp32 (3, 3, C) conv weight,
    bn, stride, counted) as :func:`dwconv_bn` takes them (the running-stat factor, num_batches_tracked,
    16-bit modules' statistics through fp32 copies)."""
    projs, running = [], []
    for w, bn, stride, counted in items:
        factor = batchnorm_factor(bn, counted)
        stats, stats32 = _running32(bn)
        projs.append(SyncProj(w, _wide(bn.weight), _wide(bn.bias), stats32, factor, bn.eps, stride))
        running.append((stats, stats32))
    ys = sync_dwconv_bn(x, projs, height, width, cls_rows, group)
    for stats, stats32 in running:
        _copy_back(stats, stats32)
    return list(ys)
