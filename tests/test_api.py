"""The public API as a user reaches it: every name callable whatever was imported first, the
kernel sets a model needs at any batch size, table choices with a tolerance, dtype errors."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import cvt_cutlass


def _submodules() -> list[str]:
    names = []
    for pkg in ("cvt_cutlass", "cvt_cutlass.ops", "cvt_cutlass.operators", "cvt_cutlass.epilogues",
                "cvt_cutlass.tools", "cvt_cutlass.tools.bench", "cvt_cutlass.tools.sweep", "cvt_cutlass.cli",
                "cvt_cutlass.train"):
        mod = importlib.import_module(pkg)
        names += [f"{pkg}.{m.name}" for m in pkgutil.iter_modules(mod.__path__) if m.name != "__main__"]
    return sorted(set(names))


def test_every_public_name_works_after_importing_every_submodule():
    """`import cvt_cutlass.swap` (or any submodule) must not shadow a public function: the import
    system sets the package attribute to the module. Every public name is resolved after all
    submodules are imported; the callables among them are called with a tiny CPU model or tensor
    where that makes sense, the rest are only checked to be callable or a class."""
    code = (
        "import importlib, torch, cvt_cutlass\n"
        f"for m in {_submodules()!r}:\n"
        "    importlib.import_module(m)\n"
        "from cvt_cutlass.checkpoint import random_cvt as build_model\n"
        "model = build_model('cvt-13')\n"
        "assert callable(cvt_cutlass.swap) and callable(cvt_cutlass.unswap), type(cvt_cutlass.swap)\n"
        "cvt_cutlass.swap(model)\n"
        "from cvt_cutlass.swap import is_swapped\n"
        "assert is_swapped(model); cvt_cutlass.unswap(model); assert not is_swapped(model)\n"
        "import cvt_cutlass.swap as sw\n"
        "sw(model); assert is_swapped(model)\n"
        "for name in cvt_cutlass.__all__:\n"
        "    v = getattr(cvt_cutlass, name)\n"
        "    assert name == '__version__' or callable(v), (name, type(v))\n"
        "x = torch.randn(2, 4, 16)\n"
        "assert cvt_cutlass.linear(x, torch.randn(8, 16)).shape == (2, 4, 8)\n"
        "assert cvt_cutlass.layer_norm_tokens(x, torch.ones(16), torch.zeros(16), 1e-5).shape == (2, 4, 16)\n"
        "assert len(cvt_cutlass.model_kernels('cvt-13', 224, 'fp16', 90)) > 10\n"
        "assert isinstance(cvt_cutlass.stats(), dict)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_swap_module_is_callable_in_process():
    import cvt_cutlass.swap as sw

    assert callable(sw) and callable(cvt_cutlass.swap)


# ----------------------------------------------------------------------------- model_kernels
def _brute_force(cfg, size, dt, arch, batches):
    """The union over batches of what every op selects (the definition model_kernels must meet)."""

    out = set()
    for b in batches:
        out |= {s.name for s in _forward_kernels_at(cfg, size, dt, arch, b)}
    return out


def _forward_kernels_at(cfg, size, dt, arch, b):
    from cvt_cutlass.operators.attention import attention_problems, select_attention
    from cvt_cutlass.operators.conv2d import conv_problems, conv_window, select_conv2d, stem_channels
    from cvt_cutlass.operators.dwconv import select_dwconv
    from cvt_cutlass.operators.layernorm import layernorm_problems, select_layernorm
    from cvt_cutlass.operators.linear import select_linear
    from cvt_cutlass.operators.linear.problems import linear_problems

    gpu = "NVIDIA H200"
    for p in linear_problems(cfg, b, size):
        yield select_linear(p.m, p.n, p.k, dt, p.epilogue, arch, gpu).spec
    for n in layernorm_problems(cfg, b, size):
        yield select_layernorm(n.rows, n.channels, dt, arch, gpu).spec
    for lay in conv_problems(cfg, b, size):
        if lay.kind == "embed":
            c = stem_channels(lay.c) if lay.c % 8 else lay.c
            window = conv_window(c, lay.k, lay.r, lay.r, lay.w, lay.stride, lay.pad)
            yield select_conv2d(lay.n * lay.p * lay.q, lay.k, lay.r * lay.r * c, c, dt, arch, gpu, window).spec
        else:
            yield select_dwconv(lay.n * lay.p * lay.q, lay.c, lay.stride, dt, arch, gpu).spec
    for a in attention_problems(cfg, b, size):
        yield select_attention(a.n, a.heads, a.lq, a.lkv, a.head_dim, dt, arch, gpu).spec


@pytest.mark.parametrize("arch", [89, 90])
@pytest.mark.parametrize("size", [224, 384, (225, 223)])
def test_model_kernels_cover_every_batch_size(arch, size):
    """What model_kernels lists (probing only bucket boundaries) is exactly what any batch from 1
    to 1024 selects: after building it, a new batch size builds nothing."""
    from cvt_cutlass.models import get_config

    cfg = get_config("cvt-13")
    listed = {s.name for s in cvt_cutlass.model_kernels(cfg, size, "fp16", arch, gpu="NVIDIA H200",
                                                        residual_stream="compute")}
    assert listed == _brute_force(cfg, size, "fp16", arch, range(1, 1025))


def test_model_kernels_accepts_models_configs_and_names():
    from transformers import CvtConfig

    from cvt_cutlass.models import get_config

    a = {s.name for s in cvt_cutlass.model_kernels("cvt-13", 224, "bf16", 90)}
    b = {s.name for s in cvt_cutlass.model_kernels(get_config("cvt-13"), 224, "bf16", 90)}
    c = {s.name for s in cvt_cutlass.model_kernels(CvtConfig(num_labels=1000), 224, "bf16", 90)}
    assert a == b == c
    both = cvt_cutlass.model_kernels("cvt-13", 224, ["fp16", "bf16"], 90)
    assert {s.dtype for s in both} == {"fp16", "bf16"}
    assert all(s.pass_ == "fwd" for s in both)


@pytest.mark.parametrize("arch", [89, 90])
def test_model_kernels_of_an_fp32_residual_stream(arch):
    """residual_stream="fp32" (the default) adds, to the 16-bit set ("compute"), an _rf32 twin of
    every Linear forward that adds a residual (and an _rf32in twin of the plain residual one: a
    stage's last fc2, rounded), the _xf32 / _yf32 twins of every LayerNorm, forward and backward,
    and an _xf32r16 twin of every backward."""
    plain = {s.name: s for s in cvt_cutlass.model_kernels("cvt-13", 224, "bf16", arch, True, residual_stream="compute")}
    fp32 = {s.name: s for s in cvt_cutlass.model_kernels("cvt-13", 224, "bf16", arch, True)}
    assert set(plain) <= set(fp32)
    extra = [fp32[n] for n in set(fp32) - set(plain)]
    residual_fwd = [s for s in plain.values() if s.op == "linear" and s.pass_ == "fwd" and "residual" in s.epilogue]
    norms = [s for s in plain.values() if s.op == "layernorm"]
    assert residual_fwd and norms
    assert {s.name for s in extra} == {s.with_(residual="f32").name for s in residual_fwd} | {
        s.with_(residual="f32in").name for s in residual_fwd if s.epilogue == "bias_residual"} | {
        s.with_(io=io).name for s in norms for io in ("xf32", "yf32")} | {
        s.with_(io="xf32r16").name for s in norms if s.pass_ == "bwd"}


def test_model_kernels_for_training_cover_every_backward_family():
    """training=True adds the training forward's kernels and a backward kernel of every family the
    step calls, for both paths."""
    for arch in (90, 89):
        fwd = {s.name for s in cvt_cutlass.model_kernels("cvt-13", 224, "bf16", arch)}
        train = cvt_cutlass.model_kernels("cvt-13", 224, "bf16", arch, training=True)
        assert {s.name for s in train} > fwd
        kinds = {(s.op, s.pass_) for s in train}
        for kind in (("linear", "dgrad"), ("linear", "wgrad"), ("layernorm", "bwd"), ("attention", "bwd"),
                     ("conv2d", "dgrad"), ("conv2d", "wgrad"), ("dwconv", "fwd"), ("dwconv", "bwd")):
            assert kind in kinds, (arch, kind)
        names = {s.name for s in train}
        assert any("_bias_gelu_dgelu_" in n for n in names)  # fc1 keeps GELU's derivative
        assert any("_dgelu_saved_dbias_" in n for n in names)  # which fc2's dgrad multiplies by
        assert any(s.op == "dwconv" and getattr(s, "groups", None) for s in train)  # batch-statistics kernels


def test_a_new_image_size_shares_the_kernels_whose_shapes_do_not_change():
    at224 = {s.name for s in cvt_cutlass.model_kernels("cvt-13", 224, "fp16", 90)}
    at256 = {s.name for s in cvt_cutlass.model_kernels("cvt-13", 256, "fp16", 90)}
    assert len(at224 & at256) >= len(at256) // 2  # most of them: widths and channels do not move


# ----------------------------------------------------------------------------- kernel sets
def test_choose_kernels_tolerance_trades_a_bounded_loss_for_fewer_kernels():
    from cvt_cutlass.operators.selection import choose_kernels

    g = ("linear", "90", "GPU", "fp16")
    measured = {
        (*g, "bias", 1, 64, 64): {"a": 1.00, "b": 1.04, "c": 1.50},
        (*g, "bias", 2, 64, 64): {"a": 1.10, "b": 1.00},
        (*g, "bias", 3, 64, 64): {"c": 1.00, "b": 1.02},
        (("attention", "90", "GPU", "fp16", "h1", 1, 1, 64)): {"x": 1.0},
    }
    fastest = choose_kernels(measured, 0.0)
    assert [fastest[k] for k in list(measured)[:3]] == ["a", "b", "c"]
    few = choose_kernels(measured, 0.05)
    assert {few[k] for k in list(measured)[:3]} == {"b"}  # one kernel within 5% of every problem's fastest
    for k, name in few.items():
        assert measured[k][name] <= min(measured[k].values()) * 1.05
    with pytest.raises(ValueError):
        choose_kernels(measured, -0.1)


def test_packaged_tables_stay_within_their_tolerance_of_the_sweeps():
    """The packaged selection tables were written from the packaged sweeps with the CLI's default
    tolerance: every row's kernel is within it of the fastest passing kernel measured there."""
    from cvt_cutlass.operators.selection import SelectionTable, table_path

    from cvt_cutlass.cli import TABLE_TOLERANCE
    from cvt_cutlass.tools.sweep.driver import read_rows

    sweep = read_rows(Path(__file__).resolve().parents[1] / "profiles" / "linear_cvt13_h200.csv")
    best, times = {}, {}
    for r in sweep:
        if r["Provider"] == "cutlass" and r["Disposition"] == "passed" and r["Runtime"]:
            key = (r["kernel_path"].removeprefix("sm"), r["epilogue"], r["m"], r["n"], r["k"], r["A"][:3])
            t = float(r["Runtime"])
            best[key] = min(t, best.get(key, t))
            times[(key, r["Operation"])] = t
    table = SelectionTable.load(table_path("linear"))
    checked = 0
    for row in table.rows:
        dt = "f16" if row["dtype"] == "fp16" else "bf1"
        key = (row["arch"], row["epilogue"], row["m"], row["n"], row["k"], dt)
        if (key, row["kernel"]) in times:
            assert times[(key, row["kernel"])] <= best[key] * (1 + TABLE_TOLERANCE) + 1e-9, row
            checked += 1
    assert checked > 100


# ----------------------------------------------------------------------------- dtype errors
def test_non_floating_inputs_raise_on_every_op():
    import torch

    t = torch.ones
    cases = {
        "linear": lambda dt: cvt_cutlass.linear(t(2, 8, dtype=dt), t(8, 8, dtype=dt)),
        "layer_norm_tokens": lambda dt: cvt_cutlass.layer_norm_tokens(t(1, 2, 8, dtype=dt), t(8, dtype=dt),
                                                                      t(8, dtype=dt), 1e-5),
        "attention": lambda dt: cvt_cutlass.attention(t(1, 4, 1, 8, dtype=dt), t(1, 4, 1, 8, dtype=dt),
                                                      t(1, 4, 1, 8, dtype=dt), 0.5),
        "dwconv_tokens": lambda dt: cvt_cutlass.dwconv_tokens(t(1, 4, 8, dtype=dt), t(3, 3, 8), t(8), 2, 2, 1),
        "conv2d_nhwc": lambda dt: cvt_cutlass.conv2d_nhwc(t(1, 4, 4, 8, dtype=dt), t(8, 3, 3, 8, dtype=dt),
                                                          t(8, dtype=dt), 1, 1),
    }
    for op, call in cases.items():
        for dt in (torch.int32, torch.bool, torch.int64):
            with pytest.raises(TypeError, match=f"cvt_cutlass.{op}: .* must be a floating-point tensor"):
                call(dt)


@pytest.mark.parametrize("kw", [{"arch": 80}, {"arch": [89, 100]}, {"batches": []}, {"batches": [0]},
                                {"image_size": 0}, {"image_size": -5}])
def test_kernels_for_refuses_what_it_would_quietly_change(kw):
    """An arch that is not a kernel path (it emitted sm89 kernels), no or non-positive batches, a
    non-positive image size (taken as the model's): ValueError naming the value."""
    with pytest.raises(ValueError, match="arch|batches"):
        cvt_cutlass.kernels_for("linear", **kw)
