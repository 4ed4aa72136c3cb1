"""The CvT layer as one op (cvt_layer / cvt_layer_train / cvt_layer_backward, one autograd node
per layer): HF's gradients and running statistics in float64, the op-by-op path's results, what
it does not serve (counted), torch.compile's trace, bad arguments. CPU tests run its C++ body on
the ops' references; GPU tests on the kernels."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from cvt_cutlass import fallback, runtime
from cvt_cutlass.layer import set_layer_op
from cvt_cutlass.swap import swap

from .conftest import requires_sm80
from .test_swap import tiny_cvt

LAYERS = 1 + 2 + 3  # tiny_cvt's depth


@pytest.fixture(autouse=True)
def _layer_op_default():
    yield
    set_layer_op(None)


def _step(model, x, y, seed=5):
    """Loss, gradients and float buffers of one training forward + backward (drop path drawn from ``seed``)."""
    torch.manual_seed(seed)
    loss = F.cross_entropy(model(x).logits.float(), y)
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, [b.detach().clone() for b in model.buffers() if b.dtype.is_floating_point]


def _rel(a, ref, floor) -> float:
    """Relative error, the reference's norm floored (CvT's key biases have zero gradient: softmax
    does not see a shift of every key)."""
    return float((a - ref).norm() / max(float(ref.norm()), floor))


def _data(device, dtype=torch.float32, b=2):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(b, 3, 64, 64, generator=g).to(device, dtype), torch.randint(0, 16, (b,), generator=g).to(device))


def gpu_kernel_specs(cc: int, gpu: str | None) -> list:
    """The kernels this module's GPU tests call (tests/gpu_kernels.py prebuilds them): tiny_cvt's
    training and inference sets at 64x64, both 16-bit dtypes, batches up to 4, with the fp32
    residual stream's variants."""
    from cvt_cutlass import model_kernels

    from .gpu_kernels import default_arch

    cfg = tiny_cvt().config
    arch = default_arch(cc)
    return [s for train in (True, False)
            for s in model_kernels(cfg, 64, ["bf16", "fp16"], arch, training=train, gpu=gpu, max_batch=4,
                                   residual_stream="fp32")]


# ----------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("drop", [0.0, 0.2])
def test_layer_op_is_hf_in_float64(drop):
    """Loss, every gradient and the running statistics of HF's model, with drop path (HF's draws,
    HF's order) and the cls token of the last stage: float64 leaves only rounding."""
    hf = tiny_cvt(drop_path_rate=[0.0, drop, drop]).train().double()
    ours = swap(copy.deepcopy(hf))
    x, y = _data("cpu", torch.float64)
    fallback.reset()
    loss, grads, bufs = _step(ours, x, y)
    st = fallback.stats()
    assert st["layer_paths"] == {} and st["fused_calls"]["cvt_layer"] == LAYERS
    assert st["fused_calls"]["cvt_layer_backward"] == LAYERS
    assert st["library_host_us"] == {}  # no kernel library ran: the CPU references did
    assert set(st["op_host_us"]) == {"cvt_layer", "cvt_layer_backward"}  # host time inside the layer op
    ref_loss, ref_grads, ref_bufs = _step(hf, x, y)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-12)
    worst = max(_rel(grads[n], ref_grads[n], 1e-3) for n in ref_grads)
    assert worst < 1e-10, worst
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-14) for a, b in zip(bufs, ref_bufs, strict=True))


@pytest.mark.parametrize("stream", ["compute", "fp32"])
def test_layer_op_is_the_op_by_op_path(stream):
    """The layer op runs the same ops in the same order as the op-by-op path: same loss, and the same
    gradients up to fp32 rounding (the layer op sums h's q / k / v gradients inside the LayerNorm
    backward, autograd sums them before it: ~3e-6 relative on this model). With an fp32 residual
    stream under bf16 autocast, drop path's scale of the stream's gradient is applied inside the
    layer op (one rounding to bf16 for the GEMMs, the LayerNorm backward scaling the residual's
    rows), autograd's ops apply it one by one: the same up to bf16 rounding."""
    base = tiny_cvt(drop_path_rate=[0.0, 0.3, 0.3]).train()
    x, y = _data("cpu")
    runs = []
    for enabled in (True, False):
        set_layer_op(enabled)
        fallback.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=stream == "fp32"):
            runs.append(_step(swap(copy.deepcopy(base), residual_stream=stream), x, y))
        paths = fallback.stats()["layer_paths"]
        assert paths == ({} if enabled else {"disabled (set_layer_op / CVT_CUTLASS_LAYER_OP=0)": LAYERS})
    set_layer_op(None)
    (l1, g1, b1), (l2, g2, b2) = runs
    assert torch.equal(l1, l2) if stream == "compute" else float(l1) == pytest.approx(float(l2), rel=1e-3)
    assert max(_rel(g1[n], g2[n], 1e-3) for n in g2) < (2e-5 if stream == "compute" else 3e-2)  # bf16: 1.5e-2
    tol = {} if stream == "compute" else {"rtol": 1e-3, "atol": 1e-4}
    assert all(torch.allclose(a, b, **tol) for a, b in zip(b1, b2, strict=True))


def _stage_output_dtypes(model) -> tuple[list, list]:
    """(hooks, the dtypes they record): each stage's output tokens' dtype per forward."""
    seen: list = []
    hooks = [st.register_forward_hook(lambda m, i, o: seen.append(o[0].dtype)) for st in model.cvt.encoder.stages]
    return hooks, seen


