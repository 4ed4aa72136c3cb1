"""``cvt-cutlass bench --op host``: host time per op call, each op against PyTorch's equivalent.

What a call costs on the CPU before the GPU sees it (Python, dispatcher, argument checks,
kernel choice, argument building, launch): tiny random inputs on the GPU, ``calls`` back-to-back
calls with no synchronisation (fewer than CUDA's launch queue holds, so the CPU never waits for
the GPU), wall time / calls, median over trials, after a warm-up that fills the plan cache and
builds the kernels. Modes: ``torch.inference_mode()`` (no autograd dispatch), ``torch.no_grad()``
(the ops' autograd kernels run their no-grad branch) and grad mode with no input requiring grad.

Runs against any installed cvt_cutlass with the public op names (``cvt_cutlass.linear``, ...,
``torch.ops.cvt_cutlass.<op>.default``), also as a script, so an earlier version can be measured
the same way: ``python cvt_cutlass/bench/host.py --label before --out host.csv``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time


def _cases(torch):
    """(op, label, cvt_cutlass call, PyTorch call) on tiny fp16 inputs."""
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape, dtype=torch.float16):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    x, w, b = r(4, 16, 64), r(256, 64), r(256)
    xn, wk, bk = r(2, 16, 16, 64), r(64, 3, 3, 64), r(64)  # NHWC image, KRSC filter
    xc, wc = xn.permute(0, 3, 1, 2).contiguous(), wk.permute(0, 3, 1, 2).contiguous()
    t, wd, bd = r(2, 1 + 64, 64), r(3, 3, 64, dtype=torch.float32), r(64, dtype=torch.float32)  # cls + 8x8
    td, wdd = t[:, 1:].reshape(2, 8, 8, 64).permute(0, 3, 1, 2).contiguous(), wd.permute(2, 0, 1)[:, None].half()
    q, k, v = r(2, 50, 2, 64), r(2, 13, 2, 64), r(2, 13, 2, 64)
    qt, kt, vt = (a.transpose(1, 2) for a in (q, k, v))
    ln_x, ln_w, ln_b = r(2, 64, 64), r(64), r(64)
    ops = torch.ops.cvt_cutlass
    import cvt_cutlass

    return [
        ("linear", "bias+GELU, torch.ops direct", lambda: ops.linear.default(x, w, b, None, "gelu"),
         lambda: F.gelu(F.linear(x, w, b))),
        ("linear", "bias+GELU, cvt_cutlass.linear", lambda: cvt_cutlass.linear(x, w, b, activation="gelu"),
         lambda: F.gelu(F.linear(x, w, b))),
        ("conv2d_nhwc", "3x3 s2 embedding", lambda: ops.conv2d_nhwc.default(xn, wk, bk, 2, 1),
         lambda: F.conv2d(xc, wc, bk, 2, 1)),
        ("dwconv_tokens", "3x3 s2 depthwise, cls row", lambda: ops.dwconv_tokens.default(t, wd, bd, 8, 8, 2, 1),
         lambda: F.conv2d(td, wdd, bd.half(), 2, 1, groups=64)),
        ("attention", "197/50-like, 2 heads", lambda: ops.attention.default(q, k, v, 0.05),
         lambda: F.scaled_dot_product_attention(qt, kt, vt, scale=0.05)),
        ("layer_norm_tokens", "64 channels", lambda: ops.layer_norm_tokens.default(ln_x, ln_w, ln_b, 1e-5, None),
         lambda: F.layer_norm(ln_x, (64,), ln_w, ln_b, 1e-5)),
    ]


def _prebuild(torch) -> None:
    """Build the kernels the tiny calls select, in parallel, before the warm-up (else the first
    call of each op builds its kernel, one after another)."""
    from cvt_cutlass import runtime
    from cvt_cutlass.operators.attention import select_attention
    from cvt_cutlass.operators.conv2d import conv_window, select_conv2d
    from cvt_cutlass.operators.dwconv import select_dwconv
    from cvt_cutlass.operators.layernorm import select_layernorm
    from cvt_cutlass.operators.linear import select_linear

    cc = runtime.device_info(torch.cuda.current_device())
    arch, dt = runtime.arch_for(cc.cc), "fp16"
    specs = [select_linear(64, 256, 64, dt, "bias_gelu", arch, cc.name).spec,
             select_conv2d(2 * 8 * 8, 64, 9 * 64, 64, dt, arch, cc.name, conv_window(64, 64, 3, 3, 16, 2, 1)).spec,
             select_dwconv(2 * 4 * 4, 64, 2, dt, arch, cc.name).spec,
             select_attention(2, 2, 50, 13, 64, dt, arch, cc.name).spec,
             select_layernorm(2 * 64, 64, dt, arch, cc.name).spec]
    runtime.prebuild(specs, cc.cc)


def host_us(torch, fn, calls: int = 200, trials: int = 15) -> float:
    """Median host microseconds per call of ``fn`` (see the module docstring)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def _library_totals() -> tuple[int, int] | None:
    """(launches, ns) inside the kernel libraries so far, where the installed version counts them."""
    from cvt_cutlass import runtime

    fn = getattr(runtime, "library_host_time", None)
    if fn is None:
        return None
    per = fn().values()
    return sum(c for c, _ in per), sum(t for _, t in per)


