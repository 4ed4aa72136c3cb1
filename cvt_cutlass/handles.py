"""Integer handles of the fused stages, for the ops that name a stage by one
(``torch.ops.cvt_cutlass.stage_infer``: an op's arguments cannot be modules). A handle names its
stage while the stage lives; a stage takes a new one when its folded weights are derived anew
(compiled graphs specialise on it, so they recompile)."""

from __future__ import annotations

import itertools
import weakref

_STAGES: dict[int, weakref.ref] = {}
_NEXT = itertools.count()


def register(stage) -> int:
    """A new handle for ``stage``."""
    handle = next(_NEXT)
    _STAGES[handle] = weakref.ref(stage, lambda _ref, h=handle: _STAGES.pop(h, None))
    return handle


def stage_of(handle: int):
    """The live stage ``handle`` names, or None."""
    ref = _STAGES.get(handle)
    return None if ref is None else ref()
