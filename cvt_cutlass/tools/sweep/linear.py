"""The Linear sweeps (GPU), in cutlass_profiler's GEMM schema: ``cvt-cutlass profile --op linear``.

Forward (``--pass fwd``): every Linear of the model at each batch
(:func:`cvt_cutlass.operators.linear.problems.linear_problems`) x the candidate space of its
epilogue (:func:`cvt_cutlass.operators.linear.candidates`), against PyTorch's unfused sequence
(``F.linear`` then ``F.gelu`` / ``+ r``). Stage 2 (unless ``--no-refine``) times the raster-order
and swizzle variants of each problem's winner (:func:`cvt_cutlass.operators.linear.refinements`).

Backward (``--pass dgrad,wgrad``): the backward GEMMs of a training step
(:func:`cvt_cutlass.operators.linear.problems.backward_problems`) x
:func:`cvt_cutlass.operators.linear.backward_candidates`, against PyTorch's ops for the same
gradient; the epilogue column is ``<pass>:<epilogue>``, the key select_linear_backward looks up.
"""

from __future__ import annotations

from pathlib import Path

from ...operators.spec import DT_FROM_TAG
from ...operators.spec import DT_TAG as _DT
from ..compare import max_rel_err, rel_err
from .driver import SWEEP_TARGET_MS, SWEEP_TRIALS, Item, finish_row, read_rows, run_sweep, sweep_items

GEMM_COLUMNS = (
    "Problem", "Provider", "OperationKind", "Operation", "Disposition", "Status",
    "gemm_kind", "m", "n", "k", "A", "B", "C", "D", "alpha", "beta", "split_k_mode", "split_k_slices",
    "batch_count", "raster_order", "swizzle_size", "op_class", "accum", "cta_m", "cta_n", "cta_k",
    "cluster_m", "cluster_n", "cluster_k", "stages", "warps_m", "warps_n", "warps_k",
    "inst_m", "inst_n", "inst_k", "min_cc", "max_cc",
    "Bytes", "Flops", "Flops/Byte", "Runtime", "GB/s", "GFLOPs",
    # ours, after the profiler's columns
    "epilogue", "kernel_path", "gpu", "date", "cutlass_version", "rel_err", "peer_rel_err",
)


def gemm_row(problem_idx: int, provider: str, operation: str, disposition: str, status: str,
             m: int, n: int, k: int, dtype: str, epilogue: str, runtime_ms: float | None,
             spec=None, extra: dict | None = None) -> dict:
    """One row in the profiler's GEMM schema (A row-major, B column-major: our x and nn.Linear W)."""
    e = 2
    nbytes = e * (m * k + n * k + m * n) + (e * m * n if "residual" in epilogue else 0) \
        + (e * n if "bias" in epilogue else 0) + (e * m * n if epilogue.endswith("aux") or "dgelu" in epilogue else 0)
    flops = 2 * m * n * k
    dt = _DT[dtype]
    row = {
        "Problem": problem_idx, "Provider": provider, "OperationKind": "gemm", "Operation": operation,
        "Disposition": disposition, "Status": status, "gemm_kind": "universal", "m": m, "n": n, "k": k,
        "A": f"{dt}:row", "B": f"{dt}:column", "C": f"{dt}:row", "D": f"{dt}:row",
        "alpha": 1, "beta": 1 if "residual" in epilogue else 0, "split_k_mode": "serial",
        "split_k_slices": 1, "batch_count": 1, "Bytes": nbytes, "Flops": flops,
        "Flops/Byte": f"{flops / nbytes:.2f}", "epilogue": epilogue,
    }
    return finish_row(row, _kernel_columns(spec) if spec is not None else None, runtime_ms, extra)


