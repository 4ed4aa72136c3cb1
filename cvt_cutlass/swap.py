"""One call moves a HF CvT onto the CUTLASS kernels: ``swap(model)`` / ``unswap(model)``.

``swap`` replaces every ``CvtStage`` of a ``CvtForImageClassification`` or ``CvtModel`` (any
config: depths, dims, heads, cls tokens come from the model) with a :class:`FusedCvtStage` that
adopts the stage's own submodules and parameters under the same names, so ``state_dict()`` keys
and tensors are unchanged and ``unswap`` puts the very same ``CvtStage`` objects back.

In eval mode, under ``torch.no_grad()``/``torch.inference_mode()`` (or with no parameter that
requires grad), a fused stage runs in tokens (B, cls + H*W, C) from the embedding to its output:

* token embedding: implicit-GEMM conv (``conv2d_nhwc``, NHWC in, tokens out), then LayerNorm
  (``layer_norm_tokens``, which writes the cls token in front of stage 3's tokens: no cat);
* per layer: LayerNorm, three depthwise conv projections with BatchNorm folded
  (``dwconv_tokens``, cls row passed through), q/k/v Linear GEMMs (three: in CvT k and v come
  from two different conv projections, so one GEMM with concatenated weights would need a
  block-diagonal weight, i.e. twice the FLOPs), fused attention with CvT's scale on (B, L, H, D)
  views, out-projection GEMM with the residual add in its epilogue, LayerNorm, fc1 GEMM with
  bias + GELU epilogue, fc2 GEMM with bias + residual epilogue.

Folded / cast weights are derived lazily per (device, dtype) and re-derived whenever a parameter
or buffer changes (their version counters) or the module is put back into eval mode.

Everything else keeps HF's semantics visibly: in training mode, with autograd recording, or for
a config the fused stage does not cover (projection methods other than ``dw_bn``, even kernel
sizes), a stage runs HF's own forward on its own modules and the reason is counted in
``cvt_cutlass.stats()['fallbacks']`` as ``swap:<reason>`` (strict mode raises). For a
CvtForImageClassification the head's LayerNorm and classifier are swapped too
(:class:`FusedHeadLayerNorm`, :class:`FusedHeadLinear`, same parameters); HF's forward still
takes the mean over the (single) cls row between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import fallback

_SWAPPED_ATTR = "_cvt_cutlass_swapped"  # on the root model: {stage path: original CvtStage}


def _stage_class():
    from transformers.models.cvt.modeling_cvt import CvtStage

    return CvtStage


def _encoder_of(model: nn.Module):
    """The CvtEncoder of a CvtForImageClassification, CvtModel or CvtEncoder."""
    from transformers.models.cvt.modeling_cvt import CvtEncoder, CvtForImageClassification, CvtModel

    if isinstance(model, CvtForImageClassification):
        return "cvt.encoder", model.cvt.encoder
    if isinstance(model, CvtModel):
        return "encoder", model.encoder
    if isinstance(model, CvtEncoder):
        return "", model
    raise TypeError(f"cvt_cutlass.swap: expected a HF CvtForImageClassification, CvtModel or CvtEncoder, "
                    f"got {type(model).__name__}")


def unsupported_reason(stage: nn.Module) -> str | None:
    """Why the fused stage cannot run this CvtStage's config (None if it can)."""
    cfg, i = stage.config, stage.stage
    if cfg.qkv_projection_method[i] != "dw_bn":
        return f"projection method {cfg.qkv_projection_method[i]!r} (fused: 'dw_bn')"
    if cfg.kernel_qkv[i] % 2 == 0 or cfg.padding_q[i] != cfg.kernel_qkv[i] // 2 or \
            cfg.padding_kv[i] != cfg.kernel_qkv[i] // 2:
        return f"kernel {cfg.kernel_qkv[i]} with padding {cfg.padding_q[i]}/{cfg.padding_kv[i]} (fused: odd, 'same')"
    if cfg.stride_q[i] != 1:
        return f"stride_q {cfg.stride_q[i]} (the residual needs stride_q 1)"
    if cfg.embed_dim[i] % cfg.num_heads[i]:
        return f"embed_dim {cfg.embed_dim[i]} not divisible by {cfg.num_heads[i]} heads"
    return None


