"""The Python API behind ``cvt-cutlass emit`` and ``cvt-cutlass build``: which kernels, and their sources."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from .epilogues import LINEAR_EPILOGUES
from .operators.linear import DTYPES, LinearSpec, candidates
from .operators.linear.problems import linear_problems
from .selection import select_linear

OPS = ("linear", "conv2d", "dwconv", "attention", "layernorm")
KERNEL_SETS = ("selected", "candidates")


def _as_tuple(v, default: Sequence) -> tuple:
    if v is None:
        return tuple(default)
    if isinstance(v, (str, int)):
        return (v,)
    return tuple(v)


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
) -> list[LinearSpec]:
    """Kernel specs of one op family.

    which="selected": the kernels the runtime picks (selection table, else heuristic) for every
    Linear problem of ``model`` at ``batches``, for each requested epilogue (also those the model
    does not use, so every epilogue has kernels). which="candidates": the profile sweep's space.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if which not in KERNEL_SETS:
        raise ValueError(f"which must be one of {KERNEL_SETS}, got {which!r}")
    archs = [int(a) for a in _as_tuple(arch, (89, 90))]
    dtypes = _as_tuple(dtype, DTYPES)
    if op != "linear":
        return _conv_kernels_for(op, archs, dtypes, which, model, batches, image_size, gpu)
    epis = _as_tuple(epilogue, LINEAR_EPILOGUES)
    for e in epis:
        if e not in LINEAR_EPILOGUES:
            raise ValueError(f"unknown epilogue {e!r}; have {sorted(LINEAR_EPILOGUES)}")
    out: dict[str, LinearSpec] = {}
    for a in archs:
        for dt in dtypes:
            for e in epis:
                if which == "candidates":
                    specs = candidates(a, dt, e)
                else:
                    shapes = {(p.m, p.n, p.k) for b in batches for p in linear_problems(model, b, image_size)}
                    specs = [select_linear(m, n, k, dt, e, a, gpu).spec for m, n, k in sorted(shapes)]
                for s in specs:
                    out.setdefault(s.name, s)
    return list(out.values())


def _conv_kernels_for(op, archs, dtypes, which, model, batches, image_size, gpu) -> list:
    """Conv families. conv2d kernels are SM80-class on both paths (one spec serves both archs);
    dwconv kernels are built per path (sm_89 / sm_90a)."""
    from .models import conv_problems
    from .operators.conv2d import conv_candidates, stem_channels
    from .operators.dwconv import dwconv_candidates
    from .selection import select_conv2d, select_dwconv

    if op == "attention":
        return _attn_kernels_for(archs, dtypes, which, model, batches, image_size, gpu)
    if op == "layernorm":
        return _norm_kernels_for(archs, dtypes, which, model, batches, image_size, gpu)
    kind = "embed" if op == "conv2d" else "dwconv"
    layers = [lay for b in batches for lay in conv_problems(model, b, image_size) if lay.kind == kind]
    out: dict[str, object] = {}
    for a in archs:
        for dt in dtypes:
            for lay in layers:
                if which == "candidates":
                    specs = (conv_candidates(dt, stem_channels(lay.c), a) if kind == "embed"
                             else dwconv_candidates(dt, lay.stride, a))
                elif kind == "embed":
                    c = stem_channels(lay.c)
                    specs = [select_conv2d(lay.n * lay.p * lay.q, lay.k, lay.r * lay.r * c, c, dt, a, gpu).spec]
                else:
                    specs = [select_dwconv(lay.n * lay.p * lay.q, lay.c, lay.stride, dt, a, gpu).spec]
                for s in specs:
                    out.setdefault(s.name, s)
    return list(out.values())


def _per_problem_kernels(archs, dtypes, which, problems, candidates, select) -> list:
    """Specs over every (arch, dtype, problem): ``candidates(dtype, problem, arch)`` for the sweep's
    space, ``[select(problem, dtype, arch).spec]`` for what the runtime picks; deduplicated by name."""
    out: dict[str, object] = {}
    for a in archs:
        for dt in dtypes:
            for lay in problems:
                specs = candidates(dt, lay, a) if which == "candidates" else [select(lay, dt, a).spec]
                for s in specs:
                    out.setdefault(s.name, s)
    return list(out.values())


