"""torch's fused SGD and AdamW with the per-parameter Python done once.

``torch.optim.SGD(..., fused=True)`` launches one kernel per parameter group and dtype, but its step
walks every parameter in Python first (``_init_group``: the gradient, the state entry, the buffers'
lists, then the state written back): for CvT-13's 342 parameters about 0.6 ms of host time per
step on the CPU CI machine (2 cores, torch 2.13.0), more than the rest of that step's optimizer work.
:class:`PlannedSGD` and :class:`PlannedAdamW` are those classes, whose step, from the second one on,
reads the parameters' gradients into lists built once (a *plan*: the parameters grouped by device
and dtype, their state tensors) and calls the same fused kernels (``torch._fused_sgd_``,
``torch._fused_adamw_``) with the same arguments, so the parameters, the state and
``state_dict()`` are those of torch's class, bit for bit.

torch's own step runs instead whenever the plan cannot serve the step: the first step (it creates
the state), a parameter without a gradient, a sparse gradient, a group whose parameters changed,
state loaded since (``load_state_dict``; a group loaded from a non-fused optimizer's checkpoint
then runs torch's non-fused step, as torch's class would), a group's momentum turned on or off or
AMSGrad switched, a learning rate or betas given as a tensor of another device or of more than one
element, ``differentiable=True``, a step traced by torch.compile, a CUDA-graph capture of a group
that is not capturable (torch's step raises). A plan holds the state tensors it read: a state entry replaced by hand (not by
``load_state_dict``) is not seen; call :meth:`PlannedSGD.forget_plans` after such a change.
"""

from __future__ import annotations

import operator
from itertools import repeat

import torch


class _Plan:
    """One parameter group's tensors in the fused kernel's lists, per (device, dtype): ``parts`` holds
    (indices into the group or None for all of them, the parameters, one list per state name)."""

    def __init__(self, params: list, state_of, names: tuple[str, ...]):
        self.names = names
        self.params = list(params)
        self.ids = list(map(id, self.params))
        by: dict[tuple, list[int]] = {}
        for i, p in enumerate(self.params):
            by.setdefault((p.device, p.dtype), []).append(i)
        self.parts = []
        for idx in by.values():
            ps = [self.params[i] for i in idx]
            self.parts.append((None if len(by) == 1 else idx, ps, [[state_of(p)[n] for p in ps] for n in names]))

    def serves(self, group_params: list) -> bool:
        return list(map(id, group_params)) == self.ids

    def grads(self) -> list | None:
        """The parameters' gradients in plan order, or None where one is missing or sparse."""
        gs = [p.grad for p in self.params]
        if any(map(operator.is_, gs, repeat(None))) or any(map(_is_sparse, gs)):
            return None
        return gs


_is_sparse = operator.attrgetter("is_sparse")


def _capturing() -> bool:
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _scalar_or_device(v, device):
    """A hyperparameter as the fused kernel takes it: a float, or a one-element tensor on ``device``;
    None where it is neither (torch's step then runs)."""
    if not isinstance(v, torch.Tensor):
        return float(v)
    if v.numel() != 1 or v.device != device:
        return None
    return v


def _on(t, device, memo: dict):
    """A GradScaler's tensor on ``device`` (moved once per step, as torch's step does)."""
    if t is None or t.device == device:
        return t
    if device not in memo:
        memo[device] = t.to(device)
    return memo[device]


