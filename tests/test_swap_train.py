"""A swapped CvT trains on the fused stage's differentiable path: the same loss, gradients,
BatchNorm running statistics and drop-path draws as HF (float64 on CPU, where every op runs its
PyTorch reference, so the math must agree to rounding), state_dict / optimizer / DDP behaviour;
on a GPU, gradient agreement with an fp32 HF reference next to HF's own error at bf16 / fp16, and
zero fallbacks per training step."""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
import torch.nn.functional as F

import cvt_cutlass
from cvt_cutlass import fallback
from cvt_cutlass.checkpoint import hf_config, randomize_norms

from .conftest import requires_sm80


def _tiny(drop_path=0.0, drop=0.0, dtype=torch.float64, seed=0):
    """A 3-stage CvT small enough for float64 on CPU (cls token on stage 3, depth >= 3 there: HF
    indexes its drop-path rates by stage)."""
    from transformers import CvtForImageClassification

    torch.manual_seed(seed)
    cfg = hf_config("cvt-13", num_labels=5)
    cfg.depth, cfg.embed_dim, cfg.num_heads = [1, 2, 3], [32, 48, 64], [1, 2, 2]
    cfg.drop_path_rate = [0.0, 0.0, drop_path]
    cfg.drop_rate = [drop] * 3
    model = CvtForImageClassification(cfg).to(dtype).train()
    return randomize_norms(model, torch.Generator().manual_seed(seed), ln_bias=False)  # non-trivial BN and LN


def _batch(n=3, size=64, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 3, size, size, generator=g, dtype=torch.float64).to(device, dtype),
            torch.randint(0, 5, (n,), generator=g).to(device))


def _step(model, x, y):
    loss = F.cross_entropy(model(x).logits.float(), y)
    loss.backward()
    return loss.detach()


def _grad_errors(ref, model) -> dict[str, float]:
    """Per parameter |g - g_ref| / max(|g_ref|, 1e-6 |all of g_ref|): the key projection's biases
    have a zero gradient in exact math (softmax ignores a constant per query row), so their
    rounding noise is measured against the whole gradient's norm."""
    total = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in ref.parameters()))
    out = {}
    for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        assert b.grad is not None and b.grad.dtype == b.dtype, n
        out[n] = ((a.grad.double() - b.grad.double()).norm() / torch.clamp(a.grad.double().norm(),
                                                                              min=1e-6 * total)).item()
    return out


def test_swapped_training_matches_hf_in_float64():
    hf = _tiny()
    sw = cvt_cutlass.swap(copy.deepcopy(hf))
    x, y = _batch()
    fallback.reset()
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (hf, sw)]
    for _ in range(3):
        losses = []
        for m, opt in zip((hf, sw), opts, strict=True):
            opt.zero_grad()
            losses.append(_step(m, x, y))
        assert torch.allclose(losses[0], losses[1], rtol=1e-10)
        errs = _grad_errors(hf, sw)
        assert max(errs.values()) < 1e-8, sorted(errs.items(), key=lambda kv: -kv[1])[:3]
        for opt in opts:
            opt.step()
    for (n, a), (_, b) in zip(hf.named_buffers(), sw.named_buffers(), strict=True):
        assert torch.allclose(a.double(), b.double(), rtol=1e-10, atol=1e-12), n  # running stats, batches tracked
    st = fallback.stats()["fallbacks"]
    assert st and not any(k.startswith("swap:") for k in st), st  # the ops' CPU references, not HF's forward
    assert sum(st.values()) > 0 and all(k.endswith(":device") for k in st)


def _slot_modules(model) -> set[int]:
    """ids of the modules the fused stages read their cast parameters from (found on first use)."""
    recipes = [getattr(st, "_cvt_recipe", None) for st in model.cvt.encoder.stages]
    return {id(m) for r in recipes if r is not None for m, _ in r.cast_slots}


def test_copy_of_a_trained_swapped_model_trains_its_own_parameters():
    """Under autocast (the parameters cast per stage through slots found on first use): a deepcopy
    after a step (an EMA model, a snapshot) reads the copy's modules; a submodule replaced after a
    step is read from the next forward on (its registration invalidates the stage's recipe); gradients reach
    the parameters in use and only those."""
    sw = cvt_cutlass.swap(_tiny())
    x, y = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _step(sw, x, y)
        twin = copy.deepcopy(sw)
        owned = {id(m) for m in twin.modules()}
        assert _slot_modules(twin) and _slot_modules(twin) <= owned
        sw.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
        _step(twin, x, y)
        assert all(p.grad is not None for p in twin.parameters())
        assert all(p.grad is None for p in sw.parameters())
        stage = twin.cvt.encoder.stages[0]
        recipe = stage._cvt_recipe
        _step(twin, x, y)
        assert stage._cvt_recipe is recipe  # found once, not per forward
        lay = stage.layers[0]
        old = lay.output.dense
        lay.output.dense = torch.nn.Linear(old.in_features, old.out_features, dtype=torch.float64)
        for _ in range(2):
            twin.zero_grad(set_to_none=True)
            old.zero_grad(set_to_none=True)
            _step(twin, x, y)
        assert lay.output.dense.weight.grad is not None and old.weight.grad is None
        assert id(lay.output.dense) in _slot_modules(twin) and id(old) not in _slot_modules(twin)
        assert stage._cvt_recipe is not recipe  # the registration of the new Linear: found again


