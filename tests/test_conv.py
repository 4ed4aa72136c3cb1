"""Conv ops (token-embedding conv2d_nhwc, depthwise dwconv_tokens): CPU and GPU.

CPU: spec names, weight preparation (KRSC, channel padding, BatchNorm folding against
nn.BatchNorm2d), the PyTorch references against HF-style NCHW math, fallbacks and errors.
GPU: every conv of CvT-13/21/W24 at 224 and 384, batch 1, 3 and 64, plus an odd 225x223 input,
both dtypes and both kernel paths, in strict mode against a float64 reference; opcheck; CUDA
graphs; the cls row.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from cvt_cutlass.operators.conv2d import (
    Conv90Spec,
    ConvRowsSpec,
    ConvSpec,
    conv_candidates,
    conv_heuristic,
    conv_problems,
    select_conv2d,
)
from cvt_cutlass.operators.dwconv import DwConvSpec, dwconv_candidates
from cvt_cutlass.operators.spec import SpecError, parse_kernel_name

import cvt_cutlass
from cvt_cutlass import build, runtime
from cvt_cutlass.ops.conv2d import (
    conv2d_nhwc,
    conv2d_nhwc_reference,
    conv_filter_krsc,
    image_to_nhwc,
    stem_channels,
)
from cvt_cutlass.ops.dwconv import dwconv_tokens, dwconv_tokens_reference, fold_batchnorm

from .conftest import CUDA_CC, DTYPES, PATHS, graph_replayed, no_kernel_body, requires_nvcc, requires_sm80
from .gpu_kernels import conv2d_spec, default_arch, dwconv_spec, model_cases, path_archs

TOL = {torch.float16: (1e-2, 1e-2), torch.bfloat16: (4e-2, 4e-2)}


# ----------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_conv_names_round_trip(dtype):
    specs = conv_candidates(dtype, 64, 90) + conv_candidates(dtype, 4, 90) + conv_candidates(dtype, 3)
    assert any(s.arch == 90 for s in specs) and all(s.arch == 89 for s in conv_candidates(dtype, 64, 89))
    assert all(s.arch == 89 for s in conv_candidates(dtype, 4, 90))  # TMA cannot read 4-channel rows
    specs += [s for st in (1, 2) for a in (89, 90) for s in dwconv_candidates(dtype, st, a)]
    names = [s.name for s in specs]
    assert len(set(names)) == len(names)
    for s in specs:
        assert parse_kernel_name(s.name) == s
    with pytest.raises(SpecError, match="not a valid conv2d fwd kernel variant"):
        parse_kernel_name("cvt_conv2d_fwd_sm89_f16_nhwc_bias_t128x128x32_w2x2x1_s4_sw1_a8")
    with pytest.raises(SpecError, match="instantiates the passes"):
        parse_kernel_name("cvt_dwconv_wgrad_sm89_f16_nhwc_bias_k3_st1_p2_b256")


def test_conv_spec_rules():
    with pytest.raises(SpecError, match="shared memory"):
        ConvSpec(89, "fp16", (256, 256, 64), (4, 2, 1), 4)
    with pytest.raises(SpecError, match="fixed_channels"):
        ConvSpec(89, "fp16", (128, 64, 32), iterator="fixed_channels", align=3)
    with pytest.raises(SpecError, match="stride"):
        DwConvSpec(90, "fp16", 3)
    assert ConvSpec(89, "fp16", (128, 64, 32), iterator="fixed_channels", align=4).channels_ok(4)
    assert not ConvSpec(89, "fp16", (128, 64, 32), iterator="fixed_channels", align=4).channels_ok(8)
    assert stem_channels(3) == 4 and stem_channels(64) == 64 and stem_channels(12) == 16


def test_conv_forward_emission():
    """Each forward spec instantiates its template (operators/conv2d/fprop_sm80.cuh, fprop_sm90.cuh)
    with its parameters: the iterator and access width of the SM80-class kernel, the SM90 tile (K
    nested, as CUTLASS's conv builder takes it), cluster and stage count; no kernel body in the .cu."""
    stem = ConvSpec(89, "fp16", (128, 64, 32), (2, 2, 1), 4, "fixed_channels", 4).instantiation()
    assert '#include "conv2d/fprop_sm80.cuh"' in stem and "using Kernel = FpropSm80<Config>;" in stem
    assert "kIterator = cutlass::conv::IteratorAlgorithm::kFixedChannels;" in stem and "kAlign = 4;" in stem
    assert "using WarpShape = cutlass::gemm::GemmShape<64, 32, 32>;" in stem
    few = ConvSpec(89, "bf16", (64, 64, 32), (2, 2, 1), 5, "few_channels", 1).instantiation()
    assert "IteratorAlgorithm::kFewChannels;" in few and "kAlign = 1;" in few and "cutlass::bfloat16_t" in few
    sm90 = Conv90Spec("fp16", (128, 192, 64), (2, 1, 1)).instantiation()
    assert '#include "conv2d/fprop_sm90.cuh"' in sm90 and "using Kernel = FpropSm90<Config>;" in sm90
    assert "cute::Shape<cute::_128, cute::_192, cute::Shape<cute::_64>>" in sm90 and "kStages = 0;" in sm90
    for src in (stem, few, sm90):
        assert no_kernel_body(src) and "cvt_conv_launch" in src and "cvt_conv_can_implement" in src
    fprop = (build.OPERATORS / "conv2d" / "fprop_sm80.cuh").read_text()
    assert "StrideSupport::kStrided, Cfg::kAlign, Cfg::kAlign>::Kernel" in fprop and "{1.0f, 1.0f}" in fprop
    # the sm_90a kernels include the TMA driver shim before any CUTLASS header (sm90_conv.cuh, first)
    fprop90 = (build.OPERATORS / "conv2d" / "sm90_conv.cuh").read_text()
    assert fprop90.index('#include "common/tma_driver.cuh"') < fprop90.index('#include "cutlass/')
    for name in ("fprop_sm90.cuh", "wgrad_sm90.cuh"):
        text = (build.OPERATORS / "conv2d" / name).read_text()
        assert text.index("#include") == text.index('#include "conv2d/sm90_conv.cuh"')  # its first include

STEM_WINDOW = (4, 64, 7, 7, 224, 4, 2)  # CvT's stem: (C padded to 4, K, R, S, W, stride, pad)


def test_row_window_forward_spec_selection_and_emission():
    """The stem's row-window forward: its name round-trips, its knobs are checked, the heuristic
    and the sweep take it where the window fits (not for CvT-W24's 96-pixel rows at 384), a table
    row naming it serves only such a window, and its .cu instantiates fprop_rows.cuh."""
    rows = conv_candidates("bf16", 4, 90, STEM_WINDOW)
    assert [s.stages for s in rows[:3]] == [2, 3, 4] and all(isinstance(s, ConvRowsSpec) for s in rows[:3])
    assert not any(isinstance(s, ConvRowsSpec) for s in conv_candidates("bf16", 4, 90))
    for spec in rows[:3]:
        assert parse_kernel_name(spec.name) == spec
    assert rows[1].name == "cvt_conv2d_fwd_sm89_bf16_nhwc_bias_rows_r7_s3_k2"
    for bad, why in (({"filter_rows": 9}, "filter rows"), ({"stages": 1}, "stages"), ({"waves": 3}, "CTAs per SM")):
        with pytest.raises(SpecError, match=why):
            ConvRowsSpec("fp16", **bad)
    assert isinstance(conv_heuristic("fp16", 4, 64, 90, STEM_WINDOW), ConvRowsSpec)
    assert isinstance(conv_heuristic("fp16", 4, 192, 90, (4, 192, 7, 7, 384, 4, 2)), ConvSpec)
    assert isinstance(conv_heuristic("fp16", 4, 64, 90), ConvSpec)
    patch8 = (4, 64, 8, 8, 224, 8, 0)  # an 8 x 8 / 8 patch embedding: 2048-element rows, over 96 KB
    assert isinstance(conv_heuristic("fp16", 4, 64, 90, patch8), ConvSpec)
    assert not any(isinstance(s, ConvRowsSpec) for s in conv_candidates("fp16", 4, 90, patch8))
    assert not ConvRowsSpec("fp16", 8, 2).serves(patch8)
    got = select_conv2d(3 * 3136, 64, 196, 4, "fp16", 89, None, STEM_WINDOW).spec
    assert got.channels_ok(4) and (not isinstance(got, ConvRowsSpec) or got.serves(STEM_WINDOW))
    assert not isinstance(select_conv2d(3 * 9216, 192, 196, 4, "fp16", 89, None, (4, 192, 7, 7, 384, 4, 2)).spec,
                          ConvRowsSpec)
    src = rows[1].instantiation()
    assert '#include "conv2d/fprop_rows.cuh"' in src and "using Kernel = FpropRows<Config>;" in src
    assert "static constexpr int kR = 7;" in src and no_kernel_body(src) and "cvt_conv_launch" in src
    assert build.OPERATORS / "conv2d" / "rows_common.cuh" in build.project_headers(src)


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("target", ["sm_89", "sm_90a"])
def test_real_compiles_of_the_row_window_forward(target):
    """nvcc builds the row-window forward for sm_89 and sm_90a (SM80-class code serves both
    paths), without spills."""
    from .test_build import build_and_check

    build_and_check([ConvRowsSpec("bf16", 7, 3), ConvRowsSpec("fp16", 7, 2)], target, lambda s: 2, "conv")


def test_krsc_and_image_padding():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 3, 7, 7, generator=g)
    x = torch.randn(2, 3, 20, 18, generator=g)
    w4, x4 = conv_filter_krsc(w, 4), image_to_nhwc(x, 4)
    assert w4.shape == (64, 7, 7, 4) and x4.shape == (2, 20, 18, 4)
    assert (w4[..., 3] == 0).all() and (x4[..., 3] == 0).all()
    ref = F.conv2d(x, w, None, 4, 2).permute(0, 2, 3, 1)
    torch.testing.assert_close(conv2d_nhwc_reference(x4, w4, None, 4, 2), ref)
    x16 = image_to_nhwc(x, 4, torch.bfloat16)  # converted in the same copy: .to's rounding
    assert x16.dtype == torch.bfloat16 and x16.is_contiguous() and (x16[..., 3] == 0).all()
    assert torch.equal(x16[..., :3], x.permute(0, 2, 3, 1).to(torch.bfloat16))


