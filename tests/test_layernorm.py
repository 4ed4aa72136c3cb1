"""LayerNorm on tokens (layer_norm_tokens, the LayerNorm kernel family): CPU and GPU.

CPU: spec names and rules, the heuristic's split of a row, real nvcc compiles for sm_89 and
sm_90a (library info, exports, no spills), the reference against nn.LayerNorm and torch.cat,
visible fallbacks, argument errors, autograd through the fallback.
GPU: every LayerNorm shape of CvT-13 / W24 (and odd row counts, strided rows, the cls prefix,
b = 1) in strict mode against float64; nothing written outside the output; (mean, rstd) stats;
opcheck; CUDA graph; backward.
"""

from __future__ import annotations

import pytest
import torch
from cvt_cutlass.operators.layernorm import (
    LayerNormSpec,
    channels_supported,
    layernorm_candidates,
    layernorm_heuristic,
    layernorm_problems,
)
from cvt_cutlass.operators.spec import SpecError, parse_kernel_name

import cvt_cutlass
from cvt_cutlass import build, runtime
from cvt_cutlass.ops.layernorm import layer_norm_tokens, layer_norm_tokens_reference

from .conftest import CUDA_CC, DTYPES, PATHS, graph_replayed, no_kernel_body, requires_nvcc, requires_sm80
from .gpu_kernels import default_arch, layernorm_spec, path_archs
from .test_build import build_and_check


# ----------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("arch", [89, 90])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_names_round_trip(arch, dtype):
    for c in (64, 192, 384, 768, 1024):
        for s in layernorm_candidates(dtype, c, arch) + [layernorm_heuristic(dtype, c, arch)]:
            assert parse_kernel_name(s.name) == s
            assert f"_c{c}_" in s.name and s.channels % (8 * s.lanes) == 0
    with pytest.raises(SpecError, match="not a valid layernorm fwd kernel variant"):
        parse_kernel_name("cvt_layernorm_fwd_sm89_f16_blc_bias_k3_st1_p2_b256")
    with pytest.raises(SpecError, match="unknown op"):
        parse_kernel_name("cvt_groupnorm_fwd_sm89_f16_blc_c64_l8_b256")


def test_heuristic_splits_rows_evenly():
    assert (layernorm_heuristic("fp16", 64, 90).lanes, layernorm_heuristic("fp16", 64, 90).vecs) == (8, 1)
    assert (layernorm_heuristic("fp16", 192, 90).lanes, layernorm_heuristic("fp16", 192, 90).vecs) == (8, 3)
    assert (layernorm_heuristic("fp16", 384, 90).lanes, layernorm_heuristic("fp16", 384, 90).vecs) == (16, 3)
    assert (layernorm_heuristic("bf16", 1024, 89).lanes, layernorm_heuristic("bf16", 1024, 89).vecs) == (32, 4)
    assert layernorm_heuristic("fp16", 8, 90).lanes == 1
    assert not channels_supported(100) and not channels_supported(8 * 32 * 17) and channels_supported(4096)
    with pytest.raises(SpecError, match="no LayerNorm kernel for 100"):
        layernorm_heuristic("fp16", 100, 90)


def test_spec_rules():
    with pytest.raises(SpecError, match="of 8 \\* lanes"):
        LayerNormSpec(90, "fp16", 64, 16)
    with pytest.raises(SpecError, match="power of two"):
        LayerNormSpec(90, "fp16", 96, 3)
    with pytest.raises(SpecError, match="at most 16"):
        LayerNormSpec(90, "fp16", 1024, 4)
    with pytest.raises(SpecError, match="arch"):
        LayerNormSpec(80, "fp16", 64, 8)
    with pytest.raises(SpecError, match="dtype"):
        LayerNormSpec(90, "fp32", 64, 8)


def test_problems_cover_the_model():
    probs = layernorm_problems("cvt-13", 2)
    assert sum(p.count for p in probs) == 3 + 1 + 2 * (1 + 2 + 10)  # 3 embeddings, head, 2 per block
    emb3 = next(p for p in probs if p.label == "s3.embed_ln")
    assert (emb3.rows, emb3.channels, emb3.prefix) == (2 * 196, 384, 1)
    assert next(p for p in probs if p.label == "s3.ln1").rows == 2 * 197
    assert {p.channels for p in layernorm_problems("cvt-w24", 1, 384)} == {192, 768, 1024}
    names = {s.name for s in cvt_cutlass.kernels_for("layernorm", [89, 90], dtype="fp16")}
    assert names == {layernorm_heuristic("fp16", c, a).name for c in (64, 192, 384) for a in (89, 90)}


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("target", ["sm_89", "sm_90a"])
def test_real_compiles(target):
    arch = 90 if target == "sm_90a" else 89
    specs = [LayerNormSpec(arch, "fp16", 64, 8), LayerNormSpec(arch, "bf16", 1024, 32)]
    build_and_check(specs, target, lambda s: 5, "norm")