def _modes(torch):
    return {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad,
            "grad mode, no input requires grad": contextlib.nullcontext}


def measure(label: str) -> list[dict]:
    import torch

    import cvt_cutlass
    import cvt_cutlass.ops  # noqa: F401  (defines torch.ops.cvt_cutlass.*)

    _prebuild(torch)
    print(f"[bench host] {label}: cvt_cutlass from {cvt_cutlass.__file__}", flush=True)
    rows = []
    for mode, ctx in _modes(torch).items():
        for op, what, ours, peer in _cases(torch):
            with ctx():
                lib0 = _library_totals()
                us = host_us(torch, ours)
                lib1 = _library_totals()
                peer_us = host_us(torch, peer)
            lib_us = "" if lib0 is None or lib1[0] == lib0[0] else f"{(lib1[1] - lib0[1]) / 1e3 / (lib1[0] - lib0[0]):.2f}"
            rows.append({"label": label, "version": getattr(cvt_cutlass, "__version__", "?"), "op": op, "call": what,
                         "mode": mode, "cvt_us": f"{us:.2f}", "library_us": lib_us, "torch_us": f"{peer_us:.2f}",
                         "ratio": f"{us / peer_us:.2f}", "gpu": torch.cuda.get_device_name()})
    st = cvt_cutlass.stats()
    rows_ok = not st["fallbacks"] and sum(st["kernel_calls"].values()) > 0
    print(f"[bench host] {label}: kernel calls {sum(st['kernel_calls'].values())}, fallbacks {st['fallbacks']} "
          f"({'all calls on kernels' if rows_ok else 'NOT all on kernels'})", flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| label | op | call | mode | cvt_cutlass us/call | of it in the kernel library | PyTorch us/call | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['op']} | {r['call']} | {r['mode']} | {r['cvt_us']} | "
                     f"{r.get('library_us') or '-'} | {r['torch_us']} | {r['ratio']}x |")
    return "\n".join(lines)


def bench_main(a) -> int:
    import torch

    if not torch.cuda.is_available():
        print("cvt-cutlass bench --op host needs a CUDA GPU; none is visible")
        return 2
    rows = measure(getattr(a, "label", None) or "this version")
    if a.out:
        from cvt_cutlass.csvfile import append_csv  # absolute: also when run as a script

        append_csv(a.out, rows, list(rows[0]))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--label", default="this version")
    p.add_argument("--out", default=None)
    raise SystemExit(bench_main(p.parse_args()))
