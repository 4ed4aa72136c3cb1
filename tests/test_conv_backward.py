"""The token-embedding conv's backward: conv2d_nhwc_backward (CUTLASS dgrad and wgrad kernels, db
in the wgrad launch) and the C++ autograd formula of conv2d_nhwc that calls it.

CPU: names, spec rules, emission, the nvcc builds (one dgrad and one wgrad kernel for sm_89 and
sm_90a), the fallback's gradients against float64 autograd, partial requests, errors, opcheck,
torch.compile. GPU: gradients of every embedding conv of CvT-13 and CvT-W24 (batch 2) and ragged
ones (odd sizes, K=72, stride 4 on a padded 4-channel image) against a float64 reference, both
kernel paths, fp16 and bf16, in strict mode, the error next to PyTorch's own (cuDNN) at the same
precision (rows appended to $CVT_CUTLASS_GRAD_ERRORS when set); the stem image's visible dx
fallback; split-K determinism; raw-launch argument checks; opcheck.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from cvt_cutlass.operators.conv2d import (
    Conv90WgradSpec,
    ConvBwdSpec,
    ConvLayer,
    ConvRowsWgradSpec,
    conv_bwd_candidates,
    conv_bwd_heuristic,
    conv_problems,
    conv_window,
    rows_serve,
    select_conv2d,
    select_conv2d_backward,
)
from cvt_cutlass.operators.spec import SpecError, parse_kernel_name

from cvt_cutlass import build, fallback, runtime
from cvt_cutlass.emitter import kernel_source
from cvt_cutlass.ops.conv2d import (
    conv2d_nhwc,
    conv2d_nhwc_backward,
    conv_filter_krsc,
    image_to_nhwc,
    stem_channels,
)

from .conftest import CUDA_CC, DTYPES, PATHS, no_kernel_body, requires_nvcc, requires_sm80
from .gpu_kernels import KERNEL_DTYPES, default_arch, path_archs
from .test_backward import _record
from .test_build import build_and_check

# Relative (Frobenius) error allowed: at most 2x PyTorch's own at the same precision, plus a floor.
FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# CvT's stem as the row-window wgrad sees it: (C padded to 4, K, R, S, W, stride, pad)
STEM_WINDOW = (4, 64, 7, 7, 224, 4, 2)


# ----------------------------------------------------------------------------- names, rules, emission
def test_conv_backward_names_round_trip():
    specs = [conv_bwd_heuristic("dgrad", "fp16", 64, 192), conv_bwd_heuristic("wgrad", "bf16", 4, 64),
             conv_bwd_heuristic("wgrad", "fp16", 192, 384), ConvBwdSpec(89, "bf16", "dgrad", (64, 64, 32),
                                                                         stages=5, iterator="analytic", swizzle=4),
             ConvBwdSpec(89, "fp16", "wgrad", (128, 64, 32), waves=4)]
    specs += conv_bwd_candidates("dgrad", "fp16", 192) + conv_bwd_candidates("wgrad", "bf16", 4)
    specs += conv_bwd_candidates("wgrad", "fp16", 4, window=STEM_WINDOW)[:3]
    sm90 = [c for c in conv_bwd_candidates("wgrad", "bf16", 192, 90) if isinstance(c, Conv90WgradSpec)]
    assert len(sm90) == 4 and not any(isinstance(c, Conv90WgradSpec) for c in conv_bwd_candidates("wgrad", "bf16", 192))
    assert not any(isinstance(c, Conv90WgradSpec) for c in conv_bwd_candidates("wgrad", "bf16", 4, 90))  # TMA rows
    assert sm90[1].name == "cvt_conv2d_wgrad_sm90a_bf16_nhwc_dbias_t64x128x64_c1x1x1_sauto_ws_a8"
    specs += sm90
    for s in specs:
        assert parse_kernel_name(s.name) == s
    assert specs[0].name == "cvt_conv2d_dgrad_sm89_f16_nhwc_strided_t128x64x32_w2x2x1_s4_sw1_optimized_a8"
    assert specs[1].name == "cvt_conv2d_wgrad_sm89_bf16_nhwc_dbias_t64x64x32_w2x2x1_s5_optimized_a4_k2"
    assert specs[3].name == "cvt_conv2d_dgrad_sm89_bf16_nhwc_strided_t64x64x32_w2x2x1_s5_sw4_analytic_a8"
    assert specs[4].name.endswith("_optimized_a8_k4")
    assert all(s.align == 4 and s.channels_ok(4) and not s.channels_ok(3) for s in conv_bwd_candidates("wgrad", "bf16", 4))
    assert conv_bwd_candidates("dgrad", "fp16", 4) == []  # the stem's image gets its dx from PyTorch
    assert specs[-5].name == "cvt_conv2d_wgrad_sm89_f16_nhwc_dbias_rows_r7_s4_k2"


def test_conv_backward_specs_refuse_what_they_cannot_build():
    with pytest.raises(SpecError, match="align=8"):
        ConvBwdSpec(89, "fp16", "dgrad", (128, 64, 32), align=4)
    with pytest.raises(SpecError, match="strided-dgrad threadblock swizzle"):
        ConvBwdSpec(89, "fp16", "dgrad", (128, 64, 32), swizzle=2)
    with pytest.raises(SpecError, match="split waves"):
        ConvBwdSpec(89, "fp16", "wgrad", (128, 64, 32), waves=3)
    with pytest.raises(SpecError, match="swizzle 1"):
        ConvBwdSpec(89, "fp16", "wgrad", (128, 64, 32), swizzle=4)
    with pytest.raises(SpecError, match="arch"):
        ConvBwdSpec(90, "fp16", "wgrad", (128, 64, 32))
    with pytest.raises(SpecError, match="instantiates the passes"):
        ConvBwdSpec(89, "fp16", "fwd", (128, 64, 32))
    with pytest.raises(SpecError, match="tile K"):
        ConvBwdSpec(89, "fp16", "wgrad", (128, 64, 16))
    with pytest.raises(SpecError, match="iterator"):
        ConvBwdSpec(89, "fp16", "wgrad", (128, 64, 32), iterator="fixed_channels")
    with pytest.raises(SpecError, match="shared memory"):
        ConvBwdSpec(89, "fp16", "dgrad", (256, 128, 64), (4, 2, 1), stages=4)
    with pytest.raises(SpecError, match="not a valid conv2d wgrad"):  # a dgrad variant under the wgrad pass
        parse_kernel_name("cvt_conv2d_wgrad_sm89_f16_nhwc_strided_t128x64x32_w2x2x1_s4_sw1_optimized_a8")
    with pytest.raises(SpecError, match="no conv dgrad kernel for C=4"):
        conv_bwd_heuristic("dgrad", "fp16", 4, 64)
    with pytest.raises(SpecError, match="no conv wgrad kernel for C=3"):
        conv_bwd_heuristic("wgrad", "fp16", 3, 64)
    with pytest.raises(SpecError, match="SM90 conv tile"):
        Conv90WgradSpec("bf16", (256, 64, 64))
    with pytest.raises(SpecError, match="SM90 conv cluster"):
        Conv90WgradSpec("bf16", (64, 64, 64), (4, 1, 1))
    with pytest.raises(SpecError, match="filter rows"):
        ConvRowsWgradSpec("bf16", 9)
    with pytest.raises(SpecError, match="stages"):
        ConvRowsWgradSpec("bf16", 7, 5)
    with pytest.raises(SpecError, match="CTAs per SM"):
        ConvRowsWgradSpec("bf16", 7, 3, 3)
    with pytest.raises(SpecError, match="not a valid conv2d dgrad"):  # the row kernel has no dgrad
        parse_kernel_name("cvt_conv2d_dgrad_sm89_f16_nhwc_dbias_rows_r7_s3_k2")


def test_row_window_wgrad_serves_the_stem_only_where_its_windows_fit():
    """The row-window wgrad takes the stem (16-byte window starts, <= 32 taps a filter row, <= 64
    pixels an output row, K a multiple of 64); the heuristic picks it there and the split-K implicit
    GEMM elsewhere; a table row naming it serves only a window it fits."""
    assert rows_serve(*STEM_WINDOW)
    assert not rows_serve(4, 64, 7, 7, 223, 4, 2)  # W * C not a multiple of 8
    assert not rows_serve(4, 64, 7, 7, 224, 4, 3)  # odd padding: 8-byte window starts
    assert not rows_serve(4, 192, 7, 7, 384, 4, 2)  # 96 pixels a row (CvT-W24 at 384)
    assert not rows_serve(4, 72, 7, 7, 224, 4, 2)  # K not a multiple of 64
    assert not rows_serve(8, 64, 7, 7, 224, 4, 2)  # 56 taps a filter row
    assert conv_window(64, 192, 3, 3, 56, 2, 1) is None  # 192 taps: the implicit GEMM's 16-byte reads
    patch8 = (4, 64, 8, 8, 224, 8, 0)  # an 8 x 8 / 8 patch embedding: 4 stages would take 100 KB
    assert [s.stages for s in conv_bwd_candidates("wgrad", "bf16", 4, window=patch8)
            if isinstance(s, ConvRowsWgradSpec)] == [2, 3]
    assert not ConvRowsWgradSpec("bf16", 8, 4).serves(patch8) and ConvRowsWgradSpec("bf16", 8, 3).serves(patch8)
    assert not rows_serve(4, 64, 7, 7, 224, 0, 2) and not rows_serve(4, 64, 7, 7, 224, 4, -2)
    rows = conv_bwd_heuristic("wgrad", "bf16", 4, 64, STEM_WINDOW)
    assert isinstance(rows, ConvRowsWgradSpec) and rows.serves(STEM_WINDOW) and rows.filter_rows == 7
    assert not rows.serves(None) and not rows.serves((4, 64, 7, 7, 384, 4, 2))
    assert isinstance(conv_bwd_heuristic("wgrad", "bf16", 4, 64), ConvBwdSpec)
    w24 = (4, 192, 7, 7, 384, 4, 2)
    assert isinstance(conv_bwd_heuristic("wgrad", "bf16", 4, 192, w24), ConvBwdSpec)
    got = select_conv2d_backward("wgrad", 2 * 3136, 64, 196, 4, "bf16", 90, "NVIDIA H200", STEM_WINDOW).spec
    assert got.serves(STEM_WINDOW)
    assert not isinstance(select_conv2d_backward("wgrad", 2 * 9216, 192, 196, 4, "bf16", 90, None, w24).spec,
                          ConvRowsWgradSpec)


def test_conv_backward_emission():
    """Each pass instantiates its template (operators/conv2d/dgrad_sm80.cuh, wgrad_sm80.cuh) with the
    spec's parameters; the templates hold the kernels (dgrad: CUTLASS's strided dgrad; wgrad: parallel
    split-K, dw and db summed without atomics)."""
    dg = kernel_source(conv_bwd_heuristic("dgrad", "bf16", 64, 192))
    assert '#include "conv2d/dgrad_sm80.cuh"' in dg and "using Kernel = DgradSm80<Config>;" in dg
    assert "static constexpr int kSwizzle = 1;" in dg and "cutlass::bfloat16_t" in dg
    wg = kernel_source(conv_bwd_heuristic("wgrad", "fp16", 4, 64))
    assert '#include "conv2d/wgrad_sm80.cuh"' in wg and "using Kernel = WgradSm80<Config>;" in wg
    assert "static constexpr int kAlign = 4;" in wg  # the stem's 4-channel activation, 8-byte accesses
    assert "static constexpr int kWaves = 2;" in wg
    ops = build.OPERATORS / "conv2d"
    dgrad, wgrad = (ops / "dgrad_sm80.cuh").read_text(), (ops / "wgrad_sm80.cuh").read_text()
    assert "DefaultConv2dDgrad" in dgrad and "StridedDgradIdentityThreadblockSwizzle<Cfg::kSwizzle>" in dgrad
    assert "StrideSupport::kStrided, 8, 8>::Kernel" in dgrad and "CVT_FAMILY_CONV2D_BWD" in dgrad
    assert "DefaultConv2dWgrad" in wgrad and "SplitKMode::kParallel" in wgrad
    assert "StrideSupport::kStrided, 8, Cfg::kAlign>::Kernel" in wgrad and "CVT_FAMILY_CONV2D_BWD" in wgrad
    assert "colsum2<Element>({partials" in wgrad and "rowsum_partials_of(" in wgrad  # deterministic dw and db
    for src in (dg, wg):
        assert "cvt_convbwd_launch" in src and "cvt_convbwd_can_implement" in src and no_kernel_body(src)
        headers = build.project_headers(src)
        assert ops / "bwd_geometry.cuh" in headers and build.OPERATORS / "conv2d" / "abi.h" in headers
        for text in (src, *(h.read_text() for h in headers)):
            assert not re.search(r'#include [<"](torch|ATen|c10)/', text) and "atomicAdd" not in text
    assert build.OPERATORS / "common" / "reduce.cuh" in build.project_headers(wg)
    rw = kernel_source(ConvRowsWgradSpec("bf16", 7, 3))
    assert '#include "conv2d/wgrad_rows.cuh"' in rw and "using Kernel = WgradRows<Config>;" in rw
    assert "static constexpr int kR = 7;" in rw and "static constexpr int kStages = 3;" in rw and no_kernel_body(rw)
    w90 = kernel_source(Conv90WgradSpec("bf16", (64, 128, 64)))
    assert '#include "conv2d/wgrad_sm90.cuh"' in w90 and "using Kernel = WgradSm90<Config>;" in w90
    assert "cute::Shape<cute::_64, cute::Shape<cute::_128>, cute::Shape<cute::_64>>" in w90 and no_kernel_body(w90)
    assert "Operator::kWgrad" in (ops / "wgrad_sm90.cuh").read_text()
    rows_src = (ops / "wgrad_rows.cuh").read_text()
    assert "colsum2<Element>({part_w" in rows_src and "atomicAdd" not in rows_src  # deterministic dw and db


def test_conv_backward_selection_is_a_pure_function_of_the_problem():
    d = select_conv2d_backward("dgrad", 2 * 784, 192, 9 * 64, 64, "bf16", 90, "NVIDIA H200")
    assert d.spec.pass_ == "dgrad" and d.spec.arch == 89 and d.spec.channels_ok(64)
    w = select_conv2d_backward("wgrad", 2 * 3136, 64, 49 * 4, 4, "fp16", 89, None)
    assert w.spec.pass_ == "wgrad" and w.spec.align == 4
    assert w == select_conv2d_backward("wgrad", 2 * 3136, 64, 49 * 4, 4, "fp16", 89, None)


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("target", ["sm_89", "sm_90a"])
def test_real_compiles_of_the_conv_backward_kernels(target):
    """nvcc builds the strided dgrad, the stem's 4-channel split-K wgrad (with its db pass) and its
    row-window wgrad for sm_89 and sm_90a (SM80-class code serves both paths), and the SM90 wgrad for
    sm_90a, without spills."""
    specs = [conv_bwd_heuristic("dgrad", "fp16", 64, 192), conv_bwd_heuristic("wgrad", "bf16", 4, 64),
             conv_bwd_heuristic("wgrad", "fp16", 4, 64, STEM_WINDOW)]
    if target == "sm_90a":  # the SM90 wgrad (TMA im2col + wgmma) exists for sm_90a only
        specs.append(Conv90WgradSpec("bf16", (64, 128, 64)))
    build_and_check(specs, target, lambda s: 9, "convbwd")


# ----------------------------------------------------------------------------- CPU: fallbacks, autograd
def _leaves(n, h, w, c, k, r, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, h, w, c, generator=g, device=device).to(dtype)
    wt = (torch.randn(k, r, r, c, generator=g, device=device) / (r * c ** 0.5)).to(dtype)
    b = (0.5 * torch.randn(k, generator=g, device=device)).to(dtype)
    return x, wt, b


def _torch_grads(x, w, b, stride, pad, gy, need_x=True):
    """PyTorch's gradients of the same conv on NCHW views (what HF runs): (dx | None, dw, db) in NHWC/KRSC."""
    xn = x.permute(0, 3, 1, 2).detach().requires_grad_(need_x)
    wn = w.permute(0, 3, 1, 2).detach().requires_grad_()
    bn = b.detach().requires_grad_()
    y = F.conv2d(xn, wn, bn, stride, pad)
    leaves = ([xn] if need_x else []) + [wn, bn]
    gr = torch.autograd.grad(y, leaves, gy.permute(0, 3, 1, 2))
    dx = gr[0].permute(0, 2, 3, 1) if need_x else None
    return dx, gr[-2].permute(0, 2, 3, 1), gr[-1]


