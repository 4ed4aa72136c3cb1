"""Epilogues: the EVT functions traced by cutlass_cppgen, their operands and their references.

Installed as ``cvt_cutlass.epilogues``. Importing this package imports neither torch nor CUTLASS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import linear as _linear


@dataclass(frozen=True)
class EpilogueDef:
    """One fused epilogue of ``y = epilogue(x @ W^T)``.

    operands: tensors the epilogue reads besides the accumulator: ``bias`` (N,), ``C`` (M, N), the
    residual (or, in dgrad, what the forward saved), and ``rs`` (M,) fp32, a per-row scale. stores:
    what it writes: always ``D`` (M, N), and ``Z`` (M, N), the pre-activation, or ``G`` (M, N),
    GELU's derivative at it in fp16, for epilogues that keep it for a backward pass.
    scale: where ``rs`` applies: "branch" (to the GEMM's output before the residual is added:
    ``residual + drop_path(x W^T + b)``) or "all" (after: ``drop_path(x W^T + b + residual)``).
    """

    name: str
    fn: Callable
    operands: tuple[str, ...]
    stores: tuple[str, ...]
    # "none", "gelu" (after the adds that precede the Z / G store), "dgelu" (dgrad: GELU' computed at
    # a saved Z) or "dgelu_saved" (dgrad: times the saved GELU')
    activation: str
    doc: str
    reduces: tuple[str, ...] = ()  # row reductions of D the epilogue writes (dgrad: "dbias")
    scale: str = ""  # "", "branch" or "all" (see above)

    @property
    def has_bias(self) -> bool:
        return "bias" in self.operands

    @property
    def has_residual(self) -> bool:
        return "C" in self.operands

    @property
    def has_aux(self) -> bool:
        return "Z" in self.stores or "G" in self.stores

    @property
    def saves_dgelu(self) -> bool:
        """The forward's extra store is GELU's derivative (fp16), not the pre-activation."""
        return "G" in self.stores

    @property
    def has_row_scale(self) -> bool:
        return "rs" in self.operands

    def reference(self, acc, bias=None, residual=None, row_scale=None):
        """The epilogue applied to a float accumulator ``acc`` (M, N) with torch ops (``row_scale``
        (M,)). Returns a list: [D] or [D, Z]. Used by tests (in float64) and by the CPU fallback.
        """
        import torch.nn.functional as F

        if self.activation == "dgelu":  # acc = dY . W, residual = the saved pre-activation Z
            d = acc * gelu_grad(residual.to(acc.dtype))
            return [d, d.sum(0)]
        if self.activation == "dgelu_saved":  # residual = the saved gelu'(Z)
            d = acc * residual.to(acc.dtype)
            return [d, d.sum(0)]
        z = acc + bias if self.has_bias else acc
        rs = row_scale.to(acc.dtype)[:, None] if self.has_row_scale else None
        if self.scale == "branch":
            z = z * rs
        if self.has_residual:
            z = z + residual
        if self.scale == "all":
            z = z * rs
        d = F.gelu(z) if self.activation == "gelu" else z
        if self.saves_dgelu:
            return [d, gelu_grad(z)]
        return [d, z] if self.has_aux else [d]


LINEAR_EPILOGUES: dict[str, EpilogueDef] = {
    e.name: e
    for e in (
        EpilogueDef("none", _linear.none, (), ("D",), "none", "x @ W^T"),
        EpilogueDef("bias", _linear.bias, ("bias",), ("D",), "none", "x @ W^T + b"),
        EpilogueDef("bias_gelu", _linear.bias_gelu, ("bias",), ("D",), "gelu", "gelu(x @ W^T + b), erf form"),
        EpilogueDef("bias_residual", _linear.bias_residual, ("bias", "C"), ("D",), "none", "x @ W^T + b + r"),
        EpilogueDef("bias_scale_residual", _linear.bias_scale_residual, ("bias", "rs", "C"), ("D",), "none",
                    "(x @ W^T + b) * s + r, s per row (fp32)", scale="branch"),
        EpilogueDef("bias_residual_scale", _linear.bias_residual_scale, ("bias", "C", "rs"), ("D",), "none",
                    "(x @ W^T + b + r) * s, s per row (fp32)", scale="all"),
        EpilogueDef(
            "bias_gelu_aux",
            _linear.bias_gelu_aux,
            ("bias",),
            ("D", "Z"),
            "gelu",
            "gelu(x @ W^T + b), also stores the pre-activation Z for backward",
        ),
        EpilogueDef(
            "bias_gelu_dgelu",
            _linear.bias_gelu_dgelu,
            ("bias",),
            ("D", "G"),
            "gelu",
            "gelu(x @ W^T + b), also stores gelu'(x @ W^T + b) in fp16 for backward",
        ),
    )
}


DGRAD_EPILOGUES: dict[str, EpilogueDef] = {
    "none": LINEAR_EPILOGUES["none"],
    "dgelu_dbias": EpilogueDef(
        "dgelu_dbias", _linear.dgelu_dbias, ("C",), ("D",), "dgelu",
        "(dY . W) * gelu'(Z) with Z read as C (erf form), dbias = its column sums", reduces=("dbias",),
    ),
    # GELU' without the dbias reduction (dbias then comes from the wgrad GEMM's operand reduction)
    "dgelu": EpilogueDef("dgelu", _linear.dgelu_dbias, ("C",), ("D",), "dgelu", "(dY . W) * gelu'(Z), Z read as C"),
    "dgelu_saved_dbias": EpilogueDef(
        "dgelu_saved_dbias", _linear.dgelu_saved_dbias, ("C",), ("D",), "dgelu_saved",
        "(dY . W) * G with G = gelu'(Z) saved by the forward in fp16 (read as C), dbias = its column sums",
        reduces=("dbias",),
    ),
}
_BY_PASS = {"fwd": LINEAR_EPILOGUES, "dgrad": DGRAD_EPILOGUES}


def gelu_grad(z):
    """d/dz of nn.GELU's exact form, Phi(z) + z phi(z), with torch ops (references, fallbacks)."""
    import math

    import torch

    return 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0)))) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def epilogues_of_pass(pass_: str) -> dict[str, EpilogueDef]:
    """The GEMM epilogues a pass of the Linear family instantiates."""
    try:
        return _BY_PASS[pass_]
    except KeyError:
        raise ValueError(f"the Linear family has no epilogues for pass {pass_!r}; have {sorted(_BY_PASS)}") from None


def get_linear_epilogue(name: str, pass_: str = "fwd") -> EpilogueDef:
    try:
        return epilogues_of_pass(pass_)[name]
    except KeyError:
        raise ValueError(
            f"unknown Linear {pass_} epilogue {name!r}; choose one of {sorted(epilogues_of_pass(pass_))}"
        ) from None


__all__ = ["DGRAD_EPILOGUES", "EpilogueDef", "LINEAR_EPILOGUES", "epilogues_of_pass", "gelu_grad",
           "get_linear_epilogue"]
