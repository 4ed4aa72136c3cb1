"""``cvt-cutlass profile``: the sweep of one op family, the roofline ceilings beside it, and the
selection tables it updates (``--update-table``)."""

from __future__ import annotations

import sys
from pathlib import Path

from . import attention, conv, linear
from .driver import append_ceilings, ceilings_path, measure_ceilings
from .tables import update_from_rows

SWEEPS = {"linear": linear.sweep, "conv2d": conv.sweep, "dwconv": conv.sweep, "attention": attention.sweep}


def profile_main(a) -> int:
    import torch

    if a.op not in SWEEPS:
        print(f"cvt-cutlass profile: error: no {a.op} sweep: its kernels come from the family's heuristic "
              f"(`cvt-cutlass bench --op {a.op}` times them against PyTorch)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("cvt-cutlass profile needs a CUDA GPU; none is visible")
        return 2
    out = Path(a.out)
    ceil_path = ceilings_path(out)
    append_ceilings(ceil_path, measure_ceilings(a.dtype or ["fp16", "bf16"]))
    print(f"roofline ceilings measured: {ceil_path}", flush=True)
    rows = SWEEPS[a.op](a, out)
    if a.update_table:
        for path in update_from_rows(rows, a.table_dir, a.tolerance):
            print(f"selection table updated: {path}")
    return 0
