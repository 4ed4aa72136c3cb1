"""Selection table and heuristic, model problem enumeration, profiler-schema rows (CPU)."""

from __future__ import annotations

import pytest
from cvt_cutlass.operators import selection
from cvt_cutlass.operators.linear import LinearSpec, heuristic_spec, select_linear, select_linear_backward
from cvt_cutlass.operators.linear.problems import linear_problems
from cvt_cutlass.operators.spec import parse_kernel_name

from cvt_cutlass import runtime
from cvt_cutlass.models import get_config, stage_shapes
from cvt_cutlass.tools.sweep.driver import read_rows
from cvt_cutlass.tools.sweep.linear import GEMM_COLUMNS, append_rows, best_per_problem, gemm_row


def test_cvt13_token_counts():
    st = stage_shapes(get_config("cvt-13"))
    assert [(s.tokens_q, s.tokens_kv) for s in st] == [(3136, 784), (784, 196), (197, 50)]
    assert [s.dim for s in st] == [64, 192, 384]
    w24 = stage_shapes(get_config("cvt-w24"), 384)
    assert [(s.tokens_q, s.tokens_kv) for s in w24] == [(9216, 2304), (2304, 576), (577, 145)]


def test_cvt13_linear_problems():
    probs = {p.label: p for p in linear_problems("cvt-13", 256)}
    assert (probs["s1.fc1"].m, probs["s1.fc1"].n, probs["s1.fc1"].k) == (802816, 256, 64)
    assert probs["s1.fc1"].epilogue == "bias_gelu"
    assert (probs["s3.k"].m, probs["s3.k"].n) == (12800, 384)
    assert probs["s3.fc2"].epilogue == "bias_residual" and probs["s3.fc2"].count == 10
    assert (probs["head"].m, probs["head"].n, probs["head"].k) == (256, 1000, 384)
    # 6 Linear layers per block: q, k, v, proj, fc1, fc2; 13 blocks; plus the head.
    assert sum(p.count for p in linear_problems("cvt-13", 1)) == 6 * 13 + 1


def _row(**kw):
    base = dict(op="linear", arch=90, gpu="NVIDIA H200", cutlass="4.2.0.0", dtype="fp16",
                epilogue="bias", m=802816, n=64, k=64, runtime_ms=0.1, peer_ms=0.12, date="2026-11-21",
                kernel=LinearSpec(90, "fp16", "bias", (128, 64, 64), schedule="pingpong").name)
    base.update(kw)
    return base


def test_table_round_trip_and_lookup(tmp_path):
    t = selection.SelectionTable()
    t.upsert(_row())
    t.upsert(_row(m=3136, kernel=LinearSpec(90, "fp16", "bias", (64, 64, 64), schedule="pingpong").name))
    t.upsert(_row(m=3136, gpu="NVIDIA H100", kernel=LinearSpec(90, "fp16", "bias", (128, 64, 64)).name))
    t.upsert(_row())  # same key: replaced, not duplicated
    path = t.save(tmp_path / "linear_selection.csv")
    text = path.read_text()
    assert text.startswith("# cvt_cutlass kernel selection table")
    t2 = selection.SelectionTable.load(path)
    assert len(t2.rows) == 3
    assert t2.dumps() == text  # stable, sorted output
    assert "t64x64x64" in t2.lookup("linear", 90, "fp16", "bias", 4000, 64, 64, gpu="NVIDIA H200")
    assert "t128x64x64_c1x1x1_sauto_coop" in t2.lookup("linear", 90, "fp16", "bias", 4000, 64, 64, gpu="NVIDIA H100")
    assert "t128x64x64_c1x1x1_sauto_pingpong" in t2.lookup("linear", 90, "fp16", "bias", 500000, 64, 64)
    assert t2.lookup("linear", 90, "fp16", "bias", 1, 64, 64) is None  # too far from any measured M
    assert t2.lookup("linear", 90, "bf16", "bias", 3136, 64, 64) is None
    assert t2.lookup("linear", 90, "fp16", "bias", 3136, 128, 64) is None


def test_select_uses_table_then_heuristic(tmp_path, monkeypatch):
    t = selection.SelectionTable([_row()])
    t.save(tmp_path / "linear_selection.csv")
    monkeypatch.setenv("CVT_CUTLASS_SELECTION_DIR", str(tmp_path))
    runtime.reload_tables()
    try:
        c = select_linear(802816, 64, 64, "fp16", "bias", 90, "NVIDIA H200")
        assert c.source == "table" and c.spec.schedule == "pingpong"
        c = select_linear(802816, 64, 64, "fp16", "bias_gelu", 90, "NVIDIA H200")
        assert c.source == "heuristic" and c.spec == heuristic_spec(802816, 64, 64, "fp16", "bias_gelu", 90)
    finally:
        monkeypatch.delenv("CVT_CUTLASS_SELECTION_DIR")
        runtime.reload_tables()


def test_table_with_missing_columns_is_rejected(tmp_path):
    (tmp_path / "t.csv").write_text("op,arch\nlinear,90\n")
    with pytest.raises(ValueError, match="lacks columns"):
        selection.SelectionTable.load(tmp_path / "t.csv")


@pytest.mark.parametrize("arch", [89, 90])
def test_heuristic_specs_are_valid(arch):
    for p in linear_problems("cvt-w24", 3, 384) + linear_problems("cvt-13", 1):
        s = heuristic_spec(p.m, p.n, p.k, "bf16", p.epilogue, arch)
        assert s.arch == arch and s.epilogue == p.epilogue