@pytest.mark.parametrize("shape", [(2, 9, 11, 8, 16, 3, 2, 1), (1, 13, 13, 4, 8, 7, 4, 2), (3, 6, 5, 16, 72, 3, 1, 1)])
def test_autograd_through_conv2d_nhwc_matches_torch_cpu(shape, counted_fallbacks):
    n, h, w, c, k, r, stride, pad = shape
    x, wt, b = _leaves(n, h, w, c, k, r)
    x.requires_grad_()
    wt.requires_grad_()
    b.requires_grad_()
    y = conv2d_nhwc(x, wt, b, stride, pad)
    assert "Conv2dFn" in y.grad_fn.name()  # the C++ autograd formula, no Python twin
    gy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, wt, b), gy)
    want = _torch_grads(x, wt, b, stride, pad, gy)
    for a, t in zip(got, want, strict=True):
        torch.testing.assert_close(a, t)
    assert counted_fallbacks.stats()["fallbacks"].get("conv2d_nhwc_backward:device", 0) == 1


def test_image_without_grad_asks_for_no_dx_cpu(counted_fallbacks, monkeypatch):
    """The stem's image does not require grad: the backward op is asked for dw and db only."""
    import cvt_cutlass.ops.conv2d as conv_mod

    seen = []
    real = conv_mod.conv2d_nhwc_backward_reference

    def spy(*args):
        seen.append(args[5:])
        return real(*args)

    monkeypatch.setattr(conv_mod, "conv2d_nhwc_backward_reference", spy)
    x, wt, b = _leaves(2, 16, 16, 4, 8, 7)
    wt.requires_grad_()
    b.requires_grad_()
    y = conv2d_nhwc(x, wt, b, 4, 2)
    dw, db = torch.autograd.grad(y.square().sum(), (wt, b))
    assert seen == [(False, True, True)]
    _, want_w, want_b = _torch_grads(x, wt, b, 4, 2, 2 * y.detach(), need_x=False)
    torch.testing.assert_close(dw, want_w)
    torch.testing.assert_close(db, want_b)
    # Only the weight: no db either.
    seen.clear()
    torch.autograd.grad(conv2d_nhwc(x, wt, b.detach(), 4, 2).sum(), (wt,))
    assert seen == [(False, True, False)]