@pytest.mark.parametrize("cls", [0, 1])
@pytest.mark.parametrize("stride", [1, 2])
def test_batchnorm_folding_matches_hf_sequence(stride, cls):
    """HF's conv projection (split cls, NCHW depthwise conv, BatchNorm in eval, back to tokens,
    cat cls) == dwconv_tokens_reference with folded weights."""
    g = torch.Generator().manual_seed(1)
    c, h, w, b = 16, 9, 7, 2
    conv = torch.nn.Conv2d(c, c, 3, stride, 1, groups=c, bias=False)
    bn = torch.nn.BatchNorm2d(c).eval()
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g))
        bn.running_mean.copy_(torch.randn(c, generator=g))
        bn.running_var.copy_(torch.rand(c, generator=g) + 0.5)
        bn.weight.copy_(torch.randn(c, generator=g))
        bn.bias.copy_(torch.randn(c, generator=g))
    x = torch.randn(b, cls + h * w, c, generator=g, dtype=torch.float64)
    conv, bn = conv.double(), bn.double()
    with torch.no_grad():
        img = x[:, cls:].transpose(1, 2).reshape(b, c, h, w)
        y = bn(conv(img)).flatten(2).transpose(1, 2)
        hf = torch.cat([x[:, :cls], y], 1)
        wf, bf = fold_batchnorm(conv.weight, bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.eps)
        assert wf.shape == (3, 3, c) and wf.dtype == torch.float32 and bf.shape == (c,)
        ours = dwconv_tokens_reference(x, wf.double(), bf.double(), h, w, stride, cls)
    torch.testing.assert_close(ours, hf, atol=1e-5, rtol=1e-5)


