"""The training step of a (swapped) CvT as users run it: precision (fp32 master weights under
autocast, or a pure bf16 / fp16 model), the optimizer, one eager step (with a GradScaler for fp16
autocast), and the whole step captured in one CUDA graph."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass


@dataclass
class Precision:
    """The parameters' dtype and the autocast dtype (None: no autocast) of a run."""

    param: object  # torch.dtype
    amp: object | None

    @property
    def scaler_needed(self) -> bool:
        import torch

        return self.amp is torch.float16


def precision_of(dtype: str, amp: str | None, cuda: bool) -> Precision:
    """--dtype and --amp as torch dtypes: fp32 parameters default to bf16 autocast on a GPU (none on
    the CPU reference path); a pure bf16 / fp16 model takes no autocast."""
    import torch

    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "none": None}
    if dtype not in ("fp32", "bf16", "fp16") or amp not in (None, *names):
        raise ValueError(f"precision: --dtype is one of fp32, bf16, fp16 and --amp one of bf16, fp16, none; got "
                         f"{dtype!r}, {amp!r}")
    param = names[dtype]
    if amp is None:
        amp = "bf16" if (cuda and param is torch.float32) else "none"
    if param is not torch.float32 and amp != "none":
        raise ValueError(f"--amp {amp} is for fp32 master weights; --dtype {dtype} trains a pure {dtype} model")
    return Precision(param, names[amp])


def fit_classifier(model, classes: int, class_names: list[str] | None = None) -> None:
    """A fresh classifier when the data has another number of classes; the config's labels follow."""
    import torch

    head = model.classifier
    if getattr(head, "out_features", classes) != classes:
        model.classifier = torch.nn.Linear(head.in_features, classes).to(head.weight.device, head.weight.dtype)
        model.num_labels = model.config.num_labels = classes
    names = class_names or [f"class_{i}" for i in range(classes)]
    model.config.id2label = dict(enumerate(names))
    model.config.label2id = {n: i for i, n in enumerate(names)}


def make_optimizer(params, name: str, lr: float, weight_decay: float, fused: bool | None = None,
                   lr_tensor: bool = False):
    """SGD (momentum 0.9) or AdamW. ``fused`` (default: on CUDA) runs torch's fused step, one kernel
    per parameter group and dtype, which also takes a GradScaler's scale and inf flag on the device,
    from lists of the parameters and their state made once (:mod:`.optim`: torch's results, less
    per-parameter Python per step);
    ``lr_tensor`` keeps the learning rate as a device tensor, so that a scheduler can change it
    between CUDA-graph replays (schedulers fill the tensor in place)."""
    import torch

    from .optim import PlannedAdamW, PlannedSGD

    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    if fused is None:
        fused = device.type == "cuda"
    rate = torch.tensor(float(lr), device=device) if lr_tensor else lr
    if name == "adamw":
        if fused:
            return PlannedAdamW(params, lr=rate, weight_decay=weight_decay)
        return torch.optim.AdamW(params, lr=rate, weight_decay=weight_decay)
    if name == "sgd":
        if fused:
            return PlannedSGD(params, lr=rate, momentum=0.9, weight_decay=weight_decay)
        return torch.optim.SGD(params, lr=rate, momentum=0.9, weight_decay=weight_decay)
    raise ValueError(f"optimizer {name!r}: sgd or adamw")


def cosine_schedule(opt, total_steps: int, warmup_steps: int = 0):
    """Linear warm-up from 0 over ``warmup_steps``, then cosine decay to 0 at ``total_steps``
    (torch.optim.lr_scheduler.LambdaLR; with a tensor learning rate it is updated in place)."""
    import math

    import torch

    def factor(i: int) -> float:
        if i < warmup_steps:
            return (i + 1) / warmup_steps
        done = (i - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(done, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


@dataclass
class StepOptions:
    """What a training step does besides forward, backward and the optimizer step: clip the
    gradients' global norm to ``clip_norm``, accumulate them over ``accumulate`` micro-batches
    (the batch split into equal parts), step ``scheduler`` after each optimizer step."""

    clip_norm: float | None = None
    accumulate: int = 1
    scheduler: object | None = None

    def __post_init__(self):
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"StepOptions: accumulate is a number of micro-batches (>= 1), got {self.accumulate!r}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"StepOptions: clip_norm must be > 0 (or None: no clipping), got {self.clip_norm!r}")


def train_body(model, opt, prec: Precision, scaler, x, y, opts: StepOptions, cache: bool = True):
    """The step's device work, the same for the eager and the captured step (no host sync):
    forward under autocast (cross-entropy in fp32) and backward per micro-batch (a DDP model's
    micro-batches before the last under no_sync: one all-reduce per step), unscale and clip,
    the optimizer step (through the GradScaler when set: a step with inf / nan gradients is skipped
    on the device by the fused optimizers). Returns (mean loss, gradient norm or None), detached."""
    import torch
    import torch.nn.functional as F

    k = opts.accumulate
    if x.shape[0] % k:
        raise ValueError(f"a batch of {x.shape[0]} does not split into {k} equal micro-batches (--accumulate)")
    total = None
    # DDP: the micro-batches before the last accumulate locally (no_sync), the last all-reduces
    no_sync = getattr(model, "no_sync", None)
    for i, (xs, ys) in enumerate(zip(x.chunk(k), y.chunk(k), strict=True)):
        with no_sync() if no_sync is not None and i < k - 1 else contextlib.nullcontext():
            with torch.autocast(x.device.type, dtype=prec.amp or torch.float32, enabled=prec.amp is not None,
                                cache_enabled=cache):
                loss = F.cross_entropy(model(xs.to(prec.param)).logits.float(), ys)
            part = loss / k if k > 1 else loss
            (scaler.scale(part) if scaler is not None else part).backward()
        total = loss.detach() if total is None else total + loss.detach()
    norm = None
    if opts.clip_norm is not None:
        if scaler is not None:
            scaler.unscale_(opt)
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, opts.clip_norm)
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()
    return (total / k if k > 1 else total), norm


def make_step(model, opt, prec: Precision, device_type: str, opts: StepOptions | None = None):
    """One eager training step ``step(x, y) -> loss`` (detached): zero the gradients, the step's
    device work (:func:`train_body`: autocast forward, backward, a GradScaler for fp16 autocast,
    clipping, accumulation), then the scheduler. ``step.grad_norm`` is the last clipped norm."""
    import torch

    opts = opts or StepOptions()
    scaler = torch.amp.GradScaler(device_type) if prec.scaler_needed else None

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss, step.grad_norm = train_body(model, opt, prec, scaler, x, y, opts)
        if opts.scheduler is not None:
            opts.scheduler.step()
        return loss

    step.scaler, step.grad_norm = scaler, None
    return step
