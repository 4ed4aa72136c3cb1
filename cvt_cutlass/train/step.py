"""The training step of a (swapped) CvT as users run it: precision (fp32 master weights under
autocast, or a pure bf16 / fp16 model), the optimizer, one eager step (with a GradScaler for fp16
autocast), and the whole step captured in one CUDA graph."""

from __future__ import annotations

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


def make_optimizer(params, name: str, lr: float, weight_decay: float):
    import torch

    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)


def make_step(model, opt, prec: Precision, device_type: str):
    """One training step ``step(x, y) -> loss`` (detached): forward under autocast when set,
    cross-entropy in fp32, backward (through the GradScaler for fp16 autocast), optimizer step."""
    import torch
    import torch.nn.functional as F

    scaler = torch.amp.GradScaler(device_type) if prec.scaler_needed else None

    def step(x, y):
        with torch.autocast(device_type, dtype=prec.amp or torch.float32, enabled=prec.amp is not None):
            loss = F.cross_entropy(model(x.to(prec.param)).logits.float(), y)
        opt.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return loss.detach()

    step.scaler = scaler
    return step


def make_captured_step(model, opt, prec: Precision, x, y, warmup=None):
    """The whole training step (forward, backward, optimizer step) captured in one CUDA graph on
    static copies of ``x`` and ``y``: ``step(x, y)`` copies the batch in and replays (no host work
    per kernel). Needs fixed shapes, a learning rate that does not change between steps (it is
    captured) and no GradScaler (bf16 autocast or a pure bf16 / fp32 model). Eager warm-up steps
    on a side stream build the kernels and the optimizer state first, as PyTorch's whole-network
    capture recipe does: real steps on the batches of ``warmup`` (default: ``(x, y)`` three
    times); their losses are ``step.warmup_losses``, and CUTLASS kernel calls / fallbacks of the
    last one ``step.counted`` (a replay runs no Python op, so it counts nothing)."""
    import torch
    import torch.nn.functional as F

    if prec.scaler_needed:
        raise ValueError("a captured training step cannot use a GradScaler (fp16 autocast): use bf16")
    static_x, static_y = x.clone(), y.clone()

    def body():
        # autocast's weight-cast cache does not survive capture: off, as PyTorch documents
        with torch.autocast("cuda", dtype=prec.amp or torch.float32, enabled=prec.amp is not None,
                            cache_enabled=False):
            loss = F.cross_entropy(model(static_x.to(prec.param)).logits.float(), static_y)
        loss.backward()
        opt.step()
        return loss.detach()

    from .. import fallback

    batches = list(warmup) if warmup is not None else [(x, y)] * 3
    losses = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i, (xb, yb) in enumerate(batches):
            static_x.copy_(xb)
            static_y.copy_(yb)
            opt.zero_grad(set_to_none=True)
            if i == len(batches) - 1:
                fallback.reset()
            losses.append(body())
    counted = fallback.stats()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)  # the graph's backward allocates the gradients in its pool
    with torch.cuda.graph(graph):
        static_loss = body()

    def step(xb, yb):
        static_x.copy_(xb)
        static_y.copy_(yb)
        graph.replay()
        return static_loss

    step.graph, step.warmup_losses, step.counted = graph, losses, counted
    return step