class _Geoms(torch.utils._python_dispatch.TorchDispatchMode):
    """The geom argument of every layer-op forward (cvt_layer / cvt_layer_train) below autograd."""

    def __init__(self):
        super().__init__()
        self.geoms = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() in ("cvt_cutlass::cvt_layer", "cvt_cutlass::cvt_layer_train"):
            self.geoms.append(list(args[-1]))
        return func(*args, **(kwargs or {}))


def _rounded_stage_outputs(device: str, b: int = 2, train: bool = True):
    """One bf16-autocast step (training, or an inference forward) of a swapped tiny CvT with an fp32
    residual stream, without and with hidden states asked for (the second positionally): (stage
    output dtypes, loss, gradients, hidden states, the layer ops' geoms) of each."""
    model = swap(tiny_cvt(drop_path_rate=[0.0, 0.0, 0.1]).train(train).to(device), residual_stream="fp32")
    x, y = _data(device, b=b)
    hooks, seen = _stage_output_dtypes(model)
    out = []
    for hidden in (False, True):
        seen.clear()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        with _Geoms() as rec, torch.autocast(device, dtype=torch.bfloat16), torch.set_grad_enabled(train):
            res = model(x, None, hidden) if hidden else model(x)  # (pixel_values, labels, output_hidden_states)
        loss = F.cross_entropy(res.logits.float(), y)
        if train:
            loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((list(seen), loss.detach(), grads, res.hidden_states, rec.geoms))
    for h in hooks:
        h.remove()
    return out


def test_stage_output_rounded_before_the_next_embedding_cpu():
    """An fp32 residual stream under bf16 autocast: a stage before another hands on its output in
    bf16 (the last layer op's fc2 sum rounded once, where HF's autocast rounds it for the next
    embedding conv), the last stage in fp32; with hidden states asked for, every stage keeps fp32
    (HF's dtype) and its values rounded are the rounded outputs. The two steps' loss and gradients
    are the same bits: the next embedding reads the same values, and the 16-bit gradient that comes
    back is what the fp32 one holds."""
    for train in (True, False):
        (d_round, l_round, g_round, _, geoms), (d_keep, l_keep, g_keep, hs, kept) = \
            _rounded_stage_outputs("cpu", train=train)
        assert d_round == [torch.bfloat16, torch.bfloat16, torch.float32]
        assert d_keep == [torch.float32] * 3 and all(h.dtype == torch.float32 for h in hs)
        # the layer op rounds (the last layer of stages 1 and 2: tiny_cvt's layers 1 and 3 of 6)
        assert [len(g) == 7 and g[6] == 1 for g in geoms] == [True, False, True, False, False, False]
        assert all(len(g) == 6 for g in kept)
        assert torch.equal(l_round, l_keep)
        assert g_round.keys() == g_keep.keys() and bool(g_keep) == train
        assert all(torch.equal(g_round[n], g_keep[n]) for n in g_keep), \
            [n for n in g_keep if not torch.equal(g_round[n], g_keep[n])]


def test_stage_output_not_rounded_where_drop_path_scales_it_cpu():
    """A stage whose last layer's output drop path scales in training (HF adds the residual before
    the scale) hands it on in fp32 there, and rounded in eval (no drop path)."""
    model = swap(tiny_cvt(drop_path_rate=[0.0, 0.2, 0.1]), residual_stream="fp32")
    x, _ = _data("cpu")
    hooks, seen = _stage_output_dtypes(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.train()(x)
        model.eval()(x)
    for h in hooks:
        h.remove()
    bf, f32 = torch.bfloat16, torch.float32
    assert seen == [bf, f32, f32, bf, bf, f32]


def test_layer_backward_refuses_a_gradient_of_another_dtype_cpu():
    """cvt_layer_backward checks the output gradient's dtype against the output's: the weights'
    where the output is rounded, x's otherwise."""
    model = swap(tiny_cvt(drop_path_rate=[0.0, 0.0, 0.0]).train(), residual_stream="fp32")
    calls = _recorded_calls(model, True, amp=torch.bfloat16)
    grad, x, weights, saved, da, dout, scalars, geom = calls["cvt_layer_backward"][1]
    op = torch.ops.cvt_cutlass.cvt_layer_backward
    assert x.dtype == grad.dtype == torch.float32 and len(geom) == 6 and dout is None
    op(grad, x, weights, saved, da, dout, scalars, geom)
    with pytest.raises(ValueError, match="the output's dtype is"):
        op(grad.bfloat16(), x, weights, saved, da, dout, scalars, geom)
    with pytest.raises(ValueError, match="the output's dtype is"):
        op(grad, x, weights, saved, da, dout, scalars, list(geom) + [1])


def test_stage_outputs_kept_fp32_outside_a_root_forward_cpu():
    """After a root forward (whose pre-hook lets the stages round), the encoder called on its own
    returns fp32 stage outputs as HF's does (the root's forward hook puts the flag back)."""
    model = swap(tiny_cvt().train(), residual_stream="fp32")
    x, y = _data("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
        hooks, seen = _stage_output_dtypes(model)
        model.cvt(x)
    for h in hooks:
        h.remove()
    assert seen == [torch.float32] * 3


def test_layer_op_rounded_output_cpu():
    """geom's seventh entry: the layer op's output in the weights' dtype (the fp32 sum rounded
    once); refused without an fp32 residual stream or with drop path after the residual."""
    model = swap(tiny_cvt(drop_path_rate=[0.0, 0.0, 0.1]).train(), residual_stream="fp32")
    calls = _recorded_calls(model, True, amp=torch.bfloat16)
    x, weights, running, da, dout, scalars, geom = calls["cvt_layer_train"][1]
    geom = list(geom[:6])
    op = torch.ops.cvt_cutlass.cvt_layer_train
    wide = op(x, weights, [], da, None, scalars, geom)[0]
    rounded = op(x, weights, [], da, None, scalars, geom + [1])[0]
    assert wide.dtype == torch.float32 and rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, wide.to(torch.bfloat16))
    with pytest.raises(ValueError, match="rounded output"):
        op(x.bfloat16(), weights, [], da, None, scalars, geom + [1])
    with pytest.raises(ValueError, match="rounded output"):
        op(x, weights, [], da, torch.ones(x.shape[0] * x.shape[1]), scalars, geom + [1])


def test_unserved_layer_runs_op_by_op_and_is_counted():
    hf = tiny_cvt(qkv_bias=[False, False, False]).train()
    ours = swap(copy.deepcopy(hf))
    x, y = _data("cpu")
    fallback.reset()
    loss, grads, _ = _step(ours, x, y)
    assert fallback.stats()["layer_paths"] == {"qkv_bias=False": LAYERS}
    ref_loss, ref_grads, _ = _step(hf, x, y)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)