def test_cpu_calls_fall_back_visibly(counted_fallbacks):
    x = torch.randn(2, 10, 12, 8).half()
    w = torch.randn(16, 3, 3, 8).half()
    b = torch.randn(16).half()
    y = conv2d_nhwc(x, w, b, 2, 1)
    assert y.shape == (2, 5, 6, 16)
    t = torch.randn(2, 1 + 6 * 5, 8)
    wf, bf = torch.randn(3, 3, 8), torch.randn(8)
    z = dwconv_tokens(t, wf, bf, 6, 5, 2, 1)
    assert z.shape == (2, 1 + 3 * 3, 8) and torch.equal(z[:, 0], t[:, 0])
    s = counted_fallbacks.stats()["fallbacks"]
    assert s == {"conv2d_nhwc:device": 1, "dwconv_tokens:device": 1}


def test_conv_argument_errors():
    x = torch.randn(1, 8, 8, 8)
    with pytest.raises(ValueError, match="do not match"):
        conv2d_nhwc(x, torch.randn(16, 3, 3, 4), None, 1, 1)
    with pytest.raises(TypeError, match="weight is"):
        conv2d_nhwc(x, torch.randn(16, 3, 3, 8).half(), None, 1, 1)
    with pytest.raises(ValueError, match="smaller than the filter"):
        conv2d_nhwc(torch.randn(1, 2, 2, 8), torch.randn(16, 7, 7, 8), None, 1, 0)
    t = torch.randn(1, 17, 8)
    with pytest.raises(ValueError, match="tokens"):
        dwconv_tokens(t, torch.randn(3, 3, 8), None, 4, 4, 1, 0)  # 17 != 0 + 16
    with pytest.raises(TypeError, match="float32"):
        dwconv_tokens(t, torch.randn(3, 3, 8).half(), None, 4, 4, 1, 1)
    with pytest.raises(ValueError, match="odd R"):
        dwconv_tokens(t, torch.randn(2, 2, 8), None, 4, 4, 1, 1)


