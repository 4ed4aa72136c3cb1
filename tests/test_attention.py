"""Fused attention (torch.ops.cvt_cutlass.attention): CPU and GPU.

CPU: spec names, the reference against HF's einsum/softmax/einsum on (B, H, L, D) tensors, the
padded-lse layout on every path, CPU fallback, errors, autograd through the fallback.
GPU: CvT-13/21/W24 attention shapes at 224, 384 and an odd size, batch 1/3/64/256, fp16/bf16,
both kernel paths, odd lengths (1, 7, 50, 197, 785), against a float64 reference of HF's math
(batches sampled for the biggest problems), strict mode; opcheck; CUDA graph; strided k/v views
of one concatenated GEMM output.
"""

from __future__ import annotations

import math

import pytest
import torch
from cvt_cutlass.operators.attention import (
    EX88_BWD_MAINLOOP,
    EX88_BWD_MAINLOOP_COPY,
    EX88_DIR,
    Attn88BwdSpec,
    AttnBwdSpec,
    AttnShortBwdSpec,
    AttnShortSpec,
    AttnSpec,
    AttnWgmmaBwdSpec,
    attention_problems,
    attn_bwd_candidates,
    attn_bwd_heuristic,
    attn_candidates,
    select_attention,
)
from cvt_cutlass.operators.selection import Choice
from cvt_cutlass.operators.spec import SpecError, parse_kernel_name

from cvt_cutlass import runtime
from cvt_cutlass.ops.attention import (
    attention,
    attention_backward,
    attention_backward_reference,
    attention_reference,
    deterministic_choice,
    lse_padded_len,
)

from .conftest import CUDA_CC, DTYPES, PATHS, graph_replayed, no_kernel_body, requires_nvcc, requires_sm80
from .gpu_kernels import attention_bwd_spec, attention_spec, default_arch, model_cases, path_archs


def hf_attention(q, k, v, scale):
    """HF CvtSelfAttention's math on (B, L, H, D) inputs, in their dtype's promotion."""
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))  # b h l d
    s = torch.einsum("bhlk,bhtk->bhlt", qh, kh) * scale
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhlt,bhtv->bhlv", p, vh).permute(0, 2, 1, 3)


# ----------------------------------------------------------------------------------- CPU
def test_attn_names_round_trip():
    specs = attn_candidates("fp16", 64, 90) + attn_candidates("bf16", 128)
    assert any(s.kernel == "ex88" for s in specs)
    assert len({s.name for s in specs}) == len(specs)
    for s in specs:
        assert parse_kernel_name(s.name) == s
    with pytest.raises(SpecError):
        AttnSpec("fp16", 48, 64)
    with pytest.raises(SpecError, match="queries and keys per block"):  # the name parses, the spec is refused
        parse_kernel_name("cvt_attention_fwd_sm89_f16_blhd_ex41_q48_k64_d64_a8")
    with pytest.raises(SpecError, match="not a valid attention fwd kernel variant"):
        parse_kernel_name("cvt_attention_fwd_sm89_f16_blhd_bias_t128x128x32_w2x2x1_s4_sw1_a8")


def test_example88_knobs():
    """The stage and CTAs-per-SM knobs in names that round-trip (defaults keep the old names) and
    reach the instantiation; the tile rules (only the KV widths measured correct and useful)."""
    from cvt_cutlass.operators.attention import Attn88Spec

    assert Attn88Spec("fp16").name == "cvt_attention_fwd_sm90a_f16_blhd_ex88_t64x128x64_tma_a8"
    spec = Attn88Spec("bf16", (64, 64, 64), "tma", 3, 3)
    assert spec.name == "cvt_attention_fwd_sm90a_bf16_blhd_ex88_t64x64x64_tma_s3_b3_a8" and parse_kernel_name(spec.name) == spec
    src = spec.instantiation()
    assert "AttentionEx88Fwd<cutlass::bfloat16_t, 64, 64, 64, cutlass::gemm::KernelTma," in src
    assert "Tag::kStagesKV, cute::Int<3>>" in src and "Tag::kBlocksPerSM, cute::Int<3>>" in src
    assert "Option" not in Attn88Spec("fp16").instantiation()  # the example's defaults: no options
    # Lq needs no alignment (TMA strides are H*D-element rows); the head dim does
    assert spec.serves(64, 197) and not spec.serves(72) and not spec.serves(60)
    for bad in (dict(tile=(64, 112, 64)), dict(tile=(64, 160, 64)), dict(stages=1), dict(blocks=5),
                dict(tile=(128, 64, 64), schedule="coop", blocks=3), dict(tile=(64, 256, 64), stages=8)):
        with pytest.raises(SpecError):
            Attn88Spec("fp16", **{"tile": (64, 128, 64), **bad})


def test_reference_is_hf_math():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 37, 3, 64, generator=g, dtype=torch.float64)
    k = torch.randn(2, 11, 3, 64, generator=g, dtype=torch.float64)
    v = torch.randn(2, 11, 3, 64, generator=g, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, 192 ** -0.5)
    torch.testing.assert_close(out, hf_attention(q, k, v, 192 ** -0.5))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * 192 ** -0.5
    torch.testing.assert_close(lse, s.exp().sum(-1).log())


def test_cpu_fallback_and_lse_layout(counted_fallbacks):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 50, 6, 64, generator=g).half()
    kv = torch.randn(2, 13, 2, 6, 64, generator=g).half()  # k and v: halves of one GEMM output
    k, v = kv[:, :, 0], kv[:, :, 1]
    out, lse = attention(q, k, v, 384 ** -0.5)
    assert out.shape == q.shape and out.is_contiguous()
    lp = lse_padded_len(50)
    assert lp == 64 and lse.shape == (2, 6, 50) and lse.stride() == (6 * lp, lp, 1)
    ref_out, ref_lse = attention_reference(q, k, v, 384 ** -0.5)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    assert counted_fallbacks.stats()["fallbacks"] == {"attention:device": 1}


def test_attention_argument_errors():
    q = torch.randn(1, 8, 2, 64)
    with pytest.raises(ValueError, match="must be"):
        attention(q, torch.randn(1, 8, 3, 64), torch.randn(1, 8, 3, 64), 0.1)
    with pytest.raises(TypeError, match="k is"):
        attention(q, torch.randn(1, 8, 2, 64).half(), torch.randn(1, 8, 2, 64), 0.1)
    with pytest.raises(ValueError, match="scale"):
        attention(q, q, q, -1.0)


def test_attention_autograd_through_fallback():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 9, 2, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, _ = attention(q, k, v, 0.3)
    out.square().sum().backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    hf_attention(q2, k2, v2, 0.3).square().sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad)


