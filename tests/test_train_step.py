"""The training step users run: optimizer, schedule, clipping, accumulation and the GradScaler in
the eager step and in the captured step (one CUDA graph), checked against the loop a PyTorch user
writes by hand. CPU tests run the eager step on the CPU reference path; GPU tests replay graphs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from cvt_cutlass.swap import swap
from cvt_cutlass.train import (
    CapturedStep,
    StepOptions,
    cosine_schedule,
    make_optimizer,
    make_step,
    precision_of,
)
from cvt_cutlass.train.captured import check_capturable, make_capturable

from .conftest import requires_sm80, requires_sm90
from .test_swap import tiny_cvt

# (optimizer, --dtype, --amp, clip, accumulate): each feature of the step at least once
CASES = [("sgd", "fp32", "none", None, 1), ("adamw", "fp32", "bf16", 0.05, 2), ("adamw", "fp32", "fp16", 0.05, 2),
         ("sgd", "fp32", "fp16", None, 2)]


def gpu_kernel_specs(cc: int, gpu: str | None) -> list:
    """The kernels this module's GPU tests call: tiny_cvt's training set at 64x64 (bf16 and fp16
    autocast; fp32 runs on PyTorch), batches up to 8."""
    from cvt_cutlass import model_kernels

    from .gpu_kernels import default_arch

    return model_kernels(tiny_cvt().config, 64, ["bf16", "fp16"], default_arch(cc), training=True, gpu=gpu,
                         max_batch=8)


def _model(device: str):
    m = tiny_cvt(drop_path_rate=[0.0, 0.0, 0.0]).train().to(device)  # drop path: no random draws to compare
    return swap(m)


def _batches(n: int, b: int, device: str, classes: int = 16):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(b, 3, 64, 64, generator=g).to(device), torch.randint(0, classes, (b,), generator=g).to(device))
            for _ in range(n)]


def _by_hand(model, opt, prec, sched, batches, clip, k):
    """The loop a PyTorch user writes: zero_grad, micro-batch backward, unscale, clip, step, update, schedule."""
    dev = batches[0][0].device.type
    scaler = torch.amp.GradScaler(dev) if prec.scaler_needed else None
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(k), y.chunk(k), strict=True):
            with torch.autocast(dev, dtype=prec.amp or torch.float32, enabled=prec.amp is not None):
                loss = F.cross_entropy(model(xs).logits.float(), ys) / k
            (scaler.scale(loss) if scaler else loss).backward()
        if clip is not None:
            if scaler:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()


def _opt(model, name):
    return make_optimizer(model.parameters(), name, 0.05 if name == "sgd" else 2e-3, 1e-4, lr_tensor=True)


def _setup(name, dtype, amp, device, steps):
    model = _model(device)
    opt = _opt(model, name)
    return model, precision_of(dtype, amp, device == "cuda"), opt, cosine_schedule(opt, steps, warmup_steps=2)


def _runs(case, device, steps):
    """The run under test (model, precision, optimizer, options) and a by-hand run from the same
    start: (run, steps of the by-hand loop given the batches, start)."""
    name, dtype, amp, clip, k = case
    model, prec, opt, sched = _setup(name, dtype, amp, device, steps)
    p0, ref = copy.deepcopy(model), copy.deepcopy(model)
    ref_opt = _opt(ref, name)

    def by_hand(batches):
        _by_hand(ref, ref_opt, prec, cosine_schedule(ref_opt, steps, 2), batches, clip, k)
        return ref, ref_opt

    return (model, prec, opt, StepOptions(clip, k, sched)), by_hand, p0


def _gap(a, b, p0) -> float:
    """Parameter distance of two runs relative to how far the first moved."""
    flat = [torch.cat([p.detach().double().flatten() for p in m.parameters()]) for m in (a, b, p0)]
    return float((flat[0] - flat[1]).norm() / (flat[0] - flat[2]).norm())


# ----------------------------------------------------------------------------------- CPU
def test_optimizer_and_schedule():
    p = [torch.nn.Parameter(torch.randn(3))]
    opt = make_optimizer(p, "adamw", 1e-3, 0.0, lr_tensor=True)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and opt.defaults["fused"] is None  # CPU: not fused by default
    sched = cosine_schedule(opt, total_steps=10, warmup_steps=4)
    seen = [float(lr)]
    for _ in range(10):
        opt.step()
        sched.step()
        seen.append(float(opt.param_groups[0]["lr"]))
    assert opt.param_groups[0]["lr"] is lr  # filled in place: a captured graph reads the new rate
    assert seen[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3]) and seen[-1] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(seen[3:], seen[4:], strict=False))
    with pytest.raises(ValueError, match="sgd or adamw"):
        make_optimizer(p, "lion", 1e-3, 0.0)


def test_make_capturable():
    p = [torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.AdamW(p, lr=1e-3)
    p[0].grad = torch.randn(3)
    opt.step()
    make_capturable(opt)
    assert opt.param_groups[0]["capturable"] and opt.state[p[0]]["step"].dtype == torch.float32
    sgd = torch.optim.SGD(p, lr=0.1)
    make_capturable(sgd)  # nothing to set: SGD does not check
    assert "capturable" not in sgd.param_groups[0]


def test_capturable_checks():
    prec16, prec_bf = precision_of("fp32", "fp16", True), precision_of("fp32", "bf16", True)
    p = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(ValueError, match="GradScaler.*fused=True"):
        check_capturable(make_optimizer(p, "sgd", 0.1, 0.0, fused=False), prec16, StepOptions())
    check_capturable(make_optimizer(p, "sgd", 0.1, 0.0, fused=True), prec16, StepOptions())
    float_lr = make_optimizer(p, "sgd", 0.1, 0.0)
    with pytest.raises(ValueError, match="learning rate as a tensor"):
        check_capturable(float_lr, prec_bf, StepOptions(scheduler=cosine_schedule(float_lr, 10)))


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: "-".join(map(str, c)))
def test_eager_step_is_the_loop_by_hand_cpu(case):
    """make_step with clipping, accumulation and a schedule = the hand-written loop, exactly
    (the swapped model on the CPU reference path)."""
    (model, prec, opt, opts), by_hand, p0 = _runs(case, "cpu", 4)
    batches = _batches(4, 4, "cpu")
    step = make_step(model, opt, prec, "cpu", opts)
    losses = [step(x, y) for x, y in batches]
    ref, _ = by_hand(batches)
    assert all(torch.isfinite(v) for v in losses) and _gap(model, p0, p0) > 0
    assert _gap(model, ref, p0) < 1e-6
    assert (step.grad_norm is not None) == (opts.clip_norm is not None)


def test_accumulation_needs_equal_micro_batches():
    model = _model("cpu")
    step = make_step(model, make_optimizer(model.parameters(), "sgd", 0.1, 0.0), precision_of("fp32", "none", False),
                     "cpu", StepOptions(accumulate=3))
    with pytest.raises(ValueError, match="does not split into 3"):
        step(*_batches(1, 4, "cpu")[0])


# ----------------------------------------------------------------------------------- GPU
@requires_sm80
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_captured_step_follows_the_loop_by_hand_gpu(case):
    """The captured step's replays (3 eager warm-up steps first) follow the hand-written eager loop
    (same kernels; the scaler's skips and the schedule on the device)."""
    (model, prec, opt, opts), by_hand, p0 = _runs(case, "cuda", 8)
    batches = _batches(8, 8, "cuda")
    step = CapturedStep(model, opt, prec, *batches[0], opts, warmup=batches[:3])
    losses = step.warmup_losses + [step(x, y) for x, y in batches[3:]]
    ref, ref_opt = by_hand(batches)
    torch.cuda.synchronize()
    assert all(torch.isfinite(v) for v in losses)
    # fp32 without autocast runs PyTorch's ops (no fp32 kernels), each counted with reason "dtype"
    assert all(k.endswith(":dtype") for k in step.counted["fallbacks"]) if prec.amp is None \
        else step.counted["fallbacks"] == {}
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(float(ref_opt.param_groups[0]["lr"]))
    assert _gap(model, ref, p0) < 2e-3, _gap(model, ref, p0)


@requires_sm80
def test_captured_step_skips_an_overflow_on_the_device_gpu():
    model, prec, opt, sched = _setup("adamw", "fp32", "fp16", "cuda", 6)
    batches = _batches(4, 8, "cuda")
    step = CapturedStep(model, opt, prec, *batches[0], StepOptions(0.05, 1, sched), warmup=batches[:2])
    before = [p.detach().clone() for p in model.parameters()]
    step.scaler._scale.fill_(2.0**60)  # every fp16 gradient overflows: the step must be skipped
    loss = step(*batches[2])
    torch.cuda.synchronize()
    assert torch.isfinite(loss)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert float(step.scaler._scale) == 2.0**59  # backed off once
    step.scaler._scale.fill_(256.0)
    step(*batches[3])
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@requires_sm80
def test_captured_step_refuses_another_shape_gpu():
    model, prec, opt, _ = _setup("sgd", "fp32", "bf16", "cuda", 4)
    x, y = _batches(1, 8, "cuda")[0]
    step = CapturedStep(model, opt, prec, x, y, warmup=[(x, y)])
    with pytest.raises(ValueError, match=r"captured for x of shape \(8, 3, 64, 64\).*got \(4, 3, 64, 64\)"):
        step(x[:4], y[:4])


# A process's training steps (eager, then the stage graphs' capture and replays) and eval forwards
# of tiny_cvt in deterministic mode, as digests; run once per CVT_CUTLASS_PDL setting (the kernel
# libraries read it once per process).
_PDL_RUN = """
import hashlib, os, sys
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch, torch.nn.functional as F
sys.path.insert(0, os.getcwd())  # the repository root (the test runs it there)
from cvt_cutlass import fallback
from cvt_cutlass.swap import swap
from tests.test_swap import tiny_cvt
def digest(ts):
    h = hashlib.sha256()
    for t in ts:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]
torch.use_deterministic_algorithms(True)
model = swap(tiny_cvt(drop_path_rate=[0.0, 0.0, 0.1]).cuda().train())
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(8, 3, 64, 64, device="cuda", generator=g)
y = torch.randint(0, 16, (8,), device="cuda", generator=g)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
torch.manual_seed(0)
for _ in range(4):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).logits.float(), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    print("grads", digest(p.grad for p in model.parameters() if p.grad is not None))
    opt.step()
print("params", digest(model.parameters()), digest(model.buffers()))
model.eval()
with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
    for b in (1, 8):
        print("eval", b, digest([model(x[:b]).logits for _ in range(2)]))
print("fallbacks", sum(fallback.stats()["fallbacks"].values()))
"""


@requires_sm90
def test_dependent_launch_on_and_off_give_the_same_bits_gpu():
    """The kernels launched with programmatic dependent launch (sm_90; CVT_CUTLASS_PDL, on by
    default) compute the same bits as launched plainly: four deterministic training steps with drop
    path (eager, the stage graphs' capture, replays) and the eval forward at batch 1 and 8, one
    process per setting."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    runs = []
    for pdl in ("0", "1"):
        r = subprocess.run([sys.executable, "-c", _PDL_RUN], capture_output=True, text=True, timeout=900,
                           cwd=root, env={**os.environ, "CVT_CUTLASS_PDL": pdl})
        assert r.returncode == 0, r.stderr[-4000:]
        runs.append([line for line in r.stdout.splitlines() if line.split(" ")[0] in ("grads", "params", "eval",
                                                                                     "fallbacks")])
    assert len(runs[0]) == 8 and runs[0][-1] == "fallbacks 0", runs[0]
    assert runs[0] == runs[1]