def test_backward_op_partial_requests_cpu(counted_fallbacks):
    x, wt, _ = _leaves(2, 7, 9, 8, 16, 3)
    gy = torch.randn(2, 4, 5, 16, dtype=torch.float64)
    dx, dw, db = conv2d_nhwc_backward(gy, x, wt, 2, 1, True, False, True)
    assert dw.shape == (0,) and dx.shape == x.shape and db.shape == (16,)
    want = _torch_grads(x, wt, torch.zeros(16, dtype=torch.float64), 2, 1, gy)
    torch.testing.assert_close(dx, want[0])
    torch.testing.assert_close(db, want[2])
    dx, dw, db = conv2d_nhwc_backward(gy, x, wt, 2, 1, False, True, False)
    assert dx.shape == (0,) and db.shape == (0,)
    torch.testing.assert_close(dw, want[1])
    # 16-bit inputs: fp32 math, rounded once
    h = conv2d_nhwc_backward(gy.bfloat16(), x.bfloat16(), wt.bfloat16(), 2, 1)
    assert all(t.dtype == torch.bfloat16 for t in h)


def test_conv_backward_raises_on_bad_input():
    x, wt, _ = _leaves(2, 7, 9, 8, 16, 3)
    gy = torch.randn(2, 4, 5, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="grad must be the output's shape"):
        conv2d_nhwc_backward(gy[:, :3], x, wt, 2, 1)
    with pytest.raises(ValueError, match="stride must be >= 1"):
        conv2d_nhwc_backward(gy, x, wt, 0, 1)
    with pytest.raises(TypeError, match="grad is torch.float32"):
        conv2d_nhwc_backward(gy.float(), x, wt, 2, 1)
    with pytest.raises(TypeError, match="floating-point"):
        conv2d_nhwc_backward(gy.long(), x, wt, 2, 1)
    with pytest.raises(ValueError, match="do not match"):
        conv2d_nhwc_backward(gy, x[..., :4], wt, 2, 1)


