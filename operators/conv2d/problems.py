"""The convolutions of a CvT (shape arithmetic only, from :mod:`cvt_cutlass.models`): each stage's
token embedding (this family's problems) and, since their geometry follows it, the depthwise q
and k/v projections the dwconv family runs."""

from __future__ import annotations

from dataclasses import dataclass

from ...models import CvtShape, ImageSize, conv_out, get_config, image_hw


@dataclass(frozen=True)
class ConvLayer:
    """One conv of the model. kind "embed": dense conv (token embedding), input (n, h, w, c)
    -> (n, p, q, k). kind "dwconv": depthwise conv projection, c = k, ``cls`` rows in front of
    each image's tokens pass through."""

    label: str  # e.g. "s1.embed", "s2.dw_q", "s3.dw_kv"
    kind: str
    n: int
    h: int
    w: int
    c: int
    k: int
    r: int
    stride: int
    pad: int
    cls: int
    count: int  # times a forward pass runs it (dw_kv: k and v, so 2 per block)

    @property
    def p(self) -> int:
        return conv_out(self.h, self.r, self.stride, self.pad)

    @property
    def q(self) -> int:
        return conv_out(self.w, self.r, self.stride, self.pad)

    @property
    def flops(self) -> int:
        macs = self.r * self.r * (1 if self.kind == "dwconv" else self.c)
        return 2 * self.n * self.p * self.q * self.k * macs


def conv_problems(cfg: CvtShape | str, batch: int, image_size: ImageSize = None,
                  in_channels: int = 3) -> list[ConvLayer]:
    """Every conv of a CvT forward pass: each stage's token embedding, then its depthwise q and
    k/v projections (k and v share a problem). ``image_size`` may be (H, W) for odd sizes."""
    if isinstance(cfg, str):
        cfg = get_config(cfg)
    h, w = image_hw(cfg, image_size)
    c = in_channels
    out = []
    for i, dim in enumerate(cfg.embed_dim):
        s = f"s{i + 1}"
        emb = ConvLayer(f"{s}.embed", "embed", batch, h, w, c, dim, cfg.patch_sizes[i], cfg.patch_stride[i],
                        cfg.patch_padding[i], 0, 1)
        out.append(emb)
        h, w, c = emb.p, emb.q, dim
        cls = int(cfg.cls_token[i])
        depth = cfg.depth[i]
        out.append(ConvLayer(f"{s}.dw_q", "dwconv", batch, h, w, dim, dim, cfg.kernel_qkv[i], cfg.stride_q[i],
                             cfg.padding_q[i], cls, depth))
        out.append(ConvLayer(f"{s}.dw_kv", "dwconv", batch, h, w, dim, dim, cfg.kernel_qkv[i], cfg.stride_kv[i],
                             cfg.padding_kv[i], cls, 2 * depth))
    return out
