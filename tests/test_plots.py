"""Plots of a profile CSV and the roofline ceilings file (CPU, synthetic rows in the real schema)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cvt_cutlass.operators.linear import heuristic_spec
from cvt_cutlass.operators.linear.problems import linear_problems

from cvt_cutlass.tools.plots import _layer_groups, plot_profile, read_ceilings
from cvt_cutlass.tools.sweep.driver import append_ceilings, ceilings_path
from cvt_cutlass.tools.sweep.linear import append_rows, gemm_row


def _rows(batches, dtype="fp16"):
    rows, seen = [], set()
    for b in batches:
        for i, p in enumerate(linear_problems("cvt-13", b)):
            if (p.m, p.n, p.k, p.epilogue) in seen:
                continue
            seen.add((p.m, p.n, p.k, p.epilogue))
            spec = heuristic_spec(p.m, p.n, p.k, dtype, p.epilogue, 90)
            base = {"kernel_path": "sm90", "gpu": "Test GPU", "date": "2026-11-21", "cutlass_version": "4.2.0.0"}
            t = p.flops / 300e9  # ms at 300 TFLOP/s
            rows.append(gemm_row(i, "pytorch", f"torch:{p.unfused}", "passed", "success", p.m, p.n, p.k,
                                 dtype, p.epilogue, 1.5 * t, extra=base))
            rows.append(gemm_row(i, "cutlass", spec.name, "passed", "success", p.m, p.n, p.k,
                                 dtype, p.epilogue, t, spec, extra=base))
            rows.append(gemm_row(i, "cutlass", spec.with_(raster="m").name, "incorrect", "success",
                                 p.m, p.n, p.k, dtype, p.epilogue, t / 10, spec, extra=base))
    return rows


def test_ceilings_round_trip(tmp_path):
    path = ceilings_path(tmp_path / "sweep.csv")
    assert path.name == "sweep_ceilings.csv"
    base = {"gpu": "Test GPU", "date": "2026-11-21", "problem": "x", "runtime_ms": "1"}
    append_ceilings(path, [{**base, "dtype": "fp32", "kind": "copy_bandwidth", "value": v, "unit": "GB/s"}
                           for v in ("4000", "4300", "4200")])
    append_ceilings(path, [{**base, "dtype": "fp16", "kind": "gemm_tflops", "value": "780", "unit": "TFLOP/s"}])
    c = read_ceilings(path)
    assert c["copy_GBps"] == 4200.0 and c["gemm_TFLOPs"] == {"fp16": 780.0} and c["gpu"] == "Test GPU"
    assert read_ceilings(tmp_path / "missing.csv") == {}


def test_layer_groups_merge_equal_problems():
    g = _layer_groups("cvt-13", [256], None)[256]
    labels = [lab for lab, _ in g]
    assert "s1.k/v" in labels and "s1.k" not in labels and "head" in labels
    assert len(g) == 16


def test_plot_profile_writes_pngs(tmp_path):
    prof = tmp_path / "sweep.csv"
    append_rows(prof, _rows([1, 256]))
    append_ceilings(ceilings_path(prof), [
        {"gpu": "Test GPU", "date": "2026-11-21", "dtype": "fp32", "kind": "copy_bandwidth", "problem": "x",
         "runtime_ms": "1", "value": "4300", "unit": "GB/s"},
        {"gpu": "Test GPU", "date": "2026-11-21", "dtype": "fp16", "kind": "gemm_tflops", "problem": "x",
         "runtime_ms": "1", "value": "790", "unit": "TFLOP/s"}])
    out = plot_profile(prof, tmp_path / "plots", batches=(1, 256))
    assert sorted(p.name for p in out) == ["linear_roofline_sm90_fp16.png", "linear_tflops_sm90_fp16.png"]
    for p in out:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_plot_model_bench_writes_one_png_per_model_and_dtype(tmp_path):
    """Throughput vs batch from a model-benchmark CSV (the committed H200 one): one PNG per (model,
    dtype), a panel per image size."""
    pytest.importorskip("matplotlib")
    from cvt_cutlass.tools.plots import plot_model_bench

    csv_path = Path(__file__).resolve().parent.parent / "profiles" / "model_bench_h200.csv"
    paths = plot_model_bench(csv_path, tmp_path)
    assert [p.name for p in paths] == ["model_cvt-13_fp16.png"]
    assert paths[0].stat().st_size > 10_000
    empty = tmp_path / "empty.csv"
    empty.write_text("date,gpu\n")
    with pytest.raises(ValueError, match="no rows"):
        plot_model_bench(empty, tmp_path)


def test_append_csv_keeps_rows_under_their_names(tmp_path):
    """A benchmark CSV appended by a later version with more or reordered columns: rows land under
    the file's header when it has every column, else a clear error (never shifted columns)."""
    import csv

    from cvt_cutlass.tools.csvfile import append_csv

    out = tmp_path / "bench.csv"
    append_csv(out, [{"a": 1, "b": 2}], ["a", "b"])
    append_csv(out, [{"b": 4, "a": 3}], ["b", "a"])
    with open(out, newline="") as f:
        assert list(csv.DictReader(f)) == [{"a": "1", "b": "2"}, {"a": "3", "b": "4"}]
    with pytest.raises(ValueError, match=r"without \['c'\]"):
        append_csv(out, [{"a": 5, "b": 6, "c": 7}], ["a", "b", "c"])
