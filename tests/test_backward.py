"""Backward kernels of the GEMM family and LayerNorm: linear_dgrad, linear_wgrad, mlp's fused
backward, layer_norm_tokens_backward, and the autograd formulas of linear / linear_gelu_aux /
mlp / layer_norm_tokens that call them.

CPU: names and emission, the nvcc builds (one kernel of each backward family for sm_89 and
sm_90a), the fallbacks' gradients against float64 autograd, errors, opcheck. GPU: every op's
gradients against a float64 reference on CvT's shapes and ragged ones, both kernel paths, fp16
and bf16, in strict mode (a fallback raises), with the error next to PyTorch's own at the same
precision (rows appended to $CVT_CUTLASS_GRAD_ERRORS when set: the closing notes' table).
"""

from __future__ import annotations

import csv
import math
import os

import pytest
import torch
import torch.nn.functional as F
from cvt_cutlass.epilogues import gelu_grad
from cvt_cutlass.operators.layernorm import LayerNormSpec, layernorm_heuristic, select_layernorm
from cvt_cutlass.operators.linear import (
    LinearSpec,
    LinearWgradSpec,
    select_linear,
    select_linear_backward,
    wgrad_heuristic,
)
from cvt_cutlass.operators.spec import SpecError, parse_kernel_name

from cvt_cutlass import build, fallback, runtime
from cvt_cutlass.emitter import kernel_source
from cvt_cutlass.ops.layernorm import layer_norm_tokens, layer_norm_tokens_backward
from cvt_cutlass.ops.linear import linear, linear_dgrad, linear_gelu_aux, linear_wgrad, mlp

from .conftest import CUDA_CC, DTYPES, PATHS, requires_nvcc, requires_sm80
from .gpu_kernels import KERNEL_DTYPES, gpu_paths, path_arch
from .test_build import build_and_check

# Relative (Frobenius) error allowed: at most 2x PyTorch's own at the same precision, plus a floor.
FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# (label, rows M, N, K) of y = x W^T with W (N, K): CvT-13's stage shapes at batch 2, and ragged.
LINEAR_CASES = [
    ("s1.qkv", 2 * 3136, 64, 64), ("s1.fc1", 2 * 3136, 256, 64), ("s1.fc2", 2 * 3136, 64, 256),
    ("s2.fc1", 2 * 784, 768, 192), ("s3.fc2", 2 * 197, 384, 1536),
    ("m1", 1, 64, 64), ("ragged", 1000, 72, 40), ("k8", 333, 16, 8),
]
# (label, rows, C, hidden) of the MLP.
MLP_CASES = [("s1", 2 * 3136, 64, 256), ("s3", 2 * 197, 384, 1536), ("ragged", 1000, 40, 72), ("m1", 1, 64, 256)]
# (label, B, L, C, prefix rows) of the LayerNorm.
LN_CASES = [("s1", 2, 3136, 64, 0), ("s3.cls", 2, 196, 384, 1), ("w24", 3, 7, 1024, 0), ("tiny", 1, 1, 8, 0)]


# ----------------------------------------------------------------------------- names, emission
def test_backward_names_round_trip():
    specs = [
        LinearSpec(90, "bf16", "dgelu_dbias", tile=(128, 128, 64), pass_="dgrad"),
        LinearSpec(89, "fp16", "none", tile=(128, 64, 32), warps=(2, 2, 1), stages=4, schedule="multistage",
                   pass_="dgrad"),
        wgrad_heuristic(64, 64, "bf16"), wgrad_heuristic(384, 1536, "fp16"),
        layernorm_heuristic("bf16", 384, 90, "bwd"), layernorm_heuristic("fp16", 64, 89, "bwd"),
        wgrad_heuristic(64, 64, "bf16").with_(waves=4),
        LinearWgradSpec(90, "fp16", (128, 192, 64), waves=0),
        LinearWgradSpec(90, "bf16", (128, 64, 64), waves=2, slabs=True),
        LinearWgradSpec(90, "bf16", (64, 128, 64), waves=1, slabs=True, cluster=(2, 1, 1), schedule="pingpong"),
    ]
    for s in specs:
        assert parse_kernel_name(s.name) == s
    assert specs[0].name.startswith("cvt_linear_dgrad_sm90a_bf16_tt_dgelu_dbias_")
    assert specs[2].name.startswith("cvt_linear_wgrad_sm89_bf16_nt_kred_")
    # The backward's 384-channel row: 32 threads of 3 8-byte vectors (fewer registers than 16 x 3 x 16 B).
    assert specs[4].name == "cvt_layernorm_bwd_sm90a_bf16_blc_c384_l32_b256_v4"
    assert specs[5].name == "cvt_layernorm_bwd_sm89_f16_blc_c64_l8_b256"
    assert specs[6].name == "cvt_linear_wgrad_sm89_bf16_nt_kred_t64x64x32_w2x2x1_s5_a8_k4"
    assert specs[7].name == "cvt_linear_wgrad_sm90a_f16_nt_rsum_t128x192x64_c1x1x1_sauto_coop_sk_a8_k0"
    assert specs[8].name == "cvt_linear_wgrad_sm90a_bf16_nt_rsum_t128x64x64_c1x1x1_sauto_coop_ps_a8_k2"
    assert specs[9].name == "cvt_linear_wgrad_sm90a_bf16_nt_rsum_t64x128x64_c2x1x1_sauto_pingpong_ps_a8_k1"


def test_backward_specs_refuse_what_they_cannot_build():
    with pytest.raises(SpecError, match="unknown epilogue .* for pass dgrad"):
        LinearSpec(90, "bf16", "bias_gelu", tile=(128, 128, 64), pass_="dgrad")
    with pytest.raises(SpecError, match="unknown epilogue .* for pass fwd"):
        LinearSpec(90, "bf16", "dgelu_dbias", tile=(128, 128, 64))
    with pytest.raises(SpecError, match="sm90 coop wgrad tile"):
        LinearWgradSpec(90, "bf16", (128, 128, 32))
    with pytest.raises(SpecError, match="no warps / stages"):
        LinearWgradSpec(90, "bf16", (128, 128, 64), stages=3)
    with pytest.raises(SpecError, match="stream-K heuristic"):
        LinearWgradSpec(90, "bf16", (128, 128, 64), waves=4)
    with pytest.raises(SpecError, match="arch"):
        LinearWgradSpec(80, "bf16", (128, 128, 32))
    with pytest.raises(SpecError, match="at most 1024"):
        layernorm_heuristic("bf16", 2048, 90, "bwd")
    with pytest.raises(SpecError, match="at most 4 vectors"):
        LayerNormSpec(90, "bf16", 2048, 32, 256, "bwd")
    with pytest.raises(SpecError, match="not a valid linear wgrad"):
        parse_kernel_name("cvt_linear_wgrad_sm89_bf16_nt_bias_t128x128x64_c1x1x1_sauto_coop_rh1_a8")
    with pytest.raises(SpecError, match="split waves"):
        LinearWgradSpec(89, "bf16", (128, 128, 32), waves=3)
    with pytest.raises(SpecError, match="sm90 \\(rsum\\) kernel's"):
        LinearWgradSpec(89, "bf16", (128, 128, 32), slabs=True)
    with pytest.raises(SpecError, match="parallel-slab wgrad waves must be 1 or 2"):
        LinearWgradSpec(90, "bf16", (128, 128, 64), waves=0, slabs=True)
    with pytest.raises(SpecError, match="sm90 coop wgrad tile"):
        LinearWgradSpec(90, "bf16", (64, 128, 64), waves=1, slabs=True)
    with pytest.raises(SpecError, match="sm90 pingpong wgrad tile"):
        LinearWgradSpec(90, "bf16", (256, 128, 64), waves=1, slabs=True, schedule="pingpong")
    with pytest.raises(SpecError, match="stream-K is cooperative-only"):
        LinearWgradSpec(90, "bf16", (128, 128, 64), waves=0, schedule="pingpong")
    with pytest.raises(SpecError, match="at most 4 CTAs"):
        LinearWgradSpec(90, "bf16", (128, 128, 64), waves=1, slabs=True, cluster=(4, 2, 1))
    with pytest.raises(SpecError, match="clusters and the ping-pong schedule"):
        LinearWgradSpec(89, "bf16", (128, 128, 32), cluster=(2, 1, 1))
    with pytest.raises(SpecError, match="vector width"):
        LayerNormSpec(90, "bf16", 384, 32, 256, "fwd", 4)
    with pytest.raises(SpecError, match="no LayerNorm backward kernel for 40"):
        layernorm_heuristic("bf16", 40, 90, "bwd")  # 5 vectors on one thread: the op falls back


