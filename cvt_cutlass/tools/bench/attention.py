"""CvT's attention on CUTLASS vs HF's einsum path and every SDPA backend (GPU), same process.

Inputs are what the projections produce: q (B, Lq, H*D) and k, v (B, Lkv, H*D) rows. Peers:

* ``hf``: HF CvtSelfAttention's math: rearrange to (B, H, L, D) views, einsum, * scale, softmax,
  einsum, rearrange back to (B, Lq, H*D) (contiguous, as the out-projection reads it).
* ``sdpa_<backend>``: ``F.scaled_dot_product_attention(q, k, v, scale=...)`` on the same (B, H, L, D)
  views with the backend forced (flash, efficient, cudnn, math) and with PyTorch's default choice,
  then back to (B, Lq, H*D). A backend that refuses the problem is reported as n/a.
* ``cutlass``: ``cvt_cutlass.attention`` on the (B, L, H, D) views (no permute copies), output
  already (B, Lq, H, D) = (B, Lq, H*D).

CUDA-graph medians; ratios = peer time / CUTLASS time; the relative error of each against an fp32
reference on the first image; the kernel and whether the table or the heuristic chose it.
"""

from __future__ import annotations

import math

from .common import geomean, markdown, run_bench

BACKENDS = ("flash", "efficient", "cudnn", "math")
CSV_COLUMNS = ("date", "gpu", "torch", "cutlass", "path", "model", "image_size", "dtype", "batch", "layer",
               "heads", "lq", "lkv", "head_dim", "provider", "ms", "tflops", "speedup_of_cutlass", "rel_err",
               "kernel", "selection", "fallbacks")


def bench_main(a) -> int:
    """``bench --op attention``: every stage's attention, ours against HF's einsum sequence and each
    SDPA backend."""
    from ...operators.attention import attention_problems

    return run_bench(a, lambda run, dt, batch: attention_problems(a.model, batch, a.image_size), _measure,
                     CSV_COLUMNS, markdown_table)


def _timed(fn, ref, backend) -> tuple[float, float]:
    """(median ms, error against the float64 reference on the first image) of one provider."""
    from contextlib import nullcontext

    from torch.nn.attention import sdpa_kernel

    from ..timing import time_cuda

    with sdpa_kernel([backend]) if backend is not None else nullcontext():
        return time_cuda(fn).median_ms, float((fn(0)[:1].float() - ref).norm() / ref.norm())


def _measure(run, dt_name: str, batch: int, lay) -> list[dict]:
    from torch.nn.attention import SDPBackend

    from ... import fallback
    from ...operators.attention import select_attention

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    q4, k4, v4, hf, ours, peers, ref = _case(lay, run.torch_dtype[dt_name], run.gen, backend)
    b, h, lq, lkv, d = lay.n, lay.heads, lay.lq, lay.lkv, lay.head_dim
    fallback.reset()
    choice = select_attention(b, h, lq, lkv, d, dt_name, run.arch, run.dev.name)
    t_ours, err_ours = _timed(ours, ref, None)
    fbs = fallback.total_fallbacks()
    results = {}
    for name, fn, bk in peers:
        try:
            results[name] = (*_timed(fn, ref, bk), "")
        except RuntimeError as e:  # the backend refuses this problem
            results[name] = (None, None, str(e).splitlines()[0][:60])
    results["cutlass"] = (t_ours, err_ours, "")
    rows = [{
        **run.row, "dtype": dt_name,
        "batch": batch, "layer": lay.label, "heads": h, "lq": lq, "lkv": lkv, "head_dim": d,
        "provider": name, "ms": f"{t:.5f}" if t else "n/a",
        "tflops": f"{lay.flops / t / 1e9:.1f}" if t else "",
        "speedup_of_cutlass": f"{t / t_ours:.3f}" if t else "",
        "rel_err": f"{err:.2e}" if err is not None else why,
        "kernel": choice.spec.name if name == "cutlass" else "",
        "selection": choice.source if name == "cutlass" else "", "fallbacks": fbs,
    } for name, (t, err, why) in results.items()]
    line = "  ".join(f"{n} {r[0]:.4f}" if r[0] else f"{n} n/a" for n, r in results.items())
    print(f"{dt_name} b={batch} {lay.label} H={h} {lq}/{lkv}: {line}  [{choice.source}] {choice.spec.name}",
          flush=True)
    return rows


