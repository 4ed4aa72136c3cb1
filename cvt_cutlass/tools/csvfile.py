"""The one CSV writer behind profile sweeps, ceilings and benchmarks: append rows, header once."""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Sequence
from pathlib import Path


def append_csv(path: str | Path, rows: Iterable[dict], columns: Sequence[str], *, ignore_extra: bool = False) -> None:
    """Append ``rows`` to ``path`` (creating it and its folder), writing the header only into an
    empty file. Keys outside ``columns`` raise unless ``ignore_extra``. A file written with other
    columns gets the rows under its own header when it has every one of ``columns`` (in its
    order), else a ValueError: rows are never written under the wrong names."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or os.path.getsize(path) == 0
    fields = list(columns)
    if not new:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if header != fields:
            missing = [c for c in fields if c not in header]
            if missing:
                raise ValueError(f"{path} has the columns {header}, without {missing}: write these rows to a new file")
            fields = header
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore" if ignore_extra else "raise")
        if new:
            w.writeheader()
        w.writerows(rows)