def test_conv_problems_cover_the_model():
    probs = conv_problems("cvt-13", 2)
    assert [p.label for p in probs] == [f"s{i}.{k}" for i in (1, 2, 3) for k in ("embed", "dw_q", "dw_kv")]
    s1 = probs[0]
    assert (s1.c, s1.k, s1.r, s1.stride, s1.p, s1.q) == (3, 64, 7, 4, 56, 56)
    assert probs[-1].cls == 1 and (probs[-1].p, probs[-1].q) == (7, 7) and probs[-1].count == 20
    odd = conv_problems("cvt-13", 1, (231, 217))
    assert [(p.h, p.w) for p in odd[::3]] == [(231, 217), (58, 54), (29, 27)]
    assert (odd[-1].p, odd[-1].q) == (8, 7)


# ----------------------------------------------------------------------------------- GPU
def _assert_close_to_reference(out, ref64, same_dtype):
    atol, rtol = TOL[out.dtype]
    assert not torch.isnan(out).any(), "NaN in the output (unwritten or broken kernel)"
    torch.testing.assert_close(out.double(), ref64, atol=atol, rtol=rtol)
    err = float((out.double() - ref64).norm() / ref64.norm())
    err_torch = float((same_dtype.double() - ref64).norm() / ref64.norm())
    assert err <= 2 * err_torch + 1e-4, (err, err_torch)


def _embed_inputs(layer, dtype, g):
    c = stem_channels(layer.c)
    x = torch.randn(layer.n, layer.c, layer.h, layer.w, device="cuda", generator=g).to(dtype)
    w = (torch.randn(layer.k, layer.c, layer.r, layer.r, device="cuda", generator=g)
         / math.sqrt(layer.c * layer.r * layer.r)).to(dtype)
    b = (0.5 * torch.randn(layer.k, device="cuda", generator=g)).to(dtype)
    return image_to_nhwc(x, c), conv_filter_krsc(w, c), b, x, w


def _dw_inputs(layer, dtype, g):
    x = torch.randn(layer.n, layer.cls + layer.h * layer.w, layer.c, device="cuda", generator=g).to(dtype)
    w = torch.randn(3, 3, layer.c, device="cuda", generator=g) / 3
    b = 0.5 * torch.randn(layer.c, device="cuda", generator=g)
    return x, w, b


