"""The depthwise conv projection + BatchNorm in training mode: dwconv_bn_train, dwconv_bn_backward,
their C++ autograd formula and the DwConvBnSpec kernel family (forward and backward).

CPU: names and spec rules, real nvcc compiles for sm_89 and sm_90a, the PyTorch path (visible,
counted) against HF's Conv2d + nn.BatchNorm2d including the running statistics after several
steps (momentum 0.1 and None, track_running_stats off), eval mode on the folded kernel path,
float64 gradcheck through the C++ autograd formula, argument errors, opcheck.
GPU: CvT-13 / CvT-W24 / ragged shapes at stride 1 and 2, fp16 and bf16, both kernel paths, in
strict mode: y and every gradient against float64 next to PyTorch's own error at the same
precision (rows appended to $CVT_CUTLASS_GRAD_ERRORS when set); running stats after 3 steps;
refusals that fall back visibly; raw-launch argument checks; determinism; opcheck; the k / v pair's
grouped launch against two single calls (bitwise).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from cvt_cutlass.operators.dwconv import (
    DwConvBnSpec,
    dwconv_bn_candidates,
    dwconv_bn_heuristic,
    select_dwconv_bn,
)
from cvt_cutlass.operators.spec import SpecError, parse_kernel_name

from cvt_cutlass import build, runtime
from cvt_cutlass.ops.dwconv import (
    dwconv_bn,
    dwconv_bn_backward,
    dwconv_bn_backward_reference,
    dwconv_bn_train,
    dwconv_bn_train_reference,
)

from .conftest import CUDA_CC, DTYPES, PATHS, graph_replayed, no_kernel_body, requires_nvcc, requires_sm80
from .gpu_kernels import KERNEL_DTYPES, gpu_paths, path_arch
from .test_backward import FLOOR, _record
from .test_build import build_and_check

EPS = 1e-5

# (label, B, H, W, C, cls rows): CvT-13 at 224 (stage 1-3), CvT-W24 at 384 (192 / 768 / 1024
# channels at 96 / 48 / 24 pixels), and ragged ones.
CASES = [
    ("13.s1", 2, 56, 56, 64, 0), ("13.s2", 2, 28, 28, 192, 0), ("13.s3", 3, 14, 14, 384, 1),
    ("w24.s1", 2, 96, 96, 192, 0), ("w24.s2", 1, 48, 48, 768, 0), ("w24.s3", 2, 24, 24, 1024, 1),
    ("ragged", 3, 7, 9, 72, 1), ("tiny", 2, 3, 5, 8, 0), ("b1", 1, 5, 4, 16, 2),
    ("narrow", 3, 1, 3, 24, 1),
]
# the cases the q / k / v libraries are tested on: CvT-13's, odd sizes, 8 channels, one input row
# of three columns (fewer than one group of loaded columns), cls rows
QKV_CASES = (0, 1, 2, 6, 7, 8, 9)


def _out(n: int, stride: int) -> int:
    return (n - 1) // stride + 1


# ----------------------------------------------------------------------------------- CPU: specs
@pytest.mark.parametrize("arch", [89, 90])
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_names_round_trip(arch, pass_):
    for c in (64, 72, 192, 384, 1024):
        for st in (1, 2):
            specs = dwconv_bn_candidates("bf16", c, st, arch, pass_) + [dwconv_bn_heuristic("fp16", c, st, arch, pass_)]
            for s in specs:
                assert parse_kernel_name(s.name) == s and s.pass_ == pass_
                assert s.name.startswith(f"cvt_dwconv_{pass_}_") and "_nhwc_bn_k3_" in s.name
    assert dwconv_bn_heuristic("bf16", 72, 2, 90, "bwd").name == "cvt_dwconv_bwd_sm90a_bf16_nhwc_bn_k3_st2_p2_g1_b128"
    q, kv = dwconv_bn_heuristic("bf16", 384, 1, arch, pass_), dwconv_bn_heuristic("bf16", 384, 2, arch, pass_)
    qkv = q.with_kv(kv)
    assert parse_kernel_name(qkv.name) == qkv and qkv.name == q.name + "_kv" + kv.variant()[5:]
    assert dwconv_bn_heuristic("fp16", 384, 1, 89).name == "cvt_dwconv_fwd_sm89_f16_nhwc_bn_k3_st1_p2_g8_b256"
    # the eval kernels' names still parse as DwConvSpec, and a bn variant never as one
    assert type(parse_kernel_name("cvt_dwconv_fwd_sm89_f16_nhwc_bias_k3_st1_p2_b256")).__name__ == "DwConvSpec"
    with pytest.raises(SpecError, match="not a valid dwconv bwd kernel variant"):
        parse_kernel_name("cvt_dwconv_bwd_sm89_f16_nhwc_bias_k3_st1_p2_b256")


def test_spec_rules():
    q = dwconv_bn_heuristic("bf16", 64, 1, 90)
    with pytest.raises(SpecError, match="cannot be the k / v pair"):
        q.with_kv(dwconv_bn_heuristic("fp16", 64, 2, 90))  # another dtype
    with pytest.raises(SpecError, match="cannot be the k / v pair"):
        q.with_kv(dwconv_bn_heuristic("bf16", 64, 2, 90, "bwd"))  # another pass
    with pytest.raises(SpecError, match="cannot be the k / v pair"):
        q.with_kv(dwconv_bn_heuristic("bf16", 64, 1, 90))  # the same stride
    wide = DwConvBnSpec(90, "bf16", 1, 2, 8, 512, "bwd")
    with pytest.raises(SpecError, match="cannot be the k / v pair.*48 KiB"):
        wide.with_kv(DwConvBnSpec(90, "bf16", 2, 2, 8, 64, "bwd"))
    with pytest.raises(SpecError, match="it has one"):
        q.with_kv(dwconv_bn_heuristic("bf16", 64, 2, 90)).with_kv(dwconv_bn_heuristic("bf16", 64, 2, 90))
    with pytest.raises(SpecError, match="multiple of the stride"):
        DwConvBnSpec(90, "bf16", 2, 1, 8, 128, "bwd")
    with pytest.raises(SpecError, match="groups"):
        DwConvBnSpec(90, "bf16", 1, 2, 3)
    with pytest.raises(SpecError, match="threads"):
        DwConvBnSpec(90, "bf16", 1, 2, 8, 96)
    with pytest.raises(SpecError, match="stride must be 1 or 2"):
        DwConvBnSpec(90, "bf16", 3)
    with pytest.raises(SpecError, match="arch"):
        DwConvBnSpec(80, "bf16", 1)
    with pytest.raises(SpecError, match="passes"):
        DwConvBnSpec(90, "bf16", 1, pass_="wgrad")
    # channel groups: the most that divide C / 8 (no idle lanes)
    assert [dwconv_bn_heuristic("bf16", c, 1, 90).groups for c in (64, 72, 96, 8, 1024)] == [8, 1, 4, 1, 8]


def _kernel_text(spec) -> tuple[str, str]:
    """A spec's instantiation and the text of every header of ours it includes (transitively)."""
    src = spec.instantiation()
    return src, "\n".join(p.read_text() for p in build.project_headers(src))


