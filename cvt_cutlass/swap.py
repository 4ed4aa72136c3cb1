"""One call moves a HF CvT onto the CUTLASS kernels: ``swap(model)`` / ``unswap(model)``.

``swap`` replaces every ``CvtStage`` of a ``CvtForImageClassification`` or ``CvtModel`` (any
config: depths, dims, heads, cls tokens come from the model) with a :class:`FusedCvtStage` that
adopts the stage's own submodules and parameters under the same names, so ``state_dict()`` keys
and tensors are unchanged and ``unswap`` puts the very same ``CvtStage`` objects back.

A fused stage runs :func:`cvt_cutlass.stage.run_stage`, the one pipeline for inference and
training, with its weights from :mod:`cvt_cutlass.params`: in eval mode without autograd
recording, the folded inference weights (:class:`~cvt_cutlass.params.FoldedParams`), derived per
(dtype, device) and re-derived whenever a parameter or buffer changes (version counters and data
pointers, watched in C++; any parameter, buffer or submodule registration), the module is moved
or cast, or it is put back into eval mode; in training mode, or while autograd records (an input
or a parameter requires grad), the parameters themselves cast in the forward
(:class:`~cvt_cutlass.params.CastParams`: BatchNorm on batch statistics, HF's drop path, every
backward on the kernels through the ops' C++ autograd formulas). Under autocast the ops run in
autocast's dtype (:func:`cvt_cutlass.stage.compute_dtype`).

A config the fused stage does not cover (projection methods other than ``dw_bn``, even kernel
sizes) or a stage with dropout > 0 in training runs HF's own forward on its own modules, the reason
counted in ``cvt_cutlass.stats()['fallbacks']`` as ``swap:<reason>`` (strict mode raises). For a
CvtForImageClassification the head's LayerNorm and classifier are swapped too
(:class:`FusedHeadLayerNorm`, :class:`FusedHeadLinear`, same parameters, on the kernels in every
mode); HF's forward still takes the mean over the (single) cls row between them.
"""

from __future__ import annotations

import inspect
import sys
import types
import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from . import fallback
from .graphs import StageGraphs, forget_placement, is_fsdp, stage_graphs_enabled
from .handles import register as register_handle
from .models import output_geometry, split_rows
from .ops.stage import traced_output_dtype, traced_stream_dtype
from .params import CastParams, FoldedParams, StageRecipe, generation, watch_registrations
from .stage import (
    autocast_off,
    autocast_on,
    checkpoint_func,
    compute_dtype,
    has_dropout,
    ops,
    rounds_output,
    run_stage,
)

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


