"""``torch.ops.cvt_cutlass.stage_infer`` and ``stage_train``: a fused stage's forward as one op, for
torch.compile.

Traced op by op, a compiled swapped model launches every kernel of a stage from Inductor's
wrapper (~55 per CvT-13 stage 3), while the same stage called eagerly replays its CUDA graph
(:mod:`cvt_cutlass.graphs`). Under torch.compile a stage that runs its inference path (no autograd
recording) is this one op instead: opaque to Dynamo and Inductor (one graph, no break), it runs
the stage as an eager call would (replaying its graph, or capturing it, or eagerly where it
cannot replay, counted in ``cvt_cutlass.stats()['stage_graphs']``; inside a reduce-overhead
capture, its kernels go into that graph) and returns the stage's outputs as one tensor.

``stage_infer(Tensor x, int stage, ScalarType dtype, ScalarType stream, ScalarType out) -> Tensor``:
``stage`` is the fused stage's handle (``FusedCvtStage._handle``), ``dtype`` the compute dtype the
trace saw (autocast's, say: at run time the compiled graph runs its ops outside autocast),
``stream`` the residual stream's (fp32 under autocast, swap's default; else ``dtype``) and ``out``
the outputs' (``FusedCvtStage.output_dtype``: the stream's, or ``dtype`` where the next stage's
embedding reads them in 16 bits); the result is the stage's token rows
(B, rows + H' * W', C), its cls row first where it has one (rows = 1, else 0), which
:func:`split_rows` views as the tokens (B, C, H', W') and the cls rows. A replayed call returns its
graph's output buffer itself, as an eager call does: the next stage's replay reads it where it is
(no copy), and the stage replays again only once nothing refers to the buffer (a result kept
across calls makes the next call run eagerly, counted). The training op returns fresh copies.

``stage_train(Tensor x, Tensor anchor, Tensor call, int stage, ScalarType dtype, ScalarType stream,
ScalarType out, bool x_grad, bool record) -> (tokens, cls, token)`` is the training forward the same way: at run time it runs the
stage as an eager training call would (its forward graph replayed), recording autograd where
``record`` (grad mode where the model was traced), keeps that call's autograd outputs under
``token`` (a CPU int64 scalar) and returns copies. Its backward, ``stage_train_backward(Tensor
token, Tensor x, Tensor anchor, Tensor? g_tokens, Tensor? g_cls, bool x_grad) -> (Tensor,
Tensor)``, runs the kept call's backward (its graph replayed) and forgets the token: the
parameters' gradients reach their ``.grad`` as in an eager step (written directly, or through their
hooks), and the op returns x's gradient (empty where ``x_grad`` is False) and the anchor's.
``anchor`` is the stage's empty leaf (``FusedCvtStage._anchor``, requiring grad): it makes the
compiled graph differentiate the op (the stage's parameters are not its inputs), and its (empty)
gradient keeps the backward op in the compiled backward. ``call`` is an empty tensor of the call
site's own (see below). A replayed call's backward runs without the autograd engine
(:func:`cvt_cutlass.graphs.replayed_backward`), so its parameters' gradients follow what the
compiled backward was asked for as eagerly; an eager call's (a signature's first calls, or
parameters with hooks) runs a nested ``torch.autograd.backward``, which fills them whatever was
asked. A kept call is dropped with its token (a forward whose backward never comes); under
saved-tensor hooks (which may save a copy of the token), after MAX_UNWATCHED later calls. A second
backward through one forward (``retain_graph``) raises. Not served, by what it cannot see:
``torch.autograd.grad`` with respect to a stage's parameters (they are no inputs of the compiled
graph: turn the stage graphs off, and the stages trace their ops), and DDP with
``find_unused_parameters=True`` (its walk of the forward's graph does not reach them). Stages that
trace their ops instead: DataParallel replicas, FSDP2, activation checkpointing, stage graphs off
(``cvt_cutlass.swap.traced_in_training``).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections import OrderedDict

import torch
from torch import Tensor

from ..handles import stage_of
from ..models import output_geometry, split_rows  # noqa: F401  (split_rows: the layout named here)
from ..switch import ThreadValue

# The stage ops' run-time context: the residual stream's and the outputs' dtypes as the trace saw
# them (a compiled graph runs its ops outside autocast, where the stream would otherwise be 16-bit);
# None outside them.
_traced = ThreadValue()


def traced_stream(dtype: torch.dtype, out: torch.dtype):
    """The block in which a stage op runs its stage: the stream and output dtypes the trace saw."""
    return _traced.using((dtype, out))


def traced_stream_dtype() -> torch.dtype | None:
    """The stream dtype set by :func:`traced_stream` on this thread, or None outside a stage op."""
    got = _traced.get()
    return None if got is None else got[0]


def traced_output_dtype() -> torch.dtype | None:
    """The outputs' dtype set by :func:`traced_stream` on this thread, or None outside a stage op."""
    got = _traced.get()
    return None if got is None else got[1]


