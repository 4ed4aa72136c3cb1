"""Where a forward spends its GPU time: kernels grouped by what they compute (``--breakdown``).

One forward (after the benchmark's warm-up) under ``torch.profiler``; every CUDA kernel's time is
added to the first category whose pattern matches its name. The categories follow the issue's
split of HF's forward (LayerNorm, copies, GEMMs, GELU, cat, depthwise conv, softmax, ...), with
the CUTLASS kernels of this project in their own rows, so the table says both what the swapped
model still spends on PyTorch and what each CUTLASS family costs.
"""

from __future__ import annotations

import re
from collections import defaultdict

# (category, pattern on the kernel name); first match wins, so specific before generic.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("conv (cuDNN)", r"xmma_fprop|implicit_convolve|conv2d_c\d|cudnn(?!.*(sdpa|attn|fmha))"),
    ("gemm (Triton)", r"triton_tem|triton_.*_mm_"),
    ("gemm (cuBLAS)", r"cutlass_\d+_|cutlass3x_|nvjet|xmma|cublas"),  # cuBLAS's own CUTLASS-built kernels
    ("cutlass attention", r"cvt_attn|Fmha|fmha|FMHA|attention_kernel_batched|AttentionKernel"),
    ("cutlass layernorm", r"cvt_layernorm|cvt_ln_|layernorm_kernel"),
    ("cutlass dwconv", r"dwconv_kernel|cvt_dwconv"),
    ("cutlass conv", r"ImplicitGemmConvolution|conv::kernel|_ZN7cutlass4conv|ConvUniversal|cvt_conv2d"),
    ("cutlass gemm", r"(cutlass::|_ZN7cutlass).*(Gemm|gemm)|cvt_gemm"),
    ("layernorm", r"layer_norm|LayerNorm|layernorm"),
    ("sdpa / softmax", r"softmax|Softmax|flash|fmha|cudnn.*attn|efficient_attention"),
    ("gemm (cuBLAS)", r"gemm|Gemm|xmma|nvjet|cublas|sm90_|sm80_|ampere_|magma"),
    ("conv (cuDNN)", r"conv|Conv|fprop"),
    ("batchnorm", r"batch_norm|BatchNorm|bn_fw"),
    ("gelu", r"gelu|GeLU|Gelu"),
    ("cat", r"CatArray|cat_"),
    ("copy / permute", r"copy|Copy|transpose|permute|contiguous"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce_kernel|triton_poi"),
    ("triton (fused)", r"triton"),
)


def categorize(name: str) -> str:
    for cat, pat in CATEGORIES:
        if re.search(pat, name):
            return cat
    return "other"


def kernel_times(fn) -> dict[str, float]:
    """{kernel name: total GPU ms} of one call of ``fn`` (synchronised), from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(e, "device_time", None)
        if us is None:
            us = e.cuda_time
        if us and not e.name.startswith("Memcpy") and not e.name.startswith("Memset"):
            out[e.name] += us / 1e3
    return dict(out)


def breakdown(times: dict[str, float]) -> dict[str, tuple[float, int]]:
    """{category: (ms, kernels)} from kernel_times' output."""
    cats: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for name, ms in times.items():
        c = cats[categorize(name)]
        c[0] += ms
        c[1] += 1
    return {k: (v[0], v[1]) for k, v in sorted(cats.items(), key=lambda kv: -kv[1][0])}


def format_table(per_provider: dict[str, dict[str, float]], top: int = 8) -> str:
    """Markdown: one column per provider, ms and share of its kernel time per category; then the
    ``top`` kernels of each provider."""
    bds = {p: breakdown(t) for p, t in per_provider.items()}
    cats = sorted({c for b in bds.values() for c in b}, key=lambda c: -max(b.get(c, (0, 0))[0] for b in bds.values()))
    lines = ["| category | " + " | ".join(f"{p} ms (share)" for p in bds) + " |",
             "|---|" + "---|" * len(bds)]
    totals = {p: sum(v[0] for v in b.values()) for p, b in bds.items()}
    for c in cats:
        cells = []
        for p, b in bds.items():
            ms = b.get(c, (0.0, 0))[0]
            cells.append(f"{ms:.3f} ({100 * ms / totals[p]:.0f}%)" if ms else "-")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append("| **kernel total** | " + " | ".join(f"**{totals[p]:.3f}**" for p in bds) + " |")
    for p, t in per_provider.items():
        lines.append(f"\ntop kernels, {p}:")
        for name, ms in sorted(t.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {ms:8.3f} ms  {categorize(name):18s} {name[:150]}")
    return "\n".join(lines)
