"""torch.ops.cvt_cutlass.linear / linear_gelu_aux: CPU (fallback, errors, autograd, tracing) and GPU.

GPU tests run every epilogue x dtype x kernel path against a float64 reference on CvT-13's Linear
shapes at batch 1 and 256 and on odd shapes, in strict mode (a fallback would raise), plus
opcheck, CUDA-graph capture, streams and the visible fallbacks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from cvt_cutlass.operators.linear.problems import linear_problems

import cvt_cutlass
from cvt_cutlass import fallback, runtime
from cvt_cutlass.ops.linear import epilogue_for, linear, linear_gelu_aux

from .conftest import CUDA_CC, DTYPES, PATHS, requires_sm80
from .gpu_kernels import default_arch, linear_spec, path_archs

# (atol, rtol) against the float64 reference; outputs are O(1) (x ~ N(0,1), W ~ N(0, 1/K)).
TOL = {torch.float16: (1e-2, 1e-2), torch.bfloat16: (4e-2, 4e-2)}
ARGS = {  # epilogue -> (bias, residual, activation)
    "none": (False, False, "none"),
    "bias": (True, False, "none"),
    "bias_gelu": (True, False, "gelu"),
    "bias_residual": (True, True, "none"),
}


def make_inputs(m, n, k, dtype, device, bias=True, residual=False, seed=0, lead=()):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(*lead, m, k, generator=g, device=device).to(dtype)
    w = (torch.randn(n, k, generator=g, device=device) / math.sqrt(k)).to(dtype)
    b = (0.5 * torch.randn(n, generator=g, device=device)).to(dtype) if bias else None
    r = torch.randn(*lead, m, n, generator=g, device=device).to(dtype) if residual else None
    return x, w, b, r


def reference(x, w, b, r, activation, dtype=torch.float64):
    y = F.linear(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype))
    if activation == "gelu":
        y = F.gelu(y)
    return y + r.to(dtype) if r is not None else y


def assert_matches(out, x, w, b, r, activation):
    ref = reference(x, w, b, r, activation)
    atol, rtol = TOL[out.dtype]
    assert not torch.isnan(out).any(), "NaN in the output (unwritten or broken kernel)"
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    # The fused op's error is at most 2x that of PyTorch in the same dtype (+ a tiny floor).
    same = reference(x, w, b, r, activation, dtype=out.dtype) if out.is_cuda else ref.to(out.dtype)
    err = float((out.double() - ref).norm() / ref.norm())
    err_torch = float((same.double() - ref).norm() / ref.norm())
    assert err <= 2 * err_torch + 1e-4, (err, err_torch)


# ----------------------------------------------------------------------------------- CPU


def test_epilogue_mapping():
    assert epilogue_for(False, False, "none") == "none"
    assert epilogue_for(True, False, "none") == "bias"
    assert epilogue_for(True, False, "gelu") == "bias_gelu"
    assert epilogue_for(True, True, "none") == "bias_residual"
    assert epilogue_for(False, True, "none") is None
    assert epilogue_for(True, True, "gelu") is None


def test_lazy_public_api():
    assert cvt_cutlass.linear is linear
    assert torch.ops.cvt_cutlass.linear.default is not None
    with pytest.raises(AttributeError):
        cvt_cutlass.no_such_thing  # noqa: B018


@pytest.mark.parametrize("epilogue", sorted(ARGS))
def test_cpu_tensors_fall_back_visibly(epilogue, counted_fallbacks):
    has_b, has_r, act = ARGS[epilogue]
    x, w, b, r = make_inputs(5, 24, 16, torch.float32, "cpu", has_b, has_r, lead=(3,))
    out = linear(x, w, b, r, act)
    assert out.shape == (3, 5, 24)
    torch.testing.assert_close(out.double(), reference(x, w, b, r, act), atol=1e-5, rtol=1e-5)
    st = counted_fallbacks.stats()
    assert st["fallbacks"] == {"linear:device": 1} and st["kernel_calls"] == {}


def test_strict_mode_refuses_to_fall_back(strict_fallbacks):
    x, w, b, _ = make_inputs(4, 8, 8, torch.float32, "cpu")
    with pytest.raises(fallback.FallbackError, match="device"):
        linear(x, w, b)


@pytest.mark.parametrize(
    "mutate, exc, msg",
    [
        (lambda x, w, b, r: (x.half(), w, b, r), TypeError, "weight is torch.float32 but x is torch.float16"),
        (lambda x, w, b, r: (x, w[:, :-1], b, r), ValueError, "do not match"),
        (lambda x, w, b, r: (x, w, b[:-1], r), ValueError, "bias must be"),
        (lambda x, w, b, r: (x, w, b, r[:, :-1]), ValueError, "residual must be"),
    ],
)
def test_bad_arguments_raise(mutate, exc, msg):
    x, w, b, r = make_inputs(4, 16, 8, torch.float32, "cpu", residual=True)
    with pytest.raises(exc, match=msg):
        linear(*mutate(x, w, b, r))
    with pytest.raises(ValueError, match="activation"):
        linear(x, w, b, None, "relu")


@pytest.mark.parametrize("epilogue", sorted(ARGS))
def test_backward_formula_matches_autograd(epilogue, counted_fallbacks):
    """The registered autograd (used on every device) against PyTorch's own, in float64."""
    has_b, has_r, act = ARGS[epilogue]
    x, w, b, r = make_inputs(6, 16, 8, torch.float64, "cpu", has_b, has_r, lead=(2,))
    leaves = [t.requires_grad_() for t in (x, w, b, r) if t is not None]
    assert torch.autograd.gradcheck(lambda *a: linear(x, w, b, r, act), leaves)
    out = linear(x, w, b, r, act)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, leaves, g)
    theirs = torch.autograd.grad(reference(x, w, b, r, act), leaves, g)
    for a, e in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, e)


