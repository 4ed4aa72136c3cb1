"""The conv sweeps (GPU), in cutlass_profiler's Conv2d schema: ``cvt-cutlass profile --op conv2d``
(the token embeddings) and ``--op dwconv`` (the depthwise conv projections).

* ``--pass fwd``: every candidate of the family on every conv of that kind in the model
  (:func:`cvt_cutlass.operators.conv2d.conv_candidates`, :func:`~cvt_cutlass.operators.dwconv.dwconv_candidates`),
  against the module sequence HF runs, in the same process.
* ``--op conv2d --pass dgrad,wgrad``: the backward kernels of each embedding conv's training step
  (dgrad: not for the stem, whose image needs no gradient; wgrad: dw and db in one launch), each
  candidate of :func:`~cvt_cutlass.operators.conv2d.conv_bwd_candidates` next to cuDNN's
  ``convolution_backward`` for the same gradient on channels_last tensors (the faster cuDNN layout;
  the stem's peer reads its 3 real channels).
* ``--op dwconv --pass train``: the depthwise projection + BatchNorm with batch statistics, forward
  (``bn_fwd``: conv, statistics, normalise, running-stat update) and backward (``bn_bwd``), each
  candidate of :func:`~cvt_cutlass.operators.dwconv.dwconv_bn_candidates` next to HF's sequence
  (cuDNN conv + F.batch_norm on HF's view of the tokens; its backward timed as captured forward +
  backward minus the forward).

Rows carry the pass in ``conv_kind`` and the selection key in ``epilogue`` (``bias``, ``dgrad`` /
``wgrad``, ``bn_<pass>_st<s>``), the keys the family's select functions look up.
"""

from __future__ import annotations

from pathlib import Path

from ...operators.spec import DT_FROM_TAG
from ...operators.spec import DT_TAG as _DT
from ..compare import max_rel_err, rel_err
from .driver import SWEEP_TARGET_MS, SWEEP_TRIALS, Item, finish_row, read_rows, run_sweep, sweep_items

CONV_COLUMNS = (
    "Problem", "Provider", "OperationKind", "Operation", "Disposition", "Status",
    "conv_kind", "n", "h", "w", "c", "k", "r", "s", "p", "q", "g", "pad_h", "pad_w", "stride_h", "stride_w",
    "dilation_h", "dilation_w", "Activation", "Filter", "Output", "conv_mode", "iterator_algorithm",
    "alpha", "beta", "split_k_mode", "split_k_slices", "op_class", "accum", "cta_m", "cta_n", "cta_k",
    "cluster_m", "cluster_n", "cluster_k", "stages", "warps_m", "warps_n", "warps_k", "inst_m", "inst_n", "inst_k",
    "min_cc", "max_cc", "Bytes", "Flops", "Flops/Byte", "Runtime", "GB/s", "GFLOPs",
    # ours, after the profiler's columns
    "epilogue", "kernel_path", "gpu", "date", "cutlass_version", "rel_err", "peer_rel_err", "cls_rows", "layer",
)
CONV_KINDS = {"fwd": "fprop", "dgrad": "dgrad", "wgrad": "wgrad", "bn_fwd": "fprop", "bn_bwd": "dgrad_wgrad"}
CONV_PASSES = ("dgrad", "wgrad")
DW_PASSES = ("bn_fwd", "bn_bwd")
EPS, MOMENTUM = 1e-5, 0.1


