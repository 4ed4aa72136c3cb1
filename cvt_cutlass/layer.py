"""A CvT layer as one op (:func:`run_layer`): the weight lists of a CvtLayer in the order
``torch.ops.cvt_cutlass.cvt_layer`` takes them (csrc/ops/layer.cpp), or the reason the layer op
does not serve it (the stage then runs the layer op by op, counted).

The weights come from a stage's :class:`cvt_cutlass.stage.StageParams` (cast for this forward in
training, cached and BatchNorm-folded in inference): ``params.layer(lay)`` builds a
:class:`LayerArgs` with the helpers here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from .switch import Switch

_LAYER_OP = Switch("CVT_CUTLASS_LAYER_OP")


def set_layer_op(enabled: bool | None) -> None:
    """False: every CvT layer runs op by op (counted with reason "disabled"), e.g. to compare the
    two paths; True: the layer op wherever it serves; None: follow CVT_CUTLASS_LAYER_OP (default 1)."""
    _LAYER_OP.set(enabled)


def layer_op_enabled() -> bool:
    return _LAYER_OP()


DISABLED = "disabled (set_layer_op / CVT_CUTLASS_LAYER_OP=0)"


class LayerArgs(NamedTuple):
    """What :func:`run_layer` passes besides the tokens: the weights in csrc/ops/layer.cpp's order
    (ln1 w, b, Wq, bq, Wk, bk, Wv, bv, Wo, bo, ln2 w, b, W1, b1, W2, b2, or those 16 as one 1-D
    buffer in that order, then per projection q, k, v
    in training the depthwise weight (3, 3, C) and BatchNorm's weight and bias, in inference the
    weight and bias with BatchNorm folded in),
    the running statistics updated in place (or none), ln1 eps, ln2 eps, BatchNorm eps q / k / v,
    the running-stat factors q / k / v, and whether BatchNorm runs on batch statistics."""

    weights: list[Tensor]
    running: list[Tensor]
    scalars: list[float]
    train: bool


def linear_weights(lay: nn.Module, linear) -> list[Tensor]:
    """The 16 weights before the projections', each from ``linear(module) -> (W, b)`` /
    for the LayerNorms ``(w, b, eps)``."""
    att = lay.attention.attention
    out: list[Tensor] = []
    for lin in (att.projection_query, att.projection_key, att.projection_value, lay.attention.output.dense):
        out += linear(lin)
    return out


def why_not(lay: nn.Module) -> str | None:
    """Why the layer op does not serve a CvtLayer's configuration (its per-op path runs instead), or None."""
    return static_why_not(lay) or batchnorm_why_not([p.normalization for p in projections(lay)])


def static_why_not(lay: nn.Module) -> str | None:
    """The part of :func:`why_not` a module tree fixes (biases present, affine BatchNorms)."""
    att = lay.attention.attention
    if any(lin.bias is None for lin in (att.projection_query, att.projection_key, att.projection_value)):
        return "qkv_bias=False"
    if not all(p.normalization.affine for p in projections(lay)):
        return "BatchNorm without affine weights"
    return None


def batchnorm_why_not(bns) -> str | None:
    """The part of :func:`why_not` that can change between forwards (process groups, the running
    statistics' dtype), for a layer's q / k / v BatchNorms."""
    from .ops.dwconv import sync_group

    for bn in bns:
        if sync_group(bn) is not None:
            return "SyncBatchNorm over several processes (all-reduces between its ops: the per-op path)"
        if bn.training and bn.track_running_stats and bn.running_mean.dtype not in (torch.float32, torch.float64):
            return f"BatchNorm running statistics in {bn.running_mean.dtype} (the ops update float32 / float64)"
    return None


def projections(lay: nn.Module) -> list[nn.Module]:
    """The q / k / v CvtSelfAttentionConvProjection's conv + BatchNorm of a layer."""
    att = lay.attention.attention
    return [p.convolution_projection for p in (att.convolution_projection_query, att.convolution_projection_key,
                                               att.convolution_projection_value)]