def test_profiler_schema_round_trip(tmp_path):
    spec = LinearSpec(90, "fp16", "bias_gelu", (128, 256, 64), cluster=(2, 1, 1))
    extra = {"kernel_path": "sm90", "gpu": "NVIDIA H200", "date": "2026-11-21"}
    rows = [
        gemm_row(0, "pytorch", "torch:linear+bias, gelu", "passed", "success", 802816, 256, 64, "fp16",
                 "bias_gelu", 0.35, extra=extra),
        gemm_row(0, "cutlass", spec.name, "passed", "success", 802816, 256, 64, "fp16", "bias_gelu", 0.2,
                 spec, extra=extra),
        gemm_row(0, "cutlass", spec.with_(schedule="pingpong", tile=(64, 256, 64), cluster=(1, 1, 1)).name,
                 "incorrect", "success", 802816, 256, 64, "fp16", "bias_gelu", None, spec, extra=extra),
    ]
    path = tmp_path / "p.csv"
    append_rows(path, rows[:1])
    append_rows(path, rows[1:])  # appending keeps one header
    back = read_rows(path)
    assert list(back[0]) == list(GEMM_COLUMNS)
    assert len(back) == 3 and back[1]["cta_n"] == "256" and back[1]["cluster_m"] == "2"
    assert back[1]["Flops"] == str(2 * 802816 * 256 * 64) and float(back[1]["GFLOPs"]) > 0
    best = best_per_problem(back)
    ((key, (row, peer)),) = best.items()
    assert key == ("sm90", "f16", "bias_gelu", 802816, 256, 64)
    assert row["Operation"] == spec.name and peer["Provider"] == "pytorch"


def test_packaged_table_is_found_and_consistent():
    """The shipped table loads through the installed package and names valid kernels that match
    their rows (a stale or misplaced table would silently turn every choice into a heuristic)."""
    from cvt_cutlass.operators.spec import parse_kernel_name as parse_name

    path = selection.table_path("linear")
    assert path.is_file(), path
    table = selection.SelectionTable.load(path)
    assert len(table.rows) >= 100
    for r in table.rows:
        spec = parse_name(r["kernel"])
        pass_, _, epi = r["epilogue"].rpartition(":")  # backward rows: "<pass>:<epilogue>"
        assert (spec.pass_, spec.dtype) == (pass_ or "fwd", r["dtype"]), r
        if pass_ == "wgrad":  # SM80-class (both paths) or SM90 (sm90 path only) kernels; db or not
            assert epi in ("dbias", "none") and (spec.arch == 89 or r["arch"] == "90"), r
        else:
            assert (str(spec.arch), spec.epilogue) == (r["arch"], epi), r
    runtime.reload_tables()
    c = select_linear(802816, 256, 64, "fp16", "bias_gelu", 90, "NVIDIA H200")
    assert c.source == "table"
    for pass_, m, n, k, epi in (("dgrad", 401408, 256, 64, "dgelu_dbias"), ("wgrad", 25216, 384, 1536, "dbias")):
        assert select_linear_backward(pass_, m, n, k, "bf16", epi, 90, "NVIDIA H200").source == "table"


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_tiny_sweep_end_to_end_gpu(tmp_path, monkeypatch):
    """Two candidates on CvT-13's batch-1 fc1 problems: profiler rows (PyTorch + both kernels,
    checked and timed), then a selection table naming the faster passing kernel per problem."""
    import types

    import cvt_cutlass.operators.linear as ol
    import torch

    from cvt_cutlass.tools.sweep.linear import sweep_linear
    from cvt_cutlass.tools.sweep.tables import update_from_rows

    cc = runtime.device_info(torch.cuda.current_device()).cc
    arch = 90 if cc == 90 else 89
    first = heuristic_spec(3136, 256, 64, "fp16", "bias_gelu", arch)
    second = (first.with_(schedule="pingpong", tile=(64, 64, 64)) if arch == 90
              else first.with_(tile=(64, 64, 32), stages=5))
    monkeypatch.setattr(ol, "candidates", lambda a, dt, e: [first, second])
    # Stage 2: one raster/swizzle variant of each problem's winner.
    monkeypatch.setattr(ol, "refinements",
                        lambda s: [s.with_(raster="m") if s.arch == 90 else s.with_(swizzle=2)])
    args = types.SimpleNamespace(model="cvt-13", batch=[1], image_size=None, dtype=["fp16"],
                                 arch=[arch], epilogue=["bias_gelu"], jobs=None)
    out = tmp_path / "p.csv"
    rows = sweep_linear(args, set(), out)
    back = read_rows(out)
    assert len(rows) == len(back) == 3 * 4  # 3 fc1 problems x (PyTorch + 2 kernels + 1 variant)
    assert {r["Disposition"] for r in back} == {"passed"}
    assert all(float(r["Runtime"]) > 0 for r in back)
    assert sum(r["Provider"] == "pytorch" for r in back) == 3
    for i in range(3):  # each problem's variant is one of its stage-1 winner
        mine = [r for r in back if r["Problem"] == str(i) and r["Provider"] == "cutlass"]
        winner = min(mine[:2], key=lambda r: float(r["Runtime"]))["Operation"]
        variant = parse_kernel_name(mine[2]["Operation"])
        assert variant.with_(raster="h", swizzle=1).name == winner
    # Resuming skips everything already measured.
    assert sweep_linear(args, {tuple(r[c] for c in ("Provider", "Operation", "m", "n", "k", "epilogue",
                                                     "kernel_path", "A")) for r in back}, out, prior=back) == []
    (path,) = update_from_rows(back, str(tmp_path))
    table = selection.SelectionTable.load(path)
    assert len(table.rows) == 3
    for r in table.rows:
        mine = [b for b in back if b["Provider"] == "cutlass" and b["m"] == r["m"] and b["n"] == r["n"]]
        assert r["kernel"] == min(mine, key=lambda b: float(b["Runtime"]))["Operation"]
    assert selection.table_path("linear") != path  # the packaged table was not redirected
