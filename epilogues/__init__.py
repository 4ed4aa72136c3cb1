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

    operands: tensors the epilogue reads besides the accumulator: ``bias`` (N,) and/or ``C``
    (M, N), the residual. stores: what it writes: always ``D`` (M, N), and ``Z`` (M, N), the
    pre-activation, for epilogues that keep it for a backward pass.
    """

    name: str
    fn: Callable
    operands: tuple[str, ...]
    stores: tuple[str, ...]
    activation: str  # "none" or "gelu", applied after the adds that precede the Z store
    doc: str

    @property
    def has_bias(self) -> bool:
        return "bias" in self.operands

    @property
    def has_residual(self) -> bool:
        return "C" in self.operands

    @property
    def has_aux(self) -> bool:
        return "Z" in self.stores

    def reference(self, acc, bias=None, residual=None):
        """The epilogue applied to a float accumulator ``acc`` (M, N) with torch ops.

        Returns a list: [D] or [D, Z]. Used by tests (in float64) and by the CPU fallback.
        """
        import torch.nn.functional as F

        z = acc + bias if self.has_bias else acc
        if self.has_residual:
            z = z + residual
        d = F.gelu(z) if self.activation == "gelu" else z
        return [d, z] if self.has_aux else [d]


LINEAR_EPILOGUES: dict[str, EpilogueDef] = {
    e.name: e
    for e in (
        EpilogueDef("none", _linear.none, (), ("D",), "none", "x @ W^T"),
        EpilogueDef("bias", _linear.bias, ("bias",), ("D",), "none", "x @ W^T + b"),
        EpilogueDef("bias_gelu", _linear.bias_gelu, ("bias",), ("D",), "gelu", "gelu(x @ W^T + b), erf form"),
        EpilogueDef("bias_residual", _linear.bias_residual, ("bias", "C"), ("D",), "none", "x @ W^T + b + r"),
        EpilogueDef(
            "bias_gelu_aux",
            _linear.bias_gelu_aux,
            ("bias",),
            ("D", "Z"),
            "gelu",
            "gelu(x @ W^T + b), also stores the pre-activation Z for backward",
        ),
    )
}


def get_linear_epilogue(name: str) -> EpilogueDef:
    try:
        return LINEAR_EPILOGUES[name]
    except KeyError:
        raise ValueError(
            f"unknown Linear epilogue {name!r}; choose one of {sorted(LINEAR_EPILOGUES)}"
        ) from None


__all__ = ["EpilogueDef", "LINEAR_EPILOGUES", "get_linear_epilogue"]
