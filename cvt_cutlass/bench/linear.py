"""Fused Linear ops vs PyTorch's unfused sequence on a CvT's Linear layers (GPU).

For every Linear layer kind of the model (q, k, v, proj, fc1, fc2 per stage, and the head) and each
batch: ``torch.ops.cvt_cutlass.linear`` with the layer's fused epilogue against what HF runs for the
same step (``F.linear`` then ``F.gelu`` or ``+ residual``), both timed in this process by
:func:`cvt_cutlass.bench.timing.time_cuda` on random inputs. Reports median ms, TFLOP/s, the
ratio (PyTorch time / CUTLASS time: > 1 means the fused op is faster; times are CUDA-graph replays,
i.e. GPU time; the per-call time of eager launches, host overhead included, is reported beside it),
the relative error of both
against an fp32 reference, which kernel ran and whether the selection table or the heuristic chose
it, and the fallback count. Appends long-format rows to a CSV (GPU name and date in each row).
"""

from __future__ import annotations

import csv
import datetime as _dt
import math
import os
from pathlib import Path

CSV_COLUMNS = (
    "date", "gpu", "torch", "cutlass", "path", "model", "image_size", "dtype", "batch", "layer",
    "m", "n", "k", "epilogue", "count", "kernel", "selection", "peer", "peer_ms", "cutlass_ms",
    "speedup", "peer_tflops", "cutlass_tflops", "peer_rel_err", "cutlass_rel_err", "fallbacks",
    "peer_eager_ms", "cutlass_eager_ms",
)


def _inputs(layer, dtype, sets, device, gen):
    import torch

    m, n, k = layer.m, layer.n, layer.k
    w = (torch.randn(n, k, device=device, generator=gen) / math.sqrt(k)).to(dtype)
    b = (0.1 * torch.randn(n, device=device, generator=gen)).to(dtype)
    xs = [torch.randn(m, k, device=device, generator=gen).to(dtype) for _ in range(sets)]
    rs = None
    if layer.epilogue == "bias_residual":
        rs = [torch.randn(m, n, device=device, generator=gen).to(dtype) for _ in range(sets)]
    return w, b, xs, rs


def _rel_err(y, ref) -> float:
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def bench_layer(layer, dtype, device, gen):
    import torch.nn.functional as F

    from .. import fallback
    from ..ops.linear import linear
    from .timing import input_sets_for, time_cuda

    esize = 2
    bytes_per_call = esize * (layer.m * layer.k + layer.n * layer.k + layer.m * layer.n * (2 if layer.epilogue == "bias_residual" else 1))
    sets = input_sets_for(bytes_per_call)
    w, b, xs, rs = _inputs(layer, dtype, sets, device, gen)
    act = "gelu" if layer.epilogue == "bias_gelu" else "none"
    bias = None if layer.epilogue == "none" else b

    def peer(i):
        y = F.linear(xs[i], w, bias)
        if act == "gelu":
            y = F.gelu(y)
        if rs is not None:
            y = y + rs[i]
        return y

    def ours(i):
        return linear(xs[i], w, bias, None if rs is None else rs[i], act)

    # Accuracy on set 0 against an fp32 reference of the same math.
    ref = F.linear(xs[0].float(), w.float(), None if bias is None else bias.float())
    if act == "gelu":
        ref = F.gelu(ref)
    if rs is not None:
        ref = ref + rs[0].float()
    fb0 = fallback.total_fallbacks()
    y_ours = ours(0)
    err_ours, err_peer = _rel_err(y_ours, ref), _rel_err(peer(0), ref)
    t_peer = time_cuda(peer, sets=sets)
    t_ours = time_cuda(ours, sets=sets)
    e_peer = time_cuda(peer, sets=sets, graph=False, trials=7)
    e_ours = time_cuda(ours, sets=sets, graph=False, trials=7)
    fbs = fallback.total_fallbacks() - fb0
    return t_peer, t_ours, e_peer, e_ours, err_peer, err_ours, fbs


def _kernel_for(layer, dtype_name, arch, gpu):
    from ..selection import select_linear

    c = select_linear(layer.m, layer.n, layer.k, dtype_name, layer.epilogue, arch, gpu)
    return c.spec.name, c.source