def test_opcheck_and_compile_cpu(counted_fallbacks):
    x, wt, b = _leaves(2, 7, 9, 8, 16, 3, dtype=torch.float32)
    gy = torch.randn(2, 4, 5, 16)
    for needs in ((True, True, True), (False, True, True), (True, False, False)):
        torch.library.opcheck(torch.ops.cvt_cutlass.conv2d_nhwc_backward.default, (gy, x, wt, 2, 1, *needs))
    leaves = tuple(t.clone().requires_grad_() for t in (x, wt, b))
    torch.library.opcheck(torch.ops.cvt_cutlass.conv2d_nhwc.default, (*leaves, 2, 1))

    def step(x, w, b):
        return conv2d_nhwc(x, w, b, 2, 1).square().sum()

    want = torch.autograd.grad(step(*leaves), leaves)
    got = torch.autograd.grad(torch.compile(step, backend="aot_eager", fullgraph=True)(*leaves), leaves)
    for a, t in zip(got, want, strict=True):
        torch.testing.assert_close(a, t)


# ----------------------------------------------------------------------------- GPU
def _ragged_layers() -> list[ConvLayer]:
    """Odd sizes, K = 72 (not a multiple of the tiles), stride 4 with a 7x7 filter on a 3-channel
    (padded to 4) image of odd size, and stride 2 on 8 channels."""
    return [ConvLayer("ragged.stem", "embed", 3, 61, 47, 3, 64, 7, 4, 2, 0, 1),
            ConvLayer("ragged.k72", "embed", 2, 29, 23, 64, 72, 3, 2, 1, 0, 1),
            ConvLayer("ragged.c8", "embed", 1, 15, 17, 8, 16, 3, 2, 1, 0, 1),
            ConvLayer("ragged.s1", "embed", 2, 13, 11, 16, 24, 3, 1, 1, 0, 1)]


def _bwd_cases():
    out = []
    for model, size in (("cvt-13", 224), ("cvt-w24", 384), ("cvt-13", (225, 223))):
        for layer in conv_problems(model, 2, size):
            if layer.kind == "embed":
                out.append(pytest.param(layer, id=f"{model}-{size}-{layer.label}"))
    return out + [pytest.param(layer, id=layer.label) for layer in _ragged_layers()]