def test_attention_problems():
    s = attention_problems("cvt-13", 2)
    assert [(a.heads, a.lq, a.lkv) for a in s] == [(1, 3136, 784), (3, 784, 196), (6, 197, 50)]
    assert math.isclose(s[2].scale, 384 ** -0.5)


# ----------------------------------------------------------------------------------- GPU
def _inputs(b, lq, lkv, h, d, dtype, g, packed_kv=True):
    q = torch.randn(b, lq, h * d, device="cuda", generator=g).to(dtype).view(b, lq, h, d)
    if packed_kv:  # one (B, L, 2*H*D) GEMM output, as the swapped model's k/v projection writes it
        kv = torch.randn(b, lkv, 2 * h * d, device="cuda", generator=g).to(dtype)
        k, v = kv[..., : h * d].view(b, lkv, h, d), kv[..., h * d:].view(b, lkv, h, d)
    else:
        k = torch.randn(b, lkv, h, d, device="cuda", generator=g).to(dtype)
        v = torch.randn(b, lkv, h, d, device="cuda", generator=g).to(dtype)
    return q, k, v


def _check_against_float64(q, k, v, scale, out, lse, sample=None):
    idx = sample if sample is not None else list(range(q.shape[0]))
    qs, ks, vs = (t[idx].double() for t in (q, k, v))
    ref, ref_lse = attention_reference(qs, ks, vs, scale)
    same = hf_attention(q[idx], k[idx], v[idx], scale)  # HF's einsum path in the same dtype
    o = out[idx].double()
    assert not torch.isnan(out[idx]).any()
    err = float((o - ref).norm() / ref.norm())
    err_hf = float((same.double() - ref).norm() / ref.norm())
    assert err <= 2 * err_hf + 1e-4, (err, err_hf)
    torch.testing.assert_close(lse[idx].double(), ref_lse, atol=2e-3, rtol=1e-3)