def test_drop_path_draws_as_hf():
    hf = _tiny(drop_path=0.6)
    sw = cvt_cutlass.swap(copy.deepcopy(hf))
    x, y = _batch()
    losses = []
    for m in (hf, sw):
        torch.manual_seed(123)
        losses.append(_step(m, x, y))
    assert torch.equal(losses[0], losses[1])
    assert max(_grad_errors(hf, sw).values()) < 1e-8
    torch.manual_seed(7)  # another draw changes the loss: the masks are live
    assert not torch.equal(_step(sw, x, y), losses[1])


def test_dropout_stage_runs_hf_visibly():
    hf = _tiny(drop=0.1)
    sw = cvt_cutlass.swap(copy.deepcopy(hf))
    x, y = _batch()
    fallback.reset()
    torch.manual_seed(0)
    a = _step(hf, x, y)
    torch.manual_seed(0)
    b = _step(sw, x, y)
    assert fallback.stats()["fallbacks"].get("swap:dropout") == 3
    assert torch.allclose(a, b, rtol=1e-10)
    sw.eval()
    fallback.reset()
    with torch.no_grad():
        sw(x)
    assert "swap:dropout" not in fallback.stats()["fallbacks"]  # eval has no dropout


def test_eval_with_autograd_uses_folded_batchnorm_and_matches_hf():
    hf, x = _tiny().eval(), _batch()[0].requires_grad_()
    sw = cvt_cutlass.swap(copy.deepcopy(hf))
    x2 = x.detach().clone().requires_grad_()
    hf(x).logits.square().sum().backward()
    sw(x2).logits.square().sum().backward()
    # folded weights are fp32 (the eval kernels' form) even in a float64 model
    assert ((x.grad - x2.grad).norm() / x.grad.norm()).item() < 1e-6
    assert max(_grad_errors(hf, sw).values()) < 1e-5


def test_state_dict_and_optimizer_survive_swap():
    hf = _tiny()
    keys = {k: v.data_ptr() for k, v in hf.state_dict().items()}
    opt = torch.optim.SGD(hf.parameters(), lr=0.1, momentum=0.9)
    _step(hf, *_batch())
    opt.step()
    state = {id(p): s["momentum_buffer"].clone() for p, s in opt.state.items()}
    cvt_cutlass.swap(hf)
    assert {k: v.data_ptr() for k, v in hf.state_dict().items()} == keys
    opt.zero_grad()
    _step(hf, *_batch())
    cvt_cutlass.unswap(hf)
    assert all(torch.equal(s["momentum_buffer"], state[id(p)]) for p, s in opt.state.items())
    assert set(id(p) for p in hf.parameters()) == set(state)


def _grads64(model, x, y, autocast: bool) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _step(model, x, y)
    return {n: p.grad.double() for n, p in model.named_parameters()}


def _whole_error(g: dict, ref: dict) -> float:
    num = sum(float((g[n] - ref[n]).pow(2).sum()) for n in ref)
    return (num / sum(float(r.pow(2).sum()) for r in ref.values())) ** 0.5


def test_fp32_residual_stream_under_autocast_on_cpu():
    """swap(residual_stream="fp32") under bf16 autocast: the stages' tokens stay fp32 on the layer
    op (no layer runs op by op) but where a stage hands them to the next embedding (rounded to bf16
    once there, as HF's autocast does), and the whole gradient against float64 is within 1.15x of HF
    autocast's (1.08x on the CPU's reference ops, 2026-11-27) and closer than the 16-bit
    stream's, op by op too; without autocast nothing changes; an unknown mode raises."""
    hf32 = _tiny(dtype=torch.float32)
    x, y = _batch(dtype=torch.float32)
    want = _grads64(_tiny(dtype=torch.float64), x.double(), y, False)
    err_hf = _whole_error(_grads64(copy.deepcopy(hf32), x, y, True), want)
    errs, dtypes = {}, {}
    for layer_op in (True, False):
        cvt_cutlass.set_layer_op(layer_op)
        try:
            for stream in ("compute", "fp32"):
                sw = cvt_cutlass.swap(copy.deepcopy(hf32), residual_stream=stream)
                hooks = [sw.cvt.encoder.stages[i].register_forward_hook(
                    lambda m, a, out, k=(stream, i): dtypes.__setitem__(k, out[0].dtype)) for i in (0, -1)]
                fallback.reset()
                errs[stream, layer_op] = _whole_error(_grads64(sw, x, y, True), want)
                for h in hooks:
                    h.remove()
                st = fallback.stats()
                assert (st["fused_calls"].get("cvt_layer_backward") == 6) == layer_op, st
        finally:
            cvt_cutlass.set_layer_op(None)
    assert dtypes == {("compute", 0): torch.bfloat16, ("compute", -1): torch.bfloat16,
                      ("fp32", 0): torch.bfloat16, ("fp32", -1): torch.float32}
    for layer_op in (True, False):
        assert errs["fp32", layer_op] <= 1.15 * err_hf and errs["fp32", layer_op] < errs["compute", layer_op], \
            (errs, err_hf)
    plain = cvt_cutlass.swap(copy.deepcopy(hf32), residual_stream="fp32")
    fallback.reset()
    _step(plain, x, y)  # no autocast: the fp32 model's own stream
    assert fallback.stats()["fused_calls"].get("cvt_layer") == 6
    again = cvt_cutlass.swap(cvt_cutlass.swap(copy.deepcopy(hf32)), residual_stream="fp32")  # the latest holds
    assert all(s.fp32_stream for s in again.cvt.encoder.stages) and again.layernorm.fp32_stream
    with pytest.raises(ValueError, match="residual_stream"):
        cvt_cutlass.swap(copy.deepcopy(hf32), residual_stream="bf16")