def _gpu_inputs(layer, dtype, seed):
    """(x NHWC padded to the kernels' channels, w KRSC padded, b, dy) on the GPU in ``dtype``; the
    float64 originals (x NCHW, w KCRS) for the reference."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    c = stem_channels(layer.c)
    x = torch.randn(layer.n, layer.c, layer.h, layer.w, device="cuda", generator=g, dtype=torch.float64)
    w = torch.randn(layer.k, layer.c, layer.r, layer.r, device="cuda", generator=g, dtype=torch.float64)
    w = w / (layer.r * layer.c ** 0.5)
    b = 0.5 * torch.randn(layer.k, device="cuda", generator=g, dtype=torch.float64)
    dy = torch.randn(layer.n, layer.p, layer.q, layer.k, device="cuda", generator=g, dtype=torch.float64)
    x, w, b, dy = (t.to(dtype).double() for t in (x, w, b, dy))  # the same values at every precision
    return image_to_nhwc(x, c).to(dtype), conv_filter_krsc(w, c).to(dtype), b.to(dtype), dy, x, w, b


def _reference_grads(x, w, b, dy, layer, dtype, need_x):
    """PyTorch's (cuDNN's) grads of the NCHW conv in ``dtype`` (float64 for the reference): (dx NHWC | None, dw KRSC, db)."""
    xs = x.to(dtype).requires_grad_(need_x)
    ws, bs = w.to(dtype).requires_grad_(), b.to(dtype).requires_grad_()
    y = F.conv2d(xs, ws, bs, layer.stride, layer.pad)
    leaves = ([xs] if need_x else []) + [ws, bs]
    gr = torch.autograd.grad(y, leaves, dy.to(dtype).permute(0, 3, 1, 2))
    return (gr[0].permute(0, 2, 3, 1) if need_x else None), gr[-2].permute(0, 2, 3, 1), gr[-1]


def _check(label, dtype, path, name, got, ref, same):
    assert not torch.isnan(got).any(), f"NaN in {name} (unwritten or broken kernel)"
    err = float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))
    err_torch = float((same.double() - ref).norm() / ref.norm().clamp_min(1e-30))
    _record("conv2d_nhwc", label, dtype, path, name, err, err_torch)
    assert err <= 2 * err_torch + FLOOR[dtype], (name, err, err_torch)


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("layer", _bwd_cases())
def test_conv_gradients_gpu(strict_fallbacks, path, dtype, layer):
    """dx (when the input has a multiple of 8 channels: stages 2 and 3), dw and db through
    conv2d_nhwc's autograd vs float64, next to cuDNN's error in the same dtype."""
    tdt = DTYPES[dtype]
    need_x = layer.c % 8 == 0
    x4, w4, b, dy, x, w, b64 = _gpu_inputs(layer, tdt, hash(layer.label) % 1000)
    leaves = [x4.requires_grad_(need_x), w4.requires_grad_(), b.requires_grad_()]
    with runtime.kernel_path(path):
        y = conv2d_nhwc(*leaves, layer.stride, layer.pad)
        got = torch.autograd.grad(y, leaves if need_x else leaves[1:], dy.to(tdt))
    torch.cuda.synchronize()
    ref = _reference_grads(x, w, b64, dy, layer, torch.float64, need_x)
    same = _reference_grads(x, w, b64, dy, layer, tdt, need_x)
    c = layer.c
    got = ([got[0]] if need_x else [None]) + list(got[-2:])
    for name, i in (("dx", 0), ("dw", 1), ("db", 2)):
        if got[i] is None:
            continue
        g = got[i][..., :c] if name != "db" else got[i]
        _check(layer.label, tdt, path, name, g, ref[i], same[i])
    if c != stem_channels(c):  # the padded channel's weight gradient is exactly zero
        assert torch.count_nonzero(got[1][..., c:]) == 0


@requires_sm80
def test_stem_image_grad_falls_back_visibly_gpu(counted_fallbacks):
    """An image that requires grad (C = 4): its dx runs PyTorch, counted with the reason, while dw
    and db still run on the wgrad kernel; strict mode raises."""
    layer = conv_problems("cvt-13", 2, 64)[0]
    x4, w4, b, dy, x, w, b64 = _gpu_inputs(layer, torch.float16, 7)
    leaves = [x4.requires_grad_(), w4.requires_grad_(), b.requires_grad_()]
    y = conv2d_nhwc(*leaves, layer.stride, layer.pad)
    dx, dw, db = torch.autograd.grad(y, leaves, dy.half())
    stats = counted_fallbacks.stats()
    assert stats["fallbacks"].get("conv2d_nhwc_backward:channels") == 1
    assert stats["kernel_calls"].get("conv2d_nhwc_backward") == 1  # the wgrad kernel
    ref = _reference_grads(x, w, b64, dy, layer, torch.float64, True)
    same = _reference_grads(x, w, b64, dy, layer, torch.float16, True)
    _check("stem.dx", torch.float16, "auto", "dx", dx[..., :3], ref[0], same[0])
    _check("stem.dw", torch.float16, "auto", "dw", dw[..., :3], ref[1], same[1])
    fallback.set_strict(True)  # (the fixture restores the mode)
    y = conv2d_nhwc(*leaves, layer.stride, layer.pad)
    with pytest.raises(RuntimeError, match="conv2d_nhwc_backward: no CUTLASS kernel .*channels"):
        torch.autograd.grad(y, leaves, dy.half())


@requires_sm80
def test_fp32_backward_is_a_strict_fallback_gpu(strict_fallbacks):
    x, wt, b = _leaves(2, 9, 9, 8, 16, 3, dtype=torch.float32, device="cuda")
    with pytest.raises(RuntimeError, match="no CUTLASS kernel for this call .dtype"):
        conv2d_nhwc_backward(torch.randn(2, 5, 5, 16, device="cuda"), x, wt, 2, 1)


def _raw_kernels(dtype="fp16", c=64, k=192):
    arch = runtime.arch_for(runtime.device_info(torch.cuda.current_device()).cc)
    m = 2 * 14 * 14
    dg = select_conv2d_backward("dgrad", m, k, 9 * c, c, dtype, arch, None).spec
    wg = select_conv2d_backward("wgrad", m, k, 9 * c, c, dtype, arch, None).spec
    return runtime.load_kernel(dg, CUDA_CC), runtime.load_kernel(wg, CUDA_CC)


@requires_sm80
def test_wgrad_splits_are_deterministic_and_agree_gpu():
    """Explicit split counts (1, 3, 7, auto) give the same dw up to fp32 summation order, each
    bitwise reproducible; db does not depend on the splits."""
    _, wg = _raw_kernels()
    x, wt, _ = _leaves(2, 28, 28, 64, 192, 3, dtype=torch.float16, device="cuda")
    dy = torch.randn(2, 14, 14, 192, device="cuda", dtype=torch.float16)
    outs = {}
    for splits in (1, 3, 7, 0):
        dw, db = torch.empty_like(wt), torch.empty(192, device="cuda", dtype=torch.float16)
        torch.ops.cvt_cutlass_C.conv2d_bwd(wg, dy, x, wt, None, dw, db, 1, 2, splits)
        dw2, db2 = torch.empty_like(wt), torch.empty_like(db)
        torch.ops.cvt_cutlass_C.conv2d_bwd(wg, dy, x, wt, None, dw2, db2, 1, 2, splits)
        assert torch.equal(dw, dw2) and torch.equal(db, db2)
        outs[splits] = (dw, db)
    want = torch.nn.grad.conv2d_weight(x.permute(0, 3, 1, 2).float(), (192, 64, 3, 3), dy.permute(0, 3, 1, 2).float(),
                                       2, 1).permute(0, 2, 3, 1)
    for dw, db in outs.values():
        torch.testing.assert_close(dw.float(), want, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(db.float(), dy.float().sum((0, 1, 2)), atol=2e-2, rtol=1e-2)


@requires_sm80
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("shape", [(2, 224, 224, 64), (3, 61, 48, 128), (1, 9, 16, 64)],
                         ids=["cvt13-b2", "ragged-k128", "tiny"])
def test_row_window_wgrad_gpu(dtype, stages, shape):
    """The stem's row-window wgrad by name (7 x 7, stride 4, pad 2, the 3 channels padded to 4)
    against float64, next to cuDNN's error at the same precision; 1, 5 and the automatic count of
    CTAs, each bitwise reproducible into NaN-filled outputs; the padded channel's dw exactly zero."""
    n, h, w, k = shape
    tdt = DTYPES[dtype]
    kern = runtime.load_kernel(ConvRowsWgradSpec(dtype, 7, stages), CUDA_CC)
    layer = ConvLayer("rows", "embed", n, h, w, 3, k, 7, 4, 2, 0, 1)
    x4, w4, _, dy, x, wt, b64 = _gpu_inputs(layer, tdt, 11)
    ref = _reference_grads(x, wt, b64, dy, layer, torch.float64, False)
    same = _reference_grads(x, wt, b64, dy, layer, tdt, False)
    dyt = dy.to(tdt).contiguous()
    for splits in (1, 5, 0):
        runs = []
        for _ in range(2):
            dw, db = torch.full_like(w4, float("nan")), torch.full((k,), float("nan"), device="cuda", dtype=tdt)
            torch.ops.cvt_cutlass_C.conv2d_bwd(kern, dyt, x4, w4, None, dw, db, layer.pad, layer.stride, splits)
            runs.append((dw, db))
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
        dw, db = runs[0]
        _check("rows.stem", tdt, "raw", "dw", dw[..., :3], ref[1], same[1])
        _check("rows.stem", tdt, "raw", "db", db, ref[2], same[2])
        assert torch.count_nonzero(dw[..., 3:]) == 0


