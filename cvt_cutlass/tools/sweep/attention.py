"""The attention sweeps (GPU): ``cvt-cutlass profile --op attention [--pass bwd]``.

No cutlass_profiler kind exists for FMHA: the rows take the GEMM-style columns, with the attention
problem's own arguments in place of m, n, k. Forward: every candidate (example 41 on both paths,
example 88 on the sm90 path) on every attention problem of the model, against the fastest PyTorch
path measured in the same process (HF's einsum sequence and SDPA with PyTorch's default backend).
Backward: every backward candidate against SDPA's backward on cuDNN and on flash; kernels whose
gradients are worse than 2x the peers' (vs float64, image 0) + 2e-3 are marked incorrect.
"""

from __future__ import annotations

from pathlib import Path

from ...operators.spec import DT_FROM_TAG
from ...operators.spec import DT_TAG as _DT
from ..compare import max_rel_err, rel_err
from .driver import SWEEP_TARGET_MS, SWEEP_TRIALS, Item, finish_row, read_rows, run_sweep, sweep_items

ATTN_COLUMNS = (
    "Problem", "Provider", "OperationKind", "Operation", "Disposition", "Status",
    "batch", "heads", "lq", "lkv", "head_dim", "scale", "Q", "K", "V", "O", "LSE", "op_class", "accum",
    "cta_q", "cta_kv", "cta_d", "schedule", "min_cc", "max_cc",
    "Bytes", "Flops", "Flops/Byte", "Runtime", "GB/s", "GFLOPs",
    "kernel_path", "gpu", "date", "cutlass_version", "rel_err", "peer_rel_err", "layer",
)


def attn_row(problem_idx: int, provider: str, operation: str, disposition: str, status: str, lay, dtype: str,
             runtime_ms: float | None, spec=None, extra: dict | None = None, bwd: bool = False) -> dict:
    """One attention profile row; ``bwd``: of the backward (OperationKind fmha_bwd: q, k, v, o, dO
    read, dq, dk, dv written; 2.5x the forward's FLOPs)."""
    b, h, lq, lkv, d = lay.n, lay.heads, lay.lq, lay.lkv, lay.head_dim
    nbytes = 2 * b * h * d * ((4 * lq + 4 * lkv) if bwd else (2 * lq + 2 * lkv)) + 4 * b * h * lq
    flops = (10 if bwd else 4) * b * h * lq * lkv * d
    dt = _DT[dtype]
    row = {"Problem": problem_idx, "Provider": provider, "OperationKind": "fmha_bwd" if bwd else "fmha",
           "Operation": operation, "Disposition": disposition, "Status": status, "batch": b, "heads": h,
           "lq": lq, "lkv": lkv, "head_dim": d, "scale": f"{lay.scale:.6g}", "Q": f"{dt}:blhd", "K": f"{dt}:blhd",
           "V": f"{dt}:blhd", "O": f"{dt}:blhd", "LSE": "f32:bhl", "Bytes": nbytes, "Flops": flops,
           "Flops/Byte": f"{flops / nbytes:.2f}", "layer": lay.label}
    return finish_row(row, _kernel_columns(spec) if spec is not None else None, runtime_ms, extra)


def _kernel_columns(spec) -> dict:
    if spec.kernel == "ex88":
        sched = getattr(spec, "schedule", "coop")
        stages, blocks = getattr(spec, "stages", 0), getattr(spec, "blocks", 0)
        return dict(op_class="tensorop(wgmma)", accum="f32", cta_q=spec.tile[0], cta_kv=spec.tile[1],
                    cta_d=spec.tile[2], min_cc=90, max_cc=90,
                    schedule=sched + (f"_s{stages}" if stages else "") + (f"_b{blocks}" if blocks else ""))
    if spec.kernel == "skv":  # the short-key kernels: 64 queries per block, every key in the CTA
        return dict(op_class="tensorop(mma.sync)", accum="f32", cta_q=64, cta_kv=spec.MAX_KEYS,
                    cta_d=spec.MAX_HEAD_DIM, schedule=f"skv_b{spec.blocks}", min_cc=80, max_cc=1024)
    if spec.kernel == "wgmma":  # ours on Hopper: 128 keys per CTA (a warpgroup per 64), 64 queries a block
        return dict(op_class="tensorop(wgmma)", accum="f32", cta_q=spec.QUERIES, cta_kv=spec.KEYS,
                    cta_d=spec.HEAD_DIM, schedule="wgmma", min_cc=90, max_cc=90)
    return dict(op_class="tensorop(mma.sync)", accum="f32", cta_q=spec.queries, cta_kv=spec.keys,
                cta_d=spec.max_k, schedule="ex41", min_cc=80, max_cc=1024)