def test_sources_hold_the_stages():
    src, fwd = _kernel_text(DwConvBnSpec(90, "bf16", 1))
    assert '#include "dwconv/dwbn_fwd.cuh"' in src and "DwBnFwd<cutlass::bfloat16_t, /*Stride=*/1," in src
    assert all(k in fwd for k in ("bn_stats_kernel", "bn_finish_kernel", "bn_norm_kernel", "chan_merge"))
    assert "CVT_FAMILY_DWCONV_BN;" in fwd and "cvt_dwbn_launch" in src and "atomicAdd" not in fwd
    src, bwd = _kernel_text(DwConvBnSpec(90, "bf16", 2, 2, 8, 128, "bwd"))
    assert '#include "dwconv/dwbn_bwd.cuh"' in src and "DwBnBwd<cutlass::bfloat16_t, /*Stride=*/2, /*In=*/2," in src
    assert all(k in bwd for k in ("bn_bwd_reduce_kernel", "bn_bwd_finish_kernel", "bn_dz_wgrad_kernel",
                                  "bn_dgrad_kernel", "sum_dx", "colsum("))
    assert "CVT_FAMILY_DWCONV_BN_BWD;" in bwd and "cvt_dwbnbwd_launch" in src and "atomicAdd" not in bwd
    # the backward's kernels are their own templates, not the forward's text: it never includes dwbn_fwd.cuh
    assert "bn_stats_kernel" not in bwd and no_kernel_body(src)


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("target", ["sm_89", "sm_90a"])
def test_real_compiles(target):
    """nvcc builds the forward and the backward library (stride 1 and 2) without spills."""
    arch = 90 if target == "sm_90a" else 89
    build_and_check([dwconv_bn_heuristic("bf16", 384, 1, arch), dwconv_bn_heuristic("fp16", 64, 2, arch)],
                    target, lambda s: 10, "dwbn")
    build_and_check([dwconv_bn_heuristic("bf16", 384, 2, arch, "bwd"), dwconv_bn_heuristic("fp16", 72, 1, arch, "bwd")],
                    target, lambda s: 11, "dwbnbwd")


@requires_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("target", ["sm_89", "sm_90a"])
def test_qkv_library_compiles(target):
    """nvcc builds a q / k / v library of each pass (q's shape and the k / v pair's, 128 and 256
    threads: a 256-thread block runs two of q's 128-thread blocks) without spills."""
    arch = 90 if target == "sm_90a" else 89
    fwd = dwconv_bn_heuristic("bf16", 192, 1, arch).with_kv(DwConvBnSpec(arch, "bf16", 2, 1, 8, 128))
    bwd = dwconv_bn_heuristic("fp16", 64, 1, arch, "bwd").with_kv(dwconv_bn_heuristic("fp16", 64, 2, arch, "bwd"))
    # q at one input per thread: its summing dgrad runs at two (the k / v pair's stride)
    one = DwConvBnSpec(arch, "bf16", 1, 1, 8, 64, "bwd").with_kv(DwConvBnSpec(arch, "bf16", 2, 2, 8, 64, "bwd"))
    build_and_check([fwd], target, lambda s: 10, "dwbn")
    build_and_check([bwd, one], target, lambda s: 11, "dwbnbwd")