def test_gelu_aux_returns_preactivation_and_its_backward(counted_fallbacks):
    x, w, b, _ = make_inputs(7, 16, 8, torch.float64, "cpu")
    leaves = [t.requires_grad_() for t in (x, w, b)]
    out, z = linear_gelu_aux(x, w, b)
    torch.testing.assert_close(z, F.linear(x, w, b))
    torch.testing.assert_close(out, F.gelu(F.linear(x, w, b)))
    assert torch.autograd.gradcheck(lambda *a: linear_gelu_aux(*a)[0], leaves)
    assert torch.autograd.gradcheck(lambda *a: sum(t.sum() for t in linear_gelu_aux(*a)), leaves)


def test_opcheck_cpu(counted_fallbacks):
    x, w, b, r = make_inputs(5, 16, 8, torch.float32, "cpu", residual=True)
    torch.library.opcheck(torch.ops.cvt_cutlass.linear.default, (x, w, b, r, "none"))
    torch.library.opcheck(torch.ops.cvt_cutlass.linear.default, (x, w, b, None, "gelu"))
    torch.library.opcheck(torch.ops.cvt_cutlass.linear_gelu_aux.default, (x, w, b))


def test_traces_under_torch_compile_without_graph_break(counted_fallbacks):
    x, w, b, r = make_inputs(5, 16, 8, torch.float32, "cpu", residual=True, lead=(2,))

    def f(x, w, b, r):
        h = torch.ops.cvt_cutlass.linear(x, w, b, None, "gelu")
        return torch.ops.cvt_cutlass.linear(x, w, b, r, "none") + h

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w, b, r), f(x, w, b, r))


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 3, 64, dtype=torch.float16)
        w = torch.empty(96, 64, dtype=torch.float16)
        out, z = torch.ops.cvt_cutlass.linear_gelu_aux(x, w, torch.empty(96, dtype=torch.float16))
        assert out.shape == z.shape == (2, 3, 96)
        assert torch.ops.cvt_cutlass.linear(x, w).shape == (2, 3, 96)