def _gpu_conv_cases():
    return model_cases(conv_problems, (224, 384, (225, 223), (231, 217)), (1, 3, 64))


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("layer", _gpu_conv_cases())
def test_conv_matches_float64_gpu(layer, dtype, path, strict_fallbacks):
    tdt = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(hash(layer.label) % 1000)
    with runtime.kernel_path(path):
        if layer.kind == "embed":
            x4, w4, b, x, w = _embed_inputs(layer, tdt, g)
            out = conv2d_nhwc(x4, w4, b, layer.stride, layer.pad)
            ref = F.conv2d(x.double(), w.double(), b.double(), layer.stride, layer.pad).permute(0, 2, 3, 1)
            same = F.conv2d(x, w, b, layer.stride, layer.pad).permute(0, 2, 3, 1)
        else:
            x, w, b = _dw_inputs(layer, tdt, g)
            out = dwconv_tokens(x, w, b, layer.h, layer.w, layer.stride, layer.cls)
            ref = dwconv_tokens_reference(x.double(), w.double(), b.double(), layer.h, layer.w, layer.stride,
                                          layer.cls)
            # PyTorch's depthwise conv in the same dtype (what HF runs), BN folded in fp32.
            img = x[:, layer.cls:].reshape(layer.n, layer.h, layer.w, layer.c).permute(0, 3, 1, 2)
            y = F.conv2d(img, w.permute(2, 0, 1).unsqueeze(1).to(tdt), b.to(tdt), layer.stride, 1, groups=layer.c)
            same = torch.cat([x[:, :layer.cls], y.flatten(2).transpose(1, 2)], 1)
            assert torch.equal(out[:, :layer.cls], x[:, :layer.cls])
    torch.cuda.synchronize()
    assert out.shape == ref.shape
    _assert_close_to_reference(out, ref, same)


@requires_sm80
def test_conv_ops_opcheck_gpu(strict_fallbacks):
    g = torch.Generator(device="cuda").manual_seed(3)
    layer = conv_problems("cvt-13", 2, 64)[3]  # s2.embed at a small size
    x4, w4, b, _, _ = _embed_inputs(layer, torch.float16, g)
    torch.library.opcheck(torch.ops.cvt_cutlass.conv2d_nhwc.default, (x4, w4, b, layer.stride, layer.pad))
    dw = conv_problems("cvt-13", 2, 64)[8]  # s3.dw_kv with cls
    x, w, b = _dw_inputs(dw, torch.bfloat16, g)
    torch.library.opcheck(torch.ops.cvt_cutlass.dwconv_tokens.default, (x, w, b, dw.h, dw.w, dw.stride, dw.cls))


@requires_sm80
def test_conv_ops_in_cuda_graph_gpu(strict_fallbacks):
    g = torch.Generator(device="cuda").manual_seed(4)
    emb, dw = conv_problems("cvt-13", 4)[0], conv_problems("cvt-13", 4)[7]
    x4, w4, b, _, _ = _embed_inputs(emb, torch.float16, g)
    x, wf, bf = _dw_inputs(dw, torch.float16, g)
    eager = (conv2d_nhwc(x4, w4, b, emb.stride, emb.pad), dwconv_tokens(x, wf, bf, dw.h, dw.w, dw.stride, dw.cls))
    outs = graph_replayed(lambda: (conv2d_nhwc(x4, w4, b, emb.stride, emb.pad),
                                   dwconv_tokens(x, wf, bf, dw.h, dw.w, dw.stride, dw.cls)))
    for o, e in zip(outs, eager, strict=True):
        assert torch.equal(o, e)