def run_layer(lay: nn.Module, t: Tensor, geom: tuple, args: LayerArgs,
              masks: tuple[Tensor | None, Tensor | None] | None = None) -> Tensor:
    """One CvtLayer on tokens t (B, cls + H*W, C) as one op, HF's drop-path draws in HF's order
    (``masks``: the layer's (drop_attn, drop_out) per-row scales from :func:`stage_drop_masks`,
    or drawn here)."""
    if masks is None:  # this layer's draws alone, as the stage's are made
        drawn = stage_drop_masks([lay], t, args.weights[0].dtype)
        masks = (None, None) if drawn is None else drawn[0]
    drop_attn, drop_out = masks
    if not args.train:
        return ops.cvt_layer(t, args.weights, drop_attn, drop_out, list(args.scalars), list(geom))
    return ops.cvt_layer_train(t, args.weights, args.running, drop_attn, drop_out, list(args.scalars),
                               list(geom))[0]


def row_scales(scale: Tensor, rows: int) -> Tensor:
    """Per-sample scales (..., B, 1, 1) as per-token-row scales (..., B * L) (rows = B * L): one
    copy, each row of the result starting 16 bytes aligned (the Linear hot path runs its kernel
    only on operands that start 16-byte aligned)."""
    lead, b = scale.shape[:-3], scale.shape[-3]
    out = scale.new_empty(*lead, -(-rows // 4) * 4)[..., :rows]
    out.view(*lead, b, rows // b).copy_(scale.reshape(*lead, b, 1).expand(*lead, b, rows // b))
    return out


class _Ops:
    """The ops the stage and the layer call, bound on first use (importing cvt_cutlass.ops loads the binding):
    torch.ops overloads, so no Python wrapper runs between the stage and the C++ hot path."""

    def __getattr__(self, name: str):
        import cvt_cutlass.ops  # noqa: F401  (loads the binding, registers the Python parts)

        from .ops.conv2d import conv_filter_krsc, image_to_nhwc
        from .ops.dwconv import dwconv_bn
        from .ops.linear import mlp

        lib = torch.ops.cvt_cutlass
        bound = {"linear": lib.linear.default, "attention": lib.attention.default,
                 "conv2d_nhwc": lib.conv2d_nhwc.default, "dwconv_tokens": lib.dwconv_tokens.default,
                 "layer_norm_tokens": lib.layer_norm_tokens.default, "image_to_nhwc": image_to_nhwc,
                 "conv_filter_krsc": conv_filter_krsc, "dwconv_bn": dwconv_bn, "mlp": mlp,
                 "cast_params": lib.cast_params.default, "depthwise_rsc_params": lib.depthwise_rsc_params.default,
                 "stage_infer": lib.stage_infer.default, "stage_train": lib.stage_train.default}
        bound["cvt_layer"], bound["cvt_layer_train"] = lib.cvt_layer.default, lib.cvt_layer_train.default
        if not torch.compiler.is_compiling():  # traced: caching here would recompile the graph
            self.__dict__.update(bound)
        return bound[name]


ops = _Ops()


def drop_mask_active(module: nn.Module) -> bool:
    """Whether HF's drop path draws masks in this forward (training, drop_prob > 0)."""
    return bool(getattr(module, "drop_prob", 0.0)) and module.training


def stage_drop_masks(layers, x: Tensor, branch_dtype: torch.dtype | None = None
                     ) -> list[tuple[Tensor | None, Tensor | None]] | None:
    """Every layer's (drop_attn, drop_out) for tokens x (B, L, C): drop path's scale per token row,
    mask / keep in fp32 (fp64 for fp64 x) (B * L,), as :func:`run_layer` draws them (the same random numbers in the
    same order: per layer the attention branch's, then the output's; HF's mask, floor(rand + keep)
    with the sum rounded to the dtype of what it drops: the attention branch's ``branch_dtype``,
    default x's, which differs for an fp32 residual stream under autocast, and x's), the
    arithmetic batched over the stage: one add, conversion, floor, multiply and row expansion for
    all masks (the add and conversion once per dtype where the two differ). None where no layer
    draws."""
    probs = [float(lay.drop_path.drop_prob) if drop_mask_active(lay.drop_path) else None for lay in layers]
    drawn = [p for p in probs if p is not None]
    if not drawn:
        return None
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    opmath = torch.promote_types(x.dtype, torch.float32)
    keep, inv_keep = _keep_factors(tuple(drawn), x.device, x.ndim, opmath)
    if branch_dtype is None or branch_dtype == x.dtype:
        rand = torch.stack([torch.rand(shape, dtype=x.dtype, device=x.device) for _ in range(2 * len(drawn))])
        mask = (rand + keep).to(x.dtype).floor_()  # floor(rand + keep): HF's, its sum rounded to x's dtype
    else:  # each draw in its own dtype (drawn in HF's order), the sums of each dtype rounded to it together
        draws = [torch.rand(shape, dtype=dt, device=x.device) for _ in drawn for dt in (branch_dtype, x.dtype)]
        sums = [(torch.stack(draws[i::2]).to(opmath) + keep[i::2]).to(dt).to(opmath)
                for i, dt in enumerate((branch_dtype, x.dtype))]
        mask = torch.stack(sums, dim=1).flatten(0, 1).floor_()  # back in draw order: attention, output, ...
    scales = row_scales(mask * inv_keep, x.shape[0] * x.shape[1])  # (2 n, B * L), fp32 (fp64 for fp64 x)
    masks, k = [], 0
    for p in probs:
        masks.append((None, None) if p is None else (scales[2 * k], scales[2 * k + 1]))
        k += p is not None
    return masks


_keep_cache: dict = {}


def _keep_factors(probs: tuple[float, ...], device: torch.device, ndim: int,
                  opmath: torch.dtype) -> tuple[Tensor, Tensor]:
    """(1 - p) and 1 / (1 - p) per mask (two per layer) in the precision PyTorch's scalar ops
    compute in (fp32 for 16-bit and fp32 tensors, fp64 for fp64), made once per stage, device and
    precision by fills on the device (no host-to-device copy, none per step)."""
    if torch.compiler.is_compiling():  # constants of the traced graph (a cache would recompile it)
        return _make_keep_factors(probs, device, ndim, opmath)
    key = (probs, str(device), ndim, opmath)
    got = _keep_cache.get(key)
    if got is None:
        if len(_keep_cache) >= 64:  # drop rates that change every step: a bound, not a leak
            _keep_cache.clear()
        got = _keep_cache[key] = _make_keep_factors(probs, device, ndim, opmath)
    return got


def keep_factor_tensors() -> list[Tensor]:
    """The keep factors cached now (a CUDA graph that read them keeps them alive)."""
    return [t for pair in _keep_cache.values() for t in pair]


def _make_keep_factors(probs: tuple[float, ...], device, ndim: int, opmath: torch.dtype) -> tuple[Tensor, Tensor]:
    tail = (1,) * ndim
    keep = torch.empty((2 * len(probs),) + tail, dtype=opmath, device=device)
    inv = torch.empty((2 * len(probs),) + tail, dtype=opmath, device=device)
    for i, p in enumerate(probs):  # fills on the device: capturable, no host-to-device copy
        keep[2 * i:2 * i + 2].fill_(1 - p)
        inv[2 * i:2 * i + 2].fill_(1 / (1 - p))
    return keep, inv


def drop_mask(x: Tensor, module: nn.Module) -> Tensor | None:
    """HF's CvtDropPath draw for x (per-sample 0 / 1 of shape (B, 1, ...), x's dtype, the same
    random numbers in the same order), or None where HF's drop path is the identity."""
    if not drop_mask_active(module):
        return None
    p = module.drop_prob
    return torch.floor(torch.rand((x.shape[0],) + (1,) * (x.ndim - 1), dtype=x.dtype, device=x.device) + (1 - p))