@pytest.mark.parametrize("pass_, vec", [("fwd", 8), ("bwd", 8), ("bwd", 4)])
def test_fp32_stream_variants_are_named_and_instantiated(pass_, vec):
    """io "xf32" / "yf32": fp32 x (with dx and the residual gradient) or fp32 y (dy), named after
    the rest of the variant; the weights stay 16-bit; any other io is refused."""
    bf = "cutlass::bfloat16_t"
    for io, x, y in (("xf32", "float", bf), ("yf32", bf, "float")):
        s = LayerNormSpec(89, "bf16", 384, 32 if vec == 4 else 16, 256, pass_, vec, io)
        assert s.name.endswith(f"_{io}") and parse_kernel_name(s.name) == s
        src = s.instantiation()
        tail = f", {x}, {y}>;" if pass_ == "fwd" else f", {vec}, {x}, {y}>;"
        assert f"LayerNorm{pass_.capitalize()}<{bf}, 384, " in src and tail in src
    with pytest.raises(SpecError, match="io must be"):
        LayerNormSpec(90, "bf16", 64, 8, io="xf16")
    if pass_ == "fwd":
        with pytest.raises(SpecError, match="backward's"):
            LayerNormSpec(90, "bf16", 64, 8, io="xf32r16").validate()
    else:  # fp32 x and dx, the residual gradient in the weights' dtype
        s = LayerNormSpec(89, "bf16", 384, 32 if vec == 4 else 16, 256, pass_, vec, "xf32r16")
        assert s.name.endswith("_xf32r16") and parse_kernel_name(s.name) == s
        assert f", {vec}, float, {bf}, {bf}>;" in s.instantiation()


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("target", ["sm_89", "sm_90a"])
def test_real_compiles_of_the_fp32_stream_variants(target):
    """The forward and the backward with fp32 x and with fp32 y (and the backward with fp32 x beside a
    16-bit residual gradient) build without spills."""
    arch = 90 if target == "sm_90a" else 89
    build_and_check([LayerNormSpec(arch, "bf16", 64, 4, io="xf32"), LayerNormSpec(arch, "fp16", 192, 8, io="yf32")],
                    target, lambda s: 5, "norm")
    build_and_check([LayerNormSpec(arch, "bf16", 64, 8, 256, "bwd", 8, "xf32"),
                     LayerNormSpec(arch, "bf16", 384, 32, 256, "bwd", 4, "yf32"),
                     LayerNormSpec(arch, "fp16", 192, 16, 256, "bwd", 4, "xf32r16")], target, lambda s: 7, "normbwd")


def test_instantiation_is_the_headers_template_with_its_parameters():
    fwd = LayerNormSpec(90, "fp16", 64, 8).instantiation()
    assert '#include "layernorm/layernorm_fwd.cuh"' in fwd
    assert "LayerNormFwd<cutlass::half_t, 64, 8, 256, cutlass::half_t, cutlass::half_t>" in fwd
    assert no_kernel_body(fwd) and "cvt_norm_launch" in fwd
    bwd = LayerNormSpec(89, "bf16", 384, 32, 256, "bwd", 4).instantiation()
    assert "LayerNormBwd<cutlass::bfloat16_t, 384, 32, 256, 4, cutlass::bfloat16_t, cutlass::bfloat16_t>" in bwd
    assert "cvt_normbwd_launch" in bwd
    # the backward's headers: its own, the forward's (lanes_sum), the shared column sums
    names = {p.name for p in build.project_headers(bwd)}
    assert {"layernorm_bwd.cuh", "layernorm_fwd.cuh", "reduce.cuh", "abi.h"} <= names


