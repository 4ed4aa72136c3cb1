"""`cvt-cutlass` argument errors: one line naming the bad value and the valid choices, status 2,
no traceback (CPU only: nothing here compiles a kernel or needs a GPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cvt_cutlass.cli import main


def _usage_error(capsys, argv: list[str]) -> str:
    """Run ``main(argv)``, expect argparse's exit status 2, return its one error line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]) and "Traceback" not in err, err
    return errors[0]


@pytest.mark.parametrize("cmd", ["emit", "build", "profile"])
@pytest.mark.parametrize("arch", ["75", "80", "100", "89,100", "sm90"])
def test_bad_arch(capsys, tmp_path, cmd, arch):
    line = _usage_error(capsys, [cmd, "--arch", arch, "--out", str(tmp_path)] if cmd != "build"
                        else [cmd, "--arch", arch])
    bad = arch.split(",")[-1]
    assert line.startswith(f"cvt-cutlass {cmd}: error: argument --arch:")
    assert f"'{bad}'" in line and "89, 90" in line


def test_bad_epilogue(capsys, tmp_path):
    from cvt_cutlass.epilogues import LINEAR_EPILOGUES

    line = _usage_error(capsys, ["emit", "--epilogue", "bias,relu", "--out", str(tmp_path)])
    assert "unknown epilogue 'relu'" in line and all(e in line for e in LINEAR_EPILOGUES)


@pytest.mark.parametrize("argv", [
    ["emit", "--dtype", "fp16,fp32", "--out", "d"],
    ["build", "--dtype", "fp32"],
    ["bench", "--dtype", "fp32"],
    ["run", "--dtype", "fp32"],
])
def test_bad_dtype(capsys, argv):
    line = _usage_error(capsys, argv)
    assert "--dtype" in line and "'fp32'" in line and "fp16" in line and "bf16" in line


@pytest.mark.parametrize("argv", [
    ["run", "--model", "cvt-99"],
    ["run", "--config", "cvt-99"],
    ["emit", "--model", "cvt-99", "--out", "d"],
    ["bench", "--model", "cvt-99"],
    ["plot", "--model", "cvt-99", "--profile", "pyproject.toml", "--out", "d"],
])
def test_bad_model(capsys, argv):
    line = _usage_error(capsys, argv)
    assert "'cvt-99'" in line and "cvt-13, cvt-21, cvt-w24" in line


def test_missing_checkpoint(capsys, tmp_path):
    line = _usage_error(capsys, ["run", "--checkpoint", str(tmp_path / "missing.pth")])
    assert "argument --checkpoint" in line and "missing.pth" in line and "no such file" in line


@pytest.mark.parametrize("argv", [
    ["run", "--batch", "0"],
    ["run", "--image-size", "-224"],
    ["run", "--jobs", "0"],
    ["emit", "--batch", "1,0", "--out", "d"],
    ["build", "--jobs", "x"],
    ["bench", "--image-size", "224,0"],
    ["plot", "--batch", "-1", "--profile", "pyproject.toml", "--out", "d"],
])
def test_non_positive_integers(capsys, argv):
    line = _usage_error(capsys, argv)
    assert "expected a positive integer" in line


def test_plot_missing_files(capsys, tmp_path):
    line = _usage_error(capsys, ["plot", "--profile", "missing.csv", "--out", str(tmp_path)])
    assert "argument --profile" in line and "'missing.csv'" in line and "no such file" in line
    profile = tmp_path / "p.csv"
    profile.write_text("")
    line = _usage_error(capsys, ["plot", "--profile", str(profile), "--ceilings", "nope.csv", "--out", "d"])
    assert "argument --ceilings" in line and "'nope.csv'" in line


