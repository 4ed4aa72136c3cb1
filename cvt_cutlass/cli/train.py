"""``cvt-cutlass train``: fine-tune a CvT on the CUTLASS kernels.

1. the model: ``--checkpoint`` (anything :func:`cvt_cutlass.load_cvt` reads: a HF directory, a
   ``.safetensors`` file, an original ``.pth``) or ``--model`` (a named config, random init). When
   the data has another number of classes than the classifier, the classifier is replaced by a
   fresh ``nn.Linear`` (as HF's ``ignore_mismatched_sizes``) and the config's labels follow;
2. the data: ``--data DIR`` in the ImageFolder layout (:class:`cvt_cutlass.train.ImageFolderTask`),
   shuffled each epoch; by default a synthetic task with a learnable signal
   (:class:`cvt_cutlass.train.SyntheticTask`);
3. precision as users run it: ``--dtype fp32`` master weights under ``torch.autocast`` in
   ``--amp bf16`` (the default on a GPU) or ``fp16`` (with ``torch.amp.GradScaler``: a step whose
   gradients overflow is skipped, as with any PyTorch model), or ``--dtype bf16/fp16``: a pure
   low-precision model;
4. the step: ``cvt_cutlass.swap`` (the fused stages train on the kernels; ``--no-swap`` trains HF's
   modules instead, the peer of a comparison), cross-entropy, fused SGD
   with momentum (or ``--optimizer adamw``), ``--schedule cosine`` with ``--warmup-steps``,
   ``--clip-norm``, ``--accumulate`` micro-batches; on a GPU the whole step captured in one CUDA
   graph (:class:`cvt_cutlass.train.CapturedStep`; ``--no-cuda-graph`` or ``--compile`` for an
   eager step); a progress line with the loss and img/s; at the end a checkpoint in HF format
   in ``--out`` (``save_pretrained``, the model unswapped first: the state dict is HF's either
   way) and a summary with the CUTLASS kernel calls and fallbacks of one step.

Without a GPU it says so and runs a few steps of the CPU reference path (fp32, small batch): the
swapped model's ops run their PyTorch references, every call counted as a fallback.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from pathlib import Path
from typing import NamedTuple

from ..train import (
    ImageFolderTask,
    Ranks,
    ShardedTask,
    StepOptions,
    SyntheticTask,
    allreduce_ms,
    cosine_schedule,
    finish,
    fit_classifier,
    make_captured_step,
    make_optimizer,
    make_step,
    mean_over_ranks,
    precision_of,
    ranks_agree,
    ranks_from_env,
)

CPU_STEPS, CPU_BATCH = 3, 2
DDP_CAPTURE_WARMUP = 11


class Progress:
    """One progress line on stderr: step, loss (running mean of the last ``window`` steps), img/s
    (none when ``quiet``: the ranks other than 0). The losses may be device tensors: they are read
    (a sync) only when the line is redrawn, at most every half second."""

    def __init__(self, total: int, batch: int, window: int = 20, quiet: bool = False):
        self.total, self.batch, self.window, self.quiet = total, batch, window, quiet
        self.losses: list = []
        self.t0 = time.perf_counter()
        self.last = 0.0

    def update(self, i: int, loss, force: bool = False) -> None:
        self.losses = (self.losses + [loss])[-self.window:]
        now = time.perf_counter()
        if self.quiet or (not force and now - self.last < 0.5):
            return
        self.last = now
        done = int(24 * (i + 1) / self.total)
        rate = (i + 1) * self.batch / max(now - self.t0, 1e-9)
        mean = float(sum(self.losses)) / len(self.losses)  # one read of the device
        sys.stderr.write(f"\r[train] [{'#' * done}{'-' * (24 - done)}] {i + 1}/{self.total}  "
                         f"loss {mean:.4f}  {rate:.0f} img/s ")
        sys.stderr.flush()
        if i + 1 == self.total:
            sys.stderr.write("\n")


def _captured(runner, opt, prec, task, batch: int, warm: int, losses: list, bar, opts):
    """``--cuda-graph``: the first ``warm`` steps train eagerly (the warm-up the capture needs),
    then the captured step; (step, kernel calls / fallbacks of the last eager step)."""
    batches = [task.batch(batch) for _ in range(warm)]
    step = make_captured_step(runner, opt, prec, *batches[0], warmup=batches, opts=opts)
    for i, loss in enumerate(step.warmup_losses):
        losses.append(loss)
        bar.update(i, loss, force=i + 1 == bar.total)
    return step, step.counted


def _warm_steps(ranks: Ranks | None) -> int:
    """Eager steps before the capture: 3, or 11 under DDP (PyTorch's whole-network capture recipe
    for DistributedDataParallel: its first iterations log with host syncs, which a capture refuses)."""
    return 3 if ranks is None else DDP_CAPTURE_WARMUP


def _task(a, device):
    if a.data:
        return ImageFolderTask(a.data, a.image_size, device, a.seed, skip_bad=a.skip_bad_images)
    return SyntheticTask(a.classes, a.image_size, device, a.seed)


def _cpu_settings(a, ranks: Ranks | None = None) -> None:
    """No GPU: the CPU reference path (fp32, no autocast, at most CPU_STEPS steps of batch
    CPU_BATCH per process), said on stdout (by rank 0), what was asked for and changed on stderr."""
    if ranks is None or ranks.main:
        print("cvt-cutlass train: no CUDA GPU is visible (torch.cuda.is_available() is False); running the CPU "
              f"reference path (fp32, at most {CPU_STEPS} steps of batch <= {CPU_BATCH}): the swapped model's ops "
              "run their PyTorch references, every call counted as a fallback.", flush=True)
    steps, batch = min(a.steps or CPU_STEPS, CPU_STEPS), min(a.batch, CPU_BATCH)
    accumulate = a.accumulate if batch % a.accumulate == 0 else 1
    changed = [f"{name} {old} -> {new}" for name, old, new in (
        ("--dtype", a.dtype, "fp32"), ("--amp", a.amp or "bf16", "none"), ("--batch", a.batch, batch),
        ("--accumulate", a.accumulate, accumulate), ("steps", a.steps or "--epochs", steps),
        ("--compile", a.compile, False), ("--cuda-graph", bool(a.cuda_graph), False),
        ("--sync-bn", a.sync_bn, False), ("--residual-stream", a.residual_stream, "fp32")) if old != new]
    # (DDP takes SyncBatchNorm on GPU modules only; without autocast the stream is the fp32 model's)
    if changed and (ranks is None or ranks.main):
        print("cvt-cutlass train: on the CPU reference path: " + ", ".join(changed), file=sys.stderr)
    a.dtype, a.amp, a.compile, a.cuda_graph, a.sync_bn = "fp32", "none", False, False, False
    a.steps, a.epochs, a.batch, a.accumulate = steps, None, batch, accumulate


def _check_args(a) -> None:
    """What would fail only after the training, or be silently ignored (ValueError: one line)."""
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {a.out} is a file; the checkpoint goes into a directory")
    if a.warmup_steps and a.schedule != "cosine":
        raise ValueError("--warmup-steps is the cosine schedule's warm-up: add --schedule cosine")
    if not a.data and a.classes < 2:
        raise ValueError(f"--classes {a.classes}: the synthetic task needs at least 2 classes")


def train_main(a) -> int:
    import torch

    from .run import load_model

    cuda = torch.cuda.is_available()
    _check_args(a)
    precision_of(a.dtype, a.amp, True)  # the same checks with or without a GPU (ValueError: one line)
    # under torchrun: this process's rank, its GPU (DDP's step in a CUDA graph only when asked)
    ranks = ranks_from_env(cuda, capture=bool(a.cuda_graph))
    if not cuda:
        _cpu_settings(a, ranks)
    if a.cuda_graph is None:
        a.cuda_graph = not a.compile and ranks is None  # the captured step by default: the batch shape is fixed
    device = torch.device(f"cuda:{ranks.local if ranks else torch.cuda.current_device()}" if cuda else "cpu")
    prec = precision_of(a.dtype, a.amp, cuda)
    task = _task(a, device)
    if ranks is not None:
        task = ShardedTask(task, ranks)
    model, label = load_model(a)
    fit_classifier(model, task.classes, getattr(task, "class_names", None))
    rc = _fit(a, model, label, task, prec, device, ranks)  # an exception ends this rank: torchrun stops the rest
    finish(ranks)
    return rc


def _describe(a, label, task, prec, total: int, ranks: Ranks | None) -> str:
    dt = str(prec.param).removeprefix("torch.")
    amp = str(prec.amp).removeprefix("torch.") if prec.amp else "off"
    procs = (f" x {ranks.world} processes (DDP{', SyncBatchNorm' if a.sync_bn else ''}, global batch "
             f"{a.batch * ranks.world})") if ranks else ""
    label = f"{label} (HF's modules, not swapped)" if a.no_swap else label
    return (f"cvt-cutlass train: {label}, {task.classes} classes, {total} steps of batch {a.batch}{procs} at "
            f"{a.image_size}x{a.image_size}, {dt} parameters, autocast {amp}, {a.optimizer} lr {a.lr}"
            f"{', cosine schedule' if a.schedule == 'cosine' else ''}"
            f"{f', clip {a.clip_norm}' if a.clip_norm else ''}{f', {a.accumulate} micro-batches' if a.accumulate > 1 else ''}"
            f"{', torch.compile' if a.compile else ''}{', the step in a CUDA graph' if a.cuda_graph else ''}; "
            f"checkpoint to {Path(a.out).resolve()}")


class Timing(NamedTuple):
    secs: float  # every step, the first ones (kernel loading, warm-up, capture) included
    steady_from: int  # the steps from this index on are the steady part
    steady_ms: float | None  # ms per steady step (None: too few steps)


def _run_steps(a, runner, opt, prec, task, total: int, device, opts, ranks: Ranks | None = None):
    """(losses as device tensors, kernel calls / fallbacks of one counted step, Timing) of
    ``total`` steps, with no host sync per step; the progress line (img/s over all ranks) on
    rank 0 only."""
    from .. import fallback
    from ..graphs import using_stage_graphs

    world, quiet = (1, False) if ranks is None else (ranks.world, not ranks.main)
    bar, losses = Progress(total, a.batch * world, quiet=quiet), []
    t0 = time.perf_counter()
    if a.cuda_graph:
        step, counted = _captured(runner, opt, prec, task, a.batch, _warm_steps(ranks), losses, bar, opts)
    else:
        step, counted = make_step(runner, opt, prec, device.type, opts), None
    counted_step = min(total - 1, 2)  # a step after the first ones (compilation, builds)
    steady_from = min(total, max(len(losses), counted_step + 2))
    t_steady = None
    for i in range(len(losses), total):
        if i == steady_from:
            t_steady = _synced_clock(device)
        x, y = task.batch(a.batch)
        if counted is None and i == counted_step:
            fallback.reset()
            with using_stage_graphs(False):  # counted as launched (a stage graph's replay calls no op)
                loss = step(x, y)
            counted = fallback.stats()
        else:
            loss = step(x, y)
        losses.append(loss)
        bar.update(i, loss, force=i + 1 == total)
    end = _synced_clock(device)
    steady = (end - t_steady) * 1e3 / (total - steady_from) if t_steady is not None else None
    return losses, counted, Timing(end - t0, steady_from, steady)


def _synced_clock(device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _runner(model, device, ranks: Ranks | None, capture: bool):
    """What the step calls: the model, or DDP around it (built on a side stream when the step is
    captured in a CUDA graph, as PyTorch's whole-network capture recipe for DDP asks)."""
    if ranks is None:
        return model
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    # the gradients are views into DDP's all-reduce buckets: no copy into and out of them
    make = functools.partial(DDP, model, device_ids=[ranks.local] if device.type == "cuda" else None,
                             gradient_as_bucket_view=True)
    if not capture:
        return make()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        runner = make()
    torch.cuda.current_stream(device).wait_stream(side)
    return runner


def _fit(a, model, label, task, prec, device, ranks: Ranks | None = None) -> int:
    import torch

    from ..swap import swap

    model = model.to(device, prec.param).train()
    if a.sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if not a.no_swap:
        swap(model, residual_stream=a.residual_stream)
    total = a.steps or a.epochs * task.steps_per_epoch(a.batch)
    if a.cuda_graph and total <= _warm_steps(ranks):  # no step left to replay after the eager warm-up
        print(f"cvt-cutlass train: {total} steps run eagerly (a CUDA graph replays after {_warm_steps(ranks)} "
              "eager steps)", file=sys.stderr)
        a.cuda_graph = False
    # fused SGD / AdamW on a GPU; the rate a tensor in a graph, so that the schedule reaches it
    opt = make_optimizer(model.parameters(), a.optimizer, a.lr, a.weight_decay, lr_tensor=a.cuda_graph)
    runner = _runner(model, device, ranks, a.cuda_graph)
    runner = torch.compile(runner) if a.compile else runner
    sched = cosine_schedule(opt, total, a.warmup_steps) if a.schedule == "cosine" else None
    opts = StepOptions(a.clip_norm, a.accumulate, sched)
    main = ranks is None or ranks.main
    if main:
        print(_describe(a, label, task, prec, total, ranks), flush=True)
    losses, counted, timing = _run_steps(a, runner, opt, prec, task, total, device, opts, ranks)
    losses = _loss_values(losses, ranks)
    if ranks is not None and not _check_ranks(model, prec, device, ranks):
        return 1
    if not main:
        return 0 if math.isfinite(losses[-1]) else 1
    return _report(a, model, losses, counted, timing, ranks)


def _loss_values(losses: list, ranks: Ranks | None) -> list[float]:
    """The steps' losses as floats (one sync); over several ranks the mean of the ranks' losses,
    which is the loss of the global batch (the ranks' shares are equal)."""
    import torch

    values = torch.stack([torch.as_tensor(v).detach().float().reshape(()) for v in losses])
    if ranks is not None:
        values = mean_over_ranks(values)
    return values.tolist()


def _check_ranks(model, prec, device, ranks: Ranks) -> bool:
    """Whether the ranks hold equal parameters (DDP kept one model); rank 0 prints it with what an
    all-reduce of the whole gradient costs on this machine."""
    agree = ranks_agree(model.parameters(), ranks)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ms = allreduce_ms(numel, device, prec.param)
    if ranks.main:
        size = numel * prec.param.itemsize / 2**20
        print(f"parameters equal on all {ranks.world} ranks: {'yes' if agree else 'NO'}; one all-reduce of "
              f"the whole gradient ({numel / 1e6:.1f} M {str(prec.param).removeprefix('torch.')} values, "
              f"{size:.0f} MiB) over {ranks.world} ranks: {ms:.2f} ms (median of 20)", flush=True)
    return agree


def _report(a, model, losses: list[float], counted, timing: Timing, ranks: Ranks | None) -> int:
    """Rank 0's end: the checkpoint (HF format), the losses as CSV beside it, the summary line."""
    from ..swap import unswap

    if not a.no_swap:
        unswap(model)
    out = Path(a.out)
    model.save_pretrained(out)
    (out / "train_losses.csv").write_text("step,loss\n" + "".join(f"{i},{v:.6f}\n" for i, v in enumerate(losses)))
    calls, fbs = sum(counted["kernel_calls"].values()), counted["fallbacks"]
    last, world = min(10, len(losses)), ranks.world if ranks else 1
    total = len(losses)
    steady = ""
    if timing.steady_ms is not None:
        steady = (f"; steady {timing.steady_ms:.2f} ms/step, {a.batch * world * 1e3 / timing.steady_ms:.0f} img/s "
                  f"(steps {timing.steady_from + 1}-{total})")
    print(f"loss {losses[0]:.4f} -> {sum(losses[-last:]) / last:.4f} (mean of the last {last} step"
          f"{'s' if last > 1 else ''}{f', the global batch: the mean over {world} ranks' if ranks else ''}); "
          f"{total * a.batch * world / timing.secs:.0f} img/s over all {total} steps ({timing.secs:.1f} s){steady}; "
          f"one step: {calls} CUTLASS kernel calls, {sum(fbs.values())} fallbacks{' ' + str(fbs) if fbs else ''}; "
          f"checkpoint (HF format) and train_losses.csv: {out}")
    if not math.isfinite(losses[-1]):
        print("cvt-cutlass train: the loss is not finite at the end")
        return 1
    return 0