def conv_row(problem_idx: int, provider: str, operation: str, disposition: str, status: str, layer, dtype: str,
             runtime_ms: float | None, spec=None, extra: dict | None = None, pass_: str = "fwd",
             epilogue: str = "bias") -> dict:
    """One row in the profiler's Conv2d schema (NHWC activations, KRSC filters; depthwise: g = C).
    ``pass_``: fwd, the backward GEMMs dgrad / wgrad of an embedding conv, or the depthwise
    projection's training kernels bn_fwd / bn_bwd (conv_kind fprop / dgrad_wgrad); ``epilogue``:
    the selection-table key (bias, dgrad, wgrad, bn_<fwd|bwd>_st<s>)."""
    from ...operators.conv2d import stem_channels

    dw = layer.kind == "dwconv"
    c = layer.c if dw else stem_channels(layer.c)
    out_px = layer.n * layer.p * layer.q
    x_el, y_el = layer.n * layer.h * layer.w * c, out_px * layer.k
    nbytes = 2 * (x_el + y_el + (x_el if pass_ == "bn_bwd" else 0)) + (
        4 * (layer.r * layer.r * c + c) if dw else 2 * (layer.k * layer.r * layer.r * c + layer.k))
    flops = 2 * out_px * layer.k * layer.r * layer.r * (1 if dw else c) * (2 if pass_ == "bn_bwd" else 1)
    dt = _DT[dtype]
    row = {
        "Problem": problem_idx, "Provider": provider, "OperationKind": "conv2d", "Operation": operation,
        "Disposition": disposition, "Status": status, "conv_kind": CONV_KINDS[pass_], "n": layer.n, "h": layer.h,
        "w": layer.w, "c": c, "k": layer.k, "r": layer.r, "s": layer.r, "p": layer.p, "q": layer.q,
        "g": c if dw else 1, "pad_h": layer.pad, "pad_w": layer.pad, "stride_h": layer.stride,
        "stride_w": layer.stride, "dilation_h": 1, "dilation_w": 1, "Activation": f"{dt}:nhwc",
        "Filter": "f32:rsc" if dw else f"{dt}:nhwc", "Output": f"{dt}:nhwc", "conv_mode": "cross",
        "alpha": 1, "beta": 1, "split_k_mode": "serial", "split_k_slices": 1, "Bytes": nbytes, "Flops": flops,
        "Flops/Byte": f"{flops / nbytes:.2f}", "epilogue": epilogue, "cls_rows": layer.cls, "layer": layer.label,
    }
    return finish_row(row, _kernel_columns(spec, dw) if spec is not None else None, runtime_ms, extra)


def _kernel_columns(spec, depthwise: bool) -> dict:
    """The profiler's kernel description columns of a conv or depthwise spec."""
    if depthwise:
        return dict(op_class="simt", accum="f32", iterator_algorithm="direct", cta_m=spec.threads * spec.pix,
                    cta_n=8, cta_k=1, min_cc=spec.min_cc, max_cc=1024)
    tm, tn, tk = spec.tile
    row = dict(op_class="tensorop", accum="f32", iterator_algorithm=spec.iterator, cta_m=tm, cta_n=tn, cta_k=tk)
    if spec.arch == 90:  # CUTLASS 3.x SM90 (wgmma)
        return {**row, "cluster_m": spec.cluster[0], "cluster_n": spec.cluster[1], "cluster_k": spec.cluster[2],
                "stages": spec.stages or "auto", "inst_m": 64, "inst_n": tn, "inst_k": 16, "min_cc": 90, "max_cc": 90}
    return {**row, "cluster_m": 1, "cluster_n": 1, "cluster_k": 1, "stages": spec.stages, "warps_m": spec.warps[0],
            "warps_n": spec.warps[1], "warps_k": spec.warps[2], "inst_m": 16, "inst_n": 8, "inst_k": 16,
            "min_cc": spec.min_cc, "max_cc": 1024}


def row_key(r: dict) -> tuple:
    """The resume key of a Conv2d row (written, or read back as strings)."""
    return (r["Provider"], r["Operation"], r["layer"], str(r["n"]), str(r["h"]), str(r["w"]), r["kernel_path"],
            r["Activation"], r.get("epilogue") or "bias")


def append_conv_rows(path: Path, rows: list[dict]) -> None:
    from ..csvfile import append_csv

    append_csv(path, rows, CONV_COLUMNS, ignore_extra=True)


def conv_table_key(row: dict) -> tuple[str, str, int, int, int]:
    """(op, epilogue, m, n, k) under which a conv row goes into its selection table; the key
    select_conv2d / select_dwconv / their backward and training variants look up."""
    from ...operators.conv2d.select import table_key as conv_key
    from ...operators.dwconv.select import table_key as dw_key

    m = int(row["n"]) * int(row["p"]) * int(row["q"])
    epi = row.get("epilogue") or "bias"
    if str(row["g"]) != "1":  # bias (inference) or bn_<pass>_st<stride> (training)
        pass_ = None if epi == "bias" else epi.removeprefix("bn_").split("_st")[0]
        return "dwconv", *dw_key(m, int(row["c"]), int(row["stride_h"]), pass_)
    return "conv2d", *conv_key(m, int(row["k"]), int(row["r"]) * int(row["s"]) * int(row["c"]),
                               "fwd" if epi == "bias" else epi)