def test_fp32_residual_stream_cpu(counted_fallbacks):
    """An fp32 residual with bf16 x: the sum and the output in fp32 (the branch unrounded), fp32
    under fake tensors too; its gradient reaches the residual in fp32 and x / W in bf16; a
    residual of a third dtype raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w, b, r = make_inputs(6, 16, 8, torch.bfloat16, "cpu", residual=True, lead=(2,))
    r = r.float().requires_grad_()
    x.requires_grad_()
    out = linear(x, w, b, r)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(x, w, b, r, "none"), atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    assert r.grad.dtype == torch.float32 and torch.equal(r.grad, g)
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad, (g.bfloat16() @ w), atol=0, rtol=0)
    with pytest.raises(TypeError, match="residual is torch.float16 but x is torch.bfloat16"):
        linear(x, w, b, r.detach().half())
    with FakeTensorMode():
        fx = torch.empty(2, 3, 64, dtype=torch.bfloat16)
        fw = torch.empty(96, 64, dtype=torch.bfloat16)
        fr = torch.empty(2, 3, 96)
        assert linear(fx, fw, torch.empty(96, dtype=torch.bfloat16), fr).dtype == torch.float32
    rounded = torch.ops.cvt_cutlass_C.linear_rounded(x.detach(), w, b, r.detach())  # one rounding of the fp32 sum
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, out.detach().bfloat16())
    with pytest.raises(TypeError, match="float32 residual"):
        torch.ops.cvt_cutlass_C.linear_rounded(x.detach(), w, b, r.detach().bfloat16())
    s = torch.rand(12)
    y = torch.ops.cvt_cutlass_C.linear_row_scaled(x.detach(), w, b, r.detach(), s, "branch")
    assert y.dtype == torch.float32
    want = (F.linear(x.detach().double(), w.double(), b.double()) * s.double().view(2, 6, 1) + r.detach().double())
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------- GPU


def _gpu_shapes():
    shapes = set()
    for batch in (1, 256):
        for p in linear_problems("cvt-13", batch):
            shapes.add((p.m, p.n, p.k))
    odd_nk = [(64, 64), (256, 64), (64, 256), (192, 768), (1536, 384), (1000, 384),
              (768, 768), (3072, 768), (1024, 4096), (1000, 1024)]
    for m in (1, 197, 350):
        for n, k in odd_nk:
            shapes.add((m, n, k))
    return sorted(shapes)


GPU_SHAPES = _gpu_shapes()


GELU_AUX_SHAPES = [(1, 64, 64), (350, 768, 192), (802816, 256, 64), (50432, 1536, 384)]
ROW_SCALED_SHAPES = [(3 * 50, 384, 1536), (4 * 197, 384, 384), (5, 64, 64)]  # tokens B * L, N, K
FP32_RESIDUAL_SHAPES = [(3136, 64, 64), *ROW_SCALED_SHAPES]  # a stage-1 out-projection, fc2, s3 proj, odd
# (m, n, k, dtype, epilogues) of the single-shape GPU tests that run on every path ...
_PATH_CASES = [
    (1000, 192, 768, "fp16", ["bias_residual"]),  # test_every_output_element_is_written
    (4 * 197, 384, 384, "fp16", ["bias_residual"]),  # test_strided_rows_and_leading_dims
    (2 * 197, 192, 64, "bf16", [*ARGS, "bias_gelu_aux"]),  # test_opcheck_gpu (+ the gelu backward's bias)
    (3136, 256, 64, "fp16", ["bias_gelu"]),  # test_cuda_graph_capture_and_replay
    *[(m, n, k, dt, ["bias_scale_residual", "bias_residual_scale"])  # test_row_scaled_linear_gpu
      for m, n, k in ROW_SCALED_SHAPES for dt in ("fp16", "bf16")],
]
# ... and of those on the default path (the fallback tests select nothing)
_DEFAULT_PATH_CASES = [
    (50432, 384, 384, "fp16", ["bias"]),  # test_runs_on_the_current_stream
    (2 * 784, 192, 192, "fp16", ["bias_gelu", "bias_residual"]),  # test_torch_compile_calls_the_kernel
]


def gpu_kernel_specs(cc: int, gpu: str | None) -> list:
    """The Linear kernels this module's GPU tests select on a device (cc, gpu), for
    tests/gpu_kernels.py to prebuild: the float64 sweep (GPU_SHAPES x dtypes x epilogues x
    paths), linear_gelu_aux's shapes, then the single-shape tests above."""
    out = []
    for arch in path_archs(cc):
        for dt in DTYPES:
            out += [linear_spec(m, n, k, dt, epi, arch, gpu) for m, n, k in GPU_SHAPES for epi in ARGS]
            out += [linear_spec(m, n, k, dt, "bias_gelu_aux", arch, gpu) for m, n, k in GELU_AUX_SHAPES]
        out += [linear_spec(m, n, k, dt, epi, arch, gpu) for m, n, k, dt, epis in _PATH_CASES for epi in epis]
        out += [linear_spec(m, n, k, dt, epi, arch, gpu, "f32") for m, n, k in FP32_RESIDUAL_SHAPES for dt in DTYPES
                for epi in ("bias_residual", "bias_scale_residual", "bias_residual_scale")]
        out += [linear_spec(m, n, k, dt, "bias_residual", arch, gpu, "f32in") for m, n, k in FP32_RESIDUAL_SHAPES
                for dt in DTYPES]
    arch = default_arch(cc)
    out += [linear_spec(m, n, k, dt, epi, arch, gpu) for m, n, k, dt, epis in _DEFAULT_PATH_CASES for epi in epis]
    return [s for s in out if s is not None]