def _kernel_columns(spec) -> dict:
    """The profiler's kernel description columns of a Linear spec."""
    tm, tn, tk = spec.tile
    row = dict(op_class="tensorop", accum="f32", cta_m=tm, cta_n=tn, cta_k=tk, cluster_m=spec.cluster[0],
               cluster_n=spec.cluster[1], cluster_k=spec.cluster[2], stages=spec.stages or "auto",
               min_cc=spec.min_cc, max_cc=1024, swizzle_size=spec.swizzle)
    if spec.arch == 90:
        row.update(raster_order={"h": "heuristic", "m": "along_m", "n": "along_n"}[spec.raster],
                   inst_m=64, inst_n=tn, inst_k=16)
    else:
        row.update(warps_m=spec.warps[0], warps_n=spec.warps[1], warps_k=spec.warps[2], inst_m=16, inst_n=8,
                   inst_k=16)
    return row


def row_key(r: dict) -> tuple:
    """The resume key of a GEMM row (written, or read back as strings)."""
    return (r["Provider"], r["Operation"], str(r["m"]), str(r["n"]), str(r["k"]), r["epilogue"],
            r["kernel_path"], r["A"])


def append_rows(path: Path, rows: list[dict]) -> None:
    from ..csvfile import append_csv

    append_csv(path, rows, GEMM_COLUMNS, ignore_extra=True)


def table_key(row: dict) -> tuple[str, str, str, str, int, int, int]:
    """(op, arch, dtype, epilogue, m, n, k) of a GEMM-schema row: the key select_linear looks up."""
    return ("linear", row["kernel_path"].removeprefix("sm"), DT_FROM_TAG[row["A"].split(":")[0]], row["epilogue"],
            int(row["m"]), int(row["n"]), int(row["k"]))


def best_per_problem(rows: list[dict]) -> dict[tuple, tuple[dict, dict | None]]:
    """{(path, dtype, epilogue, m, n, k): (fastest passing cutlass row, pytorch row)}."""
    best: dict[tuple, dict] = {}
    peer: dict[tuple, dict] = {}
    for r in rows:
        key = (r["kernel_path"], r["A"].split(":")[0], r["epilogue"], int(r["m"]), int(r["n"]), int(r["k"]))
        if r["Provider"] == "pytorch":
            peer[key] = r
        elif r["Provider"] == "cutlass" and r["Disposition"] == "passed" and r.get("Runtime"):
            if key not in best or float(r["Runtime"]) < float(best[key]["Runtime"]):
                best[key] = r
    return {k: (v, peer.get(k)) for k, v in best.items()}


class GemmFamily:
    """The Linear problems' schema and cases (tools/sweep/driver.py's Family)."""

    columns = GEMM_COLUMNS
    floor = 1e-4

    def case(self, item: Item, gen):
        return ForwardCase(item, gen) if item.pass_ == "fwd" else BackwardCase(item, gen)

    def row(self, i, item, provider, operation, disposition, status, ms, spec, extra) -> dict:
        p = item.problem
        epi = p.epilogue if item.pass_ == "fwd" else p.key
        return gemm_row(i, provider, operation, disposition, status, p.m, p.n, p.k, item.dtype, epi, ms, spec, extra)

    def key(self, row: dict) -> tuple:
        return row_key(row)

    def describe(self, item: Item) -> str:
        p = item.problem
        what = p.epilogue if item.pass_ == "fwd" else p.key
        return f"sm{item.arch} {item.dtype} {p.label} {p.m}x{p.n}x{p.k} {what}"


def _torch_dtype(dt: str):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}[dt]


