"""The one CSV writer behind profile sweeps, ceilings and benchmarks: append rows, header once."""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Sequence
from pathlib import Path


def append_csv(path: str | Path, rows: Iterable[dict], columns: Sequence[str], *, ignore_extra: bool = False) -> None:
    """Append ``rows`` to ``path`` (creating it and its folder), writing the header only into an
    empty file. Keys outside ``columns`` raise unless ``ignore_extra``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore" if ignore_extra else "raise")
        if new:
            w.writeheader()
        w.writerows(rows)
