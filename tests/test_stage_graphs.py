"""The fused stages' CUDA graphs (cvt_cutlass.graphs): what runs eagerly and why (CPU), and on the
GPU replays that train and infer like the eager calls, with the cases that must not replay (results
still in use, a new shape, moved parameters) running eagerly, counted."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import cvt_cutlass
from cvt_cutlass import fallback
from cvt_cutlass.graphs import OFF, graph_stats, reset_graph_stats, timed_stage_calls, using_stage_graphs
from cvt_cutlass.swap import swap

from .conftest import requires_sm80
from .test_swap import tiny_cvt

STAGE_GRAPHS = True  # conftest: graphs on in this module


def gpu_kernel_specs(cc: int, gpu: str | None) -> list:
    """tiny_cvt's training and inference kernels at 64x64 (the tests of test_train_step's set)."""
    from cvt_cutlass import model_kernels

    from .gpu_kernels import default_arch

    arch = default_arch(cc)
    return [*model_kernels(tiny_cvt().config, 64, ["bf16", "fp16"], arch, training=True, gpu=gpu, max_batch=8,
                           residual_stream="fp32"),
            *model_kernels(tiny_cvt().config, 64, ["fp16"], arch, training=False, gpu=gpu, max_batch=8)]


def _model(device: str, drop_path=0.0, residual_stream="compute"):
    m = tiny_cvt(drop_path_rate=[0.0, 0.0, drop_path]).train().to(device)
    return swap(m, residual_stream=residual_stream)


def _batch(b: int, device: str, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 3, 64, 64, generator=g).to(device), torch.randint(0, 16, (b,), generator=g).to(device)


def _loss(model, x, y, amp=torch.bfloat16):
    with torch.autocast(x.device.type, dtype=amp):
        return F.cross_entropy(model(x).logits.float(), y)


def _sgd_steps(model, batches, graphs: bool, optimizer=None):
    """Training steps (SGD with momentum, or ``optimizer(params)``); the losses."""
    opt = (optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)))(model.parameters())
    losses = []
    with using_stage_graphs(graphs):
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            loss = _loss(model, x, y)
            loss.backward()
            opt.step()
            losses.append(float(loss))
    return losses


# ----------------------------------------------------------------------------------- CPU
def test_timed_stage_calls_and_stage_handles():
    """timed_stage_calls records one host time per stage call inside its block (eager on the
    CPU too), none outside it and none after it; each stage's handle is its own."""
    model = _model("cpu")
    x, _ = _batch(2, "cpu")
    with torch.no_grad(), timed_stage_calls() as times:
        model(x)
        with timed_stage_calls() as inner:
            model(x)
    assert len(times) == 3 and len(inner) == 3 and all(t > 0 for t in times + inner)
    with torch.no_grad():
        model(x)
    assert len(times) == 3
    handles = [s.handle for s in model.cvt.encoder.stages]
    assert len(set(handles)) == 3 and all(isinstance(h, int) for h in handles)


def test_training_signature_follows_where_parameters_and_buffers_live():
    """A training call's signature names where the stage's parameters and buffers live and which
    require grad (a capture bakes in their addresses): in-place writes keep it; a `.data` swap,
    requires_grad_(), a buffer or parameter object replaced in its module, and a copy's own
    tensors change it."""
    from cvt_cutlass.graphs import call_key

    stage = _model("cpu").cvt.encoder.stages[2]
    x = torch.randn(2, 96, 8, 8)

    def sig(s=stage):
        why, key, params = call_key(s, x, torch.bfloat16, True, 0)
        assert why is None and params == list(s.parameters())
        return key

    first = sig()
    w = stage.layers[0].intermediate.dense.weight
    bn = stage.layers[1].attention.attention.convolution_projection_key.convolution_projection.normalization
    with torch.no_grad():
        w.add_(1.0)
        bn.running_mean.add_(1.0)
    assert sig() == first
    kept = [w.data, bn.running_mean, w]  # (freed, their memory could come back at the old address)
    flat = torch.zeros(2 * w.numel())
    w.data = flat[:w.numel()].view_as(w)
    front = sig()
    assert front != first
    w.data = flat[w.numel():].view_as(w)  # the same storage, another offset
    assert sig() != front
    w.data = w.data.clone()
    kept.append(flat)
    moved = sig()
    assert moved != first and sig() == moved
    w.requires_grad_(False)
    frozen = sig()
    assert frozen != moved
    w.requires_grad_(True)
    assert sig() == moved
    bn.running_mean = bn.running_mean.clone()  # a new buffer object
    replaced = sig()
    assert replaced != moved
    lin = stage.layers[0].intermediate.dense
    lin.weight = torch.nn.Parameter(lin.weight.detach().clone())  # a new parameter object
    assert sig() != replaced
    twin = copy.deepcopy(stage)
    twin_first = sig(twin)
    assert twin_first != sig()
    twin.layers[0].intermediate.dense.weight.data = twin.layers[0].intermediate.dense.weight.data.clone()
    assert sig(twin) != twin_first


