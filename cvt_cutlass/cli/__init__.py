"""The ``cvt-cutlass`` command line: the main job (run), training (train), and the kernel
engineer's tools (emit, build, profile, table, plot, bench). ``cvt-cutlass --help`` lists them,
``cvt-cutlass <command> --help`` their arguments with defaults."""

from __future__ import annotations

import argparse
import sys

from .args import TABLE_TOLERANCE, HelpFormatter

__all__ = ["TABLE_TOLERANCE", "main", "parser"]

DESCRIPTION = """CvT (HF CvtForImageClassification) on CUTLASS kernels emitted from Python: run and train
swap a CvT onto the kernels; emit, build, profile, table, plot and bench are the kernel engineer's
tools. Without a GPU, run and train take the CPU reference path (the ops' PyTorch references,
counted as fallbacks)."""


def parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``cvt-cutlass`` parser and its commands' parsers by name."""
    from .. import __version__
    from . import parsers

    ap = argparse.ArgumentParser(prog="cvt-cutlass", description=DESCRIPTION, formatter_class=HelpFormatter)
    ap.add_argument("--version", action="version", version=f"cvt-cutlass {__version__}")
    sub = ap.add_subparsers(dest="cmd", metavar="command", title="commands (cvt-cutlass <command> --help)")
    for add in (parsers.add_run, parsers.add_train, parsers.add_emit_build, parsers.add_profile,
                parsers.add_table_plot, parsers.add_bench):
        add(sub)
    return ap, sub.choices


def main(argv: list[str] | None = None) -> int:
    from . import commands

    ap, commands_by_name = parser()
    a = ap.parse_args(argv)
    if a.cmd is None:  # bare `cvt-cutlass`: what there is to run
        ap.print_help(sys.stderr)
        return 2
    p = commands_by_name[a.cmd]
    if a.cmd == "bench":
        commands.check_bench(a, p)
    if a.cmd == "profile":
        commands.check_profile_passes(a, p)
    return _dispatch(a, p.prog)


def _dispatch(a, prog: str) -> int:
    """Run the command; a missing input file, or a ValueError raised by our own code (bad
    arguments it validates, e.g. models.get_config), is one ``<prog>: error:`` line and status 2;
    a build that cannot run or fails (cvt_cutlass.build.BuildError: no nvcc, a device that cannot
    run the asked kernels, nvcc's failures with their logs) is its message and status 1. Anything
    else keeps its traceback."""
    from ..build import BuildError

    try:
        return a.fn(a)
    except BuildError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        msg = f"no such file or directory: {e.filename!r}" if e.filename else str(e)
    except ValueError as e:
        if not _raised_by_us(e):
            raise
        msg = str(e)
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return 2


def _raised_by_us(e: BaseException) -> bool:
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("cvt_cutlass.")
