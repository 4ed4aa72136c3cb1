"""CUDA graphs of the fused stages for models run eagerly (a user's own loop, HF Trainer).

A swapped CvT-13 issues ~220 launches in a training forward and ~350 in its backward from Python
and C++; at small batches the host takes longer to issue them than the GPU to run them. A
:class:`StageGraphs` per fused stage captures the stage's forward, and in training its backward,
as two CUDA graphs the second time a call signature comes, and replays them from then on: an eager
step then issues one replay per stage each way. Parameters and buffers are read and written
where they are, so optimizer steps, ``load_state_dict`` and the running statistics carry over;
drop path draws new random numbers on every replay (the CUDA generator's graph-safe offsets;
not the numbers an eager call would draw).

A call replays when all of these hold, and otherwise runs eagerly, counted with its reason in
``cvt_cutlass.stats()['stage_graphs']``:

* stage graphs are on (:func:`set_stage_graphs`, ``CVT_CUTLASS_STAGE_GRAPHS``; default on);
* the input is on CUDA; the current stream is not capturing (a whole captured step holds the
  stage in its own graph: :func:`held_by_caller`; a compiled model's stage ops call the stage
  graphs at run time, :mod:`cvt_cutlass.ops.stage`) nor the stream on which torch.compile's
  mode="reduce-overhead" warms up its graphs (their memory pool must hold the outputs), and the stage is
  neither an ``nn.DataParallel`` replica (its parameters are plain attributes of the copy) nor
  sharded by ``fully_shard`` (FSDP2 gathers its parameters into new memory around each call; a
  backward whose parameters moved since its replayed forward raises);
* inference (no autograd recording), or training with every layer on the layer op: no activation
  checkpointing, no SyncBatchNorm across processes, no BatchNorm with momentum=None (its factor is
  read from the counter on the host);
* the call's signature (input shape, strides, dtype and requires_grad; compute dtype, the
  residual stream's (``swap(residual_stream=)``) and the outputs'; grad and
  inference mode; deterministic algorithms; kernel path; the current stream; the stage's and its
  BatchNorms' and drop paths' modes, momenta, eps and rates, the embedding LayerNorm's eps; in
  training the parameters' and buffers' addresses and requires_grad, in inference the folded
  weights, derived again when a parameter or buffer changes) came before in an eager call that
  finished, with its backward in training; its capture ran no PyTorch fallback and no op-by-op
  layer (those are counted where they run, so their stage stays eager);
* the last replay's backward ran or its autograd graph was dropped, and nothing holds its outputs
  (two forwards before one backward, or outputs kept across calls, run eagerly).

A replay's backward may run more than once (``retain_graph``: its saved activations stay intact
until the next forward replay); a backward through a replay whose graph has been replayed again
since raises instead of returning another call's gradients, and so does one whose parameters
moved since the forward. The gradient of the stage's input is a fresh tensor; the parameters'
are fresh copies on one buffer per dtype (a channels-last parameter's in its own strides).

In inference, a stage whose input is the previous stage's replayed output reads that buffer where
it is (no copy); a call whose input comes from elsewhere copies it there, or runs eagerly while
the previous stage's last results are still referenced.

How the parameters' gradients arrive: where no parameter of the stage has a hook that
AccumulateGrad would run (``register_hook``, ``register_post_accumulate_grad_hook``, hooks on its
gradient accumulator, as DDP, FSDP and DeepSpeed install), the replay's backward writes their
``.grad`` itself, as AccumulateGrad does outside grad mode (set when None, added to in place
otherwise; in the parameter's strides), in one call: through the autograd engine CvT-13's ~340
gradients cost 5-10 us of host time each. The parameters are then not edges of the stage's autograd
node: ``backward(inputs=...)`` and ``torch.autograd.grad`` with respect to a replayed stage's
parameters give them no gradient (``torch.autograd.grad`` says they were unused): run those with
:func:`set_stage_graphs` (False). With respect to other tensors (the input, say) they leave the
parameters' ``.grad`` alone, as eagerly. With a hook on any of the stage's parameters the gradients
go through the engine, one edge per parameter. The kernel-call counters count what a capture ran,
once; a replay counts nothing there. :func:`using_stage_graphs` and :func:`set_stage_graphs` act on
the whole process; :func:`held_by_caller` on the calling thread.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import operator
import sys
import threading
import time
import weakref
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import Tensor

from . import fallback
from .switch import Switch, ThreadValue

MAX_ENTRIES = 4  # captured signatures kept per stage (least recently used dropped): e.g. training
# and evaluation, each at the batch size and at a ragged last batch
MAX_WARM = 64  # eager (and refused) signatures remembered per stage

_GRAPHS = Switch("CVT_CUTLASS_STAGE_GRAPHS")


def set_stage_graphs(enabled: bool | None) -> None:
    """True / False: fused stages replay CUDA graphs where they can / never; None: follow
    CVT_CUTLASS_STAGE_GRAPHS (default 1)."""
    _GRAPHS.set(enabled)


def using_stage_graphs(enabled: bool | None):
    """:func:`set_stage_graphs` inside the block, the setting before it restored after."""
    return _GRAPHS.using(enabled)


def stage_graphs_enabled() -> bool:
    return _GRAPHS()


OFF = "stage graphs off (set_stage_graphs / CVT_CUTLASS_STAGE_GRAPHS=0)"
HELD = "a whole captured step holds the stage (its warm-up and capture)"
_held = ThreadValue(0)  # open held_by_caller blocks in this thread


@contextlib.contextmanager
def held_by_caller():
    """Stage calls in this thread run eagerly inside the block (counted: HELD), e.g. while a
    captured training step warms up and captures the whole step in one graph of its own."""
    with _held.using(_held.get() + 1):
        yield


_timed = ThreadValue()  # the innermost timed_stage_calls block's list in this thread


@contextlib.contextmanager
def timed_stage_calls():
    """A diagnostic of the stages' host cost: inside the block, every fused stage call in this
    thread that goes through its graphs (replayed, captured or run eagerly) appends its host
    time in seconds, from entering the graphs to returning the outputs, to the list the block
    yields (the innermost block's, where blocks nest). Stages reached inside a compiled model's
    ops count too."""
    with _timed.using([]) as times:
        yield times


def graph_stats() -> dict[str, int]:
    """{'replays': n, 'captures': n, 'eager: <reason>': n} since the last reset (also
    ``cvt_cutlass.stats()['stage_graphs']``)."""
    return fallback.stage_graph_stats()


def reset_graph_stats() -> None:
    fallback.reset_stage_graph_stats()


_count = fallback.record_stage_graph


_said: set[str] = set()


def _say_once(why: str) -> None:
    """Log why a signature stays eager, once per reason (a refused capture)."""
    if why not in _said:
        _said.add(why)
        logging.getLogger("cvt_cutlass").warning("cvt_cutlass: a fused stage runs eagerly, not from a CUDA graph "
                                                 "(%s) [further ones are only counted: "
                                                 "cvt_cutlass.stats()['stage_graphs']]", why)


# ----------------------------------------------------------------------------- signature
def _slots(stage) -> tuple[list, list]:
    """(module, name) of the stage's parameters and buffers, found once per registration generation."""
    from .params import generation

    got = stage.__dict__.get("_cvt_graph_slots")
    if got is None or got[0] != generation():
        def where(path):
            owner, _, name = path.rpartition(".")
            return stage.get_submodule(owner), name

        got = (generation(), [where(p) for p, _ in stage.named_parameters()],
               [where(b) for b, _ in stage.named_buffers()])
        stage.__dict__["_cvt_graph_slots"] = got
    return got[1], got[2]


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def is_fsdp(stage) -> bool:
    """Whether fully_shard (FSDP2) manages the stage's parameters."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(stage, FSDPModule)


_BN_STATE = operator.attrgetter("training", "momentum", "track_running_stats", "eps")


def _drop_state(drop: torch.nn.Module) -> tuple:
    return drop.training, float(getattr(drop, "drop_prob", 0.0))  # (nn.Identity where the rate is 0)


def _modules_of(stage) -> tuple:
    """(its BatchNorms, whether one is an nn.SyncBatchNorm, its layers' drop paths, the embedding
    LayerNorm), found again with the stage's recipe (a registration since)."""
    from .params import StageRecipe

    rec = StageRecipe.of(stage)
    got = stage.__dict__.get("_cvt_graph_modules")
    if got is None or got[0] is not rec:
        got = (rec, rec.bns, any(isinstance(bn, torch.nn.SyncBatchNorm) for bn in rec.bns),
               [lay.drop_path for lay in stage.layers], stage.embedding.convolution_embeddings.normalization)
        stage.__dict__["_cvt_graph_modules"] = got
    return got[1:]


def _module_state(stage) -> tuple | str:
    """What of the stage's modules a capture bakes in, or why a training call cannot be captured."""
    from .ops.dwconv import sync_group

    bn_mods, any_sync, drop_mods, emb_ln = _modules_of(stage)
    bns = tuple(map(_BN_STATE, bn_mods))
    for training, momentum, _, _ in bns:
        if training and momentum is None:
            return "BatchNorm momentum=None (its factor is read from the counter on the host)"
    if any_sync and any(sync_group(bn) is not None for bn in bn_mods):
        return "SyncBatchNorm across processes"
    return (stage.training, bns, tuple(map(_drop_state, drop_mods)), float(emb_ln.eps))


def _signature(stage, x: Tensor, dtype: torch.dtype, train: bool) -> tuple[str | None, tuple | None, list]:
    """(why the call runs eagerly or None, its signature, the stage's parameters)."""
    from .stage import checkpoint_func

    if not stage_graphs_enabled():
        return OFF, None, []
    if _held.get():
        return HELD, None, []
    if x.device.type != "cuda":
        return "not on CUDA", None, []
    if torch.cuda.is_current_stream_capturing():
        return "inside a CUDA graph capture (the caller's graph holds the stage)", None, []
    stream = torch.cuda.current_stream(x.device)
    if stream.cuda_stream and _compiled_graphs_stream(x.device, stream):  # (never the default stream)
        return "torch.compile's CUDA graphs (mode=\"reduce-overhead\") warming up: their pool holds the outputs", None, []
    if train and not stage.training:
        return "autograd records in eval mode (the op-by-op path)", None, []
    if train and checkpoint_func(stage) is not None:
        return "activation checkpointing", None, []
    return call_key(stage, x, dtype, train, stream.cuda_stream)


def _compiled_graphs_stream(device: torch.device, current: torch.cuda.Stream) -> bool:
    """Whether torch.compile's CUDA graph trees (mode="reduce-overhead") run on ``current``, this
    thread's current stream: they warm up a compiled graph there with their memory pool taking its
    allocations, and its outputs must come from that pool."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        manager = trees.get_manager(index, create_if_none_exists=False)
        stream = None if manager is None else manager.stream
    except (AttributeError, TypeError):  # a torch whose graph trees keep their stream elsewhere
        return False
    return stream is not None and current == stream


def call_key(stage, x: Tensor, dtype: torch.dtype, train: bool, stream: int) -> tuple[str | None, tuple | None, list]:
    """The device-independent part of :func:`_signature`: (why not or None, the signature of a
    call of ``stage`` on x issued to ``stream``, the stage's parameters)."""
    from .layer import layer_op_enabled
    from .runtime import get_kernel_path

    if getattr(stage, "_is_replica", False):
        return "an nn.DataParallel replica (its parameters are plain attributes of the copy)", None, []
    if is_fsdp(stage):
        return "FSDP2 (fully_shard gathers the parameters into new memory around each call)", None, []
    state = _module_state(stage)
    if isinstance(state, str):
        return state, None, []
    stream_dtype = getattr(stage, "stream_dtype", None)  # the residual stream's (fp32 under autocast, or dtype)
    out_dtype = getattr(stage, "output_dtype", None)  # the outputs' (the stream's, or dtype: rounded)
    sdt = dtype if stream_dtype is None else stream_dtype(x, dtype)
    sig = (tuple(x.shape), x.stride(), x.dtype, x.requires_grad, x.device, dtype, train, torch.is_grad_enabled(),
           torch.is_inference_mode_enabled(), torch.are_deterministic_algorithms_enabled(), get_kernel_path(),
           layer_op_enabled(), stream, state, sdt, dtype if out_dtype is None else out_dtype(x, dtype, sdt))
    if not train:  # the graph reads the folded weights, derived again when a parameter or buffer changes
        return None, sig + (id(stage.weights(dtype, x.device)),), []
    params, placed = _placement(stage)
    return None, sig + placed, params


class _Placement(NamedTuple):
    """A stage's recorded placement (stage.__dict__[_PLACEMENT]): the parameter and buffer objects,
    the C++ watch of their tensors, the signature part read from them, and the finalizer that
    drops the watch."""

    params: list
    buffers: list
    watch: int
    placed: tuple
    drop: weakref.finalize


_PLACEMENT = "_cvt_graph_placement"


def forget_placement(stage) -> None:
    """Drops the stage's recorded placement and its watch (which would keep the tensors it
    watched alive): after .to() / .cuda() / .half(), the next training call records it again."""
    got = stage.__dict__.pop(_PLACEMENT, None)
    if got is not None:
        got.drop()


def _placement(stage) -> tuple[list, tuple]:
    """The stage's parameters, and where they and its buffers live with the parameters'
    requires_grad (the part of a training signature a capture bakes in). Read again only when
    a parameter or buffer object was replaced in its module or a placement watch
    (csrc/watch.h) saw a tensor move or change requires_grad."""
    pslots, bslots = _slots(stage)
    params = [m._parameters[n] for m, n in pslots]
    buffers = [b for b in (m._buffers[n] for m, n in bslots) if b is not None]
    got = stage.__dict__.get(_PLACEMENT)
    if (got is not None and len(got.params) == len(params) and len(got.buffers) == len(buffers)
            and all(map(operator.is_, got.params, params)) and all(map(operator.is_, got.buffers, buffers))
            and not torch.ops.cvt_cutlass_C.placement_changed(got.watch)):
        return params, got.placed
    forget_placement(stage)
    placed = (tuple(map(Tensor.data_ptr, params)), tuple(map(Tensor.data_ptr, buffers)),
              tuple(map(_REQUIRES_GRAD, params)))
    wid = torch.ops.cvt_cutlass_C.watch_tensors(params + buffers)  # read by placement_changed
    drop = weakref.finalize(stage, torch.ops.cvt_cutlass_C.watch_drop, wid)
    stage.__dict__[_PLACEMENT] = _Placement(params, buffers, wid, placed, drop)
    return params, placed


# ----------------------------------------------------------------------------- one capture
class _Entry:
    """One captured signature: the forward graph (and the backward's), their static tensors."""

    def __init__(self, x: Tensor, producer: _Entry | None = None):
        self.device = x.device
        self.producer = producer  # the entry whose output buffer is this graph's input (inference)
        self.lent = 0  # references that consumers' graphs hold to this entry's output storage
        self.evicted = False  # dropped from its stage's entries
        if producer is None:
            self.static_x = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
        else:  # read the previous stage's replayed output where it is: no copy while it comes from there
            self.static_x = x.detach()
        self.x_buf = self.static_x.detach()
        if producer is not None:  # static_x and x_buf: two tensors on the producer's output storage
            producer.lent += 2
            weakref.finalize(self, _give_back, weakref.ref(producer), 2)
        self.fwd = torch.cuda.CUDAGraph()
        self.bwd: torch.cuda.CUDAGraph | None = None
        self.outs: tuple = ()  # the stage's outputs: (tokens (B, C, H, W) view, cls rows or None)
        self.grads_out: list[Tensor] = []  # the backward's static incoming gradients, per tensor output
        self.grad_x: Tensor | None = None
        self.n_params = 0
        self.grad_groups: list[tuple[list[int], list[Tensor]]] = []  # (parameter indices, their static
        # gradients), one group per gradient dtype
        self.anchor: Tensor | None = None  # a leaf the direct replays take instead of the parameters
        self.param_ptrs: tuple = ()  # the parameters' addresses the graphs read and write
        self.replays = 0
        self.pending = None  # weak reference to the last replay's autograd node until its backward runs
        self.hold = None  # what the graphs read that the signature names by id, or a cache could drop
        self.storage = 0
        self.base_uses = 0

    def seal(self) -> None:
        """Note how many references the entry itself holds to the outputs' storage."""
        self.storage = self.outs[0].untyped_storage()._cdata
        self.base_uses = torch._C._storage_Use_Count(self.storage)

    def busy(self) -> str | None:
        """Why the graph cannot be replayed now (the last replay's results are still in use), or None."""
        if self.pending is not None and self.pending() is not None:
            return "the last replay's backward has not run (two forwards before one backward)"
        if torch._C._storage_Use_Count(self.storage) > self.base_uses + self.lent:
            return "the last replay's outputs are still referenced"
        return None

    def input_blocked(self, x: Tensor) -> str | None:
        """Why x cannot be copied into the input buffer now (it is the previous stage's output
        buffer, whose last results are still referenced), or None."""
        if self.producer is None or x.data_ptr() == self.x_buf.data_ptr() or self.producer.busy() is None:
            return None
        return "the input buffer it shares with the previous stage's outputs holds results still referenced"

    def forward(self, x: Tensor) -> tuple:
        with torch.cuda.device(self.device):
            if x.data_ptr() != self.x_buf.data_ptr():
                self.x_buf.copy_(x)
            self.fwd.replay()
        self.replays += 1
        return tuple(None if o is None else o.detach() for o in self.outs)

    def backward(self, replay: int, grads, params: list[Tensor], direct: bool) -> list[Tensor | None]:
        """The gradients of replay number ``replay`` for the outputs' gradients ``grads``: [dx]
        with the parameters' written to their ``.grad`` here (``direct``), else [dx, *dparams];
        fresh tensors (a hook or .grad may keep them past the next replay)."""
        if replay != self.replays:
            raise RuntimeError("cvt_cutlass: a backward through a stage forward whose CUDA graph was replayed again "
                               "since (retain_graph and a second backward after another forward); run such loops "
                               "with cvt_cutlass.graphs.set_stage_graphs(False)")
        if tuple(map(Tensor.data_ptr, params)) != self.param_ptrs:
            raise RuntimeError("cvt_cutlass: a stage's parameters moved between its replayed forward and its "
                               "backward (the graph reads them where they were); run such loops with "
                               "cvt_cutlass.graphs.set_stage_graphs(False)")
        self.pending = None
        with torch.cuda.device(self.device):
            for buf, g in zip(self.grads_out, grads, strict=True):
                buf.zero_() if g is None else buf.copy_(g)
            self.bwd.replay()
            out = [None if self.grad_x is None else self.grad_x.clone()]
            if direct:  # each parameter this backward fills (csrc/grads.h: grad_wanted)
                for idx, grads in self.grad_groups:
                    _private().stage_grads([params[i] for i in idx], grads, True)
                return out
            out += [None] * self.n_params
            for idx, grads in self.grad_groups:
                for i, g in zip(idx, _private().stage_grads([params[i] for i in idx], grads, False), strict=True):
                    out[1 + i] = g
            return out


def _give_back(producer: weakref.ref, lent: int) -> None:
    """A consumer's graph is gone: its references to ``producer``'s output storage no longer count."""
    got = producer()
    if got is not None:
        got.lent -= lent


_inference_outputs: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # output storage -> its
# inference entry: a later stage's inference capture on that storage reads it in place


class _Replay(torch.autograd.Function):
    """A training replay as one autograd node: inputs x and either the stage's parameters (their
    gradients go back through the engine) or, ``direct``, the entry's anchor (the backward writes
    the parameters' .grad itself, as AccumulateGrad would: one call instead of an engine node per
    parameter); outputs the stage's tensor outputs; its backward replays the backward graph."""

    @staticmethod
    def forward(ctx, entry: _Entry, params: list[Tensor], direct: bool, x: Tensor, *edges: Tensor):
        outs = entry.forward(x)
        ctx.entry, ctx.replay, ctx.params, ctx.direct = entry, entry.replays, params, direct
        ctx.set_materialize_grads(False)
        entry.pending = weakref.ref(ctx)
        return tuple(o for o in outs if o is not None)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        got = ctx.entry.backward(ctx.replay, grads, ctx.params, ctx.direct)
        return (None, None, None, *got, *([None] if ctx.direct else ()))


def replayed_backward(outs: tuple, grads: tuple) -> tuple[bool, Tensor | None]:
    """(True, the input's gradient) after running the backward of the training replay whose
    outputs are ``outs`` (the stage's outputs, None where absent) for the outputs' gradients
    ``grads`` directly, without the autograd engine, where that replay writes its parameters'
    gradients itself; (False, None) where ``outs`` are not such a replay's (an eager call, or one
    whose gradients go through the engine). For a caller that keeps a replay's outputs privately
    (``cvt_cutlass.ops.stage``): nothing else can reach that node."""
    kept = [(o, g) for o, g in zip(outs, grads, strict=True) if o is not None]
    node = kept[0][0].grad_fn if kept else None
    if type(node) is not _Replay._backward_cls or not node.direct:
        return False, None
    return True, node.entry.backward(node.replay, [g for _, g in kept], node.params, True)[0]


def _private():
    """The binding's private ops (loaded on first use)."""
    import cvt_cutlass.ops  # noqa: F401  (loads the binding)

    return torch.ops.cvt_cutlass_C


_capture_streams: dict[int, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """A side stream per device for captures (torch.cuda.graph's own is made once, on one device)."""
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _capture_streams:
        _capture_streams[i] = torch.cuda.Stream(device=i)
    return _capture_streams[i]


# ----------------------------------------------------------------------------- a stage's graphs
class StageGraphs:
    """The captured signatures of one fused stage (see the module docstring)."""

    def __init__(self):
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._warm: set[tuple] = set()  # signatures whose eager call finished (training: its backward ran)
        self._refused: dict[tuple, str] = {}  # signatures whose capture failed, and why
        self._lock = threading.Lock()  # one thread at a time checks and replays the static buffers

    def __reduce__(self):  # a copy (deepcopy, pickle) of the stage captures its own
        return (StageGraphs, ())

    # for the compiled stage op (cvt_cutlass.ops.stage), which reaches the graphs through its stage
    replayed_backward = staticmethod(replayed_backward)

    def clear(self) -> None:
        with self._lock:
            for sig in list(self._entries):
                self._evict(sig)
            self._warm.clear()
            self._refused.clear()

    def __call__(self, stage, x: Tensor, dtype: torch.dtype, run):
        """The stage's outputs for x, replayed or from ``run(x, dtype)`` (the eager forward)."""
        times = _timed.get()
        if times is None:
            return self._call(stage, x, dtype, run)
        t0 = time.perf_counter()
        try:
            return self._call(stage, x, dtype, run)
        finally:
            times.append(time.perf_counter() - t0)

    def _call(self, stage, x: Tensor, dtype: torch.dtype, run):
        train = stage.differentiable(x)
        why, sig, params = _signature(stage, x, dtype, train)
        if why is None:
            why = self._refused.get(sig)
        if why is not None:
            _count(f"eager: {why}")
            return run(x, dtype)
        with self._lock:
            got = self._replay(stage, sig, x, dtype, run, params if train else None)
        if isinstance(got, str):
            _count(f"eager: {got}")
            return run(x, dtype) if got != _NEW else self._warm_up(sig, run(x, dtype), train)
        _count("replays")
        return got

    def _replay(self, stage, sig: tuple, x: Tensor, dtype: torch.dtype, run, params) -> tuple | str:
        """The replayed outputs of signature ``sig``, capturing it first where it is warm, or why the
        call runs eagerly."""
        entry = self._entries.get(sig)
        if entry is not None and entry.producer is not None and entry.producer.evicted:
            self._evict(sig)  # it reads a buffer that no stage writes any more: capture again
            entry = None
        if entry is None:
            if sig not in self._warm:
                return _NEW
            entry = self._capture(stage, sig, x, dtype, run, params)
            if isinstance(entry, str):
                if len(self._refused) >= MAX_WARM:
                    self._refused.clear()
                self._refused[sig] = entry
                _say_once(entry)
                return entry
        self._entries.move_to_end(sig)
        busy = entry.busy() or entry.input_blocked(x)
        if busy is not None:
            return busy
        if params is None:
            return entry.forward(x)
        direct = _private().stage_grads_direct(params)
        if not direct:
            _count(ENGINE)
        got = iter(_Replay.apply(entry, params, direct, x, *((entry.anchor,) if direct else params)))
        return tuple(None if o is None else next(got) for o in entry.outs)

    def _evict(self, sig: tuple) -> None:
        self._entries.pop(sig).evicted = True  # a later stage's graph that reads its outputs captures again

    def _warm_up(self, sig: tuple, outs: tuple, train: bool) -> tuple:
        """An eager call's outputs; the signature is warm once its backward reached them (training:
        a gradient arrived at an output, so the backward's kernels are built before the next
        forward) or now (inference)."""
        if len(self._warm) >= MAX_WARM:
            self._warm.clear()
        if not train:
            self._warm.add(sig)
            return outs
        warm = self._warm

        def mark(_grad):
            warm.add(sig)

        for o in outs:
            if o is not None and o.requires_grad:
                o.register_hook(mark)
        return outs

    def _capture(self, stage, sig: tuple, x: Tensor, dtype: torch.dtype, run, params) -> _Entry | str:
        """The forward (and with ``params``, the backward) of signature ``sig`` captured, or why not."""
        from .layer import keep_factor_tensors

        producer = None if params is not None else _inference_outputs.get(x.untyped_storage()._cdata)
        entry, before = _Entry(x, producer), fallback.tally()
        if producer is None:
            entry.x_buf.copy_(x)
        if params is not None and x.requires_grad:
            entry.static_x.requires_grad_(True)
        pool, stream = torch.cuda.graph_pool_handle(), _capture_stream(x.device)
        try:
            with torch.cuda.device(x.device), _leaf_aliases(stage) as aliases, no_gc():
                with torch.cuda.graph(entry.fwd, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    entry.outs = tuple(run(entry.static_x, dtype))
                if fallback.tally() != before:
                    return "a PyTorch fallback or op-by-op layer inside the stage (counted where it runs)"
                if params is not None:
                    _capture_backward(entry, aliases, pool, stream)
        except Exception as e:  # noqa: BLE001  an op that cannot be captured: the signature stays eager
            return f"capture failed: {(str(e).splitlines() or [type(e).__name__])[0][:160]}"
        entry.outs = tuple(None if o is None else o.detach() for o in entry.outs)  # drops the captured autograd graph
        entry.param_ptrs = () if params is None else tuple(p.data_ptr() for p in params)
        entry.hold = (None if params is not None else stage._weights, keep_factor_tensors())
        entry.seal()
        if params is None:
            _inference_outputs[entry.storage] = entry
        _count("captures")
        for old in [k for k, e in self._entries.items() if e.hold[0] is not None and e.hold[0] is not stage._weights]:
            self._evict(old)  # inference graphs of weights derived anew since: never replayed again
        self._entries[sig] = entry
        while len(self._entries) > MAX_ENTRIES:
            self._evict(next(iter(self._entries)))
        return entry


_gc_lock = threading.Lock()
_gc_holds = [0, False]  # blocks open in any thread, whether the collector was on before the first


@contextlib.contextmanager
def no_gc():
    """Python's cyclic garbage collector off inside the block, for a CUDA graph capture: a
    collection during a capture may free another model's CUDA graphs, whose reset is not
    permitted while a stream captures (the capture then fails: seen on an H100, 2026-11-27, with
    the previous test's models in reference cycles). Blocks in several threads keep it off until
    the last one ends; it then returns to the state before the first."""
    with _gc_lock:
        if _gc_holds[0] == 0:
            _gc_holds[1] = gc.isenabled()
            gc.disable()
        _gc_holds[0] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holds[0] -= 1
            if _gc_holds[0] == 0 and _gc_holds[1]:
                gc.enable()


_NEW = "a new call signature (captured when it comes again)"
ENGINE = "replays whose parameter gradients go through the autograd engine (a parameter has a hook)"


@contextlib.contextmanager
def _leaf_aliases(stage):
    """The stage's parameters replaced, inside the block, by new leaf Parameters on the same memory
    (the captured kernels read and write the real ones' addresses): a capture then meets no
    gradient accumulator of the real parameters, which an earlier step's graph may keep alive on
    another stream (joining that stream would invalidate the capture). Yields the aliases in
    ``_slots`` order."""
    pslots, _ = _slots(stage)
    real = [m._parameters[n] for m, n in pslots]
    aliases = [torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in real]
    for (m, n), a in zip(pslots, aliases, strict=True):
        m._parameters[n] = a
    try:
        yield aliases
    finally:
        for (m, n), p in zip(pslots, real, strict=True):
            m._parameters[n] = p


def _capture_backward(entry: _Entry, params: list[Tensor], pool, stream) -> None:
    """The backward graph: the outputs' gradients (static) to x's and the parameters' (static,
    grouped by dtype). The captured graph keeps the forward's saved activations
    (retain_graph), so nothing in the backward's capture reuses their memory and a replay's
    backward can run again."""
    outs = [o for o in entry.outs if o is not None]
    if not all(o.requires_grad for o in outs):
        raise RuntimeError("a stage output does not require grad")
    entry.grads_out = [torch.empty_like(o) for o in outs]
    want = [i for i, p in enumerate(params) if p.requires_grad]
    inputs = ([entry.static_x] if entry.static_x.requires_grad else []) + [params[i] for i in want]
    entry.bwd = torch.cuda.CUDAGraph()
    with torch.cuda.graph(entry.bwd, pool=pool, stream=stream, capture_error_mode="thread_local"):
        grads = list(torch.autograd.grad(outs, inputs, entry.grads_out, retain_graph=True, allow_unused=True))
        entry.grad_x = grads.pop(0) if entry.static_x.requires_grad else None
        groups: dict[torch.dtype, list[tuple[int, Tensor]]] = {}
        for i, g in zip(want, grads, strict=True):
            if g is not None:  # a parameter the stage did not use keeps no gradient
                groups.setdefault(g.dtype, []).append((i, g))
        entry.grad_groups = [([i for i, _ in got], [g for _, g in got]) for got in groups.values()]
        del grads, groups
    entry.n_params = len(params)
    entry.anchor = torch.zeros(0, device=entry.device, requires_grad=True)