def test_captures_run_without_the_garbage_collector():
    """no_gc (around every capture) turns Python's collector off and restores its state: a
    collection inside a capture could free another model's graphs (not permitted while capturing)."""
    import gc

    from cvt_cutlass.graphs import no_gc

    with no_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    first, second = no_gc(), no_gc()  # two threads' captures, the first ending first
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not gc.isenabled()
    second.__exit__(None, None, None)
    assert gc.isenabled()
    gc.disable()
    try:
        with no_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_calls_off_cuda_run_eagerly_counted():
    model = _model("cpu")
    reset_graph_stats()
    _loss(model, *_batch(2, "cpu")).backward()
    assert graph_stats() == {"eager: not on CUDA": 3}
    with using_stage_graphs(False):
        _loss(model, *_batch(2, "cpu"))
    assert graph_stats()[f"eager: {OFF}"] == 3
    assert cvt_cutlass.stats()["stage_graphs"] == graph_stats()


def test_a_copy_captures_its_own_graphs():
    model = _model("cpu")
    dup = copy.deepcopy(model)
    stages = [model.cvt.encoder.stages[i] for i in range(3)]
    copies = [dup.cvt.encoder.stages[i] for i in range(3)]
    assert all(a._graphs is not b._graphs for a, b in zip(stages, copies, strict=True))
    assert all("_cvt_graph_slots" not in s.__dict__ for s in copies)


def _traced_ops(model, x) -> list[str]:
    """The ops torch.compile's graph of model(x) calls (dynamo's FX graph, no break allowed)."""
    seen = []

    def backend(gm, _inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(x)
    return seen


@pytest.mark.parametrize("stream", ["compute", "fp32"])
def test_compiled_forwards_call_one_op_per_stage(stream):
    """Under torch.compile a stage's forward is one op (which replays the stage's graph at run
    time): stage_infer in inference, stage_train in training; under autocast with the fp32
    residual stream too (the op runs the stage with the stream the trace saw: its outputs fp32)."""
    model = _model("cpu", residual_stream=stream).eval()
    x, _ = _batch(2, "cpu")
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=stream == "fp32")
    with torch.no_grad(), amp:
        ref = model.cvt(x)
        ops = _traced_ops(model, x)
        assert sum("stage_infer" in o for o in ops) == 3 and not any("cvt_layer" in o for o in ops), ops
        torch._dynamo.reset()
        out = torch.compile(model.cvt, backend="aot_eager", fullgraph=True)(x)
    assert out.last_hidden_state.dtype == ref.last_hidden_state.dtype == torch.float32
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.cls_token_value, ref.cls_token_value, rtol=1e-5, atol=1e-5)
    model.train()
    with amp:
        ops = _traced_ops(model, x)
    assert sum("stage_train" in o for o in ops) == 3 and not any("cvt_layer" in o for o in ops), ops
    torch._dynamo.reset()


def _compiled_steps(model, batches, steps_of=_sgd_steps, **compile_args):
    torch._dynamo.reset()
    got = steps_of(torch.compile(model, fullgraph=True, **compile_args), batches, True)
    torch._dynamo.reset()
    return got


@pytest.mark.parametrize("backend,stream", [("aot_eager", "compute"), ("inductor", "compute"), ("aot_eager", "fp32")])
def test_compiled_training_steps_follow_eager_ones_cpu(backend, stream):
    """torch.compile(swapped) training (bf16 autocast) through the stage_train op: the eager steps'
    losses and parameters, each stage's gradients written by its kept call's backward, nothing kept
    after; with the 16-bit and the fp32 residual stream."""
    from cvt_cutlass.ops import stage as stage_ops

    a = _model("cpu", drop_path=0.0, residual_stream=stream)
    b = copy.deepcopy(a)
    batches = [_batch(2, "cpu", seed) for seed in range(3)]
    want = _sgd_steps(b, batches, True)
    got = _compiled_steps(a, batches, backend=backend)
    assert got == pytest.approx(want, rel=1e-4)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-5, msg=name)
    assert not stage_ops._pending


def test_compiled_training_forward_without_backward_keeps_nothing_cpu():
    """A compiled training forward whose backward never runs (its graph dropped) leaves no kept
    call behind; a second backward through one stage_train call (retain_graph) raises."""
    from cvt_cutlass.ops import stage as stage_ops

    model = _model("cpu")
    x, y = _batch(2, "cpu")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = _loss(compiled, x, y)
    assert len(stage_ops._pending) == 3
    del loss
    assert not stage_ops._pending
    torch._dynamo.reset()
    stage = model.cvt.encoder.stages[0]
    tokens, _, _ = torch.ops.cvt_cutlass.stage_train(x, stage._anchor, torch.empty(0), stage._handle, torch.float32,
                                                     torch.float32, torch.float32, False, True)
    tokens.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran already"):
        tokens.sum().backward()


def test_compiled_stage_called_twice_on_one_input_cpu():
    """Two calls of one stage on one input in a compiled graph stay two calls (the compiler does
    not merge them): two kept calls, two backwards, the eager gradients and running statistics."""
    a = _model("cpu")
    b = copy.deepcopy(a)
    x, _ = _batch(2, "cpu")

    def twice(model):
        stage = model.cvt.encoder.stages[0]
        return lambda x: stage(x)[0].sum() + stage(x)[0].square().sum()

    torch._dynamo.reset()
    torch.compile(twice(a), backend="aot_eager", fullgraph=True)(x).backward()
    twice(b)(x).backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert (pa.grad is None) == (pb.grad is None), name
        if pa.grad is not None:
            torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-6, msg=name)
    for (name, ba), bb in zip(a.named_buffers(), b.buffers(), strict=True):
        torch.testing.assert_close(ba, bb, rtol=1e-5, atol=1e-6, msg=name)
    torch._dynamo.reset()