@pytest.mark.skipif(CUDA_CC != 90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("tile", [(64, 64, 64), (64, 128, 64), (128, 128, 64)], ids=lambda t: "x".join(map(str, t)))
def test_sm90_wgrad_kernels_match_float64_gpu(tile, dtype):
    """The CUTLASS 3.x SM90 wgrad by name on every embedding conv TMA can read (C % 8 == 0) of
    CvT-13 and CvT-W24 and a ragged one, into NaN-filled outputs, dw and db against float64 next to
    cuDNN's error at the same precision; two runs bitwise equal."""
    tdt = DTYPES[dtype]
    kern = runtime.load_kernel(Conv90WgradSpec(dtype, tile), CUDA_CC)
    layers = [lay for model, size in (("cvt-13", 224), ("cvt-w24", 384)) for lay in conv_problems(model, 2, size)
              if lay.kind == "embed" and lay.c % 8 == 0] + _ragged_layers()[1:3]
    for layer in layers:
        x4, w4, _, dy, x, wt, b64 = _gpu_inputs(layer, tdt, 13)
        runs = []
        for _ in range(2):
            dw, db = torch.full_like(w4, float("nan")), torch.full((layer.k,), float("nan"), device="cuda", dtype=tdt)
            torch.ops.cvt_cutlass_C.conv2d_bwd(kern, dy.to(tdt).contiguous(), x4, w4, None, dw, db, layer.pad,
                                               layer.stride, 0)
            runs.append((dw, db))
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), layer.label
        ref = _reference_grads(x, wt, b64, dy, layer, torch.float64, False)
        same = _reference_grads(x, wt, b64, dy, layer, tdt, False)
        _check(layer.label, tdt, "sm90", "dw", runs[0][0], ref[1], same[1])
        _check(layer.label, tdt, "sm90", "db", runs[0][1], ref[2], same[2])


