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
or buffer changes (version counters and data pointers, watched in C++; any parameter, buffer or
submodule registration), the module is moved or cast, or it is put back into eval mode.

In training mode, or while autograd records (an input or a parameter requires grad), a fused
stage runs the same pipeline differentiably (:mod:`cvt_cutlass.swap_train`): the parameters
themselves cast to the compute dtype (autocast's when it is on), BatchNorm on batch statistics
with nn.BatchNorm2d's running-stat updates (folded in eval), HF's drop path, and every backward on
the kernels (the ops' C++ autograd formulas). The head's LayerNorm and classifier train on the
kernels too. Inference under autocast runs the ops in autocast's dtype.

A config the fused stage does not cover (projection methods other than ``dw_bn``, even kernel
sizes) or a stage with dropout > 0 in training runs HF's own forward on its own modules, the reason
counted in ``cvt_cutlass.stats()['fallbacks']`` as ``swap:<reason>`` (strict mode raises). For a
CvtForImageClassification the head's LayerNorm and classifier are swapped too
(:class:`FusedHeadLayerNorm`, :class:`FusedHeadLinear`, same parameters); HF's forward still
takes the mean over the (single) cls row between them.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from . import fallback
from .swap_train import compute_dtype, has_dropout, train_forward

_SWAPPED_ATTR = "_cvt_cutlass_swapped"  # on the root model: {stage path: original CvtStage}

# Bumped whenever any module registers a parameter, buffer or submodule (module.weight = ...):
# the fused stages' derived weights are then checked again. The global hooks that bump it are
# registered with the first watch (importing this module changes nothing process-wide).
_GENERATION = [0]
_GENERATION_HOOKS: list = []


def _bump_generation(*_args):
    _GENERATION[0] += 1


def _count_registrations() -> None:
    if not _GENERATION_HOOKS:
        _GENERATION_HOOKS.extend(register(_bump_generation) for register in (
            nn.modules.module.register_module_parameter_registration_hook,
            nn.modules.module.register_module_buffer_registration_hook,
            nn.modules.module.register_module_module_registration_hook))


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
    from .ops.dwconv import fold_batchnorm

    conv, bn = proj.convolution_projection.convolution, proj.convolution_projection.normalization
    return fold_batchnorm(conv.weight.detach(), bn.running_mean, bn.running_var, bn.weight.detach(),
                          bn.bias.detach(), bn.eps, None if conv.bias is None else conv.bias.detach())


class _Ops:
    """The ops the fused modules call, as torch.ops overloads (no Python wrapper between the
    forward and the C++ hot path); bound when the first module is built."""

    linear = attention = conv2d_nhwc = dwconv_tokens = layer_norm_tokens = image_to_nhwc = mlp = None

    @classmethod
    def bind(cls) -> None:
        if cls.linear is None:
            import cvt_cutlass.ops  # noqa: F401  (loads the binding, registers the Python parts)

            ops = torch.ops.cvt_cutlass
            cls.linear, cls.attention = ops.linear.default, ops.attention.default
            cls.conv2d_nhwc, cls.dwconv_tokens = ops.conv2d_nhwc.default, ops.dwconv_tokens.default
            cls.layer_norm_tokens = ops.layer_norm_tokens.default
            from .ops.conv2d import image_to_nhwc
            from .ops.linear import mlp

            cls.image_to_nhwc = staticmethod(image_to_nhwc)
            cls.mlp = staticmethod(mlp)


def _ln(x: Tensor, params: tuple[Tensor, Tensor, float], prefix: Tensor | None = None) -> Tensor:
    return _Ops.layer_norm_tokens(x, params[0], params[1], params[2], prefix)


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
        self._dropout = has_dropout(stage)
        self._weights: _StageWeights | None = None
        self._watch: tuple | None = None  # (binding watch id, registration generation, weak refs, finalizer)
        _Ops.bind()

    def train(self, mode: bool = True):
        self._weights = None  # re-derive on the next eval forward (BN statistics may have moved)
        return super().train(mode)

    def _stale(self) -> bool:
        """Whether a parameter or buffer changed since the weights were derived: an in-place write
        (version counter) or a ``.data`` swap (data pointer), checked in C++ (about 1 us), or a
        different tensor object in the module tree (looked for only after some module somewhere
        registered a parameter, buffer or submodule: the generation counter)."""
        if self._watch is None:
            return True
        wid, gen, refs, drop = self._watch
        if gen != _GENERATION[0]:
            now = self._watched_tensors()
            if len(now) != len(refs) or any(a is not r() for a, r in zip(now, refs, strict=True)):
                return True
            self._watch = (wid, _GENERATION[0], refs, drop)
        return torch.ops.cvt_cutlass_C.watch_changed(wid)

    def _watched_tensors(self) -> list[Tensor]:
        return [*self.parameters(), *self.buffers()]

    def _rewatch(self) -> None:
        _count_registrations()
        if self._watch is not None:
            self._watch[3]()  # drops the old watch (its finalizer)
        tensors = self._watched_tensors()
        wid = torch.ops.cvt_cutlass_C.watch_tensors(tensors)
        drop = weakref.finalize(self, torch.ops.cvt_cutlass_C.watch_drop, wid)
        self._watch = (wid, _GENERATION[0], [weakref.ref(t) for t in tensors], drop)

    def __getstate__(self):
        # A copy (deepcopy, pickle) derives its own weights and watches its own tensors.
        state = dict(self.__dict__)
        state["_weights"], state["_watch"] = None, None
        return state

    def _apply(self, fn, recurse: bool = True):
        self._weights = None  # .to() / .half() / .cuda(): derive again
        return super()._apply(fn, recurse)

    def weights(self, dtype: torch.dtype, device: torch.device) -> _StageWeights:
        """The folded / cast weights for a forward in ``dtype`` on ``device``.

        Eager: derived when a parameter or buffer changed (version counters), else cached. Under
        torch.compile the swapped model's pre-forward hook (which runs outside the graph) has
        derived them already; the graph reads them (and derives them itself, without caching,
        only when a stage is compiled on its own)."""
        key = (dtype, device)
        if torch.compiler.is_compiling():
            w = self._weights
            return w if w is not None and w.key == key else self._derive(dtype, device, key)
        if self._weights is None or self._weights.key != key or self._stale():
            self._weights = self._derive(dtype, device, key)
            self._rewatch()
        return self._weights

    def _derive(self, dtype: torch.dtype, device: torch.device, key: tuple) -> _StageWeights:
        from .operators.conv2d import stem_channels
        from .ops.conv2d import conv_filter_krsc

        conv = self.embedding.convolution_embeddings.projection
        cin = conv.weight.shape[1]
        ch = stem_channels(cin)
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
        return _StageWeights(
            key=key,
            embed_w=conv_filter_krsc(conv.weight.detach().to(dtype), ch),
            embed_b=_cast(conv.bias, dtype) if conv.bias is not None else torch.zeros(
                conv.weight.shape[0], dtype=dtype, device=device),
            embed_ln=_ln_params(self.embedding.convolution_embeddings.normalization, dtype),
            cls=None if cls is None else _cast(cls, dtype).reshape(-1, cls.shape[-1]), layers=layers)

    def fallback_reason(self, x: Tensor) -> str | None:
        if self._unsupported:
            return "config"
        if self.training and self._dropout:
            return "dropout"
        return None  # other dtypes/devices: each op counts its own fallback

    def differentiable(self, x: Tensor) -> bool:
        """Whether this forward runs the differentiable path (training mode, or autograd recording
        with x or a parameter requiring grad) rather than the cached inference weights."""
        return self.training or (torch.is_grad_enabled() and (x.requires_grad or any(
            p.requires_grad for p in self.parameters())))

    def forward(self, hidden_state: Tensor):
        why = self.fallback_reason(hidden_state)
        if why is not None:
            detail = self._unsupported if why == "config" else "dropout > 0 in training (the fused path has none)"
            fallback.record_fallback("swap", why, f"stage {self.stage}: {detail}")
            return self._hf_forward(self, hidden_state)
        if self.differentiable(hidden_state):
            return train_forward(self, _Ops, hidden_state)
        dev = hidden_state.device.type
        if torch.is_autocast_enabled(dev):  # inference under autocast: the ops run in its dtype
            with torch.autocast(dev, enabled=False):
                return self.fused_forward(hidden_state.to(torch.get_autocast_dtype(dev)))
        return self.fused_forward(hidden_state)

    def fused_forward(self, pixel_values: Tensor):
        ops = _Ops
        cfg, i = self.config, self.stage
        w = self.weights(pixel_values.dtype, pixel_values.device)
        conv = self.embedding.convolution_embeddings.projection
        b = pixel_values.shape[0]
        cin = pixel_values.shape[1]
        if cin != w.embed_w.shape[3]:
            x = ops.image_to_nhwc(pixel_values, w.embed_w.shape[3])
        else:
            x = pixel_values.permute(0, 2, 3, 1)  # the previous fused stage's tokens: no copy
            if not x.is_contiguous():
                x = x.contiguous()
        y = ops.conv2d_nhwc(x, w.embed_w, w.embed_b, conv.stride[0], conv.padding[0])
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
            qc = ops.dwconv_tokens(h, *lw.dw[0], hh, ww, sq, cls_rows)
            kc = ops.dwconv_tokens(h, *lw.dw[1], hh, ww, skv, cls_rows)
            vc = ops.dwconv_tokens(h, *lw.dw[2], hh, ww, skv, cls_rows)
            q = ops.linear(qc, lw.wq, lw.bq)
            k = ops.linear(kc, lw.wk, lw.bk)
            v = ops.linear(vc, lw.wv, lw.bv)
            lq, lkv = q.shape[1], k.shape[1]
            o, _ = ops.attention(q.view(b, lq, heads, d), k.view(b, lkv, heads, d), v.view(b, lkv, heads, d), scale)
            t = ops.linear(o.view(b, lq, c), lw.wo, lw.bo, t)  # out-projection + residual
            h2 = _ln(t, lw.ln2)
            f = ops.linear(h2, lw.w1, lw.b1, None, "gelu")
            t = ops.linear(f, lw.w2, lw.b2, t)  # fc2 + residual
        cls_out = t[:, :cls_rows] if cls_rows else None
        body = t[:, cls_rows:].unflatten(1, (hh, ww)).permute(0, 3, 1, 2)  # NCHW view of the tokens
        return body, cls_out


class _HeadModule(nn.Module):
    """Common part of the swapped head modules: the original module's parameters under the same
    names, on the kernels in every mode. In training or while autograd records, the parameters are
    cast differentiably (gradients come back in their dtype); under autocast the op runs in
    autocast's dtype."""

    def __init__(self, orig: nn.Module, what: str):
        super().__init__()
        self.weight = orig.weight
        self.bias = orig.bias
        self._what = what
        self.train(orig.training)
        _Ops.bind()

    def _args(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """(x, weight, bias) in the compute dtype."""
        cdt = compute_dtype(x)
        diff = self.training or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        w, b = (self.weight, self.bias) if diff else (self.weight.detach(), _detach(self.bias))
        return x.to(cdt), w.to(cdt), None if b is None else b.to(cdt)


def _detach(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach()


class FusedHeadLayerNorm(_HeadModule):
    """The classification head's LayerNorm (on the cls token, or the last stage's tokens) on the
    LayerNorm kernel."""

    def __init__(self, ln: nn.LayerNorm):
        super().__init__(ln, "LayerNorm")
        self.eps = ln.eps
        self.normalized_shape = ln.normalized_shape

    def forward(self, x: Tensor) -> Tensor:
        x, w, b = self._args(x)
        with torch.autocast(x.device.type, enabled=False):
            return _Ops.layer_norm_tokens(x, w, b, self.eps, None)


class FusedHeadLinear(_HeadModule):
    """The classifier on the Linear GEMM kernel (bias epilogue). A class count that is not a
    multiple of 8 (the kernels' 16-byte rows) runs on zero-padded weight rows, the extra logits
    sliced off (:func:`linear_rows8`), on a GPU; the CPU runs the op's reference as it is."""

    def __init__(self, lin: nn.Linear):
        super().__init__(lin, "Linear")
        self.in_features, self.out_features = lin.in_features, lin.out_features

    def forward(self, x: Tensor) -> Tensor:
        x, w, b = self._args(x)
        with torch.autocast(x.device.type, enabled=False):
            if self.out_features % 8 and x.device.type == "cuda":
                return linear_rows8(_Ops.linear, x, w, b)
            return _Ops.linear(x, w, b)


def linear_rows8(linear, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``linear(x, w, b)`` with w's rows (and b) zero-padded to a multiple of 8 and the padded
    outputs dropped: the same values and gradients (the pads are differentiable, their rows get
    zero gradient and are cut off), contiguous logits."""
    pad = -w.shape[0] % 8
    wp = torch.nn.functional.pad(w, (0, 0, 0, pad))
    bp = None if b is None else torch.nn.functional.pad(b, (0, pad))
    return linear(x, wp, bp)[..., :w.shape[0]].contiguous()


def swap(model: nn.Module, *, prebuild: bool = False, image_size: int | tuple[int, int] | None = None,
         filter_fn: Callable[[str, nn.Module], bool] | None = None) -> nn.Module:
    """Install :class:`FusedCvtStage` in place of every CvtStage of ``model`` and, for a
    CvtForImageClassification, the head's LayerNorm and classifier (each module for which
    ``filter_fn(path, module)`` is true; paths ``cvt.encoder.stages.<i>``, ``layernorm``,
    ``classifier``); returns ``model``. Swapping twice is a no-op for stages already swapped;
    ``unswap`` restores the original modules.

    Kernels: the first forward at a new (image size, dtype, device) builds, in parallel with a
    progress bar, every kernel the model can call there at any batch size from 1 to 1024
    (:func:`cvt_cutlass.model_kernels`), so a later batch size builds nothing. ``prebuild=True``
    does it now for the model's device and dtype (CUDA, fp16/bf16) at ``image_size`` (default
    224). The same forward pre-hook marks the images' batch dimension dynamic for torch.compile
    (one graph serves every batch size >= 2; batch 1 is specialised once)."""
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
    if _HOOK_ATTR not in model.__dict__:
        object.__setattr__(model, _HOOK_ATTR, model.register_forward_pre_hook(_before_forward, with_kwargs=True))
        object.__setattr__(model, _PREPARED_ATTR, set())
    object.__setattr__(model, _STAGES_ATTR, [s for s in enc.stages if isinstance(s, FusedCvtStage)])
    if prebuild:
        _prebuild_now(model, image_size)
    return model


def unswap(model: nn.Module) -> nn.Module:
    """Put back the original CvtStage objects ``swap`` replaced (the same objects, holding the
    same parameters), and remove the forward pre-hook."""
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
    for attr in (_SWAPPED_ATTR, _HOOK_ATTR, _PREPARED_ATTR, _STAGES_ATTR):
        if attr == _HOOK_ATTR and attr in model.__dict__:
            model.__dict__[attr].remove()
        if attr in model.__dict__:
            object.__delattr__(model, attr)
    return model


def is_swapped(model: nn.Module) -> bool:
    return bool(getattr(model, _SWAPPED_ATTR, None))


# ----------------------------------------------------------------------------- first forward
_HOOK_ATTR = "_cvt_cutlass_hook"  # the root model's forward pre-hook handle
_STAGES_ATTR = "_cvt_cutlass_stages"  # the fused stages the hook looks after
_PREPARED_ATTR = "_cvt_cutlass_prepared"  # {_prepared_key(...)} whose kernels are built


@torch._dynamo.disable
def _before_forward(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Runs before every forward of a swapped root model, outside any torch.compile graph: builds
    the kernels of a new (image size, dtype, device) in parallel, and marks the batch dimension
    dynamic so that a compiled model keeps one graph for every batch size."""
    x = args[0] if args else kwargs.get("pixel_values")
    if not isinstance(x, Tensor) or x.dim() != 4:
        return
    if x.shape[0] > 1:  # batch 1 keeps a graph of its own (size-1 dims specialise: broadcasting)
        torch._dynamo.maybe_mark_dynamic(x, 0)
    fused = [s for s in model.__dict__.get(_STAGES_ATTR, ()) if s.fallback_reason(x) is None]
    if not fused:
        return  # HF's forward runs for every stage: nothing to build or derive
    training = any(s.differentiable(x) for s in fused)
    cdt = compute_dtype(x)
    key = _prepared_key((x.shape[2], x.shape[3]), cdt, x.device, training)
    prepared = model.__dict__.get(_PREPARED_ATTR)
    if prepared is not None and key not in prepared:
        _prepare(model, (x.shape[2], x.shape[3]), cdt, x.device, training)
        prepared.add(key)
    infer = [s for s in fused if not s.differentiable(x)]  # the training path uses the parameters themselves
    if infer:
        _check_weights(infer, x.to(cdt) if cdt != x.dtype else x)


def _prepared_key(hw: tuple[int, int], dtype: torch.dtype, device: torch.device, training: bool = False) -> tuple:
    """What a set of built kernels serves: image size, dtype, device, the kernel path (sm89 / sm90 /
    auto: set_kernel_path switches to other kernels) and whether the training kernels are in it."""
    from .runtime import get_kernel_path

    return (hw[0], hw[1], dtype, device, get_kernel_path(), training)


def _check_weights(stages: list[FusedCvtStage], x: Tensor) -> None:
    """Derive the folded weights of the stages that will run fused, here, outside any graph (a
    compiled forward reads them): one C++ call checks every stage's tensors."""
    key = (x.dtype, x.device)
    if any(s._weights is None or s._weights.key != key or s._watch is None or s._watch[1] != _GENERATION[0]
           for s in stages) or torch.ops.cvt_cutlass_C.watch_changed_any([s._watch[0] for s in stages]):
        for s in stages:
            s.weights(*key)


def _prepare(model: nn.Module, image_size: tuple[int, int], dtype: torch.dtype, device: torch.device,
             training: bool = False) -> int:
    """Build every kernel the swapped model can call at this image size, dtype and device (any
    batch size; ``training``: the training forward's and the backward's too); returns how many the
    cache lacked. Nothing to build off CUDA or in fp32/fp64 (those run the visible PyTorch
    fallbacks)."""
    from . import runtime
    from .api import model_kernels
    from .ops.common import DTYPES

    if device.type != "cuda" or dtype not in DTYPES:
        return 0
    dev = runtime.device_info(device.index if device.index is not None else torch.cuda.current_device())
    arch = runtime.arch_for(dev.cc)
    if arch is None:
        return 0
    specs = model_kernels(model, image_size, DTYPES[dtype], arch, training, gpu=dev.name)
    jobs = runtime.plan(specs, dev.cc)
    missing = sum(not j.is_built for j in jobs)
    runtime.prebuild(specs, dev.cc, planned=jobs)
    return missing


def _prebuild_now(model: nn.Module, image_size) -> None:
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cuda" or p.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError("cvt_cutlass.swap(prebuild=True) builds the kernels for the model's device and dtype: "
                         "move it to a CUDA device in float16/bfloat16 first (model.cuda().half()), or leave "
                         f"prebuild=False and the first forward builds them (parameters are on "
                         f"{None if p is None else p.device} in {None if p is None else p.dtype})")
    size = image_size or 224
    hw = size if isinstance(size, tuple) else (size, size)
    _prepare(model, hw, p.dtype, p.device, model.training)
    model.__dict__[_PREPARED_ATTR].add(_prepared_key(hw, p.dtype, p.device, model.training))


class _CallableModule(types.ModuleType):
    """``import cvt_cutlass.swap`` makes ``cvt_cutlass.swap`` this module (the import system sets
    the package attribute): calling it still swaps, so ``cvt_cutlass.swap(model)`` works whatever
    was imported first."""

    def __call__(self, model: nn.Module, **kw) -> nn.Module:
        return swap(model, **kw)


sys.modules[__name__].__class__ = _CallableModule