def table_key(row: dict) -> tuple:
    """(op, arch, dtype, epilogue, m, n, k) of a Conv2d-schema row."""
    op, epi, m, n, k = conv_table_key(row)
    return (op, row["kernel_path"].removeprefix("sm"), DT_FROM_TAG[row["Activation"].split(":")[0]], epi, m, n, k)


def epilogue_of(lay, pass_: str) -> str:
    """The epilogue column of a conv pass's rows: bias (forward), dgrad / wgrad, bn_<pass>_st<stride>
    (the key the dwconv family files its conv + BatchNorm kernels under)."""
    if pass_ == "fwd":
        return "bias"
    return pass_ if pass_ in CONV_PASSES else f"{pass_}_st{lay.stride}"


class ConvFamily:
    """The conv problems' schema and cases (tools/sweep/driver.py's Family)."""

    columns = CONV_COLUMNS
    floor = 1e-4

    def case(self, item: Item, gen):
        if item.pass_ == "fwd":
            return ForwardCase(item, gen)
        return (ConvBwdCase if item.pass_ in CONV_PASSES else DwBnCase)(item, gen)

    def row(self, i, item, provider, operation, disposition, status, ms, spec, extra) -> dict:
        lay = item.problem
        return conv_row(i, provider, operation, disposition, status, lay, item.dtype, ms, spec, extra,
                        pass_=item.pass_, epilogue=epilogue_of(lay, item.pass_))

    def key(self, row: dict) -> tuple:
        return row_key(row)

    def describe(self, item: Item) -> str:
        lay = item.problem
        return f"sm{item.arch} {item.dtype} b={lay.n} {lay.label} {item.pass_}"


def _torch_dtype(dt: str):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}[dt]


class ForwardCase:
    """One forward conv: :func:`tools.bench.conv.make_conv_case` (HF's modules and our launch)."""

    sets = 1

    def __init__(self, item: Item, gen):
        from ..bench.conv import make_conv_case

        self.c = make_conv_case(item.problem, _torch_dtype(item.dtype), gen)

    def peers(self) -> dict[str, float]:
        import torch

        with torch.no_grad():
            return {"torch:hf_sequence": rel_err(self.c.hf(0), self.c.ref)}

    def peer_ms(self, name: str) -> float:
        import torch

        from ..timing import time_cuda

        with torch.no_grad():
            return time_cuda(self.c.hf, trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS).median_ms

    def launch(self, kid: int, i: int = 0) -> None:
        self.c.launch(kid)

    def check(self, kid: int) -> float:
        import torch

        self.c.out.fill_(float("nan"))
        self.c.launch(kid)
        torch.cuda.synchronize()
        return rel_err(self.c.out, self.c.ref)


