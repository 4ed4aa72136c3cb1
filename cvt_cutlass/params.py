"""The weights of one forward of a fused stage (:mod:`cvt_cutlass.stage`), in the compute dtype.

* :class:`FoldedParams` (inference): cast to the run dtype once, BatchNorm folded into the
  depthwise weights, cached by the fused stage until a parameter or buffer changes;
* :class:`CastParams` (training, or autograd recording): the parameters themselves, cast in this
  forward with one concatenated cast per source dtype (:class:`Caster`), BatchNorm on batch
  statistics (folded differentiably in eval).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from . import layer as layer_op
from .layer import LayerArgs
from .stage import ops, projections_of

# Bumped whenever any module registers a parameter, buffer or submodule (module.weight = ...):
# what the fused stages derived from their module trees (folded inference weights, the training
# forward's layer recipes) is then found again. The global hooks that bump it are registered with
# the first use (importing this module changes nothing process-wide).
_GENERATION = [0]
_GENERATION_HOOKS: list = []


def _bump_generation(*_args):
    _GENERATION[0] += 1


def generation() -> int:
    """How many module registrations (parameters, buffers, submodules) there were since
    :func:`watch_registrations` first ran."""
    return _GENERATION[0]


_WEIGHT_BUFFERS = [True]


def set_weight_buffers(enabled: bool) -> None:
    """Whether training forwards cast each layer's 16 weights into one buffer the layer op takes
    whole (the default) or each into a view of its own (to compare the two); the stages' recipes
    are found again."""
    _WEIGHT_BUFFERS[0] = bool(enabled)
    _bump_generation()


def watch_registrations() -> None:
    """Count module registrations from now on (once per process)."""
    if not _GENERATION_HOOKS:
        _GENERATION_HOOKS.extend(register(_bump_generation) for register in (
            nn.modules.module.register_module_parameter_registration_hook,
            nn.modules.module.register_module_buffer_registration_hook,
            nn.modules.module.register_module_module_registration_hook))


class FoldedParams:
    """Inference weights of a stage for ``dtype`` on ``device``: detached parameters cast once,
    each depthwise projection's BatchNorm folded into fp32 (3, 3, C) weights and a (C,) bias."""

    def __init__(self, stage: nn.Module, dtype: torch.dtype, device: torch.device):
        from .operators.conv2d import stem_channels
        from .ops.conv2d import conv_filter_krsc

        self.dtype, self.key = dtype, (dtype, device)
        conv = stage.embedding.convolution_embeddings.projection
        self._embed = (conv_filter_krsc(conv.weight.detach().to(dtype), stem_channels(conv.weight.shape[1])),
                       _cast(conv.bias, dtype) if conv.bias is not None else torch.zeros(
                           conv.weight.shape[0], dtype=dtype, device=device))
        cls = getattr(stage, "cls_token", None)
        self._cls = None if cls is None else _cast(cls, dtype).reshape(-1, cls.shape[-1])
        self._ln = {id(m): _ln_params(m, dtype) for m in stage.modules() if isinstance(m, nn.LayerNorm)}
        self._lin = {id(m): (_cast(m.weight, dtype), _cast(m.bias, dtype)) for m in stage.modules()
                     if isinstance(m, nn.Linear)}
        self._dw = {id(p): tuple(t.to(device) for t in _fold(p)) for p in projections_of(stage)}
        self._layers = {id(lay): self._layer_args(lay) for lay in stage.layers}
        theirs = {t.untyped_storage().data_ptr() for t in (*stage.parameters(), *stage.buffers())}
        self._aliases = [t.untyped_storage().data_ptr() in theirs for t in self._tensors()]  # a parameter's memory

    def _tensors(self) -> list[Tensor]:
        """Every tensor the weights hold, in a fixed order (the layer arguments hold the same ones)."""
        out = [*self._embed, *([] if self._cls is None else [self._cls])]
        for group in (self._ln, self._lin, self._dw):
            out += [t for ts in group.values() for t in ts if isinstance(t, Tensor)]
        return out

    def refresh(self, new: FoldedParams) -> bool:
        """Copy ``new`` (derived from the same stage since) into these tensors, in place, so that
        whatever captured their addresses reads the new values; False (nothing copied) when a
        tensor's shape, dtype or device differs, a module was replaced, a layer's path changed or
        a tensor that is a parameter's own memory (no cast needed) now is another's. LayerNorm eps
        values are not refreshed (nor watched)."""
        mine, theirs = self._tensors(), new._tensors()
        same = self.key == new.key and len(mine) == len(theirs) and all(
            (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device) for a, b in zip(mine, theirs, strict=True))
        same = same and all(list(getattr(self, f)) == list(getattr(new, f)) for f in ("_ln", "_lin", "_dw", "_layers"))
        if not same or [isinstance(a, str) for a in self._layers.values()] != \
                [isinstance(a, str) for a in new._layers.values()]:
            return False
        if any(alias and a.data_ptr() != b.data_ptr() for alias, a, b in zip(self._aliases, mine, theirs, strict=True)):
            return False  # a parameter now elsewhere: its old memory is not these weights' to write
        for a, b in zip(mine, theirs, strict=True):
            if a.data_ptr() != b.data_ptr():
                a.copy_(b)
        return True

    def _layer_args(self, lay) -> LayerArgs | str:
        why = layer_op.why_not(lay)
        if why is not None:
            return why
        ln1, ln2 = self.ln(lay.layernorm_before), self.ln(lay.layernorm_after)
        weights = [*ln1[:2], *layer_op.linear_weights(lay, self.linear), *ln2[:2],
                   *self.linear(lay.intermediate.dense), *self.linear(lay.output.dense)]
        for proj in layer_op.projections(lay):
            weights += self._dw[id(proj)]
        return LayerArgs(weights, [], [ln1[2], ln2[2], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], False)

    def layer(self, lay) -> LayerArgs | str:
        return self._layers[id(lay)] if layer_op.layer_op_enabled() else layer_op.DISABLED

    def embed(self, conv, channels):
        return self._embed

    def cls(self, stage, dtype=None):
        """The cls rows in ``dtype`` (default: the weights'; an fp32 stream's from the parameter)."""
        if dtype is None or dtype == self.dtype or self._cls is None:
            return self._cls
        return _cast(stage.cls_token, dtype).reshape(-1, stage.cls_token.shape[-1])

    def ln(self, ln):
        return self._ln[id(ln)]

    def linear(self, lin):
        return self._lin[id(lin)]

    def project(self, projs, h, hh, ww, strides, cls_rows):
        return [ops.dwconv_tokens(h, *self._dw[id(p.convolution_projection)], hh, ww, s, cls_rows)
                for p, s in zip(projs, strides, strict=True)]

    def mlp(self, layer, h, residual):
        f = ops.linear(h, *self.linear(layer.intermediate.dense), None, "gelu")
        return ops.linear(f, *self.linear(layer.output.dense), residual)  # fc2 + residual


