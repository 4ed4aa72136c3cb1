"""The conv training sweeps (GPU), in cutlass_profiler's Conv2d schema.

``cvt-cutlass profile --op conv2d --pass dgrad,wgrad``: for every token-embedding conv of the
model, the backward kernels its training step runs -- ``dgrad`` (dx; not for the stem, whose
image needs no gradient) and ``wgrad`` (dw and db in one launch) -- each candidate of
:func:`operators.conv2d.conv_bwd_candidates`, timed by its raw launch next to cuDNN's
``convolution_backward`` for the same gradient on channels_last tensors (the faster cuDNN layout;
the stem's peer reads its 3 real channels).

``cvt-cutlass profile --op dwconv --pass train``: the depthwise conv projection + BatchNorm with
batch statistics, forward (``bn_fwd``: conv, statistics, normalise, running-stat update) and
backward (``bn_bwd``: BN's backward with the batch-statistics terms, depthwise dgrad and wgrad),
each candidate of :func:`operators.dwconv.dwconv_bn_candidates` next to HF's sequence (cuDNN conv
+ F.batch_norm on HF's view of the tokens; its backward timed as captured forward + backward minus
the forward).

Every output is poisoned with NaN first and checked against an fp32 reference (pass = error within
2x the peer's same-dtype error + 1e-4, the max over the outputs of the pass); rows carry the pass
in ``conv_kind`` and the selection key in ``epilogue`` (``dgrad`` / ``wgrad``, ``bn_<pass>_st<s>``),
the keys :func:`selection.select_conv2d_backward` and :func:`selection.select_dwconv_bn` look up.
Resumable like every sweep: rows already in the CSV are skipped.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from pathlib import Path

from .operators.spec import DT_TAG as _DT
from .profile import (
    SWEEP_TARGET_MS,
    SWEEP_TRIALS,
    _build_all,
    _conv_row_key,
    append_conv_rows,
    best_cutlass_ms,
    conv_row,
)

CONV_PASSES = ("dgrad", "wgrad")
DW_PASSES = ("bn_fwd", "bn_bwd")
EPS, MOMENTUM = 1e-5, 0.1


def _rel(out, ref) -> float:
    from .bench.linear import rel_err

    return rel_err(out, ref.float())


def _max_rel(outs, refs) -> float:
    return max(_rel(o, r) for o, r in zip(outs, refs, strict=True))


def training_work(layers, passes, arch_list, dtypes):
    """[(arch, dtype, layer, pass)] of a sweep: each embedding conv's dgrad (C a multiple of 8)
    and wgrad, or each depthwise projection's bn_fwd and bn_bwd."""
    from .operators.conv2d import stem_channels

    out = []
    for arch in arch_list:
        for dt in dtypes:
            for lay in layers:
                for p in passes:
                    if p == "dgrad" and stem_channels(lay.c) % 8:
                        continue  # the stem's image needs no gradient (dx would be a visible fallback)
                    out.append((arch, dt, lay, p))
    return out


def candidates(arch: int, dtype: str, lay, pass_: str) -> list:
    from .operators.conv2d import conv_bwd_candidates, stem_channels
    from .operators.dwconv import dwconv_bn_candidates

    if pass_ in CONV_PASSES:
        return conv_bwd_candidates(pass_, dtype, stem_channels(lay.c), arch)
    return dwconv_bn_candidates(dtype, lay.c, lay.stride, arch, pass_.removeprefix("bn_"))


def epilogue_of(lay, pass_: str) -> str:
    return pass_ if pass_ in CONV_PASSES else f"{pass_}_st{lay.stride}"


def sweep_conv_training(a, done: set, out: Path) -> list[dict]:
    """Every (layer, pass) x candidate, rows appended to ``out`` problem by problem."""
    import torch

    from . import runtime
    from .build import cutlass_version
    from .models import conv_problems

    kind = "embed" if a.op == "conv2d" else "dwconv"
    passes = CONV_PASSES if kind == "embed" else DW_PASSES
    passes = [p for p in passes if p in a.passes or (kind == "dwconv" and "train" in a.passes)]
    dev = runtime.device_info(torch.cuda.current_device())
    base0 = {"gpu": dev.name, "date": _dt.datetime.now().strftime("%Y-%m-%d"), "cutlass_version": cutlass_version()}
    layers = [lay for b in a.batch for lay in conv_problems(a.model, b, a.image_size) if lay.kind == kind]
    work = training_work(layers, passes, a.arch, a.dtype or ["fp16", "bf16"])
    runtime.ensure_binding()
    specs = {s.name: s for arch, dt, lay, p in work for s in candidates(arch, dt, lay, p)}
    broken = _build_all(specs.values(), dev.cc, a.jobs)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []
    t0 = time.perf_counter()
    for i, (arch, dt, lay, p) in enumerate(work):
        case = (_ConvBwdCase if p in CONV_PASSES else _DwBnCase)(lay, p, _torch_dtype(dt), gen)
        base = {**base0, "kernel_path": f"sm{arch}", "peer_rel_err": f"{case.peer_err:.3e}"}
        new = _sweep_one(i, lay, p, dt, case, candidates(arch, dt, lay, p), broken, base, done, dev)
        append_conv_rows(out, new)
        rows += new
        done.update(_conv_row_key(r) for r in new)
        best = best_cutlass_ms(new)
        el = time.perf_counter() - t0
        print(f"[profile {p} {i + 1}/{len(work)} {el:.0f}s] sm{arch} {dt} b={lay.n} {lay.label}: "
              f"best cutlass {best:.4f} ms, peer {case.peer_ms:.4f} ms", flush=True)
    return rows