@pytest.mark.parametrize("arch", [89, 90])
def test_dgelu_dbias_emits_the_erf_derivative_and_a_row_reduction(arch):
    kw = dict(tile=(128, 128, 64)) if arch == 90 else dict(tile=(128, 64, 32), warps=(2, 2, 1), stages=4,
                                                          schedule="multistage")
    src = kernel_source(LinearSpec(arch, "fp16", "dgelu_dbias", pass_="dgrad", **kw))
    sm = "sm90" if arch == 90 else "sm80"
    assert f'#include "linear/dgrad_{sm}.cuh"' in src and f"using Kernel = Dgrad{sm.capitalize()}<Config>;" in src
    assert "DGeluErf" in src and "Sigmoid" not in src and "kReducesBias = true" in src
    assert ("Sm90RowReduction" if arch == 90 else "VisitorRowReduction") in src
    # the dgrad template reads the (N, K) weight as a row-major B: no transposed copy
    assert "using LayoutB = cutlass::layout::RowMajor;" in src
    # the branch-free erf form (one exp shared with phi), not erff, in the header the dgrad includes
    dgelu = (build.OPERATORS / "linear" / "dgelu.cuh").read_text()
    assert "struct DGeluErf" in dgelu and "erff(" not in dgelu and "dgelu_exp" in dgelu
    assert build.OPERATORS / "linear" / "dgelu.cuh" in build.project_headers(src)
    no_db = kernel_source(LinearSpec(arch, "fp16", "dgelu", pass_="dgrad", **kw))
    assert "DGeluErf" in no_db and "RowReduction" not in no_db and "kReducesBias = false" in no_db
    plain = kernel_source(LinearSpec(arch, "fp16", "none", pass_="dgrad", **kw))
    assert "RowReduction" not in plain


@pytest.mark.parametrize("arch", [89, 90])
def test_saved_gelu_derivative_emits_a_mapped_store_and_a_plain_product(arch):
    """The training forward's fc1 stores gelu'(z) in fp16 through the mapped store node and computes
    GELU from the same parts; fc2's dgrad multiplies by the saved factor (an fp16 C) and reduces
    dbias, with no GELU math of its own."""
    kw = dict(tile=(128, 128, 64)) if arch == 90 else dict(tile=(128, 64, 32), warps=(2, 2, 1), stages=4,
                                                          schedule="multistage")
    sm = "Sm90" if arch == 90 else "Sm80"
    fwd = kernel_source(LinearSpec(arch, "bf16", "bias_gelu_dgelu", **kw))
    assert f"using G = {sm}MappedAuxStore<DGeluErf, " in fwd and "GeluErf, cutlass::bfloat16_t" in fwd
    assert "thread::GELU" not in fwd and '#include "linear/mapped_store.cuh"' in fwd
    assert "static_cast<cutlass::half_t*>(p.aux)" in fwd  # the derivative's store is fp16
    dgrad = kernel_source(LinearSpec(arch, "bf16", "dgelu_saved_dbias", pass_="dgrad", **kw))
    assert "DGeluErf" not in dgrad and "Sigmoid" not in dgrad and "kReducesBias = true" in dgrad
    assert ("using ElementC = cutlass::half_t;" if arch == 90 else "OutputTileThreadMap, cutlass::half_t, cute") in dgrad
    # bias_gelu_aux keeps CUTLASS's GELU and stores the pre-activation in the compute dtype
    aux = kernel_source(LinearSpec(arch, "bf16", "bias_gelu_aux", **kw))
    assert "MappedAuxStore" not in aux and "static_cast<cutlass::bfloat16_t*>(p.aux)" in aux