def test_plot_names_what_it_cannot_draw(capsys, tmp_path):
    """CSVs plot cannot draw (a backward or conv profile, a model bench without --op model, bytes
    that are not text, a ceilings file of another schema) and batches or models with no rows: one
    `error:` line, status 2, no PNG, no traceback."""
    from pathlib import Path

    prof = Path(__file__).resolve().parent.parent / "profiles"
    junk = tmp_path / "junk.csv"
    junk.write_bytes(bytes(range(256)))
    cases = [(["--profile", str(prof / "linear_bwd_cvt13_h200.csv")], "no profile rows of a forward Linear"),
             (["--profile", str(prof / "conv2d_cvt13_h200.csv")], "not a forward Linear profile"),
             (["--profile", str(prof / "linear_cvt13_h200.csv"), "--op", "model"], "not a `cvt-cutlass bench"),
             (["--profile", str(junk)], "not a text CSV"),
             (["--profile", str(prof / "linear_cvt13_h200.csv"), "--ceilings", str(prof / "train_bench_h200.csv")],
              "not a ceilings CSV"),
             (["--profile", str(prof / "linear_cvt13_h200.csv"), "--batch", "7"], "no rows of cvt-13's layers at batch 7")]
    for argv, said in cases:
        assert main(["plot", *argv, "--out", str(tmp_path / "png")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("cvt-cutlass plot: error:") and said in err and err.count("\n") == 1, err
    assert not list((tmp_path / "png").glob("*.png"))


def test_emit_out_must_be_a_directory(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out in (str(afile), "", " "):
        assert main(["emit", "--op", "layernorm", "--out", out]) == 2
        err = capsys.readouterr().err
        assert err.startswith("cvt-cutlass emit: error: --out") and "directory" in err and err.count("\n") == 1


def test_bench_providers(capsys):
    from cvt_cutlass.tools.bench.model import PROVIDERS

    line = _usage_error(capsys, ["bench", "--op", "model", "--providers", "hf,eager"])
    assert "unknown provider 'eager'" in line and all(p in line for p in PROVIDERS)
    line = _usage_error(capsys, ["bench", "--op", "linear", "--image-size", "224,384"])
    assert "--image-size" in line and "--op model" in line


def test_model_bench_ratios_say_when_the_peer_was_not_run():
    """A provider subset without hf / compile: the ratio columns say so (no 'nanx')."""
    import math

    from cvt_cutlass.tools.bench.model import _ratio, _x

    assert _ratio(4.0, 2.0) == "2.000" and _x(_ratio(4.0, 2.0)) == "2.000x"
    assert _ratio(math.nan, 2.0) == "" and _x("") == "- (peer not run)"


def test_errors_import_no_torch():
    """Bad arguments are refused before anything heavy is imported."""
    code = ("import sys\nfrom cvt_cutlass.cli import main\n"
            "for argv in (['emit', '--epilogue', 'relu', '--out', 'd'], ['run', '--model', 'x'],\n"
            "             ['run', '--checkpoint', 'missing.pth'], ['bench', '--op', 'model', '--providers', 'x']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_good_invocations_parse(tmp_path, capsys):
    out = tmp_path / "kernels"
    assert main(["emit", "--arch", "89,90", "--op", "linear", "--epilogue", "bias", "--dtype", "fp16",
                 "--model", "CvT-13", "--out", str(out)]) == 0
    cu = sorted(out.glob("*.cu"))
    assert any("_sm89_" in p.name for p in cu) and any("_sm90" in p.name for p in cu)
    assert all("_bias_" in p.name and "bf16" not in p.name for p in cu)
    assert set(capsys.readouterr().out.split()) == {str(p) for p in cu}


def _fail_with(exc_factory):
    def cmd(a):
        exc_factory()

    return cmd


def test_dispatch_user_errors_are_one_line(monkeypatch, capsys, tmp_path):
    """ValueErrors raised by our own validation and missing input files: `<prog>: error:`, status 2."""
    from cvt_cutlass.cli import commands
    from cvt_cutlass.models import get_config

    monkeypatch.setattr(commands, "cmd_emit", _fail_with(lambda: get_config("cvt-99")))
    assert main(["emit", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cvt-cutlass emit: error: unknown CvT config 'cvt-99'") and err.count("\n") == 1

    monkeypatch.setattr(commands, "cmd_emit", _fail_with(lambda: open(tmp_path / "gone.csv")))
    assert main(["emit", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cvt-cutlass emit: error: no such file") and "gone.csv" in err


def test_build_errors_are_their_message_and_status_1(monkeypatch, capsys):
    """No nvcc, or a device that cannot run the asked kernels: `<prog>: error: <message>`, no traceback."""
    monkeypatch.setenv("CVT_CUTLASS_NVCC", "/nonexistent/nvcc")
    assert main(["build", "--op", "layernorm", "--arch", "90", "--dtype", "fp16"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cvt-cutlass build: error:") and "nvcc" in err and "Traceback" not in err
    monkeypatch.delenv("CVT_CUTLASS_NVCC")
    assert main(["build", "--op", "layernorm", "--device-cc", "89"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cvt-cutlass build: error:") and "compute capability" in err and "Traceback" not in err


@pytest.mark.parametrize("exc", [lambda: int("x"), lambda: [][1], lambda: {}["k"]])
def test_dispatch_keeps_tracebacks_of_bugs(monkeypatch, tmp_path, exc):
    """A ValueError not raised by cvt_cutlass, or any other exception, is not swallowed."""
    from cvt_cutlass.cli import commands

    monkeypatch.setattr(commands, "cmd_emit", _fail_with(exc))
    with pytest.raises((ValueError, IndexError, KeyError)):
        main(["emit", "--out", str(tmp_path)])


def test_plot_model_bench_without_rows(capsys, tmp_path):
    """A real ValueError of our own code (plots: the CSV has no rows) is one line too."""
    pytest.importorskip("matplotlib")
    empty = tmp_path / "bench.csv"
    empty.write_text("model,dtype,batch\n")
    assert main(["plot", "--op", "model", "--profile", str(empty), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cvt-cutlass plot: error:") and "bench.csv has no rows" in err


def test_bench_pass(capsys):
    line = _usage_error(capsys, ["bench", "--op", "linear", "--pass", "fwd,back"])
    assert "--pass" in line and "'back'" in line and "fwd+bwd" in line
    line = _usage_error(capsys, ["bench", "--op", "host", "--pass", "bwd"])
    assert "--pass" in line and "--op host" in line and "dwconv" in line


def test_profile_pass(capsys):
    line = _usage_error(capsys, ["profile", "--op", "conv2d", "--pass", "train", "--out", "x.csv"])
    assert "--pass" in line and "--op conv2d sweeps fwd, dgrad, wgrad, not train" in line
    line = _usage_error(capsys, ["profile", "--op", "dwconv", "--pass", "dgrad", "--out", "x.csv"])
    assert "--op dwconv sweeps fwd, train, not dgrad" in line
    line = _usage_error(capsys, ["profile", "--pass", "bwd", "--out", "x.csv"])
    assert "bwd" in line and "dgrad" in line and "wgrad" in line and "--op linear" in line
    line = _usage_error(capsys, ["profile", "--op", "layernorm", "--pass", "bwd", "--out", "x.csv"])
    assert "--op layernorm sweeps fwd, not bwd" in line
    line = _usage_error(capsys, ["profile", "--op", "attention", "--pass", "fwd,bwd", "--out", "x.csv"])
    assert "one at a time" in line
    line = _usage_error(capsys, ["profile", "--pass", "back", "--out", "x.csv"])
    assert "'back'" in line
