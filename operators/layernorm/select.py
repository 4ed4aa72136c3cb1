"""The LayerNorm kernel for a problem: the tuned table's row, else the heuristic.

Table key: (m, n, k) = (rows of all images, channels, 1); epilogue ``ln`` (forward) or
``ln_bwd``.
"""

from __future__ import annotations

from collections.abc import Iterator

from ...models import CvtShape, ImageSize
from ..selection import BatchesOf, Choice, lookup_spec, selector
from ..spec import KernelSpec
from .problems import layernorm_problems
from .spec import layernorm_candidates, layernorm_heuristic


def table_key(rows: int, channels: int, pass_: str = "fwd") -> tuple[str, int, int, int]:
    """(epilogue, m, n, k) a LayerNorm problem is filed under."""
    return ("ln" if pass_ == "fwd" else f"ln_{pass_}"), rows, channels, 1


@selector
def select_layernorm(rows: int, channels: int, dtype: str, arch: int, gpu: str | None = None,
                     pass_: str = "fwd", io: str = "") -> Choice:
    """The LayerNorm kernel for ``rows`` rows (all images) of ``channels`` channels; ``io``: its
    fp32 side (spec.py), on the split the table gives the 16-bit kernel."""
    spec = lookup_spec("layernorm", arch, dtype, *table_key(rows, channels, pass_), gpu)
    if spec is not None and (spec.arch, spec.dtype, spec.channels, spec.pass_) == (arch, dtype, channels, pass_):
        return Choice(spec.with_(io=io), "table")
    return Choice(layernorm_heuristic(dtype, channels, arch, pass_).with_(io=io), "heuristic")


def model_specs(cfg: CvtShape, size: ImageSize, dtype: str, arch: int, gpu: str | None, batches_of: BatchesOf,
                training: bool = False) -> Iterator[KernelSpec]:
    """The LayerNorm kernels a swapped CvT calls at the batch sizes ``batches_of`` names (and, when
    ``training``, their backward kernels). Without a cls token HF normalises the head's (B, C, H*W)
    view permuted: its channels are not contiguous and PyTorch runs that forward."""
    for nl in layernorm_problems(cfg, 1, size):
        if nl.label == "head_ln" and not cfg.cls_token[-1]:
            continue
        for b in batches_of("layernorm", *table_key(nl.rows, nl.channels)):
            yield select_layernorm(b * nl.rows, nl.channels, dtype, arch, gpu).spec
    if training:
        for nl in layernorm_problems(cfg, 1, size):
            for b in batches_of("layernorm", *table_key(nl.rows, nl.channels, "bwd")):
                yield select_layernorm(b * nl.rows, nl.channels, dtype, arch, gpu, "bwd").spec


def candidate_specs(cfg: CvtShape, size: ImageSize, dtype: str, arch: int) -> Iterator[KernelSpec]:
    """What a forward profile sweep tries for the model's channel counts."""
    for channels in sorted({nl.channels for nl in layernorm_problems(cfg, 1, size)}):
        yield from layernorm_candidates(dtype, channels, arch)