def test_reference_matches_layernorm_and_cat():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 10, 64, generator=g) * 3 + 1
    ln = torch.nn.LayerNorm(64)
    with torch.no_grad():
        ln.weight.copy_(torch.rand(64, generator=g) + 0.5)
        ln.bias.copy_(torch.randn(64, generator=g))
    cls = torch.randn(1, 64, generator=g)
    ref = layer_norm_tokens_reference(x, ln.weight, ln.bias, ln.eps, cls)
    expect = torch.cat([cls.expand(3, 1, 64), ln(x)], 1)
    torch.testing.assert_close(ref, expect)


def test_cpu_calls_fall_back_visibly(counted_fallbacks):
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    w, b = torch.rand(64, dtype=torch.bfloat16) + 0.5, torch.randn(64, dtype=torch.bfloat16)
    cls = torch.randn(1, 64, dtype=torch.bfloat16)
    y = layer_norm_tokens(x, w, b, 1e-5, cls)
    assert y.shape == (2, 6, 64) and torch.equal(y[:, 0], cls.expand(2, 64))
    torch.testing.assert_close(y, layer_norm_tokens_reference(x, w, b, 1e-5, cls))
    st = counted_fallbacks.stats()
    assert st["fallbacks"] == {"layer_norm_tokens:device": 1} and not st["kernel_calls"]


def test_argument_errors():
    x = torch.randn(2, 5, 64)
    w, b = torch.ones(64), torch.zeros(64)
    with pytest.raises(ValueError, match="tokens"):
        layer_norm_tokens(x[0], w, b, 1e-5)
    with pytest.raises(ValueError, match="weight must be"):
        layer_norm_tokens(x, torch.ones(32), b, 1e-5)
    with pytest.raises(ValueError, match="prefix must be"):
        layer_norm_tokens(x, w, b, 1e-5, torch.zeros(1, 32))
    with pytest.raises(ValueError, match="eps"):
        layer_norm_tokens(x, w, b, 0.0)
    with pytest.raises(TypeError, match="bias is torch.float16"):
        layer_norm_tokens(x, w, b.half(), 1e-5)