def test_autocast_and_pure_low_precision_on_cpu():
    hf32 = _tiny(dtype=torch.float32)
    sw = cvt_cutlass.swap(copy.deepcopy(hf32))
    x, y = _batch(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _step(sw, x, y)
        ref = F.cross_entropy(hf32(x).logits.float(), y)
    assert torch.isfinite(loss) and abs(loss - ref) < 0.05 * abs(ref)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in sw.parameters())
    bf = cvt_cutlass.swap(copy.deepcopy(hf32).bfloat16())
    rm0 = bf.cvt.encoder.stages[0].layers[0].attention.attention.convolution_projection_query \
        .convolution_projection.normalization.running_mean.clone()
    assert torch.isfinite(_step(bf, x.bfloat16(), y))
    bn = bf.cvt.encoder.stages[0].layers[0].attention.attention.convolution_projection_query \
        .convolution_projection.normalization
    assert bn.running_mean.dtype == torch.bfloat16 and not torch.equal(bn.running_mean, rm0)
    assert all(p.grad.dtype == torch.bfloat16 for p in bf.parameters())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_runners(models, engine: str, device_ids=None):
    """The models under one distributed engine: DDP, torch.compile over DDP, or FSDP2 (fully_shard
    per stage and the root)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for m in models:
            for stage in m.cvt.encoder.stages:
                fully_shard(stage)
            fully_shard(m)
        return models
    runners = [DDP(m, device_ids=device_ids) for m in models]
    return [torch.compile(r) for r in runners] if engine == "compile_ddp" else runners


def _engine_worker(rank: int, world: int, port: int, engine: str, out: str):
    """HF's model and the swapped one under the same engine, two SGD steps on this rank's share;
    rank 0 saves both models' full parameters and the swapped model's layer-op count."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    hf = _tiny()
    models = [hf, cvt_cutlass.swap(copy.deepcopy(hf))]
    runners = _engine_runners(models, engine)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    x, y = _batch(n=2 * world)
    for _ in range(2):
        for r, opt in zip(runners, opts, strict=True):
            opt.zero_grad()
            _step(r, x[rank::world], y[rank::world])
            opt.step()
    full = [[p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in m.parameters()] for m in models]
    fused = cvt_cutlass.stats()["fused_calls"].get("cvt_layer", 0)  # the swapped model ran its layer ops
    if rank == 0:
        torch.save([*full, fused], out)
    dist.barrier()  # every rank done before any tears gloo down (a rank aborted at exit once without it)
    dist.destroy_process_group()