@pytest.fixture(scope="module")
def prebuilt(prebuilt_kernels):
    """This module's kernels are built before its first GPU test: conftest's session fixture
    prebuilds every kernel of the selected GPU tests (gpu_kernel_specs above among them)."""
    if CUDA_CC is None:
        pytest.skip("needs a CUDA GPU")
    return prebuilt_kernels


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("epilogue", sorted(ARGS))
@pytest.mark.parametrize("m,n,k", GPU_SHAPES, ids=lambda v: str(v))
def test_linear_matches_float64(prebuilt, strict_fallbacks, path, dtype, epilogue, m, n, k):
    has_b, has_r, act = ARGS[epilogue]
    x, w, b, r = make_inputs(m, n, k, DTYPES[dtype], "cuda", has_b, has_r, seed=m + n + k)
    with runtime.kernel_path(path):
        out = linear(x, w, b, r, act)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert_matches(out, x, w, b, r, act)
    assert fallback.stats()["kernel_calls"] == {"linear": 1}


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("m,n,k", GELU_AUX_SHAPES)
def test_gelu_aux_gpu(prebuilt, strict_fallbacks, path, dtype, m, n, k):
    x, w, b, _ = make_inputs(m, n, k, DTYPES[dtype], "cuda")
    with runtime.kernel_path(path):
        out, z = linear_gelu_aux(x, w, b)
    assert_matches(z, x, w, b, None, "none")
    assert_matches(out, x, w, b, None, "gelu")


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("m,n,k", ROW_SCALED_SHAPES)
@pytest.mark.parametrize("scale", ["branch", "all"])
def test_row_scaled_linear_gpu(prebuilt, strict_fallbacks, path, dtype, m, n, k, scale):
    """The layer op's drop path in the epilogue (linear_row_scaled): (x W^T + b) * s + r and
    (x W^T + b + r) * s with an fp32 scale per row (0 for dropped rows), against float64, on a
    NaN-poisoned output too (the raw launch); a row scale that does not start 16-byte aligned runs
    the counted fallback."""
    from cvt_cutlass.epilogues import get_linear_epilogue
    from cvt_cutlass.operators.linear import select_linear

    from cvt_cutlass.ops.linear import ROW_SCALED_EPILOGUES

    dt = DTYPES[dtype]
    x, w, b, r = make_inputs(m, n, k, dt, "cuda", residual=True)
    s = (torch.rand(m, device="cuda") > 0.3).float() / 0.7
    epi = get_linear_epilogue(ROW_SCALED_EPILOGUES[scale])
    ref = epi.reference(x.double() @ w.double().T, b.double(), r.double(), s.double())[0]
    atol, rtol = TOL[dt]
    with runtime.kernel_path(path):
        out = torch.ops.cvt_cutlass_C.linear_row_scaled(x, w, b, r, s, scale)
        arch = runtime.arch_for(runtime.device_info(0).cc)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    spec = select_linear(m, n, k, dtype, epi.name, arch, runtime.device_info(0).name).spec
    raw = torch.full((m, n), float("nan"), device="cuda", dtype=dt)
    torch.ops.cvt_cutlass_C.gemm(runtime.load_kernel(spec, runtime.device_info(0).cc), x, w, b, r, raw, None, s)
    torch.testing.assert_close(raw.double(), ref, atol=atol, rtol=rtol)
    fallback.set_strict(None)
    fallback.reset()
    odd = torch.empty(m + 1, device="cuda")[1:].copy_(s)  # 4 bytes past an aligned start
    torch.testing.assert_close(torch.ops.cvt_cutlass_C.linear_row_scaled(x, w, b, r, odd, scale).double(), ref,
                               atol=atol, rtol=rtol)
    assert fallback.stats()["fallbacks"].get("linear_row_scaled:alignment") == 1


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("m,n,k", FP32_RESIDUAL_SHAPES)
def test_fp32_residual_gpu(prebuilt, strict_fallbacks, path, dtype, m, n, k):
    """An fp32 residual stream: linear and both row-scaled variants read an fp32 residual and
    write fp32 on their "_rf32" kernels; against float64 from the same 16-bit operands, only fp32
    accumulation error is left (no 16-bit rounding of the output)."""
    dt = DTYPES[dtype]
    x, w, b, r = make_inputs(m, n, k, dt, "cuda", residual=True, seed=m + n)
    r = (4 * r.float()).contiguous()
    s = (torch.rand(m, device="cuda") > 0.3).float() / 0.7
    tol = {"atol": 2e-4, "rtol": 2e-4}
    with runtime.kernel_path(path):
        out = linear(x, w, b, r)
        branch = torch.ops.cvt_cutlass_C.linear_row_scaled(x, w, b, r, s, "branch")
        scaled = torch.ops.cvt_cutlass_C.linear_row_scaled(x, w, b, r, s, "all")
    z = F.linear(x.double(), w.double(), b.double())
    assert out.dtype == branch.dtype == scaled.dtype == torch.float32
    torch.testing.assert_close(out.double(), z + r.double(), **tol)
    torch.testing.assert_close(branch.double(), z * s.double()[:, None] + r.double(), **tol)
    torch.testing.assert_close(scaled.double(), (z + r.double()) * s.double()[:, None], **tol)
    assert fallback.stats()["kernel_calls"] == {"linear": 3}


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("m,n,k", FP32_RESIDUAL_SHAPES)
def test_rounded_fp32_residual_gpu(prebuilt, strict_fallbacks, path, dtype, m, n, k):
    """linear_rounded (a stage's last sum on an fp32 residual stream) on its "_rf32in" kernel: the
    fp32 residual added in fp32 and the sum rounded once to x's dtype: within one 16-bit rounding
    (plus fp32 accumulation) of float64 from the same operands, and equal to the fp32-output
    kernel's sum rounded, but for the accumulation's last bits."""
    dt = DTYPES[dtype]
    x, w, b, r = make_inputs(m, n, k, dt, "cuda", residual=True, seed=m + n + 1)
    r = (4 * r.float()).contiguous()
    with runtime.kernel_path(path):
        out = torch.ops.cvt_cutlass_C.linear_rounded(x, w, b, r)
        wide = linear(x, w, b, r)
    want = F.linear(x.double(), w.double(), b.double()) + r.double()
    assert out.dtype == dt and out.shape == (m, n)
    eps = torch.finfo(dt).eps
    torch.testing.assert_close(out.double(), want, atol=2e-4, rtol=eps)
    assert (out != wide.to(dt)).float().mean() < 0.01  # the same sums but where a tie of the rounding moved
    assert fallback.stats()["kernel_calls"] == {"linear": 2}


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
def test_every_output_element_is_written(prebuilt, path):
    """Call a kernel directly on a NaN-poisoned output (not via a fresh allocation)."""
    from cvt_cutlass.operators.linear import select_linear

    dev = runtime.device_info(0)
    with runtime.kernel_path(path):
        arch = runtime.arch_for(dev.cc)
    m, n, k = 1000, 192, 768  # M not a multiple of any tile
    x, w, b, r = make_inputs(m, n, k, torch.float16, "cuda", residual=True)
    spec = select_linear(m, n, k, "fp16", "bias_residual", arch, dev.name).spec
    kid = runtime.load_kernel(spec, dev.cc)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
    torch.ops.cvt_cutlass_C.gemm(kid, x, w, b, r, out, None)
    assert_matches(out, x, w, b, r, "none")


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
def test_strided_rows_and_leading_dims(prebuilt, strict_fallbacks, path):
    """x with a row stride larger than K (a column slice) and 3-D inputs run on the kernel."""
    big = torch.randn(4, 197, 448, device="cuda", dtype=torch.float16)
    x = big[..., :384]  # row stride 448 (16-byte aligned), not contiguous
    _, w, b, r = make_inputs(197, 384, 384, torch.float16, "cuda", residual=True, lead=(4,))
    with runtime.kernel_path(path):
        out = linear(x, w, b, r)
    assert out.shape == (4, 197, 384)
    assert_matches(out, x, w, b, r, "none")


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("epilogue", sorted(ARGS))
def test_opcheck_gpu(prebuilt, path, epilogue):
    has_b, has_r, act = ARGS[epilogue]
    x, w, b, r = make_inputs(197, 192, 64, torch.bfloat16, "cuda", has_b, has_r, lead=(2,))
    with runtime.kernel_path(path):
        torch.library.opcheck(torch.ops.cvt_cutlass.linear.default, (x, w, b, r, act))
        torch.library.opcheck(torch.ops.cvt_cutlass.linear_gelu_aux.default, (x, w, b if has_b else w[:, 0].contiguous()))