@requires_sm80
def test_row_window_wgrad_ignores_columns_no_window_reads_gpu():
    """A 226-wide image under a 7 x 7 / 4 / 2 conv: its last column is in no pixel's window. An Inf
    there leaves PyTorch's dw finite, and the row-window wgrad's too (the pixels past Q, whose dy is
    zero, would read it: the loads stop at the last tap any pixel uses)."""
    layer = ConvLayer("rows", "embed", 2, 17, 226, 3, 64, 7, 4, 2, 0, 1)
    kern = runtime.load_kernel(ConvRowsWgradSpec("bf16", 7, 3), CUDA_CC)
    x4, w4, _, dy, x, wt, b64 = _gpu_inputs(layer, torch.bfloat16, 5)
    x4[:, :, 225, :3] = float("inf")
    x[:, :, :, 225] = float("inf")
    dw, db = torch.empty_like(w4), torch.empty(64, device="cuda", dtype=torch.bfloat16)
    torch.ops.cvt_cutlass_C.conv2d_bwd(kern, dy.bfloat16().contiguous(), x4, w4, None, dw, db, layer.pad,
                                       layer.stride, 0)
    ref = _reference_grads(x, wt, b64, dy, layer, torch.float64, False)
    assert torch.isfinite(ref[1]).all() and torch.isfinite(dw).all()
    _check("rows.edge", torch.bfloat16, "raw", "dw", dw[..., :3], ref[1], ref[1].to(torch.bfloat16))


@requires_sm80
def test_raw_conv_backward_launches_check_their_arguments_gpu():
    dg, wg = _raw_kernels()
    x, wt, _ = _leaves(2, 28, 28, 64, 192, 3, dtype=torch.float16, device="cuda")
    dy = torch.randn(2, 14, 14, 192, device="cuda", dtype=torch.float16)
    dx, dw = torch.empty_like(x), torch.empty_like(wt)
    raw = torch.ops.cvt_cutlass_C.conv2d_bwd
    with pytest.raises(RuntimeError, match="needs dx like"):
        raw(dg, dy, x, wt, None, dw, None, 1, 2)
    with pytest.raises(RuntimeError, match="needs dw like"):
        raw(wg, dy, x, wt, dx, None, None, 1, 2)
    with pytest.raises(RuntimeError, match="is not the output of"):
        raw(dg, dy, x, wt, dx, None, None, 1, 1)
    with pytest.raises(RuntimeError, match="do not describe one conv"):
        raw(wg, dy[..., :64].contiguous(), x, wt, None, dw, None, 1, 2)
    with pytest.raises(RuntimeError, match="splits must be"):
        raw(wg, dy, x, wt, None, dw, None, 1, 2, 1000)
    fwd = runtime.load_kernel(select_conv2d(2 * 14 * 14, 192, 9 * 64, 64, "fp16", 89, None).spec, CUDA_CC)
    with pytest.raises(RuntimeError, match="cvt_conv2d_fwd_.* is not a conv backward kernel"):
        raw(fwd, dy, x, wt, dx, None, None, 1, 2)
    raw(dg, dy, x, wt, dx, None, None, 1, 2)  # a good call
    want = torch.nn.grad.conv2d_input((2, 64, 28, 28), wt.permute(0, 3, 1, 2).float(), dy.permute(0, 3, 1, 2).float(),
                                      2, 1).permute(0, 2, 3, 1)
    torch.testing.assert_close(dx.float(), want, atol=2e-2, rtol=1e-2)