def _ln_params(ln: nn.LayerNorm, dtype) -> tuple[Tensor, Tensor, float]:
    return ln.weight.detach().to(dtype).contiguous(), ln.bias.detach().to(dtype).contiguous(), float(ln.eps)


def _cast(t: Tensor | None, dtype) -> Tensor | None:
    return None if t is None else t.detach().to(dtype).contiguous()


def _fold(cp: nn.Module) -> tuple[Tensor, Tensor]:
    """A conv projection's depthwise weight with its BatchNorm's running statistics folded in."""
    from .ops.dwconv import fold_batchnorm

    conv, bn = cp.convolution, cp.normalization
    if bn.running_mean is None or bn.running_var is None:  # (eager forwards run HF's module: swap:batchnorm)
        raise ValueError("cvt_cutlass: a BatchNorm without running statistics has no folded inference weights; "
                         "under torch.compile run such a model in training mode or with autograd recording")
    detached = [None if t is None else t.detach() for t in (bn.weight, bn.bias, conv.bias)]  # affine=False: None
    return fold_batchnorm(conv.weight.detach(), bn.running_mean, bn.running_var, detached[0], detached[1], bn.eps,
                          detached[2])


class CastParams:
    """Training weights of a stage: the parameters themselves in ``dtype`` (differentiable when
    grad mode is on), the depthwise conv weights in the kernels' fp32 (3, 3, C) layout, and the
    stage's BatchNorm counters advanced once for this forward. What to read comes from the
    stage's :class:`StageRecipe`."""

    def __init__(self, stage: nn.Module, dtype: torch.dtype):
        from .ops.dwconv import count_batches

        self.dtype = dtype
        self.recipe = recipe = StageRecipe.of(stage)
        self.params = recipe.cast_params()
        self._index = {id(lay): i for i, lay in enumerate(stage.layers)}  # per forward: ids do not survive a deepcopy
        self._why = [self._why_not(i) for i in range(len(recipe.layers))]
        if torch.is_grad_enabled():  # one buffer for the weights of each layer the layer op serves
            runs = [(r.run, 16) for r, why in zip(recipe.layers, self._why, strict=True)
                    if why is None and r.run is not None]
            self.cv = Caster(dtype, self.params, recipe.depthwise(), on_miss=lambda: StageRecipe.forget(stage),
                             runs=runs)
        else:
            self.cv = Caster(dtype, ())
        self.counted = count_batches(recipe.bns)

    def _why_not(self, i: int) -> str | None:
        """Why the layer op does not serve layer i in this forward, or None."""
        if not layer_op.layer_op_enabled():
            return layer_op.DISABLED
        bns = self.recipe.bns[3 * i:3 * i + 3]
        why = self.recipe.layers[i].why or layer_op.batchnorm_why_not(bns)
        if why is None and not all(bn.training for bn in bns):
            why = "BatchNorm in eval mode while autograd records (folded by the per-op path)"
        tracked = [bn.running_mean is not None for bn in bns]
        if why is None and any(tracked) and not all(tracked):
            why = "BatchNorms with and without running statistics in one layer"
        return why

    def embed(self, conv, channels):
        bias = self.cv(conv.bias)
        if bias is None:
            bias = torch.zeros(conv.weight.shape[0], dtype=self.dtype, device=conv.weight.device)
        return ops.conv_filter_krsc(self.cv(conv.weight), channels), bias

    def cls(self, stage, dtype=None):
        """The cls rows in ``dtype`` (default: the weights'; an fp32 stream's from the parameter
        itself, differentiably)."""
        cls = getattr(stage, "cls_token", None)
        if cls is None:
            return None
        if dtype is not None and dtype != self.dtype:
            return cls.to(dtype).reshape(-1, cls.shape[-1])
        return self.cv(cls).reshape(-1, cls.shape[-1])

    def ln(self, ln):
        return self.cv(ln.weight), self.cv(ln.bias), float(ln.eps)

    def linear(self, lin):
        return self.cv(lin.weight), self.cv(lin.bias)

    def project(self, projs, h, hh, ww, strides, cls_rows):
        """The projections' conv + BatchNorm; SyncBatchNorms of one group all at once (one
        all-gather and one all-reduce for the three)."""
        from .ops.dwconv import sync_dwconv_bn_modules, sync_group

        cps = [p.convolution_projection for p in projs]
        items = [(self.cv.rsc(cp.convolution.weight), cp.normalization, s, id(cp.normalization) in self.counted)
                 for cp, s in zip(cps, strides, strict=True)]
        group = sync_group(items[0][1])
        if group is not None and all(sync_group(bn) is group for _, bn, _, _ in items):
            return sync_dwconv_bn_modules(h, items, hh, ww, cls_rows, group)
        return [ops.dwconv_bn(h, cp.convolution.weight, bn, hh, ww, s, cls_rows, w, counted)
                for cp, (w, bn, s, counted) in zip(cps, items, strict=True)]

    def mlp(self, layer, h, residual):
        return ops.mlp(h, *self.linear(layer.intermediate.dense), *self.linear(layer.output.dense), residual)

    def layer(self, lay) -> LayerArgs | str:
        """The layer op's arguments: the weights cast for this forward, BatchNorm on batch
        statistics (its counters advanced, its running statistics updated by the op)."""
        from .ops.dwconv import batchnorm_factor

        i = self._index[id(lay)]
        if self._why[i] is not None:
            return self._why[i]
        r = self.recipe.layers[i]
        bns = self.recipe.bns[3 * i:3 * i + 3]
        cv, params = self.cv, self.params
        flat = None if r.run is None else cv.run(r.run)
        weights = [flat] if flat is not None else [cv(params[j]) for j in r.weights]
        for conv, bn in zip(self.recipe.convs[3 * i:3 * i + 3], bns, strict=True):
            weights += [cv.rsc(conv.weight), _wide(bn.weight), _wide(bn.bias)]
        tracked = bns[0].running_mean is not None  # all or none (_why_not)
        running = [t for bn in bns for t in (bn.running_mean, bn.running_var)] if tracked else []
        factors = [batchnorm_factor(bn, id(bn) in self.counted) for bn in bns]
        return LayerArgs(weights, running, [*r.eps, *(bn.eps for bn in bns), *factors], True)


