"""Training data for ``cvt-cutlass train`` and the tests: a synthetic task with a learnable
signal, and an ImageFolder directory (decoded once, kept in memory).

``ImageFolderTask`` reads ``root/<class>/<file>`` (classes in sorted order): images with Pillow
(``pip install -e '.[data]'``), or ``.npy`` / ``.pt`` tensors (3, H, W), resized to the image size
and normalised with ImageNet's mean and std. Every image file is checked up front (Pillow's
``verify``, which reads the file without decoding it): a file that is not an image is an error
naming it, or, with ``skip_bad=True``, left out with one warning that counts them.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff"}
TENSOR_SUFFIXES = {".npy", ".pt"}


def share(b: int, part: int, parts: int) -> tuple[int, int]:
    """Rows [lo, hi) of part ``part`` of ``parts`` equal parts of a batch of ``b``."""
    if b % parts or not 0 <= part < parts:
        raise ValueError(f"part {part} of {parts} of a batch of {b}: the batch splits into equal parts")
    return part * b // parts, (part + 1) * b // parts


class SyntheticTask:
    """Images of ``classes`` classes: class c is a fixed smooth random pattern (a 7x7 grid
    upsampled to the image size) plus unit Gaussian noise, so the class is learnable but not
    trivial. ``batch(b)`` returns (images (b, 3, S, S) fp32, labels (b,)) on ``device``;
    ``batch(b, part, parts)`` only rows ``[part * b / parts, (part + 1) * b / parts)`` of that same
    batch: each process of a run over several draws just its share (the noise comes in blocks of
    ``NOISE_ROWS`` rows, each block from its own seed, so that any share can be drawn alone)."""

    NOISE_ROWS = 16

    def __init__(self, classes: int, size: int, device, seed: int = 0):
        import torch
        import torch.nn.functional as F

        self.classes, self.size, self.device = classes, size, device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.seeds = torch.Generator().manual_seed(seed)  # on the host: a batch's block seeds, no sync
        self.noise_gen = torch.Generator(device=device)
        grid = torch.randn(classes, 3, 7, 7, generator=self.gen, device=device)
        self.templates = F.interpolate(grid, size=(size, size), mode="bilinear", align_corners=False)

    def batch(self, b: int, part: int = 0, parts: int = 1):
        import torch

        lo, hi = share(b, part, parts)
        y = torch.randint(0, self.classes, (b,), generator=self.gen, device=self.device)
        base = int(torch.randint(0, 2**62, (1,), generator=self.seeds))
        k = self.NOISE_ROWS
        blocks = []
        for blk in range(lo // k, (hi + k - 1) // k):
            self.noise_gen.manual_seed(base + blk)
            rows = min(k, b - blk * k)
            blocks.append(torch.randn(rows, 3, self.size, self.size, generator=self.noise_gen, device=self.device))
        first = (lo // k) * k  # the first drawn row
        noise = (torch.cat(blocks) if len(blocks) > 1 else blocks[0])[lo - first:hi - first]
        return self.templates[y[lo:hi]] + noise, y[lo:hi]

    def steps_per_epoch(self, batch: int) -> int:
        return 100  # an epoch of the synthetic task is 100 batches


class ImageFolderTask:
    """An ImageFolder directory: ``root/<class>/<file>``; classes in sorted order. Images are
    decoded once (Pillow, or .npy / .pt tensors) at ``size`` x ``size`` and kept in memory as uint8
    (pillow images) or float tensors; each epoch visits them in a new random order. Over several
    processes each decodes only the files of its share of each batch (over several epochs a file
    may fall to every rank, and be kept by each)."""

    def __init__(self, root: str | Path, size: int, device, seed: int = 0, skip_bad: bool = False):
        import torch

        self.root, self.size, self.device = Path(root), size, device
        if not self.root.is_dir():
            raise ValueError(f"--data {root}: not a directory")
        self.class_names = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        files = [(f, i) for i, c in enumerate(self.class_names) for f in sorted((self.root / c).rglob("*"))
                 if f.suffix.lower() in IMAGE_SUFFIXES | TENSOR_SUFFIXES]
        self.files = _checked(files, skip_bad)
        if len(self.class_names) < 2 or not self.files:
            raise ValueError(f"--data {root}: needs at least 2 class folders with images "
                             f"({', '.join(sorted(IMAGE_SUFFIXES | TENSOR_SUFFIXES))}); found "
                             f"{len(self.class_names)} folders, {len(self.files)} usable files")
        self.classes = len(self.class_names)
        self.gen = torch.Generator().manual_seed(seed)
        self._cache: dict[int, object] = {}
        self._order: list[int] = []

    def _load(self, i: int):
        import torch
        import torch.nn.functional as F

        if i not in self._cache:
            path = self.files[i][0]
            try:
                x = _decode(path)
            except (OSError, RuntimeError, EOFError) as e:  # Pillow's decode errors, torch.load's
                raise ValueError(f"--data: cannot read {path}: {e}") from e
            if x.shape[-2:] != (self.size, self.size):
                x = F.interpolate(x[None].float(), size=(self.size, self.size), mode="bilinear",
                                  align_corners=False, antialias=True)[0]
            self._cache[i] = x.to(torch.uint8) if x.dtype == torch.uint8 or path.suffix.lower() in IMAGE_SUFFIXES \
                else x.float()
        return self._cache[i]

    def batch(self, b: int, part: int = 0, parts: int = 1):
        """(images, labels) of the next ``b`` files of the epoch's order; with ``(part, parts)`` only
        rows ``[part * b / parts, (part + 1) * b / parts)`` of that batch (every process walks the
        same order and decodes only its share: DistributedSampler's partition, per batch)."""
        import torch

        lo, hi = share(b, part, parts)
        idx = []
        while len(idx) < b:
            if not self._order:
                self._order = torch.randperm(len(self.files), generator=self.gen).tolist()
            idx.append(self._order.pop())
        idx = idx[lo:hi]
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
        from PIL import Image  # present: _checked asked it about this file

        with Image.open(path) as im:
            x = torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)
    if x.dim() != 3 or x.shape[0] != 3:
        raise ValueError(f"--data: {path} is not a 3-channel image (got shape {tuple(x.shape)})")
    return x


def _checked(files: list, skip_bad: bool) -> list:
    """``files`` whose image files Pillow can read (``verify``: the header and structure, not the
    pixels); a bad one raises naming it, or with ``skip_bad`` is left out (one warning counting them)."""
    bad = [(f, why) for f, _ in files if f.suffix.lower() in IMAGE_SUFFIXES for why in [_not_an_image(f)] if why]
    if not bad:
        return files
    if not skip_bad:
        f, why = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ValueError(f"--data: {f} is not a readable image: {why}{more}; remove it, or pass --skip-bad-images")
    print(f"cvt-cutlass train: skipping {len(bad)} unreadable image file(s) under --data, e.g. {bad[0][0]}",
          file=sys.stderr)
    skipped = {f for f, _ in bad}
    return [(f, i) for f, i in files if f not in skipped]


def _not_an_image(path: Path) -> str | None:
    """Why Pillow cannot read ``path`` as an image (None when it can)."""
    try:
        from PIL import Image
    except ImportError:
        raise ValueError(f"--data: reading {path.name} needs Pillow (pip install -e '.[data]', or pip install "
                         "pillow), or store the images as .npy / .pt tensors (3, H, W)") from None
    try:
        with Image.open(path) as im:
            im.verify()
    except Exception as e:  # Pillow raises UnidentifiedImageError, OSError, SyntaxError, ... for bad files
        return f"{type(e).__name__}: {e}"
    return None