def _attn_kernels_for(archs, dtypes, which, model, batches, image_size, gpu) -> list:
    from .models import attention_problems
    from .operators.attention import attn_candidates
    from .selection import select_attention

    return _per_problem_kernels(
        archs, dtypes, which, [x for b in batches for x in attention_problems(model, b, image_size)],
        lambda dt, lay, a: attn_candidates(dt, lay.head_dim, a),
        lambda lay, dt, a: select_attention(lay.n, lay.heads, lay.lq, lay.lkv, lay.head_dim, dt, a, gpu))


def _norm_kernels_for(archs, dtypes, which, model, batches, image_size, gpu) -> list:
    from .models import layernorm_problems
    from .operators.layernorm import layernorm_candidates
    from .selection import select_layernorm

    return _per_problem_kernels(
        archs, dtypes, which, [x for b in batches for x in layernorm_problems(model, b, image_size)],
        lambda dt, lay, a: layernorm_candidates(dt, lay.channels, a),
        lambda lay, dt, a: select_layernorm(lay.rows, lay.channels, dt, a, gpu))


MAX_BATCH = 1024  # model_kernels covers every batch size from 1 to this


def model_kernels(model_or_config, image_size=224, dtype: str | Iterable[str] = "fp16", arch: int = 90,
                  training: bool = False, *, gpu: str | None = None, max_batch: int = MAX_BATCH) -> list:
    """The kernel specs a swapped CvT can call at any batch size from 1 to ``max_batch``.

    ``model_or_config``: a HF CvT model, its config, a :class:`~cvt_cutlass.models.CvtShape` or a
    named config ("cvt-13"); ``image_size``: a side or (H, W). Kernel choice depends on the batch
    only through the selection table's nearest tuned row (the shape bucket), so the set is the
    union of the choices at the batch sizes where a bucket boundary falls
    (:func:`cvt_cutlass.selection.batch_probes`): building it once means a new batch size builds
    nothing. ``training=True`` adds what a training step calls: the training forward's own kernels
    (fc1 keeping its pre-activation, the out-projection without residual for drop path, depthwise
    conv + BatchNorm on batch statistics) and every backward kernel. ``gpu`` prefers that GPU's
    table rows.
    """
    from .models import CvtShape, get_config, shape_of

    cfg = model_or_config
    if isinstance(cfg, str):
        cfg = get_config(cfg)
    elif not isinstance(cfg, CvtShape):
        cfg = shape_of(getattr(cfg, "config", cfg))
    if not 1 <= max_batch:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out: dict[str, object] = {}
    for dt in _as_tuple(dtype, DTYPES):
        for spec in _forward_kernels(cfg, image_size, dt, int(arch), gpu, max_batch):
            out.setdefault(spec.name, spec)
        if training:
            for spec in _training_kernels(cfg, image_size, dt, int(arch), gpu, max_batch):
                out.setdefault(spec.name, spec)
    return list(out.values())


def _training_kernels(cfg, size, dt: str, arch: int, gpu, max_batch: int):
    """The kernels a training step adds to the forward's (see :func:`model_kernels`)."""
    from .selection import batch_probes, select_linear

    def batches(op, epi, n, k, m1):
        return batch_probes(op, arch, dt, epi, n, k, m1, max_batch)


    for p in linear_problems(cfg, 1, size):
        extra = {"fc1": "bias_gelu_aux", "proj": "bias"}.get(p.label.rsplit(".", 1)[-1])
        if extra:
            for b in batches("linear", extra, p.n, p.k, p.m):
                yield select_linear(b * p.m, p.n, p.k, dt, extra, arch, gpu).spec
    yield from _linear_backward_kernels(cfg, size, dt, arch, gpu, batches)
    yield from _other_backward_kernels(cfg, size, dt, arch, gpu, batches)


def _linear_backward_kernels(cfg, size, dt, arch, gpu, batches):
    """dgrad and wgrad of every Linear, with the epilogues the ops ask for (fc2's dgrad applies
    GELU' and sums fc1's db; fc1's wgrad sums none)."""
    from .operators.linear.problems import backward_problems
    from .selection import select_linear_backward

    for p in backward_problems(cfg, [1], size, ("dgrad", "wgrad")):
        if p.label == "head" and cfg.num_labels <= 0:
            continue
        for b in batches("linear", p.key, p.n, p.k, p.m):
            yield select_linear_backward(p.pass_, b * p.m, p.n, p.k, dt, p.epilogue, arch, gpu).spec


