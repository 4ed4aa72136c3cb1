"""argparse types and help formatting of ``cvt-cutlass``: every bad value is one ``error:`` line
naming it and the valid choices (nothing heavy is imported to check one)."""

from __future__ import annotations

import argparse
from pathlib import Path

TABLE_TOLERANCE = 0.05  # the packaged tables: kernels within 5% of each problem's fastest


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; "(default: X)" after each option's help, unless the help says its
    default itself or there is none to show (None, False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return text
        shown = ",".join(map(str, action.default)) if isinstance(action.default, list) else action.default
        return f"{text} (default: {shown})".lstrip()


def choice(what: str, kind, choices):
    """One ``kind`` value out of ``choices`` (a sequence, or a function returning one, so that
    the choices' module is imported only when the option is parsed)."""

    def parse(s: str):
        valid = list(choices() if callable(choices) else choices)
        try:
            v = kind(s)
        except ValueError:
            v = None
        if v not in valid:
            raise argparse.ArgumentTypeError(f"unknown {what} {s!r}; choose from {', '.join(map(str, valid))}")
        return v

    return parse


def csv(item):
    """A comma-separated list, each value parsed by ``item``."""

    def parse(s: str) -> list:
        values = [item(v.strip()) for v in s.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"empty list {s!r}; expected comma-separated values")
        return values

    return parse


def csv_choices(what: str, kind, choices):
    return csv(choice(what, kind, choices))


def number(kind, ok, expected: str):
    """An argparse type: ``kind(s)`` (int or float) where ``ok`` accepts it; otherwise the error
    says what was ``expected``."""
    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            v = None
        if v is None or not ok(v):
            raise argparse.ArgumentTypeError(f"invalid value {s!r}; expected {expected}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


fraction = number(float, lambda v: 0 <= v < 1, "a number in [0, 1)")
positive_int = number(int, lambda v: v > 0, "a positive integer")
positive_float = number(float, lambda v: v > 0, "a number > 0")
nonnegative_int = number(int, lambda v: v >= 0, "an integer >= 0")


def model_names() -> list[str]:
    from ..models import CONFIGS

    return sorted(CONFIGS)


def epilogue_names() -> list[str]:
    """The forward's fused epilogues, then the dgrad pass's that the forward has not."""
    from ..epilogues import DGRAD_EPILOGUES, LINEAR_EPILOGUES

    return list(dict.fromkeys([*LINEAR_EPILOGUES, *DGRAD_EPILOGUES]))


model = choice("model", str.lower, model_names)  # case-insensitive, like models.get_config
config = choice("config", str.lower, model_names)


def input_file(s: str) -> str:
    if not Path(s).is_file():
        raise argparse.ArgumentTypeError(f"{'not a file' if Path(s).exists() else 'no such file'}: {s!r}")
    return s


def checkpoint(s: str) -> str:
    """What ``load_cvt`` reads: an existing path (or a config name, for random weights)."""
    if Path(s).exists() or s.lower() in model_names():
        return s
    raise argparse.ArgumentTypeError(f"no such file or directory: {s!r} (expected a local HF directory, "
                                     ".safetensors, or original CvT .pth/.pt/.bin)")