class ConvBwdCase:
    """One embedding conv's dgrad or wgrad: NHWC operands (the stem padded to 4 channels), an fp32
    reference, cuDNN's channels_last backward for the same gradient as the peer."""

    sets = 1

    def __init__(self, item: Item, gen):
        import torch

        from ...operators.conv2d import stem_channels
        from ...ops.conv2d import conv2d_nhwc_backward_reference

        lay, pass_, tdt = item.problem, item.pass_, _torch_dtype(item.dtype)
        c = stem_channels(lay.c)
        self.lay, self.pass_ = lay, pass_
        self.x = torch.randn(lay.n, lay.h, lay.w, c, device="cuda", generator=gen).to(tdt)
        self.w = (torch.randn(lay.k, lay.r, lay.r, c, device="cuda", generator=gen) * (lay.r * lay.r * c) ** -0.5).to(tdt)
        self.dy = torch.randn(lay.n, lay.p, lay.q, lay.k, device="cuda", generator=gen).to(tdt)
        need = (pass_ == "dgrad", pass_ == "wgrad", pass_ == "wgrad")
        ref = conv2d_nhwc_backward_reference(self.dy.float(), self.x.float(), self.w.float(), lay.stride, lay.pad,
                                             *need)
        self.ref = [r for r, n in zip(ref, need, strict=True) if n]
        self.dx = torch.empty_like(self.x) if pass_ == "dgrad" else None
        self.dw = torch.empty_like(self.w) if pass_ == "wgrad" else None
        self.db = torch.empty(lay.k, device="cuda", dtype=tdt) if pass_ == "wgrad" else None

    def peers(self) -> dict[str, float]:
        return {f"cudnn:{self.pass_}_channels_last": max_rel_err(self._peer(), self.ref)}

    def peer_ms(self, name: str) -> float:
        from ..timing import time_cuda

        return time_cuda(lambda _: self._peer(), trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS).median_ms

    def _peer(self):
        """cuDNN's gradient of this pass (channels_last; the stem's 3 real channels), as NHWC."""
        import torch

        lay, c = self.lay, self.lay.c
        cl = torch.channels_last
        x = self.x[..., :c].permute(0, 3, 1, 2).contiguous(memory_format=cl)
        w = self.w[..., :c].permute(0, 3, 1, 2).contiguous(memory_format=cl)
        dy = self.dy.permute(0, 3, 1, 2)  # an NHWC tensor is channels_last already
        mask = [self.pass_ == "dgrad", self.pass_ == "wgrad", self.pass_ == "wgrad"]
        dx, dw, db = torch.ops.aten.convolution_backward(dy, x, w, [lay.k], [lay.stride] * 2, [lay.pad] * 2, [1, 1],
                                                         False, [0, 0], 1, mask)
        if self.pass_ == "dgrad":
            return [dx.permute(0, 2, 3, 1)]
        dw = dw.permute(0, 2, 3, 1)
        if dw.shape[-1] != self.w.shape[-1]:  # the stem: the peer has no padding channel; take the reference's
            dw = torch.cat([dw, self.ref[0][..., c:].to(dw.dtype)], -1)
        return [dw, db]

    def launch(self, kid: int, i: int = 0) -> None:
        import torch

        torch.ops.cvt_cutlass_C.conv2d_bwd(kid, self.dy, self.x, self.w, self.dx, self.dw, self.db, self.lay.pad,
                                           self.lay.stride)

    def check(self, kid: int) -> float:
        import torch

        outs = [t for t in (self.dx, self.dw, self.db) if t is not None]
        for t in outs:
            t.fill_(float("nan"))
        self.launch(kid)
        torch.cuda.synchronize()
        return max_rel_err(outs, self.ref)


class DwBnCase:
    """One depthwise projection + training BatchNorm, ``bn_fwd`` or ``bn_bwd``: tokens with the cls
    rows in front, fp32 conv weight (3, 3, C) and BN parameters, an fp32 reference, HF's sequence
    as the peer."""

    sets = 1

    def __init__(self, item: Item, gen):
        import torch

        def r(*s, scale=1.0, dtype=torch.float32):
            return (scale * torch.randn(*s, device="cuda", generator=gen)).to(dtype)

        lay, self.pass_ = item.problem, item.pass_
        c, self.lay = lay.c, lay
        self.x = r(lay.n, lay.cls + lay.h * lay.w, c, dtype=_torch_dtype(item.dtype))
        self.w, self.g, self.b = r(3, 3, c, scale=1 / 3), 1 + 0.1 * r(c), 0.1 * r(c)
        self.rm, self.rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
        self.dy = r(lay.n, lay.cls + lay.p * lay.q, c, dtype=self.x.dtype)
        self._reference()
        self.y = torch.empty_like(self.dy)
        self.mean, self.invstd = torch.empty(c, device="cuda"), torch.empty(c, device="cuda")
        self.dx, self.dw = torch.empty_like(self.x), torch.empty_like(self.w)
        self.dg, self.db = torch.empty_like(self.g), torch.empty_like(self.b)

    def _reference(self):
        from ...ops.dwconv import dwconv_bn_backward_reference, dwconv_bn_train_reference

        lay, xf = self.lay, self.x.float()
        y, self.ref_mean, self.ref_invstd = dwconv_bn_train_reference(xf, self.w, self.g, self.b, None, None, 0.0,
                                                                      EPS, lay.h, lay.w, lay.stride, lay.cls)
        if self.pass_ == "bn_fwd":
            self.ref = [y, self.ref_mean, self.ref_invstd]
        else:
            self.ref = list(dwconv_bn_backward_reference(self.dy.float(), xf, self.w, self.g, self.ref_mean,
                                                         self.ref_invstd, lay.h, lay.w, lay.stride, lay.cls))

    def _hf(self, x, w, g, b):
        """HF's CvtSelfAttentionConvProjection in training mode, on HF's view of the tokens."""
        import torch
        import torch.nn.functional as F

        lay, n = self.lay, x.shape[0]
        img = x[:, lay.cls:].transpose(1, 2).reshape(n, lay.c, lay.h, lay.w)
        z = F.conv2d(img, w.permute(2, 0, 1).unsqueeze(1).to(x.dtype), None, lay.stride, 1, groups=lay.c)
        y = F.batch_norm(z, self.rm.clone(), self.rv.clone(), g, b, True, MOMENTUM, EPS).flatten(2).transpose(1, 2)
        return torch.cat([x[:, :lay.cls], y], 1) if lay.cls else y

    def _leaves(self):
        return [t.clone().requires_grad_() for t in (self.x, self.w, self.g, self.b)]

    def peers(self) -> dict[str, float]:
        import torch

        leaves = self._leaves()
        if self.pass_ == "bn_fwd":
            with torch.no_grad():
                return {f"torch:hf_{self.pass_}": rel_err(self._hf(*leaves), self.ref[0])}
        grads = torch.autograd.grad(self._hf(*leaves), leaves, self.dy)
        return {f"torch:hf_{self.pass_}": max_rel_err(grads, self.ref)}

    def peer_ms(self, name: str) -> float:
        import torch

        from ..timing import pass_gpu_ms

        return pass_gpu_ms(torch, self.pass_.removeprefix("bn_"), self._hf, self._leaves(), self.dy) or float("nan")

    def launch(self, kid: int, i: int = 0) -> None:
        import torch

        lay, raw = self.lay, torch.ops.cvt_cutlass_C
        if self.pass_ == "bn_fwd":
            raw.dwconv_bn(kid, self.x, self.w, self.g, self.b, self.rm, self.rv, self.y, self.mean, self.invstd,
                          MOMENTUM, EPS, lay.h, lay.w, lay.stride, lay.cls)
        else:
            raw.dwconv_bn_bwd(kid, self.dy, self.x, self.w, self.g, self.ref_mean, self.ref_invstd, self.dx, self.dw,
                              self.dg, self.db, lay.h, lay.w, lay.stride, lay.cls)

    def check(self, kid: int) -> float:
        import torch

        outs = [self.y, self.mean, self.invstd] if self.pass_ == "bn_fwd" else [self.dx, self.dw, self.dg, self.db]
        for t in outs:
            t.fill_(float("nan"))
        self.launch(kid)
        torch.cuda.synchronize()
        return max_rel_err(outs, self.ref)


