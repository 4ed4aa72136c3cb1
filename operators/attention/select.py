"""The attention kernel for a problem: the tuned table's row, else the heuristic.

Table key: (m, n, k) = (batch * Lq, Lkv, head dim); epilogue ``h<heads>`` (forward) or
``h<heads>_bwd``.
"""

from __future__ import annotations

from collections.abc import Iterator

from ...models import CvtShape, ImageSize
from ..selection import BatchesOf, Choice, lookup_spec, selector
from ..spec import KernelSpec
from .problems import attention_problems
from .spec import AttnShortBwdSpec, AttnShortSpec, attn_bwd_heuristic, attn_candidates, attn_heuristic


def table_key(batch: int, heads: int, lq: int, lkv: int, head_dim: int,
              pass_: str = "fwd") -> tuple[str, int, int, int]:
    """(epilogue, m, n, k) an attention problem is filed under."""
    return (f"h{heads}" if pass_ == "fwd" else f"h{heads}_{pass_}"), batch * lq, lkv, head_dim


def _serves(spec: KernelSpec, head_dim: int, lq: int, lkv: int) -> bool:
    if isinstance(spec, (AttnShortSpec, AttnShortBwdSpec)):
        return spec.serves(head_dim, lkv)
    return spec.serves(head_dim, lq) if spec.arch == 90 else spec.serves(head_dim)


@selector
def select_attention(batch: int, heads: int, lq: int, lkv: int, head_dim: int, dtype: str, arch: int,
                     gpu: str | None = None, pass_: str = "fwd") -> Choice:
    """The attention kernel (``pass_`` ``fwd`` or ``bwd``) for q (batch, lq, heads, head_dim) and
    k/v (batch, lkv, heads, head_dim). Example 88 (arch 90) kernels serve only the sm90 path."""
    spec = lookup_spec("attention", arch, dtype, *table_key(batch, heads, lq, lkv, head_dim, pass_), gpu)
    if spec is not None:
        ok = _serves(spec, head_dim, lq, lkv)
        if spec.dtype == dtype and spec.pass_ == pass_ and ok and (spec.arch != 90 or arch == 90):
            return Choice(spec, "table")
    if pass_ == "fwd":
        return Choice(attn_heuristic(dtype, head_dim, lq, arch, lkv), "heuristic")
    return Choice(attn_bwd_heuristic(dtype, head_dim, arch, lkv), "heuristic")


def model_specs(cfg: CvtShape, size: ImageSize, dtype: str, arch: int, gpu: str | None, batches_of: BatchesOf,
                training: bool = False) -> Iterator[KernelSpec]:
    """The attention kernels a swapped CvT calls at the batch sizes ``batches_of`` names (and, when
    ``training``, their backward kernels)."""
    for pass_ in ("fwd", "bwd") if training else ("fwd",):
        for a in attention_problems(cfg, 1, size):
            for b in batches_of("attention", *table_key(1, a.heads, a.lq, a.lkv, a.head_dim, pass_)):
                yield select_attention(b, a.heads, a.lq, a.lkv, a.head_dim, dtype, arch, gpu, pass_).spec


def candidate_specs(cfg: CvtShape, size: ImageSize, dtype: str, arch: int) -> Iterator[KernelSpec]:
    """What a forward profile sweep tries for the model's attention problems (head dim, key length)."""
    seen = set()
    for a in attention_problems(cfg, 1, size):
        for spec in attn_candidates(dtype, a.head_dim, arch, a.lkv):
            if spec not in seen:
                seen.add(spec)
                yield spec
