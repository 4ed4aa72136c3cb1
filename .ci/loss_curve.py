"""The loss curve of a fixed small task (GPU): HF and the swapped model train the same CvT-13 on
the same synthetic batches (cvt_cutlass.train.SyntheticTask, 10 classes), bf16 autocast, SGD
momentum, N steps; CSV and PNG of both curves, and the mean loss of the last 50 steps of each.
Usage: python .ci/loss_curve.py OUT_DIR [steps] [batch]."""

from __future__ import annotations

import copy
import csv
import sys
from pathlib import Path

import torch

from cvt_cutlass.checkpoint import random_cvt
from cvt_cutlass.swap import swap
from cvt_cutlass.train import SyntheticTask, fit_classifier, make_optimizer, make_step, precision_of


def curve(model, steps: int, batch: int) -> list[float]:
    task = SyntheticTask(10, 224, "cuda", seed=0)
    step = make_step(model, make_optimizer(model.parameters(), "sgd", 0.01, 5e-5), precision_of("fp32", "bf16", True),
                     "cuda")
    torch.manual_seed(0)  # the same drop-path draws for both
    return [float(step(*task.batch(batch))) for _ in range(steps)]


def main() -> None:
    out = Path(sys.argv[1])
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    base = random_cvt("cvt-13").train()
    fit_classifier(base, 10)
    curves = {"hf": curve(copy.deepcopy(base).cuda().train(), steps, batch),
              "swapped": curve(swap(copy.deepcopy(base).cuda().train()), steps, batch)}
    with open(out / "loss_curve.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *curves])
        w.writerows([i, *(c[i] for c in curves.values())] for i in range(steps))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, c in curves.items():
        ax.plot(c, label={"hf": "HF eager", "swapped": "cvt_cutlass swapped"}[name], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title(f"CvT-13, synthetic 10-class task, batch {batch}, bf16 autocast, SGD momentum "
                 f"({torch.cuda.get_device_name()})", fontsize=8)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png", dpi=110)
    for name, c in curves.items():
        print(f"| {name} | {c[0]:.4f} | {sum(c[-50:]) / 50:.4f} |")


if __name__ == "__main__":
    main()