def _case(lay, dtype, gen, backend):
    """Inputs as the projections write them, HF's step, our op and the SDPA peers for one problem."""
    import torch
    import torch.nn.functional as F

    from ...ops.attention import attention, attention_reference

    b, h, d, lq, lkv, s = lay.n, lay.heads, lay.head_dim, lay.lq, lay.lkv, lay.scale
    q = torch.randn(b, lq, h * d, device="cuda", generator=gen).to(dtype)
    kv = torch.randn(b, lkv, 2 * h * d, device="cuda", generator=gen).to(dtype)
    k, v = kv[..., : h * d], kv[..., h * d:]
    q4, k4, v4 = q.view(b, lq, h, d), k.view(b, lkv, h, d), v.view(b, lkv, h, d)
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q4, k4, v4))

    def back(o):
        return o.permute(0, 2, 1, 3).reshape(b, o.shape[2], h * d)

    def hf(_):
        sc = torch.einsum("bhlk,bhtk->bhlt", qh, kh) * s
        return back(torch.einsum("bhlt,bhtv->bhlv", torch.softmax(sc, dim=-1), vh))

    def ours(_):
        return attention(q4, k4, v4, s)[0].view(b, lq, h * d)

    with torch.no_grad():
        ref = attention_reference(q4[:1], k4[:1], v4[:1], s)[0].float().view(1, lq, h * d)
    peers = [("hf", hf, None), ("sdpa_default", lambda _: back(F.scaled_dot_product_attention(
        qh, kh, vh, scale=s)), None)]
    peers += [(f"sdpa_{n}", lambda _: back(F.scaled_dot_product_attention(qh, kh, vh, scale=s)),
               backend[n]) for n in BACKENDS]
    return q4, k4, v4, hf, ours, peers, ref


def markdown_table(rows: list[dict]) -> str:
    provs = ["hf", "sdpa_default"] + [f"sdpa_{n}" for n in BACKENDS] + ["cutlass"]
    head = ["dtype", "batch", "layer", "H, Lq/Lkv", *(f"{p} ms" for p in provs), "vs HF", "vs best SDPA", "fallbacks"]
    cells = []
    groups: dict[tuple, dict] = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["batch"], r["layer"], r["heads"], r["lq"], r["lkv"]), {})[r["provider"]] = r
    ratios: dict[tuple, list[float]] = {}
    for (dt, b, lay, h, lq, lkv), g in groups.items():
        t = {p: (float(g[p]["ms"]) if p in g and g[p]["ms"] != "n/a" else None) for p in provs}
        sdpa = [t[p] for p in provs if p.startswith("sdpa") and t[p]]
        best = min(sdpa) if sdpa else None
        ours = t["cutlass"]
        vs_best = best / ours if best and ours else float("nan")
        ratios.setdefault((dt, b), []).append(vs_best)
        cells.append([dt, b, lay, f"{h}, {lq}/{lkv}", *(f"{t[p]:.4f}" if t[p] else "n/a" for p in provs),
                      f"{t['hf'] / ours:.2f}x", f"{vs_best:.2f}x", g["cutlass"]["fallbacks"]])
    lines = markdown(head, cells)
    for (dt, b), rs in ratios.items():
        ok = [x for x in rs if math.isfinite(x)]
        if ok:
            lines.append(f"\n{dt} batch {b}: CUTLASS vs the fastest SDPA backend, geomean {geomean(ok):.3f}x, "
                         f"min {min(ok):.3f}x")
    return "\n".join(lines)
