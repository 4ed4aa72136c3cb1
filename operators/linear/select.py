"""The Linear kernel for a problem: the tuned table's row, else the heuristic.

Table key: (m, n, k) of the GEMM; epilogue column = the forward epilogue (``none``, ``bias``,
``bias_gelu`` ...) or ``<pass>:<epilogue>`` for the backward GEMMs (``dgrad:dgelu_dbias``,
``wgrad:dbias`` ...).
"""

from __future__ import annotations

from collections.abc import Iterator

from ...models import CvtShape, ImageSize
from ..selection import BatchesOf, Choice, lookup_spec, selector
from ..spec import KernelSpec
from .problems import BACKWARD_PASSES, backward_problems, linear_problems
from .space import candidates, heuristic_spec
from .wgrad import wgrad_heuristic


def table_epilogue(pass_: str, epilogue: str) -> str:
    """The epilogue column a Linear problem of one pass is filed under."""
    return epilogue if pass_ == "fwd" else f"{pass_}:{epilogue}"


# Epilogues without table rows of their own that take a related epilogue's tuned kernel: drop
# path's row-scaled residual epilogues read the same operands as the residual one, plus a vector;
# the training forward's fc1 that saves GELU's derivative stores as much as the one that saves the
# pre-activation (fp16 instead of the compute dtype), and fc2's input gradient that reads the saved
# derivative reads and reduces as much as the one that computes it from the pre-activation.
_TABLE_PROXY = {"bias_scale_residual": "bias_residual", "bias_residual_scale": "bias_residual",
                "bias_gelu_dgelu": "bias_gelu_aux"}
_BACKWARD_PROXY = {"dgelu_saved_dbias": "dgelu_dbias"}


@selector
def select_linear(m: int, n: int, k: int, dtype: str, epilogue: str, arch: int, gpu: str | None = None,
                  residual: str = "") -> Choice:
    """The kernel for one Linear forward problem on one path (callers count the source);
    ``residual`` "f32": the variant with an fp32 residual and output, on the tile the table
    gives the 16-bit one."""
    for key in (epilogue, _TABLE_PROXY.get(epilogue)):
        spec = None if key is None else lookup_spec("linear", arch, dtype, key, m, n, k, gpu)
        if spec is not None and (spec.arch, spec.dtype, spec.epilogue) == (arch, dtype, key):
            return Choice(spec.with_(epilogue=epilogue, residual=residual), "table")
    return Choice(heuristic_spec(m, n, k, dtype, epilogue, arch).with_(residual=residual), "heuristic")


@selector
def select_linear_backward(pass_: str, m: int, n: int, k: int, dtype: str, epilogue: str, arch: int,
                           gpu: str | None = None) -> Choice:
    """The kernel of one Linear backward GEMM: ``dgrad`` (m rows, n = the layer's K, k = its N) or
    ``wgrad`` (m rows, dW (n, k); epilogue ``dbias`` or ``none``: whether it also sums db).
    SM80-class wgrad kernels (arch 89 specs) serve both paths, SM90 ones the sm90 path; every
    wgrad kernel serves both of its epilogues, so a wgrad problem the table lists only with the
    other epilogue takes that row's kernel."""
    keys = [epilogue] + ([e for e in ("dbias", "none") if e != epilogue] if pass_ == "wgrad" else [])
    if pass_ == "dgrad" and epilogue in _BACKWARD_PROXY:
        keys.append(_BACKWARD_PROXY[epilogue])
    for key in keys:
        spec = lookup_spec("linear", arch, dtype, table_epilogue(pass_, key), m, n, k, gpu)
        if spec is None:
            continue
        if spec.pass_ == pass_ and spec.dtype == dtype and (spec.arch == arch or (pass_ == "wgrad" and spec.arch == 89)):
            return Choice(spec if pass_ == "wgrad" else spec.with_(epilogue=epilogue), "table")
    if pass_ == "wgrad":
        return Choice(wgrad_heuristic(n, k, dtype), "heuristic")
    return Choice(heuristic_spec(m, n, k, dtype, epilogue, arch, pass_=pass_), "heuristic")


# the training forward's variants: fc1 keeps GELU's derivative; drop path in the out-projection's
# and fc2's epilogues (a per-row scale: before the residual add, after it) and, for the op-by-op
# path's drop path, the out-projection without its residual
_TRAINING_FORWARD = {"fc1": ("bias_gelu_dgelu",), "proj": ("bias", "bias_scale_residual"),
                     "fc2": ("bias_residual_scale",)}


def model_specs(cfg: CvtShape, size: ImageSize, dtype: str, arch: int, gpu: str | None, batches_of: BatchesOf,
                training: bool = False, epilogues: tuple[str, ...] | None = None) -> Iterator[KernelSpec]:
    """The Linear kernels a swapped CvT calls at the batch sizes ``batches_of`` names: each forward
    problem with its own epilogue (or with each of ``epilogues``); ``training`` adds the training
    forward's variants and every backward GEMM (fc2's dgrad multiplies by the saved GELU'
    and sums fc1's db)."""
    for p in linear_problems(cfg, 1, size):
        if p.label == "head" and cfg.num_labels <= 0:
            continue
        epis = list(epilogues or [p.epilogue])
        if training:
            epis += _TRAINING_FORWARD.get(p.label.rsplit(".", 1)[-1], ())
        for e in epis:  # batch probes from the epilogue's own rows and its proxy's (select_linear takes either)
            for key in dict.fromkeys((e, _TABLE_PROXY.get(e, e))):
                for b in batches_of("linear", key, p.m, p.n, p.k):
                    yield select_linear(b * p.m, p.n, p.k, dtype, e, arch, gpu).spec
    if not training:
        return
    for p in backward_problems(cfg, [1], size, BACKWARD_PASSES):
        if p.label == "head" and cfg.num_labels <= 0:
            continue
        proxy = _BACKWARD_PROXY.get(p.epilogue, p.epilogue) if p.pass_ == "dgrad" else p.epilogue
        for key in dict.fromkeys((p.epilogue, proxy)):
            for b in batches_of("linear", table_epilogue(p.pass_, key), p.m, p.n, p.k):
                yield select_linear_backward(p.pass_, b * p.m, p.n, p.k, dtype, p.epilogue, arch, gpu).spec


def candidate_specs(cfg: CvtShape, size: ImageSize, dtype: str, arch: int,
                    epilogues: tuple[str, ...] | None = None) -> Iterator[KernelSpec]:
    """What a forward profile sweep tries for the model's epilogues (or ``epilogues``)."""
    for e in epilogues or sorted({p.epilogue for p in linear_problems(cfg, 1, size)}):
        yield from candidates(arch, dtype, e)