class ForwardCase:
    """One forward problem: :func:`tools.bench.linear.make_case`'s inputs (rotated input sets),
    PyTorch's unfused sequence as the peer, the raw GEMM launch of a kernel."""

    def __init__(self, item: Item, gen):
        import torch

        from ..bench.linear import make_case

        p = item.problem
        self.c = make_case(p.m, p.n, p.k, p.epilogue, _torch_dtype(item.dtype), gen)
        self.sets = self.c.sets
        self.outs = [torch.empty(p.m, p.n, device="cuda", dtype=self.c.w.dtype) for _ in range(self.sets)]
        # a training forward fc1's second output: bias_gelu_aux's pre-activation, bias_gelu_dgelu's
        # GELU derivative (fp16)
        adt = torch.float16 if p.epilogue == "bias_gelu_dgelu" else self.c.w.dtype
        self.aux = None if self.c.ref_aux is None else [torch.empty_like(o, dtype=adt) for o in self.outs]
        self.peer_name = f"torch:{p.unfused}"

    def peers(self) -> dict[str, float]:
        return {self.peer_name: rel_err(self.c.peer(0), self.c.ref)}

    def peer_ms(self, name: str) -> float:
        from ..timing import time_cuda

        return time_cuda(self.c.peer, sets=self.sets, trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS).median_ms

    def launch(self, kid: int, i: int) -> None:
        import torch

        aux = None if self.aux is None else self.aux[i]
        torch.ops.cvt_cutlass_C.gemm(kid, self.c.xs[i], self.c.w, self.c.bias, self.c.residual(i), self.outs[i], aux)

    def check(self, kid: int) -> float:
        import torch

        got = [self.outs[0]] + ([] if self.aux is None else [self.aux[0]])
        for t in got:
            t.fill_(float("nan"))  # every element must be written
        self.launch(kid, 0)
        torch.cuda.synchronize()
        return max_rel_err(got, [self.c.ref, self.c.ref_aux][:len(got)])


class BackwardCase:
    """One backward problem: random operands, PyTorch's ops for the gradient as the peer, an fp32
    reference, the raw dgrad / wgrad launch of a kernel."""

    sets = 1

    def __init__(self, item: Item, gen):
        import torch

        from ...epilogues import gelu_grad

        p, tdt = item.problem, _torch_dtype(item.dtype)

        def r(*s, scale=1.0):
            return (scale * torch.randn(*s, device="cuda", generator=gen)).to(tdt)

        self.p = p
        self.g = r(p.m, p.k if p.pass_ == "dgrad" else p.n)
        if p.pass_ == "dgrad":
            self.w = r(p.k, p.n, scale=p.k ** -0.5)  # the layer's (N, K) weight
            # fc1's saved pre-activation, or GELU's derivative at it (fp16, as fc1's forward saves it)
            self.z = r(p.m, p.n) if p.epilogue == "dgelu_dbias" else None
            if p.epilogue == "dgelu_saved_dbias":
                self.z = gelu_grad(torch.randn(p.m, p.n, device="cuda", generator=gen)).half()
        else:
            self.x = r(p.m, p.k)
        self.ref = self._math(torch.float32)
        self.d = torch.empty_like(self.ref[0], dtype=tdt)
        self.db = torch.empty(p.n, device="cuda", dtype=tdt) if self.ref[1] is not None else None

    def _math(self, cdt):
        """(dX or dW, db or None) as autograd's ops compute them, in ``cdt``."""
        import torch

        g = self.g.to(cdt)
        if self.p.pass_ == "wgrad":
            return g.t() @ self.x.to(cdt), (g.sum(0) if self.p.epilogue == "dbias" else None)
        dx = g @ self.w.to(cdt)
        if self.z is None:
            return dx, None
        if self.p.epilogue == "dgelu_saved_dbias":  # the fp16 factor as saved, one rounding
            dz = (dx.float() * self.z.float()).to(cdt)
        else:
            dz = torch.ops.aten.gelu_backward(dx, self.z.to(cdt))
        return dz, dz.sum(0)

    def peers(self) -> dict[str, float]:
        return {f"torch:{self.p.pass_}": max_rel_err(self._math(self.g.dtype), self.ref)}

    def peer_ms(self, name: str) -> float:
        from ..timing import time_cuda

        return time_cuda(lambda _: self._math(self.g.dtype), trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS).median_ms

    def launch(self, kid: int, i: int = 0) -> None:
        import torch

        if self.p.pass_ == "dgrad":
            torch.ops.cvt_cutlass_C.dgrad(kid, self.g, self.w, self.z, self.d, self.db)
        else:
            torch.ops.cvt_cutlass_C.wgrad(kid, self.g, self.x, self.d, self.db)

    def check(self, kid: int) -> float:
        import torch

        for t in (self.d, self.db):
            if t is not None:
                t.fill_(float("nan"))
        self.launch(kid)
        torch.cuda.synchronize()
        return max_rel_err((self.d, self.db), self.ref)


