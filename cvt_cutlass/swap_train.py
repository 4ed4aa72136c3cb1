"""The fused stage's differentiable forward: what a swapped CvT runs in training mode or while
autograd records (:meth:`cvt_cutlass.swap.FusedCvtStage.forward` dispatches here).

The same token pipeline as the inference path, on ops whose backward runs on the kernels (C++
autograd formulas): the embedding conv (``conv2d_nhwc``: dw and db on the wgrad kernel, dx on the
dgrad kernel unless it is the image), LayerNorm (``layer_norm_tokens``, the cls token written in
front, its gradient summed over images), per layer LayerNorm, the three depthwise projections with
BatchNorm (:func:`cvt_cutlass.ops.dwconv.dwconv_bn`: batch statistics and running-stat updates as
nn.BatchNorm2d in training, folded in eval), the q/k/v Linears, attention (saves q, k, v, out,
lse), the out-projection with the residual in its epilogue, LayerNorm, and the MLP op (fc1 + GELU +
fc2 + residual, whose backward chains fc2's dgrad with GELU' and fc1's db).

The parameters are used themselves, cast to the compute dtype in this forward (autograd returns
their gradients in their own dtype): the autocast dtype when ``torch.autocast`` is on for the
input's device (the ops then run with autocast off: they take one dtype), else the input's dtype.
Stochastic depth follows HF exactly, drawing its per-sample masks in HF's order and dtype (and HF
applies the second one to the MLP output after its residual add, i.e. to the whole layer output);
with a nonzero drop path the out-projection's residual add is a separate elementwise op (one
addcmul with the mask), and the layer output's drop path one kernel each way.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .operators.conv2d import stem_channels


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the ops run in: autocast's for x's device when it is on, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def drop_mask(x: Tensor, module: nn.Module) -> Tensor | None:
    """HF's CvtDropPath draw for x (per-sample 0 / 1 of shape (B, 1, ...), x's dtype, the same
    random numbers in the same order), or None where HF's drop path is the identity."""
    p = getattr(module, "drop_prob", 0.0)
    if p == 0.0 or not module.training:
        return None
    return torch.floor(torch.rand((x.shape[0],) + (1,) * (x.ndim - 1), dtype=x.dtype, device=x.device) + (1 - p))


def drop_path(x: Tensor, module: nn.Module) -> Tensor:
    """HF's drop path, ``x / keep * mask``, as one kernel each way: ``x + x * m`` with
    m = mask / keep - 1 (-1 where dropped: exactly 0; 1 / keep - 1 rounded to x's dtype where kept,
    ~3e-5 relative in bf16, computed in fp32 inside the kernel)."""
    mask = drop_mask(x, module)
    if mask is None:
        return x
    return _RowScale.apply(x, mask.mul_(1 / (1 - module.drop_prob)).sub_(1))


def add_drop_path(residual: Tensor, x: Tensor, module: nn.Module) -> Tensor:
    """``residual + drop_path(x)`` in one kernel: addcmul with the mask and 1 / keep (fp32 math)."""
    mask = drop_mask(x, module)
    if mask is None:
        return residual + x
    return torch.addcmul(residual, x, mask, value=1 / (1 - module.drop_prob))


class _RowScale(torch.autograd.Function):
    """y = x + x * m (m broadcast per sample), and dx = g + g * m: one kernel each way."""

    @staticmethod
    def forward(ctx, x, m):
        ctx.save_for_backward(m)
        return torch.addcmul(x, x, m)

    @staticmethod
    def backward(ctx, g):
        (m,) = ctx.saved_tensors
        return torch.addcmul(g, g, m), None


class _FlatCast(torch.autograd.Function):
    """Many tensors of one dtype cast to ``dtype`` with two kernels (concatenate, convert) instead
    of one per tensor; the backward casts the gradients back the same way. The outputs are views of
    one buffer, the gradients views of another."""

    @staticmethod
    def forward(ctx, dtype, *tensors):
        ctx.shapes = [t.shape for t in tensors]
        ctx.src = tensors[0].dtype
        flat = torch.cat([t.reshape(-1) for t in tensors]).to(dtype)
        return tuple(v.view(s) for v, s in zip(flat.split([t.numel() for t in tensors]), ctx.shapes, strict=True))

    @staticmethod
    def backward(ctx, *grads):
        parts = [g.reshape(-1) if g is not None else torch.zeros(s.numel(), dtype=grads[0].dtype,
                                                                  device=grads[0].device)
                 for g, s in zip(grads, ctx.shapes, strict=True)]
        flat = torch.cat(parts).to(ctx.src)
        return (None, *(v.view(s) for v, s in zip(flat.split([s.numel() for s in ctx.shapes]), ctx.shapes,
                                                    strict=True)))