@requires_sm80
@pytest.mark.parametrize("path", PATHS)
def test_cuda_graph_capture_and_replay(prebuilt, strict_fallbacks, path):
    x, w, b, r = make_inputs(3136, 256, 64, torch.float16, "cuda", residual=False)
    with runtime.kernel_path(path):
        linear(x, w, b, None, "gelu")  # warm-up: select, build, load outside the capture
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            out = linear(x, w, b, None, "gelu")
        torch.cuda.current_stream().wait_stream(s)
        for seed in (1, 2):
            x.copy_(make_inputs(3136, 256, 64, torch.float16, "cuda", seed=seed)[0])
            g.replay()
            torch.cuda.synchronize()
            assert_matches(out, x, w, b, None, "gelu")


@requires_sm80
def test_runs_on_the_current_stream(prebuilt):
    runtime.ensure_binding()
    s = torch.cuda.Stream()
    x, w, b, _ = make_inputs(50432, 384, 384, torch.float16, "cuda")
    with torch.cuda.stream(s):
        handle = torch.ops.cvt_cutlass_C.current_stream_handle(x)
        assert handle == s.cuda_stream
        out = linear(x, w, b)  # a long kernel on s; reading it after s finishes must be right
    s.synchronize()
    assert_matches(out, x, w, b, None, "none")