def test_compiled_training_under_saved_tensor_hooks_and_no_grad_cpu():
    """Under save_on_cpu (its pack hook saves a copy of the op's token) compiled steps follow the
    eager ones; a training-mode forward under no_grad keeps nothing and records nothing; with the
    stage graphs off the stages trace their ops, so torch.autograd.grad with respect to a stage's
    parameters works."""
    from cvt_cutlass.ops import stage as stage_ops

    a = _model("cpu")
    b = copy.deepcopy(a)
    batches = [_batch(2, "cpu", seed) for seed in range(2)]

    def hooked_steps(model, batches, graphs):
        with torch.autograd.graph.save_on_cpu():
            return _sgd_steps(model, batches, graphs)

    assert _compiled_steps(a, batches, hooked_steps) == pytest.approx(_sgd_steps(b, batches, True), rel=1e-4)
    assert not stage_ops._pending
    torch._dynamo.reset()
    compiled = torch.compile(a, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert not compiled(batches[0][0]).logits.requires_grad and not stage_ops._pending
    torch._dynamo.reset()
    with using_stage_graphs(False):
        loss = _loss(torch.compile(a, backend="aot_eager", fullgraph=True), *batches[0])
        weight = a.cvt.encoder.stages[1].layers[0].intermediate.dense.weight
        (g,) = torch.autograd.grad(loss, [weight])
    assert g.shape == weight.shape and g.abs().sum() > 0
    torch._dynamo.reset()


def test_stages_that_trace_their_ops_under_compile_cpu():
    """Where stage_train does not serve a compiled training forward, the stage traces its ops, for a
    reason: a DataParallel replica (it shares its original's handle), activation checkpointing,
    the stage graphs off (the way to torch.autograd.grad with respect to its parameters)."""
    from cvt_cutlass.swap import traced_in_training

    model = _model("cpu")
    stage = model.cvt.encoder.stages[0]
    assert traced_in_training(stage) is None
    stage.gradient_checkpointing = True
    assert traced_in_training(stage) == "activation checkpointing"
    stage.gradient_checkpointing = False
    with using_stage_graphs(False):
        assert traced_in_training(stage) == "stage graphs off"
        ops = _traced_ops(model, _batch(2, "cpu")[0])
        assert not any("stage_train" in o for o in ops) and any("cvt_layer_train" in o for o in ops), ops
    stage._is_replica = True
    assert "DataParallel" in traced_in_training(stage)
    torch._dynamo.reset()


def test_compiled_input_gradient_cpu():
    """The input's gradient through the compiled stages is the eager one."""
    a = _model("cpu").eval()
    b = copy.deepcopy(a)
    x, _ = _batch(2, "cpu")
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    torch._dynamo.reset()
    torch.compile(a, backend="aot_eager", fullgraph=True)(xa).logits.square().sum().backward()
    b(xb).logits.square().sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stage_infer_op_checks(dtype):
    """torch.library.opcheck of stage_infer (schema, fake kernel, dynamic shapes) on each stage,
    computing in fp32, and in bf16 on an fp32 residual stream (its output fp32, or bf16: the
    stream's last sum rounded)."""
    import cvt_cutlass.ops  # noqa: F401  (registers the ops)

    model = _model("cpu", residual_stream="fp32").eval()
    x, _ = _batch(2, "cpu")
    with torch.no_grad():
        for stage in model.cvt.encoder.stages:
            for out in {torch.float32, dtype}:
                torch.library.opcheck(torch.ops.cvt_cutlass.stage_infer.default,
                                      (x, stage._handle, dtype, torch.float32, out))
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                x = stage(x)[0]
    with pytest.raises(RuntimeError, match="names no live fused stage"):
        torch.ops.cvt_cutlass.stage_infer(x, -1, torch.float32, torch.float32, torch.float32)


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("rows", [0, 1])
def test_stage_infer_rows_are_the_outputs_buffer(b, rows):
    """stage_infer returns the one buffer a stage's outputs view (split_rows' layout), whatever
    the strides of size-1 dimensions (batch 1, one cls row); outputs in two buffers are refused."""
    from cvt_cutlass.ops.stage import split_rows, token_rows

    t = torch.randn(b, rows + 12, 5)
    tokens, cls = split_rows(t, 3, 4, rows)
    if b == 1:  # size-1 dimensions with strides of their own (as some kernels leave them)
        tokens = tokens.as_strided(tokens.shape, (999, *tokens.stride()[1:]), tokens.storage_offset())
        cls = None if cls is None else cls.as_strided(cls.shape, (7, 77, 1), cls.storage_offset())
    got = token_rows(tokens, cls)
    assert got is not None and torch.equal(got, t)
    assert got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert token_rows(torch.randn(b, 5, 3, 4), torch.randn(b, 1, 5)) is None
    assert token_rows(torch.randn(b, 5, 3, 4), None) is None  # NCHW memory, not token rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stage_train_op_checks(dtype):
    """opcheck of stage_train (schema, autograd registration, fake kernel) on each stage, computing
    in fp32, and in bf16 on an fp32 residual stream (outputs fp32, or bf16: rounded); the AOT-dispatch check compares
    two calls' outputs, which differ here by design (each call keeps its autograd outputs under a
    new token, and updates the BatchNorm statistics)."""
    from cvt_cutlass.ops import stage as stage_ops  # (registers the ops)

    model = _model("cpu", residual_stream="fp32")
    x, _ = _batch(2, "cpu")
    for stage in model.cvt.encoder.stages:
        torch.library.opcheck(torch.ops.cvt_cutlass.stage_train.default,
                              (x, stage._anchor, torch.empty(0), stage._handle, dtype, torch.float32, dtype,
                               x.requires_grad, True),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            x = stage(x)[0]
    stage_ops._pending.clear()


# ----------------------------------------------------------------------------------- GPU
@requires_sm80
def test_compiled_inference_replays_the_stage_graphs_gpu():
    """torch.compile(swapped) in inference (Inductor): the stages replay their CUDA graphs inside
    the compiled graph and the logits are the eager model's."""
    model = _model("cuda").eval()
    xs = [_batch(4, "cuda", seed)[0] for seed in (1, 2)]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        with using_stage_graphs(False):
            want = [model(x).logits for x in xs]
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        reset_graph_stats()
        got = [compiled(xs[i % 2]).logits for i in range(6)]
    assert graph_stats()["replays"] >= 3 * 4, graph_stats()
    # the stages' kernels are the eager model's; Inductor fuses the head's glue its own way
    assert all(torch.allclose(g, want[i % 2], rtol=2e-3, atol=2e-3) for i, g in enumerate(got))
    torch._dynamo.reset()


@requires_sm80
def test_compiled_inference_outputs_kept_across_calls_gpu():
    """A compiled model's stage outputs are its graphs' buffers where the stages replay: hidden
    states and the last hidden state kept from one call stay as they were through later calls on
    other inputs (those calls run eagerly while they are kept), and every call's outputs are the
    eager model's. (Under mode="reduce-overhead", torch's CUDA graphs own the outputs instead: a
    result kept across calls must be cloned, as with any model.)"""
    model = _model("cuda").eval()
    xs = [_batch(4, "cuda", seed)[0] for seed in (1, 2, 3)]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        with using_stage_graphs(False):
            want = [model.cvt(x, output_hidden_states=True) for x in xs]
        torch._dynamo.reset()
        compiled = torch.compile(model.cvt, fullgraph=True)
        for x in xs[:2]:  # warm: the stages capture their graphs
            compiled(x, output_hidden_states=True)
        reset_graph_stats()
        kept = [compiled(x, output_hidden_states=True) for x in xs]  # all three kept
        kept_copies = [[h.clone() for h in k.hidden_states] + [k.last_hidden_state.clone()] for k in kept]
        for x in xs:
            compiled(x, output_hidden_states=True)
    for i, (k, w) in enumerate(zip(kept, want, strict=True)):
        got = [*k.hidden_states, k.last_hidden_state]
        for g, c in zip(got, kept_copies[i], strict=True):
            assert torch.equal(g, c), i  # not overwritten by the later calls
        for g, e in zip(got, [*w.hidden_states, w.last_hidden_state], strict=True):
            assert torch.allclose(g.float(), e.float(), rtol=2e-2, atol=2e-2), i
    stats = graph_stats()
    assert stats["replays"] >= 3 and any(k.startswith("eager: ") for k in stats), stats
    torch._dynamo.reset()


@requires_sm80
def test_reduce_overhead_warm_ups_run_the_stages_eagerly_gpu():
    """torch.compile's mode="reduce-overhead" warms each graph up on its own stream, its memory
    pool taking the allocations: the stages run eagerly there (their outputs from that pool), also
    for a second graph of the same model (output_hidden_states on); every call's outputs are the
    eager model's."""
    model = _model("cuda").eval()
    xs = [_batch(4, "cuda", seed)[0] for seed in (1, 2)]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        with using_stage_graphs(False):
            want = [model.cvt(x).last_hidden_state.float() for x in xs]
        torch._dynamo.reset()
        compiled = torch.compile(model.cvt, mode="reduce-overhead", fullgraph=True)
        reset_graph_stats()
        got = []
        for i in range(6):
            for hidden in (False, True):
                got.append((i % 2, compiled(xs[i % 2], output_hidden_states=hidden).last_hidden_state.float()))
    for i, g in got:
        assert torch.allclose(g, want[i], rtol=2e-2, atol=2e-2), i
    assert any("reduce-overhead" in k for k in graph_stats()), graph_stats()
    torch._dynamo.reset()


@requires_sm80
@pytest.mark.parametrize("stream", ["compute", "fp32"])
def test_compiled_training_replays_the_stage_graphs_gpu(stream):
    """torch.compile(swapped) training (Inductor, bf16 autocast, SGD): the stages replay their
    graphs inside the compiled steps (from the second step on), and the steps follow the eager
    ones; with the 16-bit and the fp32 residual stream."""
    a = _model("cuda", drop_path=0.0, residual_stream=stream)
    b = copy.deepcopy(a)
    batches = [_batch(8, "cuda", seed) for seed in range(5)]
    want = _sgd_steps(b, batches, True)
    reset_graph_stats()
    got = _compiled_steps(a, batches)
    assert graph_stats()["replays"] >= 3 * 3, graph_stats()
    assert got == pytest.approx(want, rel=1e-3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, rtol=1e-3, atol=1e-5), name


@requires_sm80
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_weight_updates_reach_replayed_and_compiled_inference_gpu(mode):
    """Inference replays (eager stage graphs, or a compiled model's graphs) after the weights
    change in place (a Linear weight cast for autocast, a BatchNorm statistic folded): the outputs
    of the eager model with the new weights."""
    model = _model("cuda").eval()
    x, _ = _batch(4, "cuda")
    lin = model.cvt.encoder.stages[2].layers[0].intermediate.dense
    bn = model.cvt.encoder.stages[1].layers[0].attention.attention.convolution_projection_query \
        .convolution_projection.normalization
    run = model if mode is None else torch.compile(model, mode=mode, fullgraph=True)
    torch._dynamo.reset()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        before = [run(x).logits.clone() for _ in range(3)]
        lin.weight.mul_(-1.5)
        bn.running_var.mul_(9.0)
        after = [run(x).logits.clone() for _ in range(2)]
        with using_stage_graphs(False):
            want = model(x).logits
    assert not torch.allclose(before[-1], want, rtol=1e-2, atol=1e-2)
    assert all(torch.allclose(a, want, rtol=2e-3, atol=2e-3) for a in after)
    torch._dynamo.reset()


@requires_sm80
@pytest.mark.parametrize("stream", ["compute", "fp32"])
def test_replayed_training_follows_eager_steps_gpu(stream):
    """Six SGD steps (bf16 autocast, batch 8) with the stages replayed against the same steps
    launched eagerly: the same kernels on the same inputs, so the same losses and parameters to
    rounding, the same running statistics and batch counts; with the 16-bit and the fp32
    residual stream (whose stages' outputs and their gradients are fp32)."""
    a = _model("cuda", residual_stream=stream)
    b = copy.deepcopy(a)
    batches = [_batch(8, "cuda", seed) for seed in range(6)]
    reset_graph_stats()
    fallback.reset()  # (the CPU tests before this one count their calls off CUDA)
    la = _sgd_steps(a, batches, True)
    st = graph_stats()
    lb = _sgd_steps(b, batches, False)
    assert st.get("captures") == 3 and st.get("replays") == 3 * 5, st  # step 1 eager, step 2 captures and replays
    assert la == pytest.approx(lb, rel=1e-3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, rtol=1e-3, atol=1e-5), name
    for (name, ba), bb in zip(a.named_buffers(), b.buffers(), strict=True):
        assert torch.allclose(ba.double(), bb.double(), rtol=1e-3, atol=1e-5), name
    assert fallback.stats()["fallbacks"] == {}


@requires_sm80
def test_results_in_use_run_eagerly_gpu():
    """Two forwards before one backward, and outputs kept across calls: eager calls, counted; the
    gradients are the eager model's."""
    a = _model("cuda")
    b = copy.deepcopy(a)
    x, y = _batch(8, "cuda")
    _sgd_steps(a, [(x, y)] * 2, True)  # warm, then captured
    _sgd_steps(b, [(x, y)] * 2, False)
    reset_graph_stats()
    for m, on in ((a, True), (b, False)):
        m.zero_grad(set_to_none=True)
        with using_stage_graphs(on):
            (_loss(m, x, y) + _loss(m, x.flip(0), y.flip(0))).backward()
    st = graph_stats()
    assert st["replays"] == 3 and st["eager: the last replay's backward has not run (two forwards before one "
                                     "backward)"] == 3, st
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa.grad, pb.grad, rtol=2e-3, atol=1e-5), name
    a.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        # warm, captured and replayed, then the replay's stage outputs still held (hidden_states)
        outs = [a(x, output_hidden_states=True) for _ in range(3)]
        again = a(x)
    assert graph_stats()["eager: the last replay's outputs are still referenced"] >= 3, graph_stats()
    assert torch.equal(outs[2].logits, again.logits)


@requires_sm80
def test_replayed_inference_matches_eager_gpu():
    model = _model("cuda").eval()
    x, _ = _batch(4, "cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        with using_stage_graphs(False):
            want = model(x).logits
        reset_graph_stats()
        got = [model(x).logits for _ in range(3)]
    assert graph_stats()["replays"] == 3 * 2 and graph_stats()["captures"] == 3, graph_stats()
    assert all(torch.equal(g, want) for g in got)


@requires_sm80
def test_inference_stages_read_the_previous_stage_output_in_place_gpu():
    """In inference a stage reads the previous stage's replayed output where it is (no copy);
    alternating inputs, and hidden states kept from an earlier call, stay the eager model's."""
    model = _model("cuda").eval()
    xs = [_batch(4, "cuda", seed)[0] for seed in (1, 2)]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        with using_stage_graphs(False):
            want = [model(x, output_hidden_states=True) for x in xs]
        got = [model(xs[i % 2]).logits for i in range(6)]
        assert all(torch.equal(g, want[i % 2].logits) for i, g in enumerate(got))
        stages = model.cvt.encoder.stages
        assert all(e.producer is not None for s in stages[1:] for e in s._graphs._entries.values())
        kept = model(xs[0], output_hidden_states=True).hidden_states
        reset_graph_stats()
        other = model(xs[1]).logits
        assert torch.equal(other, want[1].logits)
        assert all(torch.equal(k, w) for k, w in zip(kept, want[0].hidden_states, strict=True))
        assert graph_stats()["eager: the last replay's outputs are still referenced"] >= 1, graph_stats()


@requires_sm80
def test_new_shapes_and_moved_parameters_capture_again_gpu():
    model = _model("cuda")
    batches = [_batch(8, "cuda"), _batch(4, "cuda"), _batch(8, "cuda"), _batch(4, "cuda")]
    reset_graph_stats()
    _sgd_steps(model, batches, True)
    assert graph_stats()["captures"] == 6, graph_stats()  # two signatures per stage
    w = model.cvt.encoder.stages[2].layers[0].intermediate.dense.weight
    w.data = w.data.clone()  # a new address: not the captured one
    reset_graph_stats()
    _sgd_steps(model, batches[:1], True)
    assert graph_stats()["eager: a new call signature (captured when it comes again)"] == 1, graph_stats()


@requires_sm80
@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_drop_path_draws_per_replay_gpu(rate):
    """With the parameters fixed, replays of one batch differ only by drop path's draws: new masks
    on each replay (stage 3 at rate 0.5; none at 0), and the batch counts move once per call."""
    model = _model("cuda", drop_path=rate)
    x, y = _batch(8, "cuda")
    _sgd_steps(model, [(x, y)] * 2, True)  # warm, captured
    reset_graph_stats()
    losses = []
    for _ in range(3):
        loss = _loss(model, x, y)
        loss.backward()
        losses.append(float(loss))
    assert graph_stats()["replays"] == 9, graph_stats()
    assert (len(set(losses)) == 3) if rate else (len(set(losses)) == 1), losses
    bn = model.cvt.encoder.stages[2].layers[0].attention.attention.convolution_projection_query \
        .convolution_projection.normalization
    assert int(bn.num_batches_tracked) == 5


@requires_sm80
def test_retained_backward_runs_twice_gpu():
    """retain_graph: a replay's backward runs again (its activations are intact until the next
    forward replay): the gradients add up as the eager model's do."""
    a = _model("cuda")
    b = copy.deepcopy(a)
    x, y = _batch(8, "cuda")
    _sgd_steps(a, [(x, y)] * 2, True)
    _sgd_steps(b, [(x, y)] * 2, False)
    reset_graph_stats()
    for m, on in ((a, True), (b, False)):
        m.zero_grad(set_to_none=True)
        with using_stage_graphs(on):
            loss = _loss(m, x, y)
            loss.backward(retain_graph=True)
            loss.backward()
    assert graph_stats()["replays"] == 3, graph_stats()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa.grad, pb.grad, rtol=2e-3, atol=1e-5), name


@requires_sm80
def test_backward_after_another_replay_or_moved_parameters_raises_gpu():
    model = _model("cuda")
    x, y = _batch(8, "cuda")
    _sgd_steps(model, [(x, y)] * 2, True)
    first = _loss(model, x, y)
    first.backward(retain_graph=True)
    _loss(model, x, y).backward()
    with pytest.raises(RuntimeError, match="replayed again since"):
        first.backward()
    loss = _loss(model, x, y)
    w = model.cvt.encoder.stages[1].layers[0].output.dense.weight
    w.data = w.data.clone()
    with pytest.raises(RuntimeError, match="parameters moved"):
        loss.backward()


@requires_sm80
def test_hooked_parameters_take_the_engine_path_gpu():
    """A hook on one parameter per stage: the replays return the gradients through the autograd
    engine (counted), the hooks run on every backward, and the steps follow those of the model
    whose replays write the gradients directly."""
    from cvt_cutlass.graphs import ENGINE

    a = _model("cuda")
    b, eager = copy.deepcopy(a), copy.deepcopy(a)
    calls = []
    for s in b.cvt.encoder.stages:
        next(s.parameters()).register_hook(lambda g: calls.append(1))
    batches = [_batch(8, "cuda", seed) for seed in range(4)]
    reset_graph_stats()
    la = _sgd_steps(a, batches, True)
    assert ENGINE not in graph_stats() and graph_stats()["replays"] == 9, graph_stats()
    reset_graph_stats()
    lb = _sgd_steps(b, batches, True)
    assert graph_stats()[ENGINE] == 9 and graph_stats()["replays"] == 9, graph_stats()
    assert len(calls) == 3 * 4 and la == lb
    assert lb == pytest.approx(_sgd_steps(eager, batches, False), rel=1e-3)
    for (name, pa), pb, pe in zip(a.named_parameters(), b.parameters(), eager.parameters(), strict=True):
        assert torch.equal(pa, pb) and torch.allclose(pa, pe, rtol=1e-3, atol=1e-5), name


@requires_sm80
def test_channels_last_parameters_train_with_fused_adamw_gpu():
    """A channels-last model under a fused AdamW: the replays' gradients come in the parameters'
    strides (the fused optimizer requires it), and the steps follow the eager ones."""
    a = _model("cuda").to(memory_format=torch.channels_last)
    b = copy.deepcopy(a)
    batches = [_batch(8, "cuda", seed) for seed in range(4)]
    def adamw(ps):
        return torch.optim.AdamW(ps, lr=1e-3, fused=True)

    losses = {on: _sgd_steps(m, batches, on, adamw) for m, on in ((a, True), (b, False))}
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        # AccumulateGrad's layout contract: the parameter's strides where a dimension has size > 1
        same = all(n == 1 or sg == sp for n, sg, sp in zip(pa.shape, pa.grad.stride(), pa.stride(), strict=True))
        assert same and torch.allclose(pa, pb, rtol=1e-3, atol=1e-5), (name, pa.grad.stride(), pa.stride())


@requires_sm80
def test_autograd_grad_of_the_input_leaves_parameter_grads_alone_gpu():
    """torch.autograd.grad with respect to the images through replayed stages: the eager model's
    input gradient, and no parameter's .grad written."""
    a = _model("cuda")
    b = copy.deepcopy(a)
    x, y = _batch(8, "cuda")
    _sgd_steps(a, [(x, y)] * 2, True)
    _sgd_steps(b, [(x, y)] * 2, False)
    got, stats = {}, {}
    for m, on in ((a, True), (b, False)):
        m.zero_grad(set_to_none=True)
        reset_graph_stats()
        with using_stage_graphs(on):
            xi = x.clone().requires_grad_(True)
            got[on] = torch.autograd.grad(_loss(m, xi, y), [xi])[0]
        stats[on] = graph_stats()
        assert all(p.grad is None for p in m.parameters())
    assert stats[True]["replays"] == 2, stats  # stage 1's input now requires grad: a new signature
    assert torch.allclose(got[True], got[False], rtol=2e-3, atol=1e-6)


# ----------------------------------------------------------------------------------- CPU: the parts a capture uses
def test_call_key_names_what_a_capture_bakes_in():
    """The signature changes with what the captured kernels read from the host (BatchNorm eps and
    momentum, drop-path rates, modes, a moved parameter, requires_grad, the stream); momentum=None
    is refused."""
    from cvt_cutlass.graphs import call_key

    model = _model("cpu", drop_path=0.2)
    stage = model.cvt.encoder.stages[2]
    x = torch.randn(2, 64, 16, 16)

    def key():
        why, sig, params = call_key(stage, x, torch.bfloat16, True, 7)
        assert why is None and len(params) == len(list(stage.parameters()))
        return sig

    base = key()
    assert key() == base and call_key(stage, x, torch.bfloat16, True, 8)[1] != base
    bn = stage.layers[0].attention.attention.convolution_projection_key.convolution_projection.normalization
    lay = stage.layers[1]
    w = stage.layers[0].intermediate.dense.weight
    for change, undo in ((lambda: setattr(bn, "eps", 1e-3), lambda: setattr(bn, "eps", 1e-5)),
                         (lambda: setattr(bn, "momentum", 0.2), lambda: setattr(bn, "momentum", 0.1)),
                         (lambda: setattr(lay.drop_path, "drop_prob", 0.3), lambda: setattr(lay.drop_path, "drop_prob",
                                                                                             0.1)),
                         (lambda: lay.drop_path.eval(), lambda: lay.drop_path.train()),
                         (lambda: w.requires_grad_(False), lambda: w.requires_grad_(True))):
        change()
        assert key() != base
        undo()
    w.data = w.data.clone()
    assert key() != base
    bn.momentum = None
    assert "momentum=None" in call_key(stage, x, torch.bfloat16, True, 7)[0]


def test_inference_key_follows_the_folded_weights():
    """In inference the signature names the folded weights, not each parameter. A parameter or
    BatchNorm statistic changed in place, or a train() / eval() round, derives them again into the
    same tensors (a captured graph reads the new values where it reads the old ones): the same
    key, the same handle; a new dtype derives new tensors under a new handle."""
    from cvt_cutlass.graphs import call_key

    model = _model("cpu").eval()
    stage = model.cvt.encoder.stages[2]
    x = torch.randn(2, 64, 16, 16)
    proj = stage.layers[0].attention.attention.convolution_projection_key.convolution_projection
    with torch.no_grad():
        base = call_key(stage, x, torch.float32, False, 7)
        assert base[0] is None and base[2] == []
        w, handle = stage.weights(torch.float32, x.device), stage._handle
        folded = w._dw[id(proj)][0]
        before = folded.clone()
        proj.normalization.running_var.mul_(4.0)  # as the kernels' training forward updates them
        assert call_key(stage, x, torch.float32, False, 7)[1] == base[1]
        assert stage.weights(torch.float32, x.device) is w and w._dw[id(proj)][0] is folded
        torch.testing.assert_close(folded, before / 2)  # 1 / sqrt(var) with var 4x
        proj.normalization.running_var.copy_(torch.full_like(proj.normalization.running_var, 9.0))
        model.train()
        model.eval()
        assert stage.weights(torch.float32, x.device) is w and not torch.equal(folded, before / 2)
        assert stage._handle == handle
        w64 = stage.weights(torch.float64, x.device)
        assert w64 is not w and stage._handle != handle
        assert call_key(stage, x.double(), torch.float64, False, 7)[1][-1] == id(w64)


def test_folded_weights_never_write_a_swapped_out_parameter():
    """A folded tensor that is a parameter's own memory (no cast needed) is not written when the
    parameter moves (`.data` swapped: the old memory may be another model's now): the weights are
    derived anew instead, under a new handle."""
    model = _model("cpu").eval()
    stage = model.cvt.encoder.stages[2]
    lin = stage.layers[0].intermediate.dense
    with torch.no_grad():
        w, handle = stage.weights(torch.float32, torch.device("cpu")), stage._handle
        old = lin.weight.data
        kept = old.clone()
        lin.weight.data = old * 2
        w2 = stage.weights(torch.float32, torch.device("cpu"))
    assert w2 is not w and stage._handle != handle and torch.equal(old, kept)
    assert torch.equal(w2.linear(lin)[0], lin.weight)


def test_leaf_aliases_share_memory_and_are_put_back():
    from cvt_cutlass.graphs import _leaf_aliases

    stage = _model("cpu").cvt.encoder.stages[1]
    real = list(stage.parameters())
    with _leaf_aliases(stage) as aliases:
        now = list(stage.parameters())
        assert all(a is n for a, n in zip(aliases, now, strict=True))
        assert all(a is not r and a.data_ptr() == r.data_ptr() and a.requires_grad == r.requires_grad
                   for a, r in zip(aliases, real, strict=True))
    assert all(a is b for a, b in zip(stage.parameters(), real, strict=True))


def _private():
    import cvt_cutlass.ops  # noqa: F401  (loads the binding)

    return torch.ops.cvt_cutlass_C


def test_stage_grads_hands_out_fresh_copies_or_accumulates_like_accumulate_grad():
    """stage_grads: without assign, fresh copies of the gradients on one buffer in the parameters'
    shapes; with assign, a parameter without a gradient gets such a copy, one with a gradient gets
    its gradient added in place (the same tensor); mismatched lists raise."""
    ps = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5)),
          torch.nn.Parameter(torch.randn(2, 1, 3))]
    grads = [torch.randn(4, 3).t(), torch.randn(5), torch.randn(2, 1, 3)]  # (any strides)
    out = _private().stage_grads(ps, grads, False)
    assert [o.shape for o in out] == [p.shape for p in ps] and all(o.is_contiguous() for o in out)
    assert all(torch.equal(o, g) for o, g in zip(out, grads, strict=True))
    assert out[0].untyped_storage().data_ptr() == out[2].untyped_storage().data_ptr()
    assert all(o.untyped_storage().data_ptr() != g.untyped_storage().data_ptr() for o, g in zip(out, grads, strict=True))
    held = torch.ones(5)
    ps[1].grad = held
    assert _private().stage_grads(ps, grads, True) == []
    assert ps[1].grad is held and torch.equal(held, 1 + grads[1])
    assert torch.equal(ps[0].grad, grads[0]) and torch.equal(ps[2].grad, grads[2])
    assert ps[0].grad.is_contiguous() and ps[0].grad.untyped_storage().data_ptr() != grads[0].untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="3 parameters and 2 gradients"):
        _private().stage_grads(ps, grads[:2], True)
    with pytest.raises(ValueError, match="gradient 1 of shape"):
        _private().stage_grads(ps, [grads[0], torch.randn(4), grads[2]], True)


