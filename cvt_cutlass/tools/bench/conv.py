"""CvT's conv steps on CUTLASS vs what the HF model runs for the same step (GPU).

For each conv of the model (token embedding and depthwise q / k,v projection of every stage),
in one process, on random inputs:

* ``hf``: the HF module sequence on the layout HF hands it. Embedding: ``nn.Conv2d`` on NCHW
  images (stage 1) or on the permuted token view HF passes between stages (channels_last memory),
  then the tokens the LayerNorm reads, made contiguous. Projection: split off the cls token,
  tokens viewed as (B, C, H, W), depthwise ``nn.Conv2d``, ``nn.BatchNorm2d`` (eval), back to
  tokens, ``torch.cat`` of the cls token.
* ``nchw``: the same math with contiguous NCHW in and out (+ the copies to and from tokens).
* ``channels_last``: the same math with channels_last tensors (token views are free).
* ``cutlass``: ``conv2d_nhwc`` on tokens (the stem: images padded to 4 channels NHWC first, timed
  as part of the step) / ``dwconv_tokens`` with BatchNorm folded and the cls row passed through.

Reported: CUDA-graph medians, ratios (peer time / CUTLASS time), the relative error of each
against an fp32 reference, the kernel and how it was chosen, and the fallback count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..compare import rel_err
from .common import markdown, run_bench

CSV_COLUMNS = (
    "date", "gpu", "torch", "cutlass", "path", "model", "image_size", "dtype", "batch", "layer", "kind",
    "n", "h", "w", "c", "k", "r", "stride", "cls", "count", "kernel", "selection",
    "hf_ms", "nchw_ms", "channels_last_ms", "cutlass_ms", "speedup_vs_hf", "speedup_vs_best_peer",
    "hf_rel_err", "cutlass_rel_err", "fallbacks",
)


@dataclass
class ConvCase:
    """One conv step: the peers, our op, an fp32 reference (tokens), and what a kernel of the
    family needs to run on its own (``launch(kid)`` writes ``out``; the sweep times that)."""

    hf: object
    nchw: object
    channels_last: object
    ours: object
    ref: object
    out: object  # tokens (B, cls + P*Q, K) that launch() writes
    launch: object


def make_conv_case(layer, dtype, gen) -> ConvCase:
    """Modules with HF's parameters, their folded / KRSC forms, inputs and the step functions."""
    return (_embed_case if layer.kind == "embed" else _dwconv_case)(layer, dtype, gen)


def _tokens(y):
    return y.flatten(2).transpose(1, 2)


def _embed_case(layer, dtype, gen) -> ConvCase:
    """A token-embedding conv: nn.Conv2d on HF's input (images, or tokens viewed as NCHW), on
    NCHW and channels_last copies, and our op on NHWC (the stem padded to 4 channels on the fly)."""
    import torch

    from ...operators.conv2d import stem_channels
    from ...ops.conv2d import conv_filter_krsc, image_to_nhwc

    b, h, w, c, k = layer.n, layer.h, layer.w, layer.c, layer.k
    conv = torch.nn.Conv2d(c, k, layer.r, layer.stride, layer.pad).to("cuda", dtype).eval()
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, device="cuda", generator=gen) / math.sqrt(c * layer.r * layer.r))
        conv.bias.copy_(0.5 * torch.randn(k, device="cuda", generator=gen))
    cp = stem_channels(c)
    wk, bias = conv_filter_krsc(conv.weight.detach(), cp), conv.bias.detach()
    if layer.label.startswith("s1."):
        x_hf = torch.randn(b, c, h, w, device="cuda", generator=gen).to(dtype)  # images, NCHW
    else:  # HF passes stage outputs as (B, HW, C) tokens viewed as NCHW
        x_hf = torch.randn(b, h * w, c, device="cuda", generator=gen).to(dtype).permute(0, 2, 1).view(b, c, h, w)
    x_nchw, x_cl = x_hf.contiguous(), x_hf.contiguous(memory_format=torch.channels_last)
    x_tok = None if cp != c else x_cl.permute(0, 2, 3, 1)  # NHWC view, packed; the stem pads on the fly (timed)

    def ours(_):
        xin = image_to_nhwc(x_hf, cp) if x_tok is None else x_tok
        return torch.ops.cvt_cutlass.conv2d_nhwc(xin, wk, bias, layer.stride, layer.pad).flatten(1, 2)

    with torch.no_grad():
        ref = _tokens(torch.nn.functional.conv2d(x_nchw.float(), conv.weight.float(), bias.float(), layer.stride,
                                                 layer.pad))
    x_k = image_to_nhwc(x_hf, cp) if x_tok is None else x_tok
    out = torch.empty(b, layer.p, layer.q, k, device="cuda", dtype=dtype)

    def launch(kid):
        torch.ops.cvt_cutlass_C.conv2d(kid, x_k, wk, bias, out, [layer.pad] * 2, [layer.stride] * 2, 0)

    return ConvCase(lambda _: _tokens(conv(x_hf)).contiguous(), lambda _: _tokens(conv(x_nchw)).contiguous(),
                    lambda _: _tokens(conv(x_cl)), ours, ref, out.flatten(1, 2), launch)