def row_key(r: dict) -> tuple:
    """The resume key of an attention row (written, or read back as strings)."""
    return (r["Provider"], r["Operation"], str(r["batch"]), str(r["heads"]), str(r["lq"]), str(r["lkv"]),
            r["kernel_path"], r["Q"], r.get("OperationKind", "fmha"))


def table_key(row: dict) -> tuple:
    """(op, arch, dtype, epilogue, m, n, k) of an attention row: the key select_attention looks up."""
    from ...operators.attention.select import table_key as family_key

    pass_ = "bwd" if row.get("OperationKind") == "fmha_bwd" else "fwd"
    key = family_key(*(int(row[c]) for c in ("batch", "heads", "lq", "lkv", "head_dim")), pass_)
    return ("attention", row["kernel_path"].removeprefix("sm"), DT_FROM_TAG[row["Q"].split(":")[0]], *key)


class AttentionFamily:
    """The attention problems' schema and cases (tools/sweep/driver.py's Family)."""

    columns = ATTN_COLUMNS

    def __init__(self, bwd: bool = False):
        self.bwd = bwd
        self.floor = 2e-3 if bwd else 1e-4

    def case(self, item: Item, gen):
        return BackwardCase(item, gen) if self.bwd else ForwardCase(item, gen)

    def row(self, i, item, provider, operation, disposition, status, ms, spec, extra) -> dict:
        return attn_row(i, provider, operation, disposition, status, item.problem, item.dtype, ms, spec, extra,
                        bwd=self.bwd)

    def key(self, row: dict) -> tuple:
        return row_key(row)

    def describe(self, item: Item) -> str:
        lay = item.problem
        return f"sm{item.arch} {item.dtype} b={lay.n} {lay.label}{' bwd' if self.bwd else ''}"


def _inputs(lay, dtype: str, gen):
    """q (B, Lq, H, D) and k, v as views of one packed (B, Lkv, 2*H*D) projection output."""
    import torch

    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    b, h, lq, lkv, d = lay.n, lay.heads, lay.lq, lay.lkv, lay.head_dim
    q = torch.randn(b, lq, h * d, device="cuda", generator=gen).to(tdt).view(b, lq, h, d)
    kv = torch.randn(b, lkv, 2 * h * d, device="cuda", generator=gen).to(tdt)
    return q, kv[..., : h * d].view(b, lkv, h, d), kv[..., h * d:].view(b, lkv, h, d)


class ForwardCase:
    """Image 0's fp32 reference, HF's einsum sequence and SDPA as the peers, the raw launch."""

    sets = 1

    def __init__(self, item: Item, gen):
        from ...ops.attention import attention_reference, new_lse

        lay = self.lay = item.problem
        self.q, self.k, self.v = _inputs(lay, item.dtype, gen)
        self.ref = attention_reference(self.q[:1], self.k[:1], self.v[:1], lay.scale)[0].float()
        self.o = self.q.new_empty(lay.n, lay.lq, lay.heads, lay.head_dim)
        self.lse = new_lse(self.q, lay.n, lay.heads, lay.lq)
        self.fns = {"torch:hf_einsum": self._hf, "torch:sdpa_default": self._sdpa}

    def _hf(self, _=0):
        import torch

        qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (self.q, self.k, self.v))
        sc = torch.einsum("bhlk,bhtk->bhlt", qh, kh) * self.lay.scale
        return torch.einsum("bhlt,bhtv->bhlv", torch.softmax(sc, dim=-1), vh).permute(0, 2, 1, 3)

    def _sdpa(self, _=0):
        import torch.nn.functional as F

        qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (self.q, self.k, self.v))
        return F.scaled_dot_product_attention(qh, kh, vh, scale=self.lay.scale).permute(0, 2, 1, 3)

    def peers(self) -> dict[str, float]:
        return {name: rel_err(fn()[:1], self.ref) for name, fn in self.fns.items()}

    def peer_ms(self, name: str) -> float:
        from ..timing import time_cuda

        return time_cuda(self.fns[name], trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS).median_ms

    def launch(self, kid: int, i: int = 0) -> None:
        import torch

        torch.ops.cvt_cutlass_C.attention(kid, self.q, self.k, self.v, self.o, self.lse, self.lay.scale)

    def check(self, kid: int) -> float:
        import torch

        self.o.fill_(float("nan"))
        self.launch(kid)
        torch.cuda.synchronize()
        return rel_err(self.o[:1], self.ref)


