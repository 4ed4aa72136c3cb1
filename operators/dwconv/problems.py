"""The depthwise convolutions of a CvT: each stage's q and k/v projections (their geometry follows
the token embedding's, so :mod:`..conv2d.problems` derives them with it)."""

from __future__ import annotations

from ...models import CvtShape, ImageSize
from ..conv2d.problems import ConvLayer, conv_problems


def dwconv_problems(cfg: CvtShape | str, batch: int, image_size: ImageSize = None) -> list[ConvLayer]:
    """The depthwise q and k/v projections of every stage (k and v share a problem)."""
    return [lay for lay in conv_problems(cfg, batch, image_size) if lay.kind == "dwconv"]