def forward_problems(a) -> list:
    """The sweep's forward problems: the model's Linears at each batch with the requested
    epilogues (default: every epilogue the model's forward uses; a training forward's variant,
    e.g. ``bias_gelu_aux``, on the problems of the epilogue it varies), each (m, n, k, epilogue) once."""
    import dataclasses

    from ...operators.linear.problems import TRAINING_VARIANTS, linear_problems

    epilogues = a.epilogue or sorted({p.epilogue for p in linear_problems(a.model, 1, a.image_size)})
    seen, probs = set(), []
    for b in a.batch:
        for p in linear_problems(a.model, b, a.image_size):
            for e in [p.epilogue] + [v for v, base in TRAINING_VARIANTS.items() if base == p.epilogue]:
                if e in epilogues and (p.m, p.n, p.k, e) not in seen:
                    seen.add((p.m, p.n, p.k, e))
                    probs.append(dataclasses.replace(p, epilogue=e))
    return probs


def sweep_linear(a, done: set, out: Path, prior: list[dict] = ()) -> list[dict]:
    """Stage 1: the candidate space on every forward problem; stage 2 (unless ``a.refine`` is
    false): the raster-order / swizzle variants of each problem's winner so far (this run's and
    ``prior`` rows)."""
    from ...operators.linear import candidates, refinements
    from ...operators.spec import parse_kernel_name

    dtypes = a.dtype or ["fp16", "bf16"]
    items = sweep_items(a.arch, dtypes, forward_problems(a), lambda arch, dt, p, _: candidates(arch, dt, p.epilogue))
    rows = run_sweep(GemmFamily(), items, out, done, jobs=a.jobs, stage="stage 1")
    if not getattr(a, "refine", True):
        return rows
    winners = best_per_problem(list(prior) + rows)
    for it in items:
        p = it.problem
        hit = winners.get((f"sm{it.arch}", _DT[it.dtype], p.epilogue, p.m, p.n, p.k))
        it.candidates = refinements(parse_kernel_name(hit[0]["Operation"])) if hit else []
    print(f"[profile stage 2] {sum(len(it.candidates) for it in items)} raster/swizzle variants of "
          f"{len(winners)} winners", flush=True)
    return rows + run_sweep(GemmFamily(), items, out, done, jobs=a.jobs, stage="stage 2")


def backward_sweep_problems(a) -> list:
    """The backward sweep's problems: the model's backward GEMMs of ``a.passes`` at each batch,
    those with ``a.epilogue``'s epilogues where given (e.g. fc2's ``dgelu_saved_dbias`` dgrad)."""
    from ...operators.linear.problems import BACKWARD_PASSES, backward_problems

    probs = backward_problems(a.model, a.batch, a.image_size, [p for p in a.passes if p in BACKWARD_PASSES])
    return [p for p in probs if not getattr(a, "epilogue", None) or p.epilogue in a.epilogue]


def sweep_linear_backward(a, done: set, out: Path) -> list[dict]:
    """Every backward problem x candidate, rows appended to ``out`` problem by problem."""
    from ...operators.linear import backward_candidates

    probs = backward_sweep_problems(a)
    items = [Item(arch, dt, p, backward_candidates(arch, dt, p.pass_, p.epilogue), p.pass_)
             for arch in a.arch for dt in (a.dtype or ["fp16", "bf16"]) for p in probs]
    return run_sweep(GemmFamily(), items, out, done, jobs=a.jobs, stage="backward")


def sweep(a, out: Path) -> list[dict]:
    """``profile --op linear``: the forward and / or backward sweeps ``a.passes`` asks for."""
    prior = read_rows(out)
    done = {row_key(r) for r in prior}
    passes = getattr(a, "passes", None) or ["fwd"]
    rows = sweep_linear(a, done, out, prior) if "fwd" in passes else []
    if set(passes) - {"fwd"}:
        rows += sweep_linear_backward(a, done, out)
    return prior + rows
