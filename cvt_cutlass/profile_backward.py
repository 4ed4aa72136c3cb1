"""The Linear backward sweep: ``cvt-cutlass profile --op linear --pass dgrad,wgrad`` (GPU).

For every Linear of the model at each batch, the backward GEMMs its training step runs:
``dgrad`` dX = dY . W (problem (m, n, k) = (rows, the layer's K, its N); fc2's dgrad carries the
``dgelu_dbias`` epilogue, GELU' at fc1's pre-activation and fc1's dbias, as the mlp op runs it) and
``wgrad`` dW = dY^T . X with db (problem (rows, N, K), epilogue ``dbias``, or ``none`` for fc1 in the MLP chain whose db its dgrad epilogue reduces). Each candidate
(operators.linear.backward_candidates: dgrad tiles / schedules, wgrad tiles x row-split waves) is
built in one parallel pool, checked against an fp32 reference (outputs poisoned with NaN first;
pass = error within 2x PyTorch's same-dtype error + 1e-4, on dX / dW and on db) and timed next to
PyTorch's ops for the same gradient, in the profiler's GEMM schema with the epilogue column
``<pass>:<epilogue>``, the key :func:`selection.select_linear_backward` looks up.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from dataclasses import dataclass
from pathlib import Path

from .operators.spec import DT_TAG as _DT
from .profile import SWEEP_TARGET_MS, SWEEP_TRIALS, _build_all, append_rows, best_cutlass_ms, gemm_row

BACKWARD_PASSES = ("dgrad", "wgrad")


@dataclass(frozen=True)
class BackwardProblem:
    label: str
    pass_: str
    m: int
    n: int  # output columns: dX's (the layer's K) or dW's rows (the layer's N)
    k: int  # reduction: the layer's N (dgrad) or K (wgrad; the rows are split)
    epilogue: str  # "none" / "dgelu_dbias" (dgrad), "dbias" / "none" (wgrad)

    @property
    def key(self) -> str:
        return f"{self.pass_}:{self.epilogue}"


def backward_problems(model: str, batches, image_size, passes) -> list[BackwardProblem]:
    from .models import linear_problems

    out: dict[tuple, BackwardProblem] = {}
    for b in batches:
        for p in linear_problems(model, b, image_size):
            probs = []
            if "dgrad" in passes:
                epi = "dgelu_dbias" if p.label.endswith(".fc2") else "none"
                probs.append(BackwardProblem(p.label, "dgrad", p.m, p.k, p.n, epi))
            if "wgrad" in passes:
                # fc1's db comes from fc2's dgrad epilogue in the mlp op: its wgrad sums no db
                epi = "none" if p.label.endswith(".fc1") else "dbias"
                probs.append(BackwardProblem(p.label, "wgrad", p.m, p.n, p.k, epi))
            for q in probs:
                if q.n % 8 == 0 and q.k % 8 == 0:  # what the kernels take; the rest falls back
                    out.setdefault((q.pass_, q.m, q.n, q.k, q.epilogue), q)
    return list(out.values())


def sweep_linear_backward(a, done: set, out: Path) -> list[dict]:
    """Every backward problem x candidate, rows appended to ``out`` problem by problem."""
    import torch

    from . import runtime
    from .build import cutlass_version
    from .operators.linear import backward_candidates

    dev = runtime.device_info(torch.cuda.current_device())
    base0 = {"gpu": dev.name, "date": _dt.datetime.now().strftime("%Y-%m-%d"), "cutlass_version": cutlass_version()}
    probs = backward_problems(a.model, a.batch, a.image_size, [p for p in a.passes if p in BACKWARD_PASSES])
    work = [(arch, dt, p) for arch in a.arch for dt in (a.dtype or ["fp16", "bf16"]) for p in probs]
    runtime.ensure_binding()
    cands = {i: backward_candidates(arch, dt, p.pass_, p.epilogue) for i, (arch, dt, p) in enumerate(work)}
    broken = _build_all({s.name: s for cs in cands.values() for s in cs}.values(), dev.cc, a.jobs)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []
    t0 = time.perf_counter()
    for i, (arch, dt, p) in enumerate(work):
        base = {**base0, "kernel_path": f"sm{arch}"}
        new = _sweep_one(i, p, dt, cands[i], broken, base, done, dev, gen)
        append_rows(out, new)
        rows += new
        best = best_cutlass_ms(new)
        el = time.perf_counter() - t0
        print(f"[profile backward {i + 1}/{len(work)} {el:.0f}s] sm{arch} {dt} {p.label} {p.key} "
              f"{p.m}x{p.n}x{p.k}: best cutlass {best:.4f} ms", flush=True)
    return rows


class _Case:
    """Random operands of one backward problem, PyTorch's ops for it and an fp32 reference."""

    def __init__(self, p: BackwardProblem, tdt, gen):
        import torch

        def r(*s, scale=1.0):
            return (scale * torch.randn(*s, device="cuda", generator=gen)).to(tdt)

        self.p = p
        self.g = r(p.m, p.k if p.pass_ == "dgrad" else p.n)
        if p.pass_ == "dgrad":
            self.w = r(p.k, p.n, scale=p.k ** -0.5)  # the layer's (N, K) weight
            self.z = r(p.m, p.n) if p.epilogue == "dgelu_dbias" else None
        else:
            self.x = r(p.m, p.k)
        self.ref = self._math(torch.float32)

    def _math(self, cdt):
        """(dX or dW, db) as autograd's ops compute them, in ``cdt``."""
        import torch

        g = self.g.to(cdt)
        if self.p.pass_ == "wgrad":
            return g.t() @ self.x.to(cdt), (g.sum(0) if self.p.epilogue == "dbias" else None)
        dx = g @ self.w.to(cdt)
        if self.z is None:
            return dx, None
        dz = torch.ops.aten.gelu_backward(dx, self.z.to(cdt))
        return dz, dz.sum(0)

    def peer(self, _=0):
        return self._math(self.g.dtype)


