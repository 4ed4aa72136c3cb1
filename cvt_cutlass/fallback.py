"""Visible fallbacks: every call that does not run on a CUTLASS kernel is counted and logged.

``stats()`` returns the counters; the benchmark prints them. With ``CVT_CUTLASS_STRICT=1`` (or
``set_strict(True)``) a fallback raises ``FallbackError`` instead, which is what the GPU tests use
to prove that a path really ran on CUTLASS.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter

log = logging.getLogger("cvt_cutlass")

_lock = threading.Lock()
_kernel_calls: Counter[str] = Counter()  # op -> calls that ran on a CUTLASS kernel
_fallbacks: Counter[tuple[str, str]] = Counter()  # (op, reason) -> calls that ran on PyTorch
_selections: Counter[tuple[str, str]] = Counter()  # (op, "table"|"heuristic") -> kernel choices
_torch_ops: Counter[str] = Counter()  # op -> calls of compute the fused modules run on PyTorch by design
_warned: set[tuple[str, str]] = set()
_strict: bool | None = None


class FallbackError(RuntimeError):
    """Raised instead of falling back when strict mode is on."""


def strict() -> bool:
    if _strict is not None:
        return _strict
    return os.environ.get("CVT_CUTLASS_STRICT", "0") not in ("", "0", "false", "False")


def set_strict(value: bool | None) -> None:
    """True: fallbacks raise. False: they are counted and logged. None: follow the env var."""
    global _strict
    _strict = value


def record_fallback(op: str, reason: str, detail: str = "") -> None:
    """Count one call of ``op`` that runs on PyTorch instead of CUTLASS, and say so once."""
    if strict():
        raise FallbackError(f"cvt_cutlass.{op}: no CUTLASS kernel for this call ({reason}: {detail})")
    key = (op, reason)
    with _lock:
        _fallbacks[key] += 1
        first = key not in _warned
        _warned.add(key)
    if first:
        log.warning("cvt_cutlass.%s falls back to PyTorch (%s): %s [further ones are only counted]",
                    op, reason, detail)


def record_kernel_call(op: str) -> None:
    with _lock:
        _kernel_calls[op] += 1


def record_torch_op(op: str) -> None:
    """Count one call of a compute op that has no CUTLASS kernel (yet) and runs on PyTorch."""
    with _lock:
        _torch_ops[op] += 1


def record_selection(op: str, source: str) -> None:
    with _lock:
        _selections[(op, source)] += 1


def stats() -> dict:
    """{'kernel_calls': {op: n}, 'fallbacks': {'op:reason': n}, 'selections': {'op:source': n},
    'torch_ops': {op: n}}."""
    with _lock:
        return {
            "kernel_calls": dict(_kernel_calls),
            "fallbacks": {f"{op}:{reason}": n for (op, reason), n in _fallbacks.items()},
            "selections": {f"{op}:{src}": n for (op, src), n in _selections.items()},
            "torch_ops": dict(_torch_ops),
        }


def total_fallbacks() -> int:
    with _lock:
        return sum(_fallbacks.values())


def reset() -> None:
    with _lock:
        _kernel_calls.clear()
        _fallbacks.clear()
        _selections.clear()
        _torch_ops.clear()
        _warned.clear()
