"""The profile sweeps end to end (GPU): every family through the one driver (tools/sweep/driver.py),
each with its heuristic kernel as the only candidate so that nothing new is built: peer and kernel
rows in the profiler's schema, every kernel checked against its reference and timed, a resumed
sweep that measures nothing again, and selection tables the runtime reads back. CPU: the items a
sweep makes."""

from __future__ import annotations

import types

import pytest
import torch
from cvt_cutlass.operators.conv2d import conv_problems

from cvt_cutlass import runtime
from cvt_cutlass.cli.args import epilogue_names
from cvt_cutlass.tools.sweep import attention as sa
from cvt_cutlass.tools.sweep import conv as sc
from cvt_cutlass.tools.sweep import linear as sl
from cvt_cutlass.tools.sweep.driver import read_rows, sweep_items
from cvt_cutlass.tools.sweep.tables import update_from_rows

from .conftest import requires_sm80


def _args(**kw):
    base = dict(model="cvt-13", batch=[1], image_size=None, dtype=["bf16"], jobs=None, epilogue=None, refine=False,
                passes=["fwd"])
    return types.SimpleNamespace(**{**base, **kw})


def _arch() -> int:
    return runtime.arch_for(runtime.device_info(torch.cuda.current_device()).cc)


def test_conv_training_items_leave_out_the_stems_dgrad():
    emb = [lay for lay in conv_problems("cvt-13", 8) if lay.kind == "embed"]
    items = sweep_items([90], ["bf16"], emb, sc.candidates_of, ("dgrad", "wgrad"))
    assert [(it.problem.label, it.pass_) for it in items] == [
        ("s1.embed", "wgrad"), ("s2.embed", "dgrad"), ("s2.embed", "wgrad"), ("s3.embed", "dgrad"),
        ("s3.embed", "wgrad")]
    assert sc.sweep_passes("dwconv", ["train"]) == ["bn_fwd", "bn_bwd"]
    assert sc.sweep_passes("conv2d", ["fwd", "wgrad"]) == ["fwd", "wgrad"]


def _check_rows(rows, out, kernels: int):
    """The rows written are the rows returned; every one passed and was timed; ``kernels`` rows
    are CUTLASS's, the rest the peers'."""
    back = read_rows(out)
    assert len(back) == len(rows), back
    assert {r["Disposition"] for r in back} == {"passed"}, [r for r in back if r["Disposition"] != "passed"]
    assert all(float(r["Runtime"]) > 0 for r in back)
    cutlass = [r for r in back if r["Provider"] == "cutlass"]
    assert len(cutlass) == kernels and len(back) > kernels
    for r in cutlass:
        assert float(r["rel_err"]) <= 2 * float(r["peer_rel_err"]) + 2e-3
    return back


def test_linear_forward_sweep_takes_the_training_forwards_gelu_aux_on_fc1s_problems():
    probs = sl.forward_problems(_args(batch=[1, 128], epilogue=["bias_gelu_aux"]))
    assert [(p.label, p.m, p.n, p.k, p.epilogue) for p in probs] == [
        (f"s{i}.fc1", b * t, 4 * c, c, "bias_gelu_aux")
        for b in (1, 128) for i, t, c in ((1, 3136, 64), (2, 784, 192), (3, 197, 384))]
    saved = sl.forward_problems(_args(batch=[128], epilogue=["bias_gelu_dgelu"]))
    assert [p.epilogue for p in saved] == ["bias_gelu_dgelu"] * 3
    inference = sl.forward_problems(_args(batch=[1]))  # default: the forward's own epilogues only
    assert {p.epilogue for p in inference} == {"bias", "bias_gelu", "bias_residual"}


def test_linear_backward_sweep_takes_the_epilogues_asked_for():
    fc2 = sl.backward_sweep_problems(_args(batch=[128], passes=["dgrad"], epilogue=["dgelu_saved_dbias"]))
    assert [(p.label, p.pass_, p.m, p.epilogue) for p in fc2] == [
        (f"s{i}.fc2", "dgrad", 128 * t, "dgelu_saved_dbias") for i, t in ((1, 3136), (2, 784), (3, 197))]
    every = sl.backward_sweep_problems(_args(batch=[128], passes=["dgrad", "wgrad"]))
    assert {p.epilogue for p in every} == {"none", "dgelu_saved_dbias", "dbias"} and len(every) > len(fc2)
    assert "dgelu_saved_dbias" in epilogue_names() and "bias_gelu_dgelu" in epilogue_names()