@requires_sm80
def test_gpu_fallbacks_are_counted_and_correct(prebuilt, counted_fallbacks):
    x, w, b, r = make_inputs(64, 36, 64, torch.float16, "cuda")  # N = 36: not a multiple of 8
    assert_matches(linear(x, w, b), x, w, b, None, "none")
    x32, w32, b32, _ = make_inputs(64, 64, 64, torch.float32, "cuda")
    torch.testing.assert_close(linear(x32, w32, b32), F.linear(x32, w32, b32))
    xs = torch.randn(64, 128, device="cuda", dtype=torch.float16)[:, ::2]  # column stride 2
    _, w2, b2, _ = make_inputs(64, 64, 64, torch.float16, "cuda")
    assert_matches(linear(xs, w2, b2), xs, w2, b2, None, "none")
    _, _, _, r2 = make_inputs(64, 64, 64, torch.float16, "cuda", residual=True)
    assert_matches(linear(xs.contiguous(), w2, None, r2), xs, w2, None, r2, "none")  # no bias+residual kernel
    st = counted_fallbacks.stats()["fallbacks"]
    assert st == {"linear:alignment": 1, "linear:dtype": 1, "linear:layout": 1, "linear:epilogue": 1}


@requires_sm80
def test_empty_batch(prebuilt, strict_fallbacks):
    x = torch.empty(0, 197, 64, device="cuda", dtype=torch.float16)
    _, w, b, _ = make_inputs(1, 192, 64, torch.float16, "cuda")
    assert linear(x, w, b).shape == (0, 197, 192)