@requires_nvcc
@pytest.mark.nvcc
def test_gelu_functors_against_float64(tmp_path):
    """GeluErf and DGeluErf (linear/dgelu.cuh, host build: expf and an IEEE reciprocal where the
    device takes ex2.approx and rcp.approx) against nn.GELU's exact form in float64 over [-12, 12],
    written with erfc (torch's 1 + erf(z / sqrt(2)) is 0 past z = -8.3 in float64): GELU within
    2e-6 |z| + 1e-7, its derivative within 2e-6, and the left tail without cancellation (GELU's
    relative error below 2e-3 for -5 < z < -1; 1 + erff there keeps 1-4 digits); their Array forms
    (what the epilogues call) give the scalar forms' bits."""
    import subprocess

    prog = tmp_path / "gelu.cu"
    prog.write_text('#include <cstdio>\n#include "linear/dgelu.cuh"\nusing namespace cvt_kernel;\nint main() {\n'
                    '  for (int i = 0; i <= 24000; ++i) { const float z = -12.f + 0.001f * i;\n'
                    '    const float g = GeluErf<float>{}(z), d = DGeluErf<float>{}(z);\n'
                    '    cutlass::Array<float, 2> a; a[0] = z; a[1] = z;\n'
                    '    const auto ga = GeluErf<cutlass::Array<float, 2>>{}(a), da = DGeluErf<cutlass::Array<float, 2>>{}(a);\n'
                    '    const int same = ga[0] == g && ga[1] == g && da[0] == d && da[1] == d;\n'
                    '    std::printf("%.9e %.9e %.9e %d\\n", z, g, d, same); }\n}\n')
    exe = tmp_path / "gelu"
    inc = [f"-I{d}" for d in (str(build.OPERATORS), *build.cutlass_include_dirs())]
    subprocess.run([build.find_nvcc(), "-std=c++17", *inc, str(prog), "-o", str(exe)], check=True, capture_output=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    zf, y, d, same = torch.tensor([[float(v) for v in ln.split()] for ln in out], dtype=torch.float64).unbind(1)
    assert (same == 1).all(), "the Array (epilogue fragment) forms differ from the scalar ones"
    cdf = 0.5 * torch.special.erfc(-zf / math.sqrt(2))
    want_y, want_d = zf * cdf, cdf + zf * torch.exp(-0.5 * zf * zf) / math.sqrt(2 * math.pi)
    assert ((y - want_y).abs() <= 2e-6 * zf.abs() + 1e-7).all(), (y - want_y).abs().max()
    assert ((d - want_d).abs() <= 2e-6).all(), (d - want_d).abs().max()
    tail = (zf < -1) & (zf > -5)
    assert ((y[tail] - want_y[tail]).abs() <= 2e-3 * want_y[tail].abs()).all()


def test_saved_gelu_derivative_selects_the_tuned_tiles():
    """Without rows of their own the two epilogues take the tiles tuned for bias_gelu_aux and
    dgelu_dbias on the same problem (select.py's proxies), with their own epilogue."""
    for gpu in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        fwd = select_linear(128 * 3136, 256, 64, "bf16", "bias_gelu_dgelu", 90, gpu)
        aux = select_linear(128 * 3136, 256, 64, "bf16", "bias_gelu_aux", 90, gpu)
        assert fwd.spec == aux.spec.with_(epilogue="bias_gelu_dgelu") and fwd.source == aux.source
        new = select_linear_backward("dgrad", 128 * 197, 1536, 384, "bf16", "dgelu_saved_dbias", 90, gpu)
        old = select_linear_backward("dgrad", 128 * 197, 1536, 384, "bf16", "dgelu_dbias", 90, gpu)
        assert new.spec == old.spec.with_(epilogue="dgelu_saved_dbias") and new.source == old.source == "table"


def test_backward_selection_is_a_pure_function_of_the_problem():
    a = select_linear_backward("dgrad", 6272, 64, 256, "bf16", "dgelu_dbias", 90, "NVIDIA H200")
    assert a.spec.pass_ == "dgrad" and a.spec.epilogue == "dgelu_dbias" and a.spec.arch == 90
    w = select_linear_backward("wgrad", 6272, 64, 64, "bf16", "dbias", 90, "NVIDIA H200")
    assert w.spec.pass_ == "wgrad" and w.spec.arch == 89  # SM80-class on both paths
    assert select_layernorm(6272, 64, "fp16", 90, None, "bwd").spec.pass_ == "bwd"


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("target", ["sm_89", "sm_90a"])
def test_real_compiles_of_each_backward_family(target):
    """nvcc builds the dgrad GEMMs with the fused dGELU + dbias epilogues (GELU' computed, or saved by
    the forward that this builds too), the operand-reducing wgrad GEMM and the LayerNorm backward
    for sm_89 and sm_90a, without spills beyond the known ones."""
    arch = 90 if target == "sm_90a" else 89
    kw = dict(tile=(128, 128, 64)) if arch == 90 else dict(tile=(128, 64, 32), warps=(2, 2, 1), stages=4,
                                                          schedule="multistage")
    build_and_check([LinearSpec(arch, "bf16", "dgelu_dbias", pass_="dgrad", **kw),
                     LinearSpec(arch, "bf16", "dgelu_saved_dbias", pass_="dgrad", **kw),
                     LinearSpec(arch, "bf16", "bias_gelu_dgelu", **kw)], target, lambda s: 1, "gemm")
    build_and_check([wgrad_heuristic(64, 64, "bf16")], target, lambda s: 6, "wgrad")
    if arch == 90:  # the SM90 wgrads with their row-sum db pass: stream-K, the parallel slabs, and
        # ping-pong slabs whose 2 x 2 cluster shares operand panels by TMA multicast
        build_and_check([LinearWgradSpec(90, "bf16", (128, 128, 64), waves=0),
                         LinearWgradSpec(90, "bf16", (128, 64, 64), waves=1, slabs=True),
                         LinearWgradSpec(90, "bf16", (64, 192, 64), waves=1, slabs=True, cluster=(2, 2, 1),
                                         schedule="pingpong")], target, lambda s: 6, "wgrad")
    # the LayerNorm backward at CvT-13's and CvT-W24's widths, 16-bit and on the fp32 stream (its row
    # staging must fit the 48 KB of static shared memory: C = 1024 loads its rows instead). Known
    # spill: 8 bytes in the 16-bit 384-channel kernel on sm_90a (ptxas, nvcc 13.0; the staged kernel
    # measured 11% faster than the unstaged one at batch 128 on an H100, 2026-12-06).
    build_and_check([layernorm_heuristic("bf16", c, arch, "bwd").with_(io=io) for c in (64, 384, 1024)
                     for io in ("", "xf32")], target, lambda s: 7, "normbwd",
                    lambda s: 8 if (s.channels, s.io, s.arch) == (384, "", 90) else 0)


# ----------------------------------------------------------------------------- CPU: fallbacks, autograd
def _fell_back(fb, op: str) -> bool:
    return any(k.startswith(op + ":") for k in fb.stats()["fallbacks"])


def _rand(*shape, dtype=torch.float64, device="cpu", scale=1.0, seed=0):
    g = torch.Generator(device=device).manual_seed(seed + sum(shape))
    return (scale * torch.randn(*shape, generator=g, device=device)).to(dtype)


def _linear_leaves(m, n, k, dtype, device, residual=False):
    x = _rand(m, k, dtype=dtype, device=device)
    w = _rand(n, k, dtype=dtype, device=device, scale=1 / math.sqrt(k), seed=1)
    b = _rand(n, dtype=dtype, device=device, scale=0.5, seed=2)
    r = _rand(m, n, dtype=dtype, device=device, seed=3) if residual else None
    return [t.requires_grad_() for t in (x, w, b, r) if t is not None]


def test_linear_autograd_runs_the_backward_ops_cpu(counted_fallbacks):
    """CPU: the autograd formula calls linear_dgrad / linear_wgrad (their fallbacks here, counted)
    and matches torch autograd in float64, for every epilogue and for a partial request."""
    for act, res in (("none", False), ("none", True), ("gelu", False)):
        leaves = _linear_leaves(33, 24, 16, torch.float64, "cpu", res)
        x, w, b = leaves[:3]
        r = leaves[3] if res else None
        g = _rand(33, 24, seed=9)
        ours = torch.autograd.grad(linear(x, w, b, r, act), leaves, g)
        ref = F.linear(x, w, b)
        ref = F.gelu(ref) if act == "gelu" else ref
        ref = ref + r if res else ref
        theirs = torch.autograd.grad(ref, leaves, g)
        for a, t in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, t)
    assert _fell_back(counted_fallbacks, "linear_dgrad") and _fell_back(counted_fallbacks, "linear_wgrad")
    x, w, b = _linear_leaves(9, 8, 8, torch.float64, "cpu")
    w.requires_grad_(False)
    dx, db = torch.autograd.grad(linear(x, w, b), (x, b), torch.ones(9, 8, dtype=torch.float64))
    torch.testing.assert_close(db, torch.full((8,), 9.0, dtype=torch.float64))


def test_autograd_formulas_are_cpp_and_compile_cpu(counted_fallbacks):
    """linear / linear_gelu_aux / mlp / layer_norm_tokens record C++ autograd nodes (a training
    step through them runs no Python autograd), and torch.compile (aot_eager) traces forward and
    backward through them to the same gradients."""
    x, w, b = _linear_leaves(9, 8, 8, torch.float64, "cpu")
    leaves = _mlp_leaves(9, 8, 16, torch.float64, "cpu")
    ln = (torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True), torch.ones(8, dtype=torch.float64,
          requires_grad=True), torch.zeros(8, dtype=torch.float64, requires_grad=True))
    outs = {"LinearFn": linear(x, w, b), "GeluAuxFn": linear_gelu_aux(x, w, b)[0], "MlpFn": mlp(*leaves),
            "LayerNormFn": layer_norm_tokens(*ln, 1e-5)}
    for name, out in outs.items():
        assert name in out.grad_fn.name(), out.grad_fn.name()

    def step(*t):
        return (mlp(*t[:6]).square().sum() + layer_norm_tokens(t[6], t[7], t[8], 1e-5).sum())

    args = (*leaves, *ln)
    want = torch.autograd.grad(step(*args), args)
    got = torch.autograd.grad(torch.compile(step, backend="aot_eager", fullgraph=True)(*args), args)
    for a, t in zip(got, want, strict=True):
        torch.testing.assert_close(a, t)


def _mlp_reference(x, w1, b1, w2, b2, r):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2) + r


def _mlp_leaves(m, c, h, dtype, device):
    x = _rand(m, c, dtype=dtype, device=device)
    w1 = _rand(h, c, dtype=dtype, device=device, scale=1 / math.sqrt(c), seed=1)
    b1 = _rand(h, dtype=dtype, device=device, scale=0.5, seed=2)
    w2 = _rand(c, h, dtype=dtype, device=device, scale=1 / math.sqrt(h), seed=3)
    b2 = _rand(c, dtype=dtype, device=device, scale=0.5, seed=4)
    r = _rand(m, c, dtype=dtype, device=device, seed=5)
    return [t.requires_grad_() for t in (x, w1, b1, w2, b2, r)]


