"""The whole training step (forward, backward, clipping, optimizer step, GradScaler) captured in
one CUDA graph, for real training loops: a replay runs the step's kernels with no host work per
kernel. What changes between steps lives on the device: the batch (copied into static inputs),
the learning rate (a tensor a scheduler fills in place), the GradScaler's scale and inf flag (the
fused optimizers skip a step on the device), the optimizer state."""

from __future__ import annotations

from .step import Precision, StepOptions, train_body


def check_capturable(opt, prec: Precision, opts: StepOptions) -> None:
    """ValueError when the step cannot be captured as asked."""
    import torch

    if prec.scaler_needed and not getattr(opt, "_step_supports_amp_scaling", False):
        raise ValueError("a captured step with fp16 autocast (its GradScaler) needs an optimizer that skips a "
                         "step on the device: make_optimizer(..., fused=True) (torch's fused SGD / AdamW)")
    if opts.scheduler is not None and not all(isinstance(g["lr"], torch.Tensor) for g in opt.param_groups):
        raise ValueError("a captured step with a scheduler needs the learning rate as a tensor "
                         "(make_optimizer(..., lr_tensor=True)): a float rate would be baked into the graph")


def make_capturable(opt) -> None:
    """Sets ``capturable`` on the optimizers that check it under capture (Adam / AdamW: their step
    count then lives on the device, as fused ones keep it anyway), moving a step count already
    kept on the host to its parameter's device."""
    import torch

    for group in opt.param_groups:
        if "capturable" not in group or group["capturable"]:
            continue
        group["capturable"] = True
        for p in group["params"]:
            st = opt.state.get(p, {})
            if isinstance(st.get("step"), torch.Tensor) and st["step"].device != p.device:
                st["step"] = st["step"].to(p.device, torch.float32)
    if hasattr(opt, "forget_plans"):  # a planned optimizer (.optim) read the state tensors replaced above
        opt.forget_plans()


class CapturedStep:
    """``step(x, y) -> loss``: the training step of :func:`.step.train_body` captured in one CUDA
    graph on static copies of a batch of ``x``'s and ``y``'s shape. Eager warm-up steps on a side
    stream build the kernels and the optimizer state first (PyTorch's whole-network capture
    recipe): real steps on ``warmup``'s batches (default ``(x, y)`` three times), the scheduler
    stepped after each; their losses are ``warmup_losses``, the CUTLASS kernel calls / fallbacks of
    the last one ``counted`` (a replay runs no Python op, so it counts nothing). The step returns a
    copy of the loss; ``grad_norm`` is the graph's norm tensor when clipping (overwritten by each
    replay). A batch of another shape raises: pad or drop it, or take the eager step for it."""

    def __init__(self, model, opt, prec: Precision, x, y, opts: StepOptions | None = None, warmup=None):
        import torch

        from ..graphs import held_by_caller

        self.opts = opts or StepOptions()
        check_capturable(opt, prec, self.opts)
        make_capturable(opt)
        self.model, self.opt, self.prec = model, opt, prec
        self.scaler = torch.amp.GradScaler("cuda") if prec.scaler_needed else None
        self.static_x, self.static_y = x.clone(), y.clone()
        batches = list(warmup) if warmup is not None else [(x, y)] * 3
        if not batches:
            raise ValueError("a captured step needs at least one eager warm-up step (it builds the optimizer state)")
        with held_by_caller():  # the stages run eagerly here: the whole step becomes one graph
            self.warmup_losses, self.counted = self._warm_up(batches)
            self.graph, self.static_loss, self.grad_norm = self._capture()

    def _body(self):
        return train_body(self.model, self.opt, self.prec, self.scaler, self.static_x, self.static_y, self.opts,
                          cache=False)  # autocast's weight-cast cache does not survive capture (PyTorch's docs)

    def _warm_up(self, batches):
        import torch

        from .. import fallback

        losses, side = [], torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i, (xb, yb) in enumerate(batches):
                self._load(xb, yb)
                self.opt.zero_grad(set_to_none=True)
                if i == len(batches) - 1:
                    fallback.reset()
                losses.append(self._body()[0])
                if self.opts.scheduler is not None:
                    self.opts.scheduler.step()
        counted = fallback.stats()
        torch.cuda.current_stream().wait_stream(side)
        return losses, counted

    def _capture(self):
        import torch

        from ..graphs import no_gc

        graph = torch.cuda.CUDAGraph()
        self.opt.zero_grad(set_to_none=True)  # the graph's backward allocates the gradients in its pool
        with no_gc(), torch.cuda.graph(graph):
            loss, norm = self._body()
        return graph, loss, norm

    def _load(self, x, y) -> None:
        for src, dst, name in ((x, self.static_x, "x"), (y, self.static_y, "y")):
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise ValueError(f"the captured step was captured for {name} of shape {tuple(dst.shape)} {dst.dtype}, "
                                 f"got {tuple(src.shape)} {src.dtype}: pad or drop the batch, or run the eager "
                                 "step (cvt_cutlass.train.make_step) for it")
            dst.copy_(src, non_blocking=True)

    def __call__(self, x, y):
        self._load(x, y)
        self.graph.replay()
        if self.opts.scheduler is not None:
            self.opts.scheduler.step()
        return self.static_loss.clone()


def make_captured_step(model, opt, prec: Precision, x, y, warmup=None, opts: StepOptions | None = None):
    """:class:`CapturedStep` (kept as the function earlier code calls)."""
    return CapturedStep(model, opt, prec, x, y, opts, warmup)