@requires_sm80
def test_torch_compile_calls_the_kernel(prebuilt, strict_fallbacks):
    x, w, b, r = make_inputs(784, 192, 192, torch.float16, "cuda", residual=True, lead=(2,))

    def block(x, w, b, r):
        h = torch.ops.cvt_cutlass.linear(x, w, b, None, "gelu")
        return torch.ops.cvt_cutlass.linear(h, w, b, r, "none")

    out = torch.compile(block, fullgraph=True)(x, w, b, r)
    ref = reference(F.gelu(reference(x, w, b, None, "none")).to(x.dtype), w, b, r, "none")
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert fallback.stats()["kernel_calls"]["linear"] >= 2


@requires_sm80
def test_plan_cache_gpu(prebuilt, counted_fallbacks):
    """One plan per call signature (sizes, strides, dtypes, devices): a second call with new
    tensors of the same signature reuses it, another row count makes one more; a pointer that is
    not 16-byte aligned under a cached plan runs the fallback (counted) and is still right."""
    x, w, b, _ = make_inputs(350, 1536, 384, torch.float16, "cuda", seed=11)
    n0 = runtime.plan_count()
    y1 = linear(x, w, b)
    y2 = linear(x.clone(), w, b)
    assert runtime.plan_count() == n0 + 1 and torch.equal(y1, y2)
    linear(x[:197], w, b)
    assert runtime.plan_count() == n0 + 2
    buf = torch.empty(350 * 384 + 4, device="cuda", dtype=torch.float16)
    xm = buf[4:].view(350, 384).copy_(x)  # same sizes and strides as x, 8 bytes off
    ym = linear(xm, w, b)
    assert runtime.plan_count() == n0 + 2
    assert counted_fallbacks.stats()["fallbacks"] == {"linear:alignment": 1}
    torch.testing.assert_close(ym, y1, atol=2e-2, rtol=2e-2)
    assert counted_fallbacks.stats()["kernel_calls"]["linear"] == 3


@requires_sm80
def test_bad_arguments_raise_gpu():
    """Wrong arguments raise the same errors on the CUDA hot path (from its planner), every time."""
    x = torch.randn(4, 64, device="cuda").half()
    w = torch.randn(8, 64, device="cuda").half()
    for _ in range(2):
        with pytest.raises(ValueError, match="do not match"):
            linear(x, torch.randn(8, 32, device="cuda").half())
        with pytest.raises(TypeError, match="floating-point"):
            linear(x.int(), w)
        with pytest.raises(TypeError, match="weight is torch.float32 but x is torch.float16"):
            linear(x, w.float())
        with pytest.raises(ValueError, match="activation must be one of"):
            linear(x, w, torch.zeros(8, device="cuda").half(), activation="relu")


@requires_sm80
def test_empty_reduction_dimension_gpu(counted_fallbacks):
    """K = 0: the product is zero, the output bias (+ GELU) — computed by the visible fallback."""
    x, w = torch.empty(4, 0, device="cuda").half(), torch.empty(8, 0, device="cuda").half()
    b = torch.randn(8, device="cuda").half()
    torch.testing.assert_close(linear(x, w, b, activation="gelu"), torch.nn.functional.gelu(b).expand(4, 8))
    assert counted_fallbacks.stats()["fallbacks"] == {"linear:alignment": 1}