@dataclass
class _LayerWeights:
    ln1: tuple[Tensor, Tensor, float]
    dw: list[tuple[Tensor, Tensor]]  # q, k, v: (R, R, C) fp32 weights, (C,) fp32 bias (BatchNorm folded)
    wq: Tensor
    bq: Tensor | None
    wk: Tensor
    bk: Tensor | None
    wv: Tensor
    bv: Tensor | None
    wo: Tensor
    bo: Tensor
    ln2: tuple[Tensor, Tensor, float]
    w1: Tensor
    b1: Tensor
    w2: Tensor
    b2: Tensor


@dataclass
class _StageWeights:
    key: tuple
    embed_w: Tensor  # (K, R, S, C') in the run dtype, C' padded for the stem
    embed_b: Tensor
    embed_ln: tuple[Tensor, Tensor, float]
    cls: Tensor | None  # (1, C) in the run dtype: the prefix row the embedding's LayerNorm writes
    layers: list[_LayerWeights]


def _ln_params(ln: nn.LayerNorm, dtype) -> tuple[Tensor, Tensor, float]:
    return ln.weight.detach().to(dtype).contiguous(), ln.bias.detach().to(dtype).contiguous(), float(ln.eps)


def _cast(t: Tensor | None, dtype) -> Tensor | None:
    return None if t is None else t.detach().to(dtype).contiguous()


def _fold(proj: nn.Module) -> tuple[Tensor, Tensor]:
    from .ops.conv import fold_batchnorm

    conv, bn = proj.convolution_projection.convolution, proj.convolution_projection.normalization
    return fold_batchnorm(conv.weight.detach(), bn.running_mean, bn.running_var, bn.weight.detach(),
                          bn.bias.detach(), bn.eps, None if conv.bias is None else conv.bias.detach())


def _ln(x: Tensor, params: tuple[Tensor, Tensor, float], prefix: Tensor | None = None) -> Tensor:
    from .ops.norm import layer_norm_tokens

    return layer_norm_tokens(x, params[0], params[1], params[2], prefix)


