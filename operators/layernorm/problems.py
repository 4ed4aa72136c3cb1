"""The LayerNorm problems of a CvT (shape arithmetic only, from :mod:`cvt_cutlass.models`)."""

from __future__ import annotations

from dataclasses import dataclass

from ...models import CvtShape, ImageSize, get_config, stage_shapes


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
