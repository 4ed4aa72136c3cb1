"""The gradient-agreement table (GPU): per model and precision mode, every parameter gradient of HF
and of the swapped model against HF in fp32 (cvt_cutlass.tools.bench.train.gradient_agreement); rows to
$OUT/grad_agreement.csv, a summary table printed last.
Usage: python .ci/grad_agreement.py OUT_DIR [MODES (comma-separated, default all)] [MODELS (default cvt-13,cvt-21)]."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from cvt_cutlass.tools.bench.train import GRAD_MODES, gradient_agreement


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    modes = sys.argv[2].split(",") if len(sys.argv) > 2 else list(GRAD_MODES)
    models = sys.argv[3].split(",") if len(sys.argv) > 3 else ["cvt-13", "cvt-21"]
    unknown = set(modes) - set(GRAD_MODES)
    if unknown:
        raise SystemExit(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(GRAD_MODES)}")
    rows, lines = [], ["| model | mode | HF rel err | swapped rel err | HF cos | swapped cos | median ratio | max ratio |",
                       "|---|---|---|---|---|---|---|---|"]
    for model in models:
        for mode in modes:
            r, s = gradient_agreement(model, mode)
            rows += r
            lines.append(f"| {model} | {mode} | {s['hf_rel_err']:.4f} | {s['swapped_rel_err']:.4f} | {s['hf_cos']:.5f} "
                         f"| {s['swapped_cos']:.5f} | {s['median_ratio']:.3f} | {s['max_ratio']:.2f} |")
            print(lines[-1], flush=True)
    with open(out / "grad_agreement.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