def test_stage_grads_fill_what_the_backward_asks_for():
    """stage_grads inside a node's backward (as a replay calls it, the parameters not edges of the
    node): backward() fills every parameter, in its own strides (channels-last here);
    torch.autograd.grad and backward(inputs=...) fill none (the README's limit: the engine does not
    reach the parameters through the node)."""
    ps = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4, 2, 3, 3))]
    ps[1].data = ps[1].data.to(memory_format=torch.channels_last)
    grads = [torch.randn(2, 3), torch.randn(4, 2, 3, 3)]

    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, anchor):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            _private().stage_grads(ps, grads, True)
            return g * 2, None

    anchor = torch.zeros(0, requires_grad=True)

    def loss(x):
        return Node.apply(x, anchor).sum()

    x = torch.randn(3, requires_grad=True)
    loss(x).backward()
    assert torch.equal(ps[0].grad, grads[0]) and torch.equal(ps[1].grad, grads[1])
    assert ps[1].grad.stride() == ps[1].stride() and ps[1].grad.is_contiguous(memory_format=torch.channels_last)
    for p in ps:
        p.grad = None
    torch.autograd.grad(loss(x), [x])
    assert ps[0].grad is None and ps[1].grad is None
    loss(x).backward(inputs=[x, ps[1]])
    assert ps[0].grad is None and ps[1].grad is None and x.grad is not None
    assert torch.autograd.grad(loss(x), [x, ps[0]], allow_unused=True)[1] is None
    assert ps[0].grad is None


