"""Fused Linear ops vs PyTorch's unfused sequence on a CvT's Linear layers (GPU).

For every Linear layer kind of the model (q, k, v, proj, fc1, fc2 per stage, and the head) and each
batch: ``torch.ops.cvt_cutlass.linear`` with the layer's fused epilogue against what HF runs for the
same step (``F.linear`` then ``F.gelu`` or ``+ residual``), both timed in this process by
:func:`cvt_cutlass.tools.timing.time_cuda` on random inputs. Reports median ms, TFLOP/s, the
ratio (PyTorch time / CUTLASS time: > 1 means the fused op is faster; times are CUDA-graph replays,
i.e. GPU time; the per-call time of eager launches, host overhead included, is reported beside it),
the relative error of both
against an fp32 reference, which kernel ran and whether the selection table or the heuristic chose
it, and the fallback count. Appends long-format rows to a CSV (GPU name and date in each row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..compare import rel_err
from .common import geomean, markdown, run_bench

CSV_COLUMNS = (
    "date", "gpu", "torch", "cutlass", "path", "model", "image_size", "dtype", "batch", "layer",
    "m", "n", "k", "epilogue", "count", "kernel", "selection", "peer", "peer_ms", "cutlass_ms",
    "speedup", "peer_tflops", "cutlass_tflops", "peer_rel_err", "cutlass_rel_err", "fallbacks",
    "peer_eager_ms", "cutlass_eager_ms",
)


@dataclass
class LinearCase:
    """Random inputs for one Linear problem, PyTorch's unfused sequence for it and an fp32
    reference of the same math (shared by the benchmark and the profile sweep)."""

    w: object
    bias: object  # None for the "none" epilogue
    xs: list  # ``sets`` input sets, rotated so small problems do not time the L2
    rs: list | None  # residuals for bias_residual
    activation: str
    ref: object  # fp32 result on set 0
    # the kernel's second output on set 0, in fp32: bias_gelu_aux's pre-activation, bias_gelu_dgelu's
    # GELU derivative at it
    ref_aux: object = None

    def peer(self, i: int):
        import torch.nn.functional as F

        y = F.linear(self.xs[i], self.w, self.bias)
        y = F.gelu(y) if self.activation == "gelu" else y
        return y + self.rs[i] if self.rs is not None else y

    def residual(self, i: int):
        return None if self.rs is None else self.rs[i]

    @property
    def sets(self) -> int:
        return len(self.xs)


def make_case(m: int, n: int, k: int, epilogue: str, dtype, gen, device: str = "cuda") -> LinearCase:
    import torch
    import torch.nn.functional as F

    from ...epilogues import gelu_grad
    from ..timing import input_sets_for

    res = epilogue == "bias_residual"
    aux = epilogue in ("bias_gelu_aux", "bias_gelu_dgelu")
    sets = input_sets_for(2 * (m * k + n * k + m * n * (2 if res or aux else 1)))
    w = (torch.randn(n, k, device=device, generator=gen) / math.sqrt(k)).to(dtype)
    b = (0.1 * torch.randn(n, device=device, generator=gen)).to(dtype)
    bias = None if epilogue == "none" else b
    xs = [torch.randn(m, k, device=device, generator=gen).to(dtype) for _ in range(sets)]
    rs = [torch.randn(m, n, device=device, generator=gen).to(dtype) for _ in range(sets)] if res else None
    act = "gelu" if epilogue in ("bias_gelu", "bias_gelu_aux", "bias_gelu_dgelu") else "none"
    z = F.linear(xs[0].float(), w.float(), None if bias is None else bias.float())
    ref = F.gelu(z) if act == "gelu" else z
    ref = ref + rs[0].float() if res else ref
    ref_aux = gelu_grad(z) if epilogue == "bias_gelu_dgelu" else z if aux else None
    return LinearCase(w, bias, xs, rs, act, ref, ref_aux)


def bench_layer(layer, dtype, device, gen):
    from ... import fallback
    from ...ops.linear import linear
    from ..timing import time_cuda

    c = make_case(layer.m, layer.n, layer.k, layer.epilogue, dtype, gen, device)

    def ours(i):
        return linear(c.xs[i], c.w, c.bias, c.residual(i), c.activation)

    fb0 = fallback.total_fallbacks()
    err_ours, err_peer = rel_err(ours(0), c.ref), rel_err(c.peer(0), c.ref)
    t_peer = time_cuda(c.peer, sets=c.sets)
    t_ours = time_cuda(ours, sets=c.sets)
    e_peer = time_cuda(c.peer, sets=c.sets, graph=False, trials=7)
    e_ours = time_cuda(ours, sets=c.sets, graph=False, trials=7)
    fbs = fallback.total_fallbacks() - fb0
    return t_peer, t_ours, e_peer, e_ours, err_peer, err_ours, fbs


def bench_main(a) -> int:
    """``bench --op linear``: every distinct Linear problem of the model against PyTorch's unfused
    sequence (graphed and eager)."""
    choices: dict = {}

    def problems_of(run, dt_name: str, batch: int) -> list:
        from ... import runtime
        from ...operators.linear import select_linear
        from ...operators.linear.problems import linear_problems

        distinct: dict = {}
        for p in linear_problems(a.model, batch, a.image_size):
            distinct.setdefault((p.m, p.n, p.k, p.epilogue), p)  # the first layer of each problem
        layers = list(distinct.values())
        for lay in layers:
            choices[lay, dt_name] = select_linear(lay.m, lay.n, lay.k, dt_name, lay.epilogue, run.arch, run.dev.name)
        runtime.prebuild({choices[lay, dt_name].spec for lay in layers}, run.dev.cc)  # parallel, progress bar
        return layers

    def measure(run, dt_name: str, batch: int, layer) -> list[dict]:
        t_peer, t_ours, x_peer, x_ours, e_peer, e_ours, fbs = bench_layer(layer, run.torch_dtype[dt_name], "cuda",
                                                                          run.gen)
        choice = choices[layer, dt_name]
        row = {
            **run.row, "dtype": dt_name, "batch": batch, "layer": layer.label, "m": layer.m, "n": layer.n,
            "k": layer.k, "epilogue": layer.epilogue, "count": layer.count, "kernel": choice.spec.name,
            "selection": choice.source, "peer": layer.unfused,
            "peer_ms": f"{t_peer.median_ms:.5f}", "cutlass_ms": f"{t_ours.median_ms:.5f}",
            "speedup": f"{t_peer.median_ms / t_ours.median_ms:.3f}",
            "peer_tflops": f"{layer.flops / t_peer.median_ms / 1e9:.1f}",
            "cutlass_tflops": f"{layer.flops / t_ours.median_ms / 1e9:.1f}",
            "peer_rel_err": f"{e_peer:.2e}", "cutlass_rel_err": f"{e_ours:.2e}", "fallbacks": fbs,
            "peer_eager_ms": f"{x_peer.median_ms:.5f}", "cutlass_eager_ms": f"{x_ours.median_ms:.5f}",
        }
        print(_fmt_row(row), flush=True)
        return [row]

    return run_bench(a, problems_of, measure, CSV_COLUMNS, markdown_table)


def _fmt_row(r: dict) -> str:
    return (f"{r['dtype']} b={r['batch']:<4} {r['layer']:<8} {r['m']:>7}x{r['n']:<5}x{r['k']:<5} "
            f"{r['epilogue']:<14} torch {float(r['peer_ms']):8.4f} ms  cutlass {float(r['cutlass_ms']):8.4f} ms  "
            f"x{r['speedup']}  [{r['selection']}] {r['kernel']}")


def markdown_table(rows: list[dict]) -> str:
    head = ["dtype", "batch", "layer", "M x N x K", "epilogue", "PyTorch ms", "CUTLASS ms", "speedup",
            "CUTLASS TFLOP/s", "eager PyTorch / CUTLASS ms", "selection", "fallbacks"]
    lines = markdown(head, ([
        r["dtype"], r["batch"], r["layer"], f"{r['m']}x{r['n']}x{r['k']}", r["epilogue"],
        f"{float(r['peer_ms']):.4f}", f"{float(r['cutlass_ms']):.4f}", r["speedup"], r["cutlass_tflops"],
        f"{float(r['peer_eager_ms']):.4f} / {float(r['cutlass_eager_ms']):.4f}", r["selection"], r["fallbacks"]]
        for r in rows))
    src = [r["selection"] for r in rows]
    lines.append(f"\nkernel choices: {src.count('table')} from the selection table, "
                 f"{src.count('heuristic')} heuristic; fallbacks: {sum(int(r['fallbacks']) for r in rows)}")
    by = {}
    for r in rows:
        by.setdefault((r["dtype"], r["batch"]), []).append(float(r["speedup"]))
    for (dt, b), s in by.items():
        lines.append(f"\n{dt} batch {b}: geomean speedup {geomean(s):.3f}, min {min(s):.3f}, max {max(s):.3f} "
                     f"over {len(s)} layers")
    return "\n".join(lines)