def test_backward_through_the_op_cpu(counted_fallbacks):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 64, generator=g, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(64, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(64, generator=g, dtype=torch.float64, requires_grad=True)
    cls = torch.randn(1, 64, generator=g, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda *a: layer_norm_tokens(*a[:3], 1e-5, a[3]), (x, w, b, cls))


def test_fp32_residual_stream_cpu(counted_fallbacks):
    """16-bit weights with fp32 x (a layer's LayerNorm on an fp32 stream: 16-bit output) or an
    fp32 output (an embedding's, with an fp32 cls prefix): the reference's values and dtypes,
    under fake tensors too; the gradients: dx in x's dtype, the weight's in the weight's; other
    dtype mixes raise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cvt_cutlass.ops.layernorm import layer_norm_tokens_backward

    g = torch.Generator().manual_seed(5)
    w = (torch.rand(64, generator=g) + 0.5).bfloat16().requires_grad_()
    b = torch.randn(64, generator=g).bfloat16()
    x32 = torch.randn(2, 6, 64, generator=g, requires_grad=True)
    y = layer_norm_tokens(x32, w, b, 1e-5)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, layer_norm_tokens_reference(x32, w, b, 1e-5), atol=0, rtol=0)
    y.float().square().sum().backward()
    assert x32.grad.dtype == torch.float32 and w.grad.dtype == torch.bfloat16
    x16 = torch.randn(2, 6, 64, generator=g).bfloat16().requires_grad_()
    cls = torch.randn(1, 64, generator=g)
    y = layer_norm_tokens(x16, w, b, 1e-5, cls, torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y[:, :1], cls.expand(2, -1, -1))
    torch.testing.assert_close(y, layer_norm_tokens_reference(x16, w, b, 1e-5, cls, torch.float32), atol=0, rtol=0)
    y.square().sum().backward()
    assert x16.grad.dtype == torch.bfloat16
    gy = torch.randn(2, 6, 64, generator=g)
    dx, dw, db = layer_norm_tokens_backward(gy.bfloat16(), x32.detach(), w.detach(), 1e-5, residual_grad=gy)
    assert (dx.dtype, dw.dtype, db.dtype) == (torch.float32, torch.bfloat16, torch.bfloat16)
    ref = layer_norm_tokens_backward(gy.bfloat16().float(), x32.detach(), w.detach().float(), 1e-5, residual_grad=gy)
    torch.testing.assert_close(dx, ref[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="both float32"):
        layer_norm_tokens(x32, w, b, 1e-5, None, torch.float32)
    with pytest.raises(TypeError, match="x is torch.float16 but the weight is torch.bfloat16"):
        layer_norm_tokens(x16.detach().half(), w, b, 1e-5)
    with pytest.raises(TypeError, match="prefix must be torch.float32, got torch.bfloat16"):
        layer_norm_tokens(x16, w, b, 1e-5, cls.bfloat16(), torch.float32)
    with FakeTensorMode():
        fx, fw = torch.empty(2, 6, 64, dtype=torch.bfloat16), torch.empty(64, dtype=torch.bfloat16)
        assert layer_norm_tokens(fx, fw, fw, 1e-5, None, torch.float32).dtype == torch.float32
        assert layer_norm_tokens(fx.float(), fw, fw, 1e-5).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------- GPU
def _inputs(b, rows, c, dtype, g, offset=0.0):
    x = (torch.randn(b, rows, c, device="cuda", generator=g) * 2 + offset).to(dtype)
    w = (torch.rand(c, device="cuda", generator=g) + 0.5).to(dtype)
    bias = torch.randn(c, device="cuda", generator=g).to(dtype)
    return x, w, bias


def _gpu_cases():
    cases = {(p.rows // max(1, b), p.channels, p.prefix, b) for b in (1, 3, 64) for p in layernorm_problems("cvt-13", b)
             if p.label != "head_ln"}
    cases |= {(p.rows, p.channels, p.prefix, 2) for p in layernorm_problems("cvt-w24", 1, 384)}
    cases |= {(1, 384, 0, 5), (7, 64, 0, 3), (33, 192, 1, 2), (0, 64, 1, 2)}  # odd / tiny row counts
    return sorted(cases)


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("rows,c,prefix,b", _gpu_cases())
def test_matches_float64_gpu(rows, c, prefix, b, dtype, path, strict_fallbacks):
    tdt = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(rows * 7 + c)
    x, w, bias = _inputs(b, rows, c, tdt, g, offset=3.0)
    pre = torch.randn(prefix, c, device="cuda", generator=g).to(tdt) if prefix else None
    with runtime.kernel_path(path):
        out = layer_norm_tokens(x, w, bias, 1e-5, pre)
    ref = layer_norm_tokens_reference(x.double(), w.double(), bias.double(), 1e-5,
                                      None if pre is None else pre.double())
    same = layer_norm_tokens_reference(x, w, bias, 1e-5, pre)  # PyTorch's LayerNorm, rounded once
    assert out.shape == (b, prefix + rows, c)
    if prefix:
        assert torch.equal(out[:, :prefix], pre.expand(b, -1, -1))
    err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    err_same = (same.double() - ref).abs().max().item() if out.numel() else 0.0
    assert err <= 1.5 * err_same + 1e-6, (err, err_same)


def _backward_float64(gy, x, w, bias, residual_grad=None):
    """dx (plus the residual gradient) and dweight of the LayerNorm by float64 autograd through
    PyTorch's LayerNorm (the reference; the op's own backward would take a kernel or fall back)."""
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y = layer_norm_tokens_reference(x64, w64, bias.double(), 1e-5)
    dx, dw = torch.autograd.grad(y, (x64, w64), gy.double())
    return (dx if residual_grad is None else dx + residual_grad.double()), dw


@requires_sm80
@pytest.mark.parametrize("layout", ["row_strided", "image_strided", "cls_view"])
def test_strided_inputs_and_no_write_outside_gpu(layout, strict_fallbacks):
    g = torch.Generator(device="cuda").manual_seed(2)
    c = 384
    if layout == "row_strided":  # every other row of a wider buffer (row stride 2C)
        buf = torch.randn(3, 50, 2 * c, device="cuda", generator=g).half()
        x = buf[:, :, :c]
    elif layout == "image_strided":
        buf = torch.randn(3, 60, c, device="cuda", generator=g).half()
        x = buf[:, 5:55]
    else:  # the head's input: the cls row of stage-3 tokens (B, 1, C), image stride 197*C
        buf = torch.randn(4, 197, c, device="cuda", generator=g).half()
        x = buf[:, :1]
    w, b = torch.rand(c, device="cuda", generator=g).half() + 0.5, torch.randn(c, device="cuda", generator=g).half()
    out = layer_norm_tokens(x, w, b, 1e-6)
    torch.testing.assert_close(out, layer_norm_tokens_reference(x, w, b, 1e-6), atol=1e-2, rtol=1e-2)
    # The kernel writes exactly the output: run it into a poisoned larger buffer through the binding.
    spec = layernorm_heuristic("fp16", c, runtime.arch_for(CUDA_CC))
    kid = runtime.load_kernel(spec, CUDA_CC)
    big = torch.full((x.shape[0], x.shape[1] + 4, c), float("nan"), device="cuda", dtype=torch.half)
    y = big[:, 2:-2]
    stats = torch.full((x.shape[0], x.shape[1], 2), float("nan"), device="cuda")
    torch.ops.cvt_cutlass_C.layer_norm(kid, x, w, b, None, y, stats, 1e-6)
    torch.cuda.synchronize()
    assert torch.isnan(big[:, :2]).all() and torch.isnan(big[:, -2:]).all()
    torch.testing.assert_close(y, out, atol=0, rtol=0)
    xf = x.float()
    torch.testing.assert_close(stats[..., 0], xf.mean(-1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(stats[..., 1], torch.rsqrt(xf.var(-1, unbiased=False) + 1e-6), atol=1e-3, rtol=1e-3)


FP32_STREAM_CASES = [(3136, 64, 0, 2), (784, 192, 0, 2), (196, 384, 1, 3), (197, 384, 0, 3), (7, 64, 0, 3)]


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("rows,c,prefix,b", FP32_STREAM_CASES)
def test_fp32_residual_stream_gpu(rows, c, prefix, b, dtype, path, strict_fallbacks):
    """On the _xf32 / _yf32 kernels: a layer's LayerNorm of fp32 x and an embedding's with an fp32
    output (and cls prefix) against float64, the backward of each against the float64 formula
    (the layer's with an fp32 residual gradient added), as close as the 16-bit kernels' own."""
    from cvt_cutlass.ops.layernorm import layer_norm_tokens_backward

    tdt = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(rows + c)
    x, w, bias = _inputs(b, rows, c, tdt, g, offset=3.0)
    x32 = x.float() + 1e-3 * torch.randn(x.shape, device="cuda", generator=g)  # not 16-bit values
    pre = torch.randn(prefix, c, device="cuda", generator=g) if prefix else None
    with runtime.kernel_path(path):
        y_layer = layer_norm_tokens(x32, w, bias, 1e-5)
        y_embed = layer_norm_tokens(x, w, bias, 1e-5, pre, torch.float32)
        gy = torch.randn(b, rows, c, device="cuda", generator=g)
        res = torch.randn(b, rows, c, device="cuda", generator=g)
        dx_layer, dw_layer, _ = layer_norm_tokens_backward(gy.to(tdt), x32, w, 1e-5, residual_grad=res)
        dx_embed, dw_embed, _ = layer_norm_tokens_backward(gy, x, w, 1e-5)
    assert (y_layer.dtype, y_embed.dtype, dx_layer.dtype, dx_embed.dtype) == (tdt, torch.float32, torch.float32, tdt)
    wd, bd = w.double(), bias.double()
    ref_layer = layer_norm_tokens_reference(x32.double(), wd, bd, 1e-5)
    ref_embed = layer_norm_tokens_reference(x.double(), wd, bd, 1e-5, None if pre is None else pre.double())
    half_ulp = {torch.float16: 2**-11, torch.bfloat16: 2**-8}[tdt]
    torch.testing.assert_close(y_layer.double(), ref_layer, atol=1e-3, rtol=2 * half_ulp)
    torch.testing.assert_close(y_embed.double(), ref_embed, atol=1e-4, rtol=1e-4)  # no output rounding
    want = _backward_float64(gy.to(tdt), x32, w, bias, res)
    torch.testing.assert_close(dx_layer.double(), want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dw_layer.double(), want[1], atol=2e-2 * rows ** 0.5, rtol=2 * half_ulp)
    want = _backward_float64(gy, x, w, bias)
    torch.testing.assert_close(dx_embed.double(), want[0], atol=1e-2, rtol=2 * half_ulp)
    torch.testing.assert_close(dw_embed.double(), want[1], atol=2e-2 * rows ** 0.5, rtol=2 * half_ulp)
    # _xf32r16: the residual gradient in 16 bits beside fp32 x (a stage's last layer whose output the
    # next embedding reads rounded): the 16-bit values added exactly, the same bits as the fp32 kernel
    # given them widened
    res16 = res.to(tdt)
    with runtime.kernel_path(path):
        dx16, dw16, db16 = layer_norm_tokens_backward(gy.to(tdt), x32, w, 1e-5, residual_grad=res16)
        dx32, dw32, db32 = layer_norm_tokens_backward(gy.to(tdt), x32, w, 1e-5, residual_grad=res16.float())
    assert dx16.dtype == torch.float32
    assert torch.equal(dx16, dx32) and torch.equal(dw16, dw32) and torch.equal(db16, db32)
    want = _backward_float64(gy.to(tdt), x32, w, bias, res16)
    torch.testing.assert_close(dx16.double(), want[0], atol=1e-4, rtol=1e-4)


@requires_sm80
def test_refusals_gpu(counted_fallbacks):
    g = torch.Generator(device="cuda").manual_seed(3)
    x, w, b = _inputs(2, 9, 100, torch.half, g)  # 100 channels: no kernel
    layer_norm_tokens(x, w, b, 1e-5)
    x2, w2, b2 = _inputs(2, 9, 64, torch.float32, g)
    layer_norm_tokens(x2, w2, b2, 1e-5)
    x3 = torch.randn(2, 9, 65, device="cuda").half()[..., 1:]  # misaligned rows
    layer_norm_tokens(x3, w.new_ones(64), w.new_zeros(64), 1e-5)
    fb = counted_fallbacks.stats()["fallbacks"]
    assert fb == {"layer_norm_tokens:channels": 1, "layer_norm_tokens:dtype": 1, "layer_norm_tokens:layout": 1}


@requires_sm80
def test_opcheck_graph_and_backward_gpu(strict_fallbacks):
    g = torch.Generator(device="cuda").manual_seed(4)
    x, w, b = _inputs(3, 196, 384, torch.bfloat16, g)
    cls = torch.randn(1, 384, device="cuda", generator=g).bfloat16()
    torch.library.opcheck(torch.ops.cvt_cutlass.layer_norm_tokens.default, (x, w, b, 1e-5, cls))
    eager = layer_norm_tokens(x, w, b, 1e-5, cls)
    out = graph_replayed(lambda: layer_norm_tokens(x, w, b, 1e-5, cls))
    assert torch.equal(out, eager)
    xr = x.detach().clone().requires_grad_()
    wr = w.detach().clone().requires_grad_()
    y = layer_norm_tokens(xr, wr, b, 1e-5, cls)
    y.float().square().sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    layer_norm_tokens_reference(x2, w2, b, 1e-5, cls).float().square().sum().backward()
    # the gradients are the reference's vjp at the kernel's output, which differs from the
    # reference's by bf16 rounding: compare at bf16 tolerance
    torch.testing.assert_close(xr.grad, x2.grad, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(wr.grad, w2.grad, atol=3e-1, rtol=3e-2)


def gpu_kernel_specs(cc: int, gpu: str | None) -> list:
    """The LayerNorm kernels this module's GPU tests select or load on a device (cc, gpu), for
    tests/gpu_kernels.py to prebuild: the float64 sweep (_gpu_cases x dtypes x paths: rows = B*L),
    then on the default path the strided views (150, 150 and 4 rows of 384), the heuristic kernel
    they run by spec, and opcheck/graph/backward (3 x 196 rows, bf16). The refusals fall back."""
    out = [layernorm_spec(b * rows, c, dt, arch, gpu)
           for arch in path_archs(cc) for dt in DTYPES for rows, c, _, b in _gpu_cases()]
    out += [layernorm_spec(b * rows, c, dt, arch, gpu, pass_, io) for arch in path_archs(cc) for dt in DTYPES
            for rows, c, _, b in FP32_STREAM_CASES for pass_ in ("fwd", "bwd") for io in ("xf32", "yf32")]
    out += [layernorm_spec(b * rows, c, dt, arch, gpu, "bwd", "xf32r16") for arch in path_archs(cc) for dt in DTYPES
            for rows, c, _, b in FP32_STREAM_CASES]
    arch = default_arch(cc)
    out += [layernorm_spec(rows, 384, "fp16", arch, gpu) for rows in (3 * 50, 4 * 1)]
    out += [layernorm_heuristic("fp16", 384, arch), layernorm_spec(3 * 196, 384, "bf16", arch, gpu)]
    return [s for s in out if s is not None]
