"""PlannedSGD / PlannedAdamW (cvt_cutlass/train/optim.py) against torch's fused classes: the same
parameters and state bit for bit, step after step, through every way a step can go (a missing
gradient, a GradScaler's skipped step, a group added, state loaded, hooks). CPU (torch's fused
kernels run there too); the GPU test repeats the trajectory on CUDA tensors."""

from __future__ import annotations

import copy

import pytest
import torch

from cvt_cutlass.train import PlannedAdamW, PlannedSGD, make_optimizer

from .conftest import requires_sm80

# (planned class, torch class, hyperparameters): momentum, Nesterov, decay, maximize, amsgrad
CASES = [(PlannedSGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-2, "nesterov": True}),
         (PlannedSGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.0, "maximize": True}),
         (PlannedSGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.5, "dampening": 0.1}),
         (PlannedAdamW, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 1e-2}),
         (PlannedAdamW, torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True, "betas": (0.8, 0.99)})]
IDS = [f"{c[0].__name__}-{i}" for i, c in enumerate(CASES)]


def _params(device: str) -> list[torch.nn.Parameter]:
    """Parameters of two dtypes and odd shapes (two kernel launches per step: one per dtype)."""
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g), torch.randn(2, 3, 4, generator=g),
          torch.randn(6, generator=g, dtype=torch.float64)]
    return [torch.nn.Parameter(p.to(device)) for p in ps]


def _pair(case, device: str, **extra):
    planned, ref, kw = case
    a = _params(device)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    other = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in extra.items()}  # a rate of its own
    return a, b, planned(a, **{**kw, **extra}), ref(b, **{**kw, **other}, fused=True)


def _grads(a, b, step: int, skip: int | None = None) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for i, (p, q) in enumerate(zip(a, b, strict=True)):
        x = torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device)
        p.grad, q.grad = (None, None) if i == skip else (x.clone(), x.clone())


def _same(a, b, oa, ob) -> bool:
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    return (all(torch.equal(p, q) for p, q in zip(a, b, strict=True)) and sa.keys() == sb.keys()
            and all(sa[i].keys() == sb[i].keys() and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]) for i in sa))


def _planned_steps(opt, monkeypatch) -> list[int]:
    """Counts the steps torch's code ran (the rest ran from the plan)."""
    seen = [0]
    torch_step = type(opt)._torch_step

    def counted(self):
        seen[0] += 1
        torch_step(self)

    monkeypatch.setattr(type(opt), "_torch_step", counted)
    return seen


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_planned_steps_equal_torch_fused(case, monkeypatch):
    a, b, oa, ob = _pair(case, "cpu")
    torch_steps = _planned_steps(oa, monkeypatch)
    for s in range(6):
        _grads(a, b, s, skip=1 if s == 3 else None)  # a missing gradient: torch's step, which skips it
        oa.step()
        ob.step()
        assert _same(a, b, oa, ob), f"step {s}"
    # the first step (state made) and the one with a missing gradient ran torch's code, and the step after
    # each ran it again (the plans are made from a step whose every parameter had a gradient)
    assert torch_steps[0] == 3


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=[IDS[0], IDS[3]])
def test_grad_scale_and_skipped_step(case):
    """What a GradScaler hands a fused step: the scale to divide by and the inf flag (1: skip)."""
    a, b, oa, ob = _pair(case, "cpu")
    for s in range(5):
        _grads(a, b, s)
        for o in (oa, ob):
            o.grad_scale = torch.tensor(4.0)
            o.found_inf = torch.tensor(1.0 if s == 3 else 0.0)
        oa.step()
        ob.step()
        assert _same(a, b, oa, ob), f"step {s}"


