"""1 vs N GPUs: `cvt-cutlass train` on the synthetic task (bf16 autocast, SGD), the swapped model
and HF's modules (--no-swap), eager and with the step in a CUDA graph, each at the per-GPU batch on
1 and N GPUs and at the global batch on 1 GPU (the data the N-GPU run sees, for the loss curves), and
both with SyncBatchNorm (--sync-bn) on N GPUs.

    python .ci/ddp_scaling.py OUT_DIR [STEPS] [BATCH] [GPUS]

Logs and each run's train_losses.csv go to OUT_DIR; a markdown table is printed last: steady ms per
step and img/s, scaling (N GPUs over 1 GPU at the same per-GPU batch), one whole-gradient all-reduce,
and the loss curve's distance to the 1-GPU run on the same global batch (max and mean |difference|
over the steps), HF's distance under the same engine being the noise to compare with.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def run(out: Path, model: str, mode: str, gpus: int, batch: int, steps: int) -> dict:
    tag = f"{model}_{mode}_x{gpus}_b{batch}"
    ck = Path("/tmp") / f"ck_{tag}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus), "-m",
           "cvt_cutlass.cli", "train", "--steps", str(steps), "--batch", str(batch), "--out", str(ck),
           "--cuda-graph" if mode.startswith("graph") else "--no-cuda-graph"]
    cmd += (["--no-swap"] if model == "hf" else []) + (["--sync-bn"] if mode.endswith("syncbn") else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    (out / f"scaling_{tag}.log").write_text(r.stdout + r.stderr)
    row = {"tag": tag, "model": model, "mode": mode, "gpus": gpus, "batch": batch, "rc": r.returncode}
    m = re.search(r"steady ([\d.]+) ms/step, (\d+) img/s", r.stdout)
    if m:
        row["ms"], row["imgs"] = float(m.group(1)), float(m.group(2))
    m = re.search(r"over \d+ ranks: ([\d.]+) ms", r.stdout)
    row["allreduce"] = float(m.group(1)) if m else None
    m = re.search(r"(\d+) fallbacks", r.stdout)
    row["fallbacks"] = int(m.group(1)) if m else None
    losses = ck / "train_losses.csv"
    if losses.exists():
        row["losses"] = [float(line.split(",")[1]) for line in losses.read_text().split()[1:]]
        (out / f"losses_{tag}.csv").write_text(losses.read_text())
    print(f"{tag}: exit {r.returncode}; " + "; ".join(x for x in r.stdout.splitlines()
                                                     if x.startswith(("loss", "parameters equal"))), flush=True)
    if r.returncode:
        print(r.stderr[-3000:], flush=True)
    return row


def distance(a: dict, b: dict) -> str:
    if "losses" not in a or "losses" not in b:
        return "-"
    d = [abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)]
    return f"{max(d):.4f} / {sum(d) / len(d):.4f}"


def table(rows: list[dict], n: int, batch: int) -> None:
    by = {(r["model"], r["mode"], r["gpus"], r["batch"]): r for r in rows}
    print(f"\n| model | step | GPUs | batch per GPU | ms/step | img/s | scaling vs 1 GPU | all-reduce ms | fallbacks "
          f"| loss vs 1 GPU at batch {batch * n}: max / mean abs diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = r["mode"].removesuffix("+syncbn")  # SyncBatchNorm rows against the 1-GPU runs of their step
        one = by.get((r["model"], base, 1, r["batch"]))
        scale = (f"{r['imgs'] / one['imgs']:.2f}x" if r["gpus"] > 1 and one and "imgs" in one and "imgs" in r
                 else "-")
        ref = by.get((r["model"], base, 1, batch * n))
        dist = distance(r, ref) if r["gpus"] > 1 and ref else "-"
        ms = f"{r['ms']:.2f}" if "ms" in r else f"exit {r['rc']}"
        imgs = f"{r['imgs']:.0f}" if "imgs" in r else "-"
        ar = f"{r['allreduce']:.2f}" if r["allreduce"] is not None else "-"
        print(f"| {r['model']} | {r['mode']} | {r['gpus']} | {r['batch']} | {ms} | {imgs} | {scale} | {ar} "
              f"| {r['fallbacks'] if r['fallbacks'] is not None else '-'} | {dist} |")


def main() -> int:
    out = Path(sys.argv[1])
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    import torch

    n = int(sys.argv[4]) if len(sys.argv) > 4 else torch.cuda.device_count()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model, mode in (("swapped", "eager"), ("swapped", "graph"), ("hf", "eager")):
        for gpus, b in ((1, batch), (n, batch), (1, batch * n)):
            rows.append(run(out, model, mode, gpus, b, steps))
    for model, mode in (("swapped", "graph+syncbn"), ("hf", "eager+syncbn")):  # SyncBatchNorm on N GPUs
        rows.append(run(out, model, mode, n, batch, steps))
    table(rows, n, batch)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