@requires_sm80
def test_dwconv_backward_matches_reference_gpu(counted_fallbacks):
    """The eval-mode depthwise conv's forward runs on its kernel; its backward (no kernel: training
    runs the conv + BatchNorm kernels) is PyTorch's, counted as a fallback, and matches the reference."""
    g = torch.Generator(device="cuda").manual_seed(5)
    dw = conv_problems("cvt-13", 2)[7]
    x, w, b = _dw_inputs(dw, torch.float32, g)
    x = x.half().requires_grad_()
    w.requires_grad_()
    y = cvt_cutlass.dwconv_tokens(x, w, b, dw.h, dw.w, dw.stride, dw.cls)
    assert counted_fallbacks.stats()["fallbacks"] == {}
    y.float().square().sum().backward()
    assert counted_fallbacks.stats()["fallbacks"] == {"dwconv_tokens_backward:no_kernel": 1}
    x2 = x.detach().clone().requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    dwconv_tokens_reference(x2, w2, b, dw.h, dw.w, dw.stride, dw.cls).float().square().sum().backward()
    torch.testing.assert_close(x.grad.float(), x2.grad.float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(w.grad, w2.grad, atol=5e-1, rtol=2e-2)


def test_conv_profile_rows_and_selection_tables(tmp_path):
    """Conv2d-schema rows round-trip; the fastest passing kernel per problem lands in the op's
    selection table under the key the runtime looks up."""
    from cvt_cutlass.operators.conv2d import conv_heuristic
    from cvt_cutlass.operators.dwconv import dwconv_heuristic
    from cvt_cutlass.operators.selection import SelectionTable

    from cvt_cutlass.tools.sweep.conv import CONV_COLUMNS, append_conv_rows, conv_row, conv_table_key
    from cvt_cutlass.tools.sweep.driver import read_rows
    from cvt_cutlass.tools.sweep.tables import update_from_rows

    emb, dw = conv_problems("cvt-13", 256)[0], conv_problems("cvt-13", 256)[8]
    base = {"kernel_path": "sm90", "gpu": "Test GPU", "date": "2026-11-21", "cutlass_version": "4.2.0.0"}
    slow, fast = conv_heuristic("fp16", 4, 64), conv_heuristic("fp16", 4, 64).with_(tile=(64, 64, 32), stages=5)
    dws = dwconv_heuristic("fp16", 2, 90)
    rows = [
        conv_row(0, "pytorch", "torch:hf_sequence", "passed", "success", emb, "fp16", 1.4, extra=base),
        conv_row(0, "cutlass", slow.name, "passed", "success", emb, "fp16", 0.5, slow, base),
        conv_row(0, "cutlass", fast.name, "passed", "success", emb, "fp16", 0.4, fast, base),
        conv_row(0, "cutlass", fast.with_(swizzle=2).name, "incorrect", "success", emb, "fp16", 0.1, fast, base),
        conv_row(1, "cutlass", dws.name, "passed", "success", dw, "fp16", 0.03, dws, base),
    ]
    # In-memory rows (ints, as the sweep hands them over) and rows read back (strings) agree.
    assert [conv_table_key(r) for r in rows] == [conv_table_key({k: str(v) for k, v in r.items()}) for r in rows]
    assert conv_table_key(rows[1])[0] == "conv2d" and conv_table_key(rows[4])[0] == "dwconv"
    path = tmp_path / "conv.csv"
    append_conv_rows(path, rows)
    back = read_rows(path)
    assert list(back[0]) == list(CONV_COLUMNS)
    assert back[1]["c"] == "4" and back[1]["g"] == "1" and back[1]["iterator_algorithm"] == "fixed_channels"
    assert back[4]["g"] == "384" and back[4]["cls_rows"] == "1" and back[4]["Filter"] == "f32:rsc"
    assert back[1]["Flops"] == str(2 * 256 * 56 * 56 * 64 * 7 * 7 * 4)
    update_from_rows(back, str(tmp_path))
    conv_t = SelectionTable.load(tmp_path / "conv2d_selection.csv")
    dw_t = SelectionTable.load(tmp_path / "dwconv_selection.csv")
    assert [r["kernel"] for r in conv_t.rows] == [fast.name] and conv_t.rows[0]["peer_ms"] == "1.400000"
    assert conv_t.lookup("conv2d", 90, "fp16", "bias", 256 * 56 * 56, 64, 7 * 7 * 4) == fast.name
    assert dw_t.lookup("dwconv", 90, "fp16", "bias_st2", 256 * 49, 384, 9) == dws.name


def test_conv_kernels_for_emission(tmp_path):
    from cvt_cutlass.api import emit, kernels_for

    sel = kernels_for("dwconv", 90, dtype="fp16", batches=(1,))
    assert {s.stride for s in sel} == {1, 2} and all(s.arch == 90 for s in sel)
    cands = kernels_for("conv2d", 89, dtype="bf16", which="candidates", batches=(1,))
    assert {s.iterator for s in cands} == {"optimized", "fixed_channels", "few_channels", "row_window"}
    paths = emit(specs=sel, out=tmp_path)
    # the headers the instantiations include, under their paths in operators/ (nvcc -I <out>)
    assert all((tmp_path / h).is_file() for h in ("dwconv/dwconv.cuh", "conv2d/abi.h", "common/abi.h"))
    for p in paths:
        src = p.read_text()
        assert p.stem in src and '#include "dwconv/dwconv.cuh"' in src


def _tiny_sweep_candidates(dtype, stride, arch):
    """The two depthwise candidates test_tiny_conv_sweep_end_to_end_gpu sweeps."""
    return [DwConvSpec(arch, dtype, stride, 1, 256), DwConvSpec(arch, dtype, stride, 2, 128)]


@requires_sm80
def test_tiny_conv_sweep_end_to_end_gpu(tmp_path, monkeypatch):
    """Two depthwise candidates on CvT-13's batch-1 projections: HF-sequence rows, checked and
    timed kernel rows, a resumed sweep that measures nothing again, and the selection table."""
    import types

    import cvt_cutlass.operators.dwconv as oc
    from cvt_cutlass.operators.selection import SelectionTable

    from cvt_cutlass.tools.sweep.conv import sweep
    from cvt_cutlass.tools.sweep.driver import read_rows
    from cvt_cutlass.tools.sweep.tables import update_from_rows

    arch = 90 if CUDA_CC == 90 else 89
    monkeypatch.setattr(oc, "dwconv_candidates", _tiny_sweep_candidates)
    args = types.SimpleNamespace(op="dwconv", model="cvt-13", batch=[1], image_size=None, dtype=["fp16"],
                                 arch=[arch], jobs=None)
    out = tmp_path / "dw.csv"
    rows = sweep(args, out)
    back = read_rows(out)
    assert len(rows) == len(back) == 6 * 3  # 6 projections x (HF + 2 kernels)
    assert {r["Disposition"] for r in back} == {"passed"} and all(float(r["Runtime"]) > 0 for r in back)
    assert len(sweep(args, out)) == len(back) and len(read_rows(out)) == len(back)  # resumed: nothing new
    update_from_rows(back, str(tmp_path))
    table = SelectionTable.load(tmp_path / "dwconv_selection.csv")
    assert len(table.rows) == 6


SM90_CONV_TILES = [((128, 128, 64), (1, 1, 1)), ((64, 192, 64), (1, 1, 1)), ((128, 128, 64), (2, 1, 1))]


@pytest.mark.skipif(CUDA_CC != 90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("tile,cluster", SM90_CONV_TILES)
@pytest.mark.parametrize("model,size", [("cvt-13", 224), ("cvt-13", (231, 217)), ("cvt-w24", 384)])
def test_sm90_conv_kernels_match_float64_gpu(model, size, tile, cluster, dtype):
    """The CUTLASS 3.x SM90 conv kernels on every embedding conv they can read (C % 8 == 0), run
    directly (whatever the selection table says), poisoned output, against float64."""
    from cvt_cutlass.operators.conv2d import Conv90Spec

    tdt = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(7)
    spec = Conv90Spec(dtype, tile, cluster)
    kid = runtime.load_kernel(spec, CUDA_CC)
    for layer in conv_problems(model, 3, size):
        if layer.kind != "embed" or layer.c % 8:
            continue
        x4, w4, b, x, w = _embed_inputs(layer, tdt, g)
        out = torch.full((layer.n, layer.p, layer.q, layer.k), float("nan"), device="cuda", dtype=tdt)
        runtime.ensure_binding()
        torch.ops.cvt_cutlass_C.conv2d(kid, x4, w4, b, out, [layer.pad] * 2, [layer.stride] * 2, 0)
        torch.cuda.synchronize()
        ref = F.conv2d(x.double(), w.double(), b.double(), layer.stride, layer.pad).permute(0, 2, 3, 1)
        same = F.conv2d(x, w, b, layer.stride, layer.pad).permute(0, 2, 3, 1)
        _assert_close_to_reference(out, ref, same)


ROW_CONV_SHAPES = [(3, 224, 224, 64), (2, 61, 48, 128), (1, 9, 16, 64), (5, 224, 160, 64)]


@requires_sm80
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("shape", ROW_CONV_SHAPES, ids=["cvt13-b3", "ragged-k128", "tiny", "q40"])
def test_row_window_conv_matches_float64_gpu(shape, stages, dtype):
    """The stem's row-window forward by name (7 x 7, stride 4, pad 2, the 3 channels padded to 4;
    one and several channel blocks, a row of fewer than 64 pixels), poisoned output, against
    float64 next to PyTorch's error in the same dtype; two runs bitwise equal."""
    from cvt_cutlass.operators.conv2d import ConvLayer, ConvRowsSpec

    n, h, w, k = shape
    tdt = DTYPES[dtype]
    layer = ConvLayer("rows", "embed", n, h, w, 3, k, 7, 4, 2, 0, 1)
    kid = runtime.load_kernel(ConvRowsSpec(dtype, 7, stages), CUDA_CC)
    x4, w4, b, x, wt = _embed_inputs(layer, tdt, torch.Generator(device="cuda").manual_seed(5))
    outs = []
    for _ in range(2):
        out = torch.full((layer.n, layer.p, layer.q, layer.k), float("nan"), device="cuda", dtype=tdt)
        torch.ops.cvt_cutlass_C.conv2d(kid, x4, w4, b, out, [layer.pad] * 2, [layer.stride] * 2, 0)
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
    ref = F.conv2d(x.double(), wt.double(), b.double(), layer.stride, layer.pad).permute(0, 2, 3, 1)
    same = F.conv2d(x, wt, b, layer.stride, layer.pad).permute(0, 2, 3, 1)
    _assert_close_to_reference(outs[0], ref, same)


@requires_sm80
def test_row_window_conv_keeps_non_finite_inputs_where_pytorch_does_gpu():
    """An Inf in an image column that only pixel 1's window covers (column 5 of a 7 x 7 / 4 / 2
    conv): PyTorch's pixel 0 stays finite, and so does the row-window forward's (the taps past S * C
    that reach column 5 from pixel 0's window are masked, not just multiplied by zero weights)."""
    from cvt_cutlass.operators.conv2d import ConvLayer, ConvRowsSpec

    layer = ConvLayer("rows", "embed", 1, 9, 16, 3, 64, 7, 4, 2, 0, 1)
    kid = runtime.load_kernel(ConvRowsSpec("bf16", 7, 2), CUDA_CC)
    x4, w4, b, x, wt = _embed_inputs(layer, torch.bfloat16, torch.Generator(device="cuda").manual_seed(3))
    x4[:, :, 5, :3] = float("inf")
    x[:, :, :, 5] = float("inf")
    out = torch.empty((layer.n, layer.p, layer.q, layer.k), device="cuda", dtype=torch.bfloat16)
    torch.ops.cvt_cutlass_C.conv2d(kid, x4, w4, b, out, [layer.pad] * 2, [layer.stride] * 2, 0)
    ref = F.conv2d(x.double(), wt.double(), b.double(), layer.stride, layer.pad).permute(0, 2, 3, 1)
    assert torch.equal(torch.isfinite(out), torch.isfinite(ref)) and torch.isfinite(out[:, :, 0]).all()


def _layer_spec(layer, dtype, arch, gpu):
    """The kernel a conv test's call of ``layer`` selects (embed: conv2d, else depthwise)."""
    return (conv2d_spec if layer.kind == "embed" else dwconv_spec)(layer, dtype, arch, gpu)


def gpu_kernel_specs(cc: int, gpu: str | None) -> list:
    """The conv kernels this module's GPU tests select on a device (cc, gpu), for
    tests/gpu_kernels.py to prebuild: the float64 sweep (_gpu_conv_cases x dtypes x paths), the
    opcheck / CUDA-graph / backward layers (default path), the tiny sweep's candidates, and on
    sm_90 the SM90 conv kernels run by name; the row-window forward by name."""
    from cvt_cutlass.operators.conv2d import Conv90Spec, ConvRowsSpec

    out = [_layer_spec(case.values[0], dt, arch, gpu)
           for arch in path_archs(cc) for dt in DTYPES for case in _gpu_conv_cases()]
    arch = default_arch(cc)
    small, four = conv_problems("cvt-13", 2, 64), conv_problems("cvt-13", 4)
    out += [_layer_spec(small[3], "fp16", arch, gpu), _layer_spec(small[8], "bf16", arch, gpu)]  # opcheck
    out += [_layer_spec(four[0], "fp16", arch, gpu), _layer_spec(four[7], "fp16", arch, gpu)]  # CUDA graph
    out.append(_layer_spec(conv_problems("cvt-13", 2)[7], "fp16", arch, gpu))  # dwconv backward
    out += [s for st in (1, 2) for s in _tiny_sweep_candidates("fp16", st, 90 if cc == 90 else 89)]
    if cc == 90:
        out += [Conv90Spec(dt, tile, cluster) for dt in DTYPES for tile, cluster in SM90_CONV_TILES]
    out += [ConvRowsSpec(dt, 7, st) for dt in DTYPES for st in (2, 3)]  # the row-window forward by name
    return [s for s in out if s is not None]