class _Planned:
    """The plan cache over the torch optimizer class this is mixed into (always fused=True). A
    subclass names the state a plan reads (``_state_names``), the kernel's hyperparameters for a
    group on a device (``_hyper``: None where the kernel cannot take them) and the launch."""

    def __init__(self, *args, **kwargs):
        kwargs["fused"] = True
        super().__init__(*args, **kwargs)
        self.forget_plans()

    def forget_plans(self) -> None:
        """Drop the plans: the next step is torch's, which reads the parameters and their state again."""
        self._plans: dict[int, _Plan] = {}
        self._plans_of = None

    def __setstate__(self, state) -> None:  # a copy or an unpickled one: torch's state, no plans
        super().__setstate__(state)
        self.forget_plans()

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        self.forget_plans()

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self.forget_plans()

    def _planned_groups(self) -> list | None:
        """(plan, grads, hyperparameters per part) for every group, or None where any group needs
        torch's step (decided before any group is stepped)."""
        if self._plans_of is not self.state or torch.compiler.is_compiling() or self.defaults.get("differentiable"):
            return None
        groups = self.param_groups
        if not all(map(self._kernel_serves, groups)):
            return None
        if not all(g.get("capturable", True) for g in groups) and _capturing():
            return None  # torch's step refuses a capture of a step that is not capturable
        out = []
        for i, group in enumerate(groups):
            plan = self._plans.get(i)
            if plan is None or plan.names != self._state_names(group) or not plan.serves(group["params"]):
                return None
            grads = plan.grads()
            kws = [self._hyper(group, ps[0].device) for _, ps, _ in plan.parts]
            if grads is None or any(k is None for k in kws):
                return None
            out.append((plan, grads, kws))
        return out

    @staticmethod
    def _kernel_serves(group) -> bool:
        """The group asks for the step the plan runs: fused (a group loaded from a checkpoint of a
        non-fused optimizer may say otherwise), for AdamW with decoupled weight decay."""
        return bool(group.get("fused")) and not group.get("foreach") and group.get("decoupled_weight_decay", True)

    def _plan_all(self) -> None:
        """Plans for every group whose state torch's step has made (every parameter had a gradient)."""
        self.forget_plans()
        for i, group in enumerate(self.param_groups):
            names = self._state_names(group)
            ps = group["params"]
            if not ps or any(p.grad is None or not all(n in self.state[p] for n in names) for p in ps):
                return
            self._plans[i] = _Plan(ps, self.state.__getitem__, names)
        self._plans_of = self.state

    def _torch_step(self) -> None:
        """torch's step, without the hooks' wrapper torch puts on its class's step once an instance of
        it exists (this class's step runs the step hooks already)."""
        base = next(c for c in type(self).__mro__ if c.__module__.startswith("torch.optim"))
        f = base.step
        (f.__wrapped__ if getattr(f, "hooked", False) else f)(self)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        planned = self._planned_groups()
        if planned is None:
            self._torch_step()
            self._plan_all()
            return loss
        scale, inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        scales: dict = {}
        infs: dict = {}
        for plan, grads, kws in planned:
            for (idx, ps, states), kw in zip(plan.parts, kws, strict=True):
                dev = ps[0].device
                gs = grads if idx is None else [grads[i] for i in idx]
                self._launch(ps, gs, states, kw, _on(scale, dev, scales), _on(inf, dev, infs))
        return loss


class PlannedSGD(_Planned, torch.optim.SGD):
    """``torch.optim.SGD(..., fused=True)`` whose step after the first runs from a plan (see the
    module's docstring): same arguments, same results."""

    @staticmethod
    def _state_names(group) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    @staticmethod
    def _hyper(group, device) -> dict | None:
        lr = _scalar_or_device(group["lr"], device)
        if lr is None:
            return None
        return {"weight_decay": group["weight_decay"], "momentum": group["momentum"], "lr": lr,
                "dampening": group["dampening"], "nesterov": group["nesterov"], "maximize": group["maximize"]}

    @staticmethod
    def _launch(ps, gs, states, kw, scale, inf) -> None:
        torch._fused_sgd_(ps, gs, states[0] if states else [], **kw, is_first_step=False, grad_scale=scale,
                          found_inf=inf)


class PlannedAdamW(_Planned, torch.optim.AdamW):
    """``torch.optim.AdamW(..., fused=True)`` whose step after the first runs from a plan (see the
    module's docstring): same arguments, same results."""

    @staticmethod
    def _state_names(group) -> tuple[str, ...]:
        return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    @staticmethod
    def _hyper(group, device) -> dict | None:
        lr = _scalar_or_device(group["lr"], device)
        beta1, beta2 = group["betas"]
        if lr is None or isinstance(beta1, torch.Tensor) or isinstance(beta2, torch.Tensor):
            return None
        return {"amsgrad": group["amsgrad"], "lr": lr, "beta1": beta1, "beta2": beta2,
                "weight_decay": group["weight_decay"], "eps": group["eps"], "maximize": group["maximize"]}

    @staticmethod
    def _launch(ps, gs, states, kw, scale, inf) -> None:
        steps, avgs, sqs = states[:3]
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(ps, gs, avgs, sqs, states[3] if len(states) > 3 else [], steps, **kw,
                            grad_scale=scale, found_inf=inf)
        if inf is not None:
            torch._foreach_sub_(steps, [inf] * len(steps))