def test_layer_op_in_eval_mode_is_the_folded_inference_op():
    hf = tiny_cvt().eval()
    ours = swap(copy.deepcopy(hf))
    x, _ = _data("cpu")
    fallback.reset()
    with torch.no_grad():
        out = ours(x).logits
    st = fallback.stats()
    assert st["layer_paths"] == {} and st["fused_calls"]["cvt_layer"] == LAYERS
    with torch.no_grad():
        torch.testing.assert_close(out, hf(x).logits, rtol=1e-4, atol=1e-4)


def test_layer_op_under_torch_compile_cpu():
    """One graph (fullgraph) through the training op and its backward; the running statistics are
    updated in the graph (functionalized in-place update); the same gradients as eager."""
    base = tiny_cvt(drop_path_rate=[0.0, 0.0, 0.0]).train()
    eager, comp = swap(copy.deepcopy(base)), swap(copy.deepcopy(base))
    x, y = _data("cpu")
    _, g1, b1 = _step(eager, x, y)
    _, g2, b2 = _step(torch.compile(comp, backend="aot_eager", fullgraph=True), x, y)
    assert max(_rel(g2[n], g1[n], 1e-3) for n in g1) < 1e-6
    assert all(torch.allclose(a, b) for a, b in zip(b1, b2, strict=True))


def _whole(g, ref) -> float:
    """Relative error of all the gradients together."""
    diff = torch.cat([(g[n] - ref[n]).flatten() for n in ref])
    return float(diff.norm() / torch.cat([t.flatten() for t in ref.values()]).norm())