@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "compile_ddp"])
def test_distributed_engines_two_processes(tmp_path, engine):
    """DDP, FSDP2 (fully_shard per stage) and torch.compile over DDP train a swapped CvT as they
    train HF's: the same parameters after two steps on two gloo processes."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "params.pt")
    mp.spawn(_engine_worker, args=(2, _free_port(), engine, out), nprocs=2, join=True)
    ref, swapped, fused = torch.load(out)
    assert fused >= 2 * (1 + 2 + 3) and len(ref) == len(swapped)
    assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(ref, swapped, strict=True))


def _syncbn_worker(rank: int, world: int, port: int, out: str):
    """Two SGD steps on this rank's share of the batch, the gradients averaged over the ranks (DDP's
    arithmetic: DDP takes SyncBatchNorm on GPU modules only): a swapped CvT with nn.SyncBatchNorm
    (convert_sync_batchnorm, then swap) and, as the control, one with per-process BatchNorm; rank 0
    saves both models' parameters and buffers and the layer paths."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    models = [cvt_cutlass.swap(torch.nn.SyncBatchNorm.convert_sync_batchnorm(_tiny())), cvt_cutlass.swap(_tiny())]
    x, y = _batch(n=2 * world)
    fallback.reset()
    for m in models:
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        for _ in range(2):
            opt.zero_grad()
            _step(m, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
            for p in m.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
    if rank == 0:
        torch.save([[[t.detach() for t in (*m.parameters(), *m.buffers())] for m in models],
                    fallback.stats()["layer_paths"]], out)
    dist.barrier()  # every rank done before any tears gloo down (a rank aborted at exit once without it)
    dist.destroy_process_group()


def test_sync_batchnorm_on_two_processes_is_one_process_on_the_whole_batch(tmp_path):
    """nn.SyncBatchNorm.convert_sync_batchnorm, then swap: two gloo processes (float64, DDP) end
    with the parameters and BatchNorm running statistics of one process on the whole batch, which
    per-process BatchNorm does not; the synced layers run op by op (the statistics all-reduced
    between the ops), said in the layer paths."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "syncbn.pt")
    mp.spawn(_syncbn_worker, args=(2, _free_port(), out), nprocs=2, join=True)
    (synced, local), paths = torch.load(out)
    one = cvt_cutlass.swap(_tiny())
    opt = torch.optim.SGD(one.parameters(), lr=0.05, momentum=0.9)
    x, y = _batch(n=4)
    for _ in range(2):
        opt.zero_grad()
        _step(one, x, y)
        opt.step()
    ref = [t.detach() for t in (*one.parameters(), *one.buffers())]
    assert len(ref) == len(synced) == len(local)
    assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(ref, synced, strict=True))
    running = [i for i, (n, _) in enumerate([*one.named_parameters(), *one.named_buffers()]) if "running_" in n]
    assert running and not all(torch.allclose(ref[i], local[i], rtol=1e-6) for i in running)
    assert any("SyncBatchNorm" in reason for reason in paths), paths


_SB_GEOM = (5, 5, 1)  # H, W, cls rows


def _sb_problem():
    """x (6 images), the q / k / v conv weights (3, 3, 8), BatchNorm weights and biases, strides and
    a fixed output cotangent per projection, float64."""
    g = torch.Generator().manual_seed(0)
    h, w, cls = _SB_GEOM
    x = torch.randn(6, cls + h * w, 8, generator=g, dtype=torch.float64)
    strides = (1, 2, 2)
    ws, gammas, betas = ([f(g) for _ in strides] for f in (
        lambda g: torch.randn(3, 3, 8, generator=g, dtype=torch.float64),
        lambda g: torch.rand(8, generator=g, dtype=torch.float64) + 0.5,
        lambda g: torch.randn(8, generator=g, dtype=torch.float64)))
    cots = [torch.randn(6, cls + ((h - 1) // s + 1) * ((w - 1) // s + 1), 8, generator=g, dtype=torch.float64)
            for s in strides]
    return x, ws, gammas, betas, strides, cots


def _sb_worker(rank: int, world: int, port: int, shares: tuple, out: str):
    """This rank's rows of x through the three SyncBatchNorm projections at once; saves the outputs,
    dx, the parameter gradients and the running statistics."""
    import torch.distributed as dist

    from cvt_cutlass.ops.dwconv import sync_dwconv_bn_modules

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x, ws, gammas, betas, strides, cots = _sb_problem()
    lo, hi = sum(shares[:rank]), sum(shares[:rank + 1])
    xl = x[lo:hi].clone().requires_grad_()
    items, leaves = [], []
    for w, gm, bt, st in zip(ws, gammas, betas, strides, strict=True):
        bn = torch.nn.SyncBatchNorm(8).double().train()
        with torch.no_grad():
            bn.weight.copy_(gm)
            bn.bias.copy_(bt)
        w = w.clone().requires_grad_()
        items.append((w, bn, st, False))
        leaves += [w, bn.weight, bn.bias]
    ys = sync_dwconv_bn_modules(xl, items, *_SB_GEOM[:2], _SB_GEOM[2], dist.group.WORLD)
    sum((y * c[lo:hi]).sum() for y, c in zip(ys, cots, strict=True)).backward()
    torch.save([[y.detach() for y in ys], xl.grad, [t.grad for t in leaves],
                [b for _, bn, _, _ in items for b in (bn.running_mean, bn.running_var)]], f"{out}.{rank}")
    dist.barrier()  # every rank done before any tears gloo down (a rank aborted at exit once without it)
    dist.destroy_process_group()


@pytest.mark.parametrize("shares", [(3, 3), (5, 1), (6, 0)])
def test_sync_batchnorm_uneven_shares_and_an_empty_rank(tmp_path, shares):
    """The q / k / v SyncBatchNorm projections over two gloo processes holding 3 + 3, 5 + 1 or 6 + 0
    images (float64): outputs and dx row for row, parameter gradients summed over the ranks and
    running statistics are one process's conv + F.batch_norm on all 6."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "sb")
    mp.spawn(_sb_worker, args=(2, _free_port(), shares, out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    x, ws, gammas, betas, strides, cots = _sb_problem()
    h, w, cls = _SB_GEOM
    x = x.requires_grad_()
    leaves = [t.clone().requires_grad_() for trio in zip(ws, gammas, betas, strict=True) for t in trio]
    ys, running = [], []
    for i, st in enumerate(strides):
        img = x[:, cls:].reshape(6, h, w, 8).permute(0, 3, 1, 2)
        z = F.conv2d(img, leaves[3 * i].permute(2, 0, 1).unsqueeze(1), None, st, 1, groups=8)
        stats = [torch.zeros(8, dtype=torch.float64), torch.ones(8, dtype=torch.float64)]
        y = F.batch_norm(z, *stats, leaves[3 * i + 1], leaves[3 * i + 2], True, 0.1, 1e-5)
        ys.append(torch.cat([x[:, :cls], y.flatten(2).transpose(1, 2)], 1))
        running += stats
    sum((y * c).sum() for y, c in zip(ys, cots, strict=True)).backward()
    close = functools.partial(torch.allclose, rtol=1e-9, atol=1e-10)
    for i, y in enumerate(ys):
        assert close(torch.cat([r[0][i] for r in ranks]), y.detach())
    assert close(torch.cat([r[1] for r in ranks]), x.grad)
    assert all(close(ranks[0][2][j] + ranks[1][2][j], t.grad) for j, t in enumerate(leaves))
    assert all(close(a, b) and close(a, c) for a, b, c in zip(ranks[0][3], ranks[1][3], running, strict=True))


def test_sync_batchnorm_parts_compose_the_whole_op():
    """The parts of the SyncBatchNorm path on one process (their PyTorch implementations on the CPU,
    float64): statistics then normalization is dwconv_bn_train; the backward sums then the
    gradient pass with those sums is dwconv_bn_backward."""
    from cvt_cutlass.ops import dwconv as d

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 1 + 49, 16, generator=g, dtype=torch.float64), torch.randn(3, 3, 16, generator=g,
                                                                                    dtype=torch.float64)
    gw, gb = torch.rand(16, generator=g, dtype=torch.float64) + 0.5, torch.randn(16, generator=g, dtype=torch.float64)
    geom = (7, 7, 2, 1)
    y, mean, invstd = d.dwconv_bn_train_reference(x, w, gw, gb, None, None, 0.1, 1e-5, *geom)
    m, m2 = d.dwconv_bn_stats(x, w, *geom)
    n = 3 * 4 * 4
    assert torch.allclose(m, mean) and torch.allclose(torch.rsqrt(m2 / n + 1e-5), invstd)
    assert torch.allclose(d.dwconv_bn_apply(x, w, gw, gb, m, invstd, *geom), y)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    dx, dw, dg, db = d.dwconv_bn_backward_reference(dy, x, w, gw, mean, invstd, *geom)
    sdy, sdyx = d.dwconv_bn_backward_sums(dy, x, w, mean, invstd, *geom)
    assert torch.allclose(sdy, db) and torch.allclose(sdyx, dg)
    dx2, dw2 = d.dwconv_bn_backward_apply(dy, x, w, gw, mean, invstd, sdy, sdyx, torch.tensor([n], dtype=x.dtype), *geom)
    assert torch.allclose(dx2, dx) and torch.allclose(dw2, dw)
    with pytest.raises(ValueError, match="grad must be"):
        d.dwconv_bn_backward_sums(dy[:, 1:], x, w, mean, invstd, *geom)


# ----------------------------------------------------------------------------- GPU
@requires_sm80
@pytest.mark.parametrize("mode", ["bf16", "fp16", "autocast_bf16", "autocast_bf16_16bit"])
@pytest.mark.parametrize("model", ["cvt-13", "cvt-21"])
def test_gradients_vs_fp32_hf_gpu(model, mode):
    """The swapped model's gradients against HF in fp32 (same weights and batch, drop path off)
    are no worse than HF's own at the same precision by more than a small margin: over the whole
    gradient (relative error, cosine) and per tensor (median ratio of the errors). Per-tensor
    errors of a randomly initialised deep CvT are large for HF too in 16-bit (the gradient of a
    20-block network at init is chaotic), so single tensors are reported, not asserted."""
    from cvt_cutlass.tools.bench.train import gradient_agreement

    fallback.reset()
    rows, summ = gradient_agreement(model, mode)
    assert fallback.stats()["fallbacks"] == {}, fallback.stats()["fallbacks"]
    assert summ["swapped_rel_err"] <= 1.5 * summ["hf_rel_err"] + 0.02, summ
    assert summ["swapped_cos"] >= summ["hf_cos"] - 0.02, summ
    # Under autocast HF keeps its residual stream and LayerNorms in fp32, and so does swap by
    # default: as close as HF's autocast (CvT-13, H100, 2026-11-27: 0.0116 vs 0.0115); the 16-bit
    # stream (residual_stream="compute") has HF's pure-bf16 precision (H200, 2026-11-23: median
    # ratio 1.42-1.53 there, 0.92-0.96 pure)
    if mode == "autocast_bf16":
        assert summ["swapped_rel_err"] <= 1.1 * summ["hf_rel_err"] + 1e-3 and summ["median_ratio"] <= 1.2, summ
    assert summ["median_ratio"] <= (2.0 if mode == "autocast_bf16_16bit" else 1.5), summ


@requires_sm80
def test_autocast_training_step_runs_on_kernels_gpu():
    """fp32 master weights under bf16 autocast: every op on a kernel, fp32 gradients, the running
    statistics move, the loss close to HF's under the same autocast."""
    from cvt_cutlass.checkpoint import random_cvt as build_model

    hf = build_model("cvt-13").cuda().train()
    sw = cvt_cutlass.swap(copy.deepcopy(hf))
    x, y = _batch(n=8, size=224, dtype=torch.float32, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a = _step(hf, x, y)
        fallback.reset()
        b = _step(sw, x, y)
    st = fallback.stats()
    assert st["fallbacks"] == {} and sum(st["kernel_calls"].values()) > 100, st
    assert abs(a - b) < 0.02 * abs(a)
    assert all(p.grad.dtype == torch.float32 for p in sw.parameters())


def test_flat_cast_matches_per_tensor_casts():
    """Caster casts a stage's parameters with one concatenation (cast_params; their gradients back
    with another): the same values and gradients as one .to() per tensor, in one buffer."""
    from cvt_cutlass.params import Caster

    ps = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True), torch.randn(5, dtype=torch.float64,
                                                                                 requires_grad=True),
          torch.randn(2, 2, 2, dtype=torch.float32, requires_grad=True)]
    cv = Caster(torch.float32, ps)
    outs = [cv(p) for p in ps]
    assert all(o.dtype == torch.float32 and o.shape == p.shape for o, p in zip(outs, ps, strict=True))
    same_buffer = outs[0].untyped_storage().data_ptr() == outs[1].untyped_storage().data_ptr()
    assert same_buffer and outs[2] is ps[2]  # fp32 already: itself
    (outs[0].sum() * 2 + outs[1].square().sum()).backward()  # ps[1] used, ps[2] not
    assert torch.equal(ps[0].grad, torch.full_like(ps[0], 2.0))
    torch.testing.assert_close(ps[1].grad, 2 * ps[1].detach().float().double())
    assert ps[2].grad is None and cv(None) is None
    assert cv(torch.ones(2, dtype=torch.float16)).dtype == torch.float32  # not a listed tensor: its own cast


@pytest.mark.parametrize("channels_last", [False, True])
def test_cast_params_one_copy_or_concatenation(channels_last):
    """cast_params converts contiguous tensors with one multi-tensor copy and any other set by a
    concatenation and a conversion: the same values either way, views of one buffer, the
    gradients back in the tensors' dtype and layout."""
    import cvt_cutlass.ops  # noqa: F401  (registers the ops)

    ps = [torch.randn(4, 3, 3, 3, requires_grad=True), torch.randn(7, requires_grad=True)]
    if channels_last:
        ps[0] = ps[0].detach().to(memory_format=torch.channels_last).requires_grad_(True)
    outs = torch.ops.cvt_cutlass.cast_params(ps, torch.bfloat16)
    assert all(torch.equal(o, p.detach().to(torch.bfloat16)) for o, p in zip(outs, ps, strict=True))
    assert outs[0].untyped_storage().data_ptr() == outs[1].untyped_storage().data_ptr()
    (outs[0].float().sum() + 3 * outs[1].float().sum()).backward()
    assert torch.equal(ps[0].grad, torch.ones_like(ps[0])) and torch.equal(ps[1].grad, torch.full_like(ps[1], 3.0))


@requires_sm80
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("model", ["cvt-13", "cvt-21", "cvt-w24"])
def test_training_step_of_each_config_has_no_fallbacks_gpu(model, dtype):
    """One training step (fp32 master weights under autocast, the configs' drop path on) of each
    named config: CUTLASS kernel calls in the forward and in the backward, zero fallbacks."""
    from cvt_cutlass.checkpoint import random_cvt as build_model
    from cvt_cutlass.tools.bench.train import counted_step
    from cvt_cutlass.train import make_optimizer, precision_of

    sw = cvt_cutlass.swap(build_model(model).cuda().train())
    x, y = _batch(n=2, size=224, dtype=torch.float32, device="cuda")
    fwd, both = counted_step(sw, make_optimizer(sw.parameters(), "sgd", 0.01, 0.0), precision_of("fp32", dtype, True),
                             x, y)
    calls_f = sum(fwd["kernel_calls"].values())
    assert both["fallbacks"] == {}, both["fallbacks"]
    assert calls_f > 50 and sum(both["kernel_calls"].values()) - calls_f > 50, both["kernel_calls"]


@pytest.fixture
def deterministic(monkeypatch):
    # PyTorch's own GEMMs under deterministic mode ask for a fixed cuBLAS workspace (its error says so)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def test_deterministic_mode_names_the_atomic_kernels(deterministic):
    """Under torch.use_deterministic_algorithms(True) a kernel that sums with fp32 atomics is
    refused with a reason of its own (its PyTorch path runs, counted); off, nothing is refused."""
    from cvt_cutlass.ops import common

    assert common.nondeterministic("x")[0] == "deterministic"
    torch.use_deterministic_algorithms(True, warn_only=True)
    assert common.nondeterministic("x") is not None
    torch.use_deterministic_algorithms(False)
    assert common.nondeterministic("x") is None


@requires_sm80
def test_deterministic_training_step_reruns_bitwise_gpu(deterministic):
    """Two training steps of a swapped CvT-13 (bf16 autocast) from the same state under
    torch.use_deterministic_algorithms(True) give bitwise-equal gradients and BatchNorm buffers;
    the attention backward runs on kernels (on sm90 our wgmma kernel adding dq in key-block order
    and the short-key kernel for stage 3; on sm89 example 41 with one key split), anything that falls
    back does so for that reason only (the SM80-class dgrad's bias reduction), and the gradients
    agree with the default mode's."""
    from cvt_cutlass.checkpoint import random_cvt as build_model

    torch.use_deterministic_algorithms(False)
    hf = build_model("cvt-13").cuda().train()
    for m in hf.modules():
        if hasattr(m, "drop_prob"):
            m.drop_prob = 0.0
    sw = cvt_cutlass.swap(hf)
    state = copy.deepcopy(sw.state_dict())
    x, y = _batch(n=8, size=224, dtype=torch.float32, device="cuda")

    def grads():
        sw.load_state_dict(state)
        sw.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _step(sw, x, y)
        return [p.grad.clone() for p in sw.parameters()], [b.clone() for b in sw.buffers()]

    free, _ = grads()
    torch.use_deterministic_algorithms(True)
    fallback.reset()
    (g1, b1), (g2, b2) = grads(), grads()
    fbs = fallback.stats()["fallbacks"]
    assert all(torch.equal(a, b) for a, b in zip(g1 + b1, g2 + b2, strict=True))
    assert all(key.endswith(":deterministic") for key in fbs), fbs
    assert fallback.stats()["kernel_calls"].get("attention_backward", 0) > 0
    flat = [torch.cat([g.float().flatten() for g in gs]) for gs in (free, g1)]
    assert float(F.cosine_similarity(*flat, dim=0)) > 0.999


def _scaled_fp16_step(model, opt, scaler, x, y) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.cross_entropy(model(x).logits.float(), y)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss.detach()


@requires_sm80
@pytest.mark.parametrize("case", ["grad_overflow", "inf_input"])
def test_fp16_gradscaler_skips_nonfinite_steps_as_hf_gpu(case):
    """fp16 autocast with a GradScaler: a step whose gradients overflow (a scale of 2^40) or whose
    loss is NaN (an inf pixel) is skipped exactly as HF's is (parameters unchanged, the scale
    halved, the same BatchNorm buffers finite), and the next finite step trains both."""
    from cvt_cutlass.checkpoint import random_cvt as build_model

    hf = build_model("cvt-13").cuda().train()
    models = [hf, cvt_cutlass.swap(copy.deepcopy(hf))]
    x, y = _batch(n=4, size=224, dtype=torch.float32, device="cuda")
    bad = x.clone()
    if case == "inf_input":
        bad[0, 0, 5, 7] = float("inf")
    scale0 = 2.0 ** 40 if case == "grad_overflow" else 2.0 ** 12
    fallback.reset()
    for m in models:
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        scaler = torch.amp.GradScaler("cuda", init_scale=scale0)
        before = [p.detach().clone() for p in m.parameters()]
        state0 = copy.deepcopy(m.state_dict())
        loss = _scaled_fp16_step(m, opt, scaler, bad, y)
        assert torch.isfinite(loss).item() == (case == "grad_overflow")
        assert scaler.get_scale() == scale0 / 2
        assert all(torch.equal(a, p) for a, p in zip(before, m.parameters(), strict=True))
        m.finite_buffers = [bool(torch.isfinite(b).all()) for b in m.buffers()]
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12)
        m.load_state_dict(state0)  # an inf pixel leaves NaN running statistics (HF's too)
        assert torch.isfinite(_scaled_fp16_step(m, opt, scaler, x, y))
        assert scaler.get_scale() == 2.0 ** 12
        assert any(not torch.equal(a, p) for a, p in zip(before, m.parameters(), strict=True))
    assert models[0].finite_buffers == models[1].finite_buffers
    assert fallback.stats()["fallbacks"] == {}, fallback.stats()["fallbacks"]