def test_mlp_forward_and_fused_backward_cpu(counted_fallbacks):
    leaves = _mlp_leaves(17, 16, 40, torch.float64, "cpu")
    g = _rand(17, 16, seed=7)
    out = mlp(*leaves)
    ref = _mlp_reference(*leaves)
    torch.testing.assert_close(out, ref)
    for a, t in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, leaves, g), strict=True):
        torch.testing.assert_close(a, t)
    assert _fell_back(counted_fallbacks, "mlp") and _fell_back(counted_fallbacks, "linear_dgrad")


def test_dgrad_with_gelu_input_matches_the_erf_derivative_cpu(counted_fallbacks):
    g, w, z = _rand(12, 16), _rand(16, 24, seed=1), _rand(12, 24, seed=2).requires_grad_()
    dx, db = linear_dgrad(g, w, z.detach())
    want = torch.autograd.grad(F.gelu(z), z, g @ w)[0]
    torch.testing.assert_close(dx, want)
    torch.testing.assert_close(db, want.sum(0))


def test_dgrad_with_the_saved_gelu_derivative_cpu(counted_fallbacks):
    """gelu_grad: the factor fc1's forward saved (linear_gelu_dgelu's second output) multiplies the
    product; db its column sums; the same as GELU's autograd at z."""
    g, w, z = _rand(12, 16), _rand(16, 24, seed=1), _rand(12, 24, seed=2).requires_grad_()
    dgelu = torch.ops.cvt_cutlass_C.linear_gelu_dgelu(_rand(12, 8, seed=3), _rand(24, 8, seed=4), _rand(24, seed=5))[1]
    assert dgelu.dtype == torch.float64  # 16-bit compute saves it in fp16 (dgelu_dtype)
    dx, db = linear_dgrad(g, w, gelu_grad=gelu_grad(z.detach()))
    want = torch.autograd.grad(F.gelu(z), z, g @ w)[0]
    torch.testing.assert_close(dx, want)
    torch.testing.assert_close(db, want.sum(0))
    with pytest.raises(ValueError, match="gelu_input or gelu_grad, not both"):
        linear_dgrad(g, w, z.detach(), z.detach())
    with pytest.raises(TypeError):
        linear_dgrad(g.half(), w.half(), gelu_grad=z.detach().bfloat16())  # the fp16 factor of 16-bit grads


def test_layer_norm_backward_with_cls_prefix_cpu(counted_fallbacks):
    x = _rand(2, 5, 16).requires_grad_()
    w, b = (_rand(16, seed=1) + 2).requires_grad_(), _rand(16, seed=2).requires_grad_()
    cls = _rand(1, 16, seed=3).requires_grad_()
    g = _rand(2, 6, 16, seed=4)
    ours = torch.autograd.grad(layer_norm_tokens(x, w, b, 1e-5, cls), (x, w, b, cls), g)
    ref = torch.cat([cls.expand(2, 1, 16), F.layer_norm(x, (16,), w, b, 1e-5)], 1)
    for a, t in zip(ours, torch.autograd.grad(ref, (x, w, b, cls), g), strict=True):
        torch.testing.assert_close(a, t)
    assert _fell_back(counted_fallbacks, "layer_norm_tokens_backward")


def test_layer_norm_backward_adds_the_residual_gradient_cpu(counted_fallbacks):
    """residual_grad is added to dx (a residual branch's gradient of x); dweight / dbias unchanged."""
    x, g, r = _rand(2, 5, 16), _rand(2, 5, 16, seed=1), _rand(2, 5, 16, seed=2)
    w = _rand(16, seed=3) + 2
    dx, dw, db = layer_norm_tokens_backward(g, x, w, 1e-5)
    dx2, dw2, db2 = layer_norm_tokens_backward(g, x, w, 1e-5, r)
    torch.testing.assert_close(dx2, dx + r, rtol=1e-15, atol=1e-15)
    assert torch.equal(dw2, dw) and torch.equal(db2, db)
    with pytest.raises(ValueError, match="residual_grad must be shaped like x"):
        layer_norm_tokens_backward(g, x, w, 1e-5, r[:, :4])
    with pytest.raises(TypeError, match="residual_grad is torch.float32"):
        layer_norm_tokens_backward(g, x, w, 1e-5, r.float())


def test_layer_norm_backward_sums_further_output_gradients_cpu(counted_fallbacks):
    """more_grads (the output feeds several ops) are summed with grad: the same as one summed
    gradient; more than two, a wrong shape or dtype raise."""
    x, g, g2, g3 = (_rand(2, 5, 16, seed=s) for s in range(4))
    w = _rand(16, seed=5) + 2
    ref = layer_norm_tokens_backward(g + g2 + g3, x, w, 1e-5)
    for a, t in zip(layer_norm_tokens_backward(g, x, w, 1e-5, None, (g2, g3)), ref, strict=True):
        torch.testing.assert_close(a, t, rtol=1e-13, atol=1e-13)
    one = layer_norm_tokens_backward(g + g2, x, w, 1e-5)
    for a, t in zip(layer_norm_tokens_backward(g, x, w, 1e-5, None, (g2,)), one, strict=True):
        torch.testing.assert_close(a, t, rtol=1e-13, atol=1e-13)
    with pytest.raises(ValueError, match="at most 2"):
        layer_norm_tokens_backward(g, x, w, 1e-5, None, (g2, g3, g3))
    with pytest.raises(ValueError, match="grad2 / grad3 must be shaped like x"):
        layer_norm_tokens_backward(g, x, w, 1e-5, None, (g2[:, :4],))
    with pytest.raises(TypeError, match="grad3 is torch.float32"):
        layer_norm_tokens_backward(g, x, w, 1e-5, None, (g2, g3.float()))


def test_expanded_grad_from_sum_is_served_cpu(counted_fallbacks):
    """autograd hands .sum()'s gradient out expanded (stride 0): copied once, never wrong."""
    x, w, b = _linear_leaves(10, 8, 8, torch.float64, "cpu")
    dx, dw, db = torch.autograd.grad(linear(x, w, b).sum(), (x, w, b))
    torch.testing.assert_close(dx, w.sum(0).expand(10, 8))
    torch.testing.assert_close(dw, x.sum(0).expand(8, 8))
    torch.testing.assert_close(db, torch.full((8,), 10.0, dtype=torch.float64))


def test_backward_ops_raise_on_bad_input():
    g, w = torch.randn(4, 8), torch.randn(8, 16)
    with pytest.raises(ValueError, match="do not match"):
        linear_dgrad(g, w.t())
    with pytest.raises(ValueError, match="gelu_input"):
        linear_dgrad(g, w, torch.randn(4, 8))
    with pytest.raises(TypeError, match="floating-point"):
        linear_dgrad(g.int(), w)
    with pytest.raises(ValueError, match="leading"):
        linear_wgrad(g, torch.randn(5, 16), True)
    with pytest.raises(TypeError, match="but grad is"):
        linear_wgrad(g, torch.randn(4, 16, dtype=torch.float64), False)
    with pytest.raises(ValueError, match="weight"):
        layer_norm_tokens_backward(torch.randn(1, 2, 8), torch.randn(1, 2, 8), torch.randn(4), 1e-5)
    with pytest.raises(ValueError, match="eps"):
        layer_norm_tokens_backward(torch.randn(1, 2, 8), torch.randn(1, 2, 8), torch.randn(8), 0.0)
    with pytest.raises(ValueError, match="w2"):
        mlp(torch.randn(2, 8), torch.randn(16, 8), torch.randn(16), torch.randn(8, 8), torch.randn(8))