class BackwardCase:
    """The forward's out / lse (float64 math), a random output gradient, float64 reference
    gradients of image 0, SDPA's backward on cuDNN and on flash as the peers (a backend that
    refuses the problem is left out), the raw backward launch."""

    sets = 1

    def __init__(self, item: Item, gen):
        import torch

        from ...ops.attention import attention_backward_reference, attention_reference, new_lse

        lay = self.lay = item.problem
        self.q, self.k, self.v = _inputs(lay, item.dtype, gen)
        self.out, lse_ref = attention_reference(self.q, self.k, self.v, lay.scale)
        self.lse = new_lse(self.q, lay.n, lay.heads, lay.lq)
        self.lse.copy_(lse_ref)
        self.dout = torch.randn(self.out.shape, device="cuda", generator=gen).to(self.q.dtype)
        self.ref = attention_backward_reference(self.dout[:1].double(), *(t[:1].double() for t in (self.q, self.k, self.v)),
                                                lay.scale)
        self.grads = [torch.empty_like(t) for t in (self.q, self.k, self.v)]
        self.backends = self._backends()

    def _backends(self) -> dict:
        from torch.nn.attention import SDPBackend

        return {"torch:sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "torch:sdpa_flash": SDPBackend.FLASH_ATTENTION}

    def _peer(self, backend):
        """(forward fn, forward + backward fn) of SDPA on one backend, with its own leaves."""
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        leaves = [t.detach().transpose(1, 2).requires_grad_() for t in (self.q, self.k, self.v)]

        def fwd(_=0):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(*leaves, scale=self.lay.scale)

        def both(_=0):
            return torch.autograd.grad(fwd(), leaves, self.dout.transpose(1, 2))

        return fwd, both

    def peers(self) -> dict[str, float]:
        out = {}
        for name, backend in list(self.backends.items()):
            try:
                grads = self._peer(backend)[1]()
            except RuntimeError:  # the backend does not take this problem
                del self.backends[name]
                continue
            out[name] = max_rel_err([g.transpose(1, 2)[:1] for g in grads], self.ref)
        return out

    def peer_ms(self, name: str) -> float:
        """The backward's GPU time: forward + autograd.grad captured together less the forward (a
        kept graph's backward alone cannot be captured: the engine runs it on its own thread)."""
        from ..timing import time_cuda

        fwd, both = self._peer(self.backends[name])
        return (time_cuda(both, trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS).median_ms
                - time_cuda(fwd, trials=SWEEP_TRIALS, target_ms=SWEEP_TARGET_MS).median_ms)

    def launch(self, kid: int, i: int = 0) -> None:
        import torch

        dq, dk, dv = self.grads
        torch.ops.cvt_cutlass_C.attention_backward(kid, self.dout, self.q, self.k, self.v, self.out, self.lse, dq, dk,
                                                   dv, self.lay.scale)

    def check(self, kid: int) -> float:
        import torch

        self.launch(kid)
        torch.cuda.synchronize()
        return max_rel_err([g[:1] for g in self.grads], self.ref)


def sweep(a, out: Path) -> list[dict]:
    """``profile --op attention [--pass bwd]``: every attention problem x candidate."""
    from ...operators.attention import attention_problems, attn_bwd_candidates, attn_candidates

    bwd = getattr(a, "passes", None) == ["bwd"]
    def cands(arch, dt, lay, _):
        return (attn_bwd_candidates if bwd else attn_candidates)(dt, lay.head_dim, arch, lay.lkv)

    layers = [lay for b in a.batch for lay in attention_problems(a.model, b, a.image_size)]
    items = sweep_items(a.arch, a.dtype or ["fp16", "bf16"], layers, cands)
    prior = read_rows(out)
    return prior + run_sweep(AttentionFamily(bwd), items, out, {row_key(r) for r in prior}, jobs=a.jobs)