def _nccl_start(rank: int, world: int, port: int):
    """This rank's GPU in an NCCL group, and HF's CvT-13 (seed 0, no drop path) on it in training mode."""
    import torch.distributed as dist

    from cvt_cutlass.checkpoint import random_cvt as build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    torch.manual_seed(0)
    hf = build_model("cvt-13").cuda().train()
    for m in hf.modules():
        if hasattr(m, "drop_prob"):
            m.drop_prob = 0.0
    return hf


def _nccl_worker(rank: int, world: int, port: int, engine: str, out: str):
    import torch.distributed as dist

    hf = _nccl_start(rank, world, port)
    models = [hf, cvt_cutlass.swap(copy.deepcopy(hf))]
    runners = _engine_runners(models, engine, [rank])
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 3, 224, 224, generator=g).cuda(), torch.randint(0, 1000, (4,), generator=g).cuda()
    fallback.reset()
    grads = []
    for r, m in zip(runners, models, strict=True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _step(r, x, y)
        full = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in m.parameters()]
        grads.append(torch.cat([t.float().flatten() for t in full]))
    every = [torch.empty_like(grads[1]) for _ in range(world)]
    dist.all_gather(every, grads[1])
    if rank == 0:
        torch.save({"same_on_ranks": all(torch.equal(e, every[0]) for e in every),
                    "cos": float(F.cosine_similarity(grads[0], grads[1], dim=0)),
                    "fallbacks": fallback.stats()["fallbacks"],
                    "fused": fallback.stats()["fused_calls"].get("cvt_layer", 0)}, out)
    dist.barrier()  # every rank done before any tears gloo down (a rank aborted at exit once without it)
    dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2+ GPUs")