def _err(outs, ref) -> float:
    from .bench.linear import rel_err

    errs = [rel_err(o, r) for o, r in zip(outs, ref, strict=True) if r is not None]
    return max(errs)


def _sweep_one(idx, p, dt, cands, broken, base, done, dev, gen) -> list[dict]:
    import torch

    from . import runtime
    from .bench.timing import time_cuda

    c = _Case(p, {"fp16": torch.float16, "bf16": torch.bfloat16}[dt], gen)
    peer_err = _err(c.peer(), c.ref)
    base = {**base, "peer_rel_err": f"{peer_err:.3e}"}
    a_col = f"{_DT[dt]}:row"
    rows = []
    peer_name = f"torch:{p.pass_}"
    if ("pytorch", peer_name, str(p.m), str(p.n), str(p.k), p.key, base["kernel_path"], a_col) not in done:
        t = time_cuda(c.peer, trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS)
        rows.append(gemm_row(idx, "pytorch", peer_name, "passed", "success", p.m, p.n, p.k, dt, p.key, t.median_ms,
                             extra=base))
    for spec in cands:
        if ("cutlass", spec.name, str(p.m), str(p.n), str(p.k), p.key, base["kernel_path"], a_col) in done:
            continue
        if spec.name in broken:
            rows.append(gemm_row(idx, "cutlass", spec.name, "not_supported", "error", p.m, p.n, p.k, dt, p.key,
                                 None, spec, extra=base))
            continue
        rows.append(_time_candidate(idx, p, dt, c, spec, runtime.load_kernel(spec, dev.cc), base, peer_err,
                                    time_cuda, torch))
    return rows


def _time_candidate(idx, p, dt, c, spec, kid, base, peer_err, time_cuda, torch) -> dict:
    d = torch.empty_like(c.ref[0], dtype=c.g.dtype)
    db = torch.empty(p.n, device="cuda", dtype=c.g.dtype) if c.ref[1] is not None else None
    if p.pass_ == "dgrad":
        def run(_=0):
            torch.ops.cvt_cutlass_C.dgrad(kid, c.g, c.w, c.z, d, db)
    else:
        def run(_=0):
            torch.ops.cvt_cutlass_C.wgrad(kid, c.g, c.x, d, db)
    d.fill_(float("nan"))
    if db is not None:
        db.fill_(float("nan"))
    try:
        run()
        torch.cuda.synchronize()
    except RuntimeError as e:
        return gemm_row(idx, "cutlass", spec.name, "not_supported", "error", p.m, p.n, p.k, dt, p.key, None,
                        spec, extra={**base, "rel_err": str(e)[:80]})
    err = _err((d, db), c.ref)
    ok = math.isfinite(err) and err <= 2 * peer_err + 1e-4
    t = time_cuda(run, trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS) if ok else None
    return gemm_row(idx, "cutlass", spec.name, "passed" if ok else "incorrect", "success", p.m, p.n, p.k, dt, p.key,
                    t.median_ms if t else None, spec, extra={**base, "rel_err": f"{err:.3e}"})