def test_opcheck_backward_ops_cpu(counted_fallbacks):
    g, w, z, x = torch.randn(6, 8), torch.randn(8, 16), torch.randn(6, 16), torch.randn(6, 16)
    torch.library.opcheck(torch.ops.cvt_cutlass.linear_dgrad.default, (g, w, z))
    torch.library.opcheck(torch.ops.cvt_cutlass.linear_wgrad.default, (g, x, True))
    t = torch.randn(2, 3, 8)
    torch.library.opcheck(torch.ops.cvt_cutlass.layer_norm_tokens_backward.default, (t, t + 1, torch.randn(8), 1e-5))
    torch.library.opcheck(torch.ops.cvt_cutlass.layer_norm_tokens_backward.default,
                          (t, t + 1, torch.randn(8), 1e-5, torch.randn(2, 3, 8)))
    leaves = _mlp_leaves(5, 8, 16, torch.float32, "cpu")
    torch.library.opcheck(torch.ops.cvt_cutlass.mlp.default, tuple(leaves))


# ----------------------------------------------------------------------------- GPU
def _record(op, label, dtype, path, name, err, err_torch):
    out = os.environ.get("CVT_CUTLASS_GRAD_ERRORS")
    if not out:
        return
    new = not os.path.exists(out)
    with open(out, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["op", "case", "dtype", "path", "grad", "rel_err", "torch_rel_err"])
        w.writerow([op, label, str(dtype).replace("torch.", ""), path, name, f"{err:.3e}", f"{err_torch:.3e}"])


def _check_grads(op, label, path, ours, torch_same, ref, names):
    for name, a, t, r in zip(names, ours, torch_same, ref, strict=True):
        assert a is not None and not torch.isnan(a).any(), f"{label} {name}: NaN or missing"
        rn = r.norm().clamp_min(1e-30)
        err = float((a.double() - r).norm() / rn)
        err_t = float((t.double() - r).norm() / rn)
        _record(op, label, a.dtype, path, name, err, err_t)
        assert err <= 2 * err_t + FLOOR[a.dtype], f"{label} {name}: error {err:.2e} vs torch {err_t:.2e}"


def _grads(fn, leaves, g):
    return torch.autograd.grad(fn(*leaves), leaves, g)


def _three_ways(fn, ref_fn, leaves, g):
    """(ours, torch in the same dtype, float64 reference) gradients."""
    lo = [t.detach().clone().requires_grad_() for t in leaves]
    hi = [t.detach().double().requires_grad_() for t in leaves]
    return _grads(fn, leaves, g), _grads(ref_fn, lo, g), _grads(ref_fn, hi, g.double())


def _linear_ref(x, w, b, r):
    return F.linear(x, w, b) + r


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("label,m,n,k", LINEAR_CASES)
def test_linear_gradients_gpu(strict_fallbacks, path, dtype, label, m, n, k):
    leaves = _linear_leaves(m, n, k, DTYPES[dtype], "cuda", residual=True)
    g = _rand(m, n, dtype=DTYPES[dtype], device="cuda", seed=11)
    with runtime.kernel_path(path):
        ours, same, ref = _three_ways(lambda *a: linear(*a), _linear_ref, leaves, g)
    _check_grads("linear", label, path, ours, same, ref, ["dx", "dW", "db", "dresidual"])


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("label,m,c,h", MLP_CASES)
def test_mlp_gradients_gpu(strict_fallbacks, path, dtype, label, m, c, h):
    leaves = _mlp_leaves(m, c, h, DTYPES[dtype], "cuda")
    g = _rand(m, c, dtype=DTYPES[dtype], device="cuda", seed=13)
    with runtime.kernel_path(path):
        ours, same, ref = _three_ways(mlp, _mlp_reference, leaves, g)
    _check_grads("mlp", label, path, ours, same, ref, ["dx", "dW1", "db1", "dW2", "db2", "dresidual"])


def _ln_ref(x, w, b, cls):
    y = F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)
    return torch.cat([cls.expand(x.shape[0], -1, -1), y], 1) if cls.shape[0] else y


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("label,b,rows,c,pre", LN_CASES)
def test_layernorm_gradients_gpu(strict_fallbacks, path, dtype, label, b, rows, c, pre):
    dt = DTYPES[dtype]
    x = _rand(b, rows, c, dtype=dt, device="cuda").requires_grad_()
    w = (1 + 0.2 * _rand(c, dtype=dt, device="cuda", seed=1)).requires_grad_()
    bias = (0.2 * _rand(c, dtype=dt, device="cuda", seed=2)).requires_grad_()
    cls = _rand(pre, c, dtype=dt, device="cuda", seed=3).requires_grad_()
    g = _rand(b, pre + rows, c, dtype=dt, device="cuda", seed=4)

    def ours_fn(x, w, bias, cls):
        return layer_norm_tokens(x, w, bias, 1e-5, cls if pre else None)

    leaves = [x, w, bias, cls] if pre else [x, w, bias]
    ref_fn = _ln_ref if pre else (lambda x, w, bias: _ln_ref(x, w, bias, x.new_empty(0, c)))
    with runtime.kernel_path(path):
        ours, same, ref = _three_ways(ours_fn if pre else (lambda x, w, bias: ours_fn(x, w, bias, None)),
                                      ref_fn, leaves, g)
    _check_grads("layer_norm", label, path, ours, same, ref, ["dx", "dweight", "dbias", "dcls"][:len(leaves)])


@requires_sm80
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("grads", [1, 3])
@pytest.mark.parametrize("label,b,rows,c", [("s1", 2, 3136, 64), ("s3.cls", 2, 197, 384)])
def test_layernorm_backward_residual_gpu(strict_fallbacks, dtype, grads, label, b, rows, c):
    """dx + residual_grad in the kernel (fp32, one rounding), with one output gradient or three
    summed in the kernel (CvT's q / k / v), against float64, next to PyTorch's LayerNorm backward,
    gradient sum and add in the same dtype; dweight / dbias bitwise as without the residual, and
    every output bitwise the same in a rerun (deterministic)."""
    dt = DTYPES[dtype]
    x, r = _rand(b, rows, c, dtype=dt, device="cuda"), _rand(b, rows, c, dtype=dt, device="cuda", seed=5)
    gs = [_rand(b, rows, c, dtype=dt, device="cuda", seed=4 + 10 * i) for i in range(grads)]
    w = 1 + 0.2 * _rand(c, dtype=dt, device="cuda", seed=1)
    dx, dw, db = layer_norm_tokens_backward(gs[0], x, w, 1e-5, r, gs[1:])
    _, dw0, db0 = layer_norm_tokens_backward(gs[0], x, w, 1e-5, None, gs[1:])
    # every sum in a fixed order: dweight / dbias do not depend on the residual, a rerun is bitwise
    assert torch.equal(dw, dw0) and torch.equal(db, db0)
    again = layer_norm_tokens_backward(gs[0], x, w, 1e-5, r, gs[1:])
    assert all(torch.equal(a, b) for a, b in zip(again, (dx, dw, db), strict=True))

    def torch_grads(x, gs, w, r):
        xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
        g = gs[0]
        for more in gs[1:]:
            g = g + more  # what autograd does where a tensor feeds several ops
        dxx, dww = torch.autograd.grad(F.layer_norm(xx, (c,), ww, None, 1e-5), (xx, ww), g)
        return dxx + r, dww, g.reshape(-1, c).sum(0)

    ref = torch_grads(x.double(), [g.double() for g in gs], w.double(), r.double())
    same = torch_grads(x, gs, w, r)
    for name, ours, want, theirs in zip(("dx", "dweight", "dbias"), (dx, dw, db), ref, same, strict=True):
        err = float((ours.double() - want).norm() / want.norm())
        err_t = float((theirs.double() - want).norm() / want.norm())
        _record("layer_norm", f"{label}+residual+{grads}grads", dt, "auto", name, err, err_t)
        assert err <= 2 * err_t + FLOOR[dt], (name, err, err_t)
    torch.library.opcheck(torch.ops.cvt_cutlass.layer_norm_tokens_backward.default,
                          (gs[0], x, w, 1e-5, r, *gs[1:]))