class _DepthwiseRSC(torch.autograd.Function):
    """Depthwise conv weights (C, 1, 3, 3) of one shape and dtype as the kernels' fp32 (3, 3, C)
    (fp64 stays fp64, for the references), with one stack (and cast) each way instead of a copy
    per weight."""

    @staticmethod
    def forward(ctx, *ws):
        c = ws[0].shape[0]
        ctx.src, ctx.c = ws[0].dtype, c
        st = torch.stack([w.view(c, 9).t() for w in ws]).to(torch.promote_types(ctx.src, torch.float32))  # (n, 9, C)
        return tuple(t.view(3, 3, c) for t in st.unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        c = ctx.c
        gs = [g.reshape(9, c) if g is not None else grads[0].new_zeros(9, c) for g in grads]
        st = torch.stack([g.t() for g in gs]).to(ctx.src)  # (n, C, 9)
        return tuple(t.view(c, 1, 3, 3) for t in st.unbind(0))


class Caster:
    """The parameters of one forward in the compute dtype: those of ``params`` not already in it are
    cast together (:class:`_FlatCast`, per source dtype); ``caster(t)`` returns t's cast (any other
    tensor is cast on its own), ``caster.dtype`` the compute dtype. ``depthwise``: conv weights
    (C, 1, 3, 3) put in the depthwise kernels' layout together (``caster.rsc(w)``)."""

    def __init__(self, dtype: torch.dtype, params, depthwise=()):
        self.dtype = dtype
        self.counted: set[int] = set()  # the BatchNorms whose num_batches_tracked this forward advanced
        self._cast: dict[int, Tensor] = {}
        groups: dict[torch.dtype, list[Tensor]] = {}
        for p in params:
            if p.dtype != dtype:
                groups.setdefault(p.dtype, []).append(p)
        for ps in groups.values():
            for p, c in zip(ps, _FlatCast.apply(dtype, *ps), strict=True):
                self._cast[id(p)] = c
        self._rsc: dict[int, Tensor] = {}
        same: dict[tuple, list[Tensor]] = {}
        for w in depthwise:
            if w.dim() == 4 and tuple(w.shape[1:]) == (1, 3, 3):
                same.setdefault((w.shape[0], w.dtype), []).append(w)
        for ws in same.values():
            for w, r in zip(ws, _DepthwiseRSC.apply(*ws), strict=True):
                self._rsc[id(w)] = r

    def __call__(self, t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        c = self._cast.get(id(t))
        return c if c is not None else t.to(self.dtype)

    def rsc(self, conv_weight: Tensor) -> Tensor:
        """A depthwise conv weight in the kernels' fp32 (3, 3, C) layout."""
        from .ops.dwconv import depthwise_rsc

        r = self._rsc.get(id(conv_weight))
        return r if r is not None else depthwise_rsc(conv_weight)


def _projections_of(stage):
    return [proj.convolution_projection for lay in stage.layers
            for proj in (lay.attention.attention.convolution_projection_query,
                         lay.attention.attention.convolution_projection_key,
                         lay.attention.attention.convolution_projection_value)]


def _stage_params(stage) -> tuple[list[Tensor], list[Tensor]]:
    """(the parameters the ops take in the compute dtype, the depthwise conv weights): all but the
    depthwise projections' go to the first list (the conv weights and BatchNorm affines go to the
    kernels in fp32)."""
    projs = _projections_of(stage)
    skip = {id(p) for proj in projs for p in proj.parameters()}
    return [p for p in stage.parameters() if id(p) not in skip], [p.convolution.weight for p in projs]


def _lin(m: nn.Linear, cv: Caster) -> tuple[Tensor, Tensor | None]:
    return cv(m.weight), cv(m.bias)


def _ln(ops, x: Tensor, ln: nn.LayerNorm, cv: Caster, prefix: Tensor | None = None) -> Tensor:
    return ops.layer_norm_tokens(x, cv(ln.weight), cv(ln.bias), float(ln.eps), prefix)


def train_forward(stage, ops, pixel_values: Tensor) -> tuple[Tensor, Tensor | None]:
    """(tokens as an NCHW view (B, C, H, W), cls rows (B, 1, C) or None), as CvtStage.forward."""
    from .ops.dwconv import count_batches

    cdt = compute_dtype(pixel_values)
    with torch.autocast(pixel_values.device.type, enabled=False):
        cv = Caster(cdt, *_stage_params(stage)) if torch.is_grad_enabled() else Caster(cdt, ())
        cv.counted = count_batches([p.normalization for p in _projections_of(stage)])
        t, hh, ww, cls_rows = _embed(stage, ops, pixel_values, cv)
        for lay in stage.layers:
            t = _layer(stage, ops, lay, t, hh, ww, cls_rows, cv)
    cls_out = t[:, :cls_rows] if cls_rows else None
    return t[:, cls_rows:].unflatten(1, (hh, ww)).permute(0, 3, 1, 2), cls_out


def _embed(stage, ops, pixel_values: Tensor, cv: Caster) -> tuple[Tensor, int, int, int]:
    """The token embedding (conv on NHWC, LayerNorm, cls token in front): (tokens, H, W, cls rows)."""
    from .ops.conv2d import conv_filter_krsc

    emb = stage.embedding.convolution_embeddings
    conv = emb.projection
    ch = stem_channels(conv.weight.shape[1])
    cdt = cv.dtype
    x = pixel_values.to(cdt)
    if x.shape[1] != ch:
        x = ops.image_to_nhwc(x, ch)  # the stem: the image padded to 4 channels
    else:
        x = x.permute(0, 2, 3, 1)  # the previous stage's tokens: no copy
        x = x if x.is_contiguous() else x.contiguous()
    bias = cv(conv.bias)
    if bias is None:
        bias = torch.zeros(conv.weight.shape[0], dtype=cdt, device=x.device)
    y = ops.conv2d_nhwc(x, conv_filter_krsc(cv(conv.weight), ch), bias, conv.stride[0], conv.padding[0])
    b, hh, ww, c = y.shape
    cls = getattr(stage, "cls_token", None)
    prefix = None if cls is None else cv(cls).reshape(-1, c)
    t = _ln(ops, y.view(b, hh * ww, c), emb.normalization, cv, prefix)
    return t, hh, ww, 0 if prefix is None else prefix.shape[0]


def _projections(stage, ops, att, h: Tensor, hh: int, ww: int, cls_rows: int, cv: Caster):
    """q, k, v (B, L, C) of one layer: depthwise conv + BatchNorm, then the Linear."""
    from .ops.dwconv import dwconv_bn

    cfg, i = stage.config, stage.stage
    out = []
    for proj, lin, stride in ((att.convolution_projection_query, att.projection_query, cfg.stride_q[i]),
                              (att.convolution_projection_key, att.projection_key, cfg.stride_kv[i]),
                              (att.convolution_projection_value, att.projection_value, cfg.stride_kv[i])):
        cp = proj.convolution_projection
        w = cp.convolution.weight
        bn = cp.normalization
        z = dwconv_bn(h, w, bn, hh, ww, stride, cls_rows, cv.rsc(w), id(bn) in cv.counted)
        out.append(ops.linear(z, *_lin(lin, cv)))
    return out


def _layer(stage, ops, lay, t: Tensor, hh: int, ww: int, cls_rows: int, cv: Caster) -> Tensor:
    """One CvtLayer on tokens t (B, cls + H*W, C)."""
    att = lay.attention.attention
    b, _, c = t.shape
    heads = stage.config.num_heads[stage.stage]
    q, k, v = _projections(stage, ops, att, _ln(ops, t, lay.layernorm_before, cv), hh, ww, cls_rows, cv)
    lq, lkv, d = q.shape[1], k.shape[1], c // heads
    o, _ = ops.attention(q.view(b, lq, heads, d), k.view(b, lkv, heads, d), v.view(b, lkv, heads, d), c ** -0.5)
    w_o, b_o = _lin(lay.attention.output.dense, cv)
    if getattr(lay.drop_path, "drop_prob", 0.0) and lay.drop_path.training:
        t = add_drop_path(t, ops.linear(o.view(b, lq, c), w_o, b_o), lay.drop_path)
    else:
        t = ops.linear(o.view(b, lq, c), w_o, b_o, t)  # out-projection + residual
    h2 = _ln(ops, t, lay.layernorm_after, cv)
    w1, b1 = _lin(lay.intermediate.dense, cv)
    w2, b2 = _lin(lay.output.dense, cv)
    return drop_path(ops.mlp(h2, w1, b1, w2, b2, t), lay.drop_path)


def has_dropout(module: nn.Module) -> bool:
    """Whether any nn.Dropout under ``module`` has p > 0 (the fused path has no dropout)."""
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())
