"""Where a training step's time goes (GPU): wall ms per step, the GPU's busy time, and the torch
profiler's top host (self CPU) and device entries, the device launches by kernel and the device
time by part (the kernel libraries by op and pass, then the PyTorch ops), for HF eager and the
swapped model at one batch (bf16 autocast, SGD momentum); providers hf, swapped, compile
(torch.compile(HF)), swapped_compile (each swapped one with swap's default fp32 residual stream), swapped_16bit
(swap(residual_stream="compute")), swapped_hidden (the fp32 stream with the model's config asking for
hidden states: every stage output stays fp32, none rounded for the next embedding). Usage: python
.ci/train_profile.py [batch] [providers]."""

from __future__ import annotations

import copy
import sys
import time

import torch

from cvt_cutlass.checkpoint import random_cvt
from cvt_cutlass.swap import swap
from cvt_cutlass.train import make_optimizer, make_step, precision_of


def build_step(base, prov: str, prec):
    """The eager training step of a fresh copy of ``base`` on the GPU for one provider: HF's model,
    the swapped one, and either under torch.compile (as the train bench runs them)."""
    model = copy.deepcopy(base).cuda().train()
    if prov.startswith("swapped"):
        swap(model, residual_stream="compute" if prov.endswith("_16bit") else "fp32")
    if prov.endswith("_hidden"):
        model.config.output_hidden_states = True
    if prov.endswith("compile"):
        model = torch.compile(model)
    return make_step(model, make_optimizer(model.parameters(), "sgd", 0.01, 0.0), prec, "cuda")


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    provs = sys.argv[2].split(",") if len(sys.argv) > 2 else ["hf", "swapped"]
    base = random_cvt("cvt-13").train()
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    prec = precision_of("fp32", "bf16", True)
    for prov in provs:
        step = build_step(base, prov, prec)
        for _ in range(6 if prov.endswith("compile") else 4):
            step(x, y)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            step(x, y)
        host = (time.perf_counter() - t0) / 5 * 1e3  # enqueue time when the GPU keeps up
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 5 * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA], record_shapes=True) as prof:
            for _ in range(2):
                step(x, y)
            torch.cuda.synchronize()
        ka = prof.key_averages()
        gpu_ms = sum(e.self_device_time_total for e in ka) / 2 / 1e3
        print(f"\n=== {prov} batch {batch}: wall {wall:.2f} ms/step, host enqueue {host:.2f} ms/step (before sync), "
              f"GPU busy {gpu_ms:.2f} ms/step", flush=True)
        print(ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
        print(ka.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=70))
        launches_by_kernel(ka, 2)
        parts_table(ka, 2)
        glue = [e for e in prof.key_averages(group_by_input_shape=True)
                if e.key in ("aten::add_", "aten::add", "aten::copy_", "aten::fill_", "aten::mul", "aten::addcmul")]
        print("glue ops by input shape (calls per 2 steps, device us):")
        for e in sorted(glue, key=lambda e: -e.self_device_time_total)[:25]:
            print(f"  {e.key:14s} {e.count:5d} {e.self_device_time_total:10.0f}  {str(e.input_shapes)[:110]}")
        del step
        torch.cuda.empty_cache()


def parts_table(ka, steps: int) -> None:
    """Device time per step by part: the kernel libraries' launches by op and pass (the binding's
    profiler scopes, cvt_kernel::<op>_<pass>), then the PyTorch ops that launched the rest."""
    cpu = [e for e in ka if e.device_type == torch.autograd.DeviceType.CPU and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in cpu) / steps
    ours = sorted(((e.self_device_time_total / steps, e.count / steps, e.key) for e in cpu
                   if e.key.startswith("cvt_kernel::")), reverse=True)
    torch_ops = sorted(((e.self_device_time_total / steps, e.count / steps, e.key) for e in cpu
                        if not e.key.startswith("cvt_kernel::")), reverse=True)
    print(f"\ndevice time by part, per step (total {total:.0f} us)\n| part | us | share | launching calls |")
    print("|---|---|---|---|")
    for us, n, key in ours + torch_ops[:12]:
        print(f"| {key} | {us:.0f} | {us / max(total, 1e-9):.1%} | {n:.0f} |")
    print(f"| (kernel libraries, all) | {sum(r[0] for r in ours):.0f} | "
          f"{sum(r[0] for r in ours) / max(total, 1e-9):.1%} | |")


def launches_by_kernel(ka, steps: int) -> None:
    """Device entries (kernels, memsets, copies) by launches per step, most first."""
    rows = [(e.count / steps, e.self_device_time_total / steps, e.key) for e in ka
            if e.device_type == torch.autograd.DeviceType.CUDA and e.count]
    print(f"device launches per step: {sum(r[0] for r in rows):.0f}")
    for n, us, key in sorted(rows, reverse=True)[:40]:
        print(f"  {n:6.1f} {us:9.0f} us  {key[:120]}")


if __name__ == "__main__":
    main()