@requires_sm80
def test_gelu_aux_backward_and_partial_requests_gpu(strict_fallbacks):
    """linear_gelu_aux's backward runs dgrad / wgrad; asking for only dW runs no dgrad; an expanded
    gradient (after .sum()) is served."""
    x, w, b = _linear_leaves(2 * 197, 192, 64, torch.bfloat16, "cuda")
    dx, dw, db = torch.autograd.grad(linear_gelu_aux(x, w, b)[0].float().square().sum(), (x, w, b))
    assert dx.shape == x.shape and dw.shape == w.shape and db.shape == b.shape
    fallback.reset()
    torch.autograd.grad(linear(x.detach(), w, b).sum(), (w,))
    calls = fallback.stats()["kernel_calls"]
    assert calls.get("linear_wgrad") == 1 and "linear_dgrad" not in calls


def test_backward_sweep_problems_and_candidates():
    """The sweep's problems: each Linear's dgrad (fc2's times fc1's saved GELU' + fc1's dbias) and wgrad, in
    the (m, n, k) convention select_linear_backward looks up; candidates name-round-trip."""
    from cvt_cutlass.operators.linear import backward_candidates
    from cvt_cutlass.operators.linear.problems import backward_problems

    probs = backward_problems("cvt-13", [2], None, ["dgrad", "wgrad"])
    fc2 = [p for p in probs if p.label == "s1.fc2"]
    assert {(p.pass_, p.m, p.n, p.k, p.epilogue) for p in fc2} == {
        ("dgrad", 2 * 3136, 256, 64, "dgelu_saved_dbias"), ("wgrad", 2 * 3136, 64, 256, "dbias")}
    assert {p.key for p in probs} == {"dgrad:none", "dgrad:dgelu_saved_dbias", "wgrad:dbias", "wgrad:none"}
    assert {p.epilogue for p in probs if p.pass_ == "wgrad" and p.label.endswith(".fc1")} == {"none"}
    assert backward_problems("cvt-13", [2], None, ["wgrad"]) == [p for p in probs if p.pass_ == "wgrad"]
    for arch in (90, 89):
        for pass_, epi in (("dgrad", "dgelu_dbias"), ("dgrad", "dgelu_saved_dbias"), ("wgrad", "dbias")):
            cands = backward_candidates(arch, "bf16", pass_, epi)
            assert len({c.name for c in cands}) == len(cands) > 4
            assert all(parse_kernel_name(c.name) == c and c.pass_ == pass_ for c in cands)
            # the SM90 wgrad kernels are candidates of the sm90 path only
            assert any(c.arch == 90 for c in cands) == (arch == 90)
    with pytest.raises(SpecError, match="no backward pass"):
        backward_candidates(90, "bf16", "fwd", "none")


SWEEP_PROBLEMS = ((2 * 197, 64, 192), (2 * 197, 192, 64))  # (m, dX cols, layer N), (m, dW rows, K)


@requires_sm80
def test_backward_sweep_end_to_end_gpu(tmp_path, monkeypatch):
    """Two problems (a dgelu_saved_dbias dgrad, a wgrad) x their heuristic kernel: profiler rows checked
    and timed, then selection-table rows that select_linear_backward finds (source "table")."""
    import types

    import cvt_cutlass.operators.linear as ol
    import cvt_cutlass.operators.linear.problems as lp

    from cvt_cutlass.tools.sweep import linear as sl
    from cvt_cutlass.tools.sweep.driver import read_rows
    from cvt_cutlass.tools.sweep.tables import update_from_rows

    dev = runtime.device_info(torch.cuda.current_device())
    arch = runtime.arch_for(dev.cc)
    (m, n, k), (m2, n2, k2) = SWEEP_PROBLEMS
    probs = [lp.BackwardProblem("t.fc2", "dgrad", m, n, k, "dgelu_saved_dbias"),
             lp.BackwardProblem("t.fc1", "wgrad", m2, n2, k2, "dbias")]
    monkeypatch.setattr(lp, "backward_problems", lambda *a: probs)
    heur = {p.pass_: select_linear_backward(p.pass_, p.m, p.n, p.k, "bf16", p.epilogue, arch, None).spec for p in probs}
    monkeypatch.setattr(ol, "backward_candidates", lambda a, dt, pass_, e: [heur[pass_]])
    args = types.SimpleNamespace(model="cvt-13", batch=[1], image_size=None, dtype=["bf16"], arch=[arch], jobs=None,
                                 passes=["dgrad", "wgrad"])
    out = tmp_path / "p.csv"
    rows = sl.sweep_linear_backward(args, set(), out)
    back = read_rows(out)
    assert len(rows) == len(back) == 4 and {r["Disposition"] for r in back} == {"passed"}, back
    assert {r["epilogue"] for r in back} == {"dgrad:dgelu_saved_dbias", "wgrad:dbias"}
    assert all(float(r["Runtime"]) > 0 and float(r["rel_err"] or 0) <= 2 * float(r["peer_rel_err"]) + 1e-4
               for r in back if r["Provider"] == "cutlass")
    update_from_rows(back, str(tmp_path))
    monkeypatch.setenv("CVT_CUTLASS_SELECTION_DIR", str(tmp_path))
    runtime.reload_tables()
    try:
        for p in probs:
            choice = select_linear_backward(p.pass_, p.m, p.n, p.k, "bf16", p.epilogue, arch, dev.name)
            assert choice.source == "table" and choice.spec == heur[p.pass_]
    finally:
        monkeypatch.delenv("CVT_CUTLASS_SELECTION_DIR")
        runtime.reload_tables()


@requires_sm80
def test_raw_backward_launches_check_their_arguments_gpu():
    """cvt_cutlass_C.dgrad / wgrad (the sweep's launches) refuse a kernel of another family, a
    dgelu kernel without its pre-activation, and wrong shapes, with the kernel's name."""
    arch = runtime.arch_for(runtime.device_info(torch.cuda.current_device()).cc)
    (m, n, k), _ = SWEEP_PROBLEMS
    dg = runtime.load_kernel(select_linear_backward("dgrad", m, n, k, "bf16", "dgelu_dbias", arch, None).spec, CUDA_CC)
    wg = runtime.load_kernel(select_linear_backward("wgrad", m, k, n, "bf16", "dbias", arch, None).spec, CUDA_CC)
    g = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    dx = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="needs gelu_input and db"):
        torch.ops.cvt_cutlass_C.dgrad(dg, g, w, None, dx, None)
    with pytest.raises(RuntimeError, match="cvt_linear_wgrad_.* is not a GEMM kernel"):
        torch.ops.cvt_cutlass_C.dgrad(wg, g, w, None, dx, None)
    with pytest.raises(RuntimeError, match="dW must be"):
        torch.ops.cvt_cutlass_C.wgrad(wg, g, dx, torch.empty(n, n, device="cuda", dtype=torch.bfloat16), None)