def _torch_dtype(dt: str):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}[dt]


def _row(i, provider, name, disposition, status, lay, dt, p, ms, spec, extra):
    return conv_row(i, provider, name, disposition, status, lay, dt, ms, spec, extra, pass_=p,
                    epilogue=epilogue_of(lay, p))


def _sweep_one(i, lay, p, dt, case, cands, broken, base, done, dev) -> list[dict]:
    from . import runtime
    from .bench.timing import time_cuda

    act, epi = f"{_DT[dt]}:nhwc", epilogue_of(lay, p)
    rows = []
    if ("pytorch", case.peer_name, lay.label, str(lay.n), str(lay.h), str(lay.w), base["kernel_path"], act,
            epi) not in done:
        rows.append(_row(i, "pytorch", case.peer_name, "passed", "success", lay, dt, p, case.peer_ms, None, base))
    for spec in cands:
        if ("cutlass", spec.name, lay.label, str(lay.n), str(lay.h), str(lay.w), base["kernel_path"], act,
                epi) in done:
            continue
        if spec.name in broken:
            rows.append(_row(i, "cutlass", spec.name, "not_supported", "error", lay, dt, p, None, spec, base))
            continue
        kid = runtime.load_kernel(spec, dev.cc)
        try:
            err = case.check(kid)
        except RuntimeError as e:
            rows.append(_row(i, "cutlass", spec.name, "not_supported", "error", lay, dt, p, None, spec,
                             {**base, "rel_err": str(e)[:80]}))
            continue
        ok = math.isfinite(err) and err <= 2 * case.peer_err + 1e-4
        t = time_cuda(lambda _, kid=kid: case.launch(kid), trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS) \
            if ok else None
        rows.append(_row(i, "cutlass", spec.name, "passed" if ok else "incorrect", "success", lay, dt, p,
                         t.median_ms if t else None, spec, {**base, "rel_err": f"{err:.3e}"}))
    return rows


class _ConvBwdCase:
    """One embedding conv's dgrad or wgrad: NHWC operands (the stem padded to 4 channels), an fp32
    reference, cuDNN's channels_last backward for the same gradient as the peer."""

    def __init__(self, lay, pass_, tdt, gen):
        import torch

        from .operators.conv2d import stem_channels
        from .ops.conv2d import conv2d_nhwc_backward_reference

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
        self.peer_name = f"cudnn:{pass_}_channels_last"
        self.peer_err = _max_rel(self._peer(), self.ref)
        from .bench.timing import time_cuda

        self.peer_ms = time_cuda(lambda _: self._peer(), trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS).median_ms

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

    def launch(self, kid: int) -> None:
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
        return _max_rel(outs, self.ref)


class _DwBnCase:
    """One depthwise projection + training BatchNorm, ``bn_fwd`` or ``bn_bwd``: tokens with the cls
    rows in front, fp32 conv weight (3, 3, C) and BN parameters, an fp32 reference, HF's sequence
    as the peer."""

    def __init__(self, lay, pass_, tdt, gen):
        import torch

        def r(*s, scale=1.0, dtype=torch.float32):
            return (scale * torch.randn(*s, device="cuda", generator=gen)).to(dtype)

        c, self.lay, self.pass_ = lay.c, lay, pass_
        self.x = r(lay.n, lay.cls + lay.h * lay.w, c, dtype=tdt)
        self.w, self.g, self.b = r(3, 3, c, scale=1 / 3), 1 + 0.1 * r(c), 0.1 * r(c)
        self.rm, self.rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
        self.dy = r(lay.n, lay.cls + lay.p * lay.q, c, dtype=tdt)
        self._reference()
        self.y = torch.empty_like(self.dy)
        self.mean, self.invstd = torch.empty(c, device="cuda"), torch.empty(c, device="cuda")
        self.dx, self.dw = torch.empty_like(self.x), torch.empty_like(self.w)
        self.dg, self.db = torch.empty_like(self.g), torch.empty_like(self.b)
        self.peer_name = f"torch:hf_{pass_}"
        self._peer_setup()

    def _reference(self):
        from .ops.dwconv import dwconv_bn_backward_reference, dwconv_bn_train_reference

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

    def _peer_setup(self):
        import torch

        from .bench.passes import _gpu_ms

        leaves = [t.clone().requires_grad_() for t in (self.x, self.w, self.g, self.b)]
        if self.pass_ == "bn_fwd":
            with torch.no_grad():
                y = self._hf(*leaves)
            self.peer_err = _rel(y, self.ref[0])
        else:
            grads = torch.autograd.grad(self._hf(*leaves), leaves, self.dy)
            self.peer_err = _max_rel(grads, self.ref)
        self.peer_ms = _gpu_ms(torch, self.pass_.removeprefix("bn_"), self._hf, leaves, self.dy) or float("nan")

    def launch(self, kid: int) -> None:
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
        return _max_rel(outs, self.ref)
