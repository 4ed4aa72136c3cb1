"""The embedding-conv kernel for a problem: the tuned table's row, else the heuristic.

Table key: (m, n, k) = (output pixels N*P*Q, output channels K, R*S*C with C as the kernels read
it: the stem's 3 channels padded to 4); epilogue ``bias`` (forward), ``dgrad`` or ``wgrad``.
"""

from __future__ import annotations

from collections.abc import Iterator

from ...models import CvtShape, ImageSize
from ..selection import BatchesOf, Choice, lookup_spec, selector
from ..spec import KernelSpec
from .problems import conv_problems
from .spec import (
    ConvRowsSpec,
    ConvRowsWgradSpec,
    conv_bwd_heuristic,
    conv_candidates,
    conv_heuristic,
    conv_window,
    stem_channels,
)


def table_key(m: int, out_channels: int, gemm_k: int, pass_: str = "fwd") -> tuple[str, int, int, int]:
    """(epilogue, m, n, k) a conv problem is filed under."""
    return ("bias" if pass_ == "fwd" else pass_), m, out_channels, gemm_k


@selector
def select_conv2d(m: int, n: int, k: int, channels: int, dtype: str, arch: int, gpu: str | None = None,
                  window: tuple[int, ...] | None = None) -> Choice:
    """The implicit-GEMM conv kernel for output pixels m = N*P*Q, n = K output channels,
    k = R*S*C (C = ``channels`` as the kernel reads them); ``window`` (spec.conv_window) the
    geometry the row-window kernel needs (a table row naming it serves only where it fits).
    SM80-class kernels (arch 89 specs) serve both paths, SM90 (wgmma) ones only the sm90 path;
    ``arch`` says which path's rows to prefer."""
    spec = lookup_spec("conv2d", arch, dtype, *table_key(m, n, k), gpu)
    if (spec is not None and spec.dtype == dtype and spec.channels_ok(channels) and (spec.arch != 90 or arch == 90)
            and (not isinstance(spec, ConvRowsSpec) or spec.serves(window))):
        return Choice(spec, "table")
    return Choice(conv_heuristic(dtype, channels, n, arch, window), "heuristic")


@selector
def select_conv2d_backward(pass_: str, m: int, n: int, k: int, channels: int, dtype: str, arch: int,
                           gpu: str | None = None, window: tuple[int, ...] | None = None) -> Choice:
    """The conv backward kernel (``pass_`` "dgrad" or "wgrad") for the conv of output pixels
    m = N*P*Q, n = K output channels, k = R*S*C; ``window`` (spec.conv_window) the geometry the
    row-window wgrad needs (a table row naming it serves only where it fits). SM80-class and
    row-window kernels serve both paths, the SM90 wgrad only the sm90 path."""
    spec = lookup_spec("conv2d", arch, dtype, *table_key(m, n, k, pass_), gpu)
    if (spec is not None and spec.pass_ == pass_ and spec.dtype == dtype and spec.channels_ok(channels)
            and (spec.arch != 90 or arch == 90) and (not isinstance(spec, ConvRowsWgradSpec) or spec.serves(window))):
        return Choice(spec, "table")
    return Choice(conv_bwd_heuristic(pass_, dtype, channels, n, window), "heuristic")


def model_specs(cfg: CvtShape, size: ImageSize, dtype: str, arch: int, gpu: str | None, batches_of: BatchesOf,
                training: bool = False) -> Iterator[KernelSpec]:
    """The embedding-conv kernels a swapped CvT calls at the batch sizes ``batches_of`` names;
    ``training`` adds dgrad and wgrad (the stem's dx is the image's: never asked for)."""
    for lay in conv_problems(cfg, 1, size):
        if lay.kind != "embed":
            continue
        c = stem_channels(lay.c)
        m1, gemm_k = lay.p * lay.q, lay.r * lay.r * c
        window = conv_window(c, lay.k, lay.r, lay.r, lay.w, lay.stride, lay.pad)
        for b in batches_of("conv2d", *table_key(m1, lay.k, gemm_k)):
            yield select_conv2d(b * m1, lay.k, gemm_k, c, dtype, arch, gpu, window).spec
        if not training:
            continue
        for pass_ in ("wgrad",) if lay.label == "s1.embed" else ("dgrad", "wgrad"):
            for b in batches_of("conv2d", *table_key(m1, lay.k, gemm_k, pass_)):
                yield select_conv2d_backward(pass_, b * m1, lay.k, gemm_k, c, dtype, arch, gpu, window).spec


def candidate_specs(cfg: CvtShape, size: ImageSize, dtype: str, arch: int) -> Iterator[KernelSpec]:
    """What a forward profile sweep tries for the model's embedding convs (each kernel once)."""
    seen = set()
    for lay in conv_problems(cfg, 1, size):
        if lay.kind != "embed":
            continue
        c = stem_channels(lay.c)
        for spec in conv_candidates(dtype, c, arch, conv_window(c, lay.k, lay.r, lay.r, lay.w, lay.stride, lay.pad)):
            if spec.name not in seen:
                seen.add(spec.name)
                yield spec