@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "compile_ddp"])
def test_distributed_engines_nccl_all_gpus(tmp_path, engine):
    """DDP, FSDP2 (fully_shard per stage) and torch.compile over DDP on every GPU with NCCL: the
    swapped CvT-13's gradients are the same on every rank, agree with HF's under the same engine
    (cosine, bf16 autocast), its layers ran as layer ops and no op falls back."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "grads.pt")
    n = torch.cuda.device_count()
    mp.spawn(_nccl_worker, args=(n, _free_port(), engine, out), nprocs=n, join=True)
    res = torch.load(out)
    assert res["same_on_ranks"] and res["cos"] > 0.99 and res["fallbacks"] == {} and res["fused"] > 0, res


def _nccl_syncbn_worker(rank: int, world: int, port: int, out: str):
    """A swapped CvT-13 with nn.SyncBatchNorm under DDP (bf16 autocast) on this rank's share of a
    batch; the same model on the whole batch in one process (rank 0); rank 0 saves the cosine of
    their gradients, the running statistics of both and the counters."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    hf = _nccl_start(rank, world, port)
    one = cvt_cutlass.swap(copy.deepcopy(hf))
    synced = cvt_cutlass.swap(torch.nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(hf)))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4 * world, 3, 224, 224, generator=g).cuda(), torch.randint(0, 1000, (4 * world,), generator=g).cuda()
    fallback.reset()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _step(DDP(synced, device_ids=[rank]), x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4])
    st = fallback.stats()
    if rank == 0:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _step(one, x, y)
        flat = [torch.cat([p.grad.float().flatten() for p in m.parameters()]) for m in (one, synced)]
        runs = [[b.float() for n, b in m.named_buffers() if "running_" in n] for m in (one, synced)]
        torch.save({"cos": float(F.cosine_similarity(*flat, dim=0)),
                    "running": max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(*runs, strict=True)),
                    "fallbacks": st["fallbacks"], "calls": st["kernel_calls"], "paths": st["layer_paths"]}, out)
    dist.barrier()  # every rank done before any tears gloo down (a rank aborted at exit once without it)
    dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2+ GPUs")