def _stage(handle: int):
    stage = stage_of(handle)
    if stage is None:
        raise RuntimeError(f"cvt_cutlass: stage handle {handle} names no live fused stage (a graph compiled "
                           "for a model since freed?)")
    return stage


def _outputs(stage, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Empty outputs of the stage on x: tokens (B, C, H', W') channels-last, cls rows (B, 0 or 1, C)."""
    b, h, w, c, rows = output_geometry(stage, x)
    tokens = x.new_empty((b, h, w, c), dtype=dtype).permute(0, 3, 1, 2)
    return tokens, x.new_empty((b, rows, c), dtype=dtype)


def token_rows(tokens: Tensor, cls: Tensor | None) -> Tensor | None:
    """The rows (B, rows + H * W, C) that a stage's outputs view, as :func:`split_rows` makes them
    from one dense buffer (tokens (B, C, H, W), cls (B, rows, C) or None), or None where they are
    not laid out so."""
    b, c, h, w = tokens.shape
    rows = 0 if cls is None else cls.shape[1]
    n, start = rows + h * w, tokens.storage_offset() - rows * c
    if start < 0 or not _strided(tokens, (n * c, 1, w * c, c)):
        return None
    if cls is not None and (cls.untyped_storage().data_ptr() != tokens.untyped_storage().data_ptr()
                            or cls.storage_offset() != start or not _strided(cls, (n * c, c, 1))):
        return None
    return tokens.as_strided((b, n, c), (n * c, c, 1), start)


def _strided(t: Tensor, strides: tuple[int, ...]) -> bool:
    """Whether t has these strides in its dimensions of size > 1 (a size-1 dimension's stride is
    any: batch 1, one cls row)."""
    return all(n == 1 or s == want for n, s, want in zip(t.shape, t.stride(), strides, strict=True))


# The stage ops: schemas and Python kernels registered directly (torch.library.custom_op's wrapper
# took 48.7 us per call of an empty op against 16.3 us this way on a 2-core CI machine, 2026-11-27)
_lib = torch.library.Library("cvt_cutlass", "FRAGMENT")
_lib.define("stage_infer(Tensor x, int stage, ScalarType dtype, ScalarType stream, ScalarType out) -> Tensor",
            tags=(torch.Tag.pt2_compliant_tag,))


def stage_infer(x: Tensor, stage: int, dtype: torch.dtype, stream: torch.dtype, out: torch.dtype) -> Tensor:
    """The stage's token rows on x (B, rows + H' * W', C), cls first (:func:`split_rows`): where the
    stage replayed its graph, that graph's output buffer, which a later replay of the stage
    overwrites only once nothing refers to it any more (:mod:`cvt_cutlass.graphs` counts the
    buffer's users; the next stage's replay copies a new input into it on the same terms), as for
    an eager call's outputs; work on another stream that reads it must be ordered before the next
    call (or read a clone). Not differentiable: a compiled stage whose autograd records calls
    stage_train."""
    s = _stage(stage)
    with traced_stream(stream, out):
        tokens, cls = s._graphs(s, x, dtype, s._run)
    t = token_rows(tokens, cls)
    if t is None or t.dtype != out:  # outputs not laid out as one buffer (or in another dtype): copied
        b, h, w, c, rows = output_geometry(s, x)
        t = x.new_empty((b, rows + h * w, c), dtype=out)
        t[:, rows:].view(b, h, w, c).copy_(tokens.permute(0, 2, 3, 1))
        if cls is not None:
            t[:, :rows].copy_(cls)
    return t


_lib.impl("stage_infer", stage_infer, "CompositeExplicitAutograd")


@torch.library.register_fake("cvt_cutlass::stage_infer", lib=_lib)
def _fake(x: Tensor, stage: int, dtype: torch.dtype, stream: torch.dtype, out: torch.dtype) -> Tensor:
    b, h, w, c, rows = output_geometry(_stage(stage), x)
    return x.new_empty((b, rows + h * w, c), dtype=out)


# ----------------------------------------------------------------------------- training
_pending: dict[int, tuple] = {}  # token -> a kept call (_keep) until its backward
_tokens = itertools.count(1)
MAX_UNWATCHED = 64  # kept calls whose token has no finalizer (saved-tensor hooks copy tokens)
_unwatched: OrderedDict[int, None] = OrderedDict()


@contextlib.contextmanager
def _recording():
    """Autograd recording inside an op's kernel: grad mode on, and the autograd and view-tracking
    dispatch keys (an op's kernel runs below them) no longer excluded."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set().remove(C.DispatchKey.AutogradFunctionality) \
        .remove(C.DispatchKey.ADInplaceOrView)  # (below a torch.autograd.Function's forward, as a compiled graph's)
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def _saved_tensor_hooks_on() -> bool:
    """Whether default saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks, save_on_cpu)
    are on: they may save a copy of the token and let the token itself go."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return False
    try:
        return top(True) is not None
    except TypeError:  # a torch whose function takes no argument
        return top() is not None


def _keep(outs: tuple) -> Tensor:
    """A new token for a kept call (its tokens, cls, x's leaf, its graphs' replayed_backward):
    dropped with the token (a forward whose backward never comes), or, under saved-tensor hooks,
    after MAX_UNWATCHED more."""
    key = next(_tokens)
    token = torch.tensor(key, dtype=torch.int64)
    _pending[key] = outs
    if not _saved_tensor_hooks_on():
        weakref.finalize(token, _pending.pop, key, None)
        return token
    _unwatched[key] = None
    while len(_unwatched) > MAX_UNWATCHED:
        _pending.pop(_unwatched.popitem(last=False)[0], None)
    return token


# Two calls on one input are two calls (each updates the BatchNorm statistics, draws its drop-path
# masks and keeps its outputs): each call site passes its own empty tensor as `call` (made by
# aten.empty, which the compiler's common-subexpression pass never merges), so that the pass never
# merges two calls either.
_lib.define("stage_train(Tensor x, Tensor anchor, Tensor call, int stage, ScalarType dtype, ScalarType stream, "
            "ScalarType out, bool x_grad, bool record) -> (Tensor, Tensor, Tensor)",
            tags=(torch.Tag.nondeterministic_seeded,))


def stage_train(x: Tensor, anchor: Tensor, call: Tensor, stage: int, dtype: torch.dtype, stream: torch.dtype,
                out: torch.dtype, x_grad: bool, record: bool) -> tuple[Tensor, Tensor, Tensor]:
    s = _stage(stage)
    leaf = x.detach().requires_grad_(x_grad and record)
    with _recording() if record else torch.no_grad(), traced_stream(stream, out):
        tokens, cls = s._graphs(s, leaf, dtype, s._run)
    out_tokens, out_cls = _outputs(s, x, out)
    out_tokens.copy_(tokens.detach())
    if cls is not None:
        out_cls.copy_(cls.detach())
    if not record:  # grad mode off where the model was traced: nothing to keep
        return out_tokens, out_cls, torch.tensor(0, dtype=torch.int64)
    return out_tokens, out_cls, _keep((tokens, cls, leaf, s._graphs.replayed_backward))


_lib.impl("stage_train", stage_train, "CompositeExplicitAutograd")


@torch.library.register_fake("cvt_cutlass::stage_train", lib=_lib)
def _train_fake(x: Tensor, anchor: Tensor, call: Tensor, stage: int, dtype: torch.dtype, stream: torch.dtype,
                out: torch.dtype, x_grad: bool, record: bool) -> tuple[Tensor, Tensor, Tensor]:
    return (*_outputs(_stage(stage), x, out), torch.empty((), dtype=torch.int64))


_lib.define("stage_train_backward(Tensor token, Tensor x, Tensor anchor, Tensor? g_tokens, Tensor? g_cls, "
            "bool x_grad) -> (Tensor, Tensor)")


def stage_train_backward(token: Tensor, x: Tensor, anchor: Tensor, g_tokens: Tensor | None, g_cls: Tensor | None,
                         x_grad: bool) -> tuple[Tensor, Tensor]:
    key = int(token)
    got = _pending.pop(key, None)
    _unwatched.pop(key, None)
    if got is None:
        raise RuntimeError("cvt_cutlass.stage_train_backward: this stage forward's backward ran already, or its "
                           f"forward is gone (a second backward through one compiled forward, retain_graph, is not "
                           f"supported: run it uncompiled; under saved-tensor hooks a forward's kept call is dropped "
                           f"after {MAX_UNWATCHED} later ones)")
    tokens, cls, leaf, replayed_backward = got
    done, gx = replayed_backward((tokens, cls), (g_tokens, g_cls))
    if not done:  # an eager call's autograd graph, or a replay with hooked parameters: the engine
        pairs = [(o, g) for o, g in ((tokens, g_tokens), (cls, g_cls)) if o is not None and g is not None
                 and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        gx = leaf.grad
    return _grad_like(x, gx, x_grad), torch.zeros_like(anchor)


def _grad_like(x: Tensor, gx: Tensor | None, x_grad: bool) -> Tensor:
    """x's gradient in x's layout (empty where not wanted)."""
    if not x_grad:
        return x.new_empty(0)
    if gx is None:
        return torch.zeros_like(x)
    if gx.dtype == x.dtype and gx.stride() == torch.empty_like(x, device="meta").stride():
        return gx  # the fake kernel's layout: empty_like(x) (x's strides where x is dense)
    return torch.empty_like(x).copy_(gx)


_lib.impl("stage_train_backward", stage_train_backward, "CompositeExplicitAutograd")


@torch.library.register_fake("cvt_cutlass::stage_train_backward", lib=_lib)
def _train_backward_fake(token: Tensor, x: Tensor, anchor: Tensor, g_tokens: Tensor | None, g_cls: Tensor | None,
                         x_grad: bool) -> tuple[Tensor, Tensor]:
    return (torch.empty_like(x) if x_grad else x.new_empty(0)), torch.empty_like(anchor)


def _setup(ctx, inputs, output) -> None:
    x, anchor, _call, _stage_handle, _dtype, _stream, _out, x_grad, _record = inputs
    ctx.x_grad = x_grad
    ctx.save_for_backward(output[2], x, anchor)  # x too: the compiled graph must not reuse its memory
    # while the stage's eager autograd graph (a call that did not replay) may read it in the backward


def _backward(ctx, g_tokens, g_cls, _g_token):
    token, x, anchor = ctx.saved_tensors
    gx, g_anchor = torch.ops.cvt_cutlass.stage_train_backward(token, x, anchor, g_tokens, g_cls, ctx.x_grad)
    # the anchor's (empty) gradient is what the compiled backward keeps the op for
    return (gx if ctx.x_grad else None), g_anchor, None, None, None, None, None, None, None


torch.library.register_autograd("cvt_cutlass::stage_train", _backward, setup_context=_setup, lib=_lib)