@requires_sm80
def test_deferred_column_sums_gpu():
    """cvt_colsum_flush (the one launch that sums a backward's deferred column sums) against
    float64: 60 segments (the list flushed whenever full) of 0 to 1111 rows, 1 to 1500 columns,
    padded rows, into float, half and bfloat16; a segment without rows writes zeros; one of fewer
    than 64 rows is the in-order fp32 sum of its rows, bit for bit."""
    arch = runtime.arch_for(runtime.device_info(torch.cuda.current_device()).cc)
    kid = runtime.load_kernel(layernorm_heuristic("bf16", 64, arch, "bwd"), CUDA_CC)
    g = torch.Generator(device="cuda").manual_seed(11)
    shapes = [(r, c) for r in (0, 1, 5, 63, 64, 200, 1111) for c in (1, 7, 33, 1024, 1500)][:30] * 2
    types = (torch.float32, torch.float16, torch.bfloat16)
    ins = [torch.randn(max(r, 1), c + 8 * (i % 3), device="cuda", generator=g) for i, (r, c) in enumerate(shapes)]
    outs = [torch.full((c,), float("nan"), device="cuda", dtype=types[i % 3]) for i, (_, c) in enumerate(shapes)]
    torch.ops.cvt_cutlass_C.colsum_flush_raw(kid, ins, [r for r, _ in shapes], outs)
    for (r, c), x, out in zip(shapes, ins, outs, strict=True):
        ref = x[:r, :c].double().sum(0)
        tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[out.dtype]
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * max(1.0, r ** 0.5))
        if r == 0:
            assert not out.any()
        if 0 < r < 64:  # few rows: summed in row order in fp32, rounded once (the split partials' contract)
            acc = torch.zeros(c, device="cuda")
            for row in x[:r, :c]:
                acc += row
            assert torch.equal(out, acc.to(out.dtype)), (r, c)
    with pytest.raises(RuntimeError, match="float \\(R, ld\\) tensors"):
        torch.ops.cvt_cutlass_C.colsum_flush_raw(kid, [ins[0].half()], [1], [outs[0]])


# The SM90 wgrad kernels the sweep tries, clustered ones built by name (TMA multicast; ping-pong) and
# a clustered stream-K one, each on a ragged problem (rows not a multiple of the K tile, dW not a
# multiple of the CTA tile or of the cluster's tiles; two parallel slabs of 500 rows), a stage-3 MLP
# one, one row, and 6,144 rows over a few tiles (16 slabs of 384 rows): raw launches vs float64.
SM90_WGRAD_PROBLEMS = ((1000, 72, 40), (2 * 197, 384, 1536), (1, 64, 64), (6144, 192, 192))
SM90_WGRAD_CLUSTERED = (((128, 128, 64), (1, 2, 1), "coop"), ((128, 192, 64), (2, 2, 1), "coop"),
                        ((64, 128, 64), (1, 1, 1), "pingpong"), ((64, 192, 64), (2, 2, 1), "pingpong"))


def _sm90_wgrad_specs():
    from cvt_cutlass.operators.linear import wgrad_candidates

    clustered = [LinearWgradSpec(90, "bf16", t, waves=1, slabs=True, cluster=c, schedule=sch)
                 for t, c, sch in SM90_WGRAD_CLUSTERED]
    return ([s for s in wgrad_candidates("bf16", 90) if s.arch == 90] + clustered
            + [LinearWgradSpec(90, "fp16", (128, 128, 64), waves=0),
               LinearWgradSpec(90, "bf16", (128, 128, 64), waves=0, cluster=(1, 2, 1))])  # a clustered stream-K