def traced_in_training(stage: nn.Module) -> str | None:
    """Why a compiled training forward of a fused stage traces its ops instead of calling the
    ``stage_train`` op (:mod:`cvt_cutlass.ops.stage`), or None."""
    if getattr(stage, "_is_replica", False):
        return "an nn.DataParallel replica (it shares its original's handle)"
    if is_fsdp(stage):
        return "FSDP2 (its hooks gather the parameters around the traced call)"
    if checkpoint_func(stage) is not None:
        return "activation checkpointing"
    if not stage_graphs_enabled():  # the way to torch.autograd.grad with respect to the parameters
        return "stage graphs off"
    return None


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
        self._weights: FoldedParams | None = None
        self._graphs = StageGraphs()  # CUDA graphs of this stage's calls (cvt_cutlass.graphs)
        self._handle = register_handle(self)  # what torch.compile's stage ops find it by
        # an empty leaf that makes a compiled graph differentiate its stage_train op (ops/stage.py):
        # a plain attribute on the CPU (not a parameter: .to() leaves it, optimizers never see it;
        # its .grad stays an empty tensor)
        self._anchor = torch.zeros(0, requires_grad=True)
        self._watch: tuple | None = None  # (binding watch id, registration generation, weak refs, finalizer)
        # activation checkpointing per layer in training (HF's gradient_checkpointing_enable() on the
        # swapped model sets it; HF's own CvT has none)
        self.gradient_checkpointing = False
        # under autocast, keep the residual stream in fp32 as HF's CvT does (swap(residual_stream=))
        self.fp32_stream = False
        # whether the root model's forward returns hidden states (set by its pre-hook; True, HF's fp32
        # outputs, where no hook says: a stage called on its own)
        self.hidden_states = True

    @property
    def handle(self) -> int:
        """The number the stage ops (``torch.ops.cvt_cutlass.stage_infer`` / ``stage_train``)
        find this stage by."""
        return self._handle

    def stream_dtype(self, x: Tensor, dtype: torch.dtype) -> torch.dtype:
        """The residual stream's dtype in a forward computing in ``dtype``: fp32 under autocast
        with ``fp32_stream`` set (HF's CvT adds its residuals in fp32 there), else ``dtype``; inside
        a compiled graph's stage op, the one its trace saw."""
        traced = None if torch.compiler.is_compiling() else traced_stream_dtype()  # (thread-local: not traced)
        if traced is not None:
            return traced
        if self.fp32_stream and dtype in (torch.float16, torch.bfloat16) and autocast_on(x.device.type):
            return torch.float32
        return dtype

    def output_dtype(self, x: Tensor, dtype: torch.dtype, stream: torch.dtype | None = None) -> torch.dtype:
        """The outputs' dtype in a forward computing in ``dtype``: the residual stream's (``stream``,
        :meth:`stream_dtype`'s where the caller has it), or ``dtype`` where the stream is fp32 and the
        next stage's embedding reads the output in 16 bits (:func:`cvt_cutlass.stage.rounds_output`);
        inside a compiled graph's stage op, the one its trace saw."""
        traced = None if torch.compiler.is_compiling() else traced_output_dtype()
        if traced is not None:
            return traced
        stream = stream or self.stream_dtype(x, dtype)
        if getattr(self, "_is_replica", False):  # (a DataParallel replica's flag is its original's at replication)
            return stream
        return dtype if rounds_output(self, dtype, stream, self.hidden_states) else stream

    def train(self, mode: bool = True):
        self._drop_watch()  # derive again on the next eval forward (the kernels update the BatchNorm
        # statistics in place, which their version counters do not see)
        return super().train(mode)

    def _drop_watch(self) -> None:
        if self._watch is not None:
            self._watch[3]()  # drops the binding's watch (its finalizer), and its hold on the tensors
            self._watch = None

    def _stale(self) -> bool:
        """Whether a parameter or buffer changed since the weights were derived: an in-place write
        (version counter) or a ``.data`` swap (data pointer), checked in C++ (about 1 us), or a
        different tensor object in the module tree (looked for only after some module somewhere
        registered a parameter, buffer or submodule: the generation counter)."""
        if self._watch is None:
            return True
        wid, gen, refs, drop = self._watch
        if gen != generation():
            now = self._watched_tensors()
            if len(now) != len(refs) or any(a is not r() for a, r in zip(now, refs, strict=True)):
                return True
            self._watch = (wid, generation(), refs, drop)
        return torch.ops.cvt_cutlass_C.watch_changed(wid)

    def _watched_tensors(self) -> list[Tensor]:
        return [*self.parameters(), *self.buffers()]

    def _rewatch(self) -> None:
        watch_registrations()
        self._drop_watch()
        tensors = self._watched_tensors()
        wid = torch.ops.cvt_cutlass_C.watch_tensors(tensors)
        drop = weakref.finalize(self, torch.ops.cvt_cutlass_C.watch_drop, wid)
        self._watch = (wid, generation(), [weakref.ref(t) for t in tensors], drop)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._handle = register_handle(self)  # a copy is a stage of its own

    def __getstate__(self):
        # A copy (deepcopy, pickle) derives its own weights and watches its own tensors.
        state = dict(self.__dict__)
        state["_weights"], state["_watch"], state["_graphs"] = None, None, StageGraphs()
        state.pop("_cvt_graph_slots", None)
        state.pop("_cvt_graph_modules", None)
        state.pop("_cvt_graph_placement", None)  # (its watch is of this stage's tensors)
        return state

    def _apply(self, fn, recurse: bool = True):
        self._weights = None  # .to() / .half() / .cuda(): derive again
        self._drop_watch()  # (it would keep the tensors it watched alive)
        self._graphs.clear()  # and capture again
        forget_placement(self)
        return super()._apply(fn, recurse)

    def weights(self, dtype: torch.dtype, device: torch.device) -> FoldedParams:
        """The folded inference weights for a forward in ``dtype`` on ``device``.

        Eager: derived once per (dtype, device), and derived again into the same tensors when a
        parameter or buffer changed (version counters, data pointers) or the stage went through
        train(), so that CUDA graphs that read them (the stage's own, a compiled model's
        reduce-overhead graphs) see the new values; a parameter of a new shape derives new tensors
        (and a new handle: compiled graphs recompile). Under
        torch.compile the swapped model's pre-forward hook (which runs outside the graph) has
        derived them already; the graph reads them (and derives them itself, without caching,
        only when a stage is compiled on its own)."""
        key = (dtype, device)
        if torch.compiler.is_compiling():
            w = self._weights
            return w if w is not None and w.key == key else FoldedParams(self, dtype, device)
        w = self._weights
        if w is None or w.key != key:
            self._weights = FoldedParams(self, dtype, device)
            self._handle = register_handle(self)  # graphs compiled around the old weights recompile
            self._rewatch()
        elif self._stale():  # derived again into the same tensors: graphs that read them stay valid
            # (not inside a CUDA graph capture: its replays would copy from tensors freed after it;
            # derived anew there, the capture holds the derivation)
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            if capturing or not w.refresh(FoldedParams(self, dtype, device)):
                self._weights = None
                return self.weights(dtype, device)
            self._rewatch()
        return self._weights

    def fallback_reason(self, x: Tensor) -> str | None:
        if self._unsupported:
            return "config"
        if self.training and self._dropout:
            return "dropout"
        if not self.training and not torch.compiler.is_compiling() and StageRecipe.of(self).untracked \
                and not self.differentiable(x):  # (not traced: guards on every BatchNorm's buffers)
            return "batchnorm"  # (folded weights need running statistics; the training path serves it)
        return None  # other dtypes/devices: each op counts its own fallback

    def differentiable(self, x: Tensor) -> bool:
        """Whether this forward runs the differentiable path (training mode, or autograd recording
        with x or a parameter requiring grad) rather than the cached inference weights."""
        return self.training or (torch.is_grad_enabled() and (x.requires_grad or any(
            p.requires_grad for p in self.parameters())))

    def forward(self, hidden_state: Tensor):
        why = self.fallback_reason(hidden_state)
        if why is not None:
            detail = {"config": self._unsupported, "dropout": "dropout > 0 in training (the fused path has none)",
                      "batchnorm": "a BatchNorm without running statistics in eval mode without autograd "
                                   "(it normalizes with the batch's: no folded weights)"}[why]
            fallback.record_fallback("swap", why, f"stage {self.stage}: {detail}")
            return self._hf_forward(self, hidden_state)
        dtype = compute_dtype(hidden_state)
        if torch.compiler.is_compiling():
            return self._compiled_forward(hidden_state, dtype)
        return self._graphs(self, hidden_state, dtype, self._run)

    def _compiled_forward(self, x: Tensor, dtype: torch.dtype):
        """Under torch.compile: one opaque op that runs the stage as an eager call would (its graphs
        replayed at run time: ops/stage.py), or the stage's ops traced where that op does not serve."""
        if self.differentiable(x):
            if traced_in_training(self) is not None:
                return self._run(x, dtype)
            # (the parameters stay out of the trace: guards on each would cost host time per call)
            call = torch.empty(0)  # this call site's own (ops/stage.py: never merged with another call)
            stream = self.stream_dtype(x, dtype)
            tokens, cls, _ = ops.stage_train(x, self._anchor, call, self._handle, dtype, stream,
                                             self.output_dtype(x, dtype, stream), x.requires_grad,
                                             torch.is_grad_enabled())
        elif getattr(self, "_is_replica", False):
            return self._run(x, dtype)  # a DataParallel replica shares its original's handle
        else:
            _, h, w, _, rows = output_geometry(self, x)
            stream = self.stream_dtype(x, dtype)
            return split_rows(ops.stage_infer(x, self._handle, dtype, stream, self.output_dtype(x, dtype, stream)),
                              h, w, rows)
        return tokens, (cls if cls.shape[1] else None)

    def _run(self, x: Tensor, dtype: torch.dtype):
        """The stage's eager forward on x in ``dtype``: (tokens (B, C, H, W), cls rows or None)."""
        stream = self.stream_dtype(x, dtype)
        out = self.output_dtype(x, dtype, stream)
        with autocast_off(x.device.type):
            return run_stage(self, x, self._params(x, dtype), stream, out)

    def _params(self, x: Tensor, dtype: torch.dtype):
        """The training weights (cast in this forward) or the cached inference weights."""
        return CastParams(self, dtype) if self.differentiable(x) else self.weights(dtype, x.device)


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

    def _args(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """(x, weight, bias) in the compute dtype."""
        cdt = compute_dtype(x)
        diff = self.training or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        w, b = (self.weight, self.bias) if diff else (self.weight.detach(), _detach(self.bias))
        return x.to(cdt), w.to(cdt), None if b is None else b.to(cdt)

    def _stream_args(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """_args, but fp32 x (an fp32 residual stream under autocast) kept for the LayerNorm to read."""
        xc, w, b = self._args(x)
        return (x if x.dtype == torch.float32 and w.dtype != torch.float32 else xc), w, b


def _detach(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach()


class FusedHeadLayerNorm(_HeadModule):
    """The classification head's LayerNorm (on the cls token, or the last stage's tokens) on the
    LayerNorm kernel."""

    def __init__(self, ln: nn.LayerNorm):
        super().__init__(ln, "LayerNorm")
        self.eps = ln.eps
        self.normalized_shape = ln.normalized_shape
        self.fp32_stream = False  # swap(residual_stream="fp32"): fp32 tokens read as they come

    def forward(self, x: Tensor) -> Tensor:
        x, w, b = self._stream_args(x) if self.fp32_stream else self._args(x)
        with autocast_off(x.device.type):
            return ops.layer_norm_tokens(x, w, b, self.eps, None)


class FusedHeadLinear(_HeadModule):
    """The classifier on the Linear GEMM kernel (bias epilogue). A class count that is not a
    multiple of 8 (the kernels' 16-byte rows) runs on zero-padded weight rows, the extra logits
    sliced off (:func:`linear_rows8`), on a GPU; the CPU runs the op's reference as it is."""

    def __init__(self, lin: nn.Linear):
        super().__init__(lin, "Linear")
        self.in_features, self.out_features = lin.in_features, lin.out_features

    def forward(self, x: Tensor) -> Tensor:
        x, w, b = self._args(x)
        with autocast_off(x.device.type):
            if self.out_features % 8 and x.device.type == "cuda":
                return linear_rows8(ops.linear, x, w, b)
            return ops.linear(x, w, b)


def linear_rows8(linear, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``linear(x, w, b)`` with w's rows (and b) zero-padded to a multiple of 8 and the padded
    outputs dropped: the same values and gradients (the pads are differentiable, their rows get
    zero gradient and are cut off), contiguous logits."""
    pad = -w.shape[0] % 8
    wp = torch.nn.functional.pad(w, (0, 0, 0, pad))
    bp = None if b is None else torch.nn.functional.pad(b, (0, pad))
    return linear(x, wp, bp)[..., :w.shape[0]].contiguous()


def swap(model: nn.Module, *, prebuild: bool = False, image_size: int | tuple[int, int] | None = None,
         filter_fn: Callable[[str, nn.Module], bool] | None = None, residual_stream: str = "fp32") -> nn.Module:
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
    (one graph serves every batch size >= 2; batch 1 is specialised once).

    ``residual_stream="fp32"`` (the default): under torch.autocast the stages keep the residual
    stream (the embeddings' LayerNorm outputs and the out-projection / fc2 sums) in fp32 and their
    LayerNorms read it there, as HF's CvT does: the gradients' error is HF autocast's (CvT-13,
    bf16, H100, 2026-11-27: 0.0116 vs 0.0115 relative against fp32; prebuild builds its kernels
    too). A stage before another hands its tokens on in autocast's dtype (its last sum rounded once,
    where HF's autocast rounds them for the next embedding conv), unless the root model's forward
    returns hidden states (HF's are fp32). ``"compute"`` runs it in autocast's dtype: ~6% less GPU
    time per training step (CvT-13, batch 128, H100, 2026-12-06) for HF's pure-16-bit accuracy
    (0.0156). Without autocast: the same."""
    if residual_stream not in ("compute", "fp32"):
        raise ValueError(f"cvt_cutlass.swap: residual_stream must be 'compute' or 'fp32', got {residual_stream!r}")
    prefix, enc = _encoder_of(model)
    swapped = getattr(model, _SWAPPED_ATTR, None)
    if swapped is None:
        swapped = {}
        object.__setattr__(model, _SWAPPED_ATTR, swapped)
    fp32 = residual_stream == "fp32"
    _swap_stages(enc, prefix, swapped, filter_fn, fp32)
    if swapped and isinstance(getattr(type(model), "supports_gradient_checkpointing", None), bool):
        # HF's gradient_checkpointing_enable() then switches the fused stages' checkpointing on
        object.__setattr__(model, "supports_gradient_checkpointing", True)
    if prefix == "cvt.encoder":
        _swap_head(model, swapped, filter_fn, fp32)
    if _HOOK_ATTR not in model.__dict__:
        object.__setattr__(model, _HOOK_ATTR, model.register_forward_pre_hook(_before_forward, with_kwargs=True))
        object.__setattr__(model, _POST_HOOK_ATTR, model.register_forward_hook(_after_forward, always_call=True))
        object.__setattr__(model, _PREPARED_ATTR, set())
    object.__setattr__(model, _STAGES_ATTR, [s for s in enc.stages if isinstance(s, FusedCvtStage)])
    if prebuild:
        _prebuild_now(model, image_size, residual_stream)
    return model


def _swap_stages(enc: nn.Module, prefix: str, swapped: dict, filter_fn, fp32: bool) -> None:
    """swap's stages: a FusedCvtStage for each CvtStage of ``enc`` that ``filter_fn`` takes (the
    original kept in ``swapped`` under its path); one swapped before takes the latest stream option."""
    cls = _stage_class()
    for j, stage in enumerate(list(enc.stages)):
        path = f"{prefix}.stages.{j}" if prefix else f"stages.{j}"
        if isinstance(stage, FusedCvtStage) and (filter_fn is None or filter_fn(path, stage)):
            stage.fp32_stream = fp32
            continue
        if not isinstance(stage, cls) or (filter_fn is not None and not filter_fn(path, stage)):
            continue
        fused = FusedCvtStage(stage)
        fused.fp32_stream = fp32
        fused.train(stage.training)
        enc.stages[j] = fused
        swapped[path] = stage


def _swap_head(model: nn.Module, swapped: dict, filter_fn, fp32: bool) -> None:
    """swap's head of a CvtForImageClassification: its LayerNorm and classifier, where they are
    nn.LayerNorm / nn.Linear (not nn.Identity: no labels) and ``filter_fn`` takes them."""
    for path, fused_cls, orig_cls in (("layernorm", FusedHeadLayerNorm, nn.LayerNorm),
                                      ("classifier", FusedHeadLinear, nn.Linear)):
        orig = getattr(model, path, None)
        if type(orig) is not orig_cls or (filter_fn is not None and not filter_fn(path, orig)):
            continue
        setattr(model, path, fused_cls(orig))
        swapped[path] = orig
    if isinstance(getattr(model, "layernorm", None), FusedHeadLayerNorm):
        model.layernorm.fp32_stream = fp32


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
    for attr in (_SWAPPED_ATTR, _HOOK_ATTR, _POST_HOOK_ATTR, _PREPARED_ATTR, _STAGES_ATTR,
                 "supports_gradient_checkpointing"):
        if attr in (_HOOK_ATTR, _POST_HOOK_ATTR) and attr in model.__dict__:
            model.__dict__[attr].remove()
        if attr in model.__dict__:
            object.__delattr__(model, attr)
    return model


def is_swapped(model: nn.Module) -> bool:
    return bool(getattr(model, _SWAPPED_ATTR, None))


# ----------------------------------------------------------------------------- first forward
_HOOK_ATTR = "_cvt_cutlass_hook"  # the root model's forward pre-hook handle
_POST_HOOK_ATTR = "_cvt_cutlass_post_hook"  # and its forward hook's
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
    _set_hidden_states(model, _wants_hidden_states(model, args, kwargs))
    fused = [s for s in model.__dict__.get(_STAGES_ATTR, ()) if s.fallback_reason(x) is None]
    if not fused:
        return  # HF's forward runs for every stage: nothing to build or derive
    training = any(s.differentiable(x) for s in fused)
    cdt = compute_dtype(x)
    stream = "fp32" if any(s.stream_dtype(x, cdt) != cdt for s in fused) else "compute"
    key = _prepared_key((x.shape[2], x.shape[3]), cdt, x.device, training, stream)
    prepared = model.__dict__.get(_PREPARED_ATTR)
    if prepared is not None and key not in prepared:
        _prepare(model, (x.shape[2], x.shape[3]), cdt, x.device, training, stream)
        prepared.add(key)
    infer = [s for s in fused if not s.differentiable(x)]  # the training path uses the parameters themselves
    if infer:
        _check_weights(infer, cdt, x.device)


def _set_hidden_states(model: nn.Module, hidden: bool) -> None:
    for s in model.__dict__.get(_STAGES_ATTR, ()):
        s.__dict__["hidden_states"] = hidden  # (a plain attribute: not through nn.Module.__setattr__'s checks)


@torch._dynamo.disable
def _after_forward(model: nn.Module, args: tuple, output) -> None:
    """After every forward of a swapped root model (an exception's too): the stages hand on their
    outputs in the stream's dtype again until the next root forward says otherwise (a stage or the
    encoder called on its own returns what HF's would)."""
    _set_hidden_states(model, True)


_HIDDEN_ARG: dict[type, int | None] = {}  # a model class's forward: output_hidden_states's position


def _wants_hidden_states(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether this forward of the root model returns hidden states (its ``output_hidden_states``
    argument, else its config's): the stages then hand on their outputs in the residual stream's
    dtype, as HF's CvT returns them (:meth:`FusedCvtStage.output_dtype`)."""
    want = kwargs.get("output_hidden_states")
    if want is None:
        cls = type(model)
        if cls not in _HIDDEN_ARG:  # (the class's forward: an instance's may be wrapped)
            names = list(inspect.signature(cls.forward).parameters)[1:]  # (self)
            _HIDDEN_ARG[cls] = names.index("output_hidden_states") if "output_hidden_states" in names else None
        i = _HIDDEN_ARG[cls]
        if i is not None and i < len(args):
            want = args[i]
    if want is None:
        want = getattr(getattr(model, "config", None), "output_hidden_states", False)
    return bool(want)


def _prepared_key(hw: tuple[int, int], dtype: torch.dtype, device: torch.device, training: bool = False,
                  stream: str = "fp32") -> tuple:
    """What a set of built kernels serves: image size, dtype, device, the kernel path (sm89 / sm90 /
    auto: set_kernel_path switches to other kernels), whether the training kernels are in it and
    the residual stream's ("fp32": its variants too)."""
    from .runtime import get_kernel_path

    return (hw[0], hw[1], dtype, device, get_kernel_path(), training, stream)


def _check_weights(stages: list[FusedCvtStage], dtype: torch.dtype, device: torch.device) -> None:
    """Derive the folded weights (in ``dtype`` on ``device``) of the stages that will run fused, here,
    outside any graph (a compiled forward reads them): one C++ call checks every stage's tensors."""
    key = (dtype, device)
    if any(s._weights is None or s._weights.key != key or s._watch is None or s._watch[1] != generation()
           for s in stages) or torch.ops.cvt_cutlass_C.watch_changed_any([s._watch[0] for s in stages]):
        for s in stages:
            s.weights(*key)


def _prepare(model: nn.Module, image_size: tuple[int, int], dtype: torch.dtype, device: torch.device,
             training: bool = False, stream: str = "fp32") -> int:
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
    specs = model_kernels(model, image_size, DTYPES[dtype], arch, training, gpu=dev.name, residual_stream=stream)
    jobs = runtime.plan(specs, dev.cc)
    missing = sum(not j.is_built for j in jobs)
    runtime.prebuild(specs, dev.cc, planned=jobs)
    return missing


def _prebuild_now(model: nn.Module, image_size, stream: str = "fp32") -> None:
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cuda" or p.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError("cvt_cutlass.swap(prebuild=True) builds the kernels for the model's device and dtype: "
                         "move it to a CUDA device in float16/bfloat16 first (model.cuda().half()), or leave "
                         f"prebuild=False and the first forward builds them (parameters are on "
                         f"{None if p is None else p.device} in {None if p is None else p.dtype})")
    size = image_size or 224
    hw = size if isinstance(size, tuple) else (size, size)
    _prepare(model, hw, p.dtype, p.device, model.training, stream)
    # an fp32 stream's set holds the 16-bit one's: it serves forwards with and without autocast
    for st in {"compute", stream}:
        model.__dict__[_PREPARED_ATTR].add(_prepared_key(hw, p.dtype, p.device, model.training, st))


class _CallableModule(types.ModuleType):
    """``import cvt_cutlass.swap`` makes ``cvt_cutlass.swap`` this module (the import system sets
    the package attribute): calling it still swaps, so ``cvt_cutlass.swap(model)`` works whatever
    was imported first."""

    def __call__(self, model: nn.Module, **kw) -> nn.Module:
        return swap(model, **kw)


sys.modules[__name__].__class__ = _CallableModule