def _other_backward_kernels(cfg, size, dt, arch, gpu, batches):
    """LayerNorm, attention, embedding conv and depthwise conv + BatchNorm: the training forward's
    batch-statistics kernel and every backward."""
    from .models import attention_problems, conv_problems, layernorm_problems
    from .operators.conv2d import stem_channels
    from .selection import select_attention, select_conv2d_backward, select_dwconv_bn, select_layernorm

    for nl in layernorm_problems(cfg, 1, size):
        for b in batches("layernorm", "ln_bwd", nl.channels, 1, nl.rows):
            yield select_layernorm(b * nl.rows, nl.channels, dt, arch, gpu, "bwd").spec
    for a in attention_problems(cfg, 1, size):
        for b in batches("attention", f"h{a.heads}_bwd", a.lkv, a.head_dim, a.lq):
            yield select_attention(b, a.heads, a.lq, a.lkv, a.head_dim, dt, arch, gpu, "bwd").spec
    for lay in conv_problems(cfg, 1, size):
        m1 = lay.p * lay.q
        if lay.kind == "embed":
            c = stem_channels(lay.c)
            # the stem's dx is the image's: never asked for in training
            for pass_ in ("wgrad",) if lay.label == "s1.embed" else ("dgrad", "wgrad"):
                for b in batches("conv2d", pass_, lay.k, lay.r * lay.r * c, m1):
                    yield select_conv2d_backward(pass_, b * m1, lay.k, lay.r * lay.r * c, c, dt, arch, gpu).spec
            continue
        for pass_ in ("fwd", "bwd"):
            for b in batches("dwconv", f"bn_{pass_}_st{lay.stride}", lay.c, 9, m1):
                yield select_dwconv_bn(b * m1, lay.c, lay.stride, dt, arch, gpu, pass_).spec


def _forward_kernels(cfg, size, dt: str, arch: int, gpu, max_batch: int):
    """Every (problem, bucket) choice of a swapped forward: linear, LayerNorm, conv, attention."""
    from .models import attention_problems, conv_problems, layernorm_problems
    from .operators.conv2d import stem_channels
    from .selection import batch_probes, select_attention, select_conv2d, select_dwconv, select_layernorm

    def batches(op, epi, n, k, m1):
        return batch_probes(op, arch, dt, epi, n, k, m1, max_batch)

    for p in linear_problems(cfg, 1, size):
        if p.label != "head" or cfg.num_labels > 0:
            for b in batches("linear", p.epilogue, p.n, p.k, p.m):
                yield select_linear(b * p.m, p.n, p.k, dt, p.epilogue, arch, gpu).spec
    for nl in layernorm_problems(cfg, 1, size):
        if nl.label == "head_ln" and not cfg.cls_token[-1]:
            continue  # HF normalises the (B, C, H*W) view permuted: channels not contiguous, PyTorch runs it
        for b in batches("layernorm", "ln", nl.channels, 1, nl.rows):
            yield select_layernorm(b * nl.rows, nl.channels, dt, arch, gpu).spec
    for lay in conv_problems(cfg, 1, size):
        m1 = lay.p * lay.q
        if lay.kind == "embed":
            c = stem_channels(lay.c)
            for b in batches("conv2d", "bias", lay.k, lay.r * lay.r * c, m1):
                yield select_conv2d(b * m1, lay.k, lay.r * lay.r * c, c, dt, arch, gpu).spec
        else:
            for b in batches("dwconv", f"bias_st{lay.stride}", lay.c, lay.r * lay.r, m1):
                yield select_dwconv(b * m1, lay.c, lay.stride, dt, arch, gpu).spec
    for a in attention_problems(cfg, 1, size):
        for b in batches("attention", f"h{a.heads}", a.lkv, a.head_dim, a.lq):
            yield select_attention(b, a.heads, a.lq, a.lkv, a.head_dim, dt, arch, gpu).spec


def emit(
    op: str = "linear",
    arch: int | Iterable[int] = 90,
    epilogue: str | Iterable[str] | None = None,
    dtype: str | Iterable[str] | None = None,
    out: str | Path = "cvt_cutlass_kernels",
    *,
    which: str = "selected",
    specs: Iterable[LinearSpec] | None = None,
    **kw,
) -> list[Path]:
    """Write one ``<procedural name>.cu`` per kernel (plus the ABI header) into ``out``. No GPU needed."""
    from .emitter import write_sources

    if specs is None:
        specs = kernels_for(op, arch, epilogue, dtype, which=which, **kw)
    return write_sources(specs, out)