def bench_main(a) -> int:
    import torch

    from .. import runtime
    from ..build import cutlass_version
    from ..models import linear_problems

    if not torch.cuda.is_available():
        print("cvt-cutlass bench needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
        return 2
    runtime.set_kernel_path(a.path)
    dev = runtime.device_info(torch.cuda.current_device())
    arch = runtime.arch_for(dev.cc)
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    date = _dt.datetime.now().strftime("%Y-%m-%d")
    rows = []
    for dt_name in a.dtype:
        for batch in a.batch:
            seen = set()
            layers = []
            for layer in linear_problems(a.model, batch, a.image_size):
                key = (layer.m, layer.n, layer.k, layer.epilogue)
                if key not in seen:
                    seen.add(key)
                    layers.append(layer)
            # Build every kernel this sweep needs up front (parallel, progress bar).
            from ..selection import select_linear

            runtime.prebuild({select_linear(lay.m, lay.n, lay.k, dt_name, lay.epilogue, arch, dev.name).spec
                              for lay in layers}, dev.cc)
            for layer in layers:
                t_peer, t_ours, x_peer, x_ours, e_peer, e_ours, fbs = bench_layer(layer, dtypes[dt_name], "cuda", gen)
                kernel, source = _kernel_for(layer, dt_name, arch, dev.name)
                rows.append({
                    "date": date, "gpu": dev.name, "torch": torch.__version__, "cutlass": cutlass_version(),
                    "path": f"sm{arch}", "model": a.model, "image_size": a.image_size or "",
                    "dtype": dt_name, "batch": batch, "layer": layer.label, "m": layer.m, "n": layer.n,
                    "k": layer.k, "epilogue": layer.epilogue, "count": layer.count, "kernel": kernel,
                    "selection": source, "peer": layer.unfused,
                    "peer_ms": f"{t_peer.median_ms:.5f}", "cutlass_ms": f"{t_ours.median_ms:.5f}",
                    "speedup": f"{t_peer.median_ms / t_ours.median_ms:.3f}",
                    "peer_tflops": f"{layer.flops / t_peer.median_ms / 1e9:.1f}",
                    "cutlass_tflops": f"{layer.flops / t_ours.median_ms / 1e9:.1f}",
                    "peer_rel_err": f"{e_peer:.2e}", "cutlass_rel_err": f"{e_ours:.2e}", "fallbacks": fbs,
                    "peer_eager_ms": f"{x_peer.median_ms:.5f}", "cutlass_eager_ms": f"{x_ours.median_ms:.5f}",
                })
                print(_fmt_row(rows[-1]), flush=True)
    if a.out:
        _append_csv(Path(a.out), rows)
    print()
    print(markdown_table(rows))
    return 0


def _fmt_row(r: dict) -> str:
    return (f"{r['dtype']} b={r['batch']:<4} {r['layer']:<8} {r['m']:>7}x{r['n']:<5}x{r['k']:<5} "
            f"{r['epilogue']:<14} torch {float(r['peer_ms']):8.4f} ms  cutlass {float(r['cutlass_ms']):8.4f} ms  "
            f"x{r['speedup']}  [{r['selection']}] {r['kernel']}")


def markdown_table(rows: list[dict]) -> str:
    head = ("| dtype | batch | layer | M x N x K | epilogue | PyTorch ms | CUTLASS ms | speedup | "
            "CUTLASS TFLOP/s | eager PyTorch / CUTLASS ms | selection | fallbacks |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['batch']} | {r['layer']} | {r['m']}x{r['n']}x{r['k']} | {r['epilogue']} | "
            f"{float(r['peer_ms']):.4f} | {float(r['cutlass_ms']):.4f} | {r['speedup']} | "
            f"{r['cutlass_tflops']} | {float(r['peer_eager_ms']):.4f} / {float(r['cutlass_eager_ms']):.4f} | "
            f"{r['selection']} | {r['fallbacks']} |"
        )
    by = {}
    for r in rows:
        by.setdefault((r["dtype"], r["batch"]), []).append(float(r["speedup"]))
    for (dt, b), s in by.items():
        geo = math.exp(sum(math.log(v) for v in s) / len(s))
        lines.append(f"\n{dt} batch {b}: geomean speedup {geo:.3f}, min {min(s):.3f}, max {max(s):.3f} "
                     f"over {len(s)} layers")
    return "\n".join(lines)


def _append_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        if new:
            w.writeheader()
        w.writerows(rows)
