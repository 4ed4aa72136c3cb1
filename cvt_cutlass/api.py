"""The Python API behind ``cvt-cutlass emit`` and ``cvt-cutlass build``: which kernels, and their sources."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from pathlib import Path

from .epilogues import LINEAR_EPILOGUES
from .operators.selection import fixed_batches, probed_batches
from .operators.spec import DTYPES, KernelSpec

OPS = ("linear", "conv2d", "dwconv", "attention", "layernorm")
KERNEL_SETS = ("selected", "candidates")


def _as_tuple(v, default: Sequence) -> tuple:
    if v is None:
        return tuple(default)
    if isinstance(v, (str, int)):
        return (v,)
    return tuple(v)


def _family(op: str):
    """The selection module of an op family (``operators/<op>/select.py``): its ``model_specs`` and
    ``candidate_specs``."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return importlib.import_module(f"{__package__}.operators.{op}.select")


def _shape(model_or_config):
    """The CvtShape of a named config, a CvtShape, a HF config or a HF model."""
    from .models import CvtShape, get_config, shape_of

    if isinstance(model_or_config, str):
        return get_config(model_or_config)
    if isinstance(model_or_config, CvtShape):
        return model_or_config
    return shape_of(getattr(model_or_config, "config", model_or_config))


def kernels_for(
    op: str = "linear",
    arch: int | Iterable[int] = 90,
    epilogue: str | Iterable[str] | None = None,
    dtype: str | Iterable[str] | None = None,
    *,
    which: str = "selected",
    model: str = "cvt-13",
    batches: Sequence[int] = (1, 32, 256),
    image_size: int | None = None,
    gpu: str | None = None,
) -> list[KernelSpec]:
    """Kernel specs of one op family.

    which="selected": the kernels the runtime picks (selection table, else heuristic) for every
    problem of ``model`` at ``batches``; for ``linear`` with each requested epilogue (by default
    every one, also those the model does not use, so every epilogue has kernels).
    which="candidates": the profile sweep's space for the model's problems.
    """
    family = _family(op)
    if which not in KERNEL_SETS:
        raise ValueError(f"which must be one of {KERNEL_SETS}, got {which!r}")
    kw = {}
    if op == "linear":
        kw["epilogues"] = _as_tuple(epilogue, LINEAR_EPILOGUES)
        for e in kw["epilogues"]:
            if e not in LINEAR_EPILOGUES:
                raise ValueError(f"unknown epilogue {e!r}; have {sorted(LINEAR_EPILOGUES)}")
    elif epilogue is not None:
        raise ValueError(f"epilogue {epilogue!r}: only the linear family takes an epilogue; {op} has its own")
    archs = [int(a) for a in _as_tuple(arch, (89, 90))]
    if any(a not in (89, 90) for a in archs):
        raise ValueError(f"arch {archs}: the kernel paths are 89 (SM80-class kernels) and 90 (SM90)")
    if not batches or any(int(b) < 1 for b in batches) or (image_size is not None and image_size < 1):
        raise ValueError(f"batches {list(batches)} and image_size {image_size}: positive (image_size None: the model's)")
    cfg = _shape(model)
    out: dict[str, KernelSpec] = {}
    for a in archs:
        for dt in _as_tuple(dtype, DTYPES):
            if which == "candidates":
                specs = family.candidate_specs(cfg, image_size, dt, a, **kw)
            else:
                specs = family.model_specs(cfg, image_size, dt, a, gpu, fixed_batches(batches), **kw)
            for s in specs:
                out.setdefault(s.name, s)
    return list(out.values())


MAX_BATCH = 1024  # model_kernels covers every batch size from 1 to this


def model_kernels(model_or_config, image_size=224, dtype: str | Iterable[str] = "fp16", arch: int = 90,
                  training: bool = False, *, gpu: str | None = None, max_batch: int = MAX_BATCH,
                  residual_stream: str = "fp32") -> list[KernelSpec]:
    """The kernel specs a swapped CvT can call at any batch size from 1 to ``max_batch``.

    ``model_or_config``: a HF CvT model, its config, a :class:`~cvt_cutlass.models.CvtShape` or a
    named config ("cvt-13"); ``image_size``: a side or (H, W). Kernel choice depends on the batch
    only through the selection table's nearest tuned row (the shape bucket), so the set is the
    union of the choices at the batch sizes where a bucket boundary falls
    (:func:`cvt_cutlass.operators.selection.batch_probes`): building it once means a new batch size
    builds nothing. ``training=True`` adds what a training step calls: the training forward's own
    kernels (fc1 keeping GELU's derivative, drop path in the out-projection's and fc2's epilogues,
    depthwise conv + BatchNorm on batch statistics) and every backward kernel. ``gpu`` prefers
    that GPU's table rows. Each family lists its own (``operators/<op>/select.py:model_specs``).
    ``residual_stream="fp32"`` (swap's default) adds the fp32-stream variants autocast calls: each
    Linear forward that adds a residual with an fp32 one (and, without drop path, with a 16-bit
    output: a stage's last sum before the next embedding), each LayerNorm with fp32 x and with fp32
    y (and each backward with fp32 x beside a 16-bit residual gradient); ``"compute"`` leaves them out.
    """
    cfg = _shape(model_or_config)
    if not 1 <= max_batch:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out: dict[str, KernelSpec] = {}
    for dt in _as_tuple(dtype, DTYPES):
        batches_of = probed_batches(int(arch), dt, max_batch)
        for op in OPS:
            for spec in _family(op).model_specs(cfg, image_size, dt, int(arch), gpu, batches_of, training):
                out.setdefault(spec.name, spec)
    if residual_stream == "fp32":
        for spec in [*out.values()]:
            for twin in _fp32_stream_twins(spec):
                out.setdefault(twin.name, twin)
    return list(out.values())


def _fp32_stream_twins(spec: KernelSpec) -> list[KernelSpec]:
    """The variants of ``spec`` an fp32 residual stream calls (none for most kernels)."""
    from .epilogues import LINEAR_EPILOGUES

    if spec.op == "linear" and spec.pass_ == "fwd" and getattr(spec, "residual", None) == "" and \
            LINEAR_EPILOGUES.get(spec.epilogue) is not None and LINEAR_EPILOGUES[spec.epilogue].has_residual:
        # a stage's last fc2 before another stage rounds its sum once ("f32in"; without drop path: the
        # plain residual epilogue; specs do not say which layer they serve, so every one has the twin)
        return [spec.with_(residual="f32")] + ([spec.with_(residual="f32in")] if spec.epilogue == "bias_residual" else [])
    if spec.op == "layernorm" and getattr(spec, "io", None) == "":
        # (and that layer's LayerNorm backward, whose residual gradient then comes back 16-bit)
        return [spec.with_(io="xf32"), spec.with_(io="yf32")] + ([spec.with_(io="xf32r16")] if spec.pass_ == "bwd" else [])
    return []


def emit(
    op: str = "linear",
    arch: int | Iterable[int] = 90,
    epilogue: str | Iterable[str] | None = None,
    dtype: str | Iterable[str] | None = None,
    out: str | Path = "cvt_cutlass_kernels",
    *,
    which: str = "selected",
    specs: Iterable[KernelSpec] | None = None,
    **kw,
) -> list[Path]:
    """Write one ``<procedural name>.cu`` per kernel (plus the ABI header) into ``out``. No GPU needed."""
    from .emitter import write_sources

    if specs is None:
        specs = kernels_for(op, arch, epilogue, dtype, which=which, **kw)
    return write_sources(specs, out)