@requires_sm80
@pytest.mark.parametrize("epilogue", ["bias_residual", "bias_gelu_aux", "bias_gelu_dgelu"])
def test_linear_forward_sweep_end_to_end_gpu(tmp_path, monkeypatch, epilogue):
    import cvt_cutlass.operators.linear as ol

    arch = _arch()
    a = _args(arch=[arch], epilogue=[epilogue])
    probs = sl.forward_problems(a)
    heur = {p.label: ol.heuristic_spec(p.m, p.n, p.k, "bf16", p.epilogue, arch) for p in probs}
    monkeypatch.setattr(ol, "candidates", lambda arch_, dt, epi: [heur[p.label] for p in probs if p.epilogue == epi][:1])
    out = tmp_path / "linear.csv"
    back = _check_rows(sl.sweep(a, out), out, kernels=len(probs))
    assert {r["epilogue"] for r in back} == {epilogue}
    assert sl.sweep(a, out) == back and len(read_rows(out)) == len(back)  # resumed: nothing measured again
    (table,) = update_from_rows(back, str(tmp_path))
    assert table.name == "linear_selection.csv" and len(read_rows(table)) > 0


@requires_sm80
def test_attention_sweeps_end_to_end_gpu(tmp_path, monkeypatch):
    import cvt_cutlass.operators.attention as oa

    arch = _arch()
    monkeypatch.setattr(oa, "attn_candidates", lambda dt, d, a, lkv: [oa.attn_heuristic(dt, d, 197, a, lkv)])
    monkeypatch.setattr(oa, "attn_bwd_candidates", lambda dt, d, a, lkv: [oa.attn_bwd_heuristic(dt, d, a, lkv)])
    for passes in (["fwd"], ["bwd"]):
        out = tmp_path / f"attn_{passes[0]}.csv"
        back = _check_rows(sa.sweep(_args(arch=[arch], passes=passes), out), out, kernels=3)  # CvT-13: 3 stages
        assert {r["OperationKind"] for r in back} == {"fmha" if passes == ["fwd"] else "fmha_bwd"}
        assert update_from_rows(back, str(tmp_path))


def _heuristic_training_kernels(arch, dt, lay, pass_):
    """conv_bwd / dwconv_bn heuristics as the only candidates (None: the stem's dgrad)."""
    import cvt_cutlass.operators.conv2d as oc
    import cvt_cutlass.operators.dwconv as od

    if pass_ in ("dgrad", "wgrad"):
        c = oc.stem_channels(lay.c)
        return None if pass_ == "dgrad" and c % 8 else [oc.conv_bwd_heuristic(pass_, dt, c, lay.k)]
    return [od.dwconv_bn_heuristic(dt, lay.c, lay.stride, arch, pass_.removeprefix("bn_"))]


@requires_sm80
@pytest.mark.parametrize("op,passes,kernels", [("conv2d", ["dgrad", "wgrad"], 5), ("dwconv", ["train"], 12)])
def test_conv_training_sweep_end_to_end_gpu(tmp_path, monkeypatch, op, passes, kernels):
    """CvT-13's embedding convs (5 gradients: no stem dgrad) and its 6 depthwise projections x
    (bn_fwd, bn_bwd)."""
    monkeypatch.setattr(sc, "candidates_of", _heuristic_training_kernels)
    out = tmp_path / f"{op}.csv"
    a = _args(op=op, arch=[_arch()], passes=passes)
    back = _check_rows(sc.sweep(a, out), out, kernels=kernels)
    assert {r["conv_kind"] for r in back} == ({"dgrad", "wgrad"} if op == "conv2d" else {"fprop", "dgrad_wgrad"})
    assert sc.sweep(a, out) == back
