"""cvt_cutlass.swap / unswap on HF CvT models: CPU and GPU.

CPU: the swapped tree (same parameter objects, same state_dict), unswap identity, the fused
stage's math (BatchNorm folding, cls token, residuals, LayerNorms) through the ops' PyTorch
fallbacks against HF's forward, visible fallbacks (training, autograd, unsupported configs),
weights re-derived when parameters change, filter_fn.
GPU: logits of swapped vs unswapped models for CvT-13 / CvT-21 at 224 and a W24-shaped config
(reduced depth) at 384, batch 1/3/64, fp16/bf16: SQNR >= 40 dB against the fp32 model and no
more than 3 dB below the unswapped model in the same dtype; every kernel op on CUTLASS (strict).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import CvtConfig, CvtForImageClassification, CvtModel  # noqa: E402

from cvt_cutlass import fallback  # noqa: E402
from cvt_cutlass.checkpoint import randomize_norms  # noqa: E402
from cvt_cutlass.swap import FusedCvtStage, FusedHeadLayerNorm, FusedHeadLinear, is_swapped, swap, unswap  # noqa: E402
from cvt_cutlass.tools.compare import sqnr_db  # noqa: E402

from .conftest import requires_sm80  # noqa: E402
from .gpu_kernels import default_arch  # noqa: E402


def _randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-trivial BatchNorm statistics, LayerNorm affines and cls tokens, so that folding and
    normalisation are really tested (fresh HF modules have mean 0, var 1, weight 1, bias 0)."""
    g = torch.Generator().manual_seed(seed)
    randomize_norms(model, g, bn_affine=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("cls_token"):
                p.copy_(torch.randn(p.shape, generator=g))


def tiny_cvt(cls=CvtForImageClassification, depth=(1, 2, 3), **kw) -> torch.nn.Module:
    cfg = CvtConfig(depth=depth, num_labels=16, **kw)
    torch.manual_seed(0)
    m = cls(cfg).eval()
    _randomize(m)
    return m


def _images(b: int, size: int, seed: int = 1, device="cpu", dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 3, size, size, generator=g).to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------------- CPU
def test_swap_structure_and_unswap_identity():
    model = tiny_cvt()
    stages = list(model.cvt.encoder.stages)
    head = (model.layernorm, model.classifier)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    text = repr(model)
    assert swap(model) is model and is_swapped(model)
    assert all(isinstance(s, FusedCvtStage) for s in model.cvt.encoder.stages)
    # the fused stages hold the original submodules and parameters under the original names
    assert [id(p) for p in model.parameters()] == params
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert model.cvt.encoder.stages[2].cls_token is stages[2].cls_token
    assert isinstance(model.layernorm, FusedHeadLayerNorm) and isinstance(model.classifier, FusedHeadLinear)
    assert model.classifier.weight is head[1].weight and model.layernorm.bias is head[0].bias
    swap(model)  # again: nothing more to swap
    assert all(isinstance(s, FusedCvtStage) for s in model.cvt.encoder.stages)
    assert unswap(model) is model and not is_swapped(model)
    assert all(a is b for a, b in zip(model.cvt.encoder.stages, stages, strict=True))
    assert (model.layernorm, model.classifier) == head
    assert repr(model) == text and [id(p) for p in model.parameters()] == params


def test_swap_accepts_cvt_model_and_filter_fn():
    model = tiny_cvt(CvtModel)
    swap(model, filter_fn=lambda path, stage: path.endswith(".2"))
    kinds = [type(s).__name__ for s in model.encoder.stages]
    assert kinds == ["CvtStage", "CvtStage", "FusedCvtStage"]
    unswap(model)
    with pytest.raises(TypeError, match="CvtForImageClassification"):
        swap(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("size", [64, 72])
def test_fused_math_matches_hf_on_cpu(size, counted_fallbacks):
    """The fused stages (folded BN, cls row, residual epilogues, LayerNorms) through the ops'
    CPU references give HF's logits; each op counts its fallback (CPU tensors)."""
    model = tiny_cvt()
    x = _images(2, size)
    with torch.no_grad():
        ref = model(x).logits
        swap(model)
        out = model(x).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    st = counted_fallbacks.stats()
    layers = 1 + 2 + 3  # (HF needs depth[i] > i: it indexes drop-path rates by stage)
    assert st["fallbacks"]["linear:device"] == 6 * layers + 1  # + the classifier
    assert st["fallbacks"]["dwconv_tokens:device"] == 3 * layers
    assert st["fallbacks"]["attention:device"] == layers and st["fallbacks"]["conv2d_nhwc:device"] == 3
    # embeddings (the cls token written in front by stage 3's), two per block, the head's
    assert st["fallbacks"]["layer_norm_tokens:device"] == 3 + 2 * layers + 1
    assert not any(k.startswith("swap:") for k in st["fallbacks"])


def test_training_and_autograd_run_the_differentiable_path(counted_fallbacks):
    """Eval with autograd recording and train mode run the fused stage's differentiable path (not
    HF's forward): no swap:* fallbacks, gradients reach every stage (tests/test_swap_train.py
    checks them against HF's)."""
    model = tiny_cvt()
    x = _images(2, 64)
    with torch.no_grad():
        ref = model(x).logits
    swap(model)
    out = model(x).logits  # eval, autograd recording: folded BatchNorm, differentiable
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert out.requires_grad
    model.train()
    model(x).logits.sum().backward()
    assert not any(k.startswith("swap:") for k in counted_fallbacks.stats()["fallbacks"])
    assert model.cvt.encoder.stages[0].embedding.convolution_embeddings.projection.weight.grad is not None
    fallback.set_strict(True)
    with pytest.raises(fallback.FallbackError, match="device"):
        model(x)  # on CPU every op is a (strict: refused) fallback


def test_parameters_converted_under_inference_mode(counted_fallbacks):
    """Parameters cast inside torch.inference_mode() are inference tensors without version
    counters; the fused stage still derives (and caches) its weights from them."""
    model = tiny_cvt()
    x = _images(1, 64)
    with torch.inference_mode():
        ref = model(x).logits
        model.to(torch.float64)
        swap(model)
        out = model(x.double()).logits
        stage = model.cvt.encoder.stages[0]
        assert stage._weights.dtype == torch.float64 and stage._weights.embed(None, 4)[0].dtype == torch.float64
        assert torch.equal(model(x.double()).logits, out)
    torch.testing.assert_close(out.float(), ref, rtol=1e-4, atol=1e-4)


def test_unsupported_config_falls_back(counted_fallbacks):
    model = tiny_cvt(padding_kv=(1, 0, 1))  # stage 1: k/v conv without "same" padding
    x = _images(1, 64)
    with torch.no_grad():
        ref = model(x).logits
        swap(model)
        out = model(x).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert counted_fallbacks.stats()["fallbacks"]["swap:config"] == 1


def test_images_with_another_channel_count_raise_as_hf_does(counted_fallbacks):
    """A 3-channel model fed 1, 2, 4 or 5 channels raises (the stem pads to 4 channels inside: a
    4-channel image must not pass as already padded), as HF's conv does; 3 channels run."""
    model = tiny_cvt()
    hf = copy.deepcopy(model)
    swap(model)
    with torch.no_grad():
        for c in (1, 2, 4, 5):
            x = torch.randn(2, c, 64, 64)
            with pytest.raises(RuntimeError):
                hf(x)
            with pytest.raises(RuntimeError, match=r"expects input \(N, 3, H, W\)"):
                model(x)
        torch.testing.assert_close(model(_images(2, 64)).logits, hf(_images(2, 64)).logits, rtol=1e-4, atol=1e-4)


def test_batchnorms_without_running_statistics_or_affines_in_eval(counted_fallbacks):
    """Eval without autograd folds BatchNorm into the depthwise weights: a BatchNorm without affine
    weights folds with weight 1 and bias 0; one without running statistics (it normalizes with the
    batch's, as HF's does) runs its stage as HF's module, counted, also after folded weights were
    derived; with autograd recording both run the fused path."""
    x = _images(2, 64)
    for affine, tracked in ((False, True), (True, False)):
        model = tiny_cvt()
        for mod in list(model.modules()):
            for name, bn in list(mod.named_children()):
                if isinstance(bn, torch.nn.BatchNorm2d):
                    new = torch.nn.BatchNorm2d(bn.num_features, affine=affine).eval()
                    new.load_state_dict({k: v for k, v in bn.state_dict().items() if affine or k.startswith("running")
                                         or k == "num_batches_tracked"})
                    setattr(mod, name, new)
        hf = copy.deepcopy(model)
        swap(model)
        with torch.no_grad():
            model(x)  # folded weights derived with the running statistics
        if not tracked:
            for m in (*model.modules(), *hf.modules()):
                if isinstance(m, torch.nn.BatchNorm2d):
                    m.track_running_stats, m.running_mean, m.running_var, m.num_batches_tracked = False, None, None, None
        counted_fallbacks.reset()
        with torch.no_grad():
            torch.testing.assert_close(model(x).logits, hf(x).logits, rtol=1e-4, atol=1e-4)
        assert counted_fallbacks.stats()["fallbacks"].get("swap:batchnorm", 0) == (0 if tracked else 3)
        torch.testing.assert_close(model(x).logits, hf(x).logits, rtol=1e-4, atol=1e-4)  # autograd records


def test_weights_follow_parameter_changes(counted_fallbacks):
    """Folded weights are derived from the live parameters: an in-place update (e.g. loading a
    checkpoint after swap) or new BatchNorm statistics show up in the next forward."""
    model = tiny_cvt()
    x = _images(1, 64)
    swap(model)
    with torch.no_grad():
        model(x)
        _randomize(model, seed=5)
        model.cvt.encoder.stages[2].layers[2].intermediate.dense.weight.mul_(1.5)
        out = model(x).logits
        w = model.cvt.encoder.stages[1].layers[0].output.dense.weight
        w.data = w.data * 0.5  # a new data pointer, the same version counter
        out_swapped = model(x).logits
        unswap(model)
        ref = model(x).logits
        w.data = w.data * 2.0
        ref_before = model(x).logits
    torch.testing.assert_close(out, ref_before, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out_swapped, ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ref, ref_before)


# ----------------------------------------------------------------------------------- GPU
_GPU_MODELS = {
    "cvt-13": (dict(), 224),
    "cvt-21": (dict(depth=(1, 4, 16)), 224),
    # W24's widths and heads, reduced depth
    "w24-shaped": (dict(embed_dim=(192, 768, 1024), num_heads=(3, 12, 16), depth=(1, 2, 3)), 384),
}
GPU_BATCHES = [1, 3, 64]
_COMPILE_CONFIG = dict(depth=(1, 2, 3), num_labels=16)  # test_swapped_model_under_torch_compile_gpu, batch 2


def gpu_kernel_specs(cc: int, gpu: str | None) -> list:
    """The kernels the swapped models of this module's GPU tests call on a device (cc, gpu), for
    tests/gpu_kernels.py to prebuild: cvt_cutlass.model_kernels of each model (default path),
    over every batch up to the largest tested (a superset of the tested batches' choices)."""
    from cvt_cutlass import model_kernels

    arch = default_arch(cc)
    out = []
    for kw, size in _GPU_MODELS.values():
        out += model_kernels(CvtConfig(num_labels=1000, **kw), size, ["fp16", "bf16"], arch, gpu=gpu,
                             max_batch=max(GPU_BATCHES))
    out += model_kernels(CvtConfig(**_COMPILE_CONFIG), 224, "fp16", arch, gpu=gpu)  # every batch size
    return out


@requires_sm80
@pytest.mark.parametrize("batch", GPU_BATCHES)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", list(_GPU_MODELS))
def test_swapped_logits_gpu(name, dtype, batch, strict_fallbacks):
    kw, size = _GPU_MODELS[name]
    cfg = CvtConfig(num_labels=1000, **kw)
    torch.manual_seed(0)
    model = CvtForImageClassification(cfg).eval()
    _randomize(model)
    model.cuda()
    x = _images(batch, size, device="cuda")
    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    with torch.inference_mode():
        ref = model(x).logits.float()
        model.to(tdt)
        same = model(x.to(tdt)).logits.float()
        swap(model)
        out = model(x.to(tdt)).logits.float()
    st = fallback.stats()
    assert st["kernel_calls"]["attention"] == sum(cfg.depth)
    # every LayerNorm on the kernel (3 embeddings, 2 per block, the head's); the classifier too
    assert st["kernel_calls"]["layer_norm_tokens"] == 3 + 2 * sum(cfg.depth) + 1
    assert st["kernel_calls"]["linear"] == 6 * sum(cfg.depth) + 1
    s_out, s_same = sqnr_db(out, ref), sqnr_db(same, ref)
    assert s_out >= s_same - 3, (s_out, s_same)
    # The absolute bar holds wherever the unswapped model in the same dtype reaches it: with bf16's
    # 8-bit mantissa through CvT-21's 21 blocks HF's own bf16 logits measure 39.3-39.6 dB on this
    # random model (H200, run S2), and the swapped ones 39.4-39.7 dB.
    assert s_out >= 40 or s_same < 40, (s_out, s_same)


@requires_sm80
def test_swapped_model_under_torch_compile_gpu(strict_fallbacks):
    """torch.compile traces the custom ops (no graph break at them) and gives the eager logits."""
    model = CvtForImageClassification(CvtConfig(**_COMPILE_CONFIG)).eval().cuda().half()
    swap(model)
    x = _images(2, 224, device="cuda", dtype=torch.float16)
    with torch.inference_mode():
        eager = model(x).logits
        explained = torch._dynamo.explain(model)(x)
        assert explained.graph_break_count == 0, explained.break_reasons
        compiled = torch.compile(model, fullgraph=True)(x).logits
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)


def test_swapped_model_traces_without_graph_breaks(counted_fallbacks):
    """torch.compile captures the whole swapped forward in one graph (fullgraph: a break at a
    custom op or in the fused stage's Python would raise); eager backend, CPU."""
    model = tiny_cvt()
    x = _images(2, 64)
    with torch.no_grad():
        ref = model(x).logits
        swap(model)
        model(x)  # derives the fused weights eagerly
        out = torch.compile(model, backend="eager", fullgraph=True)(x).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@requires_sm80
def test_new_batch_sizes_build_nothing_gpu(strict_fallbacks, monkeypatch):
    """The first forward builds (in parallel) every kernel the model calls at any batch size; after
    it, other batch sizes run on the kernels without compiling anything."""
    from cvt_cutlass import build

    model = CvtForImageClassification(CvtConfig(**_COMPILE_CONFIG)).eval().cuda().half()
    swap(model)
    with torch.inference_mode():
        model(_images(2, 224, device="cuda", dtype=torch.float16))

    def refuse(job, nvcc):
        raise AssertionError(f"built {job.name} at a new batch size")

    monkeypatch.setattr(build, "_compile_one", refuse)
    with torch.inference_mode():
        for b in (1, 5, 64, 300):
            assert model(_images(b, 224, device="cuda", dtype=torch.float16)).logits.shape == (b, 16)


def _compiled_graphs_for_batch_sizes(size: int, device: str, dtype: torch.dtype, backend: str) -> None:
    """torch.compile(swapped): no graph break at the ops (also outside inference mode), the batch
    dimension dynamic: one graph for every batch size >= 2 and one for batch 1."""
    from torch._dynamo.utils import counters

    model = swap(CvtForImageClassification(CvtConfig(**_COMPILE_CONFIG)).eval().to(device, dtype))
    x = _images(2, size, device=device, dtype=dtype)
    with torch.no_grad():
        eager = model(x).logits
        explained = torch._dynamo.explain(model)(x)
        assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    graphs = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        # Every call feeds inference tensors: a tensor made outside inference mode has other
        # dispatch keys, which dynamo guards on (it would compile one more graph for it).
        torch.testing.assert_close(compiled(x.clone()).logits, eager, rtol=2e-2, atol=2e-2)
        for b in (4, 33, 1, 7, 1):
            assert compiled(_images(b, size, device=device, dtype=dtype)).logits.shape == (b, 16)
    assert counters["stats"]["unique_graphs"] - graphs == 2


def test_compiled_swapped_model_keeps_one_graph_for_batch_sizes():
    """The same on CPU (the ops' counted fallbacks run; dynamo's eager backend): the graph
    structure, guards and dynamic batch dimension are the GPU's."""
    _compiled_graphs_for_batch_sizes(64, "cpu", torch.float32, "eager")


@requires_sm80
def test_compiled_swapped_model_keeps_one_graph_for_batch_sizes_gpu(strict_fallbacks):
    _compiled_graphs_for_batch_sizes(224, "cuda", torch.float16, "inductor")


def test_copies_derive_their_own_weights_and_unswapped_models_are_freed():
    """A deepcopy of a swapped model watches its own tensors (a load_state_dict into the copy is
    seen); a swapped stage keeps no parameter alive once the model is gone."""
    import copy
    import gc
    import weakref

    model = tiny_cvt()
    swap(model)
    stage = model.cvt.encoder.stages[2]
    with torch.no_grad():
        w = stage.weights(torch.float32, torch.device("cpu"))
        twin = copy.deepcopy(model)
        twin.load_state_dict({k: v + 1 for k, v in model.state_dict().items() if v.is_floating_point()}, strict=False)
        twin_stage = twin.cvt.encoder.stages[2]
        w2 = twin_stage.weights(torch.float32, torch.device("cpu"))
        q, q2 = (s.layers[0].attention.attention.projection_query for s in (stage, twin_stage))
        assert not torch.equal(w2.linear(q2)[0], w.linear(q)[0])
        assert stage.weights(torch.float32, torch.device("cpu")) is w  # the original is unchanged
    p = weakref.ref(next(model.parameters()))
    unswap(model)
    del model, stage, w
    gc.collect()
    assert p() is None


def test_classifier_rows_padded_to_8_keep_values_and_gradients():
    """A class count that is not a multiple of 8 runs on zero-padded rows: F.linear's values and
    gradients, contiguous logits."""
    import torch.nn.functional as F

    from cvt_cutlass.swap import linear_rows8

    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in ((3, 4, 16), (10, 16),
                                                                                                 (10,)))
    out = linear_rows8(F.linear, x, w, b)
    assert out.shape == (3, 4, 10) and out.is_contiguous()
    gy = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (x, w, b), gy)
    want = F.linear(x, w, b)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for a, e in zip(grads, torch.autograd.grad(want, (x, w, b), gy), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    assert linear_rows8(F.linear, x, w, None).shape == (3, 4, 10)
