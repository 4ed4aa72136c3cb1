"""A CvT stage on the CUTLASS ops, written once for inference and training.

:func:`run_stage` runs a ``CvtStage``'s modules on tokens (B, cls + H*W, C) from the token
embedding to the stage output: the embedding conv on NHWC (``conv2d_nhwc``), LayerNorm (which
writes stage 3's cls token in front: no ``torch.cat``), then per layer LayerNorm, the three
depthwise conv projections with BatchNorm, the q / k / v GEMMs, fused attention with CvT's scale,
the out-projection with the residual in its epilogue, LayerNorm and the MLP (bias + GELU in fc1's
epilogue, the residual in fc2's), HF's drop path where it is on.

Where the weights come from is the only difference between the two uses, a :class:`StageParams`:

* :class:`FoldedParams` (inference: eval mode, no gradient): the parameters cast to the run dtype
  once and cached, BatchNorm folded into the depthwise weights (``dwconv_tokens``), the MLP as two
  fused GEMMs;
* :class:`CastParams` (training mode, or autograd recording): the parameters themselves cast to
  the compute dtype in this forward with one concatenated cast per source dtype (gradients come back
  in the parameters' dtype), BatchNorm on batch statistics with nn.BatchNorm2d's running-stat
  updates (:func:`cvt_cutlass.ops.dwconv.dwconv_bn`; folded, differentiably, in eval), and the MLP
  op that keeps GELU's derivative at fc1's pre-activation for its fused backward.

The compute dtype (:func:`compute_dtype`) is autocast's for the input's device when autocast is
on (the ops then run with autocast off: they take one dtype), else the input's.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Protocol

import torch
from torch import Tensor, nn

from .layer import drop_mask, drop_mask_active, ops, run_layer, stage_drop_masks
from .models import split_rows
from .operators.conv2d import stem_channels


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the ops run in: autocast's for x's device when it is on, else x's (also on a
    device autocast does not know, e.g. meta)."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if autocast_on(dev) else x.dtype


def autocast_on(device_type: str) -> bool:
    """torch.is_autocast_enabled for the device types autocast knows; False elsewhere (meta)."""
    if torch.compiler.is_compiling():
        # Dynamo (torch 2.11) cannot trace torch.amp.is_autocast_available: it broke the graph there
        # in every stage and recompiled the pieces on every step. A traced model's device is a real one.
        return device_type != "meta" and torch.is_autocast_enabled(device_type)
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str):
    """A context that turns autocast off where it is on (the ops take one dtype: autocast's)."""
    return torch.autocast(device_type, enabled=False) if autocast_on(device_type) else contextlib.nullcontext()




class StageParams(Protocol):
    """The weights of one forward of a stage, in the compute dtype (see the module docstring)."""

    dtype: torch.dtype

    def embed(self, conv: nn.Conv2d, channels: int) -> tuple[Tensor, Tensor]: ...  # KRSC filter, bias

    def cls(self, stage: nn.Module, dtype: torch.dtype) -> Tensor | None: ...  # (rows, C) in the stream's dtype

    def ln(self, ln: nn.LayerNorm) -> tuple[Tensor, Tensor, float]: ...

    def linear(self, lin: nn.Linear) -> tuple[Tensor, Tensor | None]: ...

    def project(self, projs: list[nn.Module], h: Tensor, hh: int, ww: int, strides: tuple[int, ...],
                cls_rows: int) -> list[Tensor]: ...  # a layer's q / k / v conv projections of h

    def mlp(self, layer: nn.Module, h: Tensor, residual: Tensor) -> Tensor: ...

    def layer(self, layer: nn.Module): ...  # ops.layer.LayerArgs, or why the layer op does not serve it


# ----------------------------------------------------------------------------- the pipeline
def run_stage(stage: nn.Module, pixel_values: Tensor, params: StageParams, stream: torch.dtype | None = None,
              out: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]:
    """(tokens as an NCHW view (B, C, H, W), cls rows (B, rows, C) or None), as CvtStage.forward,
    with the ops in ``params.dtype`` (the caller turned autocast off), the residual stream in
    ``stream`` (default the same; fp32: as HF's CvT under autocast) and the outputs in ``out``
    (default the stream's; ``params.dtype`` on an fp32 stream: its last sum rounded once, where the
    next stage's embedding reads it in 16 bits: :func:`rounds_output`)."""
    stream = stream or params.dtype
    out = out or stream
    t, hh, ww, cls_rows = _embed(stage, pixel_values, params, stream)
    cfg, i = stage.config, stage.stage
    geom = (hh, ww, cls_rows, cfg.num_heads[i], cfg.stride_q[i], cfg.stride_kv[i])
    args = [params.layer(lay) for lay in stage.layers]
    # the drop-path masks drawn up front where every layer runs the layer op (in HF's order); a
    # layer that runs op by op draws its own where it runs
    masks = None if any(isinstance(a, str) for a in args) else stage_drop_masks(stage.layers, t, params.dtype)
    ckpt = checkpoint_func(stage)
    last = len(stage.layers) - 1
    for i, lay in enumerate(stage.layers):
        m = None if masks is None else masks[i]
        rounded = i == last and out != stream and (m is None or m[1] is None)  # (the layer op's own rounding)
        t = _layer(lay, t, geom + (1,) if rounded else geom, params, args[i], m, ckpt)
    if t.dtype != out:  # the op-by-op path's output (or a stage without layers): the same one rounding
        t = t.to(out)
    return split_rows(t, hh, ww, cls_rows)


def rounds_output(stage: nn.Module, dtype: torch.dtype, stream: torch.dtype, hidden_states: bool) -> bool:
    """Whether a stage computing in ``dtype`` on a residual stream in ``stream`` hands its output on
    in ``dtype`` (its last sum rounded once) rather than the stream's: an fp32 stream under
    autocast, a stage before another (whose embedding conv HF's autocast feeds the output rounded
    to ``dtype``), without drop path on its last layer's output this forward (HF adds the residual
    before its scale: that layer keeps the fp32 sum), and ``hidden_states`` False (the model returns
    no hidden states: HF's are fp32)."""
    if stream == dtype or hidden_states or stage.stage >= len(stage.config.depth) - 1:
        return False
    return not (stage.layers and drop_mask_active(stage.layers[-1].drop_path))


def _embed(stage, x: Tensor, params: StageParams, stream: torch.dtype) -> tuple[Tensor, int, int, int]:
    """The token embedding (conv on NHWC, LayerNorm, cls token in front): (tokens in the stream's
    dtype, H, W, cls rows)."""
    emb = stage.embedding.convolution_embeddings
    conv = emb.projection
    c_in = conv.weight.shape[1]
    if x.dim() != 4 or x.shape[1] != c_in:  # as nn.Conv2d says it (padded channels would hide it)
        raise RuntimeError(f"cvt_cutlass: stage {stage.stage}'s embedding expects input (N, {c_in}, H, W) "
                           f"({c_in} channels), got {tuple(x.shape)}")
    ch = stem_channels(c_in)
    if ch != c_in:
        x = ops.image_to_nhwc(x, ch, params.dtype)  # the stem: the image padded to 4 channels, cast
    else:
        x = x.to(params.dtype).permute(0, 2, 3, 1)  # the previous stage's tokens: no copy
        x = x if x.is_contiguous() else x.contiguous()
    w, b = params.embed(conv, ch)
    y = ops.conv2d_nhwc(x, w, b, conv.stride[0], conv.padding[0])
    n, hh, ww, c = y.shape
    prefix = params.cls(stage, stream)
    t = ops.layer_norm_tokens(y.view(n, hh * ww, c), *params.ln(emb.normalization), prefix, stream)
    return t, hh, ww, 0 if prefix is None else prefix.shape[0]


def checkpoint_func(stage):
    """The stage's activation-checkpointing function in this forward (HF's, set by its
    gradient_checkpointing_enable, else non-reentrant torch.utils.checkpoint), or None."""
    from torch.utils.checkpoint import checkpoint

    if not (getattr(stage, "gradient_checkpointing", False) and stage.training and torch.is_grad_enabled()):
        return None
    func = getattr(stage, "_gradient_checkpointing_func", None)
    if func is None:
        return functools.partial(checkpoint, use_reentrant=False)
    if getattr(func, "keywords", {}).get("use_reentrant"):
        raise ValueError("cvt_cutlass: the fused stages checkpoint non-reentrantly; enable checkpointing with "
                         "use_reentrant=False (transformers' default)")
    return func


def _layer(lay, t: Tensor, geom: tuple, params: StageParams, args, masks=None, checkpoint=None) -> Tensor:
    """One CvtLayer on tokens t (B, cls + H*W, C): the layer op (one C++ op, one autograd node)
    with ``args = params.layer(lay)``, under the activation-checkpointing function ``checkpoint``, or
    the op-by-op path for what it does not serve (``args`` the reason, counted; never checkpointed:
    its BatchNorms would update their running statistics again in the recompute; the count's
    reason says so)."""
    from . import fallback

    if not isinstance(args, str):
        if checkpoint is not None and args.train:
            return _checkpointed_layer(lay, t, geom, args, masks, checkpoint)
        return run_layer(lay, t, geom, args, masks)
    fallback.record_layer_path(f"{args}; not checkpointed" if checkpoint is not None else args)
    return _layer_ops(lay, t, geom, params)


def _layer_ops(lay, t: Tensor, geom: tuple, params: StageParams) -> Tensor:
    """One CvtLayer on tokens t (B, cls + H*W, C), op by op."""
    hh, ww, cls_rows, heads, sq, skv = geom[:6]  # (a rounded output is the stage's cast here)
    att = lay.attention.attention
    b, _, c = t.shape
    h = ops.layer_norm_tokens(t, *params.ln(lay.layernorm_before), None)
    projs = [att.convolution_projection_query, att.convolution_projection_key, att.convolution_projection_value]
    q, k, v = (ops.linear(hp, *params.linear(lin)) for hp, lin in zip(
        params.project(projs, h, hh, ww, (sq, skv, skv), cls_rows),
        (att.projection_query, att.projection_key, att.projection_value), strict=True))
    lq, lkv, d = q.shape[1], k.shape[1], c // heads
    o, _ = ops.attention(q.view(b, lq, heads, d), k.view(b, lkv, heads, d), v.view(b, lkv, heads, d), c ** -0.5)
    w_o, b_o = params.linear(lay.attention.output.dense)
    if drop_mask_active(lay.drop_path):
        t = add_drop_path(t, ops.linear(o.view(b, lq, c), w_o, b_o), lay.drop_path)
    else:
        t = ops.linear(o.view(b, lq, c), w_o, b_o, t)  # out-projection + residual
    h2 = ops.layer_norm_tokens(t, *params.ln(lay.layernorm_after), None)
    return drop_path(params.mlp(lay, h2, t), lay.drop_path)


def _checkpointed_layer(lay, t: Tensor, geom: tuple, args, masks, checkpoint) -> Tensor:
    """The layer op under ``checkpoint`` (checkpoint_func's: torch.utils.checkpoint with HF's
    options, offload included): the backward recomputes the layer's forward from t instead of
    keeping what it saves; the recompute updates no running statistics (the first run did) and
    uses the same drop-path masks (passed in, or redrawn from the restored RNG state)."""
    runs = [0]

    def fn(x: Tensor) -> Tensor:
        a = args if runs[0] == 0 else args._replace(running=[])
        runs[0] += 1
        return run_layer(lay, x, geom, a, masks)

    return checkpoint(fn, t, preserve_rng_state=masks is None)


# ----------------------------------------------------------------------------- drop path
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


def has_dropout(module: nn.Module) -> bool:
    """Whether any nn.Dropout under ``module`` has p > 0 (the fused stage has no dropout)."""
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())


def projections_of(stage) -> list[nn.Module]:
    """The ``CvtSelfAttentionConvProjection`` (conv + BatchNorm) modules of a stage, q / k / v per layer."""
    return [proj.convolution_projection for lay in stage.layers
            for proj in (lay.attention.attention.convolution_projection_query,
                         lay.attention.attention.convolution_projection_key,
                         lay.attention.attention.convolution_projection_value)]