def _dwconv_modules(c: int, stride: int, pad: int, dtype, gen):
    """A depthwise conv and an eval BatchNorm with random parameters and statistics."""
    import torch

    conv = torch.nn.Conv2d(c, c, 3, stride, pad, groups=c, bias=False).to("cuda", dtype).eval()
    bn = torch.nn.BatchNorm2d(c).to("cuda", dtype).eval()
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, device="cuda", generator=gen) / 3)
        bn.running_mean.copy_(0.1 * torch.randn(c, device="cuda", generator=gen))
        bn.running_var.copy_(torch.rand(c, device="cuda", generator=gen) + 0.5)
        bn.weight.copy_(1 + 0.1 * torch.randn(c, device="cuda", generator=gen))
        bn.bias.copy_(0.1 * torch.randn(c, device="cuda", generator=gen))
    return conv, bn


def _dwconv_case(layer, dtype, gen) -> ConvCase:
    """A depthwise conv projection + BatchNorm with the cls rows in front: HF's split / permute /
    conv / BN / cat, on NCHW and channels_last copies, and our op with BatchNorm folded."""
    import torch
    import torch.nn.functional as F

    from ...ops.dwconv import fold_batchnorm

    b, h, w, c, cls = layer.n, layer.h, layer.w, layer.c, layer.cls
    conv, bn = _dwconv_modules(c, layer.stride, layer.pad, dtype, gen)
    wf, bf = fold_batchnorm(conv.weight.detach(), bn.running_mean, bn.running_var, bn.weight.detach(),
                            bn.bias.detach(), bn.eps)
    x = torch.randn(b, cls + h * w, c, device="cuda", generator=gen).to(dtype)

    def finish(y, cls_tok):
        return torch.cat((cls_tok, _tokens(y)), 1) if cls else _tokens(y)

    def hf(_):
        cls_tok, t = torch.split(x, [cls, h * w], 1) if cls else (None, x)
        return finish(bn(conv(t.permute(0, 2, 1).view(b, c, h, w))), cls_tok)

    def image(fmt):
        return x[:, cls:].permute(0, 2, 1).reshape(b, c, h, w).contiguous(memory_format=fmt)

    with torch.no_grad():
        z = F.conv2d(image(torch.contiguous_format).float(), conv.weight.float(), None, layer.stride, layer.pad, groups=c)
        ref = finish(F.batch_norm(z, bn.running_mean.float(), bn.running_var.float(), bn.weight.float(),
                                  bn.bias.float(), False, 0.0, bn.eps), x[:, :cls].float())
    out = torch.empty(b, cls + layer.p * layer.q, c, device="cuda", dtype=dtype)
    xi, yi = x[:, cls:].unflatten(1, (h, w)), out[:, cls:].unflatten(1, (layer.p, layer.q))

    def launch(kid):
        torch.ops.cvt_cutlass_C.conv2d(kid, xi, wf, bf, yi, [layer.pad] * 2, [layer.stride] * 2, cls)

    return ConvCase(hf, lambda _: finish(bn(conv(image(torch.contiguous_format))), x[:, :cls]).contiguous(),
                    lambda _: finish(bn(conv(image(torch.channels_last))), x[:, :cls]),
                    lambda _: torch.ops.cvt_cutlass.dwconv_tokens(x, wf, bf, h, w, layer.stride, cls), ref, out, launch)