def candidates_of(arch: int, dtype: str, lay, pass_: str):
    """The candidate kernels of one (layer, pass), or None where the step runs no such kernel (the
    stem's dgrad: its image needs no gradient)."""
    from ...operators.conv2d import conv_bwd_candidates, conv_candidates, conv_window, stem_channels
    from ...operators.dwconv import dwconv_bn_candidates, dwconv_candidates

    if pass_ == "fwd":
        if lay.kind == "embed":
            c = stem_channels(lay.c)
            return conv_candidates(dtype, c, arch, conv_window(c, lay.k, lay.r, lay.r, lay.w, lay.stride, lay.pad))
        return dwconv_candidates(dtype, lay.stride, arch)
    if pass_ in CONV_PASSES:
        c = stem_channels(lay.c)
        return None if pass_ == "dgrad" and c % 8 else conv_bwd_candidates(
            pass_, dtype, c, arch, conv_window(c, lay.k, lay.r, lay.r, lay.w, lay.stride, lay.pad))
    return dwconv_bn_candidates(dtype, lay.c, lay.stride, arch, pass_.removeprefix("bn_"))


def sweep_passes(op: str, passes) -> list[str]:
    """The passes of a ``profile --op conv2d|dwconv --pass ...`` run ("train" = both dwconv passes)."""
    if op == "conv2d":
        return [p for p in ("fwd", *CONV_PASSES) if p in passes]
    return [p for p in ("fwd", *DW_PASSES) if p in passes or (p != "fwd" and "train" in passes)]


def sweep(a, out: Path) -> list[dict]:
    """``profile --op conv2d|dwconv``: every (layer, pass) x candidate of the requested passes."""
    from ...operators.conv2d import conv_problems

    kind = "embed" if a.op == "conv2d" else "dwconv"
    layers = [lay for b in a.batch for lay in conv_problems(a.model, b, a.image_size) if lay.kind == kind]
    passes = sweep_passes(a.op, getattr(a, "passes", None) or ["fwd"])
    items = sweep_items(a.arch, a.dtype or ["fp16", "bf16"], layers, candidates_of, passes)
    prior = read_rows(out)
    return prior + run_sweep(ConvFamily(), items, out, {row_key(r) for r in prior}, jobs=a.jobs)
