"""The depthwise-conv kernel for a problem: the tuned table's row, else the heuristic.

Table key: (m, n, k) = (output pixels N*P*Q, channels, 9); epilogue ``bias_st<stride>`` (the
inference kernel) or ``bn_<pass>_st<stride>`` (conv + training BatchNorm, ``fwd`` / ``bwd``).
"""

from __future__ import annotations

from collections.abc import Iterator

from ...models import CvtShape, ImageSize
from ..selection import BatchesOf, Choice, lookup_spec, selector
from ..spec import KernelSpec
from .problems import dwconv_problems
from .spec import dwconv_bn_heuristic, dwconv_candidates, dwconv_heuristic


def table_key(m: int, channels: int, stride: int, pass_: str | None = None) -> tuple[str, int, int, int]:
    """(epilogue, m, n, k) a depthwise 3x3 problem is filed under: the inference kernel's
    (``pass_`` None) or the conv + BatchNorm kernel's of one pass."""
    return (f"bias_st{stride}" if pass_ is None else f"bn_{pass_}_st{stride}"), m, channels, 9


@selector
def select_dwconv(m: int, channels: int, stride: int, dtype: str, arch: int, gpu: str | None = None) -> Choice:
    """The depthwise 3x3 kernel for m = N*P*Q output pixels of ``channels`` channels."""
    spec = lookup_spec("dwconv", arch, dtype, *table_key(m, channels, stride), gpu)
    if spec is not None and (spec.arch, spec.dtype, spec.stride) == (arch, dtype, stride):
        return Choice(spec, "table")
    return Choice(dwconv_heuristic(dtype, stride, arch), "heuristic")


@selector
def select_dwconv_bn(m: int, channels: int, stride: int, dtype: str, arch: int, gpu: str | None = None,
                     pass_: str = "fwd") -> Choice:
    """The depthwise 3x3 conv + training BatchNorm kernel of one pass (``fwd`` / ``bwd``) for
    m = N*P*Q output pixels of ``channels`` channels."""
    spec = lookup_spec("dwconv", arch, dtype, *table_key(m, channels, stride, pass_), gpu)
    if spec is not None and (spec.arch, spec.dtype, getattr(spec, "stride", None), spec.pass_) == \
            (arch, dtype, stride, pass_) and getattr(spec, "groups", None) is not None:
        return Choice(spec, "table")
    return Choice(dwconv_bn_heuristic(dtype, channels, stride, arch, pass_), "heuristic")


def model_specs(cfg: CvtShape, size: ImageSize, dtype: str, arch: int, gpu: str | None, batches_of: BatchesOf,
                training: bool = False) -> Iterator[KernelSpec]:
    """The depthwise kernels a swapped CvT calls at the batch sizes ``batches_of`` names;
    ``training`` adds the conv + batch-statistics BatchNorm kernels, forward and backward, and each
    stage's library of its q and k / v pair's kernels together (what the layer op launches)."""
    layers = dwconv_problems(cfg, 1, size)
    for lay in layers:
        m1 = lay.p * lay.q
        for b in batches_of("dwconv", *table_key(m1, lay.c, lay.stride)):
            yield select_dwconv(b * m1, lay.c, lay.stride, dtype, arch, gpu).spec
        for pass_ in ("fwd", "bwd") if training else ():
            for b in batches_of("dwconv", *table_key(m1, lay.c, lay.stride, pass_)):
                yield select_dwconv_bn(b * m1, lay.c, lay.stride, dtype, arch, gpu, pass_).spec
    for q, kv in zip(layers[0::2], layers[1::2], strict=True) if training else ():  # a stage's q, then its k / v pair
        if q.stride == kv.stride:
            continue  # one shape: the layer op runs q alone and the pair
        for pass_ in ("fwd", "bwd"):
            for b in batches_of("dwconv", *table_key(q.p * q.q, q.c, q.stride, pass_)):
                qs = select_dwconv_bn(b * q.p * q.q, q.c, q.stride, dtype, arch, gpu, pass_).spec
                kvs = select_dwconv_bn(b * kv.p * kv.q, kv.c, kv.stride, dtype, arch, gpu, pass_).spec
                yield qs.with_kv(kvs)


def candidate_specs(cfg: CvtShape, size: ImageSize, dtype: str, arch: int) -> Iterator[KernelSpec]:
    """What a forward profile sweep tries for the model's strides."""
    for stride in sorted({lay.stride for lay in dwconv_problems(cfg, 1, size)}):
        yield from dwconv_candidates(dtype, stride, arch)