def test_tensor_rate_groups_and_loaded_state():
    """A learning rate as a tensor changed in place, a group added later, state loaded from another run."""
    a, b, oa, ob = _pair(CASES[3], "cpu", lr=torch.tensor(1e-2))
    for s in range(3):
        _grads(a, b, s)
        oa.step()
        ob.step()
    extra = [torch.nn.Parameter(torch.ones(4)) for _ in range(2)]
    oa.add_param_group({"params": [extra[0]], "lr": 0.5})
    ob.add_param_group({"params": [extra[1]], "lr": 0.5})
    for s in range(3, 6):
        _grads(a, b, s)
        extra[0].grad, extra[1].grad = torch.full((4,), float(s)), torch.full((4,), float(s))
        for o in (oa, ob):
            o.param_groups[0]["lr"].mul_(0.5)
        oa.step()
        ob.step()
        assert _same(a, b, oa, ob) and torch.equal(extra[0], extra[1])
    oa.load_state_dict(copy.deepcopy(ob.state_dict()))  # the same values, other tensors: the plan must read them
    for s in range(6, 8):
        _grads(a, b, s)
        extra[0].grad, extra[1].grad = torch.ones(4), torch.ones(4)
        oa.step()
        ob.step()
        assert _same(a, b, oa, ob)


def test_copies_and_switched_groups_follow_torch():
    """A deep copy (plans are not copied), momentum turned on, AMSGrad turned off, groups loaded
    from a non-fused optimizer's checkpoint (torch's non-fused step then runs, as in torch's class)."""
    for case, key, value in [(CASES[1], "momentum", 0.9), (CASES[0], "momentum", 0.0), (CASES[4], "amsgrad", False),
                             (CASES[0], "fused", None), (CASES[3], "fused", None), (CASES[3], "foreach", True)]:
        a, b, oa, ob = _pair(case, "cpu")
        for s in range(6):
            if s == 2:
                oa = copy.deepcopy(oa)
                a = [p for g in oa.param_groups for p in g["params"]]
                b = [p for g in ob.param_groups for p in g["params"]]
            if s == 3:
                for o in (oa, ob):
                    o.param_groups[0][key] = value
            _grads(a, b, s)
            oa.step()
            ob.step()
            assert _same(a, b, oa, ob), f"{key}={value}, step {s}"


def test_sparse_gradient_is_refused_as_torch_does():
    a, b, oa, ob = _pair(CASES[3], "cpu")
    for s in range(2):
        _grads(a, b, s)
        oa.step()
        ob.step()
    a[1].grad, b[1].grad = a[1].grad.to_sparse(), b[1].grad.to_sparse()
    for o in (oa, ob):
        with pytest.raises(RuntimeError, match="sparse"):
            o.step()
    assert _same(a, b, oa, ob)  # nothing stepped, step counts included


def test_hooks_run_once_per_step():
    torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)  # an instance: torch's SGD.step is now wrapped
    a, b, oa, _ = _pair(CASES[0], "cpu")
    calls = []
    oa.register_step_pre_hook(lambda *_: calls.append("pre"))
    oa.register_step_post_hook(lambda *_: calls.append("post"))
    for s in range(3):
        _grads(a, b, s)
        oa.step()
    assert calls == ["pre", "post"] * 3


def test_make_optimizer_fused_is_planned():
    p = [torch.nn.Parameter(torch.randn(3))]
    assert type(make_optimizer(p, "sgd", 0.1, 0.0, fused=True)) is PlannedSGD
    assert type(make_optimizer(p, "adamw", 0.1, 0.0, fused=True)) is PlannedAdamW
    assert type(make_optimizer(p, "sgd", 0.1, 0.0, fused=False)) is torch.optim.SGD
    opt = make_optimizer(p, "adamw", 0.1, 0.0, fused=True)
    assert opt.defaults["fused"] and opt._step_supports_amp_scaling  # GradScaler passes its scale to the kernel


@requires_sm80
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=[IDS[0], IDS[3]])
def test_planned_steps_equal_torch_fused_gpu(case):
    a, b, oa, ob = _pair(case, "cuda", lr=torch.tensor(0.05, device="cuda"))
    for s in range(5):
        _grads(a, b, s)
        oa.step()
        ob.step()
        assert _same(a, b, oa, ob), f"step {s}"