def bench_main(a) -> int:
    """``bench --op conv``: every conv of the model (embeddings, depthwise projections) against HF's
    sequence and cuDNN in NCHW and channels_last."""
    from ...operators.conv2d import conv_problems

    return run_bench(a, lambda run, dt, batch: conv_problems(a.model, batch, a.image_size), _measure, CSV_COLUMNS,
                     markdown_table)


def _measure(run, dt_name: str, batch: int, layer) -> list[dict]:
    import torch

    from ... import fallback
    from ..timing import time_cuda

    cc = make_conv_case(layer, run.torch_dtype[dt_name], run.gen)
    fallback.reset()
    with torch.no_grad():
        e_ours, e_hf = rel_err(cc.ours(0), cc.ref), rel_err(cc.hf(0), cc.ref)
        t = {name: time_cuda(fn).median_ms for name, fn in
             (("hf", cc.hf), ("nchw", cc.nchw), ("channels_last", cc.channels_last), ("cutlass", cc.ours))}
    sel = ",".join(f"{k.split(':')[1]}" for k in fallback.stats()["selections"]) or "-"
    best_peer = min(t["hf"], t["nchw"], t["channels_last"])
    row = {
        **run.row, "dtype": dt_name,
        "batch": batch, "layer": layer.label, "kind": layer.kind, "n": layer.n, "h": layer.h,
        "w": layer.w, "c": layer.c, "k": layer.k, "r": layer.r, "stride": layer.stride,
        "cls": layer.cls, "count": layer.count, "kernel": _kernel_name(layer, dt_name, run.arch, run.dev),
        "selection": sel, "hf_ms": f"{t['hf']:.5f}", "nchw_ms": f"{t['nchw']:.5f}",
        "channels_last_ms": f"{t['channels_last']:.5f}", "cutlass_ms": f"{t['cutlass']:.5f}",
        "speedup_vs_hf": f"{t['hf'] / t['cutlass']:.3f}",
        "speedup_vs_best_peer": f"{best_peer / t['cutlass']:.3f}",
        "hf_rel_err": f"{e_hf:.2e}", "cutlass_rel_err": f"{e_ours:.2e}",
        "fallbacks": fallback.total_fallbacks(),
    }
    print(_fmt(row), flush=True)
    return [row]


def _kernel_name(layer, dt_name, arch, dev) -> str:
    from ...operators.conv2d import conv_window, select_conv2d, stem_channels
    from ...operators.dwconv import select_dwconv

    if layer.kind == "embed":
        c = stem_channels(layer.c)
        window = conv_window(c, layer.k, layer.r, layer.r, layer.w, layer.stride, layer.pad)
        return select_conv2d(layer.n * layer.p * layer.q, layer.k, layer.r * layer.r * c, c, dt_name, arch,
                             dev.name, window).spec.name
    return select_dwconv(layer.n * layer.p * layer.q, layer.c, layer.stride, dt_name, arch, dev.name).spec.name


def _fmt(r: dict) -> str:
    return (f"{r['dtype']} b={r['batch']:<4} {r['layer']:<9} hf {float(r['hf_ms']):.4f} nchw {float(r['nchw_ms']):.4f} "
            f"cl {float(r['channels_last_ms']):.4f} cutlass {float(r['cutlass_ms']):.4f} ms  "
            f"x{r['speedup_vs_hf']} vs HF, x{r['speedup_vs_best_peer']} vs best  [{r['selection']}] {r['kernel']}")


def markdown_table(rows: list[dict]) -> str:
    head = ["dtype", "batch", "step", "input (N,H,W,C) -> K", "HF ms", "NCHW ms", "channels_last ms", "CUTLASS ms",
            "vs HF", "vs best peer", "rel. err HF / CUTLASS", "fallbacks"]
    return "\n".join(markdown(head, ([
        r["dtype"], r["batch"], r["layer"], f"{r['n']},{r['h']},{r['w']},{r['c']} -> {r['k']}",
        *(f"{float(r[c]):.4f}" for c in ("hf_ms", "nchw_ms", "channels_last_ms", "cutlass_ms")),
        f"{r['speedup_vs_hf']}x", f"{r['speedup_vs_best_peer']}x", f"{r['hf_rel_err']} / {r['cutlass_rel_err']}",
        r["fallbacks"]] for r in rows)))