class FusedCvtStage(nn.Module):
    """A CvtStage on the CUTLASS ops (see the module docstring); holds the original stage's
    submodules under the original names."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.config = stage.config
        self.stage = stage.stage
        if "cls_token" in stage._parameters:
            self.cls_token = stage.cls_token
        self.embedding = stage.embedding
        self.layers = stage.layers
        self._hf_forward = type(stage).forward
        self._unsupported = unsupported_reason(stage)
        self._weights: _StageWeights | None = None

    def train(self, mode: bool = True):
        self._weights = None  # re-derive on the next eval forward (BN statistics may have moved)
        return super().train(mode)

    def _version_key(self, dtype, device) -> tuple:
        # Inference tensors (parameters converted under torch.inference_mode()) keep no version
        # counter: for them the storage address stands in (a new tensor means new weights).
        vs = tuple(("inf", t.data_ptr()) if t.is_inference() else t._version
                   for t in (*self.parameters(), *self.buffers()))
        return (dtype, device, vs)

    def weights(self, dtype: torch.dtype, device: torch.device) -> _StageWeights:
        from .ops.conv import conv_filter_krsc, stem_channels

        if torch.compiler.is_compiling():
            # Under torch.compile the weights derived by an eager call are graph constants (their
            # version counters are not traced); without one they are derived inside the graph.
            w = self._weights
            if w is not None and w.key[:2] == (dtype, device):
                return w
            key = (dtype, device, None)
        else:
            key = self._version_key(dtype, device)
            if self._weights is not None and self._weights.key == key:
                return self._weights
        conv = self.embedding.convolution_embeddings.projection
        cin = conv.weight.shape[1]
        ch = stem_channels(cin) if cin % 8 else cin
        layers = []
        for lay in self.layers:
            att = lay.attention.attention
            dw = [tuple(t.to(device) for t in _fold(p)) for p in (att.convolution_projection_query,
                                                                   att.convolution_projection_key,
                                                                   att.convolution_projection_value)]
            layers.append(_LayerWeights(
                ln1=_ln_params(lay.layernorm_before, dtype), dw=dw,
                wq=_cast(att.projection_query.weight, dtype), bq=_cast(att.projection_query.bias, dtype),
                wk=_cast(att.projection_key.weight, dtype), bk=_cast(att.projection_key.bias, dtype),
                wv=_cast(att.projection_value.weight, dtype), bv=_cast(att.projection_value.bias, dtype),
                wo=_cast(lay.attention.output.dense.weight, dtype), bo=_cast(lay.attention.output.dense.bias, dtype),
                ln2=_ln_params(lay.layernorm_after, dtype),
                w1=_cast(lay.intermediate.dense.weight, dtype), b1=_cast(lay.intermediate.dense.bias, dtype),
                w2=_cast(lay.output.dense.weight, dtype), b2=_cast(lay.output.dense.bias, dtype)))
        cls = getattr(self, "cls_token", None)
        self._weights = _StageWeights(
            key=key,
            embed_w=conv_filter_krsc(conv.weight.detach().to(dtype), ch),
            embed_b=_cast(conv.bias, dtype) if conv.bias is not None else torch.zeros(
                conv.weight.shape[0], dtype=dtype, device=device),
            embed_ln=_ln_params(self.embedding.convolution_embeddings.normalization, dtype),
            cls=None if cls is None else _cast(cls, dtype).reshape(-1, cls.shape[-1]), layers=layers)
        return self._weights

    def fallback_reason(self, x: Tensor) -> str | None:
        if self._unsupported:
            return "config"
        if self.training:
            return "training"
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            return "autograd"
        return None  # other dtypes/devices: each op counts its own fallback

    def forward(self, hidden_state: Tensor):
        why = self.fallback_reason(hidden_state)
        if why is not None:
            detail = self._unsupported if why == "config" else {
                "training": "training mode (backward passes of the fused blocks do not exist yet)",
                "autograd": "autograd is recording (use torch.no_grad() or torch.inference_mode())"}[why]
            fallback.record_fallback("swap", why, f"stage {self.stage}: {detail}")
            return self._hf_forward(self, hidden_state)
        return self.fused_forward(hidden_state)

    def fused_forward(self, pixel_values: Tensor):
        from .ops.attention import attention
        from .ops.conv import conv2d_nhwc, dwconv_tokens, image_to_nhwc
        from .ops.linear import linear

        cfg, i = self.config, self.stage
        w = self.weights(pixel_values.dtype, pixel_values.device)
        conv = self.embedding.convolution_embeddings.projection
        b = pixel_values.shape[0]
        cin = pixel_values.shape[1]
        if cin != w.embed_w.shape[3]:
            x = image_to_nhwc(pixel_values, w.embed_w.shape[3])
        else:
            x = pixel_values.permute(0, 2, 3, 1)  # the previous fused stage's tokens: no copy
            if not x.is_contiguous():
                x = x.contiguous()
        y = conv2d_nhwc(x, w.embed_w, w.embed_b, conv.stride[0], conv.padding[0])
        _, hh, ww, c = y.shape
        # LayerNorm of the embedding's tokens, the cls token written in front by the same kernel
        t = _ln(y.view(b, hh * ww, c), w.embed_ln, w.cls)
        cls_rows = 0 if w.cls is None else w.cls.shape[0]
        heads = cfg.num_heads[i]
        d = c // heads
        scale = c ** -0.5
        sq, skv = cfg.stride_q[i], cfg.stride_kv[i]
        for lw in w.layers:
            h = _ln(t, lw.ln1)
            qc = dwconv_tokens(h, *lw.dw[0], hh, ww, sq, cls_rows)
            kc = dwconv_tokens(h, *lw.dw[1], hh, ww, skv, cls_rows)
            vc = dwconv_tokens(h, *lw.dw[2], hh, ww, skv, cls_rows)
            q = linear(qc, lw.wq, lw.bq)
            k = linear(kc, lw.wk, lw.bk)
            v = linear(vc, lw.wv, lw.bv)
            lq, lkv = q.shape[1], k.shape[1]
            o, _ = attention(q.view(b, lq, heads, d), k.view(b, lkv, heads, d), v.view(b, lkv, heads, d), scale)
            t = linear(o.view(b, lq, c), lw.wo, lw.bo, t)  # out-projection + residual
            h2 = _ln(t, lw.ln2)
            f = linear(h2, lw.w1, lw.b1, activation="gelu")
            t = linear(f, lw.w2, lw.b2, t)  # fc2 + residual
        cls_out = t[:, :cls_rows] if cls_rows else None
        body = t[:, cls_rows:].unflatten(1, (hh, ww)).permute(0, 3, 1, 2)  # NCHW view of the tokens
        return body, cls_out


class _HeadModule(nn.Module):
    """Common part of the swapped head modules: the original module's parameters under the same
    names, HF semantics (visibly) in training mode or with autograd recording."""

    def __init__(self, orig: nn.Module, what: str):
        super().__init__()
        self.weight = orig.weight
        self.bias = orig.bias
        self._what = what
        self.train(orig.training)

    def _fallback(self, x: Tensor) -> bool:
        why = "training" if self.training else (
            "autograd" if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad) else None)
        if why is None:
            return False
        fallback.record_fallback("swap", why, f"head {self._what}: runs PyTorch's {self._what} (no backward yet)")
        return True

    def _param(self, t: Tensor, x: Tensor) -> Tensor:
        return t if t.dtype == x.dtype else t.detach().to(x.dtype)


class FusedHeadLayerNorm(_HeadModule):
    """The classification head's LayerNorm (on the cls token, or the last stage's tokens) on the
    LayerNorm kernel."""

    def __init__(self, ln: nn.LayerNorm):
        super().__init__(ln, "LayerNorm")
        self.eps = ln.eps
        self.normalized_shape = ln.normalized_shape

    def forward(self, x: Tensor) -> Tensor:
        if self._fallback(x):
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        from .ops.norm import layer_norm_tokens

        return layer_norm_tokens(x, self._param(self.weight, x), self._param(self.bias, x), self.eps)


class FusedHeadLinear(_HeadModule):
    """The classifier on the Linear GEMM kernel (bias epilogue)."""

    def __init__(self, lin: nn.Linear):
        super().__init__(lin, "Linear")
        self.in_features, self.out_features = lin.in_features, lin.out_features

    def forward(self, x: Tensor) -> Tensor:
        if self._fallback(x):
            return F.linear(x, self.weight, self.bias)
        from .ops.linear import linear

        b = None if self.bias is None else self._param(self.bias, x)
        return linear(x, self._param(self.weight, x), b)


def model_kernels(cfg, batches, image_size: int | None, dtypes, arch: int, gpu: str | None = None) -> list:
    """The kernel specs a swapped model of shape ``cfg`` (a CvtShape or HF CvtConfig) picks at
    these batches, image size and dtypes on ``arch``: what ``cvt-cutlass run`` builds up front."""
    from .models import (
        CvtShape,
        attention_problems,
        conv_problems,
        layernorm_problems,
        linear_problems,
        shape_of,
    )
    from .ops.conv import stem_channels
    from .selection import select_attention, select_conv2d, select_dwconv, select_layernorm, select_linear

    if not isinstance(cfg, CvtShape):
        cfg = shape_of(cfg)
    out: dict[str, object] = {}
    for b in batches:
        for dt in dtypes:
            specs = [select_linear(p.m, p.n, p.k, dt, p.epilogue, arch, gpu).spec
                     for p in linear_problems(cfg, b, image_size) if p.label != "head" or cfg.num_labels > 0]
            specs += [select_layernorm(n.rows, n.channels, dt, arch, gpu).spec
                      for n in layernorm_problems(cfg, b, image_size)]
            for lay in conv_problems(cfg, b, image_size):
                if lay.kind == "embed":
                    c = stem_channels(lay.c) if lay.c % 8 else lay.c
                    specs.append(select_conv2d(lay.n * lay.p * lay.q, lay.k, lay.r * lay.r * c, c, dt, arch, gpu).spec)
                else:
                    specs.append(select_dwconv(lay.n * lay.p * lay.q, lay.c, lay.stride, dt, arch, gpu).spec)
            specs += [select_attention(a.n, a.heads, a.lq, a.lkv, a.head_dim, dt, arch, gpu).spec
                      for a in attention_problems(cfg, b, image_size)]
            for s in specs:
                out.setdefault(s.name, s)
    return list(out.values())


def swap(model: nn.Module, *, filter_fn: Callable[[str, nn.Module], bool] | None = None) -> nn.Module:
    """Install :class:`FusedCvtStage` in place of every CvtStage of ``model`` and, for a
    CvtForImageClassification, the head's LayerNorm and classifier (each module for which
    ``filter_fn(path, module)`` is true; paths ``cvt.encoder.stages.<i>``, ``layernorm``,
    ``classifier``); returns ``model``. Swapping twice is a no-op for stages
    already swapped; ``unswap`` restores the original modules."""
    prefix, enc = _encoder_of(model)
    cls = _stage_class()
    swapped = getattr(model, _SWAPPED_ATTR, None)
    if swapped is None:
        swapped = {}
        object.__setattr__(model, _SWAPPED_ATTR, swapped)
    for j, stage in enumerate(list(enc.stages)):
        path = f"{prefix}.stages.{j}" if prefix else f"stages.{j}"
        if not isinstance(stage, cls) or (filter_fn is not None and not filter_fn(path, stage)):
            continue
        fused = FusedCvtStage(stage)
        fused.train(stage.training)
        enc.stages[j] = fused
        swapped[path] = stage
    for path, fused_cls, orig_cls in (("layernorm", FusedHeadLayerNorm, nn.LayerNorm),
                                      ("classifier", FusedHeadLinear, nn.Linear)):
        orig = getattr(model, path, None) if prefix == "cvt.encoder" else None
        if type(orig) is not orig_cls or (filter_fn is not None and not filter_fn(path, orig)):
            continue  # not a classification model, nn.Identity (no labels), or filtered out
        setattr(model, path, fused_cls(orig))
        swapped[path] = orig
    return model


def unswap(model: nn.Module) -> nn.Module:
    """Put back the original CvtStage objects ``swap`` replaced (the same objects, holding the
    same parameters)."""
    prefix, enc = _encoder_of(model)
    swapped = getattr(model, _SWAPPED_ATTR, None) or {}
    for j, _ in enumerate(list(enc.stages)):
        path = f"{prefix}.stages.{j}" if prefix else f"stages.{j}"
        if path in swapped:
            orig = swapped.pop(path)
            orig.train(enc.stages[j].training)
            enc.stages[j] = orig
    for path in ("layernorm", "classifier"):
        if path in swapped:
            orig = swapped.pop(path)
            orig.train(getattr(model, path).training)
            setattr(model, path, orig)
    if hasattr(model, _SWAPPED_ATTR):
        object.__delattr__(model, _SWAPPED_ATTR)
    return model


def is_swapped(model: nn.Module) -> bool:
    return bool(getattr(model, _SWAPPED_ATTR, None))