@requires_sm80
def test_opcheck_conv_backward_gpu(strict_fallbacks):
    x, wt, _ = _leaves(2, 28, 28, 64, 192, 3, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(2, 14, 14, 192, device="cuda", dtype=torch.bfloat16)
    for needs in ((True, True, True), (False, True, False)):
        torch.library.opcheck(torch.ops.cvt_cutlass.conv2d_nhwc_backward.default, (dy, x, wt, 2, 1, *needs))


def test_conv_passes_bench_lists_its_kernels():
    """bench --op conv --pass bwd: per embedding conv its forward and wgrad kernels, dgrad for the
    inputs that require grad (stages 2 and 3); the stem's weight gradient on the row-window kernel
    (its window fits), the other backward kernels SM80-class or (a weight gradient the sm90 table
    names) the SM90 one."""
    from cvt_cutlass.tools.bench import passes

    layers = passes.conv_layers("cvt-13", 8)
    assert [layer.label for layer in layers] == ["s1.embed", "s2.embed", "s3.embed"]
    specs = passes.kernel_specs("conv", 8, "bf16", 90, None)
    passes_of = sorted(s.pass_ for s in specs)
    assert passes_of.count("wgrad") >= 1 and passes_of.count("dgrad") >= 1 and passes_of.count("fwd") >= 1
    stem = [s for s in specs if isinstance(s, ConvRowsWgradSpec)]
    assert len(stem) == 1 and stem[0].serves(STEM_WINDOW)
    assert all(s.arch == 89 or isinstance(s, Conv90WgradSpec) for s in specs if s.pass_ != "fwd")
    assert all(s.pass_ == "wgrad" for s in specs if isinstance(s, Conv90WgradSpec))


@requires_sm80
def test_conv_passes_bench_prebuilds_what_its_rows_load_gpu(strict_fallbacks, loaded_kernels):
    """Every kernel the conv rows load (forward and backward) is in kernel_specs(), and the rows
    run in strict mode (no fallback: the stem's image asks for no dx)."""
    from cvt_cutlass.tools.bench import passes

    loaded = loaded_kernels
    dev = runtime.device_info(torch.cuda.current_device())
    gen = torch.Generator(device="cuda").manual_seed(0)
    for layer in passes.conv_layers("cvt-13", 2):
        (leaves, all_), _, (g, _) = passes._conv_inputs(torch, layer, torch.bfloat16, gen, False)
        torch.autograd.grad(conv2d_nhwc(*all_, layer.stride, layer.pad), leaves, g)
    listed = {s.name for s in passes.kernel_specs("conv", 2, "bf16", runtime.arch_for(dev.cc), dev.name)}
    assert loaded and loaded == listed, (sorted(loaded - listed), sorted(listed - loaded))


# ----------------------------------------------------------------------------- prebuild list
def _bwd_specs(layer, dtype, arch, gpu, need_x):
    c = stem_channels(layer.c)
    m, kk = layer.n * layer.p * layer.q, layer.r * layer.r * c
    window = conv_window(c, layer.k, layer.r, layer.r, layer.w, layer.stride, layer.pad)
    out = [select_conv2d_backward("wgrad", m, layer.k, kk, c, dtype, arch, gpu, window).spec]
    if need_x and c % 8 == 0:
        out.append(select_conv2d_backward("dgrad", m, layer.k, kk, c, dtype, arch, gpu).spec)
    return out


def gpu_kernel_specs(cc: int, gpu: str | None) -> list:
    """The conv backward kernels this module's GPU tests select on a device (cc, gpu)."""
    out = []
    for arch in path_archs(cc):
        for dt in KERNEL_DTYPES:
            for case in _bwd_cases():
                layer = case.values[0]
                out += _bwd_specs(layer, dt, arch, gpu, layer.c % 8 == 0)
    arch = default_arch(cc)
    out += _bwd_specs(conv_problems("cvt-13", 2, 64)[0], "fp16", arch, gpu, False)  # the stem's fallback test
    for dt in ("fp16", "bf16"):  # raw launches, splits, opcheck
        layer = ConvLayer("raw", "embed", 2, 28, 28, 64, 192, 3, 2, 1, 0, 1)
        out += _bwd_specs(layer, dt, arch, gpu, True)
    out.append(select_conv2d(2 * 14 * 14, 192, 9 * 64, 64, "fp16", 89, gpu).spec)  # the family check
    out += [ConvRowsWgradSpec(dt, 7, st) for dt in KERNEL_DTYPES for st in (2, 3)]  # the row kernel by name
    if cc == 90:  # the SM90 wgrad by name
        out += [Conv90WgradSpec(dt, t) for dt in KERNEL_DTYPES for t in ((64, 64, 64), (64, 128, 64), (128, 128, 64))]
    from cvt_cutlass.tools.bench.passes import kernel_specs

    out += kernel_specs("conv", 2, "bf16", arch, gpu)  # the passes bench's rows
    return out


def test_training_sweep_rows_carry_pass_and_selection_key(tmp_path):
    """profile --op conv2d --pass dgrad,wgrad and --op dwconv --pass train: the work list (no stem
    dgrad), the rows' conv_kind / epilogue, and the selection tables keyed as the runtime looks up."""
    from cvt_cutlass.operators.dwconv import dwconv_bn_heuristic
    from cvt_cutlass.operators.selection import SelectionTable

    from cvt_cutlass.tools.sweep.conv import append_conv_rows, candidates_of, conv_row, epilogue_of
    from cvt_cutlass.tools.sweep.driver import read_rows, sweep_items
    from cvt_cutlass.tools.sweep.tables import update_from_rows

    layers = conv_problems("cvt-13", 8)
    emb = [lay for lay in layers if lay.kind == "embed"]
    work = sweep_items([90], ["bf16"], emb, candidates_of, ("dgrad", "wgrad"))
    assert [(it.problem.label, it.pass_) for it in work] == [
        ("s1.embed", "wgrad"), ("s2.embed", "dgrad"), ("s2.embed", "wgrad"), ("s3.embed", "dgrad"),
        ("s3.embed", "wgrad")]
    s3, dwq = emb[2], next(lay for lay in layers if lay.label == "s2.dw_kv")
    base = {"kernel_path": "sm90", "gpu": "Test GPU", "date": "2026-11-23", "cutlass_version": "4.2.0.0"}
    dg = conv_bwd_heuristic("dgrad", "bf16", 192, 384)
    dg2 = dg.with_(tile=(64, 64, 32), stages=5)
    bn = dwconv_bn_heuristic("bf16", 192, 2, 90, "bwd")
    rows = [
        conv_row(0, "pytorch", "cudnn:dgrad_channels_last", "passed", "success", s3, "bf16", 0.2, None, base,
                 pass_="dgrad", epilogue="dgrad"),
        conv_row(0, "cutlass", dg.name, "passed", "success", s3, "bf16", 0.3, dg, base, pass_="dgrad",
                 epilogue="dgrad"),
        conv_row(0, "cutlass", dg2.name, "passed", "success", s3, "bf16", 0.25, dg2, base, pass_="dgrad",
                 epilogue="dgrad"),
        conv_row(1, "cutlass", bn.name, "passed", "success", dwq, "bf16", 0.1, bn, base, pass_="bn_bwd",
                 epilogue=epilogue_of(dwq, "bn_bwd")),
    ]
    path = tmp_path / "conv_bwd.csv"
    append_conv_rows(path, rows)
    back = read_rows(path)
    assert [r["conv_kind"] for r in back] == ["dgrad", "dgrad", "dgrad", "dgrad_wgrad"]
    assert back[3]["epilogue"] == "bn_bwd_st2"
    # the backward of the depthwise projection is dgrad + wgrad: twice the conv's FLOPs
    assert back[3]["Flops"] == str(2 * 2 * 8 * 14 * 14 * 192 * 9)
    update_from_rows(back, str(tmp_path))
    conv_t = SelectionTable.load(tmp_path / "conv2d_selection.csv")
    dw_t = SelectionTable.load(tmp_path / "dwconv_selection.csv")
    assert conv_t.lookup("conv2d", 90, "bf16", "dgrad", 8 * 14 * 14, 384, 9 * 192) == dg2.name
    assert conv_t.rows[0]["peer_ms"] == "0.200000"
    assert dw_t.lookup("dwconv", 90, "bf16", "bn_bwd_st2", 8 * 14 * 14, 192, 9) == bn.name