def test_parameter_cast_under_torch_compile_cpu():
    """Under autocast the stage's parameters go through cast_params, which decomposes into aten
    views for the compiler (no custom-op output aliasing another): fp32 gradients as accurate as
    eager's against the fp32 step (the two bf16 traces round differently)."""
    import warnings

    base = tiny_cvt(drop_path_rate=[0.0, 0.0, 0.0]).train()
    ref, eager, comp = (swap(copy.deepcopy(base)) for _ in range(3))
    x, y = _data("cpu")
    _, g0, _ = _step(ref, x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, g1, _ = _step(eager, x, y)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, g2, _ = _step(torch.compile(comp, backend="aot_eager", fullgraph=True), x, y)
    assert not [w for w in caught if "alias" in str(w.message)], [str(w.message) for w in caught]
    assert all(g.dtype == torch.float32 for g in g2.values())
    assert 1e-4 < _whole(g1, g0) < 0.02  # bf16 rounding, present
    assert _whole(g2, g0) <= 1.2 * _whole(g1, g0)
    assert max(_rel(g2[n], g0[n], 1e-3) for n in g0) <= 1.5 * max(_rel(g1[n], g0[n], 1e-3) for n in g0)


def test_layer_op_bad_arguments():
    import cvt_cutlass.ops  # noqa: F401

    x = torch.randn(2, 17, 64)
    w = [torch.randn(64)] * 22
    with pytest.raises(ValueError, match="geom takes 6 or 7 ints"):
        torch.ops.cvt_cutlass.cvt_layer(x, w, None, None, [1e-5] * 8, [4, 4, 1, 2, 1])
    with pytest.raises(ValueError, match="x must be"):
        torch.ops.cvt_cutlass.cvt_layer(x, w, None, None, [1e-5] * 8, [4, 4, 0, 2, 1, 2])
    with pytest.raises(ValueError, match="22 weights expected for inference \\(or 7, the first 16 as one buffer\\), "
                                         "got 5"):
        torch.ops.cvt_cutlass.cvt_layer(x, w[:5], None, None, [1e-5] * 8, [4, 4, 1, 2, 1, 2])
    flat = torch.randn(4 * 64 * 64 + 9 * 64 + 256 * 129 + 1)  # one element more than a layer of C 64, fc1 256
    with pytest.raises(ValueError, match="a 1-D buffer of the 16 weights"):
        torch.ops.cvt_cutlass.cvt_layer(x, [flat] + w[:6], None, None, [1e-5] * 8, [4, 4, 1, 2, 1, 2])
    with pytest.raises(ValueError, match="scalars 8 floats"):
        torch.ops.cvt_cutlass.cvt_layer(x, w, None, None, [1e-5] * 9, [4, 4, 1, 2, 1, 2])
    with pytest.raises(ValueError, match="drop path's scales per token row"):  # (B, L), not (B * L,)
        torch.ops.cvt_cutlass.cvt_layer(x, w, torch.ones(2, 17), None, [1e-5] * 8, [4, 4, 1, 2, 1, 2])


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """The first call of each of ``names`` (torch.ops.cvt_cutlass.<name>) below autograd, its
    arguments cloned before the call (the training op updates running statistics in place)."""

    def __init__(self, names):
        super().__init__()
        self.names, self.calls = names, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name().removeprefix("cvt_cutlass::")
        if name in self.names and name not in self.calls:
            clone = lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
            self.calls[name] = (func, torch.utils._pytree.tree_map(clone, args))
        return func(*args, **(kwargs or {}))


def _recorded_calls(model, train: bool, device="cpu", amp=None):
    """The layer ops' arguments as a swapped model calls them (under autocast to ``amp`` if given)."""
    names = ("cvt_layer_train", "cvt_layer_backward") if train else ("cvt_layer",)
    rec = _Recorder(names)
    x, y = _data(device)
    with rec, torch.autocast(device, dtype=amp or torch.bfloat16, enabled=amp is not None):
        if train:
            F.cross_entropy(model(x).logits.float(), y).backward()
        else:
            with torch.no_grad():
                model(x)
    assert set(rec.calls) == set(names), sorted(rec.calls)
    return rec.calls


def _opcheck_all(calls):
    for name, (op, args) in calls.items():
        try:
            torch.library.opcheck(op, args)
        except Exception as e:  # name the op in the failure
            raise AssertionError(f"opcheck {name}: {e}") from e


@pytest.mark.parametrize("train", [True, False])
def test_opcheck_layer_ops_cpu(train):
    """Schema (the running statistics the only mutated arguments), fake kernels against the real
    outputs, autograd registration and AOT dispatch, on the arguments a swapped CvT passes."""
    model = swap(tiny_cvt(drop_path_rate=[0.0, 0.1, 0.1]))
    _opcheck_all(_recorded_calls(model.train() if train else model.eval(), train))


@pytest.mark.parametrize("train", [True, False])
def test_opcheck_layer_ops_fp32_stream_cpu(train):
    """The same with an fp32 residual stream under bf16 autocast (swap(residual_stream="fp32")):
    fp32 tokens with bf16 weights; the fakes give the saved tensors their dtypes (t1 fp32, the
    rest bf16) and the backward fp32 dx."""
    model = swap(tiny_cvt(drop_path_rate=[0.0, 0.1, 0.1]), residual_stream="fp32")
    calls = _recorded_calls(model.train() if train else model.eval(), train, amp=torch.bfloat16)
    name = "cvt_layer_train" if train else "cvt_layer"
    x, weights = calls[name][1][0], calls[name][1][1]
    assert x.dtype == torch.float32 and weights[0].dtype == torch.bfloat16
    _opcheck_all(calls)


def test_opcheck_cast_params_cpu():
    """The training forward's parameter cast: views of one flat buffer, the gradients back in each
    parameter's dtype."""
    import cvt_cutlass.ops  # noqa: F401

    g = torch.Generator().manual_seed(2)
    ps = [torch.randn(4, 3, generator=g, requires_grad=True), torch.randn(5, generator=g, requires_grad=True)]
    torch.library.opcheck(torch.ops.cvt_cutlass.cast_params.default, (ps, torch.bfloat16))
    ws = [torch.randn(8, 1, 3, 3, generator=g, requires_grad=True) for _ in range(3)]
    torch.library.opcheck(torch.ops.cvt_cutlass.depthwise_rsc_params.default, (ws,))


def test_parameter_layout_ops_gradcheck_cpu():
    """float64 gradcheck of the stage's parameter cast and depthwise layout ops (two C++ autograd
    nodes each); a parameter whose outputs got no gradient gets none back."""
    import cvt_cutlass.ops  # noqa: F401

    g = torch.Generator().manual_seed(4)
    ps = [torch.randn(3, 2, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    ws = [torch.randn(4, 1, 3, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    cast = torch.ops.cvt_cutlass.cast_params.default
    rsc = torch.ops.cvt_cutlass.depthwise_rsc_params.default
    assert torch.autograd.gradcheck(lambda *t: tuple(cast(list(t), torch.float64)), ps)
    assert torch.autograd.gradcheck(lambda *t: tuple(rsc(list(t))), ws)
    out = rsc(ws)
    assert out[1].shape == (3, 3, 4) and torch.equal(out[1], ws[1].detach().view(4, 9).t().reshape(3, 3, 4))
    a, b = cast(ps, torch.float32)
    (a.sum() * 0).backward()  # b unused: zeros for it, from the one buffer
    assert ps[1].grad is not None and not ps[1].grad.any()
    x = torch.randn(2, dtype=torch.float64, requires_grad=True)
    (y,) = cast([x], torch.float32)
    assert torch.autograd.grad(y.sum(), x)[0].dtype == torch.float64
    with pytest.raises(ValueError, match="contiguous \\(C, 1, 3, 3\\) weights"):
        rsc([torch.randn(4, 1, 3, 3), torch.randn(5, 1, 3, 3)])


@pytest.mark.parametrize("widths", ["cvt", "odd"])
@pytest.mark.parametrize("layer_op", [True, False])
def test_layer_weights_cast_as_one_buffer_cpu(layer_op, widths):
    """Under autocast each layer's 16 weights are cast into one buffer that the layer op takes
    whole (its gradient one buffer too) and the op-by-op path reads as views: the same loss,
    gradients and running statistics, bitwise, as with every weight cast on its own. Widths of
    12 / 20 / 36 channels put the bf16 weights off 16-byte boundaries in the buffer: the layer op's
    backward then concatenates the gradients instead of writing them in place."""
    from cvt_cutlass.params import set_weight_buffers

    odd = {"embed_dim": [12, 20, 36], "num_heads": [1, 2, 3]} if widths == "odd" else {}
    base = tiny_cvt(drop_path_rate=[0.0, 0.1, 0.1], **odd).train()
    x, y = _data("cpu")
    set_layer_op(layer_op)
    runs, given = [], []
    try:
        for one_buffer in (True, False):
            set_weight_buffers(one_buffer)
            if layer_op:
                calls = _recorded_calls(swap(copy.deepcopy(base)), True, amp=torch.bfloat16)
                given.append(len(calls["cvt_layer_train"][1][1]))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                runs.append(_step(swap(copy.deepcopy(base)), x, y))
    finally:
        set_weight_buffers(True)
    (l1, g1, b1), (l2, g2, b2) = runs
    assert torch.equal(l1, l2)
    assert all(torch.equal(g1[n], g2[n]) for n in g2)
    assert all(torch.equal(a, b) for a, b in zip(b1, b2, strict=True))
    if layer_op:
        assert given == [10, 25]  # one buffer + the projections' 9, or 16 + 9
    else:  # the op-by-op path gets each weight's own view, not a slice of a buffer (whose backward
        assert _slice_backwards(base, x, y, True) == _slice_backwards(base, x, y, False)  # fills a
        # zero gradient the size of the buffer)


def _slice_backwards(base, x, y, one_buffer: bool) -> int:
    """aten::slice_backward calls in a bf16-autocast step of a swapped copy of ``base``."""
    from cvt_cutlass.params import set_weight_buffers

    set_weight_buffers(one_buffer)
    try:
        model = swap(copy.deepcopy(base))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).logits.float(), y)
        with torch.profiler.profile() as prof:
            loss.backward()
    finally:
        set_weight_buffers(True)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::slice_backward")


def test_cast_params_groups_cpu():
    """cast_params' groups: a group of one tensor in its shape, a larger one as one 1-D buffer;
    gradients back through both; groups that do not cover the tensors raise."""
    import cvt_cutlass.ops  # noqa: F401

    cast = torch.ops.cvt_cutlass.cast_params.default
    g = torch.Generator().manual_seed(7)
    ps = [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in ((3, 2), (4,), (2, 2), (5,))]
    a, b, c = cast(ps, torch.float64, [1, 2, 1])
    assert a.shape == (3, 2) and b.shape == (8,) and c.shape == (5,)
    assert torch.equal(b, torch.cat([ps[1], ps[2].flatten()]).detach())
    assert torch.autograd.gradcheck(lambda *t: tuple(cast(list(t), torch.float64, [2, 2])), ps)
    for bad in ([1, 2], [0, 4], [2, 3]):
        with pytest.raises(ValueError, match="groups"):
            cast(ps, torch.float32, bad)
    with pytest.raises(ValueError, match="groups \\[1\\] for no tensors"):
        cast([], torch.float32, [1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_parameter_gradients_are_taken_without_a_copy_cpu(dtype):
    """The gradients the cast and depthwise layout ops hand back have their parameters' layout:
    AccumulateGrad takes them as they are (views of one buffer per op), copying none."""
    import cvt_cutlass.ops  # noqa: F401

    g = torch.Generator().manual_seed(6)
    ws = [torch.randn(8, 1, 3, 3, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]
    ps = [torch.randn(8, 4, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]
    rs = torch.ops.cvt_cutlass.depthwise_rsc_params.default(ws)
    cs = torch.ops.cvt_cutlass.cast_params.default(ps, torch.bfloat16)
    loss = sum(((i + 1) * r.double()).sum() for i, r in enumerate(rs)) + sum((c * c).sum() for c in cs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        loss.backward()
    clones = [e.input_shapes for e in prof.key_averages(group_by_input_shape=True)
              if e.key == "aten::copy_" and e.input_shapes and e.input_shapes[0] in ([8, 1, 3, 3], [8, 4])]
    assert not clones, clones
    for i, w in enumerate(ws):
        assert w.grad.stride() == w.stride() and torch.equal(w.grad, torch.full_like(w, i + 1))
    assert ws[1].grad.data_ptr() == ws[0].grad.data_ptr() + 72 * ws[0].element_size()  # one buffer
    for p, c in zip(ps, cs, strict=True):
        torch.testing.assert_close(p.grad, (2 * c.detach()).to(dtype))


# ----------------------------------------------------------------------------------- GPU
@requires_sm80
@pytest.mark.parametrize("train", [True, False])
def test_opcheck_layer_ops_gpu(train, strict_fallbacks):
    """opcheck on the kernels, with the bf16 arguments a swapped CvT passes under autocast."""
    model = swap(tiny_cvt(drop_path_rate=[0.0, 0.1, 0.1]).cuda())
    _opcheck_all(_recorded_calls(model.train() if train else model.eval(), train, "cuda", torch.bfloat16))


@requires_sm80
@pytest.mark.parametrize("train", [True, False])
def test_opcheck_layer_ops_fp32_stream_gpu(train, strict_fallbacks):
    """opcheck on the kernels with an fp32 residual stream (fp32 tokens, bf16 weights)."""
    model = swap(tiny_cvt(drop_path_rate=[0.0, 0.1, 0.1]).cuda(), residual_stream="fp32")
    _opcheck_all(_recorded_calls(model.train() if train else model.eval(), train, "cuda", torch.bfloat16))


@requires_sm80
@pytest.mark.parametrize("amp,stream", [(torch.bfloat16, "compute"), (torch.float16, "compute"),
                                        (torch.bfloat16, "fp32")])
def test_layer_op_is_the_op_by_op_path_gpu(amp, stream, strict_fallbacks):
    """On the kernels: one training step with the layer op and op by op give the same loss and
    running statistics up to rounding (the layer op applies drop path in the out-projection's and
    fc2's epilogues in fp32, the op-by-op path HF's 16-bit sequence), and gradients as close to
    HF's fp32 step (the layer op also adds the residual gradients inside the LayerNorm backward
    kernel, in fp32, where the op-by-op path adds them in 16-bit): every layer is a layer op. With
    an fp32 residual stream, drop path's scale of the stream's gradient is applied inside the
    LayerNorm backward kernel."""
    base = tiny_cvt(drop_path_rate=[0.0, 0.1, 0.1]).train().cuda()
    x, y = _data("cuda", b=4)
    runs = []
    for enabled in (True, False):
        set_layer_op(enabled)
        fallback.reset()
        with torch.autocast("cuda", dtype=amp):
            runs.append(_step(swap(copy.deepcopy(base), residual_stream=stream), x, y))
        st = fallback.stats()
        if enabled:
            assert st["layer_paths"] == {} and st["fused_calls"]["cvt_layer"] == LAYERS
            # host time inside the kernel libraries, per family, for every family the step launched
            fams = {"gemm", "wgrad", "layernorm", "layernorm_bwd", "attention", "attention_bwd", "dwconv_bn",
                    "dwconv_bn_bwd"}
            assert fams <= set(st["library_host_us"]) and all(v > 0 for v in st["library_host_us"].values())
            # host time inside the layer op's forward and backward, the libraries' time within it
            assert set(st["op_host_us"]) == {"cvt_layer", "cvt_layer_backward"}
            inside = sum(st["library_host_us"][f] for f in fams - {"layernorm"})  # stage LayerNorms run outside
            assert sum(st["op_host_us"].values()) > 0.5 * inside
    (l1, g1, b1), (l2, g2, b2) = runs
    torch.testing.assert_close(l1, l2, rtol=1e-2, atol=1e-3)
    assert all(torch.allclose(a, b, rtol=1e-2, atol=1e-3) for a, b in zip(b1, b2, strict=True))
    fallback.set_strict(None)  # the fp32 reference is HF's own model
    _, g0, _ = _step(copy.deepcopy(base), x, y)
    e_layer, e_ops = _whole(g1, g0), _whole(g2, g0)
    assert e_layer <= 1.1 * e_ops + 1e-4, (e_layer, e_ops)
    worst_layer, worst_ops = (max(_rel(g[n], g0[n], 1e-3) for n in g0) for g in (g1, g2))
    assert worst_layer <= 1.5 * worst_ops + 1e-3, (worst_layer, worst_ops)  # per tensor, not only the sum


@requires_sm80
def test_stage_output_rounded_before_the_next_embedding_gpu(strict_fallbacks):
    """The same on the kernels (_rf32in fc2, _xf32r16 LayerNorm backward): the dtypes, the loss and
    gradients of the two steps equal but for the last bits (a 16-bit and an fp32 output gradient
    take different weight-gradient paths: their row sums run in another order)."""
    (d_round, l_round, g_round, _, _), (d_keep, l_keep, g_keep, _, _) = _rounded_stage_outputs("cuda", b=4)
    assert d_round == [torch.bfloat16, torch.bfloat16, torch.float32] and d_keep == [torch.float32] * 3
    torch.testing.assert_close(l_round, l_keep, rtol=1e-5, atol=1e-6)
    assert _whole(g_round, g_keep) < 1e-3, _whole(g_round, g_keep)
    assert fallback.stats()["fallbacks"] == {}


def _assert_same_step(run1, run2) -> None:
    """Two _step results bit for bit equal: loss, float buffers, every gradient."""
    (l1, g1, b1), (l2, g2, b2) = run1, run2
    assert torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(b1, b2, strict=True))
    assert g1.keys() == g2.keys() and all(torch.equal(g1[n], g2[n]) for n in g1), \
        [n for n in g1 if not torch.equal(g1[n], g2[n])]


def _kernel_launches(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset")))


@requires_sm80
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_deferred_column_sums_are_the_immediate_ones_gpu(amp, strict_fallbacks):
    """The layer op's backward sums its kernels' partial weight / bias gradients (wgrad, the fc1
    bias in fc2's dgrad, LayerNorm, depthwise conv) in one launch at its end: bit for bit the
    gradients of summing each where it is launched, with fewer launches per layer."""
    base = tiny_cvt(drop_path_rate=[0.0, 0.1, 0.1]).train().cuda()
    x, y = _data("cuda", b=4)
    runs, launches = [], []
    for deferred in (True, False):
        prev = runtime.set_deferred_sums(deferred)
        try:
            model = swap(copy.deepcopy(base))
            with torch.autocast("cuda", dtype=amp):
                _step(model, x, y)  # plans and kernels made
                model.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x).logits.float(), y)
                launches.append(_kernel_launches(loss.backward))
                model.zero_grad(set_to_none=True)
                runs.append(_step(model, x, y))
        finally:
            runtime.set_deferred_sums(prev)
    _assert_same_step(*runs)
    assert launches[0] <= launches[1] - 4 * LAYERS, launches  # >= 4 sums per layer in one launch


def test_side_stream_setting_cpu():
    """The side stream's groups: CVT_CUTLASS_SIDE_STREAM's forms, set_side_stream's round trip
    (bool, names, a comma-separated string) and its refusal of an unknown name."""
    groups = runtime.side_stream_groups
    everything = frozenset(runtime.SIDE_GROUPS)
    assert groups("") == groups("1") == groups("true") == everything
    assert groups("0") == groups("false") == groups(" off ") == frozenset()
    assert groups("qkv, fc1") == {"qkv", "fc1"}
    for bad, why in (("qkv,fc3", "unknown group"), (",", "names no group"), ("QKV", "unknown group")):
        with pytest.raises(ValueError, match=why):
            groups(bad)
    prev = runtime.set_side_stream(False)
    try:
        assert runtime.set_side_stream("out,qkv") == frozenset()
        assert runtime.set_side_stream(["fc1"]) == {"out", "qkv"}
        assert runtime.set_side_stream(True) == {"fc1"}
        assert runtime.set_side_stream(prev) == everything
        with pytest.raises(ValueError, match="unknown side-stream group"):
            runtime.set_side_stream(["attention"])
    finally:
        runtime.set_side_stream(prev)
    # the variable takes effect when the binding loads (a fresh process; the binding is built)
    code = "from cvt_cutlass import runtime; runtime.ensure_binding(); print(sorted(runtime.set_side_stream(True)))"
    env = {**os.environ, "CVT_CUTLASS_SIDE_STREAM": "qkv,out"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("['out', 'qkv']"), out.stdout + out.stderr


def _kernel_streams(fn) -> dict[str, set[int]]:
    """{kernel name: the streams it ran on} of what fn launched."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict[str, set[int]] = {}
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA and not e.name().startswith(("Memcpy", "Memset")):
            out.setdefault(e.name(), set()).add(e.device_resource_id())
    return out


@requires_sm80
@pytest.mark.parametrize("stage_graphs,stream", [(False, "fp32"), (True, "fp32"), (False, "compute")])
def test_side_stream_weight_gradients_gpu(stage_graphs, stream, strict_fallbacks):
    """The layer op's backward launches its Linear weight gradients on a second stream (the
    default): the loss, gradients and running statistics bit for bit those of one stream, eagerly
    and replayed from the stage graphs (the fork and join captured), on the fp32 residual stream and
    the 16-bit one (whose out-projection and fc2 weight gradients go beside where there is no drop
    path); eagerly, the backward's kernels on two streams (the LayerNorm backward's on one of
    them), on one with it off."""
    from cvt_cutlass.graphs import graph_stats, reset_graph_stats, using_stage_graphs

    base = tiny_cvt(drop_path_rate=[0.0, 0.1, 0.1]).train().cuda()
    x, y = _data("cuda", b=4)
    runs, streams, stats = [], [], []
    for side in (True, False):
        prev = runtime.set_side_stream(side)
        reset_graph_stats()
        try:
            model = swap(copy.deepcopy(base), residual_stream=stream)
            with torch.autocast("cuda", dtype=torch.bfloat16), using_stage_graphs(stage_graphs):
                for _ in range(3):  # plans and kernels made; the stage graphs captured and replayed
                    _step(model, x, y)
                    model.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x).logits.float(), y)
                streams.append(_kernel_streams(loss.backward))
                model.zero_grad(set_to_none=True)
                runs.append(_step(model, x, y))
            stats.append(graph_stats())
        finally:
            runtime.set_side_stream(prev)
    _assert_same_step(*runs)
    if stage_graphs:  # replayed (a capture that failed would have run the stages eagerly, counted so)
        assert all(st.get("replays", 0) > 0 and not any("capture failed" in k for k in st) for st in stats), stats
        return  # (a replayed graph's kernels run on the streams the driver picks for its branches)
    ln = {s for n, ids in streams[0].items() if "ln_bwd" in n for s in ids}
    assert len(ln) == 1 and len({s for ids in streams[0].values() for s in ids}) == 2, streams[0]
    assert len({s for ids in streams[1].values() for s in ids}) == 1, streams[1]


@requires_sm80
def test_profiler_names_the_kernel_parts_gpu(strict_fallbacks):
    """Under the torch profiler, the device time of a training step's kernel-library launches is
    attributed to scopes named by the kernels' op and pass (cvt_kernel::<op>_<pass>), the parts
    .ci/train_profile.py tabulates; the layer ops' own entries keep almost none."""
    model = swap(tiny_cvt(drop_path_rate=[0.0, 0.1, 0.1]).train().cuda())
    x, y = _data("cuda", b=4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _step(model, x, y)  # plans and kernels made
        model.zero_grad(set_to_none=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            _step(model, x, y)
            torch.cuda.synchronize()
    dev = {e.key: e.self_device_time_total for e in prof.key_averages()
           if e.device_type == torch.autograd.DeviceType.CPU and e.self_device_time_total > 0}
    want = {"cvt_kernel::" + p for p in ("linear_fwd", "linear_dgrad", "linear_wgrad", "layernorm_fwd",
                                         "layernorm_bwd", "dwconv_fwd", "dwconv_bwd", "attention_fwd",
                                         "attention_bwd", "conv2d_fwd", "colsum_flush")}
    assert want <= dev.keys(), sorted(want - dev.keys())
    layer_ops = sum(v for k, v in dev.items() if k.startswith("cvt_cutlass::cvt_layer"))
    parts = sum(v for k, v in dev.items() if k.startswith("cvt_kernel::"))
    assert layer_ops <= 0.05 * parts, (layer_ops, parts)


@requires_sm80
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_layer_weights_cast_as_one_buffer_gpu(amp, strict_fallbacks):
    """On the kernels: the layer op's weight gradients written into views of one buffer (wgrad,
    fc2's dgrad and the LayerNorm backward writing there, their column sums deferred) are bit for
    bit those of the weights cast one by one."""
    from cvt_cutlass.params import set_weight_buffers

    base = tiny_cvt(drop_path_rate=[0.0, 0.1, 0.1]).train().cuda()
    x, y = _data("cuda", b=4)
    runs = []
    try:
        for one_buffer in (True, False):
            set_weight_buffers(one_buffer)
            with torch.autocast("cuda", dtype=amp):
                runs.append(_step(swap(copy.deepcopy(base)), x, y))
    finally:
        set_weight_buffers(True)
    _assert_same_step(*runs)


@requires_sm80
def test_layer_op_inference_gpu(strict_fallbacks):
    base = tiny_cvt().eval().cuda().half()
    x, _ = _data("cuda", torch.float16, b=3)
    outs = []
    for enabled in (True, False):
        set_layer_op(enabled)
        with torch.no_grad():
            outs.append(swap(copy.deepcopy(base))(x).logits)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype,branch", [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
                                          (torch.float32, torch.bfloat16), (torch.float32, torch.float16)])
def test_stage_drop_masks_are_the_per_layer_draws(dtype, branch):
    """The per-row drop-path scales a stage draws up front for its layers (one batched add / floor
    / scale / row expansion) are the bits of HF's per-layer draws, mask / keep in fp32 per token
    row, in the same order (HF's): attention branch, then output; with an fp32 residual stream
    under autocast (``branch``) the attention branch's draw is in autocast's dtype, as HF's is."""
    from cvt_cutlass.layer import drop_mask, stage_drop_masks

    layers = tiny_cvt(drop_path_rate=[0.0, 0.1, 0.3]).train().cvt.encoder.stages[2].layers
    for lay, p in zip(layers, (0.1, 0.0, 0.3), strict=True):  # a rate per layer, one layer without
        lay.drop_path.drop_prob = p
    x = torch.randn(64, 5, 8).to(dtype)
    xa = x if branch is None else x.to(branch)
    torch.manual_seed(3)
    want = []
    for lay in layers:
        keep = 1 - lay.drop_path.drop_prob
        draws = drop_mask(xa, lay.drop_path), drop_mask(x, lay.drop_path)
        want.append(tuple(None if m is None else (m.float() * (1 / keep)).expand(64, 5, 1).reshape(-1)
                          for m in draws))
    torch.manual_seed(3)
    got = stage_drop_masks(layers, x, branch)
    assert got[1] == (None, None) and want[1] == (None, None)
    for (a, o), (wa, wo) in zip(got[::2], want[::2], strict=True):
        assert a.dtype == o.dtype == torch.float32 and a.shape == o.shape == (64 * 5,)
        assert torch.equal(a, wa) and torch.equal(o, wo)
    assert 0 < int((got[-1][0] > 0).sum()) < 64 * 5  # some rows dropped, some kept
    assert stage_drop_masks(tiny_cvt().eval().cvt.encoder.stages[2].layers, x) is None


def test_activation_checkpointing_recomputes_the_layers_cpu():
    """HF's gradient_checkpointing_enable() on a swapped CvT (HF's own CvT refuses it): the layers
    run under torch.utils.checkpoint, the gradients and running statistics are those of the run
    without it (the recompute updates no running statistics, drop-path masks and all), each layer
    op runs its forward twice, and gradient_checkpointing_disable() / unswap undo it."""
    from cvt_cutlass.swap import unswap

    base = tiny_cvt(drop_path_rate=[0.0, 0.1, 0.2]).train().double()
    # transformers 5 names it activation_checkpointing_*, keeping gradient_checkpointing_* as aliases
    w = "activation" if hasattr(base, "activation_checkpointing_enable") else "gradient"
    enable, disable, is_on = f"{w}_checkpointing_enable", f"{w}_checkpointing_disable", f"is_{w}_checkpointing"
    with pytest.raises(ValueError, match="does not support|not support"):
        getattr(copy.deepcopy(base), enable)()
    x, y = _data("cpu", torch.float64)
    runs = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = swap(copy.deepcopy(base))
        if ckpt:
            getattr(model, enable)()
            assert getattr(model, is_on)
        fallback.reset()
        runs.append(_step(model, x, y))
        assert fallback.stats()["fused_calls"]["cvt_layer"] == LAYERS * (2 if ckpt else 1)
        assert fallback.stats()["fused_calls"]["cvt_layer_backward"] == LAYERS
    (l1, g1, b1), (l2, g2, b2) = runs
    assert torch.equal(l1, l2)
    assert max(_rel(g1[n], g2[n], 1e-3) for n in g1) < 1e-12
    assert all(torch.equal(a, b) for a, b in zip(b1, b2, strict=True))
    getattr(model, enable)(**{f"{w}_checkpointing_kwargs": {"use_reentrant": True}})
    with pytest.raises(ValueError, match="non-reentrantly"):
        model(x)
    getattr(model, disable)()
    assert not getattr(model, is_on)
    unswap(model)
    assert "supports_gradient_checkpointing" not in model.__dict__


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_compiled_training_steps_keep_one_graph_cpu(amp):
    """torch.compile of a swapped CvT training with drop path, with and without autocast: one graph
    over several steps (no recompile: nothing the first traced step caches is guarded on), no graph
    break (the stages ask whether autocast is on in a way Dynamo traces)."""
    import contextlib

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = torch.compile(swap(tiny_cvt(drop_path_rate=[0.0, 0.1, 0.2]).train()), backend="aot_eager")
    x, y = _data("cpu")
    for seed in range(3):
        with torch.autocast("cpu", dtype=amp) if amp else contextlib.nullcontext():
            _step(model, x, y, seed)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
