"""CvT configurations and their stage shapes (shape arithmetic only: no torch, no weights).

The numbers follow HF ``CvtConfig`` (CvT-13 = its defaults) and the original CvT code. Each kernel
family derives the problems a model runs from these (``operators/<family>/problems.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (no torch import at module level)
    from torch import Tensor


@dataclass(frozen=True)
class CvtShape:
    name: str
    embed_dim: tuple[int, ...]
    num_heads: tuple[int, ...]
    depth: tuple[int, ...]
    patch_sizes: tuple[int, ...] = (7, 3, 3)
    patch_stride: tuple[int, ...] = (4, 2, 2)
    patch_padding: tuple[int, ...] = (2, 1, 1)
    cls_token: tuple[bool, ...] = (False, False, True)
    mlp_ratio: tuple[float, ...] = (4.0, 4.0, 4.0)
    stride_kv: tuple[int, ...] = (2, 2, 2)
    stride_q: tuple[int, ...] = (1, 1, 1)
    kernel_qkv: tuple[int, ...] = (3, 3, 3)
    padding_kv: tuple[int, ...] = (1, 1, 1)
    padding_q: tuple[int, ...] = (1, 1, 1)
    qkv_bias: tuple[bool, ...] = (True, True, True)
    num_labels: int = 1000
    image_size: int = 224


CONFIGS: dict[str, CvtShape] = {
    "cvt-13": CvtShape("cvt-13", (64, 192, 384), (1, 3, 6), (1, 2, 10)),
    "cvt-21": CvtShape("cvt-21", (64, 192, 384), (1, 3, 6), (1, 4, 16)),
    "cvt-w24": CvtShape("cvt-w24", (192, 768, 1024), (3, 12, 16), (2, 2, 20), image_size=384),
}


def shape_of(config, name: str = "custom") -> CvtShape:
    """The CvtShape of a HF ``CvtConfig`` (or anything with its attribute names)."""
    t = lambda v: tuple(v)  # noqa: E731
    return CvtShape(name, t(config.embed_dim), t(config.num_heads), t(config.depth), t(config.patch_sizes),
                    t(config.patch_stride), t(config.patch_padding), tuple(bool(c) for c in config.cls_token),
                    tuple(float(r) for r in config.mlp_ratio), t(config.stride_kv), t(config.stride_q),
                    t(config.kernel_qkv), t(config.padding_kv), t(config.padding_q),
                    tuple(bool(b) for b in config.qkv_bias), int(getattr(config, "num_labels", 1000)))


def get_config(name: str) -> CvtShape:
    try:
        return CONFIGS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown CvT config {name!r}; have {sorted(CONFIGS)}") from None


def conv_out(size: int, k: int, s: int, p: int) -> int:
    """A convolution's output size along one dimension (input size, kernel, stride, padding)."""
    return (size + 2 * p - k) // s + 1


# ----------------------------------------------------------------------------- stage outputs
def split_rows(t: Tensor, h: int, w: int, rows: int) -> tuple[Tensor, Tensor | None]:
    """A stage's token rows t (B, rows + h * w, C), cls first, as its outputs: (tokens as an NCHW
    view (B, C, h, w), cls rows (B, rows, C) or None); views of t."""
    return t[:, rows:].unflatten(1, (h, w)).permute(0, 3, 1, 2), (t[:, :rows] if rows else None)


def output_geometry(stage, x: Tensor) -> tuple[int, int, int, int, int]:
    """(B, H', W', C, cls rows) of the stage's outputs on x."""
    conv = stage.embedding.convolution_embeddings.projection
    (k, _), (s, _), (p, _) = conv.kernel_size, conv.stride, conv.padding
    rows = 1 if stage.config.cls_token[stage.stage] else 0
    return x.shape[0], conv_out(x.shape[2], k, s, p), conv_out(x.shape[3], k, s, p), conv.out_channels, rows


@dataclass(frozen=True)
class StageShape:
    stage: int
    height: int
    width: int
    dim: int
    heads: int
    depth: int
    tokens_q: int  # including the cls token
    tokens_kv: int  # including the cls token
    mlp_dim: int


ImageSize = int | tuple[int, int] | None  # square side, (H, W), or None for the config's own size


def image_hw(cfg: CvtShape, image_size: ImageSize) -> tuple[int, int]:
    """(H, W) of an image size argument."""
    if isinstance(image_size, tuple):
        return int(image_size[0]), int(image_size[1])
    side = image_size or cfg.image_size
    return side, side


def stage_shapes(cfg: CvtShape, image_size: ImageSize = None) -> list[StageShape]:
    h, w = image_hw(cfg, image_size)
    out = []
    for i in range(len(cfg.embed_dim)):
        h = conv_out(h, cfg.patch_sizes[i], cfg.patch_stride[i], cfg.patch_padding[i])
        w = conv_out(w, cfg.patch_sizes[i], cfg.patch_stride[i], cfg.patch_padding[i])
        hq = conv_out(h, cfg.kernel_qkv[i], cfg.stride_q[i], cfg.padding_q[i])
        wq = conv_out(w, cfg.kernel_qkv[i], cfg.stride_q[i], cfg.padding_q[i])
        hk = conv_out(h, cfg.kernel_qkv[i], cfg.stride_kv[i], cfg.padding_kv[i])
        wk = conv_out(w, cfg.kernel_qkv[i], cfg.stride_kv[i], cfg.padding_kv[i])
        cls = int(cfg.cls_token[i])
        out.append(
            StageShape(
                stage=i + 1, height=h, width=w, dim=cfg.embed_dim[i], heads=cfg.num_heads[i],
                depth=cfg.depth[i], tokens_q=hq * wq + cls, tokens_kv=hk * wk + cls,
                mlp_dim=int(cfg.embed_dim[i] * cfg.mlp_ratio[i]),
            )
        )
    return out
