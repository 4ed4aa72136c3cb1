"""``cvt-cutlass train``: fine-tune a CvT on the CUTLASS kernels.

1. the model: ``--checkpoint`` (anything :func:`cvt_cutlass.load_cvt` reads: a HF directory, a
   ``.safetensors`` file, an original ``.pth``) or ``--model`` (a named config, random init). When
   the data has another number of classes than the classifier, the classifier is replaced by a
   fresh ``nn.Linear`` (as HF's ``ignore_mismatched_sizes``) and the config's labels follow;
2. the data: ``--data DIR`` in the ImageFolder layout (one folder per class; images decoded with
   Pillow, or ``.npy`` / ``.pt`` tensors (3, H, W)), resized to ``--image-size`` and normalised
   with ImageNet's mean and std, shuffled each epoch; by default a synthetic task with a learnable
   signal (:class:`SyntheticTask`: each class a fixed smooth pattern under unit Gaussian noise);
3. precision as users run it: ``--dtype fp32`` master weights under ``torch.autocast`` in
   ``--amp bf16`` (the default on a GPU) or ``fp16`` (with ``torch.amp.GradScaler``: a step whose
   gradients overflow is skipped, as with any PyTorch model), or ``--dtype bf16/fp16``: a pure
   low-precision model;
4. the step: ``cvt_cutlass.swap`` (the fused stages train on the kernels), cross-entropy, SGD with
   momentum (or ``--optimizer adamw``), optionally ``--compile`` (torch.compile of the model); a
   progress line with the loss and img/s; at the end a checkpoint in HF format
   (``save_pretrained``, the model unswapped first: the state dict is HF's either way) and a
   summary with the CUTLASS kernel calls and fallbacks of one step.

Without a GPU it says so and runs a few steps of the CPU reference path (fp32, small batch): the
swapped model's ops run their PyTorch references, every call counted as a fallback.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff"}
TENSOR_SUFFIXES = {".npy", ".pt"}
CPU_STEPS, CPU_BATCH = 3, 2


# ----------------------------------------------------------------------------- data
class SyntheticTask:
    """Images of ``classes`` classes: class c is a fixed smooth random pattern (a 7x7 grid
    upsampled to the image size) plus unit Gaussian noise, so the class is learnable but not
    trivial. ``batch(b)`` returns (images (b, 3, S, S) fp32, labels (b,)) on ``device``."""

    def __init__(self, classes: int, size: int, device, seed: int = 0):
        import torch
        import torch.nn.functional as F

        self.classes, self.size, self.device = classes, size, device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        grid = torch.randn(classes, 3, 7, 7, generator=self.gen, device=device)
        self.templates = F.interpolate(grid, size=(size, size), mode="bilinear", align_corners=False)

    def batch(self, b: int):
        import torch

        y = torch.randint(0, self.classes, (b,), generator=self.gen, device=self.device)
        noise = torch.randn(b, 3, self.size, self.size, generator=self.gen, device=self.device)
        return self.templates[y] + noise, y

    def steps_per_epoch(self, batch: int) -> int:
        return 100  # an epoch of the synthetic task is 100 batches


class ImageFolderTask:
    """An ImageFolder directory: ``root/<class>/<file>``; classes in sorted order. Images are
    decoded once (Pillow, or .npy / .pt tensors) at ``size`` x ``size`` and kept in memory as uint8
    (pillow images) or float tensors; each epoch visits them in a new random order."""

    def __init__(self, root: str | Path, size: int, device, seed: int = 0):
        import torch

        self.root, self.size, self.device = Path(root), size, device
        if not self.root.is_dir():
            raise ValueError(f"--data {root}: not a directory")
        self.class_names = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        self.files = [(f, i) for i, c in enumerate(self.class_names) for f in sorted((self.root / c).rglob("*"))
                      if f.suffix.lower() in IMAGE_SUFFIXES | TENSOR_SUFFIXES]
        if len(self.class_names) < 2 or not self.files:
            raise ValueError(f"--data {root}: needs at least 2 class folders with images "
                             f"({', '.join(sorted(IMAGE_SUFFIXES | TENSOR_SUFFIXES))}); found "
                             f"{len(self.class_names)} folders, {len(self.files)} files")
        self.classes = len(self.class_names)
        self.gen = torch.Generator().manual_seed(seed)
        self._cache: dict[int, object] = {}
        self._order: list[int] = []

    def _load(self, i: int):
        import torch
        import torch.nn.functional as F

        if i not in self._cache:
            path = self.files[i][0]
            x = _decode(path)
            if x.shape[-2:] != (self.size, self.size):
                x = F.interpolate(x[None].float(), size=(self.size, self.size), mode="bilinear",
                                  align_corners=False, antialias=True)[0]
            self._cache[i] = x.to(torch.uint8) if x.dtype == torch.uint8 or path.suffix.lower() in IMAGE_SUFFIXES \
                else x.float()
        return self._cache[i]

    def batch(self, b: int):
        import torch

        idx = []
        while len(idx) < b:
            if not self._order:
                self._order = torch.randperm(len(self.files), generator=self.gen).tolist()
            idx.append(self._order.pop())
        xs = [self._load(i) for i in idx]
        x = torch.stack([t.float() / 255 if t.dtype == torch.uint8 else t for t in xs])
        mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
        y = torch.tensor([self.files[i][1] for i in idx])
        return ((x - mean) / std).to(self.device), y.to(self.device)

    def steps_per_epoch(self, batch: int) -> int:
        return max(1, math.ceil(len(self.files) / batch))


def _decode(path: Path):
    """(3, H, W): uint8 for image files (Pillow), the stored tensor for .npy / .pt."""
    import numpy as np
    import torch

    suffix = path.suffix.lower()
    if suffix == ".pt":
        x = torch.load(path, map_location="cpu", weights_only=True)
    elif suffix == ".npy":
        x = torch.from_numpy(np.load(path))
    else:
        try:
            from PIL import Image
        except ImportError as e:
            raise ValueError(f"--data: decoding {path.name} needs Pillow (pip install pillow), or store the "
                             "images as .npy / .pt tensors (3, H, W)") from e
        with Image.open(path) as im:
            x = torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)
    if x.dim() != 3 or x.shape[0] != 3:
        raise ValueError(f"--data: {path} is not a 3-channel image (got shape {tuple(x.shape)})")
    return x


# ----------------------------------------------------------------------------- model and step
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

    from . import fallback

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


# ----------------------------------------------------------------------------- the command
class Progress:
    """One progress line on stderr: step, loss (running mean of the last ``window`` steps), img/s."""

    def __init__(self, total: int, batch: int, window: int = 20):
        self.total, self.batch, self.window = total, batch, window
        self.losses: list[float] = []
        self.t0 = time.perf_counter()
        self.last = 0.0

    def update(self, i: int, loss: float, force: bool = False) -> None:
        self.losses = (self.losses + [loss])[-self.window:]
        now = time.perf_counter()
        if not force and now - self.last < 0.5:
            return
        self.last = now
        done = int(24 * (i + 1) / self.total)
        rate = (i + 1) * self.batch / max(now - self.t0, 1e-9)
        sys.stderr.write(f"\r[train] [{'#' * done}{'-' * (24 - done)}] {i + 1}/{self.total}  "
                         f"loss {sum(self.losses) / len(self.losses):.4f}  {rate:.0f} img/s ")
        sys.stderr.flush()
        if i + 1 == self.total:
            sys.stderr.write("\n")


def _captured(runner, opt, prec, task, batch: int, warm: int, losses: list, bar):
    """``--cuda-graph``: the first ``warm`` steps train eagerly (the warm-up the capture needs),
    then the captured step; (step, kernel calls / fallbacks of the last eager step)."""
    batches = [task.batch(batch) for _ in range(warm)]
    step = make_captured_step(runner, opt, prec, *batches[0], warmup=batches)
    for i, loss in enumerate(step.warmup_losses):
        losses.append(float(loss))
        bar.update(i, losses[-1], force=i + 1 == bar.total)
    return step, step.counted


def _task(a, device):
    if a.data:
        return ImageFolderTask(a.data, a.image_size, device, a.seed)
    return SyntheticTask(a.classes, a.image_size, device, a.seed)


def train_main(a) -> int:
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        print("cvt-cutlass train: no CUDA GPU is visible (torch.cuda.is_available() is False); running "
              f"{CPU_STEPS} steps of the CPU reference path (fp32, batch <= {CPU_BATCH}): the swapped model's ops "
              "run their PyTorch references, every call counted as a fallback.", flush=True)
        a.dtype, a.amp, a.compile, a.cuda_graph = "fp32", "none", False, False
        a.steps, a.epochs, a.batch = CPU_STEPS, None, min(a.batch, CPU_BATCH)
    device = torch.device("cuda" if cuda else "cpu")
    prec = precision_of(a.dtype, a.amp, cuda)
    task = _task(a, device)
    from .run import _model as load_model  # a checkpoint or a named config, as `cvt-cutlass run` loads them

    model, label = load_model(a)
    fit_classifier(model, task.classes, getattr(task, "class_names", None))
    return _fit(a, model, label, task, prec, device)


def _fit(a, model, label, task, prec, device) -> int:
    import torch

    from . import fallback
    from .swap import swap, unswap

    model = swap(model.to(device, prec.param).train())
    opt = make_optimizer(model.parameters(), a.optimizer, a.lr, a.weight_decay)
    runner = torch.compile(model) if a.compile else model
    total = a.steps or a.epochs * task.steps_per_epoch(a.batch)
    print(f"cvt-cutlass train: {label}, {task.classes} classes, {total} steps of batch {a.batch} at "
          f"{a.image_size}x{a.image_size}, {str(prec.param).removeprefix('torch.')} parameters, autocast "
          f"{str(prec.amp).removeprefix('torch.') if prec.amp else 'off'}, {a.optimizer} lr {a.lr}"
          f"{', torch.compile' if a.compile else ''}{', the step in a CUDA graph' if a.cuda_graph else ''}",
          flush=True)
    bar, losses = Progress(total, a.batch), []
    t0 = time.perf_counter()
    if a.cuda_graph:
        step, counted = _captured(runner, opt, prec, task, a.batch, min(total, 3), losses, bar)
    else:
        step, counted = make_step(runner, opt, prec, device.type), None
    for i in range(len(losses), total):
        x, y = task.batch(a.batch)
        if counted is None and i == min(total - 1, 2):  # count one step after the first ones (compilation, builds)
            fallback.reset()
        loss = step(x, y)
        if counted is None and i == min(total - 1, 2):
            counted = fallback.stats()
        losses.append(float(loss))
        bar.update(i, losses[-1], force=i + 1 == total)
    secs = time.perf_counter() - t0
    unswap(model)
    out = Path(a.out)
    model.save_pretrained(out)
    calls = sum(counted["kernel_calls"].values())
    fbs = counted["fallbacks"]
    print(f"loss {losses[0]:.4f} -> {sum(losses[-10:]) / len(losses[-10:]):.4f} (mean of the last 10 steps); "
          f"{total * a.batch / secs:.0f} img/s over {total} steps ({secs:.1f} s); one step: {calls} CUTLASS kernel "
          f"calls, {sum(fbs.values())} fallbacks{' ' + str(fbs) if fbs else ''}; checkpoint (HF format): {out}")
    if not all(math.isfinite(v) for v in losses[-1:]):
        print("cvt-cutlass train: the loss is not finite at the end")
        return 1
    return 0