def test_cache_key_covers_the_abi_header(tmp_path, monkeypatch):
    """The kernel's cache key hashes the headers it includes: the ABI (common and the family's)
    and the templates; changing operators/dwconv/abi.h changes it."""
    import shutil

    src = DwConvBnSpec(90, "fp16", 1).instantiation()
    rel = {p.relative_to(build.OPERATORS).as_posix() for p in build.project_headers(src)}
    assert {"common/abi.h", "common/device.cuh", "conv2d/abi.h", "dwconv/abi.h", "dwconv/dwbn_common.cuh",
            "dwconv/dwbn_fwd.cuh"} <= rel
    ops = tmp_path / "operators"
    shutil.copytree(build.OPERATORS, ops, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(build, "OPERATORS", ops)
    key = build.kernel_key(src, "sm_90a", "13.0")
    (ops / "dwconv" / "abi.h").write_text((ops / "dwconv" / "abi.h").read_text() + "\n// changed\n")
    assert build.kernel_key(src, "sm_90a", "13.0") != key


def test_selection_is_a_pure_function_of_the_problem():
    f = select_dwconv_bn(2 * 3136, 64, 1, "bf16", 90, "NVIDIA H200", "fwd")
    b = select_dwconv_bn(2 * 784, 64, 2, "bf16", 90, "NVIDIA H200", "bwd")
    assert (f.spec.pass_, f.spec.stride, b.spec.pass_, b.spec.stride) == ("fwd", 1, "bwd", 2)
    assert b.spec.pix % b.spec.stride == 0


def test_passes_bench_rows_and_their_kernels():
    """bench --op dwconv --pass ...: q (stride 1) and k/v (stride 2) rows per CvT-13 stage, each
    loading one forward and one backward kernel; the bytes the rate divides by."""
    from cvt_cutlass.tools.bench import passes

    rows = list(passes.cases("dwconv", 2))
    assert [(r, st) for r, st, _, _ in rows] == [(r, st) for st in (1, 2, 3) for r in ("dw_q", "dw_kv")]
    specs = passes.kernel_specs("dwconv", 2, "bf16", 90, None)
    # deduplicated by name: the heuristic's kernels do not depend on the channel count here (all 8 groups)
    assert sorted((s.pass_, s.stride) for s in specs) == [("bwd", 1), ("bwd", 2), ("fwd", 1), ("fwd", 2)]
    assert passes.dw_geometry("dw_kv", 3) == (14, 2, 1, 7)
    # stage 3 k/v at batch 2: x 2 x 197 x 384, y 2 x 50 x 384 elements of 2 bytes
    assert passes._work("dw_kv", 2 * 197, 384, 2, st=3, pass_="fwd") == (0, 2 * (2 * 197 * 384 + 2 * 50 * 384))
    assert passes._work("dw_kv", 2 * 197, 384, 2, st=3, pass_="bwd") == (0, 2 * (2 * 2 * 197 * 384 + 2 * 50 * 384))


# ----------------------------------------------------------------------------------- CPU: the op
def _hf_projection(c: int, stride: int, momentum, track=True, dtype=torch.float64, seed=0):
    """HF's CvtSelfAttentionConvProjection: depthwise Conv2d (no bias) + BatchNorm2d."""
    torch.manual_seed(seed)
    conv = torch.nn.Conv2d(c, c, 3, stride, 1, groups=c, bias=False).to(dtype)
    bn = torch.nn.BatchNorm2d(c, momentum=momentum, track_running_stats=track).to(dtype)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
    return conv, bn


def _hf_tokens(conv, bn, x, h, w, cls):
    b, _, c = x.shape
    y = bn(conv(x[:, cls:].reshape(b, h, w, c).permute(0, 3, 1, 2))).flatten(2).transpose(1, 2)
    return torch.cat([x[:, :cls], y], 1) if cls else y


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("stride,cls", [(1, 0), (2, 1)])
def test_training_steps_match_batchnorm_module_cpu(momentum, stride, cls, counted_fallbacks):
    """Several training steps, then eval: y, the running stats and num_batches_tracked as
    HF's modules; each call visibly on PyTorch (CPU)."""
    c, h, w = 16, 6, 5
    conv, bn = _hf_projection(c, stride, momentum)
    bn_ours = copy.deepcopy(bn)
    for step in range(4):
        x = torch.randn(3, cls + h * w, c, dtype=torch.float64) * 2 + step
        torch.testing.assert_close(dwconv_bn(x, conv.weight, bn_ours, h, w, stride, cls), _hf_tokens(conv, bn, x, h, w, cls))
    torch.testing.assert_close(bn_ours.running_mean, bn.running_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bn_ours.running_var, bn.running_var, rtol=1e-12, atol=1e-12)
    assert int(bn_ours.num_batches_tracked) == int(bn.num_batches_tracked) == 4
    assert counted_fallbacks.stats()["fallbacks"] == {"dwconv_bn_train:device": 4}
    bn.eval()
    bn_ours.eval()
    x = torch.randn(2, cls + h * w, c, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(dwconv_bn(x, conv.weight, bn_ours, h, w, stride, cls),
                                   _hf_tokens(conv, bn, x, h, w, cls))
    # eval: the folded (inference) op, not the training one; the running stats stay put
    assert counted_fallbacks.stats()["fallbacks"] == {"dwconv_bn_train:device": 4, "dwconv_tokens:device": 1}
    assert int(bn_ours.num_batches_tracked) == 4


def test_without_running_stats_uses_batch_statistics_in_eval_cpu(counted_fallbacks):
    conv, bn = _hf_projection(8, 2, 0.1, track=False)
    x = torch.randn(2, 25, 8, dtype=torch.float64)
    for mode in (True, False):
        bn.train(mode)
        torch.testing.assert_close(dwconv_bn(x, conv.weight, bn, 5, 5, 2), _hf_tokens(conv, bn, x, 5, 5, 0))
    assert counted_fallbacks.stats()["fallbacks"] == {"dwconv_bn_train:device": 2}


def test_fp16_running_stats_and_mean_dtypes_cpu(counted_fallbacks):
    x = torch.randn(2, 1 + 16, 8, dtype=torch.bfloat16)
    rm, rv = torch.zeros(8, dtype=torch.float16), torch.ones(8, dtype=torch.float16)
    y, mean, invstd = dwconv_bn_train(x, torch.randn(3, 3, 8), None, None, rm, rv, 0.5, EPS, 4, 4, 1, 1)
    assert y.dtype == torch.bfloat16 and mean.dtype == invstd.dtype == torch.float32
    assert rm.dtype == torch.float16 and torch.allclose(rm.float(), 0.5 * mean, atol=1e-3, rtol=1e-2)
    assert torch.equal(y[:, :1], x[:, :1])


@pytest.mark.parametrize("stride,cls,affine", [(1, 0, True), (2, 1, True), (2, 0, False), (1, 2, False)])
def test_gradcheck_through_the_cpp_autograd_formula_cpu(stride, cls, affine, counted_fallbacks):
    g = torch.Generator().manual_seed(stride + cls)
    h, w, c = 5, 4, 8
    x = torch.randn(2, cls + h * w, c, generator=g, dtype=torch.float64, requires_grad=True)
    wt = torch.randn(3, 3, c, generator=g, dtype=torch.float64, requires_grad=True)
    leaves = [x, wt]
    if affine:
        leaves += [(torch.rand(c, generator=g, dtype=torch.float64) + 0.5).requires_grad_(),
                   torch.randn(c, generator=g, dtype=torch.float64, requires_grad=True)]

    def f(x, wt, gamma=None, beta=None):
        return dwconv_bn_train(x, wt, gamma, beta, None, None, 0.1, EPS, h, w, stride, cls)[0]

    assert torch.autograd.gradcheck(f, tuple(leaves))
    assert set(counted_fallbacks.stats()["fallbacks"]) == {"dwconv_bn_train:device", "dwconv_bn_backward:device"}


def test_backward_saves_no_conv_output_cpu():
    """The autograd node keeps x, the weights and two (C,) vectors: no activation beyond x."""
    x = torch.randn(2, 36, 8, requires_grad=True)
    wt = torch.randn(3, 3, 8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        dwconv_bn_train(x, wt, None, None, None, None, 0.1, EPS, 6, 6, 1, 0)
    big = [t for t in saved if t.numel() > 9 * 8]
    assert len(big) == 1 and big[0] is x, [tuple(t.shape) for t in saved]
    assert sorted(t.numel() for t in saved) == [8, 8, 72, x.numel()]


def test_even_kernels_and_other_strides_fall_back_visibly(counted_fallbacks):
    x = torch.randn(2, 36, 8)
    y, _, _ = dwconv_bn_train(x, torch.randn(2, 2, 8), None, None, None, None, 0.1, EPS, 6, 6, 1, 0)
    assert y.shape == (2, 49, 8)  # pad 1: (6 + 2 - 2) + 1 = 7
    y, _, _ = dwconv_bn_train(x, torch.randn(3, 3, 8), None, None, None, None, 0.1, EPS, 6, 6, 3, 0)
    assert y.shape == (2, 4, 8)
    assert counted_fallbacks.stats()["fallbacks"] == {"dwconv_bn_train:device": 2}


def test_strict_mode_raises_cpu(strict_fallbacks):
    with pytest.raises(RuntimeError, match="dwconv_bn_train"):
        dwconv_bn_train(torch.randn(2, 16, 8), torch.randn(3, 3, 8), None, None, None, None, 0.1, EPS, 4, 4, 1, 0)


def test_argument_errors():
    x, w = torch.randn(2, 17, 8), torch.randn(3, 3, 8)
    args = (0.1, EPS, 4, 4, 1, 1)
    with pytest.raises(ValueError, match="tokens"):
        dwconv_bn_train(x[0], w, None, None, None, None, *args)
    with pytest.raises(ValueError, match="17 tokens"):
        dwconv_bn_train(x, w, None, None, None, None, 0.1, EPS, 4, 4, 1, 0)
    with pytest.raises(ValueError, match="weight must be"):
        dwconv_bn_train(x, torch.randn(3, 2, 8), None, None, None, None, *args)
    with pytest.raises(ValueError, match="both running_mean and running_var"):
        dwconv_bn_train(x, w, None, None, torch.zeros(8), None, *args)
    with pytest.raises(ValueError, match="bn_weight must be"):
        dwconv_bn_train(x, w, torch.ones(4), None, None, None, *args)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        dwconv_bn_train(torch.randn(1, 1, 8), w, None, None, None, None, 0.1, EPS, 1, 1, 1, 0)
    with pytest.raises(ValueError, match="momentum"):
        dwconv_bn_train(x, w, None, None, None, None, 1.5, EPS, 4, 4, 1, 1)
    with pytest.raises(TypeError, match="floating-point"):
        dwconv_bn_train(x.int(), w, None, None, None, None, *args)
    with pytest.raises(ValueError, match="grad must be"):
        dwconv_bn_backward(torch.randn(2, 16, 8), x, w, None, torch.zeros(8), torch.ones(8), 4, 4, 1, 1)


def test_backward_reference_matches_autograd_cpu():
    """The backward's PyTorch formula (BatchNorm backward with the batch-statistics terms, then
    the conv's vjp) equals autograd through the forward reference."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 1 + 35, 16, generator=g, dtype=torch.float64, requires_grad=True)
    wt = torch.randn(3, 3, 16, generator=g, dtype=torch.float64, requires_grad=True)
    gamma = (torch.rand(16, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    beta = torch.randn(16, generator=g, dtype=torch.float64, requires_grad=True)
    y, mean, invstd = dwconv_bn_train_reference(x, wt, gamma, beta, None, None, 0.1, EPS, 5, 7, 2, 1)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    expect = torch.autograd.grad(y, (x, wt, gamma, beta), dy)
    got = dwconv_bn_backward_reference(dy, x.detach(), wt.detach(), gamma.detach(), mean.detach(), invstd.detach(),
                                       5, 7, 2, 1)
    for a, b in zip(got, expect, strict=True):
        torch.testing.assert_close(a, b)


def test_opcheck_cpu(counted_fallbacks):
    x, w = torch.randn(2, 1 + 20, 8), torch.randn(3, 3, 8)
    gamma, beta = torch.rand(8) + 0.5, torch.randn(8)
    torch.library.opcheck(torch.ops.cvt_cutlass.dwconv_bn_train.default,
                          (x, w, gamma, beta, torch.zeros(8), torch.ones(8), 0.1, EPS, 5, 4, 2, 1))
    _, mean, invstd = dwconv_bn_train(x, w, gamma, beta, None, None, 0.1, EPS, 5, 4, 2, 1)
    g = torch.randn(2, 1 + 6, 8)
    torch.library.opcheck(torch.ops.cvt_cutlass.dwconv_bn_backward.default, (g, x, w, gamma, mean, invstd, 5, 4, 2, 1))
    ops = torch.ops.cvt_cutlass  # SyncBatchNorm's parts
    for op, args in ((ops.dwconv_bn_stats, (x, w)), (ops.dwconv_bn_apply, (x, w, gamma, beta, mean, invstd)),
                     (ops.dwconv_bn_backward_sums, (g, x, w, mean, invstd)),
                     (ops.dwconv_bn_backward_apply, (g, x, w, gamma, mean, invstd, mean, invstd, torch.tensor([12.0])))):
        torch.library.opcheck(op.default, (*args, 5, 4, 2, 1))


# ----------------------------------------------------------------------------------- GPU
def _leaves(b, h, w, c, cls, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed + c)
    x = (torch.randn(b, cls + h * w, c, device="cuda", generator=g) * 2 + 0.5).to(dtype).requires_grad_()
    wt = (torch.randn(3, 3, c, device="cuda", generator=g) / 3).requires_grad_()
    gamma = (1 + 0.2 * torch.randn(c, device="cuda", generator=g)).requires_grad_()
    beta = (0.2 * torch.randn(c, device="cuda", generator=g)).requires_grad_()
    return [x, wt, gamma, beta]


def _torch_same(h, w, stride, cls):
    """HF's path in the activation dtype (under autocast the conv runs in it; BatchNorm takes the
    half-precision input with fp32 parameters)."""
    def f(x, wt, gamma, beta):
        b, _, c = x.shape
        img = x[:, cls:].reshape(b, h, w, c).permute(0, 3, 1, 2)
        z = F.conv2d(img, wt.permute(2, 0, 1).unsqueeze(1).to(x.dtype), None, stride, 1, groups=c)
        y = F.batch_norm(z, None, None, gamma, beta, True, 0.1, EPS).flatten(2).transpose(1, 2)
        return torch.cat([x[:, :cls], y], 1) if cls else y
    return f


def _rel(a, ref):
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-30))


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("label,b,h,w,c,cls", CASES)
def test_forward_and_gradients_match_float64_gpu(strict_fallbacks, path, dtype, stride, label, b, h, w, c, cls):
    leaves = _leaves(b, h, w, c, cls, DTYPES[dtype])
    p, q = _out(h, stride), _out(w, stride)
    gy = torch.randn(b, cls + p * q, c, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
    gy = gy.to(DTYPES[dtype])
    with runtime.kernel_path(path):
        y, mean, invstd = dwconv_bn_train(*leaves, None, None, 0.1, EPS, h, w, stride, cls)
        ours = torch.autograd.grad(y, leaves, gy)
    hi = [t.detach().double().requires_grad_() for t in leaves]
    ref_y, ref_mean, ref_inv = dwconv_bn_train_reference(*hi, None, None, 0.1, EPS, h, w, stride, cls)
    ref = torch.autograd.grad(ref_y, hi, gy.double())
    lo = [t.detach().clone().requires_grad_() for t in leaves]
    same_y = _torch_same(h, w, stride, cls)(*lo)
    same = torch.autograd.grad(same_y, lo, gy)
    assert torch.equal(y[:, :cls], leaves[0][:, :cls].detach())
    case = f"{label}.st{stride}"
    for name, a, t, r in [("y", y, same_y, ref_y), *zip(("dx", "dweight", "dgamma", "dbeta"), ours, same, ref, strict=True)]:
        assert not torch.isnan(a).any(), f"{case} {name}: NaN"
        err, err_t = _rel(a, r), _rel(t, r)
        _record("dwconv_bn", case, DTYPES[dtype], path, name, err, err_t)
        assert err <= 2 * err_t + FLOOR[DTYPES[dtype]], f"{case} {name}: error {err:.2e} vs torch {err_t:.2e}"
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(invstd.double(), ref_inv, rtol=1e-4, atol=1e-4)
    assert [t.dtype for t in ours] == [t.dtype for t in leaves]


@requires_sm80
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("stride,cls", [(1, 0), (2, 1)])
def test_running_stats_after_three_steps_gpu(strict_fallbacks, momentum, stride, cls):
    h, w, c = 14, 14, 384
    conv, bn = _hf_projection(c, stride, momentum, dtype=torch.float32)
    conv, bn = conv.cuda(), bn.cuda()
    bn_ours = copy.deepcopy(bn)
    for step in range(3):
        x = (torch.randn(8, cls + h * w, c, device="cuda") * 2 + step).half()
        y = dwconv_bn(x, conv.weight, bn_ours, h, w, stride, cls)
        ref = _hf_tokens(conv, bn, x.float(), h, w, cls)
        torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(bn_ours.running_mean, bn.running_mean, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(bn_ours.running_var, bn.running_var, rtol=1e-4, atol=1e-5)
    assert int(bn_ours.num_batches_tracked) == int(bn.num_batches_tracked) == 3


@requires_sm80
def test_refusals_fall_back_visibly_gpu(counted_fallbacks):
    x = torch.randn(2, 16, 8, device="cuda")
    w = torch.randn(3, 3, 8, device="cuda")
    dwconv_bn_train(x, w, None, None, None, None, 0.1, EPS, 4, 4, 1, 0)  # fp32 activations
    dwconv_bn_train(x.half(), w.half(), None, None, None, None, 0.1, EPS, 4, 4, 1, 0)  # fp16 conv weight
    dwconv_bn_train(torch.randn(2, 16, 12, device="cuda").half(), torch.randn(3, 3, 12, device="cuda"), None, None,
                    None, None, 0.1, EPS, 4, 4, 1, 0)  # 12 channels
    dwconv_bn_train(x.half(), torch.randn(5, 5, 8, device="cuda"), None, None, None, None, 0.1, EPS, 4, 4, 1, 0)
    fb = counted_fallbacks.stats()["fallbacks"]
    assert fb == {"dwconv_bn_train:dtype": 1, "dwconv_bn_train:param_dtype": 1, "dwconv_bn_train:alignment": 1,
                  "dwconv_bn_train:kernel": 1}


@requires_sm80
def test_strict_mode_raises_gpu(strict_fallbacks):
    x = torch.randn(2, 16, 12, device="cuda").half()
    with pytest.raises(RuntimeError, match="dwconv_bn_train"):
        dwconv_bn_train(x, torch.randn(3, 3, 12, device="cuda"), None, None, None, None, 0.1, EPS, 4, 4, 1, 0)


@requires_sm80
def test_raw_launches_check_their_arguments_and_are_deterministic_gpu(strict_fallbacks):
    arch = runtime.arch_for(CUDA_CC)
    b, h, w, c, cls, st = 4, 14, 14, 384, 1, 2
    fk = runtime.load_kernel(select_dwconv_bn(b * 49, c, st, "bf16", arch, None, "fwd").spec, CUDA_CC)
    bk = runtime.load_kernel(select_dwconv_bn(b * 49, c, st, "bf16", arch, None, "bwd").spec, CUDA_CC)
    x, wt, gamma, beta = (t.detach() for t in _leaves(b, h, w, c, cls, torch.bfloat16))
    y = torch.empty(b, cls + 49, c, device="cuda", dtype=torch.bfloat16)
    mean, invstd = torch.empty(c, device="cuda"), torch.empty(c, device="cuda")
    raw = torch.ops.cvt_cutlass_C
    with pytest.raises(RuntimeError, match="is not a depthwise conv \\+ BatchNorm kernel"):
        raw.dwconv_bn(bk, x, wt, gamma, beta, None, None, y, mean, invstd, 0.1, EPS, h, w, st, cls)
    with pytest.raises(RuntimeError, match="y must be"):
        raw.dwconv_bn(fk, x, wt, gamma, beta, None, None, y[:, 1:], mean, invstd, 0.1, EPS, h, w, st, cls)
    with pytest.raises(RuntimeError, match="weight must be"):
        raw.dwconv_bn(fk, x, wt.half(), gamma, beta, None, None, y, mean, invstd, 0.1, EPS, h, w, st, cls)
    raw.dwconv_bn(fk, x, wt, gamma, beta, None, None, y, mean, invstd, 0.1, EPS, h, w, st, cls)
    gy = torch.randn_like(y)
    outs = []
    for _ in range(2):
        dx = torch.full_like(x, float("nan"))
        dw, dg, db = torch.empty_like(wt), torch.empty_like(gamma), torch.empty_like(beta)
        raw.dwconv_bn_bwd(bk, gy, x, wt, gamma, mean, invstd, dx, dw, dg, db, h, w, st, cls)
        outs.append((dx, dw, dg, db))
    assert not torch.isnan(outs[0][0]).any() and torch.equal(outs[0][0][:, :cls], gy[:, :cls])
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    with pytest.raises(RuntimeError, match="dx must be"):
        raw.dwconv_bn_bwd(bk, gy, x, wt, gamma, mean, invstd, dx[:, 1:], dw, dg, db, h, w, st, cls)
    # the op's own calls give the same bits as the raw launches
    y2, m2, i2 = dwconv_bn_train(x, wt, gamma, beta, None, None, 0.1, EPS, h, w, st, cls)
    assert torch.equal(y2, y) and torch.equal(m2, mean) and torch.equal(i2, invstd)
    got = dwconv_bn_backward(gy, x, wt, gamma, mean, invstd, h, w, st, cls)
    assert all(torch.equal(a, b) for a, b in zip(got, outs[0], strict=True))


@requires_sm80
def test_opcheck_and_cuda_graph_gpu(strict_fallbacks):
    b, h, w, c, cls = 3, 14, 14, 384, 1
    x, wt, gamma, beta = (t.detach() for t in _leaves(b, h, w, c, cls, torch.bfloat16))
    rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
    torch.library.opcheck(torch.ops.cvt_cutlass.dwconv_bn_train.default,
                          (x, wt, gamma, beta, rm, rv, 0.1, EPS, h, w, 1, cls))
    _, mean, invstd = dwconv_bn_train(x, wt, gamma, beta, None, None, 0.1, EPS, h, w, 1, cls)
    gy = torch.randn(b, cls + h * w, c, device="cuda").bfloat16()
    torch.library.opcheck(torch.ops.cvt_cutlass.dwconv_bn_backward.default,
                          (gy, x, wt, gamma, mean, invstd, h, w, 1, cls))
    eager = dwconv_bn_train(x, wt, gamma, beta, None, None, 0.1, EPS, h, w, 1, cls)[0]
    out = graph_replayed(lambda: dwconv_bn_train(x, wt, gamma, beta, None, None, 0.1, EPS, h, w, 1, cls))[0]
    assert torch.equal(out, eager)


def _library_launches() -> int:
    """Calls of the dwconv + BatchNorm kernel libraries' launch entry points so far."""
    return sum(c for fam, (c, _) in runtime.library_host_time().items() if fam.startswith("dwconv_bn"))


@requires_sm80
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("label,b,h,w,c,cls", [CASES[0], CASES[2], CASES[6]])
def test_kv_pair_is_two_single_calls_gpu(strict_fallbacks, dtype, label, b, h, w, c, cls):
    """The grouped launch of two projections of one input (CvT's k and v, stride 2: the layer op's
    path) gives the bits of two single calls: outputs, batch statistics, running statistics and
    every gradient; a pair whose layouts differ runs as two single calls."""
    dt, st = DTYPES[dtype], 2
    x = _leaves(b, h, w, c, cls, dt)[0].detach()
    ps = [[t.detach() for t in _leaves(b, h, w, c, cls, dt, seed=s)[1:]] for s in (1, 2)]
    runs = [[(torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")) for _ in ps] for _ in range(2)]
    singles = [dwconv_bn_train(x, *p, *r, m, EPS, h, w, st, cls) for p, r, m in zip(ps, runs[0], (0.1, 0.3), strict=True)]
    (wa, ga, ba), (wb, gb, bb) = ps
    (ra, va), (rb, vb) = runs[1]
    launches = _library_launches()
    pair = torch.ops.cvt_cutlass_C.dwconv_bn_train_pair(x, wa, ga, ba, ra, va, 0.1, EPS, wb, gb, bb, rb, vb, 0.3, EPS,
                                                        h, w, st, cls)
    assert _library_launches() - launches == 1  # one grouped launch of the library, not two
    assert all(torch.equal(u, v) for u, v in zip(pair, (*singles[0], *singles[1]), strict=True))
    assert all(torch.equal(u, v) for u, v in zip(runs[0], runs[1], strict=True) for u, v in zip(u, v, strict=True))
    gy = [torch.randn_like(singles[0][0]) for _ in ps]
    stats = [(m, i) for _, m, i in singles]
    bwd = [dwconv_bn_backward(g, x, p[0], p[1], *st_, h, w, st, cls) for g, p, st_ in zip(gy, ps, stats, strict=True)]
    launches = _library_launches()
    got = torch.ops.cvt_cutlass_C.dwconv_bn_backward_pair(x, gy[0], wa, ga, *stats[0], gy[1], wb, gb, *stats[1],
                                                          h, w, st, cls)
    assert _library_launches() - launches == 1
    assert all(torch.equal(u, v) for u, v in zip(got, (*bwd[0], *bwd[1]), strict=True))
    # different layouts (the second without BatchNorm weights): two single calls, the same results
    mixed = torch.ops.cvt_cutlass_C.dwconv_bn_train_pair(x, wa, ga, ba, None, None, 0.1, EPS, wb, None, None, None,
                                                         None, 0.1, EPS, h, w, st, cls)
    alone = dwconv_bn_train(x, wb, None, None, None, None, 0.1, EPS, h, w, st, cls)
    assert all(torch.equal(u, v) for u, v in zip(mixed[3:], alone, strict=True))


@requires_sm80
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("label,b,h,w,c,cls", [CASES[i] for i in QKV_CASES])
def test_qkv_is_q_and_the_kv_pair_gpu(strict_fallbacks, dtype, label, b, h, w, c, cls):
    """A layer's q (stride 1) and k / v pair (stride 2) in one set of launches (the layer op's
    path): each projection's output and gradients against float64 next to PyTorch's error, and
    within rounding of three single calls (q at stride 1 and the pair at stride 2 read x once for
    the three: the statistics and BatchNorm sums are merged in another order; the conv outputs
    are the single calls' bits); running statistics likewise; two calls give the same bits."""
    dt, sq, skv = DTYPES[dtype], 1, 2
    x = _leaves(b, h, w, c, cls, dt)[0].detach()
    ps = [[t.detach() for t in _leaves(b, h, w, c, cls, dt, seed=s)[1:]] for s in (1, 2, 3)]
    moms, strides = (0.1, 0.3, 0.2), (sq, skv, skv)
    runs = [[(torch.randn(c, device="cuda"), torch.rand(c, device="cuda") + 0.5) for _ in ps] for _ in range(3)]
    runs[1], runs[2] = ([(m.clone(), v.clone()) for m, v in runs[0]] for _ in range(2))
    singles = [dwconv_bn_train(x, *p, *r, m, EPS, h, w, s, cls)
               for p, r, m, s in zip(ps, runs[0], moms, strides, strict=True)]

    def qkv(run):
        return torch.ops.cvt_cutlass_C.dwconv_bn_train_qkv(
            x, [p[0] for p in ps], [p[1] for p in ps], [p[2] for p in ps], [t for r in run for t in r], list(moms),
            [EPS] * 3, h, w, sq, skv, cls)
    launches = _library_launches()
    got = qkv(runs[1])
    assert _library_launches() - launches == 1  # one launch of one library, not a q call and a pair
    assert all(torch.equal(u, v) for u, v in zip(got, qkv(runs[2]), strict=True))
    _assert_rounding_apart(got, [t for one in singles for t in one], dt)
    _assert_rounding_apart([t for r in runs[1] for t in r], [t for r in runs[0] for t in r], dt)
    gy = [torch.randn_like(one[0]) for one in singles]
    bwd = [dwconv_bn_backward(g, x, p[0], p[1], one[1], one[2], h, w, s, cls)
           for g, p, one, s in zip(gy, ps, singles, strides, strict=True)]

    def qkv_backward(sum_dx=False):
        return torch.ops.cvt_cutlass_C.dwconv_bn_backward_qkv(
            x, gy, [p[0] for p in ps], [p[1] for p in ps], [one[1] for one in singles], [one[2] for one in singles],
            h, w, sq, skv, cls, sum_dx)
    launches = _library_launches()
    grads = qkv_backward()
    assert _library_launches() - launches == 1
    assert all(torch.equal(u, v) for u, v in zip(grads, qkv_backward(), strict=True))
    _assert_rounding_apart(grads, [t for one in bwd for t in one], dt)
    _qkv_against_float64(x, ps, strides, gy, got, grads, (h, w, cls), dt, label)
    _check_summed_dx(x, gy, grads, cls, qkv_backward)
    # k and v of different layouts (v without BatchNorm weights): the three single calls, same results
    launches = _library_launches()
    mixed = torch.ops.cvt_cutlass_C.dwconv_bn_train_qkv(
        x, [p[0] for p in ps], [ps[0][1], ps[1][1], None], [ps[0][2], ps[1][2], None],
        [t for r in runs[1] for t in r], list(moms), [EPS] * 3, h, w, sq, skv, cls)
    assert _library_launches() - launches == 3
    alone = dwconv_bn_train(x, ps[2][0], None, None, *runs[0][2], moms[2], EPS, h, w, skv, cls)
    assert all(torch.equal(u, v) for u, v in zip(mixed[6:], alone, strict=True))


def _assert_rounding_apart(got, expect, dt):
    """Tensors of a q / k / v library within rounding of the single calls' (statistics merged in
    another order): activations (dtype dt) within one unit of dt's precision in norm, fp32 results
    within 1e-4 (the BatchNorm sums feed dz's rounding to dt, which dW sums)."""
    for i, (u, v) in enumerate(zip(got, expect, strict=True)):
        if u is None or v is None:
            assert u is None and v is None, f"output {i}"
            continue
        assert u.dtype == v.dtype and u.shape == v.shape, f"output {i}"
        tol = torch.finfo(dt).eps if u.dtype == dt else 1e-4
        rel = _rel(u, v.double())
        assert rel <= tol, f"output {i}: {rel:.2e} from the single call (allowed {tol:.0e})"


def _qkv_against_float64(x, ps, strides, gy, got, grads, geom, dt, label):
    """Each projection of the q / k / v library, output and gradients (the backward given the
    single calls' statistics), against float64 next to PyTorch's error at dt."""
    h, w, cls = geom
    for i, (p, s) in enumerate(zip(ps, strides, strict=True)):
        hi = [t.detach().double().requires_grad_() for t in (x, *p)]
        ref_y, _, _ = dwconv_bn_train_reference(*hi, None, None, 0.1, EPS, h, w, s, cls)
        ref = torch.autograd.grad(ref_y, hi, gy[i].double())
        lo = [t.detach().clone().requires_grad_() for t in (x, *p)]
        same_y = _torch_same(h, w, s, cls)(*lo)
        same = torch.autograd.grad(same_y, lo, gy[i])
        ours = (got[3 * i], *grads[4 * i:4 * i + 4])
        for name, a, t, r in zip(("y", "dx", "dweight", "dgamma", "dbeta"), ours, (same_y.detach(), *same),
                                 (ref_y.detach(), *ref),
                                 strict=True):
            err, err_t = _rel(a, r), _rel(t, r)
            _record("dwconv_bn_qkv", f"{label}.{'qkv'[i]}", dt, "auto", name, err, err_t)
            assert err <= 2 * err_t + FLOOR[dt], f"{label} {'qkv'[i]} {name}: error {err:.2e} vs torch {err_t:.2e}"


def _check_summed_dx(x, gy, grads, cls, qkv_backward):
    """The q / k / v backward with sum_dx (the layer op's call): one launch, q's dx the three
    projections' dx summed (within one rounding of the sum of the three separately rounded dx,
    plus theirs), k's and v's None, every weight gradient bitwise the same."""
    launches = _library_launches()
    summed = qkv_backward(True)
    assert _library_launches() - launches == 1
    assert summed[4] is None and summed[8] is None
    assert all(torch.equal(summed[i], grads[i]) for i in range(12) if i % 4)
    parts = [grads[i].double() for i in (0, 4, 8)]
    ref = sum(parts)
    ulp = torch.finfo(x.dtype).eps
    bound = ulp * (ref.abs() + sum(t.abs() for t in parts)) + 1e-30
    err = (summed[0].double() - ref).abs()
    assert summed[0].dtype == x.dtype and summed[0].shape == grads[0].shape
    assert (err <= bound).all(), f"summed dx off by {(err / bound).max().item():.2f} of the bound"
    if cls:  # the cls rows: the three dy rows summed
        rows = sum(g[:, :cls].double() for g in gy)
        assert (summed[0][:, :cls].double() - rows).abs().max() <= ulp * rows.abs().max() * 2


@requires_sm80
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("label,b,h,w,c,cls", [CASES[0], CASES[2], CASES[6]])
def test_sync_batchnorm_parts_are_the_whole_op_gpu(strict_fallbacks, dtype, stride, label, b, h, w, c, cls):
    """The kernels in parts (SyncBatchNorm's path) given one process's statistics and sums give the
    bits of the whole op: the statistics pass's mean (and invstd from its m2 to fp32 rounding),
    the normalization with the batch's statistics, the backward sums (BatchNorm's weight
    gradients) and the gradient pass with them."""
    from cvt_cutlass.ops import dwconv as d

    dt = DTYPES[dtype]
    x, wt, gamma, beta = (t.detach() for t in _leaves(b, h, w, c, cls, dt))
    geom = (h, w, stride, cls)
    y, mean, invstd = dwconv_bn_train(x, wt, gamma, beta, None, None, 0.1, EPS, *geom)
    m, m2 = d.dwconv_bn_stats(x, wt, *geom)
    n = b * _out(h, stride) * _out(w, stride)
    assert torch.equal(m, mean)
    torch.testing.assert_close(torch.rsqrt(m2 / n + EPS), invstd, rtol=2e-6, atol=0)
    assert torch.equal(d.dwconv_bn_apply(x, wt, gamma, beta, mean, invstd, *geom), y)
    gy = torch.randn_like(y)
    dx, dw, dg, db = dwconv_bn_backward(gy, x, wt, gamma, mean, invstd, *geom)
    sdy, sdyx = d.dwconv_bn_backward_sums(gy, x, wt, mean, invstd, *geom)
    assert torch.equal(sdy, db) and torch.equal(sdyx, dg)
    count = torch.full((1,), float(n), device="cuda")
    dx2, dw2 = d.dwconv_bn_backward_apply(gy, x, wt, gamma, mean, invstd, sdy, sdyx, count, *geom)
    assert torch.equal(dx2, dx) and torch.equal(dw2, dw)
    with pytest.raises(ValueError, match="mean"):  # operands the kernels cannot take: checked, not read
        d.dwconv_bn_apply(x, wt, gamma, beta, mean.cpu(), invstd, *geom)
    with pytest.raises(ValueError, match="sum_dy"):
        d.dwconv_bn_backward_apply(gy, x, wt, gamma, mean, invstd, sdy[: c // 2], sdyx, count, *geom)


BENCH_BATCH = 8


@requires_sm80
def test_passes_bench_prebuilds_what_its_rows_load_gpu(strict_fallbacks, loaded_kernels):
    """bench --op dwconv --pass ... compiles kernel_specs() before timing: exactly the kernels its
    rows load (forward and backward), every row on the kernels (strict)."""
    from cvt_cutlass.tools.bench import passes

    loaded = loaded_kernels
    dev = runtime.device_info(torch.cuda.current_device())
    gen = torch.Generator(device="cuda").manual_seed(0)
    for row, st, m, c in passes.cases("dwconv", BENCH_BATCH):
        leaves, g = passes._inputs(torch, row, m, c, torch.bfloat16, gen, BENCH_BATCH, st)
        ours, peer = passes._fns(row, st)
        a, b = ours(*leaves), peer(*leaves)
        assert a.shape == b.shape == g.shape
        torch.autograd.grad(a, leaves, g)
    listed = {s.name for s in passes.kernel_specs("dwconv", BENCH_BATCH, "bf16", runtime.arch_for(dev.cc), dev.name)}
    assert loaded == listed, (sorted(loaded ^ listed))


def gpu_kernel_specs(cc: int, gpu: str | None) -> list:
    """The kernels this module's GPU tests select on a device (cc, gpu): both passes of every
    case x stride x dtype x path, then the fixed shapes of the other tests (default path)."""
    out = []
    for arch in sorted({path_arch(p, cc) for p in gpu_paths(cc)}):
        for dt in KERNEL_DTYPES:
            for _, b, h, w, c, _cls in CASES:
                for st in (1, 2):
                    m = b * _out(h, st) * _out(w, st)
                    out += [select_dwconv_bn(m, c, st, dt, arch, gpu, p).spec for p in ("fwd", "bwd")]
    arch = path_arch("auto", cc)
    for dt in KERNEL_DTYPES:  # the q / k / v libraries (default path)
        for i in QKV_CASES:
            _, b, h, w, c, _cls = CASES[i]
            sel = [[select_dwconv_bn(b * _out(h, st) * _out(w, st), c, st, dt, arch, gpu, p).spec for st in (1, 2)]
                   for p in ("fwd", "bwd")]
            out += [q.with_kv(kv) for q, kv in sel]
    for st in (1, 2):
        out += [select_dwconv_bn(8 * _out(14, st) ** 2, 384, st, "fp16", arch, gpu, p).spec for p in ("fwd", "bwd")]
    out += [select_dwconv_bn(m, 384, st, "bf16", arch, gpu, p).spec
            for m, st in ((4 * 49, 2), (3 * 196, 1)) for p in ("fwd", "bwd")]
    from cvt_cutlass.tools.bench.passes import kernel_specs

    return out + kernel_specs("dwconv", BENCH_BATCH, "bf16", arch, gpu)
