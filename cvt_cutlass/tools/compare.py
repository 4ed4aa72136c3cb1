"""How far a result is from its reference: what sweeps, benchmarks and ``cvt-cutlass run`` report."""

from __future__ import annotations

import math


def rel_err(y, ref) -> float:
    """||y - ref|| / ||ref||, computed in the reference's dtype (fp32 or float64)."""
    return float((y.to(ref.dtype) - ref).norm() / ref.norm().clamp_min(1e-30))


def max_rel_err(outs, refs) -> float:
    """The worst :func:`rel_err` over paired outputs (pairs whose reference is None are skipped)."""
    return max(rel_err(o, r) for o, r in zip(outs, refs, strict=True) if r is not None)


def sqnr_db(x, ref) -> float:
    """Signal-to-quantisation-noise ratio of x against ref, in dB (inf when equal)."""
    x, ref = x.double(), ref.double()
    noise = (x - ref).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)