def test_sync_batchnorm_nccl_all_gpus_is_one_process_on_the_whole_batch(tmp_path):
    """nn.SyncBatchNorm (convert_sync_batchnorm, then swap) under DDP on every GPU with NCCL, bf16
    autocast: gradients (averaged by DDP) and running statistics of one process on the whole
    batch, the statistics and sums passes on the kernels, no fallbacks."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "syncbn.pt")
    n = torch.cuda.device_count()
    mp.spawn(_nccl_syncbn_worker, args=(n, _free_port(), out), nprocs=n, join=True)
    res = torch.load(out)
    assert res["fallbacks"] == {} and res["cos"] > 0.99 and res["running"] < 2e-2, res
    assert res["calls"].get("dwconv_bn_stats", 0) > 0 and res["calls"].get("dwconv_bn_backward_apply", 0) > 0, res
    assert any("SyncBatchNorm" in reason for reason in res["paths"]), res


def test_depthwise_weights_put_in_kernel_layout_together():
    """Caster.rsc: a stage's depthwise weights (C, 1, 3, 3) as fp32 (3, 3, C) views of one stacked
    buffer, the same values and gradients as one permute + copy per weight."""
    from cvt_cutlass.ops.dwconv import depthwise_rsc
    from cvt_cutlass.params import Caster

    ws = [torch.randn(16, 1, 3, 3, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    cv = Caster(torch.bfloat16, (), ws)
    outs = [cv.rsc(w) for w in ws]
    refs = [depthwise_rsc(w) for w in ws]
    assert all(o.dtype == torch.float32 and o.is_contiguous() and torch.equal(o, r) for o, r in zip(outs, refs, strict=True))
    assert outs[0]._base is outs[2]._base is not None
    gy = [torch.randn(3, 3, 16) for _ in range(3)]
    got = torch.autograd.grad(outs[:2], ws, gy[:2], allow_unused=True)  # the third unused: zero
    want = torch.autograd.grad(refs[:2], ws[:2], gy[:2])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and not got[2].any()
    assert got[0].dtype == torch.bfloat16 and got[0].shape == (16, 1, 3, 3)
    other = torch.randn(8, 1, 3, 3)
    assert torch.equal(cv.rsc(other), depthwise_rsc(other))  # not listed: its own copy
