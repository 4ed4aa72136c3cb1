"""A process-wide on / off setting that code sets, or an environment variable decides."""

from __future__ import annotations

import contextlib
import os


class Switch:
    """``switch()`` is the value given to ``switch.set(value)``; after ``set(None)`` (the start) it
    is the environment variable ``env`` (unset: on), off for "0", "false" or "False"."""

    def __init__(self, env: str):
        self.env = env
        self.value: bool | None = None

    def set(self, value: bool | None) -> None:
        self.value = value

    def __call__(self) -> bool:
        if self.value is not None:
            return self.value
        return os.environ.get(self.env, "1") not in ("0", "false", "False")

    @contextlib.contextmanager
    def using(self, value: bool | None):
        """``set(value)`` inside the block, the setting before it restored after."""
        was = self.value
        self.value = value
        try:
            yield
        finally:
            self.value = was
