"""Visible fallbacks: every call that does not run on a CUTLASS kernel is counted and logged.

``stats()`` returns the counters; the benchmark prints them. Kernel calls are counted by the
binding's hot path (atomics in C++, per op and selection source); fallbacks run in Python and are
counted here. With ``CVT_CUTLASS_STRICT=1`` (or ``set_strict(True)``) a fallback raises
``FallbackError`` instead, which is what the GPU tests use to prove that a path really ran on
CUTLASS.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import Counter

from .switch import Switch

log = logging.getLogger("cvt_cutlass")

_lock = threading.Lock()
_fallbacks: Counter[tuple[str, str]] = Counter()  # (op, reason) -> calls that ran on PyTorch
_warned: set[tuple[str, str]] = set()
_layer_paths: Counter[str] = Counter()  # reason -> CvT layers run op by op instead of as one layer op
_stage_graphs: Counter[str] = Counter()  # 'replays', 'captures', 'eager: <reason>' (cvt_cutlass.graphs)
# ops the binding counts that launch other ops' kernels (not kernels of their own)
COMPOSITES = ("mlp", "cvt_layer", "cvt_layer_backward")
_STRICT = Switch("CVT_CUTLASS_STRICT", default=False)


class FallbackError(RuntimeError):
    """Raised instead of falling back when strict mode is on."""


def strict() -> bool:
    return _STRICT()


def set_strict(value: bool | None) -> None:
    """True: fallbacks raise. False: they are counted and logged. None: follow the env var."""
    _STRICT.set(value)


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
        log.warning("cvt_cutlass.%s falls back to PyTorch (%s): %s [further ones are only counted: "
                    "cvt_cutlass.stats()]", op, reason, detail)


def record_layer_path(reason: str) -> None:
    """Count one CvT layer that runs op by op (its kernels still run) because the layer op does
    not serve it, and say so once per reason. Inside a torch.compile trace only the count (Dynamo
    replays it on every call of the compiled graph; a lock or a log there would break the graph)."""
    torch = sys.modules.get("torch")  # (this module imports no torch of its own)
    if torch is not None and torch.compiler.is_compiling():
        _layer_paths[reason] += 1
        return
    with _lock:
        _layer_paths[reason] += 1
        first = ("layer", reason) not in _warned
        _warned.add(("layer", reason))
    if first:
        log.warning("cvt_cutlass: a CvT layer runs op by op, not as one layer op (%s) [further ones are only "
                    "counted: cvt_cutlass.stats()['layer_paths']]", reason)


def stats() -> dict:
    """{'kernel_calls': {op: n}, 'fallbacks': {'op:reason': n}, 'selections': {'op:source': n},
    'fused_calls': {op: n}, 'layer_paths': {reason: n}, 'library_host_us': {family: us}, 'op_host_us': {op: us}}: calls
    that ran on a CUTLASS kernel, calls that ran on PyTorch and why, for the kernel calls whether
    the tuned table or the heuristic chose the kernel; calls of the ops made of other ops (mlp,
    the layer op and its backward); CvT layers run op by op and why; host time spent inside the
    kernel libraries' launch entry points (params, TMA descriptors, the launch API) per family;
    'op_host_us': {op: us}, host time inside the layer op's forward and backward (the libraries'
    time included); 'stage_graphs': the fused stages' CUDA graph replays, captures and eager calls
    by reason (:mod:`cvt_cutlass.graphs`)."""
    from .runtime import kernel_counters, library_host_time, op_host_time

    calls, sel, fused = {}, {}, {}
    for op, (table, heuristic) in kernel_counters().items():
        if op in COMPOSITES:
            if table + heuristic:
                fused[op] = table + heuristic
            continue
        if table + heuristic:
            calls[op] = table + heuristic
        for src, n in (("table", table), ("heuristic", heuristic)):
            if n:
                sel[f"{op}:{src}"] = n
    with _lock:
        fb = {f"{op}:{reason}": n for (op, reason), n in _fallbacks.items()}
        paths = dict(_layer_paths)
    lib = {fam: round(ns / 1e3, 1) for fam, (_, ns) in library_host_time().items()}
    op_host = {op: round(ns / 1e3, 1) for op, (_, ns) in op_host_time().items()}
    return {"kernel_calls": calls, "fallbacks": fb, "selections": sel, "fused_calls": fused, "layer_paths": paths,
            "library_host_us": lib, "op_host_us": op_host, "stage_graphs": stage_graph_stats()}


def total_fallbacks() -> int:
    with _lock:
        return sum(_fallbacks.values())


def record_stage_graph(what: str) -> None:
    """Count a fused stage's CUDA graph replay, capture, or eager call ('eager: <reason>')."""
    with _lock:
        _stage_graphs[what] += 1


def stage_graph_stats() -> dict[str, int]:
    with _lock:
        return dict(_stage_graphs)


def reset_stage_graph_stats() -> None:
    with _lock:
        _stage_graphs.clear()


def tally() -> int:
    """Fallbacks and op-by-op layers counted so far (a change tells that a call ran one)."""
    with _lock:
        return sum(_fallbacks.values()) + sum(_layer_paths.values())


def reset() -> None:
    """Zero the counters (kernel calls and fallbacks). The warnings stay said: each (op, reason)
    is logged once per process, however often the counters are reset."""
    from .runtime import reset_kernel_counters

    reset_kernel_counters()
    with _lock:
        _stage_graphs.clear()
        _fallbacks.clear()
        _layer_paths.clear()