def _eps(lay: nn.Module) -> tuple[float, float]:
    return float(lay.layernorm_before.eps), float(lay.layernorm_after.eps)


def _one_buffer(ps: list[Tensor]) -> bool:
    """Whether a layer's 16 weights have the shapes (and one dtype) the layer op reads from one
    buffer: LayerNorms (C,), q / k / v / out (C, C) + (C,), fc1 (H, C) + (H,), fc2 (C, H) + (C,)."""
    c, h = ps[0].shape[0], ps[12].shape[0]
    want = [(c,), (c,), *[(c, c), (c,)] * 4, (c,), (c,), (h, c), (h,), (c, h), (c,)]
    return all(tuple(p.shape) == w and p.dtype == ps[0].dtype for p, w in zip(ps, want, strict=True))


def _wide(t: Tensor) -> Tensor:
    """A BatchNorm affine parameter in float32 for the kernels (differentiably; fp32 / fp64 as it is)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


class _LayerRecipe(NamedTuple):
    weights: tuple[int, ...]  # the layer op's 16 weights before the projections', as indices into the cast slots
    eps: tuple[float, float]  # its LayerNorms' eps
    why: str | None  # why the layer op does not serve it, as far as the module tree says
    run: int | None = None  # the first of its 16 consecutive cast slots, cast as one buffer (or None)


class StageRecipe:
    """What a stage's training forward reads from its module tree, found once and kept on the stage
    until a module registers a parameter, buffer or submodule anywhere (:func:`generation`; a
    deepcopy of the stage maps the modules in it to the copy's):

    * ``cast_slots``: (module, name) of the parameters the ops take in the compute dtype (all but the
      depthwise projections', whose conv weights and BatchNorm affines go to the kernels in fp32),
      read through each forward (a parameter reassigned without a registration is seen): first
      the 16 of each layer the layer op can take as one buffer, in its order (cast into one buffer
      each: :class:`Caster`), then the others in ``stage.parameters()`` order;
    * ``convs`` / ``bns``: the depthwise projections' conv and BatchNorm modules, q / k / v per layer
      (``untracked``: one of those BatchNorms has no running statistics);
    * ``layers``: per layer (in ``stage.layers`` order) where its weights sit among the cast slots,
      its LayerNorms' eps and what in its module tree keeps the layer op from serving it.
    """

    def __init__(self, stage: nn.Module, kept: bool = True):
        if kept:  # a recipe kept on the stage is checked against the registrations since
            watch_registrations()
        self.generation = generation() if kept else -1
        projs = projections_of(stage)
        self.convs = [p.convolution for p in projs]
        self.bns = [p.normalization for p in projs]
        # a BatchNorm without running statistics normalizes with the batch's in eval mode too
        self.untracked = any(bn.running_mean is None for bn in self.bns)
        skip = {id(p) for proj in projs for p in proj.parameters()}
        slots = {}  # each parameter once, in stage.parameters()' order
        for path, p in stage.named_parameters():
            if id(p) not in skip:
                owner, _, name = path.rpartition(".")
                slots[id(p)] = (stage.get_submodule(owner), name)
        found = [self._layer_params(lay) for lay in stage.layers]
        order, starts = [], []
        for ps, _ in found:  # the runs first: a layer's 16 weights, where they can be one buffer
            ids = [id(p) for p in ps or ()]
            fits = ps is not None and _WEIGHT_BUFFERS[0] and _one_buffer(ps) and all(i in slots for i in ids)
            starts.append(len(order) if fits and not set(ids) & set(order) and len(set(ids)) == 16 else None)
            if starts[-1] is not None:
                order += ids
        taken = set(order)
        order += [i for i in slots if i not in taken]
        self.cast_slots = [slots[i] for i in order]
        index = {i: k for k, i in enumerate(order)}
        self.layers = [_LayerRecipe((), (0.0, 0.0), why) if ps is None else
                       _LayerRecipe(tuple(index[id(p)] for p in ps), _eps(lay), None, k)
                       for lay, (ps, why), k in zip(stage.layers, found, starts, strict=True)]

    @staticmethod
    def _layer_params(lay: nn.Module) -> tuple[list[Tensor] | None, str | None]:
        """The layer op's 16 weights before the projections', or why it does not serve the layer."""
        why = layer_op.static_why_not(lay)
        if why is not None:
            return None, why
        ln1, ln2 = lay.layernorm_before, lay.layernorm_after
        params = [ln1.weight, ln1.bias, *layer_op.linear_weights(lay, lambda m: (m.weight, m.bias)), ln2.weight,
                  ln2.bias, lay.intermediate.dense.weight, lay.intermediate.dense.bias, lay.output.dense.weight,
                  lay.output.dense.bias]
        if any(p is None for p in params):
            return None, "a LayerNorm or Linear without weight or bias"
        return params, None

    @classmethod
    def of(cls, stage: nn.Module) -> StageRecipe:
        """The stage's recipe, found again where a registration came since (or none was found)."""
        if torch.compiler.is_compiling():  # traced: found in the trace, nothing kept or watched
            return cls(stage, kept=False)
        r = getattr(stage, "_cvt_recipe", None)
        if r is None or r.generation != generation():
            r = stage._cvt_recipe = cls(stage)
        return r

    @staticmethod
    def forget(stage: nn.Module) -> None:
        """A parameter the forward used was not among the slots (a submodule replaced without a
        registration): find them again next forward (this one casts that parameter on its own)."""
        stage._cvt_recipe = None

    def cast_params(self) -> list[Tensor]:
        return [getattr(m, n) for m, n in self.cast_slots]

    def depthwise(self) -> list[Tensor]:
        return [conv.weight for conv in self.convs]


class Caster:
    """The parameters of one forward in the compute dtype: those of ``params`` not already in it are
    cast together (``torch.ops.cvt_cutlass.cast_params``, per source dtype: two kernels each way);
    ``caster(t)`` returns t's cast (any other tensor is cast on its own, and ``on_miss`` is called
    once), ``caster.dtype`` the compute dtype. ``runs``: (first index, length) of consecutive
    params cast into one 1-D buffer (``caster.run(first)``; a layer's 16 weights for the layer op),
    where they share a source dtype; ``caster(t)`` of a param in one is a view of it.
    ``depthwise``: conv weights (C, 1, 3, 3) put in the depthwise kernels' layout together
    (``caster.rsc(w)``)."""

    def __init__(self, dtype: torch.dtype, params, depthwise=(), on_miss=None, runs=()):
        self.dtype = dtype
        self._on_miss = on_miss
        self._cast: dict[int, Tensor] = {}
        self._runs: dict[int, Tensor] = {}
        self._grouped: list[tuple[list[Tensor], Tensor]] = []
        self._members: dict[int, tuple[Tensor, int]] | None = None
        groups: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(params):
            if p.dtype != dtype:
                groups.setdefault(p.dtype, []).append(i)
        run_at = dict(runs)
        for idx in groups.values():
            self._cast_group(params, idx, run_at)
        self._rsc: dict[int, Tensor] = {}
        same: dict[tuple, list[Tensor]] = {}
        for w in depthwise:
            if _groupable(w):
                same.setdefault((w.shape[0], w.dtype, w.device), []).append(w)
        for ws in same.values():
            for w, r in zip(ws, ops.depthwise_rsc_params(ws), strict=True):
                self._rsc[id(w)] = r

    def _cast_group(self, params, idx: list[int], run_at: dict[int, int]) -> None:
        """params[idx] (one source dtype) cast together, a run whole in idx as one buffer."""
        ps, sizes, starts, i = [], [], [], 0
        while i < len(idx):
            k = idx[i]
            n = run_at.get(k, 1)
            if n == 1 or idx[i + n - 1:i + n] != [k + n - 1]:  # a run is consecutive in params and in idx
                n = 1
            ps += params[k:k + n]
            sizes.append(n)
            starts.append(k)
            i += n
        j = 0
        for n, k, out in zip(sizes, starts, ops.cast_params(ps, self.dtype, sizes), strict=True):
            if n == 1:
                self._cast[id(ps[j])] = out
            else:
                self._runs[k] = out
                self._grouped.append((ps[j:j + n], out))
            j += n

    def run(self, first: int) -> Tensor | None:
        """The one buffer of the run starting at params[first], or None where it was not cast as one."""
        return self._runs.get(first)

    def __call__(self, t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        c = self._cast.get(id(t))
        if c is not None:
            return c
        if self._grouped:
            c = self._member(t)
            if c is not None:
                return c
        if t.dtype != self.dtype:
            self._missed()
        return t.to(self.dtype)

    def _member(self, t: Tensor) -> Tensor | None:
        """A view of the run buffer holding t's cast (a layer op weight that something else reads
        too, e.g. one tied to another module), or None."""
        if self._members is None:
            self._members = {}
            for ps, flat in self._grouped:
                offset = 0
                for p in ps:
                    self._members[id(p)] = (flat, offset)
                    offset += p.numel()
        m = self._members.get(id(t))
        if m is None:
            return None
        flat, offset = m
        c = self._cast[id(t)] = flat[offset:offset + t.numel()].view(t.shape)
        return c

    def _missed(self) -> None:
        if self._on_miss is not None:
            self._on_miss()
            self._on_miss = None

    def rsc(self, conv_weight: Tensor) -> Tensor:
        """A depthwise conv weight in the kernels' fp32 (3, 3, C) layout."""
        from .ops.dwconv import depthwise_rsc

        r = self._rsc.get(id(conv_weight))
        if r is not None:
            return r
        if _groupable(conv_weight):
            self._missed()  # a weight the grouped layout would have taken
        return depthwise_rsc(conv_weight)


def _groupable(w: Tensor) -> bool:
    """A depthwise weight the grouped layout op takes: contiguous (C, 1, 3, 3)."""
    return w.dim() == 4 and tuple(w.shape[1:]) == (1, 3, 3) and w.is_contiguous()