def test_stage_grads_direct_only_without_hooks():
    """The engine-free path serves parameters nobody hooks; a tensor hook, a post-accumulate hook,
    a hook on the gradient accumulator (as DDP's reducer installs) or a non-leaf send the gradients
    through the engine; a frozen parameter does not matter."""
    direct = _private().stage_grads_direct

    def params():
        return [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]

    ps = params()
    assert direct(ps)
    ps[2].requires_grad_(False)
    assert direct(ps)
    ps[0].register_hook(lambda g: g)
    assert not direct(ps)
    ps = params()
    ps[1].register_post_accumulate_grad_hook(lambda p: None)
    assert not direct(ps)
    ps = params()
    acc = torch.autograd.graph.get_gradient_edge(ps[1]).node
    acc.register_hook(lambda gi, go: None)
    assert not direct(ps)
    assert not direct([torch.randn(4, requires_grad=True) * 2])


def test_data_parallel_replicas_and_fully_sharded_stages_stay_eager():
    from torch.distributed.fsdp import FSDPModule

    from cvt_cutlass.graphs import call_key

    stage = _model("cpu").cvt.encoder.stages[1]
    x = torch.randn(2, 64, 16, 16)
    assert call_key(stage, x, torch.bfloat16, True, 7)[0] is None
    stage._is_replica = True
    assert "DataParallel replica" in call_key(stage, x, torch.bfloat16, True, 7)[0]
    del stage._is_replica
    stage.__class__ = type("FSDPFusedCvtStage", (FSDPModule, type(stage)), {})  # as fully_shard makes it
    assert "FSDP2" in call_key(stage, x, torch.bfloat16, True, 7)[0]