def _gpu_cases():
    return model_cases(attention_problems, (224, 384, (231, 217)), (1, 3, 64, 256))


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("a", _gpu_cases())
def test_attention_matches_float64_gpu(a, dtype, path, strict_fallbacks):
    g = torch.Generator(device="cuda").manual_seed(a.lq + a.heads)
    q, k, v = _inputs(a.n, a.lq, a.lkv, a.heads, a.head_dim, DTYPES[dtype], g)
    with runtime.kernel_path(path):
        out, lse = attention(q, k, v, a.scale)
    torch.cuda.synchronize()
    big = a.n * a.heads * a.lq * a.lkv > 2**31
    sample = [0, a.n // 2, a.n - 1] if big else None
    _check_against_float64(q, k, v, a.scale, out, lse, sample)


ODD_LENGTHS = [(1, 1), (7, 7), (50, 7), (197, 50), (785, 197), (1, 785), (785, 1)]
ODD_HEADS = (1, 6, 16)


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("lq,lkv", ODD_LENGTHS)
def test_attention_odd_lengths_gpu(lq, lkv, path, strict_fallbacks):
    g = torch.Generator(device="cuda").manual_seed(lq * 1000 + lkv)
    for h in ODD_HEADS:
        q, k, v = _inputs(3, lq, lkv, h, 64, torch.float16, g, packed_kv=h != 6)
        with runtime.kernel_path(path):
            out, lse = attention(q, k, v, 0.05)
        torch.cuda.synchronize()
        _check_against_float64(q, k, v, 0.05, out, lse)


@requires_sm80
def test_attention_opcheck_and_graph_gpu(strict_fallbacks):
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = _inputs(2, 197, 50, 6, 64, torch.bfloat16, g)
    torch.library.opcheck(torch.ops.cvt_cutlass.attention.default, (q, k, v, 384 ** -0.5))
    eager = attention(q, k, v, 384 ** -0.5)
    outs = graph_replayed(lambda: attention(q, k, v, 384 ** -0.5))
    assert torch.equal(outs[0], eager[0]) and torch.equal(outs[1], eager[1])


EX88_CASES = [((64, 128, 64), "tma", 0), ((128, 64, 64), "coop", 0), ((128, 64, 64), "pingpong", 0),
              ((64, 64, 64), "tma", 3)]


@pytest.mark.skipif(CUDA_CC != 90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("tile,schedule,blocks", EX88_CASES)
def test_example88_kernels_match_float64_gpu(tile, schedule, blocks, dtype):
    """Example-88 kernels run directly (whatever the table says) with CvT's scale, any Lq (odd
    ones included: rows past Lq are clipped on store) and Lkv, strided k/v views, against float64;
    the rows around the output must stay untouched."""
    from cvt_cutlass.operators.attention import Attn88Spec

    from cvt_cutlass.ops.attention import new_lse

    spec = Attn88Spec(dtype, tile, schedule, 0, blocks)
    kid = runtime.load_kernel(spec, CUDA_CC)
    g = torch.Generator(device="cuda").manual_seed(11)
    for b, h, lq, lkv, scale in ((3, 1, 3136, 784, 0.125), (2, 3, 784, 196, 192 ** -0.5), (2, 6, 200, 50, 0.05),
                                 (1, 12, 8, 1, 0.1), (2, 16, 576, 145, 1024 ** -0.5), (3, 6, 197, 50, 0.05),
                                 (2, 16, 577, 145, 0.03), (2, 2, 1, 7, 0.2), (1, 4, 7, 785, 0.1), (2, 3, 785, 197, 0.07)):
        q, k, v = _inputs(b, lq, lkv, h, 64, DTYPES[dtype], g)
        n = b * lq * h * 64
        buf = torch.full((n + 128 * h * 64,), 7.0, device="cuda", dtype=q.dtype)  # room for a stray tile
        out = buf[:n].view(b, lq, h, 64)
        out.fill_(float("nan"))
        lse = new_lse(q, b, h, lq)
        torch.ops.cvt_cutlass_C.attention(kid, q, k, v, out, lse, scale)
        torch.cuda.synchronize()
        _check_against_float64(q, k, v, scale, out, lse)
        assert bool((buf[n:] == 7.0).all()), "wrote past the last query row"


# (batch, heads, Lq, Lkv, head dim): the short-key kernels' cases run by name.
SHORT_CASES = ((3, 6, 197, 50, 64), (2, 6, 200, 50, 64), (1, 12, 8, 1, 64), (2, 2, 1, 7, 64), (2, 3, 130, 64, 64),
               (2, 4, 100, 37, 48), (1, 2, 65, 63, 32), (2, 3, 70, 20, 40), (1, 2, 17, 9, 8))


@requires_sm80
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_short_key_forward_kernel_matches_float64_gpu(dtype):
    """The short-key forward run by name on Lkv <= 64 (CvT-13's stage 3, one key, exactly 64 keys,
    head dims 48 and 32, Lq on and off its 64-row blocks) against float64; the rows after the
    output stay untouched; a problem with 65 keys is refused."""
    from cvt_cutlass.ops.attention import new_lse

    kid = runtime.load_kernel(AttnShortSpec(dtype), CUDA_CC)
    g = torch.Generator(device="cuda").manual_seed(12)
    for b, h, lq, lkv, d in SHORT_CASES:
        q, k, v = _inputs(b, lq, lkv, h, d, DTYPES[dtype], g, packed_kv=lkv % 2 == 0)
        n = b * lq * h * d
        buf = torch.full((n + 128 * h * d,), 7.0, device="cuda", dtype=q.dtype)
        out = buf[:n].view(b, lq, h, d)
        out.fill_(float("nan"))
        lse = new_lse(q, b, h, lq)
        torch.ops.cvt_cutlass_C.attention(kid, q, k, v, out, lse, 0.07)
        torch.cuda.synchronize()
        _check_against_float64(q, k, v, 0.07, out, lse)
        assert bool((buf[n:] == 7.0).all()), "wrote past the last query row"
    q, k, v = _inputs(2, 9, 65, 2, 64, DTYPES[dtype], g)
    with pytest.raises(RuntimeError, match="cannot run"):
        torch.ops.cvt_cutlass_C.attention(kid, q, k, v, torch.empty_like(q), new_lse(q, 2, 2, 9), 0.1)


def test_attention_profile_rows_and_table(tmp_path):
    """Attention rows round-trip; the fastest passing kernel per problem and the fastest PyTorch
    path land in the attention table under the key select_attention looks up."""
    from cvt_cutlass.operators.attention import Attn88Spec
    from cvt_cutlass.operators.selection import SelectionTable

    from cvt_cutlass.tools.sweep.attention import ATTN_COLUMNS, attn_row
    from cvt_cutlass.tools.sweep.driver import read_rows
    from cvt_cutlass.tools.sweep.tables import update_from_rows

    lay = attention_problems("cvt-13", 256)[1]
    base = {"kernel_path": "sm90", "gpu": "Test GPU", "date": "2026-11-21", "cutlass_version": "4.2.0.0"}
    e41, e88 = AttnSpec("fp16", 64, 64, 64), Attn88Spec("fp16", (64, 128, 64), "tma")
    rows = [attn_row(1, "pytorch", "torch:hf_einsum", "passed", "success", lay, "fp16", 1.06, extra=base),
            attn_row(1, "pytorch", "torch:sdpa_default", "passed", "success", lay, "fp16", 0.145, extra=base),
            attn_row(1, "cutlass", e41.name, "passed", "success", lay, "fp16", 0.32, e41, base),
            attn_row(1, "cutlass", e88.name, "passed", "success", lay, "fp16", 0.14, e88, base)]
    path = tmp_path / "attn.csv"
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ATTN_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    back = read_rows(path)
    assert back[3]["cta_kv"] == "128" and back[3]["schedule"] == "tma" and back[2]["schedule"] == "ex41"
    assert back[0]["Flops"] == str(4 * 256 * 3 * 784 * 196 * 64)
    update_from_rows(back, str(tmp_path))
    t = SelectionTable.load(tmp_path / "attention_selection.csv")
    assert [(r["kernel"], r["peer_ms"]) for r in t.rows] == [(e88.name, "0.145000")]
    assert t.lookup("attention", 90, "fp16", "h3", 256 * 784, 196, 64) == e88.name


def test_profile_rows_name_every_candidate_kernel():
    """Each candidate a forward or backward sweep tries (examples 41 and 88, the short-key kernels,
    the wgmma backward) gives a profile row with its CTA shape and schedule."""
    from cvt_cutlass.tools.sweep.attention import attn_row

    lay = attention_problems("cvt-13", 128)[2]  # stage 3: Lkv 50, where the short-key kernels serve
    base = {"kernel_path": "sm90", "gpu": "Test GPU", "date": "2026-11-27", "cutlass_version": "4.2.0.0"}
    specs = attn_candidates("bf16", 64, 90, lay.lkv) + attn_bwd_candidates("bf16", 64, 90, lay.lkv)
    assert {s.kernel for s in specs} == {"ex41", "ex88", "skv", "wgmma"}
    for spec in specs:
        row = attn_row(1, "cutlass", spec.name, "passed", "success", lay, "bf16", 0.1, spec, base)
        assert int(row["cta_q"]) in (32, 64, 128) and int(row["cta_kv"]) in (64, 128, 256), spec.name
        prefix = {"ex41": ("ex41",), "ex88": ("tma", "coop", "pingpong"), "skv": ("skv_b",),
                  "wgmma": ("wgmma",)}[spec.kernel]
        assert row["schedule"].startswith(prefix), spec.name


_REFUSALS = r"""
import sys, torch
from cvt_cutlass import runtime
from cvt_cutlass.operators.attention import AttnSpec, Attn88Spec
from cvt_cutlass.operators.linear import heuristic_spec
from cvt_cutlass.ops.attention import new_lse
runtime.ensure_binding()
cc = runtime.device_info(0).cc
def expect_raise(what, fn):
    try:
        fn()
        torch.cuda.synchronize()
    except RuntimeError as e:
        print("raised", what, str(e).splitlines()[0][:100], flush=True)
        return
    raise SystemExit(f"{what}: no error")
b, h, lq, lkv, d = 1, 6, 197, 50, 64
q = torch.randn(b, lq, h * d, device="cuda").half().view(b, lq, h, d)
kv = torch.randn(b, lkv, 2 * h * d, device="cuda").half()
k, v = kv[..., : h * d].view(b, lkv, h, d), kv[..., h * d:].view(b, lkv, h, d)
o, lse = q.new_empty(b, lq, h, d), new_lse(q, b, h, lq)
k41 = runtime.load_kernel(AttnSpec("fp16", 64, 64, 64), cc)
bad_k = torch.randn(b, lkv, h * d + 4, device="cuda").half()[..., : h * d].view(b, lkv, h, d)
expect_raise("ex41 misaligned k rows", lambda: torch.ops.cvt_cutlass_C.attention(k41, q, bad_k, v, o, lse, 0.05))
if cc == 90:
    k88 = runtime.load_kernel(Attn88Spec("fp16", (64, 128, 64), "tma"), cc)
    expect_raise("ex88 misaligned k rows", lambda: torch.ops.cvt_cutlass_C.attention(k88, q, bad_k, v, o, lse, 0.05))
arch = 90 if cc == 90 else 89
kg = runtime.load_kernel(heuristic_spec(256, 64, 64, "fp16", "bias", arch), cc)
a = torch.randn(256, 72, device="cuda").half()[:, 4:68]  # rows 16-byte apart, start 8 bytes in
w, bias, out = (torch.randn(64, 64, device="cuda").half(), torch.randn(64, device="cuda").half(),
                torch.empty(256, 64, device="cuda").half())
expect_raise("gemm misaligned A", lambda: torch.ops.cvt_cutlass_C.gemm(kg, a, w, bias, None, out, None))
from cvt_cutlass.operators.dwconv import DwConvSpec
kd = runtime.load_kernel(DwConvSpec(89, "fp16", 2, 1, 256), cc)
x8, y8 = torch.randn(1, 8, 8, 64, device="cuda").half(), torch.empty(1, 8, 8, 64, device="cuda").half()
w8, b8 = torch.randn(3, 3, 64, device="cuda"), torch.randn(64, device="cuda")
expect_raise("dwconv stride mismatch", lambda: torch.ops.cvt_cutlass_C.conv2d(kd, x8, w8, b8, y8, [1, 1], [1, 1], 0))
# the process is still healthy: a correct call works after the refusals
torch.ops.cvt_cutlass_C.attention(k41, q, k, v, o, lse, 0.05)
torch.cuda.synchronize()
print("ok")
"""


@requires_sm80
def test_kernel_refusals_raise_gpu():
    """Problems a kernel library refuses (misaligned rows or pointers in examples 41 and 88,
    a depthwise kernel asked for another stride)
    raise RuntimeError through the binding and leave the process usable (run in a subprocess, so a
    crash fails this test instead of the whole suite)."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _REFUSALS], capture_output=True, text=True, env=dict(os.environ),
                       timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert r.stdout.count("raised") == (4 if CUDA_CC == 90 else 3)


def _refusal_specs(cc: int) -> list:
    """The kernels the _REFUSALS script loads by spec (keep in step with it)."""
    from cvt_cutlass.operators.attention import Attn88Spec
    from cvt_cutlass.operators.dwconv import DwConvSpec
    from cvt_cutlass.operators.linear import heuristic_spec

    out = [AttnSpec("fp16", 64, 64, 64), heuristic_spec(256, 64, 64, "fp16", "bias", 90 if cc == 90 else 89),
           DwConvSpec(89, "fp16", 2, 1, 256)]
    return out + ([Attn88Spec("fp16", (64, 128, 64), "tma")] if cc == 90 else [])


def gpu_kernel_specs(cc: int, gpu: str | None) -> list:
    """The kernels this module's GPU tests select or load on a device (cc, gpu), for
    tests/gpu_kernels.py to prebuild: the float64 sweep (_gpu_cases x dtypes x paths), the odd
    lengths (every path), opcheck/graph (default path), the refusal script's kernels, and on
    sm_90 the example-88 kernels run by name."""
    from cvt_cutlass.operators.attention import Attn88Spec

    out = []
    for arch in path_archs(cc):
        for dt in DTYPES:
            out += [attention_spec(a.n, a.heads, a.lq, a.lkv, a.head_dim, dt, arch, gpu)
                    for a in (case.values[0] for case in _gpu_cases())]
        out += [attention_spec(3, h, lq, lkv, 64, "fp16", arch, gpu) for lq, lkv in ODD_LENGTHS for h in ODD_HEADS]
    out.append(attention_spec(2, 6, 197, 50, 64, "bf16", default_arch(cc), gpu))  # opcheck and graph
    out += _refusal_specs(cc)
    if cc == 90:
        out += [Attn88Spec(dt, tile, sched, 0, blocks) for dt in DTYPES for tile, sched, blocks in EX88_CASES]
    out += [AttnShortSpec(dt) for dt in DTYPES]
    out += _bwd_gpu_specs(cc, gpu)
    return [s for s in out if s is not None]



# ----------------------------------------------------------------------------------- backward
def test_attn_bwd_names_round_trip_and_refusals():
    for spec in attn_bwd_candidates("bf16", 64, 90) + attn_bwd_candidates("fp16", 48, 89):
        assert spec.pass_ == "bwd" and parse_kernel_name(spec.name) == spec
    assert AttnBwdSpec("fp16").name == "cvt_attention_bwd_sm89_f16_blhd_ex41_q64_k64_d64_a8"
    assert Attn88BwdSpec("bf16").name == "cvt_attention_bwd_sm90a_bf16_blhd_ex88_t64x128x64_coop_a8"
    with pytest.raises(SpecError, match="keys 128"):
        Attn88BwdSpec("bf16", (64, 64, 64))
    with pytest.raises(SpecError, match="64 or 128"):
        AttnBwdSpec("fp16", 32, 64)
    with pytest.raises(SpecError, match="passes"):
        parse_kernel_name("cvt_attention_dgrad_sm89_f16_blhd_ex41_q64_k64_d64_a8")
    assert [type(s) for s in attn_bwd_candidates("fp16", 160, 90)] == [AttnBwdSpec] * 4  # no Hopper kernel > 128


def test_short_key_backward_spec_serves_short_keys_only():
    """The short-key backward: its name, where it serves (Lkv <= 64, head dim <= 64, multiples of
    8), the candidates and heuristic that offer it, and what it refuses."""
    spec = AttnShortBwdSpec("bf16")
    assert spec.name == "cvt_attention_bwd_sm89_bf16_blhd_skv64_d64_b2_a8"
    assert parse_kernel_name(spec.name) == spec and parse_kernel_name(AttnShortBwdSpec("fp16", 3).name).blocks == 3
    assert spec.serves(64, 50) and spec.serves(48, 64) and spec.serves(64)
    assert not spec.serves(64, 65) and not spec.serves(72, 50) and not spec.serves(44, 50)
    with pytest.raises(SpecError, match="2 or 3 CTAs"):
        AttnShortBwdSpec("bf16", 4)
    for arch in (89, 90):
        assert AttnShortBwdSpec("fp16") in attn_bwd_candidates("fp16", 64, arch, lkv=50)
        assert not any(isinstance(s, AttnShortBwdSpec) for s in attn_bwd_candidates("fp16", 64, arch, lkv=196))
        assert attn_bwd_heuristic("bf16", 64, arch, lkv=50) == spec
        assert not isinstance(attn_bwd_heuristic("bf16", 64, arch, lkv=196), AttnShortBwdSpec)



@pytest.mark.parametrize("lkv", [784, 50])
def test_deterministic_mode_takes_a_backward_that_sums_in_order(lkv):
    """Under torch.use_deterministic_algorithms(True) a backward whose spec says it reduce-adds dq
    in the order CTAs arrive (example 88's) gives way to the sm89 path's heuristic (example 41, or
    the short-key kernel for Lkv <= 64); the others (our wgmma one then sums in key-block order),
    and every kernel outside deterministic mode, stay."""
    specs = attn_bwd_candidates("bf16", 64, 90, lkv=lkv)
    assert {s.kernel for s in specs if not s.DETERMINISTIC} == {"ex88"}
    assert lkv <= 64 or any(s.kernel == "wgmma" and s.DETERMINISTIC for s in specs)
    torch.use_deterministic_algorithms(True)
    try:
        for spec in specs:
            got = deterministic_choice(Choice(spec, "table"), "bf16", 64, lkv).spec
            assert got.DETERMINISTIC and (got == spec) == spec.DETERMINISTIC, (spec.name, got.name)
            assert got.kernel == ("skv" if lkv <= 64 else "ex41") or got == spec
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(deterministic_choice(Choice(s, "table"), "bf16", 64, lkv).spec == s for s in specs)


def test_wgmma_backward_spec():
    """Our Hopper backward: its name, head dim 64 only, offered on the sm90 path only, refused
    names."""
    spec = AttnWgmmaBwdSpec("bf16")
    assert spec.name == "cvt_attention_bwd_sm90a_bf16_blhd_wgmma_k128_q64_d64_a8"
    assert parse_kernel_name(spec.name) == spec and parse_kernel_name(AttnWgmmaBwdSpec("fp16").name).dtype == "fp16"
    assert spec.serves(64, 784) and spec.serves(64) and not spec.serves(48) and not spec.serves(128)
    assert AttnWgmmaBwdSpec("fp16") in attn_bwd_candidates("fp16", 64, 90, lkv=784)
    assert attn_bwd_heuristic("bf16", 64, 90, lkv=784) == spec and attn_bwd_heuristic("bf16", 64, 90) == spec
    assert attn_bwd_heuristic("bf16", 64, 89, lkv=784).kernel == "ex41"
    assert attn_bwd_heuristic("bf16", 48, 90, lkv=784).kernel == "ex88"
    assert not any(isinstance(s, AttnWgmmaBwdSpec) for s in attn_bwd_candidates("fp16", 64, 89, lkv=784))
    assert not any(isinstance(s, AttnWgmmaBwdSpec) for s in attn_bwd_candidates("fp16", 48, 90, lkv=784))
    with pytest.raises(SpecError):
        parse_kernel_name("cvt_attention_bwd_sm89_bf16_blhd_wgmma_k128_q64_d64_a8")  # sm_90a only
    with pytest.raises(SpecError):
        parse_kernel_name("cvt_attention_bwd_sm90a_bf16_blhd_wgmma_k128_q128_d64_a8")  # 64 queries a block
    with pytest.raises(SpecError):
        parse_kernel_name("cvt_attention_bwd_sm90a_bf16_blhd_wgmma_k64_q64_d64_a8")  # 128 keys a CTA


def test_selector_never_hands_long_keys_to_the_short_key_kernels(monkeypatch):
    """A table row naming a short-key kernel (measured for other lengths) is not taken for a
    problem with more than 64 keys or a head dim above 64: the heuristic serves it instead."""
    import cvt_cutlass.operators.attention.select as sel
    from cvt_cutlass.operators import selection

    for spec in (AttnShortSpec("bf16"), AttnShortBwdSpec("bf16")):
        monkeypatch.setattr(sel, "lookup_spec", lambda *a, spec=spec, **k: spec)
        selection.clear()  # the selectors memoise their answers
        pass_ = spec.pass_
        assert select_attention(2, 6, 197, 50, 64, "bf16", 89, None, pass_) == selection.Choice(spec, "table")
        for lkv, d in ((65, 64), (50, 72)):
            choice = select_attention(2, 6, 197, lkv, d, "bf16", 89, None, pass_)
            assert choice.source == "heuristic" and choice.spec.kernel != "skv", (lkv, d, choice)
    selection.clear()


# The only differences between our copy of example 88's backward mainloop and CUTLASS's file, as its
# header comment documents them: (CUTLASS's line, ours).
EX88_MAINLOOP_CHANGES = (
    ("        acc_DS(i) = acc_P(i) * params.scale_softmax * (acc_DP(i) - reg_ODO(i));",
     "        acc_DS(i) = Element(acc_P(i) * params.scale_softmax * (acc_DP(i) - reg_ODO(i)));"),
    ('#include "../collective/fmha_common.hpp"', '#include "collective/fmha_common.hpp"'),
    ('#include "../collective/fmha_collective_load.hpp"', '#include "collective/fmha_collective_load.hpp"'),
    ('#include "../collective/fmha_collective_softmax.hpp"', '#include "collective/fmha_collective_softmax.hpp"'),
    ('#include "../kernel/fmha_options.hpp"', '#include "kernel/fmha_options.hpp"'),
)


def test_ex88_bwd_mainloop_copy_differs_from_cutlass_only_as_documented():
    """operators/attention/ex88/ holds CUTLASS's example-88 backward mainloop with the bf16 fix and
    the includes made relative to the example directory: below our header comment, the file is the
    installed CUTLASS's line for line except those lines (a CUTLASS upgrade that changes the
    mainloop fails here: then the copy must be taken again and the fix re-applied)."""
    import difflib
    from pathlib import Path

    import cutlass_library

    from cvt_cutlass.build import OPERATORS

    theirs = (Path(cutlass_library.source_path) / EX88_DIR / EX88_BWD_MAINLOOP).read_text().split("\n")
    copy = (OPERATORS / EX88_BWD_MAINLOOP_COPY).read_text()
    comment, license_start, body = copy.partition("/*****")
    ours = (license_start + body).split("\n")
    assert all(ln.startswith("//") or not ln for ln in comment.split("\n"))  # our header: a comment only
    fix_old, fix_new = (line.strip() for line in EX88_MAINLOOP_CHANGES[0])  # documented in the header
    assert fix_old in comment and fix_new in comment
    assert '"../collective/..." and "../kernel/..." became "collective/..." and' in comment
    diff = "\n".join(difflib.unified_diff(theirs, ours, "cutlass", "ours", lineterm="", n=0))
    assert len(ours) == len(theirs), diff
    changed = tuple((a, b) for a, b in zip(theirs, ours, strict=True) if a != b)
    assert sorted(changed) == sorted(EX88_MAINLOOP_CHANGES), diff
    # the Hopper backward includes the copy, and nothing else includes the example's own file
    src = Attn88BwdSpec("bf16").instantiation()
    header = (OPERATORS / "attention" / "ex88_bwd.cuh").read_text()
    assert '#include "attention/ex88_bwd.cuh"' in src and "AttentionEx88Bwd<cutlass::bfloat16_t, 64, 128, 64>" in src
    assert f'#include "{EX88_BWD_MAINLOOP_COPY}"' in header and EX88_BWD_MAINLOOP not in header
    assert "params.mainloop.scale_softmax = a.scale;" in header


def test_attention_headers_hold_the_kernels():
    """No kernel code in the specs: each instantiation includes its family header; the backward
    headers share bwd_common.cuh (the rowsum(dout * o) pass, the dq conversion, the stride checks),
    the short-key kernels short_common.cuh (tiles, loads, MMAs); example 41's kernels find the
    cuRAND stand-in in operators/attention/shim."""
    from cvt_cutlass.operators.attention import Attn88Spec

    from cvt_cutlass.build import OPERATORS, project_headers

    specs = {"ex41_fwd": AttnSpec("fp16"), "ex88_fwd": Attn88Spec("fp16"), "ex41_bwd": AttnBwdSpec("bf16"),
             "ex88_bwd": Attn88BwdSpec("bf16"), "short_fwd": AttnShortSpec("bf16"),
             "short_bwd": AttnShortBwdSpec("bf16"), "wgmma_bwd": AttnWgmmaBwdSpec("fp16")}
    common = OPERATORS / "attention" / "bwd_common.cuh"
    for header, spec in specs.items():
        src = spec.instantiation()
        assert no_kernel_body(src) and f'#include "attention/{header}.cuh"' in src
        deps = project_headers(src, tuple(spec.include_dirs))
        assert (OPERATORS / "attention" / f"{header}.cuh") in deps
        assert (common in deps) == header.endswith("bwd")
        assert (OPERATORS / "attention" / "shim" / "curand_kernel.h" in deps) == header.startswith("ex41")
        assert (OPERATORS / "attention" / "short_common.cuh" in deps) == header.startswith("short")
    assert "delta_kernel" in common.read_text() and "dq_convert_kernel" in common.read_text()


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("target", ["sm_89", "sm_90a"])
def test_real_compiles_of_the_short_key_forward(target):
    """nvcc builds the short-key forward for both paths, without spills."""
    from .test_build import build_and_check

    build_and_check([AttnShortSpec("bf16")], target, lambda s: 4, "attn")


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("target", ["sm_89", "sm_90a"])
def test_real_compiles_of_the_attention_backward(target):
    """nvcc builds example 41's backward and the short-key backward (both paths) and, for sm_90a,
    example 88's bf16 backward and our wgmma one (example 88's kernel spills 32 bytes in one
    function with nvcc 13.0: allowed, no more; the short-key kernel none at 2 CTAs per SM, a few
    at 3; the wgmma kernel none, and no wgmma serialised)."""
    from .test_build import build_and_check

    specs = [AttnBwdSpec("bf16"), AttnShortBwdSpec("fp16"), AttnShortBwdSpec("bf16", 3)] + (
        [Attn88BwdSpec("bf16"), AttnWgmmaBwdSpec("fp16")] if target == "sm_90a" else [])
    build_and_check(specs, target, lambda s: 8, "attnbwd", _bwd_spill_budget)


@requires_nvcc
@pytest.mark.nvcc
def test_wgmma_backward_offsets_match_cute(tmp_path):
    """The wgmma backward computes its shared-memory offsets (the swizzled q / k / v / dout tiles
    and dS^T) and its accumulators' fragment coordinates by hand; a host program built with nvcc
    compares every one with CuTe's layouts and partitions (which its wgmma descriptors come from)."""
    import subprocess
    from pathlib import Path

    from cvt_cutlass import build
    from cvt_cutlass.build import OPERATORS

    src = Path(__file__).parent / "cuda" / "wgmma_bwd_layouts.cu"
    exe = tmp_path / "layouts"
    includes = [f"-I{d}" for d in (OPERATORS, *build.cutlass_include_dirs())]
    subprocess.run([str(build.find_nvcc()), "-std=c++17", "--expt-relaxed-constexpr", "-arch=sm_90a", *includes,
                    "-o", str(exe), str(src)], check=True, capture_output=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "mismatches 0", out.stdout + out.stderr


def _bwd_spill_budget(spec) -> int:
    """Spill stores allowed with nvcc 13.0: example 88's kernel 32 bytes in one function, the
    short-key backward budgeted for 3 CTAs an SM (168 registers) 168 bytes; none elsewhere."""
    if isinstance(spec, Attn88BwdSpec):
        return 32
    return 168 if isinstance(spec, AttnShortBwdSpec) and spec.blocks == 3 else 0


def test_attention_backward_cpu_with_lse_gradient(counted_fallbacks):
    """CPU: the C++ autograd formula calls attention_backward (its fallback here, counted); a
    loss that uses lse too gets the gradient of both outputs."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 9, 3, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, lse = attention(q, k, v, 0.3)
    (out.square().sum() + (lse * torch.arange(9.0, dtype=torch.float64)).sum()).backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out2, lse2 = attention_reference(q2, k2, v2, 0.3)
    (out2.square().sum() + (lse2 * torch.arange(9.0, dtype=torch.float64)).sum()).backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad)
    assert counted_fallbacks.stats()["fallbacks"].get("attention_backward:device", 0) == 1


def test_attention_backward_argument_errors():
    q, k = torch.randn(1, 8, 2, 16), torch.randn(1, 5, 2, 16)
    out, lse = attention(q, k, k, 0.2)
    with pytest.raises(ValueError, match="grad and out"):
        attention_backward(torch.randn(1, 7, 2, 16), q, k, k, out, lse, 0.2)
    with pytest.raises(ValueError, match="lse must be float32"):
        attention_backward(out, q, k, k, out, lse.double(), 0.2)
    with pytest.raises(ValueError, match="scale"):
        attention_backward(out, q, k, k, out, lse, 0.0)


def test_attention_opcheck_cpu():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 7, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    torch.library.opcheck(torch.ops.cvt_cutlass.attention.default, (q, k, v, 0.4))
    out, lse = attention(q.detach(), k.detach(), v.detach(), 0.4)
    torch.library.opcheck(torch.ops.cvt_cutlass.attention_backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, 0.4, None))


# Gradient tolerance per dtype: ours may exceed torch's own error (HF's math at the same precision,
# against float64) by at most 2x plus this floor (relative Frobenius error of dq, dk, dv).
GRAD_TOL = {"fp16": 2e-3, "bf16": 1.5e-2}


def _rel(a, ref):
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _check_grads_against_float64(q, k, v, scale, grads, dout, dtype, glse=None):
    """grads (dq, dk, dv) from a kernel against float64, next to torch's own error at q's dtype."""
    leaves64 = [t.detach().double() for t in (q, k, v)]
    ref = attention_backward_reference(dout.double(), *leaves64, scale, None if glse is None else glse.double())
    same = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if glse is None:  # the peer: PyTorch's SDPA (cuDNN / flash) at the same precision
        o_same = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in same), scale=scale)
        torch_grads = torch.autograd.grad(o_same, same, dout.transpose(1, 2))
    else:  # SDPA has no lse output: HF's math with an fp32 softmax
        o_same, l_same = attention_reference(*same, scale)
        torch_grads = torch.autograd.grad((o_same, l_same), same, (dout, glse))
    for name, ours, theirs, r in zip("qkv", grads, torch_grads, ref, strict=True):
        assert not torch.isnan(ours).any(), name
        err, err_torch = _rel(ours, r), _rel(theirs, r)
        assert err <= 2 * err_torch + GRAD_TOL[dtype], (f"d{name}", err, err_torch)


def _bwd_cases():
    cases = []
    for model, size in (("cvt-13", 224), ("cvt-21", 224), ("cvt-w24", 384), ("cvt-13", (231, 217))):
        for a in attention_problems(model, 2, size):
            cases.append(pytest.param(a.n, a.heads, a.lq, a.lkv, a.head_dim, a.scale,
                                      id=f"{model}-{size}-{a.label}"))
    for lq, lkv in ODD_LENGTHS:
        cases.append(pytest.param(3, 6, lq, lkv, 64, 0.05, id=f"odd-{lq}x{lkv}"))
    cases.append(pytest.param(2, 4, 100, 37, 48, 0.1, id="d48"))
    return cases


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("b,h,lq,lkv,d,scale", _bwd_cases())
def test_attention_backward_matches_float64_gpu(b, h, lq, lkv, d, scale, dtype, path, strict_fallbacks):
    g = torch.Generator(device="cuda").manual_seed(lq + 7 * h)
    q, k, v = _inputs(b, lq, lkv, h, d, DTYPES[dtype], g, packed_kv=h % 2 == 1)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with runtime.kernel_path(path):
        out, lse = attention(*leaves, scale)
        dout = torch.randn(out.shape, device="cuda", generator=g).to(out.dtype)
        grads = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    _check_grads_against_float64(q, k, v, scale, grads, dout, dtype)


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
def test_attention_backward_with_lse_gradient_gpu(path, strict_fallbacks):
    g = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = _inputs(2, 197, 50, 6, 64, torch.bfloat16, g)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with runtime.kernel_path(path):
        out, lse = attention(*leaves, 0.05)
        dout = torch.randn(out.shape, device="cuda", generator=g).to(out.dtype)
        glse = torch.randn(lse.shape, device="cuda", generator=g)
        grads = torch.autograd.grad((out, lse), leaves, (dout, glse))
    _check_grads_against_float64(q, k, v, 0.05, grads, dout, "bf16", glse)


# (batch, heads, Lq, Lkv, head dim): CvT-13's stage 3, head dims 48, 32, 40 and 8 (the last two end
# inside a 16-wide MMA step), exactly 64 keys with Lq a multiple of the 64-row blocks, one query and one key.
SHORT_BWD_CASES = ((2, 6, 197, 50, 64), (2, 4, 100, 37, 48), (3, 2, 128, 64, 64), (2, 3, 1, 1, 64), (1, 2, 65, 63, 32),
                   (2, 3, 70, 20, 40), (1, 2, 17, 9, 8))


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_short_key_backward_gpu(dtype, path, strict_fallbacks):
    """The short-key backward through the op (at these batches no table row applies: the heuristic
    picks it for Lkv <= 64) against float64 with lse's gradient too, packed k / v views; a second
    run gives the same bits (no sums across CTAs)."""
    for b, h, lq, lkv, d in SHORT_BWD_CASES:
        g = torch.Generator(device="cuda").manual_seed(lq + lkv)
        q, k, v = _inputs(b, lq, lkv, h, d, DTYPES[dtype], g, packed_kv=lkv % 2 == 0)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with runtime.kernel_path(path):
            arch = runtime.arch_for(CUDA_CC)
            assert isinstance(select_attention(b, h, lq, lkv, d, dtype, arch, None, "bwd").spec, AttnShortBwdSpec)
            out, lse = attention(*leaves, 0.07)
            dout = torch.randn(out.shape, device="cuda", generator=g).to(out.dtype)
            glse = torch.randn(lse.shape, device="cuda", generator=g)
            grads = torch.autograd.grad((out, lse), leaves, (dout, glse))
            again = attention_backward(dout, *(t.detach() for t in (q, k, v)), out.detach(), lse.detach(), 0.07,
                                       glse)
        _check_grads_against_float64(q, k, v, 0.07, grads, dout, dtype, glse)
        for a, r in zip(grads, again, strict=True):
            assert torch.equal(a, r), (b, h, lq, lkv, d)


BWD_KERNEL_SHAPES = ((2, 3, 784, 196, 192 ** -0.5), (3, 6, 197, 50, 384 ** -0.5), (1, 1, 3136, 784, 0.125),
                     (2, 16, 577, 145, 1024 ** -0.5), (2, 2, 1, 7, 0.2), (2, 3, 130, 64, 0.1))


def _bwd_kernel_specs(cc: int) -> list:
    return [s for dt in DTYPES for s in attn_bwd_candidates(dt, 64, 90 if cc == 90 else 89)]


@requires_sm80
def test_attention_backward_kernels_match_float64_gpu():
    """Every backward candidate, run by name on CvT's shapes and odd ones; outputs written only
    where they belong (the rows after dk are untouched)."""
    failed = []
    for spec in _bwd_kernel_specs(CUDA_CC):
        kid = runtime.load_kernel(spec, CUDA_CC)
        g = torch.Generator(device="cuda").manual_seed(13)
        for b, h, lq, lkv, scale in BWD_KERNEL_SHAPES:
            if isinstance(spec, AttnShortBwdSpec) and not spec.serves(64, lkv):
                continue
            q, k, v = _inputs(b, lq, lkv, h, 64, DTYPES[spec.dtype], g)
            out, lse = attention_reference(q, k, v, scale)
            lse_p = _padded_lse(lse, b, h, lq)
            dout = torch.randn(out.shape, device="cuda", generator=g).to(out.dtype)
            dq, dv = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
            n = k.numel()
            buf = torch.full((n + 128 * h * 64,), 7.0, device="cuda", dtype=q.dtype)
            dk = buf[:n].view(k.shape)
            torch.ops.cvt_cutlass_C.attention_backward(kid, dout, q, k, v, out, lse_p, dq, dk, dv, scale)
            torch.cuda.synchronize()
            try:
                _check_grads_against_float64(q, k, v, scale, (dq, dk, dv), dout, spec.dtype)
                assert bool((buf[n:] == 7.0).all()), "wrote past the last key row"
            except AssertionError as e:
                failed.append(f"{spec.name} b={b} h={h} lq={lq} lkv={lkv}: {str(e).splitlines()[0]}")
    assert not failed, "\n".join(failed)


def _padded_lse(lse, b, h, lq):
    """lse as the kernels read it: (B, H, Lq) rows lse_padded_len(Lq) floats apart, NaN padding
    (kernels must not read it)."""
    lp = lse_padded_len(lq)
    lse_p = torch.full((b * h * lp,), float("nan"), device="cuda").as_strided((b, h, lq), (h * lp, lp, 1))
    return lse_p.copy_(lse)


@requires_sm80
def test_deterministic_backward_kernels_rerun_bitwise_gpu():
    """Under torch.use_deterministic_algorithms(True) every backward candidate whose spec says it
    sums dq in order (our wgmma kernel by turn counters over 7 key blocks at Lkv 784, on one wave of
    CTAs and on several, example 41 with one key split, the short-key kernel) gives the same bits
    in three runs, and matches float64."""
    raw, failed = torch.ops.cvt_cutlass_C.attention_backward, []
    for spec in (s for s in _bwd_kernel_specs(CUDA_CC) if s.DETERMINISTIC):
        kid = runtime.load_kernel(spec, CUDA_CC)
        g = torch.Generator(device="cuda").manual_seed(17)
        for b, h, lq, lkv in ((2, 1, 3136, 784), (24, 1, 3136, 784), (3, 3, 197, 196), (2, 6, 197, 50)):
            if isinstance(spec, AttnShortBwdSpec) and not spec.serves(64, lkv):
                continue
            q, k, v = _inputs(b, lq, lkv, h, 64, DTYPES[spec.dtype], g)
            out, lse = attention_reference(q, k, v, 0.125)
            lse_p, dout = _padded_lse(lse, b, h, lq), torch.randn(out.shape, device="cuda", generator=g).to(out.dtype)
            runs, was = [], torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(True)
            try:
                for _ in range(3):
                    runs.append(tuple(torch.full_like(t, float("nan")) for t in (q, k, v)))
                    raw(kid, dout, q, k, v, out, lse_p, *runs[-1], 0.125)
                torch.cuda.synchronize()
            finally:
                torch.use_deterministic_algorithms(was)
            try:
                assert all(torch.equal(x, y) for r in runs[1:] for x, y in zip(runs[0], r, strict=True)), \
                    "a rerun gave other bits"
                _check_grads_against_float64(q, k, v, 0.125, runs[0], dout, spec.dtype)
            except AssertionError as e:
                failed.append(f"{spec.name} b={b} h={h} lq={lq} lkv={lkv}: {str(e).splitlines()[0]}")
    assert not failed, "\n".join(failed)


@requires_sm80
def test_attention_backward_raw_launch_checks_its_arguments_gpu():
    spec = _bwd_kernel_specs(CUDA_CC)[-1]
    kid = runtime.load_kernel(spec, CUDA_CC)
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = _inputs(2, 33, 9, 2, 64, DTYPES[spec.dtype], g)
    out, lse = attention(q, k, v, 0.1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    raw = torch.ops.cvt_cutlass_C.attention_backward
    with pytest.raises(RuntimeError, match="do not match"):
        raw(kid, out, q, k, v, out, lse, dq, dk[:, :5], dv, 0.1)
    with pytest.raises(RuntimeError, match="lse must be"):
        raw(kid, out, q, k, v, out, lse.contiguous().double(), dq, dk, dv, 0.1)
    with pytest.raises(RuntimeError, match="share"):
        raw(kid, out, q, k, v, out, lse, dq.float(), dk, dv, 0.1)
    fwd = runtime.load_kernel(attention_spec(2, 2, 33, 9, 64, spec.dtype, default_arch(CUDA_CC), None), CUDA_CC)
    with pytest.raises(RuntimeError, match="not an attention backward"):
        raw(fwd, out, q, k, v, out, lse, dq, dk, dv, 0.1)


@requires_sm80
def test_attention_backward_opcheck_and_graph_gpu(strict_fallbacks):
    g = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = _inputs(2, 197, 50, 6, 64, torch.bfloat16, g)
    out, lse = attention(q, k, v, 0.05)
    dout = torch.randn(out.shape, device="cuda", generator=g).to(out.dtype)
    args = (dout, q, k, v, out, lse, 0.05, None)
    torch.library.opcheck(torch.ops.cvt_cutlass.attention_backward.default, args)
    # lse in another layout (a traced graph's contiguous copy): repacked once, still on the kernels
    for a, b in zip(attention_backward(*args[:5], lse.contiguous(), 0.05), attention_backward(*args), strict=True):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    eager = attention_backward(*args)
    outs = graph_replayed(lambda: attention_backward(*args))
    for a, b in zip(outs, eager, strict=True):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)  # dq: fp32 atomics, order may differ


def _bwd_gpu_specs(cc: int, gpu: str | None) -> list:
    out = []
    for arch in path_archs(cc):
        for dt in DTYPES:
            out += [attention_bwd_spec(*c.values[:5], dt, arch, gpu) for c in _bwd_cases()]
            out += [attention_spec(*c.values[:5], dt, arch, gpu) for c in _bwd_cases()]
        out.append(attention_spec(2, 6, 197, 50, 64, "bf16", arch, gpu))
        out.append(attention_bwd_spec(2, 6, 197, 50, 64, "bf16", arch, gpu))
    out += _bwd_kernel_specs(cc)
    out.append(attention_spec(2, 2, 33, 9, 64, _bwd_kernel_specs(cc)[-1].dtype, default_arch(cc), gpu))
    for arch in path_archs(cc):
        out += [attention_spec(b, h, lq, lkv, d, dt, arch, gpu) for dt in DTYPES for b, h, lq, lkv, d in SHORT_BWD_CASES]
        out += [attention_bwd_spec(b, h, lq, lkv, d, dt, arch, gpu) for dt in DTYPES
                for b, h, lq, lkv, d in SHORT_BWD_CASES]
    return out
