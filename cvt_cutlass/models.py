"""CvT configurations and their stage shapes (shape arithmetic only: no torch, no weights).

The numbers follow HF ``CvtConfig`` (CvT-13 = its defaults) and the original CvT code. Each kernel
family derives the problems a model runs from these (``operators/<family>/problems.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


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


def _conv_out(size: int, k: int, s: int, p: int) -> int:
    return (size + 2 * p - k) // s + 1


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
        h = _conv_out(h, cfg.patch_sizes[i], cfg.patch_stride[i], cfg.patch_padding[i])
        w = _conv_out(w, cfg.patch_sizes[i], cfg.patch_stride[i], cfg.patch_padding[i])
        hq = _conv_out(h, cfg.kernel_qkv[i], cfg.stride_q[i], cfg.padding_q[i])
        wq = _conv_out(w, cfg.kernel_qkv[i], cfg.stride_q[i], cfg.padding_q[i])
        hk = _conv_out(h, cfg.kernel_qkv[i], cfg.stride_kv[i], cfg.padding_kv[i])
        wk = _conv_out(w, cfg.kernel_qkv[i], cfg.stride_kv[i], cfg.padding_kv[i])
        cls = int(cfg.cls_token[i])
        out.append(
            StageShape(
                stage=i + 1, height=h, width=w, dim=cfg.embed_dim[i], heads=cfg.num_heads[i],
                depth=cfg.depth[i], tokens_q=hq * wq + cls, tokens_kv=hk * wk + cls,
                mlp_dim=int(cfg.embed_dim[i] * cfg.mlp_ratio[i]),
            )
        )
    return out


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
        return _conv_out(self.h, self.r, self.stride, self.pad)

    @property
    def q(self) -> int:
        return _conv_out(self.w, self.r, self.stride, self.pad)

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


@dataclass(frozen=True)
class AttentionLayer:
    """One attention problem of the model: q (n, lq, heads, head_dim), k/v (n, lkv, heads, head_dim)."""

    label: str  # "s1.attn" ...
    n: int
    heads: int
    lq: int
    lkv: int
    head_dim: int
    scale: float  # CvT: embed_dim ** -0.5 (not head_dim ** -0.5)
    count: int

    @property
    def flops(self) -> int:
        return 4 * self.n * self.heads * self.lq * self.lkv * self.head_dim


def attention_problems(cfg: CvtShape | str, batch: int, image_size: ImageSize = None) -> list[AttentionLayer]:
    """The attention of every stage (lengths include the cls token)."""
    if isinstance(cfg, str):
        cfg = get_config(cfg)
    out = []
    for st in stage_shapes(cfg, image_size):
        out.append(AttentionLayer(f"s{st.stage}.attn", batch, st.heads, st.tokens_q, st.tokens_kv,
                                  st.dim // st.heads, st.dim ** -0.5, st.depth))
    return out


@dataclass(frozen=True)
class NormLayer:
    """One LayerNorm kind of the model over (rows, channels) tokens; ``prefix`` rows (the cls
    token) are written in front of each image's output ("embed": after the token embedding)."""

    label: str  # "s1.embed_ln", "s1.ln1", "s1.ln2", "head_ln"
    rows: int  # all images
    channels: int
    prefix: int
    count: int


def layernorm_problems(cfg: CvtShape | str, batch: int, image_size: ImageSize = None) -> list[NormLayer]:
    """Every LayerNorm of a forward pass: after each token embedding (cls written in front), before
    attention and before the MLP of each block; the head's on the cls token (or mean token)."""
    if isinstance(cfg, str):
        cfg = get_config(cfg)
    out = []
    for st in stage_shapes(cfg, image_size):
        cls = int(cfg.cls_token[st.stage - 1])
        s = f"s{st.stage}"
        out += [NormLayer(f"{s}.embed_ln", batch * (st.tokens_q - cls), st.dim, cls, 1),
                NormLayer(f"{s}.ln1", batch * st.tokens_q, st.dim, 0, st.depth),
                NormLayer(f"{s}.ln2", batch * st.tokens_q, st.dim, 0, st.depth)]
    out.append(NormLayer("head_ln", batch, cfg.embed_dim[-1], 0, 1))
    return out