@pytest.mark.skipif(CUDA_CC != 90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("spec", _sm90_wgrad_specs(), ids=lambda s: s.name)
def test_sm90_wgrad_kernels_gpu(spec):
    kid = runtime.load_kernel(spec, CUDA_CC)
    dt = DTYPES[spec.dtype]
    for m, n, k in SM90_WGRAD_PROBLEMS:
        g, x = _rand(m, n, device="cuda", seed=1), _rand(m, k, device="cuda", seed=2)
        ref_w, ref_b = g.t() @ x, g.sum(0)
        for with_db in (True, False):
            dw = torch.full((n, k), float("nan"), device="cuda", dtype=dt)
            db = torch.full((n,), float("nan"), device="cuda", dtype=dt) if with_db else None
            torch.ops.cvt_cutlass_C.wgrad(kid, g.to(dt), x.to(dt), dw, db)
            peer = (g.to(dt).t() @ x.to(dt)).double()
            tol = 2 * _rel(peer, ref_w) + FLOOR[dt]
            assert _rel(dw.double(), ref_w) <= tol, (m, n, k)
            if with_db:
                assert _rel(db.double(), ref_b) <= FLOOR[dt], (m, n, k)
    # the row pass's copy, which the GEMM then reads (every split: slabs of 384 rows): dY's rows scaled
    # by drop path's rs, from 16-bit and from fp32 rows (rounded once)
    m, n, k = SM90_WGRAD_PROBLEMS[-1]
    x = _rand(m, k, device="cuda", seed=2).to(dt)
    rs = torch.where(torch.arange(m, device="cuda") % 3 == 1, 0.0, 1 / 0.7).float()
    for wide in (False, True):
        g = _rand(m, n, device="cuda", seed=1).to(torch.float32 if wide else dt)
        want = (g * rs[:, None]).to(dt)
        ref_w = want.double().t() @ x.double()
        dw = torch.full((n, k), float("nan"), device="cuda", dtype=dt)
        gs = torch.full((m, n), float("nan"), device="cuda", dtype=dt)
        torch.ops.cvt_cutlass_C.wgrad(kid, g, x, dw, None, rs, gs)
        assert torch.equal(gs, want), wide
        assert _rel(dw.double(), ref_w) <= 2 * _rel((want.t() @ x).double(), ref_w) + FLOOR[dt], wide
    # deterministic: the same inputs give the same bits (fixed split order, ordered row sums), with
    # workspaces taken over freed garbage (with db, the row-sum pass zeroes the stream-K barrier
    # flags, not a memset: stale flags would hang or corrupt)
    g, x = _rand(25216, 384, device="cuda", seed=3).to(dt), _rand(25216, 1536, device="cuda", seed=4).to(dt)
    outs = []
    for _ in range(3):
        garbage = torch.full((1 << 24,), -1, device="cuda", dtype=torch.int32)
        del garbage
        dw, db = torch.empty(384, 1536, device="cuda", dtype=dt), torch.empty(384, device="cuda", dtype=dt)
        torch.ops.cvt_cutlass_C.wgrad(kid, g, x, dw, db)
        outs.append((dw, db))
    for dw, db in outs[1:]:
        assert torch.equal(outs[0][0], dw) and torch.equal(outs[0][1], db)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.ops.cvt_cutlass_C.wgrad(kid, g, x, dw, db)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert not any(n.startswith("Memset") for n in names), names  # no memset launch beside the kernels


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("label,m,n,k", [c for c in LINEAR_CASES if c[0] in ("s1.qkv", "s3.fc2", "ragged", "m1")])
@pytest.mark.parametrize("wide", [False, True])
def test_row_scaled_wgrad_gpu(path, dtype, label, m, n, k, wide):
    """Drop path's backward in the weight gradient's row-sum pass (the layer op's out-projection
    and fc2): the scaled gradient it writes is bitwise PyTorch's g * rs (fp32 product, one
    rounding), dW and db are those of the scaled gradient (against float64), with and without db.
    With g in fp32 (``wide``: an fp32 residual stream's gradient) the pass rounds g's rows, scaled
    or not, to x's dtype once: the copy is bitwise (g * rs).to(dtype), or g.to(dtype)."""
    dt = DTYPES[dtype]
    spec = select_linear_backward("wgrad", m, n, k, dtype, "dbias", path_arch(path, CUDA_CC),
                                  torch.cuda.get_device_name()).spec
    kid = runtime.load_kernel(spec, CUDA_CC)
    # g's rows padded (read ldy = n + 8 apart; the scaled copy is packed), x's packed
    g = _rand(m, n + 8, device="cuda", seed=5).to(torch.float32 if wide else dt)[:, :n]
    x = _rand(m, k, device="cuda", seed=6).to(dt)
    g_before = g.clone()
    rows = torch.arange(m, device="cuda")
    scales = torch.where(rows % 3 == 1, 0.0, 1 / 0.7).float()  # drop path's scales: 0 or 1 / keep
    for rs in (scales, None) if wide else (scales,):
        want = (g * rs[:, None]).to(dt) if rs is not None else g.to(dt)  # PyTorch's: fp32 product, one rounding
        ref_w, ref_b = want.double().t() @ x.double(), want.double().sum(0)
        tol = 2 * _rel((want.t() @ x).double(), ref_w) + FLOOR[dt]
        for with_db in (True, False):
            gs = torch.full((m, n), float("nan"), device="cuda", dtype=dt)
            dw = torch.full((n, k), float("nan"), device="cuda", dtype=dt)
            db = torch.full((n,), float("nan"), device="cuda", dtype=dt) if with_db else None
            torch.ops.cvt_cutlass_C.wgrad(kid, g, x, dw, db, rs, gs)
            assert torch.equal(gs, want), (label, with_db, rs is None)
            assert _rel(dw.double(), ref_w) <= tol, (label, with_db, rs is None)
            if with_db:
                assert _rel(db.double(), ref_b) <= FLOOR[dt], (label, rs is None)
    assert torch.equal(g, g_before)  # the scale goes to the copy only
    with pytest.raises(RuntimeError, match="come together" if not wide else "needs g_scaled"):
        torch.ops.cvt_cutlass_C.wgrad(kid, g, x, dw, None, None if wide else scales, None)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.cvt_cutlass_C.wgrad(kid, g, x, dw, None, scales.double(), gs)
    if not wide:
        packed = g.contiguous()
        with pytest.raises(RuntimeError, match="single memory location"):  # the scaled copy over its input
            torch.ops.cvt_cutlass_C.wgrad(kid, packed, x, dw, None, scales, packed)


def _rel(a, ref):
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


BENCH_BATCH = 8  # the passes benchmark's rows at a small batch: its kernel list must be what they load


@requires_sm80
@pytest.mark.parametrize("op", ["linear", "layernorm"])
def test_passes_bench_prebuilds_what_its_rows_load_gpu(strict_fallbacks, loaded_kernels, op):
    """bench --op linear/layernorm --pass ... compiles kernel_specs() before timing; every kernel
    its rows then load (forward and backward) must be in that list, or timing would build."""
    from cvt_cutlass.tools.bench import passes

    loaded = loaded_kernels
    dev = runtime.device_info(torch.cuda.current_device())
    gen = torch.Generator(device="cuda").manual_seed(0)
    for row, _, m, c in passes.cases(op, BENCH_BATCH):
        leaves, g = passes._inputs(torch, row, m, c, torch.bfloat16, gen, BENCH_BATCH)
        torch.autograd.grad(passes._fns(row)[0](*leaves), leaves, g)
    listed = {s.name for s in passes.kernel_specs(op, BENCH_BATCH, "bf16", runtime.arch_for(dev.cc), dev.name)}
    assert loaded and loaded <= listed, sorted(loaded - listed)
    assert listed <= loaded, sorted(listed - loaded)


@requires_sm80
def test_opcheck_backward_ops_gpu(strict_fallbacks):
    g = torch.randn(2 * 197, 192, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(192, 64, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(2 * 197, 64, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.cvt_cutlass.linear_dgrad.default, (g, w, z))
    torch.library.opcheck(torch.ops.cvt_cutlass.linear_wgrad.default, (g, z, True))
    t = torch.randn(3, 196, 384, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.cvt_cutlass.layer_norm_tokens_backward.default,
                          (t, t + 1, torch.rand(384, device="cuda", dtype=torch.bfloat16) + 0.5, 1e-5))
    leaves = _mlp_leaves(2 * 197, 384, 1536, torch.bfloat16, "cuda")
    torch.library.opcheck(torch.ops.cvt_cutlass.mlp.default, tuple(leaves))


# ----------------------------------------------------------------------------- prebuild list
def _backward_specs(arch, dtype, gpu):
    out = []
    for _, m, n, k in LINEAR_CASES:
        out.append(select_linear_backward("dgrad", m, k, n, dtype, "none", arch, gpu).spec)
        out.append(select_linear_backward("wgrad", m, n, k, dtype, "dbias", arch, gpu).spec)
    for _, m, c, h in MLP_CASES:
        out.append(select_linear_backward("dgrad", m, h, c, dtype, "dgelu_dbias", arch, gpu).spec)
        out.append(select_linear_backward("dgrad", m, h, c, dtype, "dgelu_saved_dbias", arch, gpu).spec)
        out.append(select_linear_backward("dgrad", m, c, h, dtype, "none", arch, gpu).spec)
        out.append(select_linear_backward("wgrad", m, c, h, dtype, "dbias", arch, gpu).spec)
        out.append(select_linear_backward("wgrad", m, h, c, dtype, "none", arch, gpu).spec)
    for _, b, rows, c, _pre in LN_CASES:
        out.append(select_layernorm(b * rows, c, dtype, arch, gpu, "bwd").spec)
    return out


def gpu_kernel_specs(cc: int, gpu: str | None) -> list:
    """The backward kernels this module's GPU tests (and test_linear's / test_layernorm's opcheck
    and backward tests, which now run them) select on a device (cc, gpu): the forward kernels they
    use are listed by test_linear / test_layernorm."""
    from .gpu_kernels import layernorm_spec, linear_spec

    out = []
    for arch in sorted({path_arch(p, cc) for p in gpu_paths(cc)}):
        for dt in KERNEL_DTYPES:
            out += _backward_specs(arch, dt, gpu)
            for _, m, n, k in LINEAR_CASES:
                out.append(linear_spec(m, n, k, dt, "bias_residual", arch, gpu))
            for _, m, c, h in MLP_CASES:
                out += [linear_spec(m, h, c, dt, "bias_gelu_aux", arch, gpu),
                        linear_spec(m, h, c, dt, "bias_gelu_dgelu", arch, gpu),
                        linear_spec(m, c, h, dt, "bias_residual", arch, gpu)]
            for _, b, rows, c, _pre in LN_CASES:
                out.append(layernorm_spec(b * rows, c, dt, arch, gpu))
    arch = path_arch("auto", cc)
    from cvt_cutlass.tools.bench.passes import kernel_specs

    out += [s for op in ("linear", "layernorm") for s in kernel_specs(op, BENCH_BATCH, "bf16", arch, gpu)]
    for epi in ("none", "dgelu_dbias", "dgelu_saved_dbias"):  # opcheck / test_linear's opcheck (2 * 197 rows, 192 <-> 64)
        out.append(select_linear_backward("dgrad", 2 * 197, 64, 192, "bf16", epi, arch, gpu).spec)
    out += [select_linear_backward("wgrad", 2 * 197, 192, 64, "bf16", "dbias", arch, gpu).spec,
            select_layernorm(3 * 196, 384, "bf16", arch, gpu, "bwd").spec,
            *(_sm90_wgrad_specs() if cc == 90 else []),
            layernorm_heuristic("bf16", 64, arch, "bwd"),  # the deferred column sums' flush
            linear_spec(2 * 197, 192, 64, "bf16", "bias_gelu_aux", arch, gpu),
            linear_spec(2 * 197, 192, 64, "bf16", "bias_gelu_dgelu", arch, gpu),
            linear_spec(2 * 197, 192, 64, "bf16", "bias", arch, gpu)]
    return [s for s in out if s is not None]

