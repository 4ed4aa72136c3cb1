"""The attention problems of a CvT: one per stage (shape arithmetic only, from
:mod:`cvt_cutlass.models`)."""

from __future__ import annotations

from dataclasses import dataclass

from ...models import CvtShape, ImageSize, get_config, stage_shapes


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
